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


def test_sampling_flags_reach_every_episode_with_a_seed_of_its_own(tmp_path):
    """--temperature/--top-p/--seed: every model call of an episode samples with them; each
    (task, sample) has its own seed, the same in a rerun; results.json and the report
    say how the run sampled."""
    from ridgeline.llm.base import Sampling
    from tests.helpers.scripted_model import ScriptedModel

    def run(out):
        model = ScriptedModel(["```bash\nexit 0\n```"] * 40)
        cfg = EvalConfig(agent="llm", task_ids=IDS[:2], samples=2, concurrency=1, out=out,
                         agent_config=AgentConfig(step_limit=1, sampling=Sampling(
                             temperature=0.7, top_p=0.9, seed=11, max_tokens=64)))
        return run_eval(cfg, model=model), model.samplings

    first, samplings = run(tmp_path / "a")
    assert {(s.temperature, s.top_p) for s in samplings} == {(0.7, 0.9)}
    seeds = {s.seed for s in samplings}
    assert len(seeds) == 4 and 11 not in seeds  # one per (task, sample), derived
    assert {s.seed for s in run(tmp_path / "b")[1]} == seeds
    meta = json.loads((tmp_path / "a" / "results.json").read_text())
    assert json.dumps(meta).count('"temperature": 0.7') >= 1
    assert "temperature 0.7, top_p 0.9, seed 11" in (tmp_path / "a" / "report.md").read_text()
    assert first.summary.pass_at_1_ci95 is not None


def test_pass_at_1_has_an_interval_over_tasks():
    from ridgeline.eval.results import EpisodeResult, summarize
    from ridgeline.tasks.verifier import VerdictStatus

    def ep(task, ok, sample=0):
        return EpisodeResult(task_id=task, sample=sample,
                             status=VerdictStatus.PASSED if ok else VerdictStatus.FAILED)

    mixed = summarize([ep(f"t{i}", i % 2 == 0) for i in range(40)])
    lo, hi = mixed.pass_at_1_ci95
    assert lo < mixed.pass_rate < hi and 0.25 < lo and hi < 0.75
    sure = summarize([ep(f"t{i}", True, s) for i in range(5) for s in range(4)], samples=4)
    assert sure.pass_at_1_ci95 == (1.0, 1.0)
    infra = EpisodeResult(task_id="x", status=VerdictStatus.INFRA_ERROR)
    assert summarize([infra]).pass_at_1_ci95 is None  # nothing scored, no interval


def test_a_run_directory_evaluates_its_checkpoint(tmp_path):
    from ridgeline.engine.model_executor.registry import DEFAULT_MODEL, resolve_model

    def checkpoint_model(model: str) -> str:
        return str(resolve_model(model).path) if model != DEFAULT_MODEL else model

    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text('{"model_type": "llama"}')
    # the run's own config.json (a training config) does not make it a model directory
    (tmp_path / "config.json").write_text('{"steps": 3}')
    assert checkpoint_model(str(tmp_path)) == str(tmp_path / "checkpoint")
    assert checkpoint_model(str(tmp_path / "checkpoint")) == str(tmp_path / "checkpoint")
    assert checkpoint_model("default") == "default"


def test_top_p_of_zero_is_refused_by_the_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ridgeline.cli", "eval", "--agent", "oracle",
                        "--task", IDS[0], "--out", str(tmp_path), "--top-p", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "top-p" in r.stderr
