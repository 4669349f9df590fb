"""Ordering and ranking: numbers, CSV rows, word frequencies, medians."""

from __future__ import annotations

import random
import re
from collections import Counter

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.checks import untouched_test
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES


@family("sort-numbers", skill="sorting", split="train")
def sort_numbers(rng: random.Random) -> Instance:
    """A file of integers put in numeric order (ascending or descending) in another file."""
    n = rng.randint(12, 40)
    low = rng.choice((-500, -50, 0, 1))
    values = rng.sample(range(low, rng.choice((999, 5000, 40000))), n)
    # Numeric order must differ from the order of the text, so a plain text sort fails.
    values[rng.randrange(n)] = rng.randint(1, 9)
    values[rng.randrange(n)] = rng.randint(10000, 99999)
    values = list(dict.fromkeys(values))
    descending = rng.random() < 0.4
    expected = sorted(values, reverse=descending)
    assert expected != sorted(values, key=str, reverse=descending)
    src = rng.choice(("numbers.txt", "values.txt", "readings.txt", "data/ids.txt", "input.txt"))
    out = rng.choice(("sorted.txt", "ordered.txt", "result.txt", "numbers_sorted.txt"))
    order = "largest to smallest" if descending else "smallest to largest"
    word = "descending" if descending else "ascending"
    instruction = rng.choice((
        f"/app/{src} holds one integer per line. Write the same integers to /app/{out}, one "
        f"per line, ordered by numeric value from {order}. Leave /app/{src} as it is.",
        f"Put the numbers of /app/{src} in {word} numeric order (by value, not as text) and "
        f"save them, one per line, as /app/{out}; do not modify the original file.",
        f"I need the integers listed in /app/{src} arranged from {order}. Write them, one "
        f"per line and nothing else, to /app/{out} (keep /app/{src} unchanged).",
    ))
    content = "\n".join(map(str, values)) + "\n"
    tests = f'''"""sort-numbers: {len(values)} integers of {src}, {word}."""
import hashlib
from pathlib import Path

EXPECTED = {[str(v) for v in expected]!r}


def test_numbers_are_sorted():
    lines = [ln.strip() for ln in Path("/app/{out}").read_text().splitlines() if ln.strip()]
    assert lines == EXPECTED
''' + untouched_test(src, content)
    flags = "-nr" if descending else "-n"
    return Instance(instruction, {src: content}, f"sort {flags} {src} > {out}\n", tests,
                    tags=("sort", "numbers"))


_NUMERIC_COLUMNS = {  # column -> range of values
    "age": (18, 90), "score": (0, 1000), "hours": (1, 400), "points": (0, 5000),
    "visits": (0, 2500), "height_cm": (140, 210),
}


def _people(rng: random.Random, n: int, numeric: list[str]) -> tuple[list[str], list[list[str]]]:
    """A header and `n` rows: a unique name, a team, then the `numeric` columns (each
    column's values unique)."""
    names = [a.capitalize() + " " + b.capitalize()
             for a, b in zip(rng.sample(NAMES, n), rng.choices(NOUNS, k=n))]
    teams = rng.sample(SERVICES, rng.randint(3, 5))
    cols = {c: rng.sample(range(*_NUMERIC_COLUMNS[c]), n) for c in numeric}
    header = ["name", rng.choice(("team", "group", "dept")), *numeric]
    rows = [[names[i], rng.choice(teams), *(str(cols[c][i]) for c in numeric)]
            for i in range(n)]
    return header, rows


@family("sort-csv-by-column", skill="sorting", split="train")
def sort_csv_by_column(rng: random.Random) -> Instance:
    """The rows of a CSV file ordered by one numeric column, header kept first."""
    numeric = rng.sample(sorted(_NUMERIC_COLUMNS), rng.randint(2, 3))
    n = rng.randint(8, 20)
    header, rows = _people(rng, n, numeric)
    key = rng.choice(numeric)
    k = header.index(key)
    descending = rng.random() < 0.5
    expected = [header] + sorted(rows, key=lambda r: int(r[k]), reverse=descending)
    src = rng.choice(("people.csv", "members.csv", "roster.csv", "staff.csv"))
    out = rng.choice(("sorted.csv", f"by_{key}.csv", "ranked.csv", "report.csv"))
    word = "descending (largest first)" if descending else "ascending (smallest first)"
    instruction = rng.choice((
        f"Write a copy of /app/{src} to /app/{out} with the data rows ordered by the "
        f"`{key}` column, {word}, compared as numbers. The header line must stay the first "
        f"line, and the original file must not change.",
        f"/app/{src} is a CSV file with a header. Create /app/{out} containing the header "
        f"followed by all of its rows in {word.split(' ')[0]} numeric order of `{key}`. "
        f"Do not edit /app/{src}.",
        f"Produce /app/{out}: the same CSV as /app/{src} (same header, same rows, same "
        f"columns) but with the rows ranked by {key}, {word}.",
    ))
    content = "\n".join(",".join(r) for r in [header, *rows]) + "\n"
    tests = f'''"""sort-csv-by-column: {src} rows by {key}, {word.split(' ')[0]}."""
import csv
import hashlib
from pathlib import Path

EXPECTED = {expected!r}


def test_rows_are_ordered():
    with open("/app/{out}", newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    assert rows[0] == EXPECTED[0], "the header must be the first line"
    assert rows == EXPECTED
''' + untouched_test(src, content)
    flags = f"-t, -k{k + 1},{k + 1}n" + ("r" if descending else "")
    solution = f"{{ head -n 1 {src}; tail -n +2 {src} | sort {flags}; }} > {out}\n"
    return Instance(instruction, {src: content}, solution, tests, difficulty="medium",
                    tags=("sort", "csv"))


@family("top-three-words", skill="sorting", split="heldout")
def top_three_words(rng: random.Random) -> Instance:
    """The 3 most frequent words of a text with their counts, most frequent first."""
    vocab = rng.sample(NOUNS, rng.randint(8, 14))
    top = sorted(rng.sample(range(6, 16), 3), reverse=True)
    counts = dict(zip(vocab[:3], top))
    for w in vocab[3:]:
        counts[w] = rng.randint(1, top[2] - 1)
    tokens = [w for w, c in counts.items() for _ in range(c)]
    rng.shuffle(tokens)
    lines, i = [], 0
    while i < len(tokens):
        m = rng.randint(4, 10)
        words = tokens[i:i + m]
        i += m
        words[0] = words[0].capitalize()
        for j in range(1, len(words) - 1):
            if rng.random() < 0.12:
                words[j] += ","
        if rng.random() < 0.2:
            w = rng.randrange(len(words))
            words[w] = words[w].upper()
        lines.append(" ".join(words) + rng.choice((".", ".", "!", "?", ";")))
    text = "\n".join(lines) + "\n"
    found = Counter(re.findall(r"[a-z]+", text.lower()))
    ranked = found.most_common()
    assert ranked[2][1] > ranked[3][1] and ranked[0][1] > ranked[1][1] > ranked[2][1]
    expected = [f"{w} {c}" for w, c in ranked[:3]]
    src = rng.choice(("story.txt", "essay.txt", "notes.txt", "chapter1.txt", "speech.txt"))
    out = rng.choice(("top3.txt", "frequent.txt", "top_words.txt", "answer.txt"))
    instruction = rng.choice((
        f"Which 3 words occur most often in /app/{src}? Compare words case-insensitively "
        f"and ignore punctuation. Write them to /app/{out}, most frequent first, one per "
        f"line as `<word> <count>` with the word in lower case.",
        f"Find the three most frequent words of /app/{src} (a word is a run of letters; "
        f"\"Apple\" and \"apple\" are the same word) and save them to /app/{out}: one line "
        f"each, `word count`, lower-case word, highest count first.",
        f"Rank the words of /app/{src} by how many times they appear (ignoring case and "
        f"punctuation) and put the top 3 in /app/{out}, one `<word> <count>` line each, "
        f"in order of decreasing count, words in lower case.",
    ))
    tests = f'''"""top-three-words: the 3 most frequent words of {src}."""
import hashlib
from pathlib import Path

EXPECTED = {expected!r}


def test_top_three():
    lines = [" ".join(ln.split()) for ln in Path("/app/{out}").read_text().splitlines()
             if ln.strip()]
    assert lines == EXPECTED
''' + untouched_test(src, text)
    solution = (f"tr 'A-Z' 'a-z' < {src} | tr -cs 'a-z' '\\n' | grep -v '^$' | sort | uniq -c "
                f"| sort -k1,1nr | head -n 3 | awk '{{print $2, $1}}' > {out}\n")
    return Instance(instruction, {src: text}, solution, tests, difficulty="medium",
                    tags=("sort", "uniq", "words"))


@family("median-of-column", skill="sorting", split="heldout")
def median_of_column(rng: random.Random) -> Instance:
    """The median of one numeric column of a CSV file, written to a file."""
    numeric = rng.sample(sorted(_NUMERIC_COLUMNS), 3)
    while True:
        header, rows = _people(rng, rng.choice(range(7, 26, 2)), numeric)
        key = rng.choice(numeric)
        k = header.index(key)
        vals = [int(r[k]) for r in rows]
        median = sorted(vals)[len(vals) // 2]
        mean = sum(vals) / len(vals)
        # The answer must not be the middle row as given, nor (rounded) the mean.
        if vals[len(vals) // 2] != median and round(mean) != median:
            break
    src = rng.choice(("people.csv", "survey.csv", "players.csv", "stats.csv"))
    out = rng.choice(("median.txt", f"{key}_median.txt", "answer.txt"))
    instruction = rng.choice((
        f"What is the median of the `{key}` column of /app/{src}? (The file has an odd "
        f"number of data rows, so the median is one of the values.) Write just that number "
        f"to /app/{out}.",
        f"Compute the median {key} over all rows of the CSV file /app/{src} (header on the "
        f"first line, an odd number of rows) and save it, and nothing else, in /app/{out}.",
        f"/app/{out} should contain the middle value of the `{key}` column of /app/{src} "
        f"once its values are put in numeric order (there is an odd number of rows).",
    ))
    content = "\n".join(",".join(r) for r in [header, *rows]) + "\n"
    tests = f'''"""median-of-column: median {key} of {src} is {median}."""
import hashlib
from pathlib import Path


def test_median():
    assert float(Path("/app/{out}").read_text().strip()) == {median}
''' + untouched_test(src, content)
    solution = (f"tail -n +2 {src} | cut -d, -f{k + 1} | sort -n "
                f"| awk '{{v[NR] = $1}} END {{print v[(NR + 1) / 2]}}' > {out}\n")
    return Instance(instruction, {src: content}, solution, tests, difficulty="medium",
                    tags=("sort", "median", "csv"))
