"""rename-function: calc_total renamed to compute_total everywhere; behaviour kept."""

import subprocess
import sys
from pathlib import Path

EXPECTED = "charged 32.40\ncharged 30.00\nquote: 108.0\n"


def run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd="/app", timeout=30)


def test_old_name_gone():
    for p in Path("/app/shop").rglob("*.py"):
        assert "calc_total" not in p.read_text(), f"calc_total still in {p}"


def test_new_name_defined():
    r = run("import shop.pricing as p; print(hasattr(p, 'compute_total'), "
            "hasattr(p, 'calc_total'))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True False"


def test_cli_output_unchanged():
    r = subprocess.run([sys.executable, "-m", "shop.cli"], capture_output=True, text=True,
                       cwd="/app", timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == EXPECTED


def test_callers_work():
    r = run("from shop.cart import Cart\nfrom shop.checkout import checkout\n"
            "c = Cart(); c.add('x', 10, 3); print(c.total(), checkout(c, tax_free=True))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "32.4 charged 30.00"
