"""Files and directories: sorting, creating, finding and de-duplicating files."""

from __future__ import annotations

import random
import shlex

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.checks import sha256, tree_unchanged_test
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES




def _text(rng: random.Random, lines: int, width: tuple[int, int] = (2, 8)) -> str:
    return "".join(" ".join(rng.choice(NOUNS) for _ in range(rng.randint(*width))) + "\n"
                   for _ in range(lines))


_EXTENSIONS = ("txt", "csv", "json", "md", "log", "py", "yaml", "ini", "html")


def _content_for(rng: random.Random, ext: str) -> str:
    word = rng.choice(NOUNS)
    return {
        "csv": f"name,{word}\n{rng.choice(NAMES)},{rng.randint(1, 999)}\n",
        "json": f'{{"{word}": {rng.randint(1, 999)}}}\n',
        "py": f"print({word!r})\n",
        "yaml": f"{word}: {rng.randint(1, 99)}\n",
        "ini": f"[{word}]\nvalue = {rng.randint(1, 99)}\n",
        "html": f"<p>{word}</p>\n",
        "log": f"2024-05-{rng.randint(1, 28):02d} INFO {rng.choice(SERVICES)}: {word}\n",
    }.get(ext, _text(rng, rng.randint(1, 4)))


@family("sort-files-by-extension", skill="files", split="train")
def sort_files_by_extension(rng: random.Random) -> Instance:
    """The files of a folder moved into per-extension sub-folders of another folder."""
    src = rng.choice(("inbox", "incoming", "downloads", "drop", "unsorted"))
    dest = rng.choice(("sorted", "by_type", "organized", "filed"))
    exts = rng.sample(_EXTENSIONS, rng.randint(3, 5))
    names: dict[str, str] = {}
    count = rng.randint(8, 14)
    while len(names) < count or len({n.rsplit(".", 1)[1] for n in names}) < 3:
        ext = rng.choice(exts)
        stem = rng.choice(NOUNS)
        if rng.random() < 0.3:  # a dotted stem: only the last dot counts
            stem += "." + rng.choice(("old", "v2", "final", "bak"))
        elif rng.random() < 0.4:
            stem += f"_{rng.randint(1, 99)}"
        name = f"{stem}.{ext}"
        if name not in names:
            names[name] = _content_for(rng, ext)
    files = {f"{src}/{n}": c for n, c in names.items()}
    expected = {f"{dest}/{n.rsplit('.', 1)[1]}/{n}": sha256(c) for n, c in names.items()}
    example = next(iter(sorted(names)))
    ex_dest = f"/app/{dest}/{example.rsplit('.', 1)[1]}/{example}"
    instruction = rng.choice((
        f"Sort the files in /app/{src} into folders by extension: move each file to "
        f"/app/{dest}/<ext>/<file name>, where <ext> is the part of the name after its last "
        f"dot (so /app/{src}/{example} ends up as {ex_dest}). Afterwards no files may remain "
        f"in /app/{src}; keep every file's name and contents.",
        f"Tidy up /app/{src}: every file there must be moved (not copied) into a "
        f"sub-folder of /app/{dest} named after its extension, the text after the last "
        f"`.` of its name. For example {example} goes to {ex_dest}. Keep names and contents "
        f"as they are.",
        f"I want the files of /app/{src} grouped by type. Create /app/{dest}/<extension>/ "
        f"folders (extension = what follows the last dot of the name) and move each file "
        f"into the right one, unchanged and under its own name, e.g. {ex_dest}. /app/{src} "
        f"must end up with no files in it.",
    ))
    tests = f'''"""sort-files-by-extension: {len(names)} files of {src} into {dest}/<ext>/."""
import hashlib
import os
from pathlib import Path

EXPECTED = {expected!r}


def files_under(top):
    out = {{}}
    for dirpath, _dirs, names in os.walk(top):
        for n in names:
            p = Path(dirpath) / n
            out[str(p.relative_to("/app"))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_files_sorted_by_extension():
    assert files_under("/app/{dest}") == EXPECTED


def test_source_has_no_files_left():
    assert files_under("/app/{src}") == {{}}
'''
    solution = (f'for f in {src}/*; do ext="${{f##*.}}"; mkdir -p "{dest}/$ext"; '
                f'mv "$f" "{dest}/$ext/"; done\n')
    return Instance(instruction, files, solution, tests, difficulty="medium",
                    tags=("files", "mv", "loops"))


_DIR_POOL = ("src", "docs", "tests", "config", "scripts", "data/raw", "data/clean",
             "assets/images", "assets/fonts", "build", "logs", "lib/vendor", "src/core",
             "src/utils", "docs/api")
_FILE_NAMES = ("README.md", "notes.txt", "VERSION", "settings.ini", "main.py",
               "index.md", ".gitkeep", "todo.txt", "LICENSE")


@family("make-directory-tree", skill="files", split="train")
def make_directory_tree(rng: random.Random) -> Instance:
    """A project skeleton: given directories (some empty) and files with given contents."""
    root = f"{rng.choice(NOUNS)}-{rng.choice(('app', 'service', 'tool', 'site', 'lib'))}"
    dirs = sorted(rng.sample(_DIR_POOL, rng.randint(3, 5)))
    places = ["", *dirs]
    files: dict[str, str] = {}
    for name in rng.sample(_FILE_NAMES, rng.randint(2, 4)):
        where = rng.choice(places)
        line = rng.choice((f"{rng.choice(NOUNS)} {rng.choice(NOUNS)}",
                           f"version {rng.randint(0, 9)}.{rng.randint(0, 20)}",
                           f"owner {rng.choice(NAMES)}", f"# {root}"))
        files[f"{where}/{name}".lstrip("/")] = line
    empty = [d for d in dirs if not any(f.startswith(d + "/") for f in files)]
    if not empty:  # at least one directory must exist without any file in it
        extra = rng.choice([d for d in _DIR_POOL if d not in dirs])
        dirs = sorted([*dirs, extra])
        empty = [extra]
    items = [f"- directory /app/{root}/{d}/" for d in dirs]
    items += [f"- file /app/{root}/{f} containing exactly one line: `{line}`"
              for f, line in sorted(files.items())]
    rng.shuffle(items)
    listing = "\n".join(items)
    instruction = rng.choice((
        f"Create this layout for a new project under /app/{root} (create parent "
        f"directories as needed):\n{listing}",
        f"Set up the skeleton of /app/{root}. It needs the following directories and "
        f"files, and nothing else matters:\n{listing}",
        f"Build the directory tree below (directories may be empty; each file holds the "
        f"single line shown, followed by a newline):\n{listing}",
    ))
    all_dirs = sorted({"/".join(p.split("/")[:i + 1]) for p in dirs
                       for i in range(p.count("/") + 1)})
    tests = f'''"""make-directory-tree: the skeleton of {root}."""
from pathlib import Path

ROOT = Path("/app/{root}")
DIRS = {all_dirs!r}
FILES = {dict(sorted(files.items()))!r}


def test_directories_exist():
    for d in DIRS:
        assert (ROOT / d).is_dir(), f"missing directory {{d}}"


def test_files_have_their_line():
    for f, line in FILES.items():
        p = ROOT / f
        assert p.is_file(), f"missing file {{f}}"
        assert p.read_text().rstrip("\\n") == line, f
'''
    solution = f"mkdir -p {' '.join(shlex.quote(f'{root}/{d}') for d in dirs)}\n"
    solution += "".join(f"printf '%s\\n' {shlex.quote(line)} > {shlex.quote(f'{root}/{f}')}\n"
                        for f, line in files.items())
    return Instance(instruction, {}, solution, tests, tags=("files", "mkdir"))


@family("copy-largest-file", skill="files", split="heldout")
def copy_largest_file(rng: random.Random) -> Instance:
    """The largest file (in bytes) of a directory tree, copied to a given place."""
    top = rng.choice(("data", "archive", "storage", "share", "projects"))
    subdirs = ["", *rng.sample(("2023", "2024", "old", "misc", "reports", "raw",
                                "a/b", "a/c", "backup/x"), rng.randint(2, 4))]
    files: dict[str, str] = {}
    count = rng.randint(8, 16)
    while len(files) < count:
        d = rng.choice(subdirs)
        name = f"{rng.choice(NOUNS)}{rng.choice(('.txt', '.dat', '.csv', '', '.log'))}"
        files[f"{top}/{d}/{name}".replace("//", "/")] = _text(rng, rng.randint(2, 20))
    paths = list(files)
    # A decoy with the most lines but short ones, then the largest: few long lines.
    decoy, big = rng.sample(paths, 2)
    files[decoy] = "".join(rng.choice(NOUNS) + "\n" for _ in range(60))
    limit = max(len(c) for p, c in files.items() if p != big)
    long_lines = _text(rng, rng.randint(3, 6), (30, 60))
    while len(long_lines) <= limit:
        long_lines += _text(rng, 1, (30, 60))
    files[big] = long_lines
    assert max(files, key=lambda p: len(files[p])) == big
    base = big.rsplit("/", 1)[1]
    if rng.random() < 0.5:
        out_dir = rng.choice(("largest", "biggest", "out"))
        out = f"{out_dir}/{base}"
        where = (f"into the directory /app/{out_dir}/ (create it), keeping its file name")
        solution_cp = f'mkdir -p {out_dir}\ncp "$f" {out_dir}/\n'
    else:
        out = rng.choice(("largest_file", "biggest.out", "largest.copy"))
        where = f"to /app/{out}"
        solution_cp = f'cp "$f" {out}\n'
    instruction = rng.choice((
        f"Find the largest file (by size in bytes) anywhere under /app/{top} and copy it "
        f"{where}. The original files must stay where they are, unchanged.",
        f"Which file under /app/{top} (including its subdirectories) takes the most bytes? "
        f"Copy it {where}; do not move or modify anything in /app/{top}.",
        f"Copy the biggest file of the directory tree /app/{top} {where}. Size means the "
        f"number of bytes; leave /app/{top} as it is.",
    ))
    expected = {p: sha256(c) for p, c in files.items()}
    tests = f'''"""copy-largest-file: {big} copied to {out}."""
import hashlib
import os
from pathlib import Path

ORIGINALS = {expected!r}


def test_largest_copied():
    data = Path("/app/{out}").read_bytes()
    assert hashlib.sha256(data).hexdigest() == {sha256(files[big])!r}


{tree_unchanged_test("test_tree_untouched", top)}'''
    solution = (f"f=$(find {top} -type f -printf '%s %p\\n' | sort -n | tail -n 1 "
                f"| cut -d' ' -f2-)\n" + solution_cp)
    return Instance(instruction, files, solution, tests, tags=("files", "find", "size"))


@family("remove-duplicate-files", skill="files", split="heldout")
def remove_duplicate_files(rng: random.Random) -> Instance:
    """Files with identical contents de-duplicated, keeping the alphabetically first."""
    top = rng.choice(("photos", "uploads", "documents", "backups", "attachments"))
    ext = rng.choice((".txt", ".dat", ".md", ".bin"))
    pool = rng.sample(NOUNS, len(NOUNS))
    names: list[str] = []
    for i in range(0, len(pool) - 1, 2):
        names.append(f"{pool[i]}_{pool[i + 1]}{ext}")
    rng.shuffle(names)
    names = names[:rng.randint(10, 15)]
    files: dict[str, str] = {}
    groups: list[list[str]] = []
    rest = list(names)
    for _ in range(rng.randint(2, 3)):  # groups of identical files: distinct first letters
        size = rng.randint(2, 3)
        group: list[str] = []
        for n in list(rest):
            if len(group) < size and all(n[0] != g[0] for g in group):
                group.append(n)
                rest.remove(n)
        groups.append(group)
        content = _text(rng, rng.randint(2, 6))
        for n in group:
            files[n] = content
    for n in rest:
        files[n] = _text(rng, rng.randint(2, 6))
    assert all(len(g) >= 2 for g in groups)
    assert len(set(files.values())) == len(groups) + len(rest)
    keep = sorted(rest + [min(g) for g in groups])
    instruction = rng.choice((
        f"Some files in /app/{top} are exact duplicates of each other (same contents). "
        f"For every set of identical files keep only the one whose name comes first in "
        f"alphabetical order and delete the others. Files that have no duplicate stay.",
        f"De-duplicate /app/{top}: whenever several files there have byte-for-byte the "
        f"same contents, remove all of them except the alphabetically first name. Do not "
        f"change any file you keep.",
        f"/app/{top} holds repeated copies of some files under different names. Delete "
        f"the redundant copies so that each distinct content is left exactly once, in "
        f"the file with the alphabetically smallest name of its group.",
    ))
    kept = {n: sha256(files[n]) for n in keep}
    tests = f'''"""remove-duplicate-files: {len(files) - len(keep)} duplicates removed from {top}."""
import hashlib
from pathlib import Path

KEPT = {kept!r}


def test_only_first_of_each_group_left():
    found = {{p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in Path("/app/{top}").iterdir() if p.is_file()}}
    assert sorted(found) == sorted(KEPT)
    assert found == KEPT
'''
    solution = (f"cd {top}\ndeclare -A seen\n"
                "for f in $(LC_ALL=C ls); do\n"
                "  h=$(sha256sum \"$f\" | cut -d' ' -f1)\n"
                "  if [ -n \"${seen[$h]}\" ]; then rm -- \"$f\"; else seen[$h]=1; fi\n"
                "done\n")
    return Instance(instruction, {f"{top}/{n}": c for n, c in files.items()}, solution,
                    tests, difficulty="medium", tags=("files", "checksum", "dedupe"))
