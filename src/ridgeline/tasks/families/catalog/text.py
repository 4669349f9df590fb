"""Text processing and counting over generated files."""

from __future__ import annotations

import random

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.words import LEVELS, NOUNS, SERVICES


def _log_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for i in range(n):
        svc = rng.choice(SERVICES)
        level = rng.choice(LEVELS)
        msg = " ".join(rng.choice(NOUNS) for _ in range(rng.randint(2, 6)))
        lines.append(f"2024-05-{rng.randint(1, 28):02d} {i % 24:02d}:{rng.randint(0, 59):02d} "
                     f"[{level}] {svc}: {msg}")
    return lines


@family("count-level-lines", skill="counting", split="train")
def count_level_lines(rng: random.Random) -> Instance:
    """How many lines of a log have one level (a count written to a file)."""
    lines = _log_lines(rng, rng.randint(20, 80))
    level = rng.choice(LEVELS)
    expected = sum(f"[{level}]" in line for line in lines)
    log = f"{rng.choice(SERVICES)}.log"
    out = rng.choice(("count.txt", "answer.txt", f"{level.lower()}_count.txt"))
    instruction = rng.choice((
        f"How many lines of /app/{log} are at level {level}? Write just the number to "
        f"/app/{out}.",
        f"Count the {level} entries in the log file /app/{log} (lines marked [{level}]) and "
        f"save the count, and nothing else, in /app/{out}.",
        f"/app/{out} should contain the number of [{level}] lines in /app/{log}.",
    ))
    tests = f'''"""count-level-lines: {expected} [{level}] lines in {log}."""
from pathlib import Path


def test_count_is_written():
    assert Path("/app/{out}").read_text().strip() == "{expected}"


def test_log_is_untouched():
    assert len(Path("/app/{log}").read_text().splitlines()) == {len(lines)}
'''
    return Instance(instruction, {log: "\n".join(lines) + "\n"},
                    f"grep -cF '[{level}]' {log} > {out} || true\n", tests,
                    tags=("grep", "count"))


@family("longest-line", skill="text", split="heldout")
def longest_line(rng: random.Random) -> Instance:
    """The longest line of a file, copied to another file."""
    lines = [" ".join(rng.choice(NOUNS) for _ in range(rng.randint(1, 7)))
             for _ in range(rng.randint(8, 30))]
    i = rng.randrange(len(lines))  # made strictly the longest: one right answer
    others = max((len(x) for j, x in enumerate(lines) if j != i), default=0)
    while len(lines[i]) <= others:
        lines[i] += " " + rng.choice(NOUNS)
    answer = lines[i]
    src = rng.choice(("notes.txt", "phrases.txt", "lines.txt", "input.txt"))
    out = rng.choice(("longest.txt", "answer.txt", "result.txt"))
    instruction = rng.choice((
        f"Find the longest line in /app/{src} and write that line (only it) to /app/{out}.",
        f"Which line of /app/{src} has the most characters? Put it in /app/{out}.",
        f"Save the longest line of /app/{src} into /app/{out}.",
    ))
    tests = f'''"""longest-line: the longest line of {src}."""
from pathlib import Path


def test_longest_line():
    assert Path("/app/{out}").read_text().strip("\\n") == {answer!r}
'''
    solution = (f"awk '{{ if (length($0) > max) {{ max = length($0); line = $0 }} }} "
                f"END {{ print line }}' {src} > {out}\n")
    return Instance(instruction, {src: "\n".join(lines) + "\n"}, solution, tests,
                    tags=("awk", "text"))
