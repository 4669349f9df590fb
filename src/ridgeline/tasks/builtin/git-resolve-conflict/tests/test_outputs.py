"""git-resolve-conflict: merged with main's timeout and feature's retries."""

import subprocess
from pathlib import Path

REPO = Path("/app/repo")


def git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stderr}"
    return r.stdout.strip()


def test_config_resolved():
    text = (REPO / "config.txt").read_text()
    assert "<<<<<<<" not in text and ">>>>>>>" not in text and "=======" not in text
    assert text.splitlines() == ["name = service", "timeout = 60", "mode = fast",
                                 "retries = 3"]


def test_merge_committed():
    parents = git("rev-list", "--parents", "-n", "1", "HEAD").split()[1:]
    assert len(parents) == 2, "HEAD is not a merge commit"
    assert git("log", "-1", "--format=%s", parents[0]) == "Raise timeout"
    assert parents[1] == git("rev-parse", "feature")
    assert git("show", "HEAD:config.txt").splitlines()[1] == "timeout = 60"


def test_clean_and_on_main():
    assert git("symbolic-ref", "--short", "HEAD") == "main"
    assert git("status", "--porcelain") == ""
