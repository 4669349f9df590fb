"""sh-sort-lines: /app/sorted.txt is fruits.txt sorted."""

from pathlib import Path

FRUITS = 'pear\napple\nmango\nbanana\ncherry\nkiwi\n'


def test_sorted():
    lines = Path("/app/sorted.txt").read_text().strip().splitlines()
    assert [line.strip() for line in lines] == sorted(FRUITS.split())


def test_input_kept():
    assert Path("/app/fruits.txt").read_text() == FRUITS
