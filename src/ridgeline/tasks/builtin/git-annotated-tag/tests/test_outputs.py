"""git-annotated-tag: annotated v1.2.0 on the release commit."""

import subprocess
from pathlib import Path

REPO = Path("/app/repo")


def git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stderr}"
    return r.stdout.strip()


def test_tag_is_annotated():
    assert git("cat-file", "-t", "v1.2.0") == "tag"


def test_tag_target():
    target = git("rev-parse", "v1.2.0^{commit}")
    assert git("log", "-1", "--format=%s", target) == "Release 1.2.0"


def test_tag_message():
    assert git("tag", "-l", "--format=%(contents)", "v1.2.0").strip() == "Version 1.2.0"


def test_no_new_commits():
    assert git("log", "-1", "--format=%s") == "Start 1.3 development"
    assert git("rev-list", "--count", "HEAD") == "4"
