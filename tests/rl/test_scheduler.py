"""The domain scheduler against simulated episode times and failure rates: shares follow
the weights, caps and sandbox quotas hold, a hanging domain does not starve the others,
long groups start first (and the step's long tail shrinks), the curriculum rests what
is always or never solved, and a checkpoint resumes the same order.

The simulations run the real scheduler on a virtual clock (an event queue of group
finish times), so they are exact and take milliseconds."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from ridgeline.errors import ConfigError
from ridgeline.rl.curriculum import CurriculumConfig
from ridgeline.rl.filters import EpisodeOutcome
from ridgeline.rl.protocols import AdaptiveTaskSource
from ridgeline.rl.rollouts import EpisodeGroup
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.scheduler import DomainScheduler, DomainSpec, SchedulerConfig


@dataclass(frozen=True)
class Task:
    id: str
    domain: str




def tasks_of(domains: dict[str, int]) -> list[Task]:
    return [Task(f"{d}-{i}", d) for d, n in domains.items() for i in range(n)]


def group(task: Task, seconds: float, failed: bool = False, passes: list[bool] | None = None,
          ) -> EpisodeGroup:
    if failed:
        recs = [EpisodeOutcome(verdict="infra_error", reward=None, detail="test_timeout")] * 2
    else:
        recs = [EpisodeOutcome(verdict="passed" if p else "failed", reward=float(p))
                for p in (passes if passes is not None else [True, False])]
    return EpisodeGroup(task, recs, seconds)


NO_CURRICULUM = CurriculumConfig(enabled=False)


def no_wait_draw(sampler: Any) -> tuple[int, Any] | None:
    try:
        if isinstance(sampler, DomainScheduler):
            return sampler.draw(timeout=0)
        return sampler.draw()
    except TimeoutError:
        return None


@dataclass
class SimResult:
    finished: Counter = field(default_factory=Counter)      # groups per domain
    useful: Counter = field(default_factory=Counter)        # not failed
    max_in_flight: Counter = field(default_factory=Counter)
    slot_seconds: Counter = field(default_factory=Counter)
    order: list[str] = field(default_factory=list)


def simulate(sampler: Any, slots: int, horizon: float,
             outcome: Callable[[Task, random.Random], tuple[float, bool]], seed: int = 0,
             ) -> SimResult:
    """Slots pull draws as soon as they are free; each group takes the time `outcome`
    gives and fails or not; everything on a virtual clock up to `horizon`."""
    rng = random.Random(seed)
    res = SimResult()
    now, events, seq = 0.0, [], itertools.count()
    running: Counter = Counter()
    while True:
        while sum(running.values()) < slots:
            got = no_wait_draw(sampler)
            if got is None:
                break
            draw, task = got
            seconds, failed = outcome(task, rng)
            running[task.domain] += 1
            res.max_in_flight[task.domain] = max(res.max_in_flight[task.domain],
                                                 running[task.domain])
            res.order.append(task.id)
            heapq.heappush(events, (now + seconds, next(seq), draw, task, seconds, failed))
        if not events:
            break
        end, _, draw, task, seconds, failed = heapq.heappop(events)
        if end > horizon:
            break
        now = end
        running[task.domain] -= 1
        res.finished[task.domain] += 1
        res.slot_seconds[task.domain] += seconds
        if not failed:
            res.useful[task.domain] += 1
        if isinstance(sampler, AdaptiveTaskSource):  # the FIFO does not adapt
            sampler.finished(draw, group(task, seconds, failed))
        sampler.done(draw)
    return res


def test_starts_follow_the_domain_weights():
    cfg = SchedulerConfig(domains={"a": DomainSpec(weight=1), "b": DomainSpec(weight=2),
                                   "c": DomainSpec(weight=1)}, curriculum=NO_CURRICULUM)
    sched = DomainScheduler(tasks_of({"a": 3, "b": 5, "c": 2}), cfg, slots=8)
    res = simulate(sched, 8, 500.0, lambda t, r: (r.uniform(0.5, 1.5), False))
    total = sum(res.finished.values())
    assert total > 2000
    for d, share in {"a": 0.25, "b": 0.5, "c": 0.25}.items():
        assert abs(res.finished[d] / total - share) < 0.03, (d, res.finished)


def test_caps_and_sandbox_quotas_hold():
    cfg = SchedulerConfig(domains={"slow": DomainSpec(max_groups=1),
                                   "big": DomainSpec(weight=4, max_sandboxes=8)},
                          curriculum=NO_CURRICULUM)
    sched = DomainScheduler(tasks_of({"slow": 2, "big": 2, "other": 2}), cfg, slots=12,
                            group_size=4)
    # 12 slots, weights 1/4/1: "other" gets twice its share of slots by default: 4
    assert [sched.domains[d].cap for d in ("big", "other", "slow")] == [2, 4, 1]
    res = simulate(sched, 12, 200.0,
                   lambda t, r: (5.0 if t.domain == "slow" else r.expovariate(1.0), False))
    assert res.max_in_flight["slow"] == 1
    assert res.max_in_flight["big"] == 2            # 8 sandboxes / 4 per group
    assert res.max_in_flight["other"] == 4


def hanging(domain: str, hang_s: float = 60.0) -> Callable[[Task, random.Random], tuple]:
    """Episodes of `domain` hang until the rollout's time limit ends them as a failure;
    the others take Pareto-tailed times with mean ~1."""
    def outcome(task: Task, rng: random.Random) -> tuple[float, bool]:
        if task.domain == domain:
            return hang_s, True
        return min(30.0, 0.4 * rng.paretovariate(1.6)), False
    return outcome


def test_a_hanging_domain_cannot_starve_the_others():
    domains = {f"d{i}": 3 for i in range(4)} | {"hangs": 3}
    tasks = tasks_of(domains)
    sched = DomainScheduler(tasks, SchedulerConfig(curriculum=NO_CURRICULUM), slots=10)
    fifo = TaskSampler(tasks, seed=0)
    mine = simulate(sched, 10, 600.0, hanging("hangs"))
    base = simulate(fifo, 10, 600.0, hanging("hangs"))
    healthy = [d for d in domains if d != "hangs"]
    assert sum(mine.useful.values()) > 2 * sum(base.useful.values())
    # every healthy domain gets at least half of its share (1/5 of all starts)
    total = sum(mine.useful[d] for d in healthy) / 0.8
    assert min(mine.useful[d] for d in healthy) >= 0.5 * total / 5
    assert sched.domains["hangs"].degraded
    assert sched.metrics()["sched/hangs/cap"] == 1.0
    # the hanging domain held at most its default cap (2 x its share of 10 slots)
    assert mine.max_in_flight["hangs"] <= 4 < base.max_in_flight["hangs"]


def test_a_domain_that_recovers_gets_its_slots_back():
    sched = DomainScheduler(tasks_of({"a": 2, "b": 2}), SchedulerConfig(curriculum=NO_CURRICULUM),
                            slots=4)
    broken = True

    def outcome(task: Task, rng: random.Random) -> tuple[float, bool]:
        return 1.0, broken and task.domain == "b"

    simulate(sched, 4, 30.0, outcome)
    assert sched.domains["b"].degraded
    broken = False
    res = simulate(sched, 4, 60.0, outcome)
    assert not sched.domains["b"].degraded and res.max_in_flight["b"] >= 2


def step_makespans(sampler: Any, steps: int, batch: int, durations: dict[str, float]) -> list[float]:
    """A synchronous step: `batch` groups on `batch` // 2 slots, the step ends when the
    last finishes (the long tail longest-first scheduling cuts)."""
    spans = []
    for _ in range(steps):
        drawn = []
        for _ in range(batch):
            got = no_wait_draw(sampler)
            assert got is not None
            drawn.append(got)
        # list scheduling on the slots, in the order handed out
        free = [0.0] * (batch // 2)
        for draw, task in drawn:
            start = heapq.heappop(free)
            heapq.heappush(free, start + durations[task.id])
        spans.append(max(free))
        for draw, task in drawn:
            if isinstance(sampler, AdaptiveTaskSource):
                sampler.finished(draw, group(task, durations[task.id]))
            sampler.done(draw)
    return spans


def test_long_groups_start_first_and_the_step_tail_shrinks():
    rng = random.Random(3)
    tasks = tasks_of({"a": 6, "b": 6})
    durations = {t.id: min(10.0, rng.lognormvariate(0, 1)) for t in tasks}
    spans = {}
    for longest_first in (False, True):
        cfg = SchedulerConfig(longest_first=longest_first, wave=8, curriculum=NO_CURRICULUM)
        sched = DomainScheduler(tasks, cfg, slots=100, seed=1)
        spans[longest_first] = step_makespans(sched, 60, 8, durations)[5:]  # once learnt
    assert sum(spans[True]) < 0.95 * sum(spans[False])     # 14% shorter with this seed
    # within a wave, the order handed out is by expected time, longest first
    cfg = SchedulerConfig(wave=8, curriculum=NO_CURRICULUM)
    sched = DomainScheduler(tasks, cfg, slots=100, seed=2)
    step_makespans(sched, 10, 8, durations)
    wave = [no_wait_draw(sched)[1] for _ in range(8)]
    times = [durations[t.id] for t in wave]
    assert times == sorted(times, reverse=True)


def test_the_curriculum_rests_solved_and_impossible_tasks_and_favours_the_rest():
    tasks = [Task("always", "x"), Task("never", "x"), Task("half", "x")]
    sched = DomainScheduler(tasks, SchedulerConfig(curriculum=CurriculumConfig(
        min_episodes=4, rest_draws=10)), slots=1)
    rng = random.Random(0)
    starts: Counter = Counter()
    for _ in range(400):
        draw, task = sched.draw(timeout=0)
        starts[task.id] += 1
        p = {"always": 1.0, "never": 0.0, "half": 0.5}[task.id]
        passes = [rng.random() < p for _ in range(4)]
        if task.id == "half" and (all(passes) or not any(passes)):
            passes[0] = not passes[0]     # keep "half" in between
        sched.finished(draw, group(task, 1.0, passes=passes))
        sched.done(draw)
    assert starts["half"] > 0.7 * 400
    assert starts["always"] >= 10 and starts["never"] >= 10   # still probed now and then
    m = sched.metrics()
    assert m["sched/x/resting"] >= 1


def test_a_checkpoint_resumes_the_same_order():
    tasks = tasks_of({"a": 4, "b": 4, "c": 4})
    cfg = SchedulerConfig(domains={"c": DomainSpec(weight=3)})

    def play(sched: DomainScheduler, n: int, seen: list[str]) -> None:
        for _ in range(n):
            draw, task = sched.draw(timeout=0)
            seen.append(task.id)
            sched.finished(draw, group(task, 1.0 + len(task.id) % 3,
                                       passes=[len(seen) % 3 == 0, True]))
            sched.done(draw)

    whole: list[str] = []
    play(DomainScheduler(tasks, cfg, slots=4, seed=5), 60, whole)
    first = DomainScheduler(tasks, cfg, slots=4, seed=5)
    part: list[str] = []
    play(first, 30, part)
    pending_draw, pending_task = first.draw(timeout=0)   # handed out, never finished
    state = first.state_dict()
    again = DomainScheduler(tasks, cfg, slots=4, seed=5)
    again.load_state_dict(state)
    draw, task = again.draw(timeout=0)
    assert (draw, task.id) == (pending_draw, pending_task.id)   # re-issued first
    again.finished(draw, group(task, 1.0 + len(task.id) % 3, passes=[31 % 3 == 0, True]))
    again.done(draw)
    part.append(task.id)
    play(again, 29, part)
    assert part == whole


def test_draw_blocks_while_every_domain_is_full_and_close_ends_it():
    import threading

    from ridgeline.rl.buffer import BufferClosed

    sched = DomainScheduler(tasks_of({"a": 1}), SchedulerConfig(
        default=DomainSpec(max_groups=1), curriculum=NO_CURRICULUM), slots=1)
    draw, task = sched.draw()
    with pytest.raises(TimeoutError):
        sched.draw(timeout=0.05)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(sched.draw()))
    t.start()
    sched.finished(draw, group(task, 1.0))
    t.join(5)
    assert got and got[0][1] is task
    blocked: list[BaseException] = []

    def wait() -> None:
        try:
            sched.draw()
        except BufferClosed as e:
            blocked.append(e)

    t = threading.Thread(target=wait)
    t.start()
    sched.close()
    t.join(5)
    assert blocked


def test_settings_for_a_domain_without_tasks_are_an_error():
    with pytest.raises(ConfigError, match="domains without tasks: typo"):
        DomainScheduler(tasks_of({"a": 1}), SchedulerConfig(domains={"typo": DomainSpec()}),
                        slots=2)


@dataclass(frozen=True)
class DomainTokenTask:
    id: str
    prompt_ids: list[int]
    answer: Any
    domain: str


def test_a_domain_whose_verifier_hangs_cannot_starve_a_real_run():
    """The whole loop (engine, sandboxed verifiers, buffer, trainer) with the scheduler:
    one domain's verifier hangs in its sandbox until its time limit; the run still trains
    on the other domains, the hanging one is degraded to a single probe group, and its
    groups are masked, never rewarded 0."""
    from ridgeline.engine import LLM
    from ridgeline.rl.digits import DIGITS, SHIFT_VERIFIER, shift_tasks, tiny_policy
    from ridgeline.rl.loop import AsyncRLLoop, LoopConfig
    from ridgeline.rl.rollouts import SandboxVerifier, TokenTaskRollout
    from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig

    family = shift_tasks(3)
    tasks = [DomainTokenTask(f"{d}-{i}", family(k).prompt_ids, family(k).answer, d)
             for k, (d, i) in enumerate((d, i) for d in ("a", "b", "c", "hangs")
                                        for i in range(3))]
    good = SandboxVerifier(SHIFT_VERIFIER)
    hanging = SandboxVerifier("import time; time.sleep(600)", timeout_s=1.5)
    scored: Counter = Counter()

    def reward(task, completions):
        scored[task.domain] += 1
        return (hanging if task.domain == "hangs" else good)(task, completions)

    model = tiny_policy()
    llm = LLM.from_hf_model(model, num_kv_blocks=512, block_size=4, max_num_seqs=64)
    sched = DomainScheduler(tasks, SchedulerConfig(curriculum=NO_CURRICULUM), slots=4)
    loop = AsyncRLLoop(PolicyTrainer(model, TrainerConfig(lr=5e-4)), sched,
                       TokenTaskRollout(llm, reward, max_tokens=DIGITS), llm.worker,
                       LoopConfig(group_size=4, batch_groups=4, eta=1, rollout_threads=4))
    try:
        history = loop.run(steps=12)
    finally:
        good.close()
        hanging.close()
        llm.worker.stop()
    assert len(history) == 12 and not loop.errors
    assert sched.domains["hangs"].degraded
    # at most its cap (2) at a time before it degraded, then one probe at a time
    assert scored["hangs"] <= 8 and min(scored[d] for d in "abc") >= 8
    # the three failed groups that degraded it (4 episodes each) were masked, not scored 0
    assert sum(m.get("masked/infra_error", 0.0) for m in history) >= 4 * 3
    assert all(m["staleness_max"] <= 1 for m in history)


def test_a_domain_whose_tasks_all_rest_is_probed_again_without_a_burst():
    """Rests end in draws of any task (a domain whose tasks all rest is never drawn, so
    its own draws would never end them), and a domain coming back resumes at the current
    virtual time instead of catching up on the starts it missed in a burst."""
    tasks = tasks_of({"a": 3, "b": 4})
    sched = DomainScheduler(tasks, SchedulerConfig(curriculum=CurriculumConfig(
        min_episodes=2, rest_draws=12)), slots=1)
    order = []
    for i in range(400):
        draw, task = sched.draw(timeout=0)
        order.append(task.domain)
        solved = task.domain == "b" and i < 200       # b is solved, then it is not
        passes = [True, True] if solved else [i % 2 == 0, i % 2 == 1]
        sched.finished(draw, group(task, 1.0, passes=passes))
        sched.done(draw)
    assert order[:200].count("b") >= 20               # b's solved tasks keep being probed
    runs = "".join(order[200:]).split("a")
    assert max(len(r) for r in runs) <= 2             # and b does not catch up in a burst
