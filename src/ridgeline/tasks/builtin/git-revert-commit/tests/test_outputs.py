"""git-revert-commit: the bad commit undone by a new commit, history intact."""

import subprocess
from pathlib import Path

REPO = Path("/app/repo")


def git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stderr}"
    return r.stdout.strip()


def test_history_kept_and_extended():
    subjects = git("log", "--format=%s").splitlines()
    assert subjects[1:] == ["Add changelog", "Break tax calculation", "Add README",
                            "Add tax module"]
    assert len(subjects) == 5


def test_tax_restored():
    expected = (Path(__file__).parent / "tax_ok.py").read_text()
    assert (REPO / "tax.py").read_text() == expected
    assert git("show", "HEAD:tax.py") + "\n" == expected


def test_other_changes_kept():
    assert (REPO / "CHANGELOG.md").is_file() and (REPO / "README.md").is_file()
    assert git("status", "--porcelain") == ""
