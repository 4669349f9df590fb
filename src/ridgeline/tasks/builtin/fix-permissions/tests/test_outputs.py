"""fix-permissions: *.sh executable for all, README not, secret.key mode 600."""

import stat
from pathlib import Path


def mode(p: str) -> int:
    return stat.S_IMODE(Path(p).stat().st_mode)


def test_scripts_executable():
    for name in ("build.sh", "deploy.sh", "clean.sh"):
        assert mode(f"/app/scripts/{name}") & 0o111 == 0o111, name


def test_readme_not_executable():
    assert mode("/app/scripts/README.md") & 0o111 == 0


def test_secret_key_private():
    assert mode("/app/secret.key") == 0o600


def test_contents_kept():
    assert Path("/app/secret.key").read_text() == "s3cr3t-token\n"
