"""sh-count-words: /app/words.txt holds 12, the number of words in text.txt."""

from pathlib import Path


def test_words_file_exists():
    assert Path("/app/words.txt").is_file()


def test_count():
    # `wc -w FILE` also prints the file name after the number: accept that.
    words = Path("/app/words.txt").read_text().split()
    assert words and words[0] == "12"
