"""sh-tail-lines: /app/last.txt is the last 2 lines of log.txt."""

from pathlib import Path


def test_last_two():
    lines = Path("/app/last.txt").read_text().strip().splitlines()
    assert [line.strip() for line in lines] == ["line 9", "line 10"]
