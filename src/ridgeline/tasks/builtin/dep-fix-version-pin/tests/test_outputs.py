"""dep-fix-version-pin: tinyfmt pinned to 2.x and installed; report runs."""

import re
import subprocess
import sys
from pathlib import Path

EXPECTED = """item      | amount
--------------------
rent      | 1,200.00
food      | 432.50
transport | 89.99
total: 1,722.49
"""


def test_pin_fixed():
    reqs = Path("/app/requirements.txt").read_text()
    assert re.search(r"^tinyfmt\s*(==|>=|~=)\s*2(\.0)*(\.0)?\s*$", reqs, re.M), reqs
    assert "1.0.0" not in reqs


def test_only_version_two_installed():
    infos = sorted(p.name for p in Path("/app/vendor").glob("tinyfmt-*.dist-info"))
    assert infos == ["tinyfmt-2.0.0.dist-info"]


def test_report_runs():
    r = subprocess.run([sys.executable, "/app/report.py"], capture_output=True, text=True,
                       timeout=30, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    assert r.stdout == EXPECTED
