"""sh-concat-files: /app/ab.txt is a.txt followed by b.txt."""

from pathlib import Path

A, B = 'first part\nmore of the first\n', 'second part\n'


def test_concatenated():
    lines = [line.rstrip() for line in Path("/app/ab.txt").read_text().strip().splitlines()]
    assert lines == (A + B).splitlines()
