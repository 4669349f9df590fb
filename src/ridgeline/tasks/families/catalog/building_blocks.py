"""Building blocks: training families for the command idioms the held-out skills use.

A policy trained only on the other training families learns the protocol but invents
options for held-out goals, because it has seen too few idioms. Each family here teaches
one idiom (awk `length`, `sort | uniq -c | sort -rn`, `tar -tzf`/`-xzf -C`, numeric
`chmod`, `find -size/-empty/-perm/-name`, `stat -c %s`/`ls -S`, `md5sum`, `git log`
formats, `git checkout --`, `cut | sort -u`, `python3 -c` on JSON, `sed -i` on Python,
`sort -n | head`, `grep -oE`) through a goal that differs from every held-out family's, so
held-out success still needs the skill rather than a memorised command. Each docstring
names the held-out family it supports and how its goal differs.
"""

from __future__ import annotations

import json
import random
import re
import shlex
from collections import Counter

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.archives import _targz, _tree
from ridgeline.tasks.families.catalog.checks import sha256, tree_unchanged_test, untouched_test
from ridgeline.tasks.families.catalog.git import _GIT_TEST, _build_repo, _history
from ridgeline.tasks.families.catalog.sorting import _NUMERIC_COLUMNS, _people
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES

FILLER = ("the", "a", "of", "and", "near", "with", "under", "every", "old", "new", "by")
CITIES = ("lisbon", "oslo", "quito", "lagos", "kyoto", "perth", "denver", "tunis", "cairo")

#: The head of most generated test modules, and a helper reading non-blank lines.
_HEAD = '''import hashlib
import os
from pathlib import Path


def lines(path):
    return [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
'''


def _value_test(out: str, expected: object) -> str:
    """A test that /app/`out` holds the single value `expected` (a number compared as a
    number, anything else as stripped text)."""
    if isinstance(expected, int):
        check = f"assert int(float(got)) == {expected} and float(got) == {expected}"
    elif isinstance(expected, float):
        check = f"assert abs(float(got) - {expected!r}) <= 0.005 + 1e-9"
    else:
        check = f"assert got == {expected!r}"
    return f'''

def test_answer():
    got = Path("/app/{out}").read_text().strip()
    {check}
'''


def _sentence(rng: random.Random, vocab: list[str], k: tuple[int, int] = (1, 8)) -> str:
    return " ".join(rng.choice(vocab) for _ in range(rng.randint(*k)))


# -- text -----------------------------------------------------------------------------


@family("line-lengths", skill="text", split="train")
def line_lengths(rng: random.Random) -> Instance:
    """Line lengths: the shortest line's, one given line's, or the lines over a limit.

    Teaches awk's `length` (with `sort -n | head`, `NR ==` and a length filter). Supports
    the held-out `longest-line`, which asks for the longest line itself: no goal here is
    that one.
    """
    lines = [_sentence(rng, list(NOUNS)) for _ in range(rng.randint(10, 30))]
    src = rng.choice(("phrases.txt", "notes.txt", "titles.txt", "data/lines.txt"))
    kind = rng.choice(("shortest", "nth", "over"))
    content = "\n".join(lines) + "\n"
    if kind == "shortest":
        expected: object = min(len(x) for x in lines)
        out = rng.choice(("shortest.txt", "answer.txt", "min_length.txt"))
        instruction = rng.choice((
            f"How many characters long is the shortest line of /app/{src}? Write just the "
            f"number to /app/{out}.",
            f"Find the length, in characters, of the shortest line in /app/{src} and save "
            f"that number (and nothing else) in /app/{out}.",
            f"/app/{out} should contain the number of characters of the shortest line of "
            f"/app/{src} (the newline does not count).",
        ))
        solution = f"awk '{{ print length($0) }}' {src} | sort -n | head -n 1 > {out}\n"
        check = _value_test(out, expected)
    elif kind == "nth":
        n = rng.randint(2, len(lines))
        expected = len(lines[n - 1])
        out = rng.choice((f"line{n}_length.txt", "answer.txt", "length.txt"))
        instruction = rng.choice((
            f"How many characters does line {n} of /app/{src} have (not counting the "
            f"newline)? Write the number to /app/{out}.",
            f"Count the characters on line number {n} of /app/{src}, without its line "
            f"break, and save the count in /app/{out}.",
            f"/app/{out} should hold the length in characters of the {n}th line of "
            f"/app/{src}, and nothing else.",
        ))
        solution = f"awk 'NR == {n} {{ print length($0) }}' {src} > {out}\n"
        check = _value_test(out, expected)
    else:
        lengths = sorted({len(x) for x in lines})
        k = lengths[len(lengths) // 2]
        keep = [x for x in lines if len(x) > k]
        out = rng.choice(("long_lines.txt", "selected.txt", "over_limit.txt"))
        instruction = rng.choice((
            f"Copy every line of /app/{src} that is longer than {k} characters to "
            f"/app/{out}, in their original order. Lines of exactly {k} characters or "
            f"fewer are left out.",
            f"Which lines of /app/{src} have more than {k} characters? Write them, one per "
            f"line and in the order they appear, to /app/{out}.",
            f"Filter /app/{src}: /app/{out} must contain only the lines with strictly more "
            f"than {k} characters, unchanged and in the same order.",
        ))
        solution = f"awk 'length($0) > {k}' {src} > {out}\n"
        check = f'''

def test_long_lines():
    got = [ln.rstrip() for ln in Path("/app/{out}").read_text().splitlines() if ln.strip()]
    assert got == {keep!r}
'''
    tests = f'"""line-lengths ({kind}) of {src}."""\n' + _HEAD + check + untouched_test(src, content)
    return Instance(instruction, {src: content}, solution, tests,
                    difficulty="easy" if kind != "shortest" else "medium",
                    tags=("awk", "length"))


@family("count-words-in-text", skill="text", split="train")
def count_words_in_text(rng: random.Random) -> Instance:
    """How often one word occurs in a text, or how many different words it has.

    Teaches splitting a text into lower-case words (`tr 'A-Z' 'a-z' | tr -cs 'a-z' '\\n'`)
    and counting them (`grep -cx`, `sort -u | wc -l`). Supports the held-out
    `top-three-words` (the three most frequent words with counts), a different goal.
    """
    target = rng.choice(NOUNS)
    vocab = [w for w in NOUNS + FILLER if target not in w and w not in target]
    vocab = rng.sample(vocab, rng.randint(8, 16))
    kind = rng.choice(("occurrences", "distinct"))
    while True:
        lines = []
        for _ in range(rng.randint(6, 14)):
            words = [rng.choice(vocab) for _ in range(rng.randint(4, 10))]
            if kind == "occurrences":
                for _ in range(rng.choice((0, 1, 1, 2))):
                    words[rng.randrange(len(words))] = target
            for j, w in enumerate(words):
                r = rng.random()
                words[j] = w.capitalize() if r < 0.15 else w.upper() if r < 0.2 else w
                if j < len(words) - 1 and rng.random() < 0.1:
                    words[j] += ","
            lines.append(" ".join(words) + rng.choice((".", ".", "!", "?", ";")))
        text = "\n".join(lines) + "\n"
        tokens = re.findall(r"[a-z]+", text.lower())
        if kind == "occurrences":
            expected = tokens.count(target)
            per_line = sum(target in ln.lower() for ln in lines)
            if expected >= 3 and per_line != expected:
                break
        else:
            expected = len(set(tokens))
            raw = len(set(re.findall(r"[A-Za-z]+", text)))
            if raw != expected:
                break
    src = rng.choice(("story.txt", "essay.txt", "speech.txt", "notes/chapter.txt"))
    if kind == "occurrences":
        out = rng.choice(("count.txt", f"{target}_count.txt", "answer.txt"))
        instruction = rng.choice((
            f"How many times does the word \"{target}\" occur in /app/{src}? Count every "
            f"occurrence, in any letter case (\"{target.capitalize()}\" counts too). Write "
            f"just the number to /app/{out}.",
            f"Count the occurrences of the word {target} in /app/{src}, ignoring case and "
            f"punctuation (a line may contain it more than once), and save the count in "
            f"/app/{out}.",
            f"/app/{out} should contain the number of times \"{target}\" appears as a word "
            f"in /app/{src}, case-insensitively, and nothing else.",
        ))
        solution = (f"tr 'A-Z' 'a-z' < {src} | tr -cs 'a-z' '\\n' | grep -cx {target} "
                    f"> {out}\n")
    else:
        out = rng.choice(("vocabulary_size.txt", "distinct_words.txt", "answer.txt"))
        instruction = rng.choice((
            f"How many different words does /app/{src} use? A word is a run of letters, "
            f"and \"Apple\" and \"apple\" are the same word. Write the number to /app/{out}.",
            f"Count the distinct words of /app/{src}, ignoring letter case and "
            f"punctuation, and save the count in /app/{out}.",
            f"/app/{out} should hold the size of the vocabulary of /app/{src}: the number "
            f"of unique words once everything is lower-cased (words are runs of letters).",
        ))
        solution = (f"tr 'A-Z' 'a-z' < {src} | tr -cs 'a-z' '\\n' | grep -v '^$' | sort -u "
                    f"| wc -l > {out}\n")
    tests = (f'"""count-words-in-text ({kind}): {expected} in {src}."""\n' + _HEAD
             + _value_test(out, expected) + untouched_test(src, text))
    return Instance(instruction, {src: text}, solution, tests, difficulty="medium",
                    tags=("tr", "words", "count"))


_TICKET_KEYS = ("OPS", "WEB", "API", "DB", "INFRA", "UX", "CORE", "SEC")


@family("extract-pattern-matches", skill="text", split="train")
def extract_pattern_matches(rng: random.Random) -> Instance:
    """Every ticket id (or ISO date) in a text, in order of appearance, repeats kept.

    Teaches `grep -oE` with a regular expression. Supports the held-out `unique-emails`
    (distinct e-mail addresses, sorted): here the matches keep their order and repeats.
    """
    kind = rng.choice(("tickets", "dates"))
    vocab = list(NOUNS)
    if kind == "tickets":
        keys = rng.sample(_TICKET_KEYS, 3)
        pool = [f"{k}-{rng.randint(1, 999)}" for k in keys for _ in range(2)]
        templates = ("fixed in {t}", "see {t} and {u}", "({t})", "{t}: {w}", "closes {t}",
                     "blocked by {t}")
        decoys = (f"{keys[0].lower()}-{rng.randint(1, 99)}", f"{keys[1]}-team",
                  f"the {keys[2]} board", f"step {rng.randint(1, 9)}-{rng.randint(1, 9)}")
        pattern, what = r"[A-Z]+-[0-9]+", "ticket id"
        describe = (f"a ticket id is a project key in capital letters, a dash and a number, "
                    f"like {pool[0]}")
        src = rng.choice(("changelog.txt", "standup.md", "notes/sprint.txt"))
    else:
        pool = [f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}" for _ in range(5)]
        templates = ("on {t}", "from {t} to {u}", "due {t}:", "[{t}]", "{t} release",
                     "moved to {t}")
        decoys = (f"{rng.randint(1, 28)}/{rng.randint(1, 12)}/2024", f"{rng.randint(8, 18)}:30",
                  f"v{rng.randint(1, 3)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}",
                  f"room {rng.randint(100, 400)}")
        pattern, what = r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "date"
        describe = f"dates are written as YYYY-MM-DD, like {pool[0]}"
        src = rng.choice(("diary.txt", "schedule.md", "notes/plan.txt"))
    lines = []
    for _ in range(rng.randint(6, 12)):
        parts = [_sentence(rng, vocab, (2, 5))]
        if rng.random() < 0.75:
            t, u = rng.choice(pool), rng.choice(pool)
            parts.append(rng.choice(templates).format(t=t, u=u, w=rng.choice(vocab)))
        if rng.random() < 0.35:
            parts.append(rng.choice(decoys))
        parts.append(_sentence(rng, vocab, (0, 3)))
        line = " ".join(p for p in parts if p)
        lines.append(line[0].upper() + line[1:])
    if not any(re.search(pattern, ln) for ln in lines):
        lines.append(rng.choice(templates).format(t=pool[1], u=pool[2], w=vocab[0]))
    text = "\n".join(lines) + "\n"
    expected = re.findall(pattern, text)
    out = rng.choice((f"{what.split()[-1]}s.txt", "matches.txt", "extracted.txt"))
    instruction = rng.choice((
        f"Extract every {what} that appears in /app/{src} ({describe}) and write them to "
        f"/app/{out}, one per line, in the order they occur. Keep repeats: one mentioned "
        f"twice is listed twice.",
        f"List all the {what}s mentioned in /app/{src}, one per line in order of "
        f"appearance (duplicates included), in /app/{out}. Note: {describe}.",
        f"/app/{out} should contain each occurrence of a {what} in /app/{src}, one per "
        f"line, in reading order, repeats kept ({describe}).",
    ))
    tests = (f'"""extract-pattern-matches: {len(expected)} {what}s in {src}."""\n' + _HEAD
             + f'''

def test_matches_in_order():
    assert lines("/app/{out}") == {expected!r}
''' + untouched_test(src, text))
    solution = f"grep -oE '{pattern}' {src} > {out}\n"
    return Instance(instruction, {src: text}, solution, tests,
                    tags=("grep", "regex", "extract"))


# -- counting and sorting -------------------------------------------------------------

_PATHS = ("/", "/login", "/logout", "/api/users", "/api/orders", "/static/app.js",
          "/static/style.css", "/search", "/cart", "/health", "/docs", "/favicon.ico")
_STATUS = ("200", "201", "301", "304", "400", "401", "403", "404", "500", "503")


@family("most-frequent-log-value", skill="counting", split="train")
def most_frequent_log_value(rng: random.Random) -> Instance:
    """The most common status code, path or client address of a web access log.

    Teaches `awk '{print $N}' | sort | uniq -c | sort -rn | head -n 1` on the fields of a
    log. Supports the held-out `top-three-words` (three words of a prose text with their
    counts): here one field value of a log, written alone.
    """
    field = rng.choice(("status", "path", "ip"))
    ips = [f"{rng.choice(('10.0', '192.168', '172.16'))}.{rng.randint(0, 9)}.{rng.randint(2, 254)}"
           for _ in range(rng.randint(4, 8))]
    ips = list(dict.fromkeys(ips))
    pool = {"status": rng.sample(_STATUS, rng.randint(3, 6)),
            "path": rng.sample(_PATHS, rng.randint(4, 8)), "ip": ips}[field]
    counts = {v: rng.randint(1, 7) for v in pool}
    top = rng.choice(pool)
    counts[top] = max(c for v, c in counts.items() if v != top) + rng.randint(1, 3)
    values = [v for v, c in counts.items() for _ in range(c)]
    rng.shuffle(values)
    lines = []
    for i, v in enumerate(values):
        rec = {"ip": rng.choice(ips), "path": rng.choice(_PATHS), "status": rng.choice(_STATUS)}
        rec[field] = v
        method = "POST" if rec["path"] in ("/login", "/api/orders", "/cart") else "GET"
        lines.append(f'{rec["ip"]} - - [14/May/2024:{8 + i // 60:02d}:{i % 60:02d}:'
                     f'{rng.randint(0, 59):02d} +0000] "{method} {rec["path"]} HTTP/1.1" '
                     f'{rec["status"]} {rng.randint(120, 9000)}')
    content = "\n".join(lines) + "\n"
    col = {"ip": 1, "path": 7, "status": 9}[field]
    assert Counter(ln.split()[col - 1] for ln in lines).most_common(2)[0] == (top, counts[top])
    src = rng.choice(("access.log", "logs/access.log", "nginx_access.log", "web.log"))
    out = rng.choice(("answer.txt", f"top_{field}.txt", "most_common.txt"))
    what = {"status": "HTTP status code", "path": "requested URL path",
            "ip": "client IP address"}[field]
    instruction = rng.choice((
        f"/app/{src} is a web server access log (one request per line). Which {what} "
        f"occurs most often in it? Write just that value to /app/{out}.",
        f"Find the most frequent {what} among the requests logged in /app/{src} and save "
        f"it, and nothing else, in /app/{out}.",
        f"Count the requests of /app/{src} per {what}; /app/{out} should contain the "
        f"{what} with the highest count (only the value, not the count).",
    ))
    tests = (f'"""most-frequent-log-value: {field} {top} x{counts[top]} in {src}."""\n' + _HEAD
             + _value_test(out, top) + untouched_test(src, content))
    solution = (f"awk '{{ print ${col} }}' {src} | sort | uniq -c | sort -rn | head -n 1 "
                f"| awk '{{ print $2 }}' > {out}\n")
    return Instance(instruction, {src: content}, solution, tests, difficulty="medium",
                    tags=("sort", "uniq", "logs"))


@family("numeric-extremes", skill="sorting", split="train")
def numeric_extremes(rng: random.Random) -> Instance:
    """The N largest or smallest values of a CSV column, or whose value is the extreme.

    Teaches `cut -d, -f` with `sort -n`/`sort -rn` and `head -n`/`tail -n` (and
    `sort -t, -k`). Supports the held-out `median-of-column` (the middle value), a
    different goal.
    """
    numeric = rng.sample(sorted(_NUMERIC_COLUMNS), 3)
    kind = rng.choice(("largest", "smallest", "who-max", "who-min"))
    for _ in range(30):
        header, rows = _people(rng, rng.randint(8, 18), numeric)
        key = rng.choice(numeric)
        k = header.index(key)
        vals = [int(r[k]) for r in rows]
        if sorted(vals) != sorted(vals, key=str):  # text order must give another answer
            break
    n = rng.randint(2, 5)
    src = rng.choice(("people.csv", "players.csv", "stats.csv", "members.csv"))
    content = "\n".join(",".join(r) for r in [header, *rows]) + "\n"
    col = k + 1
    if kind in ("largest", "smallest"):
        big = kind == "largest"
        expected = [str(v) for v in sorted(vals, reverse=big)[:n]]
        out = rng.choice((f"{kind}.txt", f"{key}_{kind}.txt", "answer.txt"))
        order = "largest first" if big else "smallest first"
        instruction = rng.choice((
            f"Write the {n} {kind} values of the `{key}` column of /app/{src} to /app/{out}, "
            f"one per line, {order}.",
            f"What are the {n} {'highest' if big else 'lowest'} {key} values in the CSV file "
            f"/app/{src} (header on the first line)? Save them to /app/{out}, one number "
            f"per line, {order}.",
            f"/app/{out} should list the {n} {kind} numbers of column `{key}` of /app/{src}, "
            f"compared as numbers, {order}, one per line.",
        ))
        check = f'''

def test_values():
    assert [str(int(float(x))) for x in lines("/app/{out}")] == {expected!r}
'''
        solution = (f"tail -n +2 {src} | cut -d, -f{col} | sort -n{'r' if big else ''} "
                    f"| head -n {n} > {out}\n")
    else:
        big = kind == "who-max"
        row = (max if big else min)(rows, key=lambda r: int(r[k]))
        out = rng.choice(("name.txt", "answer.txt", f"{'top' if big else 'bottom'}_{key}.txt"))
        adj = "highest" if big else "lowest"
        instruction = rng.choice((
            f"Who has the {adj} `{key}` in /app/{src}? Write that person's name (the "
            f"`name` column) to /app/{out}.",
            f"Find the row of the CSV file /app/{src} with the {adj} {key} (compared as "
            f"numbers) and save its name field, and nothing else, in /app/{out}.",
            f"/app/{out} should contain the name of the person whose `{key}` value is the "
            f"{adj} in /app/{src}.",
        ))
        check = _value_test(out, row[0])
        solution = (f"tail -n +2 {src} | sort -t, -k{col},{col}n | "
                    f"{'tail' if big else 'head'} -n 1 | cut -d, -f1 > {out}\n")
    tests = f'"""numeric-extremes ({kind}) of {key} in {src}."""\n' + _HEAD + check + \
        untouched_test(src, content)
    return Instance(instruction, {src: content}, solution, tests,
                    difficulty="medium" if kind.startswith("who") else "easy",
                    tags=("sort", "head", "csv"))


# -- archives -------------------------------------------------------------------------


@family("count-archive-files", skill="archives", split="train")
def count_archive_files(rng: random.Random) -> Instance:
    """How many files (or files of one extension) a .tar.gz holds, without unpacking it.

    Teaches `tar -tzf` (listing members, directories ending in `/`) with `grep`/`wc -l`.
    Supports the held-out `list-archive-files`, which writes the listing itself: here
    only a count.
    """
    top = rng.choice(("backup", "release", "dataset", "site", rng.choice(SERVICES)))
    files = _tree(rng, top, (5, 14))
    exts = sorted({p.rsplit(".", 1)[1] for p in files})
    ext = rng.choice(exts) if rng.random() < 0.5 else None
    if ext:
        d = rng.choice(sorted({p.rsplit("/", 1)[0] for p in files}))
        files[f"{d}/{rng.choice(NOUNS)}.{ext}.orig"] = "old copy\n"
        count = sum(p.endswith(f".{ext}") for p in files)
        what = f"files with the extension .{ext}"
        solution = f"tar -tzf {{a}} | grep -c '\\.{ext}$' > {{o}}\n"
    else:
        count = len(files)
        what = "regular files (directories do not count)"
        solution = "tar -tzf {a} | grep -v '/$' | wc -l > {o}\n"
    archive = rng.choice((f"{top}.tar.gz", f"{top}-{rng.randint(1, 9)}.tgz", "bundle.tar.gz"))
    out = rng.choice(("count.txt", "answer.txt", "file_count.txt"))
    blob = _targz(files, with_dirs=rng.random() < 0.7)
    instruction = rng.choice((
        f"How many {what} are stored in the archive /app/{archive}? Write just the number "
        f"to /app/{out}; do not unpack the archive into /app.",
        f"Without extracting it, count the {what} inside the compressed tarball "
        f"/app/{archive} and save the count in /app/{out}.",
        f"/app/{out} should contain the number of {what} packed in /app/{archive}. Leave "
        f"the archive packed and unchanged.",
    ))
    tests = (f'"""count-archive-files: {count} {what.split(" (")[0]} in {archive}."""\n'
             + _HEAD + _value_test(out, count) + f'''

def test_not_unpacked():
    assert not Path("/app/{top}").exists()
''' + untouched_test(archive, blob))
    return Instance(instruction, {archive: blob}, solution.format(a=archive, o=out), tests,
                    tags=("archives", "tar", "count"))


@family("unpack-archive", skill="archives", split="train")
def unpack_archive(rng: random.Random) -> Instance:
    """A whole .tar.gz unpacked into a given (new) directory.

    Teaches `tar -xzf ARCHIVE -C DIR` (and `mkdir -p`). Supports the held-out
    `extract-one-file`, which takes out a single member: here everything is unpacked.
    """
    top = rng.choice(("release", "assets", "bundle", "snapshot", "export", "docs"))
    files = _tree(rng, top, (3, 9))
    archive = rng.choice((f"{top}.tar.gz", f"downloads/{top}.tgz",
                          f"{top}-v{rng.randint(1, 5)}.{rng.randint(0, 9)}.tar.gz"))
    dest = rng.choice(("unpacked", "restore", "extracted", "work/in", "staging"))
    blob = _targz(files, with_dirs=rng.random() < 0.7)
    example = min(files)
    instruction = rng.choice((
        f"Unpack the compressed tarball /app/{archive} into the directory /app/{dest} "
        f"(create it): each member keeps its path below it, e.g. `{example}` becomes "
        f"/app/{dest}/{example}. Keep the archive.",
        f"Extract every file of /app/{archive} under /app/{dest}/, with the paths they have "
        f"in the archive (so /app/{dest}/{example} exists afterwards). The archive itself "
        f"must stay as it is.",
        f"I need the contents of /app/{archive} unpacked in /app/{dest} (a new directory), "
        f"member paths preserved, for instance /app/{dest}/{example}.",
    ))
    expected = {f"{dest}/{p}": sha256(c) for p, c in files.items()}
    tests = f'''"""unpack-archive: {archive} into {dest}."""
''' + _HEAD + f'''
EXPECTED = {expected!r}


def test_unpacked():
    found = {{}}
    for dirpath, _dirs, names in os.walk("/app/{dest}"):
        for n in names:
            p = Path(dirpath) / n
            found[str(p.relative_to("/app"))] = hashlib.sha256(p.read_bytes()).hexdigest()
    assert found == EXPECTED
''' + untouched_test(archive, blob)
    return Instance(instruction, {archive: blob}, f"mkdir -p {dest}\ntar -xzf {archive} -C {dest}\n",
                    tests, tags=("archives", "tar", "extract"))


# -- permissions ----------------------------------------------------------------------

_TARGET_MODES = (0o640, 0o600, 0o750, 0o755, 0o700, 0o444, 0o660, 0o644)
_START_MODES = (0o644, 0o664, 0o666, 0o755, 0o600, 0o640, 0o775)


def _spell_mode(m: int) -> str:
    def who(bits: int) -> str:
        names = [n for b, n in ((4, "read"), (2, "write"), (1, "execute")) if bits & b]
        return ", ".join(names) if names else "no access"
    return (f"owner: {who(m >> 6 & 7)}; group: {who(m >> 3 & 7)}; "
            f"others: {who(m & 7)}")


@family("set-file-mode", skill="permissions", split="train")
def set_file_mode(rng: random.Random) -> Instance:
    """Given files (named, or of one extension) set to an exact permission mode.

    Teaches numeric `chmod MODE FILES` (and globs). Supports the held-out
    `make-files-private` (clearing group/other bits recursively, keeping each owner's)
    and `find-world-writable`: here one exact mode for chosen files.
    """
    d = rng.choice(("config", "deploy", "scripts", "shared", "etc", "keys"))
    exts = rng.sample(("conf", "sh", "key", "txt", "ini", "pem"), 3)
    files: dict[str, str] = {}
    while len(files) < rng.randint(5, 9) or len({p.rsplit(".", 1)[1] for p in files}) < 2:
        files[f"{d}/{rng.choice(NOUNS)}.{rng.choice(exts)}"] = _sentence(rng, list(NOUNS)) + "\n"
    mode = rng.choice(_TARGET_MODES)
    by_ext = rng.random() < 0.4
    if by_ext:
        ext = rng.choice(sorted({p.rsplit(".", 1)[1] for p in files}))
        targets = sorted(p for p in files if p.endswith(f".{ext}"))
        which = f"every .{ext} file in /app/{d}"
        solution = f"chmod {mode:o} {d}/*.{ext}\n"
    else:
        targets = sorted(rng.sample(sorted(files), rng.randint(1, min(3, len(files) - 1))))
        which = ", ".join(f"/app/{p}" for p in targets)
        solution = f"chmod {mode:o} {' '.join(targets)}\n"
    modes = {p: rng.choice([m for m in _START_MODES if m != mode]) for p in files}
    spelled = f"{mode:o}" if rng.random() < 0.5 else f"{mode:o} ({_spell_mode(mode)})"
    if rng.random() < 0.4:
        spelled = f"[{_spell_mode(mode)}]"
    instruction = rng.choice((
        f"Set the permissions of {which} to exactly {spelled}. The other files must keep "
        f"their current permissions.",
        f"Change the mode of {which} so that it is {spelled}, nothing more and nothing "
        f"less; leave every other file as it is.",
        f"The permissions are wrong: {which} must have mode {spelled}. Fix them without "
        f"changing any other file or the files' contents.",
    ))
    expected = {p: (mode if p in targets else m) for p, m in modes.items()}
    tests = f'''"""set-file-mode: {len(targets)} files of {d} to {mode:o}."""
import hashlib
import os
import stat
from pathlib import Path

EXPECTED = {{k: int(v, 8) for k, v in {({p: oct(m) for p, m in expected.items()})!r}.items()}}
CONTENTS = {({p: sha256(c) for p, c in files.items()})!r}


def mode(rel):
    return stat.S_IMODE(os.stat(f"/app/{{rel}}").st_mode)


def test_modes():
    assert {{rel: oct(mode(rel)) for rel in EXPECTED}} == {{r: oct(m) for r, m in EXPECTED.items()}}


def test_contents_unchanged():
    for rel, digest in CONTENTS.items():
        assert hashlib.sha256(Path(f"/app/{{rel}}").read_bytes()).hexdigest() == digest, rel
'''
    return Instance(instruction, files, solution, tests, modes=modes,
                    tags=("permissions", "chmod"))


# -- files ----------------------------------------------------------------------------


@family("find-files-matching", skill="files", split="train")
def find_files_matching(rng: random.Random) -> Instance:
    """The files of a tree that are large, empty, owner-executable or name-prefixed.

    Teaches `find DIR -type f` with `-size +Nk`, `-empty`, `-perm -u+x` or `-name`,
    output to a file. Supports the held-out `copy-largest-file` and `find-world-writable`
    (the largest file copied; world-writable files listed and fixed): other selections.
    """
    top = rng.choice(("data", "share", "project", "files", "storage"))
    subdirs = ["", *rng.sample(("a", "logs", "tmp", "old/2023", "cache", "docs", "src"),
                               rng.randint(2, 4))]
    kind = rng.choice(("large", "empty", "executable", "prefix"))
    prefix = rng.choice(("draft_", "tmp_", "old_", "test_"))
    files: dict[str, str] = {}
    while len(files) < rng.randint(8, 14):
        name = f"{rng.choice(NOUNS)}.{rng.choice(('txt', 'log', 'dat', 'csv', 'sh'))}"
        files[f"{top}/{rng.choice(subdirs)}/{name}".replace("//", "/")] = \
            "".join(_sentence(rng, list(NOUNS)) + "\n" for _ in range(rng.randint(1, 8)))
    paths = sorted(files)
    targets = set(rng.sample(paths, rng.randint(2, 4)))
    modes: dict[str, int] = {}
    if kind == "large":
        for p in paths:
            if p in targets:
                while len(files[p]) < 3000:
                    files[p] += _sentence(rng, list(NOUNS), (5, 12)) + "\n"
            assert (len(files[p]) > 2048) == (p in targets)
        cond = "are larger than 2 KiB (more than 2048 bytes)"
        solution = f"find {top} -type f -size +2k > {{o}}\n"
    elif kind == "empty":
        for p in targets:
            files[p] = ""
        cond = "are empty (0 bytes)"
        solution = f"find {top} -type f -empty > {{o}}\n"
    elif kind == "executable":
        modes = {p: rng.choice((0o755, 0o744, 0o700) if p in targets else
                               (0o644, 0o664, 0o640, 0o600, 0o654)) for p in paths}
        cond = "their owner is allowed to execute (the owner's execute bit is set)"
        solution = f"find {top} -type f -perm -u+x > {{o}}\n"
    else:
        renamed = {}
        for p in paths:
            d, n = p.rsplit("/", 1)
            renamed[f"{d}/{prefix}{n}" if p in targets else p] = files[p]
        files = renamed
        targets = {p for p in files if p.rsplit("/", 1)[1].startswith(prefix)}
        files[f"{top}/{prefix}{rng.choice(NOUNS)}/{rng.choice(NOUNS)}.txt"] = "not a match\n"
        files[f"{top}/{rng.choice(NOUNS)}_{prefix}{rng.choice(NOUNS)}.txt"] = "not a match\n"
        cond = f"have a name starting with `{prefix}`"
        solution = f"find {top} -type f -name '{prefix}*' > {{o}}\n"
    out = rng.choice(("found.txt", "list.txt", "selected.txt", "matches.txt"))
    example = min(targets)
    instruction = rng.choice((
        f"List the files under /app/{top} (at any depth) that {cond}. Write their paths "
        f"relative to /app, like `{example}`, to /app/{out}, one per line, in any order.",
        f"Which regular files in the /app/{top} tree {cond}? Save their paths (relative to "
        f"/app, e.g. {example}) one per line in /app/{out}; order does not matter.",
        f"Find all the files below /app/{top} that {cond} and put the list of their paths in "
        f"/app/{out} (one path per line such as `{example}`, any order). Change nothing "
        f"in /app/{top}.",
    ))
    originals = {p: sha256(c) for p, c in files.items()}
    tests = f'''"""find-files-matching ({kind}): {len(targets)} files of {top}."""
''' + _HEAD + f'''
ORIGINALS = {originals!r}


def test_listed():
    got = sorted(ln.removeprefix("/app/").removeprefix("./") for ln in lines("/app/{out}"))
    assert got == {sorted(targets)!r}


{tree_unchanged_test("test_tree_untouched", top)}'''
    return Instance(instruction, files, solution.format(o=out), tests, modes=modes,
                    difficulty="easy", tags=("files", "find"))


@family("file-size-facts", skill="files", split="train")
def file_size_facts(rng: random.Random) -> Instance:
    """A file's size in bytes, the smallest file of a folder, or a folder's total bytes.

    Teaches `stat -c %s`, `ls -S` and `wc -c`. Supports the held-out `copy-largest-file`
    (the largest file of a tree, copied): here sizes are reported, not files copied.
    """
    d = rng.choice(("uploads", "reports", "logs", "inbox", "media"))
    ext = rng.choice(("txt", "log", "csv", "dat"))
    files: dict[str, str] = {}
    sizes: set[int] = set()
    for name in rng.sample(NOUNS, rng.randint(5, 9)):
        text = "".join(_sentence(rng, list(NOUNS)) + "\n" for _ in range(rng.randint(1, 30)))
        while len(text) in sizes:
            text += rng.choice(NOUNS) + "\n"
        sizes.add(len(text))
        files[f"{d}/{name}.{ext}"] = text
    kind = rng.choice(("size", "smallest", "total"))
    out = rng.choice(("answer.txt", "size.txt", "result.txt"))
    if kind == "size":
        p = rng.choice(sorted(files))
        expected: object = len(files[p])
        instruction = rng.choice((
            f"What is the size of /app/{p} in bytes? Write just the number to /app/{out}.",
            f"Find out how many bytes /app/{p} takes and save that number in /app/{out}.",
            f"/app/{out} should contain the size in bytes of the file /app/{p}.",
        ))
        solution = f"stat -c %s {p} > {out}\n"
        check = _value_test(out, expected)
    elif kind == "smallest":
        p = min(files, key=lambda q: len(files[q]))
        expected = p.rsplit("/", 1)[1]
        instruction = rng.choice((
            f"Which file in /app/{d} is the smallest (fewest bytes)? Write its file name "
            f"to /app/{out}.",
            f"Find the smallest file of the folder /app/{d} by size in bytes and save its "
            f"name in /app/{out}.",
            f"/app/{out} should contain the name of the file in /app/{d} that has the "
            f"fewest bytes.",
        ))
        solution = f"ls -S {d} | tail -n 1 > {out}\n"
        check = f'''

def test_answer():
    assert Path(Path("/app/{out}").read_text().strip()).name == {expected!r}
'''
    else:
        expected = sum(len(c) for c in files.values())
        instruction = rng.choice((
            f"How many bytes do the files in /app/{d} take together? Write the total size "
            f"in bytes (the sum of the file sizes) to /app/{out}.",
            f"Add up the sizes in bytes of all the files in /app/{d} and save the total in "
            f"/app/{out}.",
            f"/app/{out} should contain the combined size, in bytes, of every file in "
            f"/app/{d} (file contents only, not disk blocks).",
        ))
        solution = f"cat {d}/* | wc -c > {out}\n"
        check = _value_test(out, expected)
    originals = {p: sha256(c) for p, c in files.items()}
    tests = f'"""file-size-facts ({kind}) in {d}."""\n' + _HEAD + f'''
ORIGINALS = {originals!r}
''' + check + f'''

{tree_unchanged_test("test_folder_untouched", d)}'''
    return Instance(instruction, files, solution, tests, tags=("files", "size"))


@family("find-identical-file", skill="files", split="train")
def find_identical_file(rng: random.Random) -> Instance:
    """Which files of a folder are byte-for-byte copies of a reference file (or are not).

    Teaches comparing contents with checksums (`md5sum`, `sha256sum`) or `cmp`. Supports
    the held-out `remove-duplicate-files` (deleting duplicates within a folder): here
    files are compared with one reference and nothing is deleted.
    """
    svc = rng.choice(SERVICES)
    ref = rng.choice((f"{svc}.conf", f"current/{svc}.conf", "settings.ini", "live/app.cfg"))
    keys = rng.sample(NOUNS, rng.randint(5, 9))
    base = "".join(f"{k} = {rng.randint(1, 999)}\n" for k in keys)
    d = rng.choice(("backups", "snapshots", "versions", "candidates"))
    kind = rng.choice(("same", "different"))
    n_same = 1 if kind == "same" else rng.randint(1, 2)

    def near(text: str) -> str:
        how = rng.choice(("value", "newline", "swap", "space", "extra"))
        ls = text.splitlines(keepends=True)
        if how == "value":
            i = rng.randrange(len(ls))
            ls[i] = ls[i].rstrip("\n") + "0\n"
        elif how == "newline":
            return text.rstrip("\n")
        elif how == "swap":
            i = rng.randrange(len(ls) - 1)
            ls[i], ls[i + 1] = ls[i + 1], ls[i]
        elif how == "space":
            i = rng.randrange(len(ls))
            ls[i] = ls[i].replace(" = ", "  = ", 1)
        else:
            ls.append(f"{rng.choice(NOUNS)} = {rng.randint(1, 9)}\n")
        return "".join(ls)

    names = [f"{svc}.{i}.conf" if rng.random() < 0.5 else f"{rng.choice(NOUNS)}_{i}.conf"
             for i in rng.sample(range(1, 40), rng.randint(5, 9))]
    files = {ref: base}
    contents = [base] * n_same
    while len(contents) < len(names):
        c = near(base)
        if c != base and c not in contents:
            contents.append(c)
    rng.shuffle(contents)
    for n, c in zip(names, contents):
        files[f"{d}/{n}"] = c
    same = sorted(n for n, c in zip(names, contents) if c == base)
    diff = sorted(n for n, c in zip(names, contents) if c != base)
    out = rng.choice(("answer.txt", "match.txt", "result.txt"))
    if kind == "same":
        expected = same
        instruction = rng.choice((
            f"Exactly one file in /app/{d} has the same contents as /app/{ref}, byte for "
            f"byte (the others differ, some only slightly). Write its file name to "
            f"/app/{out}.",
            f"Which of the files in /app/{d} is an exact copy of /app/{ref}? Save its name "
            f"in /app/{out}. Do not change any file.",
            f"/app/{out} should contain the name of the file of /app/{d} whose contents are "
            f"identical to /app/{ref}.",
        ))
        awk = "$1 == h"
    else:
        expected = diff
        instruction = rng.choice((
            f"Some files in /app/{d} are exact copies of /app/{ref}, others differ from it "
            f"(some only by a character). List the names of the files that differ in "
            f"/app/{out}, one per line, any order.",
            f"Which files of /app/{d} do not have exactly the same contents as /app/{ref}? "
            f"Write their names to /app/{out}, one per line.",
            f"Compare every file in /app/{d} with /app/{ref} byte for byte; /app/{out} "
            f"should list (one name per line, in any order) those that are not identical.",
        ))
        awk = "$1 != h"
    originals = {p: sha256(c) for p, c in files.items() if p.startswith(d + "/")}
    tests = f'"""find-identical-file ({kind}) against {ref}."""\n' + _HEAD + f'''
ORIGINALS = {originals!r}


def test_answer():
    assert sorted(Path(x).name for x in lines("/app/{out}")) == {expected!r}


{tree_unchanged_test("test_folder_untouched", d)}''' + untouched_test(ref, base)
    solution = (f"h=$(md5sum < {ref} | cut -d' ' -f1)\n"
                f"md5sum {d}/* | awk -v h=\"$h\" '{awk} {{ print $2 }}' > {out}\n")
    return Instance(instruction, files, solution, tests, difficulty="medium",
                    tags=("files", "checksum", "compare"))


# -- git ------------------------------------------------------------------------------


@family("git-history-facts", skill="git", split="train")
def git_history_facts(rng: random.Random) -> Instance:
    """A fact read from a repository's history: commit count, last subject, files changed.

    Teaches `git rev-list --count`, `git log -1 --format=%s [-- PATH]` and
    `git show --name-only`. Supports the held-out `git-find-commit-hash` (the hash of the
    commit whose message mentions something) and `git-undo-last-commit`: other goals.
    """
    repo = rng.choice(("repo", "project", "service", "app"))
    history = _history(rng, rng.randint(3, 9))
    kind = rng.choice(("count", "subject", "files", "file-subject"))
    out = rng.choice(("answer.txt", "result.txt", "info.txt"))
    if kind == "files":
        known = sorted({p for _m, ch in history for p in ch})
        changed = rng.sample(known, min(len(known), rng.randint(1, 2)))
        changed += [f"{rng.choice(('docs', 'src', 'conf'))}/{rng.choice(NOUNS)}_new.txt"]
        history.append((rng.choice(("Update several files", "Tidy up", "Release prep")),
                        {p: f"{rng.choice(NOUNS)} = {rng.randint(100, 999)}\n" for p in changed}))
        expected: object = sorted(set(changed))
    built = _build_repo(repo, history)
    last_touch: dict[str, int] = {}
    for i, (_m, ch) in enumerate(history):
        for p in ch:
            last_touch[p] = i
    if kind == "file-subject":
        cands = [p for p, i in last_touch.items() if i < len(history) - 1]
        better = [p for p in cands if p != "README.md"]
        path = rng.choice(sorted(better or cands))
        expected = history[last_touch[path]][0]
        instruction = rng.choice((
            f"What is the subject (first line of the message) of the most recent commit "
            f"of /app/{repo} that changed the file {path}? Write it to /app/{out}.",
            f"In the git repository /app/{repo}, find the last commit that modified "
            f"{path} and save its commit message's subject line in /app/{out}.",
            f"/app/{out} should contain the subject line of the newest commit touching "
            f"{path} in /app/{repo}.",
        ))
        solution = f"git -C {repo} log -1 --format=%s -- {shlex.quote(path)} > {out}\n"
        check = _value_test(out, expected)
    elif kind == "count":
        expected = len(history)
        instruction = rng.choice((
            f"How many commits does the current branch of the git repository /app/{repo} "
            f"have? Write just the number to /app/{out}.",
            f"Count the commits in the history of /app/{repo} (the checked-out branch, "
            f"from the first commit to HEAD) and save the number in /app/{out}.",
            f"/app/{out} should contain the number of commits reachable from HEAD in "
            f"/app/{repo}.",
        ))
        solution = f"git -C {repo} rev-list --count HEAD > {out}\n"
        check = _value_test(out, expected)
    elif kind == "subject":
        expected = history[-1][0]
        instruction = rng.choice((
            f"What is the message of the latest commit of /app/{repo}? Write its subject "
            f"line to /app/{out}.",
            f"Save the subject (first line of the message) of the most recent commit of "
            f"the git repository /app/{repo} in /app/{out}.",
            f"/app/{out} should contain the subject line of the commit HEAD points to in "
            f"/app/{repo}.",
        ))
        solution = f"git -C {repo} log -1 --format=%s > {out}\n"
        check = _value_test(out, expected)
    else:
        instruction = rng.choice((
            f"Which files did the latest commit of /app/{repo} change? Write their paths "
            f"(relative to the repository root), one per line, in any order, to /app/{out}.",
            f"List the paths of the files modified or added by the most recent commit of "
            f"the git repository /app/{repo} in /app/{out}, one per line.",
            f"/app/{out} should name every file touched by the HEAD commit of /app/{repo}, "
            f"one path per line (relative to the repository), any order.",
        ))
        solution = f"git -C {repo} show --name-only --format= HEAD > {out}\n"
        check = f'''

def test_files():
    got = [ln.strip() for ln in Path("/app/{out}").read_text().splitlines() if ln.strip()]
    assert sorted(got) == {expected!r}
'''
    tests = (f'"""git-history-facts ({kind}) of {repo}."""\n' + _GIT_TEST.format(repo=repo)
             + check + f'''

def test_repository_unchanged():
    assert git("rev-parse", "HEAD") == {built.commits[-1]!r}
    assert git("status", "--porcelain") == ""
''')
    return Instance(instruction, built.files, solution, tests, tags=("git", "log"))


@family("git-discard-changes", skill="git", split="train")
def git_discard_changes(rng: random.Random) -> Instance:
    """One file's uncommitted change (or deletion) thrown away, another change kept.

    Teaches `git checkout -- PATH` / `git restore PATH` and reading `git status`/`diff`.
    Supports the held-out `git-undo-last-commit` (a commit reverted by a new commit):
    here nothing is committed, only the work tree is restored.
    """
    repo = rng.choice(("repo", "config", "site", "tool"))
    while True:
        history = _history(rng, rng.randint(3, 7))
        state: dict[str, str] = {}
        for _m, ch in history:
            state.update({p: c for p, c in ch.items() if c is not None})
        if len(state) >= 2:
            break
    restore, keep = rng.sample(sorted(state), 2)
    deleted = rng.random() < 0.3
    changes = {keep: state[keep] + f"{rng.choice(NOUNS)} = {rng.randint(1, 99)}\n"}
    if not deleted:
        changes[restore] = rng.choice((state[restore] + "debug = true\n",
                                       f"{rng.choice(NOUNS)} = broken\n"))
    built = _build_repo(repo, history, changes)
    if deleted:
        del built.files[f"{repo}/{restore}"]
    what = "deleted" if deleted else "edited"
    instruction = rng.choice((
        f"In the git repository /app/{repo}, the file {restore} was {what} by mistake and "
        f"the change is not committed. Bring it back to its last committed content; keep "
        f"the uncommitted change to {keep}. Do not make a commit.",
        f"Discard the uncommitted changes to {restore} in /app/{repo} (it must match the "
        f"latest commit again), but leave the work in progress on {keep} as it is and do "
        f"not commit anything.",
        f"/app/{repo} has local changes to {keep} and {restore}. Only the changes to "
        f"{keep} are wanted: restore {restore} to the version in HEAD, without committing "
        f"or touching {keep}.",
    ))
    tests = (f'"""git-discard-changes: {restore} restored, {keep} kept in {repo}."""\n'
             + _GIT_TEST.format(repo=repo)) + f'''

def test_file_restored():
    assert (REPO / "{restore}").read_text() == {state[restore]!r}


def test_other_change_kept():
    assert (REPO / "{keep}").read_text() == {changes[keep]!r}
    assert git("diff", "--name-only") == {keep!r}
    assert git("diff", "--cached", "--name-only") == ""


def test_no_new_commit():
    assert git("rev-parse", "HEAD") == {built.commits[-1]!r}
'''
    return Instance(instruction, built.files,
                    f"git -C {repo} checkout -- {shlex.quote(restore)}\n", tests,
                    tags=("git", "restore"))


# -- data -----------------------------------------------------------------------------

_ORDER_STATUS = ("pending", "shipped", "delivered", "cancelled", "returned")


@family("distinct-column-values", skill="data", split="train")
def distinct_column_values(rng: random.Random) -> Instance:
    """The distinct values of one CSV column (optionally of the rows matching a value),
    sorted, one per line.

    Teaches `cut -d, -f N | sort -u` (and `awk -F,` filters). Supports the held-out
    `count-distinct-values` (how many distinct values) and `unique-emails`: here the
    values themselves are listed.
    """
    customers = rng.sample(NAMES, rng.randint(4, 10))
    cities = rng.sample(CITIES, rng.randint(3, 7))
    products = rng.sample(NOUNS, rng.randint(3, 8))
    header = ["order_id", "customer", "city", "product", "status"]
    while True:
        rows = [[str(5000 + i), rng.choice(customers), rng.choice(cities),
                 rng.choice(products), rng.choice(_ORDER_STATUS)]
                for i in range(rng.randint(15, 40))]
        col = rng.choice(("customer", "city", "product"))
        k = header.index(col)
        status = rng.choice(_ORDER_STATUS) if rng.random() < 0.4 else None
        picked = [r[k] for r in rows if status is None or r[4] == status]
        expected = sorted(set(picked))
        if len(picked) > len(expected) >= 2 and (
                status is None or expected != sorted({r[k] for r in rows})):
            break
    src = rng.choice(("orders.csv", "sales/orders.csv", "export.csv"))
    plural = {"customer": "customers", "city": "cities", "product": "products"}[col]
    out = rng.choice((f"{plural}.txt", "distinct.txt", "values.txt"))
    scope = f" among the orders whose status is {status}" if status else ""
    instruction = rng.choice((
        f"Which different values does the `{col}` column of /app/{src} take{scope}? Write "
        f"each one once to /app/{out}, one per line, in alphabetical order.",
        f"List the distinct {plural}{scope} in the CSV file /app/{src} (header on the first "
        f"line): no duplicates, sorted alphabetically, one per line, in /app/{out}.",
        f"/app/{out} should contain every {col} that occurs in /app/{src}{scope}, each "
        f"exactly once, sorted, one per line.",
    ))
    content = "\n".join(",".join(r) for r in [header, *rows]) + "\n"
    tests = (f'"""distinct-column-values: {col}{" for " + status if status else ""} in '
             f'{src}."""\n' + _HEAD + f'''

def test_values():
    assert lines("/app/{out}") == {expected!r}
''' + untouched_test(src, content))
    if status:
        solution = (f"awk -F, '$5 == \"{status}\" {{ print ${k + 1} }}' {src} | sort -u "
                    f"> {out}\n")
    else:
        solution = f"tail -n +2 {src} | cut -d, -f{k + 1} | sort -u > {out}\n"
    return Instance(instruction, {src: content}, solution, tests,
                    difficulty="medium" if status else "easy", tags=("csv", "sort", "uniq"))


@family("json-lookup", skill="data", split="train")
def json_lookup(rng: random.Random) -> Instance:
    """A value read from JSON records: one record's field, the top record, or a total.

    Teaches `python3 -c` with `json.load` (navigating an object to its list, `max`,
    `sum`). Supports the held-out `count-json-matching` and `convert-records-filtered`
    (counting matches; converting a filtered subset): other goals.
    """
    n = rng.randint(6, 16)
    names = rng.sample(NOUNS, n)
    prices = rng.sample(range(150, 20000), n)
    items = [{"sku": f"{rng.choice('ABCDEFGH')}{1000 + i * 7 + rng.randint(0, 6)}",
              "name": names[i], "price": prices[i] / 100, "stock": rng.randint(0, 80),
              "category": rng.choice(("tools", "garden", "kitchen", "office"))}
             for i in range(n)]
    wrapped = rng.random() < 0.5
    data = {"updated": "2024-05-01", "items": items} if wrapped else items
    src = rng.choice(("inventory.json", "data/products.json", "catalog.json"))
    where = (f"/app/{src} is a JSON object whose `items` key holds a list of products"
             if wrapped else f"/app/{src} holds a JSON array of products")
    load = f"d = json.load(open('{src}'))" + ("['items']" if wrapped else "")
    kind = rng.choice(("field", "top", "total"))
    out = rng.choice(("answer.txt", "result.txt", "value.txt"))
    if kind == "field":
        it = rng.choice(items)
        fld = rng.choice(("name", "stock", "price"))
        expected: object = it[fld]
        instruction = rng.choice((
            f"{where}. What is the `{fld}` of the product with sku {it['sku']}? Write just "
            f"the value to /app/{out}.",
            f"Look up the product whose `sku` is {it['sku']} in /app/{src} (a JSON "
            f"{'object with the list of products under `items`' if wrapped else 'array of products'}) "
            f"and save its {fld} in /app/{out}.",
            f"{where}; /app/{out} should contain the {fld} of the one with sku "
            f"{it['sku']}, and nothing else.",
        ))
        expr = f"[r['{fld}'] for r in d if r['sku'] == '{it['sku']}'][0]"
    elif kind == "top":
        fld = rng.choice(("price", "stock"))
        best = max(items, key=lambda r: (r[fld], r["name"]))
        if sum(r[fld] == best[fld] for r in items) > 1:
            fld = "price"
            best = max(items, key=lambda r: r[fld])
        expected = best["name"]
        adj = "most expensive product" if fld == "price" else "product with the most stock"
        instruction = rng.choice((
            f"{where}. What is the name of the {adj}? Write it to /app/{out}.",
            f"Find the {adj} in /app/{src} (the one with the highest `{fld}`) and save its "
            f"`name` in /app/{out}.",
            f"{where}; /app/{out} should contain the `name` of the record with the largest "
            f"`{fld}`.",
        ))
        expr = f"max(d, key=lambda r: r['{fld}'])['name']"
    else:
        expected = sum(r["stock"] for r in items)
        instruction = rng.choice((
            f"{where}. How many units are in stock in total (the sum of every product's "
            f"`stock`)? Write the number to /app/{out}.",
            f"Add up the `stock` field over all products in /app/{src} and save the total "
            f"in /app/{out}.",
            f"{where}; /app/{out} should contain the total stock, summed over all of them.",
        ))
        expr = "sum(r['stock'] for r in d)"
    content = json.dumps(data, indent=2) + "\n"
    tests = (f'"""json-lookup ({kind}) in {src}."""\n' + _HEAD
             + _value_test(out, expected) + untouched_test(src, content))
    solution = f"python3 -c \"import json; {load}; print({expr})\" > {out}\n"
    return Instance(instruction, {src: content}, solution, tests,
                    difficulty="easy" if kind == "total" else "medium", tags=("json", "python"))


# -- python ---------------------------------------------------------------------------

_CONSTANTS = {  # name -> a function giving (old, new) distinct values
    "TIMEOUT_S": lambda r: r.sample((5, 10, 15, 30, 45, 60, 90, 120), 2),
    "MAX_RETRIES": lambda r: r.sample((1, 2, 3, 4, 5, 8, 10), 2),
    "BATCH_SIZE": lambda r: r.sample((16, 32, 64, 128, 256, 512), 2),
    "LOG_LEVEL": lambda r: r.sample(("DEBUG", "INFO", "WARNING", "ERROR"), 2),
    "SAMPLE_RATE": lambda r: r.sample((0.1, 0.25, 0.5, 0.75, 1.0), 2),
    "REGION": lambda r: r.sample(("eu-west", "us-east", "ap-south", "sa-east"), 2),
    "PORT": lambda r: r.sample((8000, 8080, 8443, 9000, 5000), 2),
}
_FUNCS = (  # name, parameters with defaults, docstring, body
    ("paginate", ("items", ("per_page", (10, 20, 25, 50)), ("start", (0, 1))),
     "Split items into pages of per_page items, beginning at index start.",
     "items = items[start:]\n    return [items[i:i + per_page] for i in range(0, len(items), per_page)]"),
    ("backoff", (("base", (0.5, 1.0, 2.0)), ("factor", (2, 3)), ("steps", (3, 4, 5))),
     "The delays between retries: base, base * factor, base * factor ** 2, ...",
     "return [base * factor ** i for i in range(steps)]"),
    ("truncate", ("text", ("width", (20, 40, 60, 80)), ("suffix", ("...", "~"))),
     "Shorten text to at most width characters, ending with suffix when cut.",
     "if len(text) <= width:\n        return text\n    return text[:width - len(suffix)] + suffix"),
    ("greeting", ("name", ("word", ("Hello", "Hi", "Welcome")), ("mark", ("!", "."))),
     "A greeting for name, such as 'Hello, Ada!'.",
     "return f\"{word}, {name}{mark}\""),
)


def _params(rng: random.Random, spec: tuple) -> list[tuple[str, object | None]]:
    return [(p, None) if isinstance(p, str) else (p[0], rng.choice(p[1])) for p in spec]


def _signature(name: str, params: list[tuple[str, object | None]]) -> str:
    return f"def {name}(" + ", ".join(p if v is None else f"{p}={v!r}" for p, v in params) + "):"


@family("edit-python-setting", skill="python", split="train")
def edit_python_setting(rng: random.Random) -> Instance:
    """A module-level constant's value, or a parameter's default, changed in a Python file.

    Teaches in-place edits of Python source with `sed -i 's/old/new/'` (anchored lines,
    signatures). Supports the held-out `rename-python-function` and
    `add-keyword-argument`: here an existing value changes, no name or parameter is added
    or renamed.
    """
    module = rng.choice(("settings", "config", "defaults", "app_config"))
    names = rng.sample(sorted(_CONSTANTS), rng.randint(3, 5))
    consts = {n: _CONSTANTS[n](rng) for n in names}
    funcs = rng.sample(_FUNCS, 2)
    sigs = {}
    parts = []
    for fname, spec, doc, body in funcs:
        params = _params(rng, spec)
        sigs[fname] = params
        parts.append(f'{_signature(fname, params)}\n    """{doc}"""\n    {body}\n')
    head = (f'"""Settings of the {rng.choice(SERVICES)} service."""\n\n'
            + "".join(f"{n} = {old!r}\n" for n, (old, _new) in consts.items()))
    text = head + "\n\n" + "\n\n".join(parts)
    kind = rng.choice(("constant", "default"))
    if kind == "constant":
        const = rng.choice(names)
        old, new = consts[const]
        before, after = f"{const} = {old!r}", f"{const} = {new!r}"
        values = {n: (new if n == const else o) for n, (o, _x) in consts.items()}
        instruction = rng.choice((
            f"In /app/{module}.py, change the value of {const} from {old!r} to {new!r}. "
            f"Nothing else in the file may change.",
            f"The setting {const} in /app/{module}.py must become {new!r} (it is {old!r} "
            f"now). Edit the file in place and keep all other settings.",
            f"Update /app/{module}.py so that {const} is {new!r} instead of {old!r}; the "
            f"other constants and the functions stay as they are.",
        ))
        check = f'''

def test_constants():
    mod = load()
    assert {{n: getattr(mod, n) for n in {sorted(values)!r}}} == {values!r}
'''
        defaults = {f: {p: v for p, v in ps if v is not None} for f, ps in sigs.items()}
    else:
        fname = rng.choice(sorted(sigs))
        params = sigs[fname]
        spec = next(s for f, s, _d, _b in funcs if f == fname)
        choices = {p[0]: p[1] for p in spec if not isinstance(p, str)}
        pname = rng.choice(sorted(choices))
        old = dict(params)[pname]
        new = rng.choice([v for v in choices[pname] if v != old])
        new_params = [(p, new if p == pname else v) for p, v in params]
        before, after = _signature(fname, params), _signature(fname, new_params)
        defaults = {f: {p: v for p, v in (new_params if f == fname else ps) if v is not None}
                    for f, ps in sigs.items()}
        values = {n: o for n, (o, _x) in consts.items()}
        instruction = rng.choice((
            f"Change the default value of the parameter `{pname}` of `{fname}` in "
            f"/app/{module}.py from {old!r} to {new!r}. Keep its other parameters and "
            f"the rest of the file as they are.",
            f"`{fname}` (in /app/{module}.py) should use {new!r} as the default for "
            f"`{pname}` (it is {old!r} now). Edit the file in place.",
            f"Update /app/{module}.py: calls to `{fname}` that leave out `{pname}` must get "
            f"{new!r} instead of {old!r}. Do not rename or add parameters.",
        ))
        check = f'''

def test_constants_unchanged():
    mod = load()
    assert {{n: getattr(mod, n) for n in {sorted(values)!r}}} == {values!r}
'''
    assert text.count(before) == 1
    tests = f'''"""edit-python-setting ({kind}): {before!r} -> {after!r} in {module}.py."""
import importlib.util
import inspect


def load():
    spec = importlib.util.spec_from_file_location("{module}", "/app/{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
''' + check + f'''

def test_defaults():
    mod = load()
    for fname, want in {defaults!r}.items():
        params = inspect.signature(getattr(mod, fname)).parameters
        got = {{p: v.default for p, v in params.items()
               if v.default is not inspect.Parameter.empty}}
        assert got == want, fname
'''
    sed_old = re.sub(r"([.*\[\]^$\\/])", r"\\\1", before)   # a basic regular expression
    sed_new = re.sub(r"([\\/&])", r"\\\1", after)
    solution = f"sed -i {shlex.quote(f's/^{sed_old}$/{sed_new}/')} {module}.py\n"
    return Instance(instruction, {f"{module}.py": text}, solution, tests,
                    tags=("python", "sed", "edit"), agent_timeout_s=300)
