"""sh-pwd-file: /app/where.txt holds /app/work/deep."""

from pathlib import Path


def test_where():
    assert Path("/app/where.txt").read_text().strip() == "/app/work/deep"
