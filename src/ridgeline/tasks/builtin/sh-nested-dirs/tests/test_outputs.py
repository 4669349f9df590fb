"""sh-nested-dirs: /app/data/raw/2024 is a directory."""

from pathlib import Path


def test_nested_directory():
    for p in ("/app/data", "/app/data/raw", "/app/data/raw/2024"):
        assert Path(p).is_dir() and not Path(p).is_symlink(), f"{p} is not a directory"
