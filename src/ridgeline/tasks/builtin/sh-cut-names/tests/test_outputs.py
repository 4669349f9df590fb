"""sh-cut-names: /app/names.txt is the first column of people.csv."""

from pathlib import Path


def test_names():
    lines = [line.strip() for line in Path("/app/names.txt").read_text().strip().splitlines()]
    if lines and lines[0] != "name":     # the header is asked for; its absence is forgiven
        lines.insert(0, "name")
    assert lines == ["name", "alice", "bob", "carol"]
