"""sh-head-lines: /app/first.txt is the first 3 lines of log.txt."""

from pathlib import Path


def test_first_three():
    lines = Path("/app/first.txt").read_text().strip().splitlines()
    assert [line.strip() for line in lines] == ["line 1", "line 2", "line 3"]
