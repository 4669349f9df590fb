"""sh-sed-replace: every `cat` in /app/pets.txt became `dog`."""

from pathlib import Path

PETS = 'my cat is black\nthe cat sleeps\ncats and dogs\n'


def test_replaced():
    text = Path("/app/pets.txt").read_text()
    assert text.rstrip("\n") == PETS.replace("cat", "dog").rstrip("\n")
