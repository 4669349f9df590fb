"""sh-write-greeting: /app/greeting.txt holds the line `good morning`."""

from pathlib import Path

OUT = Path("/app/greeting.txt")


def test_file_exists():
    assert OUT.is_file(), "/app/greeting.txt does not exist"


def test_content():
    assert OUT.read_text().strip() == "good morning"
