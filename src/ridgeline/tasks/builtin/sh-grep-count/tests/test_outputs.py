"""sh-grep-count: /app/failures.txt holds 3, the number of FAIL lines."""

from pathlib import Path


def test_failures_file_exists():
    assert Path("/app/failures.txt").is_file()


def test_count():
    words = Path("/app/failures.txt").read_text().split()
    assert words and words[0] == "3"
