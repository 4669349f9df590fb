"""sh-count-csv-files: /app/csv_count.txt holds 4."""

from pathlib import Path


def test_count_file_exists():
    assert Path("/app/csv_count.txt").is_file()


def test_count():
    words = Path("/app/csv_count.txt").read_text().split()
    assert words and words[0] == "4"
