"""sh-append-status: /app/status.log gained a last line `finished`."""

from pathlib import Path

LOG = Path("/app/status.log")


def test_lines():
    lines = [line.rstrip() for line in LOG.read_text().rstrip("\n").split("\n")]
    assert lines == ["started", "running", "finished"]
