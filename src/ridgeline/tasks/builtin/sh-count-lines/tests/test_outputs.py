"""sh-count-lines: /app/count.txt holds 7, the number of lines of names.txt."""

from pathlib import Path


def test_count_file_exists():
    assert Path("/app/count.txt").is_file()


def test_count():
    # `wc -l FILE` also prints the file name after the number: accept that.
    words = Path("/app/count.txt").read_text().split()
    assert words and words[0] == "7"
    assert Path("/app/names.txt").read_text().count("\n") == 7
