"""sh-rename-file: /app/draft.txt is now /app/final.txt."""

from pathlib import Path

DRAFT = 'Chapter 1\nIt was a dark and stormy night.\n'


def test_renamed():
    assert Path("/app/final.txt").is_file(), "/app/final.txt does not exist"
    assert Path("/app/final.txt").read_text() == DRAFT


def test_old_name_gone():
    assert not Path("/app/draft.txt").exists()
