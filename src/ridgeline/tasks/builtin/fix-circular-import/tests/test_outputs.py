"""fix-circular-import: the package imports cleanly and prints the catalogue."""

import subprocess
import sys

EXPECTED = """Foundation by Isaac Asimov (1951)
Dune by Frank Herbert (1965)
Neuromancer by William Gibson (1984)
Hyperion by Dan Simmons (1989)
"""


def py(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          cwd="/app", timeout=30)


def test_main_prints_catalogue():
    r = py("-m", "library")
    assert r.returncode == 0, r.stderr
    assert r.stdout == EXPECTED


def test_models_importable_alone():
    r = py("-c", "from library.models import Book; print(Book('T', 'A', 2000))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "T by A (2000)"


def test_services_importable_alone():
    r = py("-c", "from library.services import format_book, catalogue; "
                 "print(len(catalogue()))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "4"
