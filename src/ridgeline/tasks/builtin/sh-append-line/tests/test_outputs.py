"""sh-append-line: /app/notes.txt gained a last line `buy milk`."""

from pathlib import Path

NOTES = Path("/app/notes.txt")


def test_lines():
    lines = [line.rstrip() for line in NOTES.read_text().rstrip("\n").split("\n")]
    assert lines == ["wake up", "make coffee", "buy milk"]
