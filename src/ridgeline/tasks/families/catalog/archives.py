"""Archives: packing directories and reading or extracting compressed tarballs."""

from __future__ import annotations

import gzip
import io
import random
import tarfile

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.checks import sha256, tree_unchanged_test
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES




def _line(rng: random.Random) -> str:
    return " ".join(rng.choice(NOUNS) for _ in range(rng.randint(2, 8)))


_SUBDIRS = ("docs", "src", "config", "data", "assets", "notes", "reports", "src/lib",
            "data/2024", "docs/guide")
_NAMES = ("readme.md", "index.html", "main.py", "settings.ini", "users.csv", "notes.txt",
          "schema.json", "changelog.md", "app.conf", "todo.txt", "report.txt", "map.json")


def _tree(rng: random.Random, top: str, n: tuple[int, int]) -> dict[str, str]:
    """`top`/... files (paths relative to the workspace) with small text contents."""
    pool = [d for d in _SUBDIRS if d.split("/")[0] != top]  # no top/top/...
    dirs = ["", *rng.sample(pool, rng.randint(2, 4))]
    files: dict[str, str] = {}
    count = rng.randint(*n)
    while len(files) < count:
        d = rng.choice(dirs)
        name = rng.choice(_NAMES)
        if rng.random() < 0.4:
            stem, ext = name.rsplit(".", 1)
            name = f"{stem}_{rng.choice(NOUNS)}.{ext}"
        path = f"{top}/{d}/{name}".replace("//", "/")
        files[path] = "".join(_line(rng) + "\n" for _ in range(rng.randint(1, 12)))
    return files


def _targz(files: dict[str, str], with_dirs: bool) -> bytes:
    """A reproducible .tar.gz of `files` (fixed times and owners), with an entry for every
    directory first when `with_dirs` (as the usual tools write one)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        def add(name: str, data: bytes | None) -> None:
            info = tarfile.TarInfo(name)
            info.mtime = 1717200000
            info.uname = info.gname = "app"
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))

        if with_dirs:
            dirs = sorted({"/".join(p.split("/")[:i]) for p in files
                           for i in range(1, p.count("/") + 1)})
            for d in dirs:
                add(d + "/", None)
        for p in sorted(files):
            add(p, files[p].encode())
    return gzip.compress(raw.getvalue(), mtime=0)


@family("pack-directory", skill="archives", split="train")
def pack_directory(rng: random.Random) -> Instance:
    """A directory packed into a gzip-compressed tarball (sometimes leaving a type out)."""
    top = rng.choice(("project", "website", "docs", "notes", "config", "reports"))
    files = _tree(rng, top, (4, 9))
    exclude = None
    if rng.random() < 0.5:  # a variant with scratch files to leave out
        exclude = rng.choice((".tmp", ".bak", ".swp"))
        for _ in range(rng.randint(1, 3)):
            d = rng.choice(sorted({p.rsplit("/", 1)[0] for p in files}))
            files[f"{d}/{rng.choice(NOUNS)}{exclude}"] = "scratch\n"
    archive = rng.choice((f"{top}.tar.gz", f"{top}-backup.tar.gz", "backup.tar.gz",
                          f"{top}-{rng.randint(2020, 2025)}.tgz"))
    wanted = {p: sha256(c) for p, c in files.items() if not (exclude and p.endswith(exclude))}
    leave_out = (f" Leave out every file whose name ends in `{exclude}`; everything else "
                 f"must be in it." if exclude else "")
    instruction = rng.choice((
        f"Create /app/{archive}, a gzip-compressed tar archive of the directory /app/{top}. "
        f"Paths inside the archive must start with `{top}/` (e.g. `{min(wanted)}`)."
        f"{leave_out}",
        f"Back up /app/{top} as a gzipped tarball named /app/{archive}, so that unpacking it "
        f"in /app would recreate {top}/ with its files (member paths begin with `{top}/`)."
        f"{leave_out} Do not change /app/{top}.",
        f"Pack the whole /app/{top} folder into /app/{archive} (tar format, gzip "
        f"compression), with member names relative to /app such as `{min(wanted)}`."
        f"{leave_out}",
    ))
    originals = {p: sha256(c) for p, c in files.items()}
    tests = f'''"""pack-directory: {top} into {archive}{f' without *{exclude}' if exclude else ''}."""
import hashlib
import os
import tarfile
from pathlib import Path

ARCHIVE = Path("/app/{archive}")
WANTED = {wanted!r}
ORIGINALS = {originals!r}


def test_is_gzip_tar():
    assert ARCHIVE.is_file()
    assert ARCHIVE.read_bytes()[:2] == b"\\x1f\\x8b", "not gzip-compressed"


def test_members_and_contents():
    with tarfile.open(ARCHIVE, "r:gz") as tar:
        found = {{m.name.removeprefix("./"): hashlib.sha256(tar.extractfile(m).read()).hexdigest()
                 for m in tar.getmembers() if m.isfile()}}
    assert found == WANTED


{tree_unchanged_test("test_directory_untouched", top)}'''
    flag = f"--exclude='*{exclude}' " if exclude else ""
    return Instance(instruction, files, f"tar {flag}-czf {archive} {top}\n", tests,
                    difficulty="medium" if exclude else "easy", tags=("archives", "tar"))


@family("extract-one-file", skill="archives", split="heldout")
def extract_one_file(rng: random.Random) -> Instance:
    """One named member of a .tar.gz extracted to a given path, nothing else unpacked."""
    top = rng.choice(("release", "site", "bundle", "snapshot", "export"))
    files = _tree(rng, top, (6, 12))
    member = rng.choice(sorted(files))
    inner = member.split("/", 1)[1]
    archive = rng.choice((f"{top}.tar.gz", f"{top}-{rng.randint(1, 9)}.{rng.randint(0, 9)}.tgz",
                          "archive.tar.gz"))
    base = member.rsplit("/", 1)[1]
    out = rng.choice((f"restored/{base}", f"{base}", f"recovered_{base}", f"out/{base}"))
    blob = _targz(files, with_dirs=True)
    instruction = rng.choice((
        f"/app/{archive} contains a file stored as `{member}`. Get just that file out of "
        f"the archive and save it as /app/{out}. Do not unpack any other file of the "
        f"archive into /app, and keep the archive as it is.",
        f"I only need `{inner}` from the archive /app/{archive} (its path in the archive "
        f"is `{member}`). Put its contents at /app/{out}; nothing else from the archive "
        f"should end up in /app, and the archive must not change.",
        f"Restore /app/{out} from the compressed tarball /app/{archive}: it is the member "
        f"`{member}`. Leave the other members packed (none of them may appear in /app) "
        f"and do not modify the archive.",
    ))
    others = sorted({p.rsplit("/", 1)[1] for p in files} - {base})
    tests = f'''"""extract-one-file: {member} of {archive} to {out}."""
import hashlib
import os
from pathlib import Path


def test_member_extracted():
    data = Path("/app/{out}").read_bytes()
    assert hashlib.sha256(data).hexdigest() == {sha256(files[member])!r}


def test_nothing_else_unpacked():
    assert not Path("/app/{top}").exists(), "/app/{top} was unpacked"
    names = {{n for _d, _s, fs in os.walk("/app") for n in fs}}
    assert not names & set({others!r})


def test_archive_unchanged():
    data = Path("/app/{archive}").read_bytes()
    assert hashlib.sha256(data).hexdigest() == {sha256(blob)!r}
'''
    mkdir = f"mkdir -p {out.rsplit('/', 1)[0]}\n" if "/" in out else ""
    solution = mkdir + f"tar -xzOf {archive} {member} > {out}\n"
    return Instance(instruction, {archive: blob}, solution, tests,
                    tags=("archives", "tar", "extract"))


@family("list-archive-files", skill="archives", split="heldout")
def list_archive_files(rng: random.Random) -> Instance:
    """The paths of the regular files inside a .tar.gz, listed one per line in a file."""
    top = rng.choice(("backup", "logs", "dataset", "photos", rng.choice(SERVICES)))
    files = _tree(rng, top, (5, 14))
    if rng.random() < 0.5:
        files[f"{top}/{rng.choice(NAMES)}.key"] = "secret\n"
    archive = rng.choice((f"{top}.tar.gz", f"{top}_{rng.randint(1, 28):02d}.tgz",
                          "incoming.tar.gz"))
    out = rng.choice(("contents.txt", "manifest.txt", "files.txt", f"{top}-list.txt"))
    blob = _targz(files, with_dirs=True)
    instruction = rng.choice((
        f"Without unpacking it into /app, write the path of every regular file stored in "
        f"the archive /app/{archive} to /app/{out}, one per line, exactly as stored (e.g. "
        f"`{min(files)}`). Leave directories out; the order does not matter.",
        f"Make a manifest of /app/{archive}: /app/{out} must list the files (not the "
        f"directories) it contains, one archive path per line like `{min(files)}`, any "
        f"order. Do not extract the archive into /app.",
        f"What files are packed in /app/{archive}? Save their paths inside the archive, "
        f"one per line (directory entries excluded, any order) in /app/{out}, and leave "
        f"the archive packed and unchanged.",
    ))
    tests = f'''"""list-archive-files: the {len(files)} files of {archive}."""
import hashlib
from pathlib import Path

EXPECTED = {sorted(files)!r}


def test_listing():
    lines = [ln.strip().removeprefix("./") for ln in Path("/app/{out}").read_text().splitlines()
             if ln.strip()]
    assert sorted(lines) == EXPECTED


def test_not_unpacked():
    assert not Path("/app/{top}").exists()


def test_archive_unchanged():
    data = Path("/app/{archive}").read_bytes()
    assert hashlib.sha256(data).hexdigest() == {sha256(blob)!r}
'''
    solution = f"tar -tzf {archive} | grep -v '/$' > {out}\n"
    return Instance(instruction, {archive: blob}, solution, tests,
                    tags=("archives", "tar", "list"))
