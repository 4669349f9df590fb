"""git-create-branch: feature/login created from main and checked out."""

import subprocess
from pathlib import Path

REPO = Path("/app/repo")


def git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stderr}"
    return r.stdout.strip()


def test_branch_checked_out():
    assert git("symbolic-ref", "HEAD") == "refs/heads/feature/login"


def test_branch_starts_at_main():
    assert git("rev-parse", "feature/login") == git("rev-parse", "main")


def test_main_unchanged():
    assert git("log", "--format=%s", "main").splitlines() == ["Greet the world",
                                                              "Initial commit"]
