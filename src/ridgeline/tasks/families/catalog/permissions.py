"""Permissions: making scripts executable, making files private, auditing modes."""

from __future__ import annotations

import random

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.checks import sha256
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES




def _line(rng: random.Random) -> str:
    return " ".join(rng.choice(NOUNS) for _ in range(rng.randint(2, 7)))


_MODES_TEST = '''

def mode(rel):
    return stat.S_IMODE(os.stat(f"/app/{rel}").st_mode)


def test_contents_unchanged():
    for rel, digest in CONTENTS.items():
        assert hashlib.sha256(Path(f"/app/{rel}").read_bytes()).hexdigest() == digest, rel
'''


@family("make-scripts-executable", skill="permissions", split="train")
def make_scripts_executable(rng: random.Random) -> Instance:
    """The shell scripts of one folder made executable for everyone; nothing else."""
    d = rng.choice(("scripts", "bin", "tools", "ops", "hooks"))
    nested = rng.random() < 0.5
    subdirs = [""] + (rng.sample(("deploy", "ci", "db", "util"), rng.randint(1, 2))
                      if nested else [])
    files: dict[str, str] = {}
    scripts: list[str] = []
    for name in rng.sample(NOUNS, rng.randint(3, 6)):
        p = f"{d}/{rng.choice(subdirs)}/{name}.sh".replace("//", "/")
        files[p] = f"#!/bin/sh\necho {rng.choice(('running', 'starting', 'done'))} {name}\n"
        scripts.append(p)
    for name in rng.sample(("README.md", "notes.txt", "config.ini", "hosts.conf",
                            "LICENSE", "usage.txt"), rng.randint(1, 3)):
        files[f"{d}/{rng.choice(subdirs)}/{name}".replace("//", "/")] = _line(rng) + "\n"
    # A script outside the folder must stay as it is.
    outside = f"{rng.choice(('templates', 'examples', 'archive'))}/{rng.choice(NOUNS)}.sh"
    files[outside] = "#!/bin/sh\necho example\n"
    # Scripts are readable by all (a script needs read to run); others vary.
    modes = {p: rng.choice((0o644, 0o644, 0o664) if p in scripts else
                           (0o644, 0o640, 0o664, 0o600)) for p in files}
    where = (f"in /app/{d} and all of its subdirectories" if nested else f"in /app/{d}")
    instruction = rng.choice((
        f"Make every `.sh` file {where} executable by its owner, its group and everyone "
        f"else, keeping their other permission bits. Other files must stay as they are "
        f"(non-executable), and nothing outside /app/{d} may change.",
        f"The shell scripts (names ending in `.sh`) {where} cannot be run yet. Add "
        f"execute permission for user, group and others to them (their read and write "
        f"bits stay as they are), without touching the other files or any file outside "
        f"/app/{d}.",
        f"Allow anyone to execute the `*.sh` files {where}. Keep all other permissions as "
        f"they are, leave non-script files non-executable and do not change anything "
        f"outside /app/{d}.",
    ))
    expected = {p: (m | 0o111 if p in scripts else m) for p, m in modes.items()}
    tests = f'''"""make-scripts-executable: {len(scripts)} scripts in {d} executable for all."""
import hashlib
import os
import stat
from pathlib import Path

EXPECTED = {{k: int(v, 8) for k, v in {({p: oct(m) for p, m in expected.items()})!r}.items()}}
CONTENTS = {({p: sha256(c) for p, c in files.items()})!r}
SCRIPTS = {sorted(scripts)!r}
''' + _MODES_TEST + '''

def test_scripts_executable_by_all():
    for rel in SCRIPTS:
        assert mode(rel) & 0o111 == 0o111, rel
        assert mode(rel) & 0o222 == EXPECTED[rel] & 0o222, f"{rel}: write bits changed"


def test_other_modes_unchanged():
    others = {rel: oct(m) for rel, m in EXPECTED.items() if rel not in SCRIPTS}
    assert {rel: oct(mode(rel)) for rel in others} == others
'''
    solution = f"find {d} -type f -name '*.sh' -exec chmod a+x {{}} +\n"
    return Instance(instruction, files, solution, tests, modes=modes,
                    tags=("permissions", "chmod"))


_PRIVATE_MODES = (0o644, 0o664, 0o666, 0o755, 0o640, 0o604, 0o775, 0o660, 0o744)


@family("make-files-private", skill="permissions", split="heldout")
def make_files_private(rng: random.Random) -> Instance:
    """Group and other permissions removed from every file of a folder, owner's kept."""
    d = rng.choice(("secrets", "private", "keys", "personal", "credentials"))
    files: dict[str, str] = {}
    for _ in range(rng.randint(4, 9)):
        sub = rng.choice(("", "", rng.choice(NAMES)))
        name = rng.choice((f"{rng.choice(SERVICES)}.key", f"{rng.choice(NOUNS)}.txt",
                           f"{rng.choice(SERVICES)}.env", f"{rng.choice(NOUNS)}.pem",
                           f"run_{rng.choice(NOUNS)}.sh"))
        files[f"{d}/{sub}/{name}".replace("//", "/")] = _line(rng) + "\n"
    public = f"{rng.choice(('public', 'www', 'shared'))}/{rng.choice(NOUNS)}.txt"
    files[public] = _line(rng) + "\n"
    modes = {p: rng.choice(_PRIVATE_MODES) for p in files}
    modes[public] = 0o644
    expected = {p: (m & 0o700 if p != public else m) for p, m in modes.items()}
    instruction = rng.choice((
        f"Lock down /app/{d}: every file in it (subdirectories included) must give no "
        f"permissions at all to its group and to others, while the owner keeps exactly "
        f"the permissions it has now. Do not change files outside /app/{d}.",
        f"Nobody but the owner should be able to read, write or execute the files under "
        f"/app/{d}. Remove all group and other permission bits from them and keep the "
        f"owner's bits unchanged (an executable stays executable for its owner).",
        f"Make the files of /app/{d} (recursively) private: clear the group and others "
        f"permissions, leave the owner's read/write/execute bits as they are, and leave "
        f"/app/{public.split('/')[0]} alone.",
    ))
    tests = f'''"""make-files-private: the files of {d} owner-only."""
import hashlib
import os
import stat
from pathlib import Path

EXPECTED = {{k: int(v, 8) for k, v in {({p: oct(m) for p, m in expected.items()})!r}.items()}}
CONTENTS = {({p: sha256(c) for p, c in files.items()})!r}
''' + _MODES_TEST + '''

def test_modes():
    assert {rel: oct(mode(rel)) for rel in EXPECTED} == {rel: oct(m) for rel, m in EXPECTED.items()}
'''
    solution = f"find {d} -type f -exec chmod go-rwx {{}} +\n"
    return Instance(instruction, files, solution, tests, modes=modes,
                    tags=("permissions", "chmod", "privacy"))


_WW_MODES = (0o666, 0o777, 0o646, 0o757, 0o662)
_SAFE_MODES = (0o644, 0o664, 0o755, 0o600, 0o640, 0o775)


@family("find-world-writable", skill="permissions", split="heldout")
def find_world_writable(rng: random.Random) -> Instance:
    """World-writable files of a tree listed in a file, then their other-write bit removed."""
    d = rng.choice(("shared", "srv", "uploads", "webroot", "exports"))
    files: dict[str, str] = {}
    count = rng.randint(7, 14)
    while len(files) < count:
        sub = rng.choice(("", "", "cache", "tmp", "static", "data/in", "data/out"))
        name = f"{rng.choice(NOUNS)}.{rng.choice(('txt', 'log', 'html', 'css', 'db', 'sh'))}"
        files[f"{d}/{sub}/{name}".replace("//", "/")] = _line(rng) + "\n"
    paths = sorted(files)
    bad = set(rng.sample(paths, rng.randint(2, max(2, len(paths) // 3))))
    modes = {p: rng.choice(_WW_MODES if p in bad else _SAFE_MODES) for p in paths}
    out = rng.choice(("world_writable.txt", "audit.txt", "writable.txt", "report.txt"))
    expected = {p: m & ~0o002 for p, m in modes.items()}
    instruction = rng.choice((
        f"Audit /app/{d}: write the absolute path of every file under it that anyone (the "
        f"'other' class) can write to /app/{out}, one per line, in any order. Then take "
        f"away that write permission from others on those files, changing nothing else.",
        f"Some files in /app/{d} (any depth) are world-writable. List them in /app/{out} "
        f"(one absolute path per line, e.g. /app/{paths[0]}, any order) and then fix them "
        f"by removing only the write bit for others; every other permission bit stays.",
        f"Find the files below /app/{d} whose permissions let others (not owner, not "
        f"group) write them. Record their absolute paths, one per line, in /app/{out}; "
        f"afterwards make them no longer writable by others, keeping all other bits.",
    ))
    tests = f'''"""find-world-writable: {len(bad)} world-writable files of {d}."""
import hashlib
import os
import stat
from pathlib import Path

EXPECTED = {{k: int(v, 8) for k, v in {({p: oct(m) for p, m in expected.items()})!r}.items()}}
CONTENTS = {({p: sha256(c) for p, c in files.items()})!r}
LISTED = {sorted(f"/app/{p}" for p in bad)!r}
''' + _MODES_TEST + f'''

def test_listed():
    lines = [ln.strip() for ln in Path("/app/{out}").read_text().splitlines() if ln.strip()]
    assert sorted(lines) == LISTED
''' + '''

def test_modes():
    assert {rel: oct(mode(rel)) for rel in EXPECTED} == {rel: oct(m) for rel, m in EXPECTED.items()}
'''
    solution = (f"find /app/{d} -type f -perm -0002 > /app/{out}\n"
                f"find /app/{d} -type f -perm -0002 -exec chmod o-w {{}} +\n")
    return Instance(instruction, files, solution, tests, modes=modes, difficulty="medium",
                    tags=("permissions", "find", "audit"))
