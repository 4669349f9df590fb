"""sh-lowercase: /app/quiet.txt is shout.txt in lower case."""

from pathlib import Path

SHOUT = 'HELLO THERE\nSTOP SHOUTING\n'


def test_lowercase():
    assert Path("/app/quiet.txt").read_text().rstrip("\n") == SHOUT.lower().rstrip("\n")
