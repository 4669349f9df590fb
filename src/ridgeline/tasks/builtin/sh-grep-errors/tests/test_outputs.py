"""sh-grep-errors: /app/errors.txt holds the ERROR lines of app.log."""

from pathlib import Path


def test_error_lines():
    lines = Path("/app/errors.txt").read_text().strip().splitlines()
    assert [line.strip() for line in lines] == ["ERROR disk full",
                                                "ERROR timeout talking to db"]
