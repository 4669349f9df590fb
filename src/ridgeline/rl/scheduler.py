"""The domain scheduler: which task the next rollout group plays, across many task
domains at once, so that every domain gets its share of rollout slots and one that is
slow, hangs or fails cannot starve the others.

    sched = DomainScheduler(tasks, SchedulerConfig(domains={"web": DomainSpec(weight=2)}),
                            slots=8, group_size=4)
    loop = AsyncRLLoop(trainer, sched, rollout, worker, LoopConfig(rollout_threads=8))

It is a `protocols.AdaptiveTaskSource`: a `TaskSource` like `TaskSampler` (`draw / done /
state_dict`) that the loop also tells when a group finishes. What it decides:

- **Shares.** Each domain (`task.domain`, e.g. the suite's categories) has a weight;
  starts are handed out by stride scheduling (each start advances the domain's virtual
  time by 1 / weight, the domain furthest behind goes next), so over any stretch each
  domain gets its weighted share of starts among the domains that can start.
- **Isolation.** A domain has at most `max_groups` groups (and `max_sandboxes`
  sandboxes) in flight; by default twice its weighted share of the slots. A domain
  whose recent groups mostly failed (infrastructure errors, timeouts: every episode
  masked, or the rollout raised) is *degraded* to one group in flight, a probe, until it
  recovers. Hanging episodes are ended by the rollout's own time limits; until then they
  hold only their domain's slots.
- **Curriculum.** Within a domain, tasks are drawn in proportion to `Curriculum.weight`
  (4 p (1 - p) of their recent pass rate); tasks always or never passed rest for a while.
  A domain's weight is scaled by the mean weight of its tasks that are not resting, so
  domains with more to learn get more rollouts; a domain whose tasks all rest waits.
- **Long episodes first.** Starts are planned a wave at a time (`wave` draws, chosen by
  the rules above); within a wave the task expected to run longest (a moving average of
  its group times) is handed out first, so a step does not wait on a long group that
  started last. The wave's composition is unchanged, only its order.

Draw numbers, the pending draws, the virtual times, the curriculum and the random state
are in `state_dict()`: a resumed run hands out its unfinished draws again first.
"""

from __future__ import annotations

import math
import random
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.rl.buffer import BufferClosed
from ridgeline.rl.curriculum import Curriculum, CurriculumConfig, CurriculumState
from ridgeline.rl.protocols import RLTask, TaskT
from ridgeline.rl.rollouts import EpisodeGroup, passed
from ridgeline.tasks.verifier import VerdictStatus

if TYPE_CHECKING:
    from ridgeline.rl.sampler import SamplerState

_SCORED = (VerdictStatus.PASSED, VerdictStatus.FAILED)
_NOT_SCORED = (VerdictStatus.INFRA_ERROR, VerdictStatus.UNSUPPORTED)

DEFAULT_DOMAIN = "tasks"


def task_domain(task: RLTask) -> str:
    """The task's `domain` attribute (a token task has none: the default domain)."""
    return str(getattr(task, "domain", "") or DEFAULT_DOMAIN)


class DomainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: float = Field(1.0, gt=0, description="share of rollout starts, relative")
    max_groups: int | None = Field(None, ge=1, description="groups in flight at most "
                                   "(default: twice the domain's weighted share of slots)")
    max_sandboxes: int | None = Field(None, ge=1, description="sandboxes (episodes) in "
                                      "flight at most")


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="off: tasks in a shuffled order (TaskSampler)")
    domains: dict[str, DomainSpec] = Field(default_factory=dict,
                                           description="per-domain settings by name")
    default: DomainSpec = Field(default_factory=DomainSpec)
    longest_first: bool = True
    wave: int = Field(8, ge=1, description="starts planned at a time (ordered longest first)")
    failure_window: int = Field(8, ge=1, description="recent groups a domain's health is "
                                "judged on")
    failure_threshold: float = Field(0.5, gt=0, le=1, description="share of failed groups "
                                     "in the window that degrades a domain to one group")
    min_failures: int = Field(3, ge=1, description="failed groups before a domain degrades")
    duration_ema: float = Field(0.3, gt=0, le=1, description="weight of the newest group "
                                "time in a task's expected duration")
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)


class DomainOrderState(TypedDict):
    """`DomainScheduler.state_dict()`: the draws, the plan, the virtual times, the counts,
    the durations, the curriculum and the random state."""

    kind: Literal["domain"]
    seed: int
    next: int
    redo: list[list[int | str]]     # [draw, task id]
    plan: list[str]
    vtime: dict[str, float]
    counts: dict[str, list[int]]
    duration: dict[str, float]
    scale: dict[str, float]
    vclock: float
    curriculum: CurriculumState
    rng: list[object]               # random.getstate(), as JSON


def group_failed(group: EpisodeGroup | None) -> bool:
    """No episode of the group could be used: every outcome masked by an infrastructure
    failure (infra_error, unsupported, unhealthy sandbox), or no group at all."""
    if group is None:
        return True
    if not group.outcomes:
        return False
    return all(o.verdict in _NOT_SCORED or not o.healthy for o in group.outcomes)


def _passes(group: EpisodeGroup) -> list[bool]:
    """Pass or not, for each graded episode of the group (`rollouts.passed`)."""
    return [passed(o) for o in group.outcomes
            if o.verdict in _SCORED and o.reward is not None]


class _Domain(Generic[TaskT]):
    def __init__(self, name: str, spec: DomainSpec, tasks: list[TaskT], window: int) -> None:
        self.name = name
        self.spec = spec
        self.tasks = tasks
        self.cap = 1
        self.vtime = 0.0
        self.in_flight = 0
        self.started = 0
        self.finished = 0
        self.failed = 0
        self.outcomes: deque[bool] = deque(maxlen=window)   # recent groups: True = failed
        self.degraded = False


class DomainScheduler(Generic[TaskT]):
    """The adaptive task source: shares, isolation, curriculum and long episodes first
    across task domains (the module docstring)."""

    def __init__(self, tasks: Sequence[TaskT], config: SchedulerConfig | None = None, *,
                 slots: int, group_size: int = 1, seed: int = 0) -> None:
        if not tasks:
            raise RidgelineError("no tasks to train on",
                                 hint="check the task selection of the config")
        self.config = cfg = config or SchedulerConfig()
        self.seed = seed
        self._tasks = {str(t.id): t for t in tasks}
        if len(self._tasks) != len(tasks):
            raise ConfigError("two tasks share an id", hint="task ids must be unique")
        by_domain: dict[str, list[TaskT]] = {}
        for t in tasks:
            by_domain.setdefault(task_domain(t), []).append(t)
        unknown = sorted(set(cfg.domains) - set(by_domain))
        if unknown:
            raise ConfigError(f"scheduler settings for domains without tasks: {', '.join(unknown)}",
                              hint=f"the tasks' domains are: {', '.join(sorted(by_domain))}")
        self.domains = {d: _Domain(d, cfg.domains.get(d, cfg.default), ts, cfg.failure_window)
                        for d, ts in sorted(by_domain.items())}
        self._domain_of = {str(t.id): self.domains[task_domain(t)] for t in tasks}
        total = sum(d.spec.weight for d in self.domains.values())
        for d in self.domains.values():
            cap = d.spec.max_groups or max(1, math.ceil(2 * slots * d.spec.weight / total))
            if d.spec.max_sandboxes is not None:
                cap = min(cap, max(1, d.spec.max_sandboxes // max(1, group_size)))
            d.cap = cap
        self.curriculum = Curriculum(cfg.curriculum)
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._closed = False
        self._next = 0
        self._plan: list[str] = []              # task ids planned, not yet handed out
        self._redo: list[tuple[int, str]] = []  # draws to hand out again (after a resume)
        self._pending: dict[int, str] = {}      # handed out, not yet consumed by a step
        self._running: dict[int, str] = {}      # handed out, rollout not yet finished
        self._duration: dict[str, float] = {}   # task -> expected group seconds
        self._scale: dict[str, float] = {}      # domain -> weight factor (conflicts)
        self._vclock = 0.0   # virtual time of the last start: where a returning domain resumes
        self.waits = 0

    # ---- the sampler interface (AsyncRLLoop) --------------------------------------------

    def draw(self, timeout: float | None = None) -> tuple[int, TaskT]:
        """The next (draw number, task): blocks while every domain that has work is at
        its cap. Raises BufferClosed once `close()` was called."""
        with self._cond:
            while True:
                if self._closed:
                    raise BufferClosed("the scheduler was closed")
                picked = self._pick()
                if picked is not None:
                    return picked
                self.waits += 1
                if not self._cond.wait(timeout) and timeout is not None:
                    raise TimeoutError("no domain can start a group")

    def finished(self, draw: int, group: EpisodeGroup | None) -> None:
        """The rollout of `draw` ended (`group` None: it raised): its slot is free, and
        its outcome and time feed the domain's health, the curriculum and the durations."""
        with self._cond:
            tid = self._running.pop(draw, None)
            if tid is None:
                return
            d = self._domain_of[tid]
            d.in_flight -= 1
            d.finished += 1
            failed = group_failed(group)
            d.failed += failed
            d.outcomes.append(failed)
            n_failed = sum(d.outcomes)
            d.degraded = (n_failed >= self.config.min_failures
                          and n_failed / len(d.outcomes) >= self.config.failure_threshold)
            if group is not None and not failed:
                self.curriculum.record(tid, _passes(group))
                seconds = group.seconds
                if seconds > 0:
                    old = self._duration.get(tid)
                    a = self.config.duration_ema
                    self._duration[tid] = seconds if old is None else a * seconds + (1 - a) * old
            if group is None:
                self._pending.pop(draw, None)   # nothing to consume: not handed out again
            self._cond.notify_all()

    def done(self, draw: int) -> None:
        """A train step consumed the group of `draw`."""
        with self._cond:
            self._pending.pop(draw, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def scale_weight(self, domain: str, factor: float) -> None:
        """Scale a domain's weight from now on (e.g. the conflict monitor's reweighting)."""
        with self._cond:
            if domain in self.domains:
                self._scale[domain] = self._scale.get(domain, 1.0) * factor

    # ---- choosing -----------------------------------------------------------------------

    def _cap(self, d: _Domain[TaskT]) -> int:
        return 1 if d.degraded else d.cap

    def _can_start(self, d: _Domain[TaskT]) -> bool:
        return d.in_flight < self._cap(d)

    def _pick(self) -> tuple[int, TaskT] | None:
        """Under the lock: hand out a redo, else the longest eligible planned task, else
        plan more; None when no domain with work has a free slot."""
        for k, (draw, tid) in enumerate(self._redo):
            if self._can_start(self._domain_of[tid]):
                del self._redo[k]
                return self._hand_out(draw, tid)
        if not self._plan:
            self._plan = [t for t in (self._plan_one(eligible_only=False)
                                      for _ in range(self.config.wave)) if t is not None]
        eligible = [k for k, tid in enumerate(self._plan)
                    if self._can_start(self._domain_of[tid])]
        if not eligible:
            # the plan waits on full domains; start something that can run now instead
            tid = self._plan_one(eligible_only=True)
            if tid is None:
                return None
            self._plan.append(tid)
            eligible = [len(self._plan) - 1]
        k = max(eligible, key=self._expected) if self.config.longest_first else eligible[0]
        tid = self._plan.pop(k)
        draw, self._next = self._next, self._next + 1
        return self._hand_out(draw, tid)

    def _expected(self, k: int) -> float:
        """Expected group time of planned task k: its own average, else its domain's,
        else the mean over all known tasks (0 before anything finished)."""
        tid = self._plan[k]
        if tid in self._duration:
            return self._duration[tid]
        known = [self._duration[t.id] for t in self._domain_of[tid].tasks
                 if t.id in self._duration] \
            or list(self._duration.values())
        return sum(known) / len(known) if known else 0.0

    def _hand_out(self, draw: int, tid: str) -> tuple[int, TaskT]:
        d = self._domain_of[tid]
        d.in_flight += 1
        d.started += 1
        self._pending[draw] = tid
        self._running[draw] = tid
        return draw, self._tasks[tid]

    def _candidates(self, d: _Domain[TaskT]) -> list[tuple[TaskT, float]]:
        """Tasks of `d` not resting, with their curriculum weights."""
        cur = self.curriculum
        return [(t, cur.weight(t.id)) for t in d.tasks if not cur.resting(t.id)]

    def effective_weight(self, d: _Domain[TaskT],
                         candidates: list[tuple[TaskT, float]] | None = None) -> float:
        cands = self._candidates(d) if candidates is None else candidates
        if not cands:
            return 0.0
        return (d.spec.weight * self._scale.get(d.name, 1.0)
                * sum(w for _, w in cands) / len(cands))

    def _plan_one(self, eligible_only: bool) -> str | None:
        """Choose the next task: the domain furthest behind in virtual time (among those
        with a free slot when `eligible_only`), then a task of it by curriculum weight."""
        options = []
        for d in self.domains.values():
            if eligible_only and not self._can_start(d):
                continue
            if d.degraded and not eligible_only:
                continue  # a degraded domain gets only the probes `eligible_only` allows
            cands = self._candidates(d)
            w = self.effective_weight(d, cands)
            if w > 0:
                options.append((d, cands, w))
        if not options:
            if eligible_only or any(self._candidates(d) for d in self.domains.values()):
                return None
            # every task rests: probe the domain furthest behind rather than stall
            options = [(d, [(t, 1.0) for t in d.tasks], d.spec.weight)
                       for d in self.domains.values() if not d.degraded] or \
                      [(d, [(t, 1.0) for t in d.tasks], d.spec.weight)
                       for d in self.domains.values()]
        for o, _, _ in options:   # a domain back from idle resumes now, without a burst
            o.vtime = max(o.vtime, self._vclock)
        d, cands, w = min(options, key=lambda o: (o[0].vtime, o[0].name))
        self._vclock = d.vtime
        d.vtime += 1.0 / w
        tasks, weights = zip(*cands)
        tid = str(self._rng.choices(tasks, weights=weights)[0].id)
        self.curriculum.drawn(tid)
        return tid

    # ---- observability and checkpoints -----------------------------------------------------

    def domain_report(self) -> dict[str, dict[str, float]]:
        """Each domain's state: starts (and their share), groups in flight, failed,
        degraded, cap, effective weight and tasks resting."""
        with self._cond:
            total = sum(d.started for d in self.domains.values()) or 1
            return {d.name: {
                "started": float(d.started), "share_of_starts": round(d.started / total, 4),
                "in_flight": float(d.in_flight), "failed": float(d.failed),
                "degraded": float(d.degraded), "cap": float(self._cap(d)),
                "weight": self.effective_weight(d),
                "resting": float(sum(self.curriculum.resting(t.id) for t in d.tasks))}
                for d in self.domains.values()}

    def metrics(self) -> dict[str, float]:
        out = {f"sched/{name}/{k}": v for name, state in self.domain_report().items()
               for k, v in state.items()}
        with self._cond:
            out["sched/waits"] = float(self.waits)
            out["sched/in_flight"] = float(sum(d.in_flight for d in self.domains.values()))
        return out

    def state_dict(self, exclude: Sequence[int] = ()) -> DomainOrderState:
        """`exclude`: draws whose groups are saved elsewhere (finished, in the buffer)."""
        with self._cond:
            skip = set(exclude)
            redo = sorted({**dict(self._redo), **self._pending}.items())
            state = self._rng.getstate()
            return {"kind": "domain", "seed": self.seed, "next": self._next,
                    "redo": [[i, tid] for i, tid in redo if i not in skip],
                    "plan": list(self._plan),
                    "vtime": {n: d.vtime for n, d in self.domains.items()},
                    "counts": {n: [d.started, d.finished, d.failed] for n, d in self.domains.items()},
                    "duration": dict(self._duration), "scale": dict(self._scale),
                    "vclock": self._vclock,
                    "curriculum": self.curriculum.state_dict(),
                    "rng": [state[0], list(state[1]), state[2]]}

    def load_state_dict(self, state: SamplerState) -> None:
        if state.get("kind") != "domain":
            raise ConfigError("the checkpoint's task order is not a domain scheduler's",
                              hint="resume with the scheduler setting the run started with")
        with self._cond:
            self.seed, self._next = int(state["seed"]), int(state["next"])
            self._redo = [(int(i), str(t)) for i, t in state["redo"] if str(t) in self._tasks]
            self._plan = [t for t in state.get("plan", []) if t in self._tasks]
            self._pending, self._running = {}, {}
            for n, v in state.get("vtime", {}).items():
                if n in self.domains:
                    self.domains[n].vtime = float(v)
            for n, (s, f, x) in state.get("counts", {}).items():
                if n in self.domains:
                    d = self.domains[n]
                    d.started, d.finished, d.failed = int(s), int(f), int(x)
            self._duration = {k: float(v) for k, v in state.get("duration", {}).items()}
            self._scale = {k: float(v) for k, v in state.get("scale", {}).items()}
            self._vclock = float(state.get("vclock", 0.0))
            self.curriculum.load_state_dict(state.get("curriculum", {}))
            v, internal, gauss = state["rng"]
            self._rng.setstate((v, tuple(internal), gauss))

