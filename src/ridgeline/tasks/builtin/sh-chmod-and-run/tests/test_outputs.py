"""sh-chmod-and-run: greet.sh is executable and its output is in greet_output.txt."""

import stat
from pathlib import Path

GREET = Path("/app/greet.sh")


def test_executable():
    assert stat.S_IMODE(GREET.stat().st_mode) & stat.S_IXUSR, "/app/greet.sh is not executable"
    assert GREET.read_text() == '#!/bin/bash\necho "greeting number $((6 * 7))"\n'


def test_output():
    assert Path("/app/greet_output.txt").read_text().strip() == "greeting number 42"
