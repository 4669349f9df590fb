"""A training run: `ridgeline train --config FILE [--resume]`.

    config = load_train_config("train.yaml")
    result = train(config)                  # or train(config, resume=True)

Builds the tasks (terminal tasks played by the agent in task sandboxes, or the token
family `shift` for quick experiments) and the parts (`parts.py`: the policy, `load_policy`
with the engine's own weights, its trainer, the rollout and where weights go: the
in-process engine on the same Hugging Face directory, servers at `engine.url`, or Ray
actors), then the asynchronous loop and the run directory (`run_log`), and trains. After every step the
metrics line is written (fsynced), then every `checkpoint_every` steps a checkpoint;
`--resume` restores the newest one (weights, optimizer, buffer, task order, RNG),
drops the metrics of later steps and goes on with the step after it.

Problems that would otherwise surface mid-run are checked at the start: a missing model,
a task selection that is empty or where every task fails its quality check (the oracle
must pass and the null agent fail), a checkpoint of another model, a sandbox backend that
cannot start.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from ridgeline.agent.results import (
    EpisodeResult, episode_result, run_jobs, summarize, task_episode_result, write_results,
)
from ridgeline.agent.run import run_task_episode
from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.rl import checkpoint
from ridgeline.rl.config import TrainConfig, load_train_config
from ridgeline.rl.distributed import ray_parts
from ridgeline.rl.loop import AsyncRLLoop
from ridgeline.rl.parts import (
    RunParts, RunTasks, local_parts, make_trainer, remote_parts, select_tasks,
)
from ridgeline.rl.policy import load_policy
from ridgeline.rl.protocols import EpisodeRollout, GroupRollout, RLTask, StepMetrics
from ridgeline.rl.run_log import RunLog
from ridgeline.rl.run_plots import plot_run
from ridgeline.rl.sampler import episode_seed
from ridgeline.rl.sharded import ShardedTrainer
from ridgeline.tasks.verifier import Verdict, VerdictStatus

if TYPE_CHECKING:
    from ridgeline.tasks import Task

__all__ = ["HeldOutEval", "TrainConfig", "TrainResult", "load_train_config", "train"]

log = logging.getLogger(__name__)


class HeldOutEval(TypedDict):
    """One held-out evaluation: a line of eval.jsonl. Scored as `ridgeline eval` scores
    (`agent.results.summarize`): infrastructure errors and unsupported tasks are never
    scored, neither pass nor fail. Its episodes are in `results` (results.json, as
    `ridgeline eval` writes it) and their trajectories beside it."""

    step: int
    version: int                    # the trainer's weights version, the one evaluated
    sampled_versions: list[int]     # the versions the engine sampled the episodes under
    pass_rate: float | None         # over scored episodes; None when none was scored
    pass_rate_ci95: tuple[float, float] | None   # bootstrap over tasks; None: none scored
    episodes: int
    ungraded: int                   # not scored: infra errors and unsupported tasks
    infra_errors: int
    ungraded_reasons: dict[str, int]   # failure class (infra:<what>, unsupported:..) -> n
    per_task: dict[str, float | None]  # pass rate over its scored episodes (None: none)
    seconds: float
    results: str                    # RUN/eval/step-N/results.json
    endpoint_error: str | None      # the model endpoint went down: the eval stopped early


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    history: list[StepMetrics] = field(default_factory=list)
    evals: list[HeldOutEval] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)


def build_parts(cfg: TrainConfig) -> RunParts:
    """The policy, trainer, rollout and weights sink: Ray actors, servers at
    `engine.url`, or the in-process engine."""
    if cfg.ray.enabled:
        if cfg.engine.url:
            raise ConfigError("ray.enabled and engine.url both set",
                              hint="with Ray, each rollout worker runs its own engine replica")
        return ray_parts(cfg)
    parts = remote_parts(cfg) if cfg.engine.url else local_parts(cfg)
    if isinstance(parts.trainer, ShardedTrainer):
        # the last thing the run does: the other ranks' `follow` returns
        parts.closers.append(parts.trainer.close)
    return parts


def follow(cfg: TrainConfig) -> None:
    """A rank other than 0 of `ridgeline train --nproc N`: the policy and its shard of
    the trainer, which runs the trainer calls rank 0's run makes until it ends."""
    trainer = make_trainer(cfg, load_policy(cfg.policy))
    assert isinstance(trainer, ShardedTrainer), "follow() runs in a rank of sharded.launch"
    trainer.follow()


def export(run_dir: Path, out_dir: Path) -> Path:
    """`ridgeline train export RUN_DIR OUT_DIR`: the policy of the run's newest checkpoint
    (whole or sharded, written at any world size) as a Hugging Face directory that
    transformers and the engine load."""
    config = run_dir / "config.json"
    if not config.is_file():
        raise ConfigError(f"{run_dir} holds no training run (no config.json)",
                          hint="pass the run directory of `ridgeline train` (its --out)")
    cfg = TrainConfig.model_validate_json(config.read_text())
    cfg = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(
        update={"nproc": 1})})
    policy = load_policy(cfg.policy)
    ckpt = checkpoint.load(run_dir, policy.identity)
    checkpoint.restore_trainer(ckpt, make_trainer(cfg, policy))
    return policy.save_pretrained(out_dir)


def evaluate(cfg: TrainConfig, rollout: GroupRollout[Task], tasks: list[Task], step: int,
             version: int) -> HeldOutEval:
    """The held-out tasks, `eval_samples` episodes each, run and scored by the code
    `ridgeline eval` uses (`agent.results`: `run_jobs`, one `EpisodeResult` per episode,
    `summarize`), with the rollout's model (the engine's current weights) and sampling.
    Writes RUN/eval/step-N/results.json and the episodes' trajectories beside it. Call it
    while no rollout is in flight (`AsyncRLLoop.paused`)."""
    # held-out tasks are terminal tasks, whose rollouts (the agent's, Ray's) play single
    # episodes
    assert isinstance(rollout, EpisodeRollout)
    out_dir = cfg.out / "eval" / f"step-{step}"
    traj_dir = out_dir / "trajectories"
    traj_dir.mkdir(parents=True, exist_ok=True)
    position: dict[str, int] = {}
    for i, t in enumerate(tasks):
        position.setdefault(t.id, i)
    sampled: set[int] = set()

    def run_one(job: tuple[Task, int]) -> EpisodeResult:
        task, sample = job
        # seeds apart from training's (negative draws), the same at every eval
        seed = episode_seed(cfg.seed + 1, -1 - position[task.id], sample)
        return _held_out_episode(rollout, task, sample, seed,
                                 traj_dir / f"{task.id}.{sample}.jsonl", version, sampled)

    t0 = time.perf_counter()
    jobs = [(t, s) for s in range(cfg.eval_samples) for t in tasks]
    concurrency = min(len(jobs), cfg.engine.max_num_seqs) or 1
    results, endpoint_error = run_jobs(jobs, run_one, concurrency)
    seconds = time.perf_counter() - t0
    summary = summarize(results, samples=cfg.eval_samples, wall_s=seconds)
    # as `ridgeline eval` describes its run (`eval.runner.run_meta`)
    r = getattr(rollout, "sampling", None) or cfg.rollout
    meta = {"agent": "llm", "tasks": "held-out", "model": cfg.policy.model, "step": step,
            "version": version, "temperature": r.temperature, "top_p": r.top_p,
            "seed": cfg.seed + 1, "max_tokens": r.max_tokens, "samples": cfg.eval_samples,
            "concurrency": concurrency, "backend": cfg.rollout.backend,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    path = write_results(out_dir, results, summary, meta)
    if endpoint_error is not None:
        log.warning("held-out eval of step %d stopped early, the model endpoint failed: %s",
                    step, endpoint_error)
    if sampled - {version}:
        log.warning("held-out eval of version %d sampled under versions %s", version,
                    sorted(sampled))
    scored: dict[str, list[EpisodeResult]] = {t.id: [] for t in tasks}
    for res in results:
        if res.scored:
            scored[res.task_id].append(res)
    return {"step": step, "version": version, "sampled_versions": sorted(sampled),
            "pass_rate": summary.pass_rate if summary.n_scored else None,
            "pass_rate_ci95": summary.pass_at_1_ci95,
            "episodes": summary.n_episodes, "ungraded": summary.n_episodes - summary.n_scored,
            "infra_errors": summary.n_infra_error,
            "ungraded_reasons": dict(Counter(x.failure_class or "?" for x in results
                                             if not x.scored)),
            "per_task": {k: sum(x.status is VerdictStatus.PASSED for x in v) / len(v)
                         if v else None for k, v in scored.items()},
            "seconds": round(seconds, 1), "results": str(path),
            "endpoint_error": endpoint_error}


def _held_out_episode(rollout: EpisodeRollout[Task], task: Task, sample: int, seed: int,
                      path: Path, version: int, sampled: set[int]) -> EpisodeResult:
    """One held-out episode as `ridgeline eval` runs it (`run_task_episode`, then
    `task_episode_result`), its model a `TokenChat` on the agent rollout's generator with
    the rollout's sampling and `seed`. A rollout whose episodes run elsewhere (Ray's
    workers) reports only the outcome: the result is made from its verdict (no
    trajectory here)."""
    from ridgeline.rl.agent_rollout import AgentRollout
    from ridgeline.rl.token_chat import TokenChat

    if not isinstance(rollout, AgentRollout):
        t0 = time.perf_counter()
        outcome, _ = rollout.episode(task, seed, sample)
        verdict = Verdict(VerdictStatus(outcome.verdict), reward=outcome.reward,
                          detail=outcome.detail, reason=outcome.detail or None)
        return episode_result(task, sample, verdict, None, time.perf_counter() - t0, path)
    chat = TokenChat(rollout.generator, rollout.tokenizer,
                     sampling=rollout.sampling.model_copy(update={"seed": seed}),
                     version=version)
    ep = run_task_episode(task, chat, rollout.agent_config, backend=rollout.backend,
                          trajectory_path=path)
    if chat.episode is not None:
        sampled.update(v for v in chat.episode.versions if v >= 0)
    return task_episode_result(task, sample, ep, path)


def probe_sandbox(backend: str) -> None:
    """Start and stop one sandbox of `backend`: a backend that cannot start fails the run
    here, not as every episode's infra error."""
    from ridgeline.sandbox import SandboxSpec, create_sandbox

    try:
        create_sandbox(SandboxSpec(), backend=backend).close()
    except RidgelineError as e:
        raise ConfigError(f"the sandbox backend {backend!r} cannot start a sandbox: {e}",
                          hint="`ridgeline sandbox run -- true` shows the problem; or set "
                               "rollout.backend") from None


def write_report(run_dir: Path, tasks: RunTasks, loop: AsyncRLLoop[RLTask]) -> None:
    """report.json: the tasks left out and why (quality check, flaky oracle), each
    domain's share of rollouts and its state, and the domain conflicts flagged."""
    domains = loop.adaptive.domain_report() if loop.adaptive is not None else {}
    report = {"excluded_tasks": tasks.excluded, "domains": domains,
              "conflicts": loop.conflicts.report(), "rollout_errors": loop.errors[-20:]}
    tmp = run_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(run_dir / "report.json")


def _append_json(path: Path, record: Mapping[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train(config: TrainConfig, *, resume: bool = False,
          on_step: Callable[[int, StepMetrics], None] | None = None) -> TrainResult:
    run_dir = config.out
    if not resume and checkpoint.find(run_dir) is not None:
        raise ConfigError(f"{run_dir} already holds a run",
                          hint="pass --resume to continue it, or choose another --out")
    probe_sandbox(config.rollout.backend)
    tasks = select_tasks(config)   # before the model: a bad selection fails in seconds
    parts = build_parts(config)
    try:
        return _train(config, tasks, parts, resume, on_step)
    finally:
        parts.close()


def _start(cfg: TrainConfig, tasks: RunTasks, parts: RunParts, loop: AsyncRLLoop[RLTask],
           resume: bool) -> tuple[int, RunLog]:
    """A new run directory (step 0), or everything restored from the checkpoint: the
    first step to train and the run log."""
    run_dir = cfg.out
    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        runlog = RunLog(run_dir)
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
        return 0, runlog
    ckpt = checkpoint.load(run_dir, parts.policy.identity)
    checkpoint.restore_trainer(ckpt, parts.trainer)    # whole or sharded, any world size
    parts.trainer.version -= 1      # sync() makes it the checkpoint's version again
    parts.trainer.sync(parts.weights)
    loop.buffer.load_state_dict(ckpt.buffer)
    tasks.source.load_state_dict(ckpt.state["sampler"])
    loop.conflicts.load_state_dict(ckpt.state.get("extra", {}).get("conflicts", {}))
    checkpoint.set_rng_state(ckpt.rng)
    log.info("resumed %s at step %d (version %d)", run_dir, ckpt.step + 1,
             parts.trainer.version)
    return ckpt.step + 1, RunLog(run_dir, resume_step=ckpt.step)


def _save(cfg: TrainConfig, step: int, tasks: RunTasks, parts: RunParts,
          loop: AsyncRLLoop[RLTask]) -> None:
    # the buffer first, then the task source: a group finishing in between is handed
    # out again on resume, never both restored and redone
    buffer_state = loop.buffer.state_dict()
    ready = [e["group"].index for e in buffer_state["ready"]]
    t0 = time.perf_counter()
    checkpoint.save(cfg.out, step, policy=parts.policy, trainer=parts.trainer,
                    buffer_state=buffer_state, sampler_state=tasks.source.state_dict(ready),
                    identity=parts.policy.identity,
                    extra={"conflicts": loop.conflicts.state_dict()})
    log.info("checkpoint of step %d written in %.1f s", step, time.perf_counter() - t0)


def _train(cfg: TrainConfig, tasks: RunTasks, parts: RunParts, resume: bool,
           on_step: Callable[[int, StepMetrics], None] | None) -> TrainResult:
    run_dir = cfg.out
    loop: AsyncRLLoop[RLTask] = AsyncRLLoop(parts.trainer, tasks.source, parts.rollout,
                                            parts.weights, cfg.loop)
    start, runlog = _start(cfg, tasks, parts, loop, resume)
    result = TrainResult(run_dir, start, excluded=tasks.excluded)
    if tasks.excluded:
        (run_dir / "excluded_tasks.json").write_text(json.dumps(tasks.excluded, indent=1))

    def held_out(done: int) -> HeldOutEval:
        # no training rollout in flight: the eval has the engine, on one weights version,
        # to itself; groups finished meanwhile wait in the buffer
        with loop.paused():
            ev = evaluate(cfg, parts.rollout, tasks.held_out, done, parts.trainer.version)
        _append_json(run_dir / "eval.jsonl", ev)
        result.evals.append(ev)
        return ev

    if tasks.held_out and start == 0:
        held_out(0)         # the base policy, with the same sampling as every later eval
    started = time.monotonic()

    def step_done(step: int, metrics: StepMetrics) -> None:
        done = step + 1
        last = done == cfg.steps or (cfg.time_limit_s is not None
                                     and time.monotonic() - started >= cfg.time_limit_s)
        if tasks.held_out and (last or (cfg.eval_every and done % cfg.eval_every == 0)):
            ev = held_out(done)
            if ev["pass_rate"] is not None:
                metrics["eval/pass_rate"] = ev["pass_rate"]
        metrics.update(parts.metrics())    # per-replica / per-worker load
        runlog.log(step, metrics)  # before the checkpoint: a kill between loses nothing
        if done % cfg.checkpoint_every == 0 or last:
            _save(cfg, step, tasks, parts, loop)
        result.steps_done = done
        result.history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
        if last:
            loop.stop()

    try:
        loop.run(cfg.steps, on_step=step_done, start_step=start)
    finally:
        runlog.close()
        write_report(run_dir, tasks, loop)
        if cfg.plots:
            try:
                plot_run(run_dir)
            except Exception as e:  # noqa: BLE001 - plots are a convenience
                log.warning("could not draw the run's plots: %s", e)
    if loop.errors:
        log.warning("%d rollouts failed; last: %s", len(loop.errors), loop.errors[-1])
    return result
