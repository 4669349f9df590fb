"""fix-syntax-error: calc.py adds its two arguments."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("a,b", [(2, 3), (-4, 10), (0, 0), (123, 877)])
def test_adds(a, b):
    r = subprocess.run([sys.executable, "/app/calc.py", str(a), str(b)],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(a + b)
