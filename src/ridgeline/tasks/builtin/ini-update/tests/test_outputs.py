"""ini-update: [server] port 8080, new [logging] section, everything else kept."""

import configparser
from pathlib import Path

ORIGINAL = (Path(__file__).parent / "settings.ini").read_text().splitlines()


def parsed():
    cp = configparser.ConfigParser(inline_comment_prefixes=None)
    cp.read("/app/settings.ini")
    return cp


def test_server_port():
    assert parsed()["server"]["port"] == "8080"


def test_database_port_kept():
    assert parsed()["database"]["port"] == "5432"


def test_logging_section():
    cp = parsed()
    assert cp.has_section("logging") and cp["logging"]["level"] == "debug"
    assert cp.sections()[-1] == "logging"


def test_other_lines_and_comments_kept():
    new = [ln for ln in Path("/app/settings.ini").read_text().splitlines() if ln.strip()]
    old = [ln for ln in ORIGINAL if ln.strip()]
    changed = [(a, b) for a, b in zip(old, new) if a != b]
    assert changed == [("port = 80", "port = 8080")]
    assert new[len(old):] == ["[logging]", "level = debug"]
