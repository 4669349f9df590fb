"""sh-copy-file: /app/report_copy.txt is a copy of /app/report.txt."""

from pathlib import Path

REPORT = 'quarterly report\nrevenue: 1200\ncosts: 800\n'


def test_original_kept():
    assert Path("/app/report.txt").read_text() == REPORT


def test_copy():
    copy = Path("/app/report_copy.txt")
    assert copy.is_file() and not copy.is_symlink(), "/app/report_copy.txt is not a file"
    assert copy.read_text() == REPORT
