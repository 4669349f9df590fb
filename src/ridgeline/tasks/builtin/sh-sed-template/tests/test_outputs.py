"""sh-sed-template: /app/letter.txt is template.txt with NAME -> Alice."""

from pathlib import Path

TEMPLATE = "Dear NAME,\nNAME and NAME's friends are welcome!\n"


def test_letter():
    text = Path("/app/letter.txt").read_text()
    assert text.rstrip("\n") == TEMPLATE.replace("NAME", "Alice").rstrip("\n")


def test_template_kept():
    assert Path("/app/template.txt").read_text() == TEMPLATE
