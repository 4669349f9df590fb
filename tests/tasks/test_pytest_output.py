"""Per-test results from pytest's console output."""

from __future__ import annotations

import subprocess
import sys

from ridgeline.tasks.pytest_output import Outcome, parse_pytest_output, summary_counts

RA_OUTPUT = """\
============================= test session starts ==============================
collected 5 items

../tests/test_outputs.py .F.sE                                          [100%]

==================================== ERRORS ====================================
_________________________ ERROR at setup of test_db ____________________________
==================================== PASSES ====================================
=========================== short test summary info ============================
PASSED ../tests/test_outputs.py::test_a
PASSED ../tests/test_outputs.py::test_param[1-2]
FAILED ../tests/test_outputs.py::test_b - AssertionError: assert 1 == 2
SKIPPED [1] ../tests/test_outputs.py:20: not on this platform
ERROR ../tests/test_outputs.py::test_db - RuntimeError: no db
=========== 1 failed, 2 passed, 1 skipped, 1 error in 0.12s ====================
"""


def test_parse_short_summary():
    results = parse_pytest_output(RA_OUTPUT)
    assert [(r.name.split("::")[-1], r.outcome) for r in results] == [
        ("test_a", Outcome.PASSED), ("test_param[1-2]", Outcome.PASSED),
        ("test_b", Outcome.FAILED), ("../tests/test_outputs.py:20", Outcome.SKIPPED),
        ("test_db", Outcome.ERROR)]
    assert results[2].message == "AssertionError: assert 1 == 2"
    assert [r.ok for r in results] == [True, True, False, False, False]


def test_counts():
    assert summary_counts(RA_OUTPUT) == {"failed": 1, "passed": 2, "skipped": 1, "error": 1}


def test_several_sessions_and_ansi():
    two = RA_OUTPUT + "\x1b[32mPASSED\x1b[0m not in a summary\n" + RA_OUTPUT
    assert len(parse_pytest_output(two)) == 10
    colored = "\x1b[1m===== short test summary info =====\x1b[0m\n\x1b[32mPASSED\x1b[0m t.py::x\n"
    assert [(r.name, r.outcome) for r in parse_pytest_output(colored)] == [
        ("t.py::x", Outcome.PASSED)]


def test_verbose_fallback_and_nothing():
    verbose = "t.py::test_one PASSED   [ 50%]\nt.py::test_two FAILED   [100%]\n"
    assert [r.outcome for r in parse_pytest_output(verbose)] == [Outcome.PASSED,
                                                                 Outcome.FAILED]
    assert parse_pytest_output("bash: uv: command not found\n") == []


def test_collection_error_counts_as_error(tmp_path):
    (tmp_path / "test_broken.py").write_text("import no_such_module_xyz\n\ndef test_x(): pass\n")
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                          str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"})
    results = parse_pytest_output(out.stdout)
    # pytest stops at a collection error: the broken module is the one result, an error
    assert [(r.name.rsplit("/", 1)[-1], r.outcome) for r in results] == [
        ("test_broken.py", Outcome.ERROR)]
    assert not any(r.ok for r in results)
