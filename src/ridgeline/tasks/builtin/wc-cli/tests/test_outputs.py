"""wc-cli: a small wc clone."""

import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
A, B, C = (str(DATA / n) for n in ("a.txt", "b.txt", "c.txt"))


def run(*args):
    r = subprocess.run([sys.executable, "/app/wc.py", *args], capture_output=True,
                       text=True, timeout=20)
    return r.returncode, [ln.split() for ln in r.stdout.splitlines() if ln.strip()], r.stderr


def test_single_file_all_counts():
    assert run(A) == (0, [["4", "6", "29", A]], "")


def test_no_trailing_newline():
    code, lines, _ = run(B)
    assert code == 0 and lines == [["0", "4", "24", B]]


def test_selected_counts_in_fixed_order():
    code, lines, _ = run("-c", "-l", C)
    assert code == 0 and lines == [["2", "37", C]]
    code, lines, _ = run("-w", C)
    assert lines == [["5", C]]


def test_several_files_total():
    code, lines, _ = run("-l", "-w", A, B, C)
    assert code == 0
    assert lines == [["4", "6", A], ["0", "4", B], ["2", "5", C], ["6", "15", "total"]]


def test_missing_file():
    code, lines, err = run(A, "/nonexistent/file.txt")
    assert code == 1
    assert lines[0] == ["4", "6", "29", A]
    assert "nonexistent" in err
