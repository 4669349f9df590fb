"""Chunking: size bounds, exact offsets, overlap, boundary preferences, code awareness."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ridgeline.platform.chunking import Chunk, chunk_id, chunk_text, looks_like_code


def _sentences(n: int, words: int = 9, tag: str = "s") -> list[str]:
    return [" ".join(f"{tag}{i}w{j}" for j in range(words)).capitalize() + "."
            for i in range(n)]


def _check_invariants(text: str, chunks: list[Chunk], size: int, overlap: int) -> None:
    covered = [False] * len(text)
    for i, c in enumerate(chunks):
        assert c.index == i
        assert c.text == text[c.start:c.end]
        assert c.text.strip() and len(c.text) <= size
        for p in range(c.start, c.end):
            covered[p] = True
    for prev, nxt in zip(chunks, chunks[1:]):
        assert nxt.start > prev.start and nxt.end > prev.end
        assert prev.end - nxt.start <= overlap
    # every character that is not whitespace is in some chunk
    missing = [p for p, ch in enumerate(text) if not ch.isspace() and not covered[p]]
    assert missing == []


def test_empty_and_short_texts() -> None:
    assert chunk_text("") == []
    assert chunk_text(" \n\n\t ") == []
    [only] = chunk_text("  One short paragraph.\n")
    assert (only.text, only.start, only.end) == ("One short paragraph.", 2, 22)


def test_paragraph_boundaries_are_preferred() -> None:
    paragraphs = [" ".join(_sentences(5, tag=f"p{k}")) for k in range(8)]  # ~290 chars each
    text = "\n\n".join(paragraphs)
    chunks = chunk_text(text, size=800, overlap=0)
    _check_invariants(text, chunks, 800, 0)
    assert len(chunks) > 1
    for c in chunks:
        # each chunk is a run of whole paragraphs
        assert c.text.split("\n\n") == paragraphs[paragraphs.index(c.text.split("\n\n")[0]):][
            :len(c.text.split("\n\n"))]


def test_one_long_paragraph_is_cut_at_sentence_ends_with_overlap() -> None:
    text = " ".join(_sentences(60))
    chunks = chunk_text(text, size=400, overlap=120)
    _check_invariants(text, chunks, 400, 120)
    assert len(chunks) >= 6
    for c in chunks:
        assert c.text.endswith(".") and c.text[0].isupper()
    for prev, nxt in zip(chunks, chunks[1:]):
        shared = text[nxt.start:prev.end]
        assert shared and shared.endswith(".")     # whole sentences carried over


def test_markdown_heading_starts_a_chunk() -> None:
    body = " ".join(_sentences(6))
    text = f"# Intro\n{body}\n## Details\n{body}"
    chunks = chunk_text(text, size=len(body) + 40, overlap=0)
    assert [c.text.splitlines()[0] for c in chunks] == ["# Intro", "## Details"]


def test_words_longer_than_the_size_are_cut() -> None:
    text = "start " + "x" * 2500 + " end"
    chunks = chunk_text(text, size=1000, overlap=50)
    _check_invariants(text, chunks, 1000, 50)
    assert "".join(c.text for c in chunks if "x" in c.text).count("x") >= 2500


def test_size_in_tokens() -> None:
    text = " ".join(_sentences(40))

    def words(s: str) -> int:
        return len(s.split())

    chunks = chunk_text(text, size=50, overlap=10, length=words)
    assert len(chunks) > 1
    assert all(words(c.text) <= 50 for c in chunks)
    assert max(words(c.text) for c in chunks) > 40        # packed, not one sentence each
    assert all(c.text == text[c.start:c.end] for c in chunks)


PY_SOURCE = '''"""A module."""

import os


def first(x):
    """Add one."""
    y = x + 1

    return y


@decorator
def second(items):
    total = 0
    for item in items:
        total += item
    return {
        "total": total,
    }


class Third:
    def method(self):
        return os.getcwd()

    def other(self):
        return 2
'''


def test_code_is_cut_before_top_level_definitions() -> None:
    chunks = chunk_text(PY_SOURCE, size=140, overlap=0, code=True)
    _check_invariants(PY_SOURCE, chunks, 140, 0)
    starts = [c.text.splitlines()[0] for c in chunks]
    # a definition with its decorator fits in 140 characters, so none is cut
    assert starts[0] == '"""A module."""' and {"@decorator", "class Third:"} <= set(starts)
    assert set(starts) <= {'"""A module."""', "def first(x):", "@decorator", "class Third:"}
    # never cut before a closing bracket: it stays with its block
    assert not any(c.text.lstrip().startswith("}") for c in chunks)


def test_code_chunks_keep_the_first_lines_indentation() -> None:
    chunks = chunk_text(PY_SOURCE, size=60, overlap=0, code=True)
    inner = [c for c in chunks if c.text.startswith(" ")]
    assert inner, "a small size must cut inside a definition"
    for c in inner:
        line_start = PY_SOURCE.rfind("\n", 0, c.start) + 1
        assert PY_SOURCE[line_start:c.start] == ""          # starts at a line start


def test_code_is_cut_between_lines_only() -> None:
    chunks = chunk_text(PY_SOURCE, size=80, overlap=30, code=True)
    lines = set(PY_SOURCE.splitlines())
    for c in chunks:
        assert all(line in lines for line in c.text.splitlines()[1:])


def test_deterministic_and_stable_ids() -> None:
    text = " ".join(_sentences(30))
    assert chunk_text(text, size=300, overlap=60) == chunk_text(text, size=300, overlap=60)
    assert chunk_id("docs/a.md", 3) == chunk_id("docs/a.md", 3) != chunk_id("docs/a.md", 4)
    assert chunk_id("a", 1) != chunk_id("b", 1)


def test_looks_like_code() -> None:
    assert looks_like_code("src/app/main.py") and looks_like_code("LIB.RS")
    assert not looks_like_code("README.md") and not looks_like_code(None)
    assert not looks_like_code("notes")


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        chunk_text("text", size=0)
    with pytest.raises(ValueError):
        chunk_text("text", size=100, overlap=60)


_ALPHABET = st.sampled_from(list("abc xyz.!?\n\n\t#}") + ["word ", "Sentence. ", "\n\n"])


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(_ALPHABET, max_size=300), size=st.integers(8, 120),
       frac=st.floats(0, 0.5), code=st.booleans())
def test_invariants_hold_for_any_text(pieces: list[str], size: int, frac: float,
                                      code: bool) -> None:
    text = "".join(pieces)
    overlap = int(size * frac)
    chunks = chunk_text(text, size=size, overlap=overlap, code=code)
    _check_invariants(text, chunks, size, overlap)
    assert bool(chunks) == bool(re.search(r"\S", text))


def test_an_overlap_never_swallows_the_previous_chunk() -> None:
    # found by hypothesis: a short chunk "ce." was followed by "ce. a" from the same start
    text = "a" * 10 + "Sentence. a"
    chunks = chunk_text(text, size=8, overlap=4)
    _check_invariants(text, chunks, 8, 4)
