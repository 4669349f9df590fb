"""git-find-commit: the hash of the commit that introduced DEBUG = True."""

import subprocess
from pathlib import Path

REPO = Path("/app/repo")


def git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stderr}"
    return r.stdout.strip()


def culprit() -> str:
    for sha in git("rev-list", "--reverse", "HEAD").split():
        try:
            text = git("show", f"{sha}:settings.py")
        except AssertionError:
            continue
        if "DEBUG = True" in text.splitlines():
            return sha
    raise AssertionError("repository changed: no commit has DEBUG = True")


def test_answer():
    answer = Path("/app/answer.txt").read_text().strip()
    assert answer == culprit()
    assert git("log", "-1", "--format=%s", answer) == "Investigate slow checkout"
