"""`AsyncRLLoop.paused()`: inside it no rollout runs. Groups in flight when it is entered
finish first and go into the buffer as any other; groups not yet started wait until it
ends; the staleness bound holds across it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ridgeline.rl.filters import EpisodeOutcome
from ridgeline.rl.loop import AsyncRLLoop, LoopConfig
from ridgeline.rl.rollouts import EpisodeGroup
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.tokens import TokenEpisode


@dataclass(frozen=True)
class Task:
    id: str


class Sink:
    """The engine as far as versions go: tokens are stamped with the last synced one."""

    def __init__(self) -> None:
        self.version = 0

    def update_weights(self, tensors, version=None) -> int:
        self.version = version
        return 0


class Trainer:
    """Syncs a new version every step (the groups below have no reward variance, so
    nothing is ever trained on)."""

    def __init__(self) -> None:
        self.version = 0

    def step(self, batch):
        raise AssertionError("zero-variance groups are never trained on")

    def gradient(self, batch):
        raise AssertionError("no conflict measurement in these tests")

    def sync(self, sink) -> dict[str, float]:
        self.version += 1
        sink.update_weights([], version=self.version)
        return {}


class SlowRollout:
    """Groups that take `seconds`; counts those running, started and finished."""

    def __init__(self, sink: Sink, seconds: float = 0.15) -> None:
        self.sink = sink
        self.seconds = seconds
        self.lock = threading.Lock()
        self.running = self.started = self.finished = 0

    def __call__(self, task: Task, seeds: list[int]) -> EpisodeGroup:
        with self.lock:
            self.running += 1
            self.started += 1
        try:
            version = self.sink.version
            time.sleep(self.seconds)
            outcomes = []
            for _ in seeds:
                ep = TokenEpisode.start([1, 2, 3])
                ep.add_completion([4, 5], [0.0, 0.0], [version, version])
                outcomes.append(EpisodeOutcome(verdict="failed", reward=0.0, sample=ep))
            return EpisodeGroup(task, outcomes, self.seconds)
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1


def make_loop(eta: int = 1, threads: int = 3) -> tuple[AsyncRLLoop, SlowRollout]:
    sink = Sink()
    rollout = SlowRollout(sink)
    loop = AsyncRLLoop(Trainer(), TaskSampler([Task("a"), Task("b"), Task("c")]), rollout, sink,
                       LoopConfig(group_size=2, batch_groups=1, eta=eta, rollout_threads=threads))
    return loop, rollout


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


def test_paused_waits_for_the_groups_in_flight_and_starts_none_until_it_ends():
    loop, rollout = make_loop()
    seen: dict[str, int] = {}

    def on_step(step, metrics):
        if step != 2:
            return
        assert wait_for(lambda: rollout.running > 0), "no rollout ran during the step"
        seen["running_before"] = rollout.running
        with loop.paused():
            with rollout.lock:
                seen["running"] = rollout.running
                seen["finished"] = rollout.finished
            seen["in_flight"] = loop.rollouts_in_flight
            buf = loop.buffer.metrics()
            seen["put"] = buf["finished"]
            seen["ready"] = loop.buffer.num_ready
            ready_in_state = len(loop.buffer.state_dict()["ready"])
            seen["ready_in_state"] = ready_in_state
            started = rollout.started
            time.sleep(3 * rollout.seconds)   # a group would have started and finished
            seen["started_while_paused"] = rollout.started - started
        seen["version"] = loop.buffer.version

    history = loop.run(6, on_step=on_step)
    assert [m["step"] for m in history] == list(range(6))    # and it went on after the pause
    assert seen["running_before"] >= 1
    assert seen["running"] == 0 and seen["in_flight"] == 0
    assert seen["started_while_paused"] == 0
    # every group that finished before the pause went into the buffer (a checkpoint taken
    # inside holds the ones not yet trained on)
    assert seen["put"] == seen["finished"]
    assert seen["ready"] >= seen["running_before"] and seen["ready_in_state"] == seen["ready"]
    assert loop.rollouts_in_flight == 0
    assert rollout.started > 6
    m = loop.buffer.metrics()
    assert m["max_staleness"] <= 1 and m["consumed"] == 6      # the bound held throughout


def test_a_pause_before_run_holds_back_every_group_and_nests():
    loop, rollout = make_loop(eta=0, threads=2)
    with loop.paused():
        runner = threading.Thread(target=loop.run, args=(3,), daemon=True)
        runner.start()
        with loop.paused():
            time.sleep(0.3)
        time.sleep(0.3)       # the inner block ended: still paused
        assert rollout.started == 0
        # the rollout threads were admitted (they keep their tickets) and wait to start
        assert wait_for(lambda: loop.buffer.metrics()["started"] >= 1)
    runner.join(timeout=30)
    assert not runner.is_alive()
    assert rollout.started >= 3 and loop.buffer.metrics()["consumed"] == 3
    assert loop.buffer.metrics()["max_staleness"] == 0       # eta 0: synchronous


def test_pausing_with_nothing_in_flight_returns_at_once():
    loop, rollout = make_loop()
    with loop.paused():
        assert loop.rollouts_in_flight == 0
    assert rollout.started == 0
