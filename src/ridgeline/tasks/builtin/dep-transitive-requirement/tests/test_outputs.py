"""dep-transitive-requirement: reportkit and a compatible tinyfmt in /app/vendor."""

import subprocess
import sys
from pathlib import Path

EXPECTED = """Visitors
========
day | visits
------------
mon | 120
tue | 98
wed | 143
"""


def test_packages_installed():
    vendor = Path("/app/vendor")
    assert (vendor / "reportkit" / "__init__.py").is_file()
    assert sorted(p.name for p in vendor.glob("tinyfmt-*.dist-info")) == [
        "tinyfmt-2.0.0.dist-info"]


def test_main_runs():
    r = subprocess.run([sys.executable, "/app/main.py"], capture_output=True, text=True,
                       timeout=30, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    assert r.stdout == EXPECTED
