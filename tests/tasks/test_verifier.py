"""Environments and the verifier, for real in sandboxes: Terminal-Bench v1 and Harbor
tasks run unchanged (oracle passes, untouched environment fails), and every way a run
can go wrong gets the right status."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ridgeline.errors import TaskError
from ridgeline.tasks import (
    TaskUnsupported, VerdictStatus, apply_solution, load_task, prepare_environment,
    verdict_from_error, verify,
)

FIXTURES = Path(__file__).parent / "fixtures"
BROKEN = FIXTURES / "broken"
TB1 = ["tb1-hello-world", "tb1-csv-summary", "tb1-fix-script"]
HARBOR = ["harbor-hello", "harbor-word-count", "harbor-partial-reward"]


def episode(task, oracle: bool):
    try:
        with prepare_environment(task) as sb:
            if oracle:
                apply_solution(task, sb)
            return verify(task, sb)
    except Exception as e:
        return verdict_from_error(e)


@pytest.mark.parametrize("name", TB1 + HARBOR)
def test_fixture_runs_unchanged(name):
    task = load_task(FIXTURES / name)
    null = episode(task, oracle=False)
    assert null.status is VerdictStatus.FAILED, (null.detail, null.output)
    assert null.reward is not None and null.reward < 1
    oracle = episode(task, oracle=True)
    assert oracle.status is VerdictStatus.PASSED, (oracle.detail, oracle.output)
    assert oracle.reward == 1.0
    if name != "harbor-partial-reward":        # the one verifier without pytest
        assert oracle.tests_total >= 1 and oracle.tests_passed == oracle.tests_total


def test_per_test_results_and_partial_reward():
    v = episode(load_task(FIXTURES / "tb1-fix-script"), oracle=False)
    outcomes = {t.name.split("::")[-1]: t.outcome.value for t in v.tests}
    assert outcomes == {"test_executable": "passed", "test_with_name": "failed",
                        "test_without_name": "failed"}
    assert (v.tests_passed, v.tests_total) == (1, 3)
    p = episode(load_task(FIXTURES / "harbor-partial-reward"), oracle=False)
    assert p.status is VerdictStatus.FAILED and p.reward == pytest.approx(1 / 3, abs=1e-3)


def test_dockerfile_is_honoured():
    task = load_task(FIXTURES / "tb1-csv-summary")
    with prepare_environment(task) as sb:
        r = sb.run("cat data.csv | wc -l; echo $REPORT_NAME $DATA_FILE; pwd")
        assert r.ok, r.stderr
        assert r.stdout.split() == ["6", "summary", "/app/data.csv", "/app"]
        assert (sb.workspace_dir / "data.csv").is_file()


def test_harbor_ctrf_report_written():
    task = load_task(FIXTURES / "harbor-hello")
    with prepare_environment(task) as sb:
        apply_solution(task, sb)
        verify(task, sb)
        assert (sb.logs_host_dir / "verifier" / "ctrf.json").is_file()
        assert (sb.logs_host_dir / "verifier" / "reward.txt").read_text().strip() == "1"


def test_tests_are_copied_in_only_for_verification():
    task = load_task(FIXTURES / "tb1-hello-world")
    with prepare_environment(task) as sb:
        assert sb.run("ls -A /tests").stdout == ""
        assert sb.run("touch /tests/x").exit_code != 0        # read-only for the agent
        verify(task, sb)
        assert "test_outputs.py" in sb.run("ls /tests").stdout


def test_hanging_tests_are_killed_and_not_scored():
    task = load_task(BROKEN / "tb1-hanging-tests")
    v = episode(task, oracle=False)
    assert v.status is VerdictStatus.INFRA_ERROR and v.reason == "test_timeout"
    assert v.reward is None and "3s" in v.detail


def test_unsupported_base_image():
    task = load_task(BROKEN / "tb1-unsupported-image")
    with pytest.raises(TaskUnsupported, match="postgres"):
        prepare_environment(task)
    v = episode(task, oracle=False)
    assert v.status is VerdictStatus.UNSUPPORTED and v.reward is None


def test_unsupported_missing_package():
    v = episode(load_task(BROKEN / "tb1-missing-package"), oracle=False)
    assert v.status is VerdictStatus.UNSUPPORTED
    assert "frobnicator-tools-xyz" in v.detail and "Dockerfile line 2" in v.detail


def test_missing_reward_is_infra_error():
    v = episode(load_task(BROKEN / "harbor-no-reward"), oracle=True)
    assert v.status is VerdictStatus.INFRA_ERROR and v.reason == "no_reward"
    assert v.reward is None


def test_test_script_removed_after_loading(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    task = load_task(d)
    (d / "run-tests.sh").unlink()
    v = episode(task, oracle=False)
    assert v.status is VerdictStatus.INFRA_ERROR and v.reason == "test_script_missing"


def test_no_test_results_is_infra_error(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    (d / "run-tests.sh").write_text("#!/bin/bash\necho 'no pytest here'\nexit 3\n")
    v = episode(load_task(d), oracle=False)
    assert v.status is VerdictStatus.INFRA_ERROR and v.reason == "no_test_results"
    assert v.reward is None


def test_setup_failure_is_infra_error(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    (d / "setup.sh").write_text("#!/bin/bash\necho preparing\nexit 7\n")
    v = episode(load_task(d), oracle=False)
    assert v.status is VerdictStatus.INFRA_ERROR and v.reason == "setup_failed"
    assert "exit code 7" in v.detail


def test_verify_needs_the_task_sandbox():
    a = load_task(FIXTURES / "tb1-hello-world")
    b = load_task(FIXTURES / "harbor-hello")
    with prepare_environment(a) as sb:
        with pytest.raises(TaskError, match="prepare_environment"):
            verify(b, sb)


def test_unhealthy_sandbox_is_infra_error():
    """A workspace that vanished under the sandbox fails the health probe: the verdict
    is an infrastructure error, not the agent's failure."""
    task = load_task(FIXTURES / "tb1-hello-world")
    with prepare_environment(task) as sb:
        apply_solution(task, sb)
        # The workspace may be a filesystem of its own (volume.py): detached first.
        subprocess.run(["umount", "-l", str(sb.workspace_dir)], capture_output=True)
        shutil.rmtree(sb.workspace_dir)
        v = verify(task, sb)
    assert v.status is VerdictStatus.INFRA_ERROR and v.reason == "health_failed"
    assert v.reward is None


def test_interactive_solution_yaml_is_unsupported(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(FIXTURES / "tb1-csv-summary", d)
    (d / "solution.yaml").write_text("- command: vim notes.txt\n  block: false\n"
                                     "- command: ':wq'\n  append_enter: true\n")
    task = load_task(d)
    with prepare_environment(task) as sb:
        with pytest.raises(TaskUnsupported, match="interactive"):
            apply_solution(task, sb)
