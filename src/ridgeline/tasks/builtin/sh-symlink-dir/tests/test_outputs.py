"""sh-symlink-dir: /app/latest is a symlink to /app/v2."""

import os
from pathlib import Path


def test_is_symlink():
    assert Path("/app/latest").is_symlink(), "/app/latest is not a symbolic link"


def test_points_to_v2():
    assert os.path.realpath("/app/latest") == "/app/v2"
    assert Path("/app/latest/VERSION").read_text().strip() == "2.0"
