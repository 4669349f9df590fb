"""sh-symlink-file: /app/current.conf is a symlink to /app/settings.conf."""

import os
from pathlib import Path


def test_is_symlink():
    assert Path("/app/current.conf").is_symlink(), "/app/current.conf is not a symbolic link"


def test_points_to_settings():
    assert os.path.realpath("/app/current.conf") == "/app/settings.conf"
    assert Path("/app/settings.conf").read_text() == "mode = fast\n"
