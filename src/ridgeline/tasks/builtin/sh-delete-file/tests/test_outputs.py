"""sh-delete-file: /app/old.txt is gone, /app/new.txt is kept."""

from pathlib import Path


def test_old_gone():
    assert not Path("/app/old.txt").exists()


def test_new_kept():
    assert Path("/app/new.txt").read_text() == "version 2\n"
