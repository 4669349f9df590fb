"""Suites of other people's tasks (issue 28): a task directory that does not load is
reported with its reason and skipped, never stopping `tasks list` or `tasks check` for
the rest; multi-step Harbor tasks are refused with a reason that says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ridgeline.errors import TaskError
from ridgeline.tasks import load_task
from ridgeline.tasks.cli import app
from ridgeline.tasks.loader import load_suite

FIXTURES = Path(__file__).parent / "fixtures"
runner = CliRunner()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGELINE_CACHE_DIR", str(tmp_path / "cache"))


def multi_step_task(d: Path, complete: bool = True) -> Path:
    """A Harbor task in the multi-step layout: no instruction.md or tests/ at its root;
    step 2 builds on what step 1 left. Incomplete: step 2 has no tests."""
    for step in ("01-setup", "02-extend"):
        (d / "steps" / step / "tests").mkdir(parents=True)
        (d / "steps" / step / "solution").mkdir(parents=True)
    (d / "environment").mkdir()
    (d / "environment" / "Dockerfile").write_text("FROM python:3.12-slim\nWORKDIR /app\n")
    (d / "task.toml").write_text('version = "1.0"\n\n'
                                 '[[steps]]\nname = "01-setup"\n\n'
                                 '[[steps]]\nname = "02-extend"\nmin_reward = 1.0\n'
                                 '[steps.verifier]\ntimeout_sec = 60\n')
    for step, files in (("01-setup", ["a"]), ("02-extend", ["a", "b"])):
        sd = d / "steps" / step
        (sd / "instruction.md").write_text(f"Create /app/{files[-1]}.txt.\n")
        (sd / "solution" / "solve.sh").write_text(f"#!/bin/bash\ntouch /app/{files[-1]}.txt\n")
        checks = "".join(f"    assert os.path.exists('/app/{f}.txt')\n" for f in files)
        (sd / "tests" / "test_step.py").write_text(f"import os\n\ndef test_files():\n{checks}")
        if complete or step == "01-setup":
            (sd / "tests" / "test.sh").write_text(
                "#!/bin/bash\ncd /app\npython3 -m pytest /tests/test_step.py -rA && echo 1 > "
                "/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    return d


def make_suite(root: Path) -> Path:
    """Two good tasks beside five that are broken in the ways collections are."""
    for name in ("tb1-hello-world", "harbor-hello"):
        shutil.copytree(FIXTURES / name, root / name)
    bad_yaml = root / "bad-yaml"
    shutil.copytree(FIXTURES / "tb1-hello-world", bad_yaml)
    (bad_yaml / "task.yaml").write_text("instruction: [unclosed\n")
    bad_toml = root / "bad-toml"
    shutil.copytree(FIXTURES / "harbor-hello", bad_toml)
    (bad_toml / "task.toml").write_text("version = \n")
    no_tests = root / "no-run-tests"
    shutil.copytree(FIXTURES / "tb1-hello-world", no_tests)
    (no_tests / "run-tests.sh").unlink()
    dangling = root / "dangling-task-file"
    dangling.mkdir()
    (dangling / "task.yaml").symlink_to(root / "nowhere.yaml")
    not_utf8 = root / "not-utf8"
    shutil.copytree(FIXTURES / "harbor-hello", not_utf8)
    (not_utf8 / "instruction.md").write_bytes(b"\xff\xfe\x00bad")
    (root / "notes").mkdir()            # not a task at all: ignored, not broken
    return root


BROKEN = {"bad-yaml": "invalid YAML", "bad-toml": "invalid TOML",
          "no-run-tests": "run-tests.sh", "dangling-task-file": "link to nothing",
          "not-utf8": "not UTF-8"}


def test_load_suite_sets_broken_tasks_aside_with_their_reason(tmp_path):
    suite = load_suite(make_suite(tmp_path))
    assert [t.id for t in suite.tasks] == ["harbor-hello", "tb1-hello-world"]
    reasons = {b.id: b.reason for b in suite.broken}
    assert sorted(reasons) == sorted(BROKEN)
    for task_id, word in BROKEN.items():
        assert word in reasons[task_id], reasons[task_id]
    # one task directory given on its own still fails loudly
    with pytest.raises(TaskError, match="invalid YAML"):
        load_suite(tmp_path / "bad-yaml")


def test_tasks_list_reports_broken_tasks_and_lists_the_rest(tmp_path):
    root = make_suite(tmp_path)
    r = runner.invoke(app, ["list", str(root), "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row for row in json.loads(r.output)}
    assert not rows["harbor-hello"]["broken"] and not rows["tb1-hello-world"]["broken"]
    assert {i for i, row in rows.items() if row["broken"]} == set(BROKEN)
    assert "invalid YAML" in rows["bad-yaml"]["reason"]
    r = runner.invoke(app, ["list", str(root)])
    assert r.exit_code == 0, r.output
    assert "2 tasks, 5 broken" in r.output and "broken bad-toml:" in r.output


def test_a_multi_step_harbor_task_runs_step_by_step(tmp_path):
    from ridgeline.tasks import apply_solution, prepare_environment
    from ridgeline.tasks.checks import check_task
    from ridgeline.tasks.steps import run_steps
    task = load_task(multi_step_task(tmp_path / "multi"))
    assert [s.name for s in task.steps] == ["01-setup", "02-extend"]
    assert task.instruction == "Create /app/a.txt." and task.unsupported_reason is None
    assert task.steps[1].test_timeout_s == 60
    check = check_task(task, runs=1, save=False)
    assert check.ok, check.reasons
    assert "steps 2/2 run, 2 passed" in check.oracle[0].detail
    assert "steps 1/2 run, 0 passed" in check.null.detail
    # An agent that does step 1 only: half the task, and step 2 is what failed.
    with prepare_environment(task) as sb:
        v = run_steps(task, sb, lambda view, box: view.metadata["step"] == "01-setup"
                      and apply_solution(view, box))
    assert v.status.value == "failed" and v.reward == 0.5
    assert "02-extend: failed" in v.detail


def test_an_incomplete_multi_step_task_is_broken_with_its_reason(tmp_path):
    with pytest.raises(TaskError, match="step '02-extend'"):
        load_task(multi_step_task(tmp_path / "multi", complete=False))


def test_tasks_check_rows_for_good_unsupported_and_broken_tasks(tmp_path):
    root = tmp_path / "suite"
    shutil.copytree(FIXTURES / "harbor-hello", root / "harbor-hello")
    multi_step_task(root / "multi", complete=False)
    (root / "bad-yaml").mkdir()
    (root / "bad-yaml" / "task.yaml").write_text("instruction: [unclosed\n")
    r = runner.invoke(app, ["check", str(root), "--runs", "1", "--json"])
    assert r.exit_code == 1, r.output
    out = json.loads(r.output)
    assert (out["n_tasks"], out["n_valid"], out["n_unsupported"], out["n_broken"]) == \
        (3, 1, 0, 2)
    rows = {row["id"]: row for row in out["tasks"]}
    assert rows["harbor-hello"]["ok"]
    assert rows["multi"]["broken"] and "step '02-extend'" in rows["multi"]["reasons"][0]
    assert rows["bad-yaml"]["broken"] and "invalid YAML" in rows["bad-yaml"]["reasons"][0]
    r = runner.invoke(app, ["check", str(root), "--runs", "1"])
    assert r.exit_code == 1
    assert "bad-yaml: broken:" in r.output and "02-extend" in r.output


def test_the_oracle_on_a_task_without_a_solution_is_unsupported(tmp_path):
    from ridgeline.agent.run import run_task_episode
    d = tmp_path / "no-solution"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    (d / "solution.sh").unlink()
    ep = run_task_episode(load_task(d), "oracle")
    assert ep.verdict.status.value == "unsupported"
    assert "no oracle solution" in ep.verdict.detail


def test_a_separate_verifier_environment_without_its_image_is_broken(tmp_path):
    d = tmp_path / "separate"
    shutil.copytree(FIXTURES / "harbor-hello", d)
    (d / "task.toml").write_text((d / "task.toml").read_text().replace(
        "[verifier]", '[verifier]\nenvironment_mode = "separate"'))
    with pytest.raises(TaskError, match="the verifier's image"):
        load_task(d)
    (d / "tests" / "Dockerfile").write_text("FROM python:3.12\n")
    assert "needs the image mode" in load_task(d).unsupported_reason_in(images=False)


def test_a_step_that_inherits_the_prior_session_continues_the_conversation(tmp_path):
    from ridgeline.agent.run import run_task_episode
    from tests.helpers.scripted_model import ScriptedModel
    d = multi_step_task(tmp_path / "multi")
    toml = (d / "task.toml").read_text().replace(
        'name = "02-extend"\n', 'name = "02-extend"\ninherit_prior_session = true\n')
    (d / "task.toml").write_text(toml)
    task = load_task(d)
    assert [s.inherit_prior_session for s in task.steps] == [False, True]
    act = "```bash\ntouch /app/{}.txt\n```"
    done = "<finish>done</finish>"
    model = ScriptedModel([act.format("a"), done, act.format("b"), done])
    ep = run_task_episode(task, model)
    assert ep.verdict.status.value == "passed", ep.verdict.detail
    first, second = model.prompts[0], model.prompts[2]
    assert "Create /app/a.txt." in first[1].content and len(first) == 2
    # step 2 starts from step 1's whole conversation, then its own instruction
    assert [m.content for m in second[:len(first)]] == [m.content for m in first]
    assert "Create /app/b.txt." in second[-1].content and len(second) > len(first) + 1
