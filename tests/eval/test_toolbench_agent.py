"""The tool-call benchmark through the harness: oracle and null bounds, the LLM agent on a
`WorldEnvironment` (native tool calls and the text format, a misuse it recovers from),
and `ridgeline eval --tasks toolbench --json`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ridgeline.agent import Trajectory
from ridgeline.errors import ConfigError, ModelEndpointError
from ridgeline.eval.runner import EvalConfig
from ridgeline.eval.toolbench.runner import WorldEnvironment, run_toolbench
from ridgeline.eval.toolbench.tasks import TOOL_TASKS
from ridgeline.eval.toolbench.world import World
from ridgeline.llm.base import Message

from tests.helpers.scripted_model import ScriptedModel, tool_reply


def _config(tmp_path: Path, agent: str, **kw) -> EvalConfig:
    return EvalConfig(tasks="toolbench", agent=agent, out=tmp_path / "out", **kw)


def _call(name: str, **arguments: object) -> str:
    return f'I will call {name}.\n<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_oracle_passes_every_task(tmp_path: Path) -> None:
    seen = []
    run = run_toolbench(_config(tmp_path, "oracle", concurrency=4), on_result=seen.append)
    assert run.summary.n_tasks == len(TOOL_TASKS) >= 15
    assert run.summary.pass_rate == 1.0 and run.summary.n_passed == len(TOOL_TASKS)
    assert {r.steps for r in run.results} == {1} and {r.trajectory for r in run.results} == {None}
    assert len(seen) == len(TOOL_TASKS)
    assert {r.domain for r in run.results} >= {"portfolio", "documents"}
    assert run.files["results"].exists() and run.files["report"].exists()
    assert run.meta["tasks"] == "toolbench" and run.meta["agent"] == "oracle"


def test_null_passes_nothing(tmp_path: Path) -> None:
    run = run_toolbench(_config(tmp_path, "null", samples=2, limit=5))
    assert run.summary.n_tasks == 5 and run.summary.n_episodes == 10
    assert run.summary.pass_rate == 0.0
    assert {r.failure_class for r in run.results} == {"state_mismatch"}


def test_unknown_task_id_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no-such-task"):
        run_toolbench(_config(tmp_path, "oracle", task_ids=["no-such-task"]))


def test_agent_solves_a_task_with_native_tool_calls(tmp_path: Path) -> None:
    model = ScriptedModel([tool_reply("get_price", call_id="a", symbol="ACME"),
                           tool_reply("buy", call_id="b", symbol="ACME", quantity=10),
                           tool_reply("finish", call_id="c", summary="bought 10 ACME")],
                          supports_tools=True)
    run = run_toolbench(_config(tmp_path, "llm", task_ids=["buy-acme"]), model=model)
    (res,) = run.results
    assert res.status == "passed", res.detail
    assert res.steps == 3 and res.tokens > 0 and res.failure_class is None
    # the world's result came back as JSON in the answer to the native call
    answer = model.prompts[1][-1]
    assert answer.role == "tool" and answer.tool_call_id == "a" and answer.content == "12.5"
    bought = json.loads(model.prompts[2][-1].content)
    assert bought["quantity"] == 10 and bought["cash"] == 10_000 - 125
    traj = Trajectory.load(res.trajectory)
    assert traj.header.action_format == "tool_calls"
    assert "buy" in {t.name for t in traj.header.tools}
    assert traj.verdict is not None and traj.verdict["status"] == "passed"


def test_agent_solves_a_task_in_the_text_format(tmp_path: Path) -> None:
    model = ScriptedModel([_call("get_positions"), _call("sell", symbol="BOLT", quantity=25),
                           "Done.\n<finish/>"])
    run = run_toolbench(_config(tmp_path, "llm", task_ids=["sell-all-bolt"]), model=model)
    (res,) = run.results
    assert res.status == "passed", res.detail
    system = model.prompts[0][0].content
    # the prompt teaches the world's tools, not the sandbox's
    assert "<tool_call>" in system and "- sell:" in system and '"quantity":{"type":"integer"}' in system
    assert "bash" not in system
    observation = model.prompts[1][-1]
    assert observation.role == "user" and '"BOLT": {"quantity": 25' in observation.content


def test_misuse_comes_back_as_an_observation_and_the_agent_recovers(tmp_path: Path) -> None:
    model = ScriptedModel([
        _call("buy", symbol="DYNE", quantity=6),           # 618 > 120 cash: refused
        _call("deposit", amount=500, currency="USD"),       # no such argument: format hint
        _call("deposit", amount=500),
        _call("buy", symbol="DYNE", quantity=6),
        "<finish/>",
    ])
    run = run_toolbench(_config(tmp_path, "llm", task_ids=["deposit-then-max-dyne"]), model=model)
    (res,) = run.results
    assert res.status == "passed", res.detail
    refused = model.prompts[1][-1].content
    assert "insufficient cash" in refused and "reflect" in refused  # failure nudge
    assert "takes no argument 'currency'" in model.prompts[2][-1].content
    traj = Trajectory.load(res.trajectory)
    assert traj.result.n_format_errors == 1
    assert traj.steps[0].observation is not None and traj.steps[0].observation.ok is False


def test_an_agent_that_changes_nothing_fails_with_state_mismatch(tmp_path: Path) -> None:
    model = ScriptedModel(["<finish/>"])
    run = run_toolbench(_config(tmp_path, "llm", task_ids=["buy-acme"]), model=model)
    (res,) = run.results
    assert res.status == "failed" and res.failure_class == "state_mismatch"
    assert "ACME" in res.detail


def test_a_model_endpoint_that_fails_stops_the_run(tmp_path: Path) -> None:
    def down(messages: list[Message]) -> str:
        raise ModelEndpointError("connection refused")

    model = ScriptedModel([down] * 10)
    with pytest.raises(ModelEndpointError, match=r"\(connection refused\).*episodes were run"):
        run_toolbench(_config(tmp_path, "llm", concurrency=1), model=model)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    episodes = saved["episodes"]
    assert episodes and all(r["failure_class"] == "model_error" for r in episodes)
    assert len(episodes) < len(TOOL_TASKS)


def test_world_environment_reports_misuse_without_raising() -> None:
    env = WorldEnvironment(World(cash=1.0, prices={"ACME": 5.0}))
    obs = env.execute(env.validate("buy", {"symbol": "ACME", "quantity": "two"}), timeout=5)
    assert not obs.ok and "whole number" in obs.text
    obs = env.execute(env.validate("get_price", {"symbol": "ACME"}), timeout=5)
    assert obs.ok and obs.text == "5.0"


def test_cli_runs_toolbench_and_prints_json(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "ridgeline"
    proc = subprocess.run([str(exe), "eval", "--tasks", "toolbench", "--agent", "oracle", "--json",
                           "--out", str(tmp_path / "cli")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"pass_rate", "n_tasks", "n_passed", "n_infra_error", "n_unsupported"} <= set(out)
    assert out["pass_rate"] == 1.0 and out["n_tasks"] == len(TOOL_TASKS)
    assert out["n_infra_error"] == 0 and out["n_unsupported"] == 0
