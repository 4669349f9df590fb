"""sh-unique-lines: /app/unique.txt is the sorted distinct names of visitors.txt."""

from pathlib import Path


def test_unique_sorted():
    lines = Path("/app/unique.txt").read_text().strip().splitlines()
    assert [line.strip() for line in lines] == ["anna", "bob", "tom", "zoe"]
