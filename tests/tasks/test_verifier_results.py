"""The verifier reads what the tests really did (issue 28): a plain `pytest --ctrf FILE`
works in any test script, and a pytest that ran no test (usage error, unloadable
conftest, nothing collected, pytest not found) is an infrastructure error with its
reason, never a 0 reward, even when a Harbor test.sh wrote one from its exit code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path


from ridgeline.tasks import (
    VerdictStatus, apply_solution, load_task, prepare_environment, verdict_from_error,
    verify,
)
from ridgeline.tasks.verifier import Session, no_test_run, sessions_of

FIXTURES = Path(__file__).parent / "fixtures"
TASKS_SRC = Path(__file__).resolve().parents[2] / "src" / "ridgeline" / "tasks"

#: A Harbor test.sh as the public task collections write it: the reward is pytest's $?.
HARBOR_TEST_SH = """#!/bin/bash
{pytest}
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def episode(task, oracle: bool, keep=None):
    try:
        with prepare_environment(task) as sb:
            if oracle:
                apply_solution(task, sb)
            verdict = verify(task, sb)
            if keep is not None:
                keep(sb)
            return verdict
    except Exception as e:
        return verdict_from_error(e)


def harbor_task(tmp_path: Path, pytest_line: str, extra: dict[str, str] | None = None):
    d = tmp_path / "harbor"
    shutil.copytree(FIXTURES / "harbor-hello", d)
    (d / "tests" / "test.sh").write_text(HARBOR_TEST_SH.format(pytest=pytest_line))
    for name, text in (extra or {}).items():
        (d / "tests" / name).write_text(text)
    return load_task(d)


def tb1_task(tmp_path: Path, pytest_line: str, extra: dict[str, str] | None = None):
    d = tmp_path / "tb1"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    (d / "run-tests.sh").write_text(f"#!/bin/bash\n{pytest_line}\n")
    for name, text in (extra or {}).items():
        (d / "tests" / name).write_text(text)
    return load_task(d)


def test_plain_pytest_ctrf_is_graded_and_writes_the_report(tmp_path):
    """`pytest --ctrf FILE` without the uv stand-in: the option exists, the tests run,
    the report lists what pytest ran."""
    task = harbor_task(tmp_path, "pytest --ctrf /logs/verifier/ctrf.json "
                                 "/tests/test_outputs.py -rA")
    reports = []
    oracle = episode(task, oracle=True, keep=lambda sb: reports.append(json.loads(
        (sb.logs_host_dir / "verifier" / "ctrf.json").read_text())))
    assert oracle.status is VerdictStatus.PASSED, (oracle.detail, oracle.output)
    assert (oracle.tests_passed, oracle.tests_total) == (2, 2)
    summary = reports[0]["results"]["summary"]
    assert (summary["tests"], summary["passed"]) == (2, 2)
    null = episode(task, oracle=False)
    assert null.status is VerdictStatus.FAILED and null.reward == 0.0, null.detail


def test_harbor_usage_error_is_not_a_zero_reward(tmp_path):
    task = harbor_task(tmp_path, "pytest --no-such-option /tests/test_outputs.py -rA")
    v = episode(task, oracle=True)
    assert v.status is VerdictStatus.INFRA_ERROR, (v.detail, v.output)
    assert v.reason == "pytest_usage_error" and v.reward is None
    assert "--no-such-option" in v.detail and "reward file was not read" in v.detail


def test_harbor_missing_test_runner_is_not_a_zero_reward(tmp_path):
    task = harbor_task(tmp_path, "PATH=/nowhere pytest /tests/test_outputs.py -rA")
    v = episode(task, oracle=True)
    assert v.status is VerdictStatus.INFRA_ERROR, (v.detail, v.output)
    assert v.reason == "test_command_not_found" and v.reward is None
    assert "pytest" in v.detail


def test_nothing_collected_is_an_infra_error(tmp_path):
    task = tb1_task(tmp_path, "pytest $TEST_DIR/test_empty.py -rA",
                    {"test_empty.py": "# no tests here\n"})
    v = episode(task, oracle=True)
    assert v.status is VerdictStatus.INFRA_ERROR, (v.detail, v.output)
    assert v.reason == "no_tests_collected" and v.reward is None
    assert "exit code 5" in v.detail


def test_conftest_import_error_is_an_infra_error(tmp_path):
    """An unloadable conftest stops pytest before any test: ours. A test module that
    cannot import the agent's module is a collected error: the agent's failure."""
    task = tb1_task(tmp_path / "a", "pytest $TEST_DIR/test_outputs.py -rA",
                    {"conftest.py": "import module_nobody_installed\n"})
    v = episode(task, oracle=True)
    assert v.status is VerdictStatus.INFRA_ERROR, (v.detail, v.output)
    assert v.reason == "pytest_usage_error" and v.reward is None
    assert "conftest" in v.detail
    task = tb1_task(tmp_path / "b", "pytest $TEST_DIR/test_outputs.py -rA",
                    {"test_outputs.py": "from agents_module import answer\n\n"
                                        "def test_answer():\n    assert answer() == 42\n"})
    v = episode(task, oracle=False)
    assert v.status is VerdictStatus.FAILED and v.reward == 0.0, (v.detail, v.output)


def test_no_test_run_reads_the_runners_exit_code():
    done = [{"s": "A", "e": "start"}, {"s": "A", "e": "finish", "n": 0, "x": 5}]
    sessions = sessions_of(done)
    assert sessions[0].complete and sessions[0].exit_status == 5
    assert no_test_run("collected 0 items", sessions)[0] == "no_tests_collected"
    usage = [Session("B", finished=True, announced=0, exit_status=4)]
    assert no_test_run("", usage)[0] == "pytest_usage_error"
    # interrupted (what the tests imported may call pytest.exit): not a reason of ours
    assert no_test_run("", [Session("C", finished=True, announced=0, exit_status=2)]) \
        is None
    # printed a session it never reported: tampering, never an infrastructure error
    assert no_test_run("=== test session starts ===\nERROR: usage: x", []) is None
    text = "ERROR: usage: __main__.py [options]\n__main__.py: error: unrecognized " \
           "arguments: --ctrf\n"
    assert no_test_run(text, [])[0] == "pytest_usage_error"
    assert no_test_run(text, None)[0] == "pytest_usage_error"
    assert no_test_run("===== no tests ran in 0.01s =====", None)[0] == \
        "no_tests_collected"
    assert no_test_run("test.sh: line 3: pytest: command not found", [])[0] == \
        "test_command_not_found"
    assert no_test_run("just a script that printed things", []) is None


# -- the CTRF stand-in beside a real pytest-json-ctrf (host pytest, no sandbox) ----------

REAL_CTRF = textwrap.dedent("""\
    import json

    def pytest_addoption(parser):
        parser.getgroup("ctrf").addoption("--ctrf", action="store", default=None)

    def pytest_sessionfinish(session):
        path = session.config.getoption("--ctrf")
        if path:
            open(path, "w").write(json.dumps({"writer": "real"}))
    """)


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "real_ctrf.py").write_text(REAL_CTRF)
    env = {**os.environ, "PYTEST_PLUGINS": "ridgeline_ctrf",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": f"{TASKS_SRC}:{tmp_path}"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           *args, str(tmp_path / "test_one.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


def test_ctrf_stand_in_steps_aside_for_a_real_plugin(tmp_path):
    """Alone, the stand-in writes what pytest ran; after a real pytest-json-ctrf that
    registered --ctrf first, there is no option conflict and only the real one writes."""
    r = _pytest(tmp_path, "--ctrf", str(tmp_path / "out" / "ctrf.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "out" / "ctrf.json").read_text())
    assert report["results"]["summary"]["passed"] == 1
    assert [t["name"] for t in report["results"]["tests"]] == ["test_one.py::test_one"]
    r = _pytest(tmp_path, "-p", "real_ctrf", "--ctrf", str(tmp_path / "ctrf.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "ctrf.json").read_text()) == {"writer": "real"}


# -- the control: a run that ran no test, repeated without the agent's changes -----------

def test_broken_task_stays_an_infra_error_after_its_control(tmp_path):
    """The task's own test script stops pytest: a fresh environment without the agent's
    changes runs no test either, so the cause is the task, not the agent."""
    task = tb1_task(tmp_path, "pytest --no-such-option $TEST_DIR/test_outputs.py -rA")
    v = episode(task, oracle=False)
    assert v.status is VerdictStatus.INFRA_ERROR, (v.detail, v.output)
    assert v.reason == "pytest_usage_error" and v.reward is None
    assert "also without the agent's changes" in v.detail, v.detail


def test_control_runs_once_per_task(tmp_path, monkeypatch):
    """Two episodes of one broken task: the control's fresh environment is made once."""
    from ridgeline.tasks import verifier
    made = []
    real = verifier.prepare_environment

    def counting(task, *args, **kwargs):
        made.append((task.path, kwargs.get("mode"), kwargs.get("backend")))
        return real(task, *args, **kwargs)

    monkeypatch.setattr(verifier, "prepare_environment", counting)
    task = harbor_task(tmp_path, "pytest --no-such-option /tests/test_outputs.py -rA")
    for _ in range(2):
        v = episode(task, oracle=False)
        assert v.status is VerdictStatus.INFRA_ERROR and v.reward is None, v.detail
        assert "also without the agent's changes" in v.detail, v.detail
    assert made == [(task.path, "host", "bwrap")]
