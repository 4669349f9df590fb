"""sh-copy-dir: /app/config_backup holds copies of every file in /app/config."""

from pathlib import Path

FILES = {'app.conf': 'name = shop\nport = 8080\n', 'db.conf': 'host = localhost\nuser = admin\n'}


def test_original_kept():
    for name, text in FILES.items():
        assert Path("/app/config", name).read_text() == text


def test_backup():
    backup = Path("/app/config_backup")
    assert backup.is_dir() and not backup.is_symlink(), "/app/config_backup is not a directory"
    for name, text in FILES.items():
        assert (backup / name).is_file(), f"/app/config_backup/{name} is missing"
        assert (backup / name).read_text() == text
