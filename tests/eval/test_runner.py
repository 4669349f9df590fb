"""The evaluation harness end to end: real sandboxes, real built-in tasks, real verifier."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from ridgeline.agent import AgentConfig
from ridgeline.errors import ConfigError, ModelEndpointError
from ridgeline.eval.runner import EvalConfig, run_eval
from ridgeline.llm import OpenAIClient
from ridgeline.tasks import load_tasks

IDS = [t.id for t in load_tasks("builtin")][:3]


def test_oracle_passes_every_task(tmp_path):
    seen = []
    ok = run_eval(EvalConfig(agent="oracle", task_ids=IDS, concurrency=3, out=tmp_path),
                  on_result=seen.append)
    assert ok.summary.n_passed == 3 and ok.summary.pass_rate == 1.0 and len(seen) == 3
    assert {r.steps for r in ok.results} == {1}


def test_null_agent_fails_every_sample_and_the_report_says_so(tmp_path):
    null = run_eval(EvalConfig(agent="null", task_ids=IDS, concurrency=3, samples=2, out=tmp_path))
    assert null.summary.n_episodes == 6 and null.summary.n_passed == 0
    assert null.summary.failure_classes == {"tests_failed": 6}
    assert null.summary.pass_at_k["pass@2"] == 0.0
    data = json.loads((tmp_path / "results.json").read_text())
    assert {e["task_id"] for e in data["episodes"]} == set(IDS)
    assert (tmp_path / "report.md").read_text().startswith("# Evaluation: null")


def test_unknown_task_id_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no-such-task"):
        run_eval(EvalConfig(agent="null", task_ids=["no-such-task"], out=tmp_path))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_down_keeps_results_and_raises(tmp_path):
    model = OpenAIClient(f"http://127.0.0.1:{_closed_port()}/v1", model="m", max_retries=1,
                         backoff_s=0.01, timeout=2.0)
    cfg = EvalConfig(agent="llm", task_ids=IDS, concurrency=1, out=tmp_path,
                     agent_config=AgentConfig(step_limit=3))
    with pytest.raises(ModelEndpointError, match="episodes were run and saved"):
        run_eval(cfg, model=model)
    data = json.loads((tmp_path / "results.json").read_text())
    assert 1 <= len(data["episodes"]) < len(IDS)  # stopped early, what ran is kept
    ep = data["episodes"][0]
    assert ep["status"] == "infra_error" and ep["failure_class"] == "model_error"


def test_cli_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ridgeline.cli", "eval", "--agent", "oracle",
                        "--task", IDS[0], "--out", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("pass_rate", "n_tasks", "n_passed", "n_infra_error", "n_unsupported"):
        assert key in out
    assert out["n_passed"] == 1


def test_demo_slice_covers_every_domain():
    from ridgeline.eval.runner import DEMO_TASK_IDS, select_tasks

    demo = select_tasks(EvalConfig(tasks="demo"))
    assert sorted(t.id for t in demo) == sorted(DEMO_TASK_IDS)
    assert {t.domain for t in demo} == {t.domain for t in load_tasks("builtin")}
