"""sh-make-two-dirs: /app/src and /app/docs are directories."""

from pathlib import Path


def test_src():
    assert Path("/app/src").is_dir() and not Path("/app/src").is_symlink()


def test_docs():
    assert Path("/app/docs").is_dir() and not Path("/app/docs").is_symlink()
