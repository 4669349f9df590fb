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

The sampler hands out tasks in a seeded order and knows which draws are not yet trained
on, and episode seeds derive from (run seed, draw, sample): a checkpoint of the sampler
and the buffer resumes the same data order.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.engine import SamplingParams
from ridgeline.errors import RidgelineError
from ridgeline.rl.advantages import group_advantages
from ridgeline.rl.buffer import BufferClosed, RolloutBuffer
from ridgeline.rl.conflicts import ConflictConfig, ConflictMonitor
from ridgeline.rl.filters import (
    TOO_FEW_VALID, ZERO_VARIANCE, EpisodeRecord, FilterConfig, filter_batch,
)
from ridgeline.rl.scheduler import task_domain
from ridgeline.rl.tokens import TokenBatch, TokenEpisode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenTask:
    """A single-turn verifiable task: a prompt of token ids and what the verifier needs
    to score a completion (JSON-able)."""

    id: str
    prompt_ids: list[int]
    answer: Any


@dataclass
class EpisodeGroup:
    """One task's group of sampled episodes, as the buffer holds it. `index` is the
    sampler's draw number (the checkpoint's data order); `samples[i]` is None for an
    episode with no token record (its record says why it is masked)."""

    task: Any
    samples: list[TokenEpisode | None]
    records: list[EpisodeRecord] = field(default_factory=list)
    seconds: float = 0.0
    index: int = -1
    tokens: int = 0        # tokens sampled for this group (throughput)


class GroupRollout(Protocol):
    """Plays `len(seeds)` episodes of one task, one per seed."""

    def __call__(self, task: Any, seeds: list[int]) -> EpisodeGroup: ...


def episode_seed(run_seed: int, draw: int, sample: int) -> int:
    """A sampling seed per episode, a function of where it is in the data order only
    (so a resumed run samples what the uninterrupted one would have)."""
    return (run_seed * 1_000_003 + draw * 1009 + sample) % (2**31 - 1)


class TaskSampler:
    """Tasks in a seeded order: shuffled epochs over a list, or `tasks(i)` for a family
    that generates task `i`. Tracks which draws are not yet consumed by a train step, so
    a checkpoint resumes with them first and then where the order left off."""

    def __init__(self, tasks: Sequence[Any] | Callable[[int], Any], seed: int = 0) -> None:
        if not callable(tasks) and not tasks:
            raise RidgelineError("no tasks to train on",
                                 hint="check the task selection of the config")
        self.tasks = tasks
        self.seed = seed
        self._lock = threading.Lock()
        self._next = 0
        self._redo: list[int] = []          # draws to hand out again (after a resume)
        self._pending: set[int] = set()     # handed out, not yet consumed

    def task(self, draw: int) -> Any:
        if callable(self.tasks):
            return self.tasks(draw)
        n = len(self.tasks)
        epoch, pos = divmod(draw, n)
        order = list(range(n))
        random.Random(self.seed * 7919 + epoch).shuffle(order)
        return self.tasks[order[pos]]

    def draw(self) -> tuple[int, Any]:
        with self._lock:
            if self._redo:
                i = self._redo.pop(0)
            else:
                i, self._next = self._next, self._next + 1
            self._pending.add(i)
        return i, self.task(i)

    def done(self, draw: int) -> None:
        """A train step consumed the group of `draw`."""
        with self._lock:
            self._pending.discard(draw)

    def finished(self, draw: int, group: Any | None) -> None:
        """The rollout of `draw` ended (`group` None: it raised); a shuffled order does
        not adapt, the `DomainScheduler` does."""

    def close(self) -> None:
        """The run is ending (nothing blocks in `draw` here)."""

    def metrics(self) -> dict[str, float]:
        return {}

    def domain_report(self) -> dict[str, dict[str, float]]:
        """A shuffled order keeps no per-domain state."""
        return {}

    def scale_weight(self, domain: str, factor: float) -> None:
        """A shuffled order has no domain weights to scale."""

    def state_dict(self, exclude: Sequence[int] = ()) -> dict[str, Any]:
        """`exclude`: draws whose groups are saved elsewhere (finished, in the buffer)."""
        with self._lock:
            pending = sorted((self._pending | set(self._redo)) - set(exclude))
            return {"kind": "shuffled", "seed": self.seed, "next": self._next, "redo": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind", "shuffled") != "shuffled":
            raise RidgelineError(f"the checkpoint's task order is a {state['kind']} "
                                 "scheduler's, not a shuffled order",
                                 hint="resume with the scheduler setting the run started with")
        with self._lock:
            self.seed, self._next = int(state["seed"]), int(state["next"])
            self._redo, self._pending = [int(i) for i in state["redo"]], set()


class VerifierError(RidgelineError):
    """The verifier could not score a group (its episodes are masked, never rewarded 0)."""


class SandboxVerifier:
    """Scores completions with a Python program run in a sandbox. The program reads
    `[{"answer": ..., "completion": [ids...]}, ...]` as JSON on stdin and prints a JSON
    list of rewards (numbers, or null for "cannot score")."""

    def __init__(self, script: str, sandbox: Any | None = None, timeout_s: float = 30.0) -> None:
        from ridgeline.sandbox import SandboxSpec, create_sandbox

        self.script = script
        self.timeout_s = timeout_s
        self._own = sandbox is None
        self.sandbox = sandbox or create_sandbox(SandboxSpec())
        self._lock = threading.Lock()  # one command at a time per sandbox

    def __call__(self, task: TokenTask, completions: list[list[int]]) -> list[float | None]:
        payload = json.dumps([{"answer": task.answer, "completion": c} for c in completions])
        with self._lock:
            res = self.sandbox.run(["python3", "-I", "-c", self.script],
                                   stdin=payload.encode(), timeout=self.timeout_s)
        if not res.ok:
            raise VerifierError(f"verifier exited {res.exit_code}: {res.stderr.strip()[-300:]}")
        try:
            rewards = json.loads(res.stdout)
        except ValueError:
            raise VerifierError(f"verifier printed no JSON: {res.stdout[-200:]!r}") from None
        if not isinstance(rewards, list) or len(rewards) != len(completions):
            raise VerifierError(f"verifier gave {rewards!r} for {len(completions)} completions")
        return [None if r is None else float(r) for r in rewards]

    def close(self) -> None:
        if self._own:
            self.sandbox.close()


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


Reward = Callable[[TokenTask, list[list[int]]], Sequence[float | None]]


class TokenTaskRollout:
    """Single-turn groups of a `TokenTask` on the in-process engine, scored by `reward`
    (e.g. a `SandboxVerifier`)."""

    def __init__(self, llm: Any, reward: Reward, *, max_tokens: int = 16,
                 temperature: float = 1.0) -> None:
        self.llm = llm
        self.reward = reward
        self.max_tokens = max_tokens
        self.temperature = temperature

    def __call__(self, task: TokenTask, seeds: list[int]) -> EpisodeGroup:
        t0 = time.perf_counter()
        reqs = [(self.llm.new_request_id("rl"), task.prompt_ids,
                 SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens,
                                ignore_eos=True, seed=seed, logprobs_mode="tempered"))
                for seed in seeds]
        samples = []
        for handle in self.llm.worker.submit_many(reqs):
            c = handle.result().outputs[0]
            ep = TokenEpisode.start(task.prompt_ids, group=task.id)
            ep.add_completion(c.token_ids, c.logprobs, c.token_versions)
            samples.append(ep)
        try:
            rewards = list(self.reward(task, [s.token_ids[len(task.prompt_ids):]
                                              for s in samples]))
            verdict, detail = "passed", ""
        except Exception as e:  # noqa: BLE001 - a broken verifier masks, never scores 0
            log.warning("verifier failed on task %s: %s", task.id, e)
            rewards, verdict, detail = [None] * len(samples), "infra_error", str(e)[:300]
        records = []
        for ep, r in zip(samples, rewards):
            ep.reward = r
            records.append(EpisodeRecord(verdict=verdict, reward=r, sample=ep, detail=detail))
        return EpisodeGroup(task, list(samples), records, time.perf_counter() - t0,
                            tokens=sum(s.num_policy_tokens for s in samples))


def passed(record: EpisodeRecord) -> bool:
    """An episode counts as a pass when it is graded and earned the full reward."""
    return record.verdict == "passed" and record.reward is not None and record.reward >= 1.0


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
                                     if r.verdict in ("infra_error", "unsupported")).items():
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
