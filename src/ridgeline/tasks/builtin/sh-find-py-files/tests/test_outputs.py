"""sh-find-py-files: /app/py_files.txt lists the 3 .py files under /app/project."""

import os
from pathlib import Path

WANTED = {"main.py", "util/helpers.py", "tests/test_main.py"}


def relative(line: str) -> str:
    # Absolute paths, paths from /app (project/...) and from /app/project (./...) are fine.
    p = os.path.normpath(line.strip())
    for prefix in ("/app/project/", "project/"):
        if p.startswith(prefix):
            return p[len(prefix):]
    return p


def test_listed():
    lines = [line for line in Path("/app/py_files.txt").read_text().splitlines() if line.strip()]
    assert len(lines) == 3
    assert {relative(line) for line in lines} == WANTED
