"""copy-config: local.conf is default.conf with only the port changed."""

from pathlib import Path

ORIGINAL = (Path(__file__).parent / "default.conf").read_text()


def test_default_unchanged():
    assert Path("/app/config/default.conf").read_text() == ORIGINAL


def test_local_exists():
    assert Path("/app/config/local.conf").is_file()


def test_local_has_new_port_and_nothing_else_changed():
    local = Path("/app/config/local.conf").read_text().splitlines()
    expected = [("port = 9000" if line == "port = 8000" else line)
                for line in ORIGINAL.splitlines()]
    assert local == expected
