"""sh-write-three-lines: /app/colors.txt is red, green, blue on three lines."""

from pathlib import Path

OUT = Path("/app/colors.txt")


def test_file_exists():
    assert OUT.is_file(), "/app/colors.txt does not exist"


def test_three_lines():
    lines = [line.strip() for line in OUT.read_text().strip().splitlines()]
    assert lines == ["red", "green", "blue"]
