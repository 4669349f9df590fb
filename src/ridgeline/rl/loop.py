"""The asynchronous RL loop on token tasks: rollout threads generate groups on the engine
while the trainer learns from earlier ones, with staleness bounded by admission control.

    rollout = TokenTaskRollout(llm, SandboxVerifier(script), max_tokens=16)
    loop = AsyncRLLoop(trainer, TaskSampler(tasks), rollout, llm.worker, LoopConfig(eta=1))
    for metrics in loop.run(steps=200): ...

A rollout thread asks the buffer for admission (blocked while starting another group
would leave it more than `eta` versions stale when consumed), draws the next task from
the `TaskSampler` and has the group rollout produce `group_size` episodes of it, each a
`TokenEpisode` (token ids, behaviour logprobs and weights versions as sampled) with an
`EpisodeRecord` (verdict, reward, exit status). Two rollouts exist: `TokenTaskRollout`
(single-turn prompt ids in, completion ids out, scored by a verifier that runs in a
sandbox: model output is never evaluated on the host) and `agent_rollout.AgentRollout`
(the agent in a task sandbox, multi-turn, graded by the task's tests). A verifier that
fails masks the group's episodes (reward None, with a reason): an infrastructure failure
never becomes a reward of 0. The trainer takes `batch_groups` groups per step, filters
them (masked episodes, zero-variance groups), computes GRPO advantages, steps, syncs the
weights into the engine as a new version and publishes it to the buffer.

The sampler (`sampler.py`) hands out tasks in a seeded order and knows which draws are
not yet trained on, and episode seeds derive from (run seed, draw, sample): a checkpoint
of the sampler and the buffer resumes the same data order. The rollouts and their groups
are in `rollouts.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import RidgelineError
from ridgeline.rl.advantages import group_advantages
from ridgeline.rl.buffer import BufferClosed, RolloutBuffer
from ridgeline.rl.conflicts import ConflictConfig, ConflictMonitor
from ridgeline.rl.filters import (
    TOO_FEW_VALID, ZERO_VARIANCE, FilterConfig, filter_batch,
)
from ridgeline.rl.rollouts import EpisodeGroup, GroupRollout, VerifierError, passed
from ridgeline.rl.sampler import TaskSampler, episode_seed
from ridgeline.rl.scheduler import task_domain
from ridgeline.rl.tokens import TokenBatch
from ridgeline.tasks.verifier import VerdictStatus

log = logging.getLogger(__name__)


class LoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(8, ge=2, description="completions per task (a GRPO group)")
    batch_groups: int = Field(8, ge=1, description="groups per train step")
    eta: int = Field(1, ge=0, description="max policy versions between sampling and use")
    rollout_threads: int = Field(2, ge=1, description="groups played at once")
    normalize_std: bool = Field(True, description="divide each group's advantages by its "
                                "reward std (GRPO): a group with one success in eight weighs "
                                "like one with four. Dr.GRPO argues for False (no bias toward "
                                "low-variance groups); the recorded learning runs used True")
    filters: FilterConfig = Field(default_factory=FilterConfig)
    conflicts: ConflictConfig = Field(default_factory=ConflictConfig)


class AsyncRLLoop:
    def __init__(self, trainer: Any, tasks: TaskSampler, rollout: GroupRollout, worker: Any,
                 config: LoopConfig | None = None) -> None:
        self.trainer = trainer
        self.tasks = tasks
        self.rollout = rollout
        self.worker = worker          # where weights are synced (an EngineWorker)
        self.config = cfg = config or LoopConfig()
        self.buffer = RolloutBuffer(cfg.batch_groups, cfg.eta)
        self.conflicts = ConflictMonitor(cfg.conflicts)
        self._stop = threading.Event()
        self.errors: list[str] = []

    def stop(self) -> None:
        """End `run()` after the current step (e.g. from `on_step` once a goal is met)."""
        self._stop.set()

    # ---- rollouts ---------------------------------------------------------------------

    def _produce(self) -> None:
        cfg = self.config
        while True:
            try:
                ticket = self.buffer.admit()
            except BufferClosed:
                return
            draw = -1
            try:
                draw, task = self.tasks.draw()
                seeds = [episode_seed(self.tasks.seed, draw, j) for j in range(cfg.group_size)]
                group = self.rollout(task, seeds)
                group.index = draw
                self.tasks.finished(draw, group)
            except BufferClosed:
                return
            except BaseException as e:  # noqa: BLE001 - reported by run(); slot given back
                self.errors.append(f"{type(e).__name__}: {e}")
                log.warning("rollout failed: %s: %s", type(e).__name__, e)
                self.buffer.abort(ticket)
                if draw >= 0:
                    self.tasks.finished(draw, None)
                    self.tasks.done(draw)
                if isinstance(e, (StopIteration, RidgelineError)) and not isinstance(
                        e, VerifierError):
                    return  # a broken setup, not a bad episode: this thread stops
                continue
            try:
                self.buffer.put(group, ticket)
            except BufferClosed:
                return

    # ---- training ---------------------------------------------------------------------

    def train_step(self, groups: list[EpisodeGroup], step: int | None = None) -> dict[str, Any]:
        cfg = self.config
        filtered = filter_batch([g.records for g in groups], cfg.filters)
        episodes, rewards, ids, valid, domains = [], [], [], [], []
        for gi, fg in enumerate(filtered.groups):
            for rec in fg.episodes:
                if rec.sample is None:
                    continue
                episodes.append(rec.sample)
                rewards.append(float("nan") if rec.reward is None else rec.reward)
                ids.append(gi)
                valid.append(rec.mask)
                domains.append(task_domain(groups[gi].task))
        metrics: dict[str, Any] = {}
        records = [r for g in groups for r in g.records]
        graded = [r for r in records if r.reward is not None]
        metrics["reward_mean"] = (sum(r.reward for r in graded) / len(graded)
                                  if graded else float("nan"))
        metrics["pass_rate"] = (sum(passed(r) for r in graded) / len(graded)
                                if graded else float("nan"))
        by_domain: dict[str, list[bool]] = {}
        for g in groups:
            by_domain.setdefault(task_domain(g.task), []).extend(
                passed(r) for r in g.records if r.reward is not None)
        for domain, flags in sorted(by_domain.items()):
            if flags:
                metrics[f"pass_rate/{domain}"] = sum(flags) / len(flags)
        version = self.trainer.version
        staleness = [version - v for e in episodes for v, m in zip(e.versions, e.loss_mask) if m]
        metrics["staleness_max"] = float(max(staleness, default=0))
        metrics["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
        metrics["staleness_hist"] = {str(k): v for k, v in sorted(Counter(staleness).items())}
        # masked by rules 1-2 (broken or cut off), not the episodes of skipped groups
        metrics["episodes_masked"] = float(sum(
            n for reason, n in filtered.stats.reasons.items()
            if reason not in (ZERO_VARIANCE, TOO_FEW_VALID)))
        metrics["groups_skipped"] = float(len(filtered.skipped))
        reasons = filtered.stats.reasons
        for reason, count in sorted(reasons.items()):
            metrics[f"masked/{reason}"] = float(count)
        # what the verifier said about infrastructure failures (test_timeout, ...)
        for detail, count in Counter(r.detail or "?" for r in records
                                     if r.verdict in (VerdictStatus.INFRA_ERROR, VerdictStatus.UNSUPPORTED)).items():
            metrics[f"infra/{detail[:40]}"] = float(count)
        adv = group_advantages(torch.tensor(rewards), ids, mask=torch.tensor(valid, dtype=torch.bool),
                               normalize_std=cfg.normalize_std) if episodes else None
        keep = [i for i in range(len(episodes)) if adv is not None and bool(adv.trainable[i])]
        if keep:
            batch = TokenBatch.of([episodes[i] for i in keep],
                                  [float(adv.advantages[i]) for i in keep])
            if step is not None and self.conflicts.due(step):
                rates = {d: sum(f) / len(f) for d, f in by_domain.items() if f}
                metrics.update(self.conflicts.measure(step, self.trainer, batch,
                                                      [domains[i] for i in keep], rates))
                for d in self.conflicts.to_reweight():
                    log.warning("domains in conflict: sampling %s less", d)
                    self.tasks.scale_weight(d, cfg.conflicts.reweight_factor)
            metrics.update(self.trainer.step(batch))
            if metrics.get("train_seconds"):
                metrics["train_tokens_per_s"] = float(batch.attention_mask.sum()) / \
                    metrics["train_seconds"]
        metrics.update(self.trainer.sync(self.worker))
        metrics.update(self.tasks.metrics())
        self.buffer.publish_version()
        for g in groups:
            self.tasks.done(g.index)
        return metrics

    def run(self, steps: int, on_step: Callable[[int, dict[str, Any]], None] | None = None,
            start_step: int = 0) -> list[dict[str, Any]]:
        """Train steps `start_step .. steps-1`; metrics per step. Rollout threads stop
        when it returns."""
        threads = [threading.Thread(target=self._produce, daemon=True,
                                    name=f"ridgeline-rollout-{i}")
                   for i in range(self.config.rollout_threads)]
        for t in threads:
            t.start()
        history = []
        try:
            for step in range(start_step, steps):
                if self._stop.is_set():
                    break
                t0 = time.perf_counter()
                groups = None
                while groups is None:
                    groups = self.buffer.get_batch(timeout=1.0)
                    if groups is None and not any(t.is_alive() for t in threads):
                        raise RidgelineError(
                            "every rollout thread stopped: " + "; ".join(self.errors[-3:]),
                            hint="check the tasks, the model and the verifier")
                wait = time.perf_counter() - t0
                metrics = self.train_step(groups, step)
                step_s = time.perf_counter() - t0
                # sampled tokens this step trained on, per second of the step's wall time
                # (rollouts run concurrently with each other and with training)
                metrics.update(step=step, wait_seconds=wait,
                               rollout_seconds=sum(g.seconds for g in groups),
                               rollout_tokens_per_s=sum(g.tokens for g in groups) / step_s,
                               step_seconds=step_s)
                history.append(metrics)
                if on_step is not None:
                    on_step(step, metrics)
        finally:
            self.buffer.close()
            self.tasks.close()
            for t in threads:
                t.join(timeout=60)
        return history
