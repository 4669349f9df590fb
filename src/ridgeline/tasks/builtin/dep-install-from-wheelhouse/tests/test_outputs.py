"""dep-install-from-wheelhouse: tinyfmt installed into /app/vendor, app.py runs."""

import subprocess
import sys
from pathlib import Path

EXPECTED = """fruit  | qty
------------
apples | 3
pears  | 12
plums  | 7
"""


def test_package_in_vendor():
    assert Path("/app/vendor/tinyfmt/__init__.py").is_file()
    assert list(Path("/app/vendor").glob("tinyfmt-2.0.0.dist-info"))


def test_app_runs():
    r = subprocess.run([sys.executable, "/app/app.py"], capture_output=True, text=True,
                       timeout=30, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    assert r.stdout == EXPECTED
