"""sh-env-home: /app/home.txt holds the value of $HOME."""

import os
from pathlib import Path


def test_home():
    value = Path("/app/home.txt").read_text().strip()
    assert value and value == os.environ["HOME"].rstrip("/")
