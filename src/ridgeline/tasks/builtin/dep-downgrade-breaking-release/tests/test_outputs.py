"""dep-downgrade-breaking-release: tinyfmt 1.0.0 in vendor, script unchanged and working."""

import subprocess
import sys
from pathlib import Path

EXPECTED = """bolts   | 1500
nuts    | 1320
washers | 98
"""


def test_script_unchanged():
    original = (Path(__file__).parent / "inventory_report.py").read_text()
    assert Path("/app/inventory_report.py").read_text() == original


def test_single_installation_of_1_0_0():
    vendor = Path("/app/vendor")
    assert sorted(p.name for p in vendor.glob("tinyfmt-*.dist-info")) == [
        "tinyfmt-1.0.0.dist-info"]
    assert '__version__ = "1.0.0"' in (vendor / "tinyfmt" / "__init__.py").read_text()


def test_report_runs():
    r = subprocess.run([sys.executable, "/app/inventory_report.py"], capture_output=True,
                       text=True, timeout=30, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    assert r.stdout == EXPECTED
