"""git-merge-feature: a merge commit of feature into main."""

import subprocess
from pathlib import Path

REPO = Path("/app/repo")


def git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stderr}"
    return r.stdout.strip()


def test_on_main():
    assert git("symbolic-ref", "--short", "HEAD") == "main"


def test_merge_commit_parents():
    parents = git("rev-list", "--parents", "-n", "1", "HEAD").split()[1:]
    assert len(parents) == 2, "HEAD is not a merge commit"
    assert git("log", "-1", "--format=%s", parents[0]) == "Bump version"
    assert parents[1] == git("rev-parse", "feature")


def test_files_from_both_sides():
    assert (REPO / "version.txt").read_text() == "2.0\n"
    assert (REPO / "login.txt").read_text() == "login page\nlogout button\n"
    assert git("status", "--porcelain") == ""
