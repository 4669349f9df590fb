"""uppercase-text: output.txt is input.txt in upper case."""

from pathlib import Path

ORIGINAL = (Path(__file__).parent / "input.txt").read_text()


def test_output_exists():
    assert Path("/app/output.txt").is_file()


def test_output_is_uppercase_input():
    assert Path("/app/output.txt").read_text().rstrip("\n") == ORIGINAL.upper().rstrip("\n")
