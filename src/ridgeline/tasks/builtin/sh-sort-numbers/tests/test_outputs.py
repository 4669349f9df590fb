"""sh-sort-numbers: /app/sorted.txt is numbers.txt sorted numerically."""

from pathlib import Path


def test_sorted_numerically():
    lines = Path("/app/sorted.txt").read_text().strip().splitlines()
    assert [line.strip() for line in lines] == ["3", "7", "9", "25", "42", "100"]
