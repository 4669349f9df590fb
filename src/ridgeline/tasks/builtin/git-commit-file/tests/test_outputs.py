"""git-commit-file: notes.txt committed with the message "Add notes"."""

import subprocess
from pathlib import Path

REPO = Path("/app/repo")


def git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stderr}"
    return r.stdout.strip()


def test_history():
    assert git("log", "--format=%s").splitlines() == ["Add notes", "Initial commit"]


def test_on_main():
    assert git("symbolic-ref", "--short", "HEAD") == "main"


def test_notes_committed():
    assert git("show", "HEAD:notes.txt") == "remember the milk"


def test_clean_tree():
    assert git("status", "--porcelain") == ""
