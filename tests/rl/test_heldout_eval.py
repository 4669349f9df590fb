"""The held-out evaluation of a training run is `ridgeline eval`'s: the same episode
results, the same aggregation (pass@1 over scored episodes with its bootstrap interval
over tasks, infrastructure errors apart), results.json and trajectories under
RUN/eval/step-N/; the model is the rollout's generator with the rollout's sampling and
per-episode seeds apart from training's; and no training rollout runs while it does."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import ridgeline.tasks.steps as task_steps
from ridgeline.agent import AgentConfig, Trajectory
from ridgeline.eval.compare import compare
from ridgeline.eval.results import EpisodeResult, summarize
from ridgeline.llm.base import Completion, Sampling
from ridgeline.rl import run as rl_run
from ridgeline.rl.agent_rollout import AgentRollout
from ridgeline.rl.digits import tiny_policy
from ridgeline.rl.filters import EpisodeOutcome
from ridgeline.rl.parts import RunParts, RunTasks, make_trainer
from ridgeline.rl.policy import load_policy
from ridgeline.rl.rollouts import EpisodeGroup
from ridgeline.rl.run import TrainConfig, evaluate, train
from ridgeline.rl.run_log import read_metrics
from ridgeline.rl.sampler import TaskSampler, episode_seed
from ridgeline.rl.tokens import TokenEpisode
from ridgeline.tasks import Verdict, VerdictStatus, load_tasks
from ridgeline.tasks.loader import builtin_suite_dir
from tests.rl.test_agent_rollout import chatml_tokenizer


class ScriptedGenerator:
    """A token generator that solves hello-file (a bash action, then finish) and gives
    up on every other task at once; it records the sampling of every call and stamps
    its tokens with the engine's weights version."""

    def __init__(self, tokenizer, version: int) -> None:
        self.tok = tokenizer
        self.version = version
        self.name = "scripted"
        self.context_window = 100_000
        self.samplings: list[Sampling] = []

    def complete_ids(self, prompt_ids, sampling=None, tools=None) -> Completion:
        self.samplings.append(sampling)
        prompt = self.tok.decode(prompt_ids)
        if "hello.txt" in prompt and "echo hello" not in prompt:
            text = "<bash>echo hello > /app/hello.txt</bash>"
        else:
            text = "<finish/>"
        ids = self.tok.encode(text, add_special_tokens=False)
        return Completion(text=text, token_ids=ids, logprobs=[-0.5] * len(ids),
                          token_versions=[self.version] * len(ids), finish_reason="stop")


def held_out_tasks():
    suite = {t.id: t for t in load_tasks(str(builtin_suite_dir()))}
    return [suite[i] for i in ("hello-file", "create-directory", "uppercase-text")]


def test_the_held_out_eval_is_evals_results_and_trajectories_under_the_run_dir(
        tmp_path, monkeypatch):
    # uppercase-text's grading fails as infrastructure: never a pass nor a fail
    real_verify = task_steps.verify   # where an episode's verdict is made

    def verify(task, sb):
        if task.id == "uppercase-text":
            return Verdict(VerdictStatus.INFRA_ERROR, detail="injected", reason="sandbox_error")
        return real_verify(task, sb)

    monkeypatch.setattr(task_steps, "verify", verify)
    tok = chatml_tokenizer()
    gen = ScriptedGenerator(tok, version=3)
    rollout = AgentRollout(gen, tok, AgentConfig(step_limit=3),
                           Sampling(temperature=0.7, max_tokens=64))
    cfg = TrainConfig(out=tmp_path / "run", eval_samples=2, seed=5,
                      rollout={"temperature": 0.7})
    tasks = held_out_tasks()

    ev = evaluate(cfg, rollout, tasks, step=4, version=3)

    out = tmp_path / "run" / "eval" / "step-4"
    data = json.loads((out / "results.json").read_text())
    results = [EpisodeResult.model_validate(e) for e in data["episodes"]]   # eval's type
    by = {(r.task_id, r.sample): r for r in results}
    assert sorted(by) == sorted((t.id, s) for t in tasks for s in (0, 1))
    for s in (0, 1):
        assert by["hello-file", s].status is VerdictStatus.PASSED
        assert by["create-directory", s].status is VerdictStatus.FAILED
        assert by["uppercase-text", s].failure_class == "infra:sandbox_error"
    for r in results:        # every trajectory under the run dir, graded by its verdict
        traj = Trajectory.load(r.trajectory)
        assert traj.verdict is not None and traj.verdict["status"] == r.status.value
        assert r.trajectory == str(out / "trajectories" / f"{r.task_id}.{r.sample}.jsonl")
    # the aggregation is eval's: pass@1 over scored episodes, the interval over tasks
    summary = summarize(results, samples=2)
    assert data["summary"]["pass_at_1_ci95"] == list(summary.pass_at_1_ci95)
    assert ev["pass_rate"] == summary.pass_rate == 0.5
    assert ev["pass_rate_ci95"] == summary.pass_at_1_ci95 == (0.0, 1.0)
    assert (ev["episodes"], ev["ungraded"], ev["infra_errors"]) == (6, 2, 2)
    assert ev["ungraded_reasons"] == {"infra:sandbox_error": 2}
    assert ev["per_task"] == {"hello-file": 1.0, "create-directory": 0.0,
                              "uppercase-text": None}
    assert ev["version"] == 3 and ev["sampled_versions"] == [3]
    assert ev["results"] == str(out / "results.json") and ev["endpoint_error"] is None
    assert data["meta"]["temperature"] == 0.7 and data["meta"]["version"] == 3

    # the rollout's sampling, one seed per episode (TokenChat: seed * 1000 + turn), none
    # of them a training episode's, and the same at the next eval
    assert {(s.temperature, s.top_p) for s in gen.samplings} == {(0.7, 1.0)}
    seeds = sorted(s.seed for s in gen.samplings)
    episodes = {s // 1000 for s in seeds}
    assert len(episodes) == 6
    training = {episode_seed(cfg.seed, d, j) for d in range(2000) for j in range(16)}
    assert not episodes & training
    gen.samplings.clear()
    again = evaluate(cfg, rollout, tasks, step=5, version=3)
    assert sorted(s.seed for s in gen.samplings) == seeds
    assert again["per_task"] == ev["per_task"]
    # two evals of a run are two `ridgeline eval` runs: eval-compare reads them as the
    # same measurement
    cmp = compare([out, tmp_path / "run" / "eval" / "step-5"])
    assert not cmp.differences and [r.pass_rate for r in cmp.runs] == [0.5, 0.5]


# ---- no training rollout in flight during the eval ----------------------------------------


@dataclass(frozen=True)
class ToyTask:
    id: str
    domain: str = "toy"
    difficulty: str = "easy"


class Sink:
    def __init__(self) -> None:
        self.version = 0

    def update_weights(self, tensors, version=None) -> int:
        self.version = version
        return len(list(tensors))


class CountingRollout:
    """Training groups that take a while, and held-out episodes (played elsewhere, as
    Ray's are: only the outcome comes back) that note how many groups run meanwhile."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.lock = threading.Lock()
        self.running = 0
        self.during_eval: list[int] = []
        self.eval_versions: list[int] = []

    def __call__(self, task, seeds) -> EpisodeGroup:
        with self.lock:
            self.running += 1
        try:
            version = self.sink.version
            time.sleep(0.2)
            outcomes = []
            for _ in seeds:
                ep = TokenEpisode.start([11, 1, 2, 3, 10])
                ep.add_completion([5, 5], [0.0, 0.0], [version, version])
                outcomes.append(EpisodeOutcome(verdict="failed", reward=0.0, sample=ep))
            return EpisodeGroup(task, outcomes, 0.2)
        finally:
            with self.lock:
                self.running -= 1

    def episode(self, task, seed, sample):
        for _ in range(3):
            with self.lock:
                self.during_eval.append(self.running)
            time.sleep(0.03)
        self.eval_versions.append(self.sink.version)
        passed = task.id == "h0"
        return EpisodeOutcome(verdict="passed" if passed else "failed",
                              reward=1.0 if passed else 0.0), None


def test_no_training_rollout_runs_during_the_held_out_eval(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    tiny_policy(0).save_pretrained(model_dir)
    cfg = TrainConfig.model_validate({
        "policy": {"model": str(model_dir)}, "steps": 6, "eval_every": 2, "eval_samples": 2,
        "out": str(tmp_path / "run"), "checkpoint_every": 100, "plots": False,
        "loop": {"group_size": 2, "batch_groups": 1, "eta": 1, "rollout_threads": 3}})
    sink = Sink()
    rollout = CountingRollout(sink)
    policy = load_policy(cfg.policy)
    parts = RunParts(policy, make_trainer(cfg, policy), rollout, sink)
    tasks = RunTasks(TaskSampler([ToyTask("t0"), ToyTask("t1")]),
                     held_out=[ToyTask("h0"), ToyTask("h1")])
    monkeypatch.setattr(rl_run, "probe_sandbox", lambda backend: None)
    monkeypatch.setattr(rl_run, "select_tasks", lambda config: tasks)
    monkeypatch.setattr(rl_run, "build_parts", lambda config: parts)

    result = train(cfg)

    assert result.steps_done == 6
    assert [e["step"] for e in result.evals] == [0, 2, 4, 6]
    assert len(rollout.during_eval) == 4 * 4 * 3
    assert set(rollout.during_eval) == {0}       # the eval had the engine to itself
    # the version recorded is the one the engine held throughout the eval
    assert [e["version"] for e in result.evals] == [0, 2, 4, 6]
    assert rollout.eval_versions == [v for v in (0, 2, 4, 6) for _ in range(4)]
    for e in result.evals:
        assert e["pass_rate"] == 0.5 and e["per_task"] == {"h0": 1.0, "h1": 0.0}
        assert e["infra_errors"] == 0 and e["pass_rate_ci95"] == (0.0, 1.0)
    lines = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 2, 4, 6]
    assert all(set(x) >= {"step", "version", "pass_rate", "pass_rate_ci95", "episodes",
                          "ungraded", "infra_errors", "per_task", "seconds"} for x in lines)
    assert (tmp_path / "run" / "eval" / "step-6" / "results.json").is_file()
    # the run went on after each pause, within its staleness bound
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(6))
    assert all(m["staleness_max"] <= 1 for m in metrics)
    assert [m.get("eval/pass_rate") for m in metrics] == [None, 0.5, None, 0.5, None, 0.5]
