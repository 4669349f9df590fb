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

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.rl import checkpoint
from ridgeline.rl.config import TrainConfig, load_train_config
from ridgeline.rl.distributed import ray_parts
from ridgeline.rl.loop import AsyncRLLoop
from ridgeline.rl.parts import RunParts, RunTasks, local_parts, remote_parts, select_tasks
from ridgeline.rl.protocols import EpisodeRollout, GroupRollout, RLTask, StepMetrics
from ridgeline.rl.rollouts import passed
from ridgeline.rl.run_log import RunLog
from ridgeline.rl.run_plots import plot_run
from ridgeline.rl.sampler import episode_seed

if TYPE_CHECKING:
    from ridgeline.tasks import Task

__all__ = ["HeldOutEval", "TrainConfig", "TrainResult", "load_train_config", "train"]

log = logging.getLogger(__name__)


class HeldOutEval(TypedDict):
    """One held-out evaluation: a line of eval.jsonl."""

    step: int
    version: int
    pass_rate: float | None         # over graded episodes; None when none was graded
    episodes: int
    ungraded: int
    ungraded_reasons: dict[str, int]   # "verdict:detail" -> episodes
    per_task: dict[str, float]      # pass rate over all its episodes, ungraded ones too
    seconds: float


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
    return remote_parts(cfg) if cfg.engine.url else local_parts(cfg)


def evaluate(cfg: TrainConfig, rollout: GroupRollout[Task], tasks: list[Task], step: int,
             version: int) -> HeldOutEval:
    """The held-out tasks, `eval_samples` episodes each, with the rollout's sampling."""
    # held-out tasks are terminal tasks, whose rollouts (the agent's, Ray's) play single
    # episodes
    assert isinstance(rollout, EpisodeRollout)
    t0 = time.perf_counter()
    jobs = [(i, t, j) for i, t in enumerate(tasks) for j in range(cfg.eval_samples)]
    with ThreadPoolExecutor(min(len(jobs), cfg.engine.max_num_seqs) or 1) as ex:
        # seeds apart from training's (negative draws), the same at every eval
        outcomes = list(ex.map(lambda job: rollout.episode(
            job[1], episode_seed(cfg.seed + 1, -1 - job[0], job[2]), job[2])[0], jobs))
    per_task: dict[str, list[bool]] = {}
    for (_, task, _), out in zip(jobs, outcomes):
        per_task.setdefault(task.id, []).append(passed(out))
    graded = [out for out in outcomes if out.reward is not None]
    why = Counter(f"{o.verdict}:{o.detail}" for o in outcomes if o.reward is None)
    return {"step": step, "version": version,
            "pass_rate": sum(passed(o) for o in graded) / len(graded) if graded else None,
            "episodes": len(outcomes), "ungraded": len(outcomes) - len(graded),
            "ungraded_reasons": dict(why),
            "per_task": {k: sum(v) / len(v) for k, v in per_task.items()},
            "seconds": round(time.perf_counter() - t0, 1)}


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
    parts.trainer.load_state_dict(ckpt.trainer)
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
