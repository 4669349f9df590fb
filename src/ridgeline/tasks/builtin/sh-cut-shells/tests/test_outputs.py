"""sh-cut-shells: /app/shells.txt is the third field of users.txt."""

from pathlib import Path


def test_shells():
    lines = [line.strip() for line in Path("/app/shells.txt").read_text().strip().splitlines()]
    assert lines == ["/bin/bash", "/usr/sbin/nologin", "/bin/zsh", "/bin/fish"]
