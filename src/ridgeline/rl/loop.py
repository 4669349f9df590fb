"""The asynchronous RL loop on token tasks: rollout threads generate groups on the engine
while the trainer learns from earlier ones, with staleness bounded by admission control.

    rollout = TokenTaskRollout(llm, SandboxVerifier(script), max_tokens=16)
    loop = AsyncRLLoop(trainer, TaskSampler(tasks), rollout, llm.worker, LoopConfig(eta=1))
    for metrics in loop.run(steps=200): ...

A rollout thread asks the buffer for admission (blocked while starting another group
would leave it more than `eta` versions stale when consumed), draws the next task from
the task source (`protocols.TaskSource`) and has the group rollout produce `group_size`
episodes of it: an `EpisodeGroup` of `EpisodeOutcome`s (verdict, reward, exit status),
each carrying its `TokenEpisode` (token ids, behaviour logprobs and weights versions as
sampled). Two rollouts exist: `TokenTaskRollout`
(single-turn prompt ids in, completion ids out, scored by a verifier that runs in a
sandbox: model output is never evaluated on the host) and `agent_rollout.AgentRollout`
(the agent in a task sandbox, multi-turn, graded by the task's tests). A verifier that
fails masks the group's episodes (reward None, with a reason): an infrastructure failure
never becomes a reward of 0. The trainer takes `batch_groups` groups per step, filters
them (masked episodes, zero-variance groups), computes GRPO advantages, steps, syncs the
weights into the engine (a `protocols.WeightsSink`) as a new version and publishes it to
the buffer.

`paused()` holds back groups not yet started and waits out those in flight: inside it
no rollout runs (the run's held-out evaluation, `run.evaluate`, has the engine to
itself).

The task source (`sampler.py`, `scheduler.py`) hands out tasks in a seeded order and
knows which draws are not yet trained on, and episode seeds derive from (run seed, draw,
sample): a checkpoint of the task source and the buffer resumes the same data order. The
rollouts and their groups are in `rollouts.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic

import torch
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import RidgelineError
from ridgeline.rl.advantages import group_advantages
from ridgeline.rl.buffer import BufferClosed, RolloutBuffer, Ticket
from ridgeline.rl.conflicts import ConflictConfig, ConflictMonitor
from ridgeline.rl.filters import (
    TOO_FEW_VALID, ZERO_VARIANCE, FilterConfig, FilterResult, filter_batch,
)
from ridgeline.rl.protocols import (
    AdaptiveTaskSource, GroupRollout, StepMetrics, TaskSource, TaskT, Trainer, WeightsSink,
)
from ridgeline.rl.rollouts import EpisodeGroup, VerifierError, passed
from ridgeline.rl.sampler import episode_seed
from ridgeline.rl.scheduler import task_domain
from ridgeline.rl.tokens import TokenBatch, TokenEpisode
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


class AsyncRLLoop(Generic[TaskT]):
    """Rollout threads filling the staleness-bounded buffer, and the train steps that
    take from it (`run`)."""

    def __init__(self, trainer: Trainer, tasks: TaskSource[TaskT], rollout: GroupRollout[TaskT],
                 weights: WeightsSink, config: LoopConfig | None = None) -> None:
        self.trainer = trainer
        self.tasks = tasks
        # the scheduler's hooks; a FIFO task source has none to call
        self.adaptive = tasks if isinstance(tasks, AdaptiveTaskSource) else None
        self.rollout = rollout
        self.weights = weights        # where each step's weights are synced
        self.config = cfg = config or LoopConfig()
        self.buffer: RolloutBuffer[EpisodeGroup] = RolloutBuffer(cfg.batch_groups, cfg.eta)
        self.conflicts = ConflictMonitor(cfg.conflicts)
        self._stop = threading.Event()
        self.errors: list[str] = []
        # groups whose rollout is running (drawn, not yet put or given back), and how many
        # `paused()` blocks are open: while one is, no group starts
        self._flight = threading.Condition()
        self._running = 0
        self._pauses = 0

    def stop(self) -> None:
        """End `run()` after the current step (e.g. from `on_step` once a goal is met)."""
        self._stop.set()

    @property
    def rollouts_in_flight(self) -> int:
        """Groups whose rollout is running now."""
        with self._flight:
            return self._running

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No rollout runs inside the block (the held-out evaluation has the engine to
        itself, on one weights version): groups not yet started wait, and the block is
        entered once every group in flight has finished and gone into the buffer, as
        any other (a checkpoint taken inside holds them). A rollout thread keeps a ticket
        it was admitted with while it waits, so the staleness bound holds: the group
        samples later, never earlier, than its ticket's version. Nests; callable from
        `on_step` (the trainer waits on nothing meanwhile) and before `run()`."""
        with self._flight:
            self._pauses += 1
        try:
            with self._flight:
                while self._running:
                    self._flight.wait()
            yield
        finally:
            with self._flight:
                self._pauses -= 1
                self._flight.notify_all()

    def _start_group(self) -> None:
        """Wait while paused, then count a group as in flight (BufferClosed: the run ends)."""
        with self._flight:
            while self._pauses and not self.buffer.closed:
                self._flight.wait(timeout=1.0)
            if self.buffer.closed:
                raise BufferClosed("the rollout buffer is closed: the run is ending")
            self._running += 1

    def _end_group(self) -> None:
        with self._flight:
            self._running -= 1
            self._flight.notify_all()

    # ---- rollouts ---------------------------------------------------------------------

    def _produce(self) -> None:
        while True:
            try:
                ticket = self.buffer.admit()
            except BufferClosed:
                return
            draw = -1
            try:
                # a draw blocked here (the scheduler's caps) is not yet in flight
                draw, task = self.tasks.draw()
                self._start_group()
            except BufferClosed:
                return
            except BaseException as e:  # noqa: BLE001 - as a failed rollout's, below
                if not self._failed(e, ticket, draw):
                    return
                continue
            try:
                if not self._play(task, draw, ticket):
                    return
            finally:
                self._end_group()   # after put: a drained pause finds the group buffered

    def _play(self, task: TaskT, draw: int, ticket: Ticket) -> bool:
        """Play the group of `draw` and put it in the buffer; False: this thread stops."""
        cfg = self.config
        try:
            seeds = [episode_seed(self.tasks.seed, draw, j) for j in range(cfg.group_size)]
            group = self.rollout(task, seeds)
            group.index = draw
            if self.adaptive is not None:
                self.adaptive.finished(draw, group)
        except BufferClosed:
            return False
        except BaseException as e:  # noqa: BLE001 - reported by run(); slot given back
            return self._failed(e, ticket, draw)
        try:
            self.buffer.put(group, ticket)
        except BufferClosed:
            return False
        return True

    def _failed(self, e: BaseException, ticket: Ticket, draw: int) -> bool:
        """A rollout (or its draw) raised: give the slot back; False when this thread
        stops (a broken setup, not a bad episode)."""
        self.errors.append(f"{type(e).__name__}: {e}")
        log.warning("rollout failed: %s: %s", type(e).__name__, e)
        self.buffer.abort(ticket)
        if draw >= 0:
            if self.adaptive is not None:
                self.adaptive.finished(draw, None)
            self.tasks.done(draw)
        return not (isinstance(e, (StopIteration, RidgelineError))
                    and not isinstance(e, VerifierError))

    # ---- training ---------------------------------------------------------------------

    def train_step(self, groups: list[EpisodeGroup], step: int | None = None) -> StepMetrics:
        cfg = self.config
        filtered = filter_batch([g.outcomes for g in groups], cfg.filters)
        episodes: list[TokenEpisode] = []
        rewards, ids, valid, domains = [], [], [], []
        for gi, fg in enumerate(filtered.groups):
            for out in fg.episodes:
                if out.sample is None:
                    continue
                episodes.append(out.sample)
                rewards.append(float("nan") if out.reward is None else out.reward)
                ids.append(gi)
                valid.append(out.mask)
                domains.append(task_domain(groups[gi].task))
        metrics, by_domain = _batch_metrics(groups, filtered, episodes, self.trainer.version)
        adv = group_advantages(torch.tensor(rewards), ids, mask=torch.tensor(valid, dtype=torch.bool),
                               normalize_std=cfg.normalize_std) if episodes else None
        keep = [i for i in range(len(episodes)) if adv is not None and bool(adv.trainable[i])]
        if adv is not None and keep:
            batch = TokenBatch.of([episodes[i] for i in keep],
                                  [float(adv.advantages[i]) for i in keep])
            if step is not None and self.conflicts.due(step):
                rates = {d: sum(f) / len(f) for d, f in by_domain.items() if f}
                metrics.update(self.conflicts.measure(step, self.trainer, batch,
                                                      [domains[i] for i in keep], rates))
                for d in self.conflicts.to_reweight():
                    log.warning("domains in conflict: sampling %s less", d)
                    if self.adaptive is not None:
                        self.adaptive.scale_weight(d, cfg.conflicts.reweight_factor)
            trained = self.trainer.step(batch)
            metrics.update(trained)
            if trained.get("train_seconds"):
                metrics["train_tokens_per_s"] = float(batch.attention_mask.sum()) / \
                    trained["train_seconds"]
        metrics.update(self.trainer.sync(self.weights))
        if self.adaptive is not None:
            metrics.update(self.adaptive.metrics())
        self.buffer.publish_version()
        for g in groups:
            self.tasks.done(g.index)
        return metrics

    def run(self, steps: int, on_step: Callable[[int, StepMetrics], None] | None = None,
            start_step: int = 0) -> list[StepMetrics]:
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
            with self._flight:
                self._flight.notify_all()   # rollout threads waiting out a pause end
            if self.adaptive is not None:
                self.adaptive.close()
            for t in threads:
                t.join(timeout=60)
        return history


def _batch_metrics(groups: list[EpisodeGroup], filtered: FilterResult,
                   episodes: list[TokenEpisode], version: int
                   ) -> tuple[StepMetrics, dict[str, list[bool]]]:
    """What the batch was, before training on it: reward and pass rates (overall and per
    domain, over graded episodes), staleness of the trained-on tokens, what was masked
    and why; and the per-domain pass flags (the conflict monitor's rates)."""
    metrics: StepMetrics = {}
    outcomes = [o for g in groups for o in g.outcomes]
    graded = [o.reward for o in outcomes if o.reward is not None]
    metrics["reward_mean"] = sum(graded) / len(graded) if graded else float("nan")
    metrics["pass_rate"] = (sum(passed(o) for o in outcomes if o.reward is not None)
                            / len(graded) if graded else float("nan"))
    by_domain: dict[str, list[bool]] = {}
    for g in groups:
        by_domain.setdefault(task_domain(g.task), []).extend(
            passed(o) for o in g.outcomes if o.reward is not None)
    for domain, flags in sorted(by_domain.items()):
        if flags:
            metrics[f"pass_rate/{domain}"] = sum(flags) / len(flags)
    staleness = [version - v for e in episodes for v, m in zip(e.versions, e.loss_mask) if m]
    metrics["staleness_max"] = float(max(staleness, default=0))
    metrics["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
    metrics["staleness_hist"] = {str(k): v for k, v in sorted(Counter(staleness).items())}
    # masked by rules 1-2 (broken or cut off), not the episodes of skipped groups
    reasons = filtered.stats.reasons
    metrics["episodes_masked"] = float(sum(
        n for reason, n in reasons.items() if reason not in (ZERO_VARIANCE, TOO_FEW_VALID)))
    metrics["groups_skipped"] = float(len(filtered.skipped))
    for reason, count in sorted(reasons.items()):
        metrics[f"masked/{reason}"] = float(count)
    # what the verifier said about infrastructure failures (test_timeout, ...)
    for detail, count in Counter(o.detail or "?" for o in outcomes if o.verdict in (
            VerdictStatus.INFRA_ERROR, VerdictStatus.UNSUPPORTED)).items():
        metrics[f"infra/{detail[:40]}"] = float(count)
    return metrics, by_domain
