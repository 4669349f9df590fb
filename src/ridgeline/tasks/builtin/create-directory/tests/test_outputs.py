"""create-directory: /app/output is a directory."""

from pathlib import Path


def test_output_is_a_directory():
    out = Path("/app/output")
    assert out.exists(), "/app/output does not exist"
    assert out.is_dir() and not out.is_symlink(), "/app/output is not a directory"
