"""latest-release-symlink: /app/current -> releases/v1.10.0."""

import os
from pathlib import Path


def test_current_is_symlink():
    assert Path("/app/current").is_symlink()


def test_points_to_newest_release():
    assert os.path.realpath("/app/current") == "/app/releases/v1.10.0"
    assert Path("/app/current/VERSION").read_text().strip() == "v1.10.0"


def test_releases_untouched():
    assert sorted(p.name for p in Path("/app/releases").iterdir()) == [
        "v0.9.12", "v1.10.0", "v1.2.0", "v1.9.3"]
