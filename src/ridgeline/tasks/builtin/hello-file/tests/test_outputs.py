"""hello-file: /app/hello.txt contains the word hello."""

from pathlib import Path

HELLO = Path("/app/hello.txt")


def test_file_exists():
    assert HELLO.is_file(), "/app/hello.txt does not exist"


def test_file_content():
    assert HELLO.read_text().strip().lower() == "hello"
