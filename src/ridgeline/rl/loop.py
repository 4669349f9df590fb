"""The asynchronous RL loop on token tasks: rollout threads generate groups on the engine
while the trainer learns from earlier ones, with staleness bounded by admission control.

    loop = AsyncRLLoop(llm, trainer, tasks, SandboxVerifier(script), LoopConfig(eta=1))
    for metrics in loop.run(steps=200): ...

A rollout thread asks the buffer for admission (blocked while starting another group
would leave it more than `eta` versions stale when consumed), samples a group of
`group_size` completions of one task from the engine's worker (token ids, behaviour
logprobs and weights versions recorded as sampled), and has the verifier score them.
The verifier runs *inside a sandbox*: model output is untrusted and never evaluated on
the host. A verifier that fails or gives no reward masks the group's episodes (reward
None, with a reason): an infrastructure failure never becomes a reward of 0. The trainer
takes `batch_groups` groups per step, filters them (masked episodes, zero-variance
groups), computes GRPO advantages, steps, syncs the weights into the engine as a new
version and publishes it to the buffer.

Multi-turn agent episodes in task sandboxes go through the same buffer, filters, batches
and trainer; this module drives single-turn token tasks (prompt ids in, completion ids
out), which is what the pipeline test and quick experiments need.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.engine import SamplingParams
from ridgeline.errors import RidgelineError
from ridgeline.rl.advantages import group_advantages
from ridgeline.rl.buffer import BufferClosed, RolloutBuffer
from ridgeline.rl.filters import EpisodeRecord, FilterConfig, filter_batch
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
    """One task's group of sampled episodes, as the buffer holds it."""

    task: TokenTask
    samples: list[TokenEpisode]
    records: list[EpisodeRecord] = field(default_factory=list)
    seconds: float = 0.0


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
    rollout_threads: int = Field(2, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    normalize_std: bool = True
    filters: FilterConfig = Field(default_factory=FilterConfig)


Reward = Callable[[TokenTask, list[list[int]]], Sequence[float | None]]


class AsyncRLLoop:
    def __init__(self, llm: Any, trainer: Any, tasks: Iterator[TokenTask], reward: Reward,
                 config: LoopConfig | None = None) -> None:
        self.llm = llm
        self.trainer = trainer
        self.tasks = tasks
        self.reward = reward
        self.config = cfg = config or LoopConfig()
        self.buffer = RolloutBuffer(cfg.batch_groups, cfg.eta)
        self._task_lock = threading.Lock()
        self._seeds = itertools.count()
        self._stop = threading.Event()
        self.errors: list[str] = []

    def stop(self) -> None:
        """End `run()` after the current step (e.g. from `on_step` once a goal is met)."""
        self._stop.set()

    # ---- rollouts ---------------------------------------------------------------------

    def _next_task(self) -> TokenTask:
        with self._task_lock:
            return next(self.tasks)

    def rollout(self, task: TokenTask) -> EpisodeGroup:
        """One group: sampled on the engine, scored by the verifier (in its sandbox)."""
        cfg = self.config
        t0 = time.perf_counter()
        reqs = [(self.llm.new_request_id("rl"), task.prompt_ids,
                 SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                ignore_eos=True, seed=next(self._seeds)))
                for _ in range(cfg.group_size)]
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
        return EpisodeGroup(task, samples, records, time.perf_counter() - t0)

    def _produce(self) -> None:
        while True:
            try:
                ticket = self.buffer.admit()
            except BufferClosed:
                return
            try:
                group = self.rollout(self._next_task())
            except BufferClosed:
                return
            except BaseException as e:  # noqa: BLE001 - reported by run(); slot given back
                self.errors.append(f"{type(e).__name__}: {e}")
                self.buffer.abort(ticket)
                if isinstance(e, StopIteration):
                    return
                continue
            try:
                self.buffer.put(group, ticket)
            except BufferClosed:
                return

    # ---- training ---------------------------------------------------------------------

    def train_step(self, groups: list[EpisodeGroup]) -> dict[str, float]:
        cfg = self.config
        filtered = filter_batch([g.records for g in groups], cfg.filters)
        episodes, rewards, ids, valid = [], [], [], []
        for gi, fg in enumerate(filtered.groups):
            for rec in fg.episodes:
                episodes.append(rec.sample)
                rewards.append(float("nan") if rec.reward is None else rec.reward)
                ids.append(gi)
                valid.append(rec.mask)
        metrics: dict[str, float] = {}
        known = [ep.reward for g in groups for ep in g.samples if ep.reward is not None]
        metrics["reward_mean"] = sum(known) / len(known) if known else float("nan")
        adv = group_advantages(torch.tensor(rewards), ids, mask=torch.tensor(valid),
                               normalize_std=cfg.normalize_std)
        keep = [i for i in range(len(episodes)) if bool(adv.trainable[i])]
        version = self.trainer.version
        staleness = [version - v for e in episodes for v, m in zip(e.versions, e.loss_mask) if m]
        metrics["staleness_max"] = float(max(staleness, default=0))
        metrics["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
        metrics["episodes_masked"] = float(sum(not v for v in valid))
        metrics["groups_skipped"] = float(len(filtered.skipped))
        if keep:
            batch = TokenBatch.of([episodes[i] for i in keep],
                                  [float(adv.advantages[i]) for i in keep])
            metrics.update(self.trainer.step(batch))
        metrics.update(self.trainer.sync(self.llm.worker))
        self.buffer.publish_version()
        return metrics

    def run(self, steps: int, on_step: Callable[[int, dict[str, float]], None] | None = None
            ) -> list[dict[str, float]]:
        """Train `steps` steps; metrics per step. Rollout threads stop when it returns."""
        threads = [threading.Thread(target=self._produce, daemon=True,
                                    name=f"ridgeline-rollout-{i}")
                   for i in range(self.config.rollout_threads)]
        for t in threads:
            t.start()
        history = []
        try:
            for step in range(steps):
                if self._stop.is_set():
                    break
                t0 = time.perf_counter()
                groups = None
                while groups is None:
                    groups = self.buffer.get_batch(timeout=1.0)
                    if groups is None and not any(t.is_alive() for t in threads):
                        raise RidgelineError(
                            "every rollout thread stopped: " + "; ".join(self.errors[-3:]),
                            hint="check the tasks and the verifier")
                wait = time.perf_counter() - t0
                metrics = self.train_step(groups)
                metrics.update(step=float(step), wait_seconds=wait,
                               rollout_seconds=sum(g.seconds for g in groups),
                               step_seconds=time.perf_counter() - t0)
                history.append(metrics)
                if on_step is not None:
                    on_step(step, metrics)
        finally:
            self.buffer.close()
            for t in threads:
                t.join(timeout=30)
        return history
