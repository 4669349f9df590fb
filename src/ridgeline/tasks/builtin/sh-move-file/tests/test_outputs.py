"""sh-move-file: todo.txt moved from /app/inbox to /app/done."""

from pathlib import Path

TODO = 'fix the sink\ncall mum\n'


def test_moved():
    moved = Path("/app/done/todo.txt")
    assert moved.is_file(), "/app/done/todo.txt does not exist"
    assert moved.read_text() == TODO


def test_source_gone():
    assert not Path("/app/inbox/todo.txt").exists()
    assert Path("/app/inbox").is_dir()
