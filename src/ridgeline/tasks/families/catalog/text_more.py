"""More text processing (word replacement, e-mail extraction) and counting files."""

from __future__ import annotations

import hashlib
import random
import re

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES

FILLER = ("the", "a", "of", "and", "near", "with", "under", "every", "old", "new", "by")
REPLACEMENTS = ("comet", "prairie", "thistle", "walrus", "zephyr", "tundra", "bramble",
                "citadel", "nimbus", "osprey")


def _digest(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def _prose(rng: random.Random, vocab: list[str], word: str, lines: int) -> str:
    out = []
    for _ in range(lines):
        words = [rng.choice(vocab + list(FILLER)) for _ in range(rng.randint(4, 11))]
        for _ in range(rng.choice((0, 0, 1, 2))):
            words[rng.randrange(len(words))] = word
        text = " ".join(words)
        out.append(text + rng.choice(("", ".", ",", ";")))
    return "\n".join(out) + "\n"


@family("replace-word", skill="text", split="train")
def replace_word(rng: random.Random) -> Instance:
    """One word replaced by another everywhere in a file (or in every file of a folder)."""
    old = rng.choice(NOUNS)
    # Every other word of the text must not contain the old one: whole-word and
    # substring replacement then agree, so the goal has one answer.
    vocab = [w for w in NOUNS if old not in w]
    new = rng.choice(REPLACEMENTS)
    many = rng.random() < 0.4
    if many:
        folder = rng.choice(("docs", "notes", "chapters"))
        ext = rng.choice(("md", "txt"))
        names = [f"{folder}/{n}.{ext}" for n in rng.sample(vocab, rng.randint(2, 4))]
        decoy = f"{folder}/{rng.choice(('index', 'draft', 'todo'))}.{'bak' if ext == 'txt' else 'orig'}"
    else:
        names = [rng.choice(("story.txt", "notes.txt", "README.md", "letter.txt"))]
        decoy = f"{rng.choice(('backup', 'original', 'copy'))}_{names[0]}"
    files = {}
    for n in names:
        text = _prose(rng, vocab, old, rng.randint(4, 12))
        while len(re.findall(rf"\b{old}\b", text)) < 2:
            text = _prose(rng, vocab, old, rng.randint(4, 12))
        files[n] = text
    files[decoy] = _prose(rng, vocab, old, 3) + f"{old} {old}\n"
    expected = {n: files[n].replace(old, new) for n in names}
    if many:
        where = f"every .{ext} file in /app/{folder}"
        instruction = rng.choice((
            f"In {where}, replace each occurrence of the word \"{old}\" with \"{new}\". "
            f"Edit the files in place; files with other extensions must stay as they are.",
            f"The word \"{old}\" should read \"{new}\" throughout the .{ext} files of "
            f"/app/{folder}. Change them all (in place) and leave every other file alone.",
            f"Update the .{ext} documents in /app/{folder} so that \"{old}\" is replaced by "
            f"\"{new}\" everywhere (the files keep their names; other files are not to be "
            f"modified).",
        ))
        solution = f"sed -i 's/{old}/{new}/g' {folder}/*.{ext}\n"
    else:
        where = f"/app/{names[0]}"
        instruction = rng.choice((
            f"Replace every occurrence of the word \"{old}\" in {where} with \"{new}\", "
            f"editing the file in place. Do not touch /app/{decoy}.",
            f"In the file {where}, change all instances of \"{old}\" to \"{new}\" (every "
            f"one of them, wherever it occurs). /app/{decoy} must stay unchanged.",
            f"{where} should say \"{new}\" wherever it now says \"{old}\"; update it in "
            f"place and leave the other files of /app as they are.",
        ))
        solution = f"sed -i 's/{old}/{new}/g' {names[0]}\n"
    tests = f'''"""replace-word: {old} -> {new} in {', '.join(names)}."""
import hashlib
from pathlib import Path

EXPECTED = {expected!r}


def test_replaced():
    for name, text in EXPECTED.items():
        assert Path("/app", name).read_text().rstrip("\\n") == text.rstrip("\\n"), name


def test_other_file_untouched():
    data = Path("/app/{decoy}").read_bytes()
    assert hashlib.sha256(data).hexdigest() == "{_digest(files[decoy])}"
'''
    return Instance(instruction, files, solution, tests,
                    difficulty="medium" if many else "easy", tags=("sed", "replace"))


DOMAINS = ("example.com", "mail.org", "corp.net", "uni.edu", "shop.io", "post.de")


def _collation_safe(addrs: list[str]) -> bool:
    """Every pair first differs at a letter or digit of both (and neither is a prefix of
    the other), so byte order and locale collation agree on the sorted list."""
    for i, a in enumerate(addrs):
        for b in addrs[i + 1:]:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if j is None or not (a[j].isalnum() and b[j].isalnum()):
                return False
    return True


@family("unique-emails", skill="text", split="heldout")
def unique_emails(rng: random.Random) -> Instance:
    """The distinct e-mail addresses found in a text file, sorted, one per line."""
    while True:
        addrs = set()
        for name in rng.sample(NAMES, rng.randint(4, 9)):
            local = name + rng.choice(("", "", f".{rng.choice(NOUNS)}", str(rng.randint(1, 99))))
            addrs.add(f"{local}@{rng.choice(DOMAINS)}")
        addrs = sorted(addrs)
        if _collation_safe(addrs):
            break
    mentions = addrs + rng.choices(addrs, k=rng.randint(3, 10))
    rng.shuffle(mentions)
    templates = (
        "From: {a}", "cc {a}, {b}", "Please write to <{a}> about the {n}.",
        "Forwarded by {a} to {b}.", "The {n} report ({a}) is late", "Contact: {a};",
        "{n} and {m} reviewed by {a}", "reply-to={a}", "ask {a} or {b} about the {n}",
    )
    lines = []
    i = 0
    while i < len(mentions):
        t = rng.choice(templates)
        need = t.count("{a}") + t.count("{b}")
        a, b = (mentions[i:i + 2] + [mentions[i]])[:2]
        i += need
        lines.append(t.format(a=a, b=b, n=rng.choice(NOUNS), m=rng.choice(NOUNS)))
        if rng.random() < 0.4:  # lines with no address, some with look-alikes
            lines.append(rng.choice((
                f"meeting about the {rng.choice(NOUNS)} at 10:30",
                f"thanks @{rng.choice(NAMES)} for the {rng.choice(NOUNS)}",
                f"see {rng.choice(SERVICES)}.example.com/{rng.choice(NOUNS)} for details",
                "no reply needed",
            )))
    text = "\n".join(lines) + "\n"
    found = sorted(set(re.findall(r"[a-z0-9._]+@[a-z0-9.-]+\.[a-z]+", text)))
    assert found == addrs, (found, addrs)
    src = rng.choice(("inbox.txt", "messages.log", "notes.md", "thread.txt"))
    out = rng.choice(("emails.txt", "addresses.txt", "contacts.txt", "unique_emails.txt"))
    instruction = rng.choice((
        f"Extract every e-mail address that appears in /app/{src} and write the distinct "
        f"ones to /app/{out}, one per line, in alphabetical order.",
        f"/app/{src} mentions a number of e-mail addresses, some more than once. List each "
        f"address once, sorted alphabetically, one per line, in /app/{out}.",
        f"Which e-mail addresses occur in /app/{src}? Save them to /app/{out}: no "
        f"duplicates, one address per line, sorted, nothing else on the lines.",
    ))
    tests = f'''"""unique-emails: {len(addrs)} distinct addresses in {src}."""
import hashlib
from pathlib import Path

EXPECTED = {addrs!r}


def test_addresses():
    lines = [ln.strip() for ln in Path("/app/{out}").read_text().splitlines() if ln.strip()]
    assert lines == EXPECTED


def test_input_is_untouched():
    data = Path("/app/{src}").read_bytes()
    assert hashlib.sha256(data).hexdigest() == "{_digest(text)}"
'''
    solution = (f"grep -oE '[a-z0-9._]+@[a-z0-9.-]+\\.[a-z]+' {src} | sort -u > {out}\n")
    return Instance(instruction, {src: text}, solution, tests, difficulty="medium",
                    tags=("grep", "regex", "emails"))


EXTS = ("py", "txt", "md", "csv", "log", "json")


@family("count-files-by-type", skill="counting", split="train")
def count_files_by_type(rng: random.Random) -> Instance:
    """How many files of one extension a directory tree holds, at any depth."""
    root = rng.choice(("project", "repo", "workspace", "site"))
    dirs = ["", "src", "src/lib", "docs", "tests", "data", "data/raw", "scripts", "docs/old"]
    dirs = [""] + rng.sample(dirs[1:], rng.randint(3, 7))
    ext = rng.choice(EXTS)
    files: dict[str, str] = {}
    while sum(p.endswith(f".{ext}") for p in files) < 3:
        d = rng.choice(dirs)
        e = rng.choice(EXTS)
        path = "/".join(x for x in (root, d, f"{rng.choice(NOUNS)}.{e}") if x)
        files[path] = f"{rng.choice(NOUNS)}\n"
    # Look-alikes that do not count: another extension after ours, ours inside a name.
    files[f"{root}/{rng.choice(dirs[1:])}/{rng.choice(NOUNS)}.{ext}.bak"] = "old\n"
    files[f"{root}/{ext}_notes.md" if ext != "md" else f"{root}/md_notes.txt"] = "x\n"
    if rng.random() < 0.5:  # a directory whose name ends in the extension
        files[f"{root}/archive.{ext}/README"] = "not a file of that type\n"
    count = sum(p.endswith(f".{ext}") for p in files)
    out = rng.choice(("count.txt", "answer.txt", f"{ext}_files.txt"))
    instruction = rng.choice((
        f"How many .{ext} files are there in /app/{root}, including all of its "
        f"subdirectories? Write just the number to /app/{out}.",
        f"Count the files whose name ends in .{ext} anywhere under /app/{root} (at any "
        f"depth; directories do not count) and save the count in /app/{out}.",
        f"/app/{out} should contain the number of regular files with the extension .{ext} "
        f"in the /app/{root} tree, and nothing else.",
    ))
    tests = f'''"""count-files-by-type: {count} .{ext} files under {root}."""
from pathlib import Path


def test_count():
    assert Path("/app/{out}").read_text().strip() == "{count}"


def test_tree_is_untouched():
    found = sorted(str(p.relative_to("/app")) for p in Path("/app/{root}").rglob("*")
                   if p.is_file())
    assert found == {sorted(files)!r}
'''
    solution = f"find {root} -type f -name '*.{ext}' | wc -l > {out}\n"
    return Instance(instruction, files, solution, tests, tags=("find", "count"))
