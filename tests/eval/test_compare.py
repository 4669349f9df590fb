"""`ridgeline eval-compare`: evaluation runs side by side, and whether they are the same
measurement."""

from __future__ import annotations

import json

import pytest

from ridgeline.errors import ConfigError
from ridgeline.eval.compare import compare
from ridgeline.eval.runner import EvalConfig, run_eval

TASKS = ["hello-file", "create-directory"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("evals")
    for agent in ("oracle", "null"):
        run_eval(EvalConfig(tasks="builtin", agent=agent, task_ids=TASKS, out=root / agent,
                            concurrency=2))
    return root


def test_runs_side_by_side_per_task_and_overall(runs, capsys):
    cmp = compare([runs / "oracle", runs / "null"], ["oracle", "null"])
    assert cmp.tasks == sorted(TASKS)
    oracle, null = cmp.runs
    assert (oracle.passed, oracle.scored, null.passed) == (2, 2, 0)
    assert oracle.per_task["hello-file"] == (1, 1) and null.per_task["hello-file"] == (0, 1)
    assert not cmp.differences
    from ridgeline.eval.compare import compare_command

    compare_command([runs / "oracle", runs / "null"], ["oracle", "null"], as_json=True)
    out = json.loads(capsys.readouterr().out)
    assert out["comparable"] and out["runs"][0]["pass_rate"] == 1.0


def test_other_sampling_or_other_tasks_are_named_not_hidden(runs, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(runs / "null", other)
    data = json.loads((other / "results.json").read_text())
    data["meta"]["temperature"] = 0.7
    data["episodes"] = data["episodes"][:1]
    (other / "results.json").write_text(json.dumps(data))
    cmp = compare([runs / "oracle", other])
    assert any(d.startswith("temperature") for d in cmp.differences)
    assert any(d.startswith("tasks") for d in cmp.differences)


def test_a_directory_without_results_is_a_clear_error(runs, tmp_path):
    with pytest.raises(ConfigError, match="no results.json"):
        compare([runs / "oracle", tmp_path])
    with pytest.raises(ConfigError, match="at least two"):
        compare([runs / "oracle"])
