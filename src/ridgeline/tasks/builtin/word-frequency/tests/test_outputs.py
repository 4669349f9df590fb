"""word-frequency: the top 5 words with counts, ties alphabetical."""

import re
from collections import Counter
from pathlib import Path

TEXT = (Path(__file__).parent / "book.txt").read_text()


def expected():
    counts = Counter(re.findall(r"[a-z]+", TEXT.lower()))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    return [f"{w} {c}" for w, c in ranked]


def test_output_exists():
    assert Path("/app/top_words.txt").is_file()


def test_top_words():
    lines = [ln.strip() for ln in Path("/app/top_words.txt").read_text().splitlines()
             if ln.strip()]
    assert [" ".join(ln.split()) for ln in lines] == expected()
