"""sh-mkdir-and-file: /app/out/ready.txt holds `yes`."""

from pathlib import Path


def test_dir():
    assert Path("/app/out").is_dir() and not Path("/app/out").is_symlink()


def test_file():
    assert Path("/app/out/ready.txt").read_text().strip() == "yes"
