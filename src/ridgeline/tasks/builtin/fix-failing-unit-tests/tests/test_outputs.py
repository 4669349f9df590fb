"""fix-failing-unit-tests: inventory.py fixed, the visible tests unchanged and passing."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

VISIBLE = Path(__file__).parent / "visible_test_inventory.py"


def load():
    spec = importlib.util.spec_from_file_location("inventory", "/app/inventory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_visible_tests_unchanged():
    assert Path("/app/tests/test_inventory.py").read_text() == VISIBLE.read_text()


def test_visible_tests_pass():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_inventory.py"], cwd="/app", capture_output=True,
                       text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.returncode == 0, r.stdout[-2000:]


def test_remove_exact_amount_and_error():
    inv = load().Inventory()
    inv.add("x", 4)
    inv.remove("x", 3)
    assert inv.count("x") == 1 and inv.items() == ["x"]
    with pytest.raises(ValueError):
        inv.remove("x", 2)
    assert inv.count("x") == 1
    inv.remove("x", 1)
    assert inv.items() == [] and inv.total_units() == 0


def test_remove_unknown_item():
    inv = load().Inventory()
    with pytest.raises(ValueError):
        inv.remove("ghost", 1)
