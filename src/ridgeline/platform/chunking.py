"""Splitting a document into overlapping chunks small enough to embed.

The text is first cut into *units* (sentences and lines of prose, lines of source code),
each with the strength of the boundary in front of it: a paragraph or heading is a strong
place to cut, a sentence end a weaker one, a line wrap weaker still, and a cut inside a
word the last resort. Units are packed greedily into chunks of at most `size` (measured by
`length`: characters by default, or tokens with a tokenizer's counter); when a chunk is
full it ends at the strongest boundary in its last two thirds (before a paragraph or a
definition) or its second half (a weaker one), so chunks rarely start mid-thought. Each
chunk after the first is packed to `size - overlap` and then takes whole units from the
end of the previous one, up to `overlap`, so a passage cut in two still appears whole in
one of them.

Source code is cut between lines only, preferring a blank line followed by a line at
column 0 (a new top-level definition, its decorators or comment), then a blank line
inside a block, and never before a closing bracket.

Everything is deterministic: the same text and settings give the same chunks and ids.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

#: file extensions chunked as source code
CODE_EXTENSIONS = frozenset({
    ".py", ".pyi", ".js", ".jsx", ".ts", ".tsx", ".mjs", ".cjs", ".go", ".rs", ".java",
    ".kt", ".kts", ".scala", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cs", ".swift",
    ".rb", ".php", ".lua", ".sh", ".bash", ".zsh", ".pl", ".r", ".jl", ".ex", ".exs", ".erl",
    ".hs", ".ml", ".sql", ".toml", ".yaml", ".yml", ".json", ".tf", ".proto", ".m", ".dart",
})

# boundary strengths
_WORD, _WRAP, _SENTENCE, _PARAGRAPH = 0, 1, 2, 3

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
# a sentence end (with closing quotes/brackets and the spaces after it) or a line break
_SENTENCE_OR_LINE = re.compile(r"[.!?][\"')\]]*[ \t]+|[.!?][\"')\]]*\n\s*|\n\s*")
_WORD_UNIT = re.compile(r"\S+\s*|\s+")
_CLOSERS = tuple(")]}")


@dataclass(frozen=True)
class Chunk:
    index: int          # position in the document, from 0
    text: str           # the document's text[start:end]
    start: int          # character offsets into the document
    end: int


def chunk_id(doc_id: str, index: int) -> str:
    """A chunk's stable name: the same document id and position give the same id."""
    return f"{doc_id}#{index}"


def looks_like_code(name: str | None) -> bool:
    """Whether a file name (or path) is source code by its extension."""
    return bool(name) and PurePosixPath(str(name).lower()).suffix in CODE_EXTENSIONS


@dataclass(frozen=True)
class _Unit:
    start: int
    end: int
    strength: int       # of the boundary before this unit


def _prose_units(text: str) -> list[_Unit]:
    units: list[_Unit] = []
    para_start = 0
    breaks = [m.end() for m in _PARAGRAPH_BREAK.finditer(text)] + [len(text)]
    for para_end in breaks:
        if para_end <= para_start:
            continue
        pos, strength = para_start, _PARAGRAPH
        for m in _SENTENCE_OR_LINE.finditer(text, para_start, para_end):
            if m.end() <= pos:
                continue
            units.append(_Unit(pos, m.end(), strength))
            pos = m.end()
            strength = _WRAP if m.group().startswith("\n") else _SENTENCE
            # a Markdown heading starts a section
            if text.startswith("#", pos):
                strength = _PARAGRAPH
        if pos < para_end:
            units.append(_Unit(pos, para_end, strength))
        para_start = para_end
    return units


def _code_units(text: str) -> list[_Unit]:
    units: list[_Unit] = []
    pos = 0
    prev_blank = True
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if not stripped:
            strength = _WORD                    # keep blank lines with what precedes them
        elif stripped.startswith(_CLOSERS):
            strength = _WORD                    # a closing bracket stays with its block
        elif prev_blank and not line[0].isspace():
            strength = _PARAGRAPH               # a new top-level definition
        elif prev_blank:
            strength = _SENTENCE                # a new block inside a definition
        else:
            strength = _WRAP
        units.append(_Unit(pos, pos + len(line), strength))
        pos += len(line)
        prev_blank = not stripped
    return units


def _split_long(text: str, unit: _Unit, size: int, length: Callable[[str], int]) -> list[_Unit]:
    """Cut a unit longer than `size` at spaces, and a word longer than `size` anywhere."""
    out: list[_Unit] = []
    strength = unit.strength
    for m in _WORD_UNIT.finditer(text, unit.start, unit.end):
        start, end = m.start(), m.end()
        while length(text[start:end]) > size:
            # the longest prefix that fits (binary search: `length` may be a tokenizer)
            lo, hi = start + 1, end
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if length(text[start:mid]) <= size:
                    lo = mid
                else:
                    hi = mid - 1
            out.append(_Unit(start, lo, strength))
            start, strength = lo, _WORD
        out.append(_Unit(start, end, strength))
        strength = _WORD
    return out


def _units(text: str, code: bool, size: int, length: Callable[[str], int]) -> list[_Unit]:
    units = _code_units(text) if code else _prose_units(text)
    out: list[_Unit] = []
    for u in units:
        if length(text[u.start:u.end]) > size:
            out.extend(_split_long(text, u, size, length))
        else:
            out.append(u)
    return out


def _groups(text: str, units: list[_Unit], size: int, overlap: int,
            length: Callable[[str], int]) -> list[tuple[int, int]]:
    """Partition units into consecutive [start, end) index ranges, each ending at the
    strongest boundary it may end at. The first fills up to `size`, the others up to
    `size - overlap`, leaving room for the overlap taken from the group before."""
    groups: list[tuple[int, int]] = []
    s, n = 0, len(units)
    while s < n:
        budget = size if s == 0 else size - overlap
        e = s + 1                               # each unit fits alone (see _units)
        while e < n and length(text[units[s].start:units[e].end]) <= budget:
            e += 1
        if e < n:
            # cut before unit c: the strongest boundary, the latest among equals, once the
            # chunk is a third full (before a paragraph or definition) or half full
            def full_enough(c: int) -> bool:
                fill = length(text[units[s].start:units[c - 1].end])
                return fill * (3 if units[c].strength == _PARAGRAPH else 2) >= budget

            cuts = [c for c in range(s + 1, e + 1) if full_enough(c)]
            if cuts:
                e = max(cuts, key=lambda c: (units[c].strength, c))
        groups.append((s, e))
        s = e
    return groups


def chunk_text(text: str, *, size: int = 800, overlap: int = 100, code: bool = False,
               length: Callable[[str], int] = len) -> list[Chunk]:
    """Split `text` into chunks of at most `size` (by `length`) that overlap by up to
    `overlap`. Whitespace-only chunks are dropped and each chunk is stripped of the
    whitespace around it, except a code chunk's first indentation (its offsets say where
    it is)."""
    if size < 1:
        raise ValueError(f"chunk size must be positive, got {size}")
    if not 0 <= overlap <= size // 2:
        raise ValueError(f"chunk overlap must be between 0 and half the size, got {overlap}")
    units = _units(text, code, size, length)
    chunks: list[Chunk] = []
    for s, e in _groups(text, units, size, overlap, length):
        # take whole units from the previous group while they fit the overlap and the size,
        # never back to where the previous chunk starts (it would hold that whole chunk)
        o = s
        while (o > 0 and chunks and units[o - 1].start > chunks[-1].start
               and length(text[units[o - 1].start:units[s].start]) <= overlap
               and length(text[units[o - 1].start:units[e - 1].end]) <= size):
            o -= 1
        start, end = units[o].start, units[e - 1].end
        while start < end and text[start].isspace():
            start += 1
        if code:    # keep the first line's indentation: it says where the code sits
            start = max(units[o].start, text.rfind("\n", units[o].start, start) + 1)
        while end > start and text[end - 1].isspace():
            end -= 1
        if start < end:
            chunks.append(Chunk(len(chunks), text[start:end], start, end))
    return chunks
