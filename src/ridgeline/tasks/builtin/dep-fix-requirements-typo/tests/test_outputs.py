"""dep-fix-requirements-typo: requirements fixed and installed; weather.py runs."""

import re
import subprocess
import sys
from pathlib import Path

EXPECTED = """city   | temp  | commute
------------------------
Oslo   | 26.6F | 7.46mi
Lisbon | 65.3F | 24.98mi
Cairo  | 87.8F | 4.66mi
"""


def test_requirements_fixed():
    reqs = Path("/app/requirements.txt").read_text()
    assert "unitconvv" not in reqs
    assert re.search(r"^unitconv\b", reqs, re.M)
    assert re.search(r"^tinyfmt\b", reqs, re.M)


def test_installed():
    vendor = Path("/app/vendor")
    assert (vendor / "unitconv" / "__init__.py").is_file()
    assert (vendor / "tinyfmt" / "__init__.py").is_file()


def test_weather_runs():
    r = subprocess.run([sys.executable, "/app/weather.py"], capture_output=True, text=True,
                       timeout=30, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    assert r.stdout == EXPECTED
