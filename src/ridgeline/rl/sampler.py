"""The order of a run's tasks: a seeded shuffle over a list (or a family `tasks(i)`),
resumable from a checkpoint, and each episode's sampling seed as a function of where it
is in that order (so a resumed run samples what the uninterrupted one would have).
`TaskSampler` is the FIFO `protocols.TaskSource`; `scheduler.DomainScheduler` is the
adaptive one (`protocols.AdaptiveTaskSource`)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, Literal, TypeAlias, TypedDict

from ridgeline.errors import RidgelineError
from ridgeline.rl.protocols import TaskT

if TYPE_CHECKING:
    from ridgeline.rl.scheduler import DomainOrderState


class ShuffledOrderState(TypedDict):
    """`TaskSampler.state_dict()`: where the order is, and the draws to hand out again."""

    kind: Literal["shuffled"]
    seed: int
    next: int
    redo: list[int]


#: A task source's checkpoint state (state.json's "sampler").
SamplerState: TypeAlias = "ShuffledOrderState | DomainOrderState"


def episode_seed(run_seed: int, draw: int, sample: int) -> int:
    """A sampling seed per episode, a function of where it is in the data order only
    (so a resumed run samples what the uninterrupted one would have)."""
    return (run_seed * 1_000_003 + draw * 1009 + sample) % (2**31 - 1)


class TaskSampler(Generic[TaskT]):
    """Tasks in a seeded order: shuffled epochs over a list, or `tasks(i)` for a family
    that generates task `i`. Tracks which draws are not yet consumed by a train step, so
    a checkpoint resumes with them first and then where the order left off. It does not
    adapt to how groups went and never blocks, so it has none of the scheduler's hooks."""

    def __init__(self, tasks: Sequence[TaskT] | Callable[[int], TaskT], seed: int = 0) -> None:
        if not callable(tasks) and not tasks:
            raise RidgelineError("no tasks to train on",
                                 hint="check the task selection of the config")
        self.tasks = tasks
        self.seed = seed
        self._lock = threading.Lock()
        self._next = 0
        self._redo: list[int] = []          # draws to hand out again (after a resume)
        self._pending: set[int] = set()     # handed out, not yet consumed

    def task(self, draw: int) -> TaskT:
        if callable(self.tasks):
            return self.tasks(draw)
        n = len(self.tasks)
        epoch, pos = divmod(draw, n)
        order = list(range(n))
        random.Random(self.seed * 7919 + epoch).shuffle(order)
        return self.tasks[order[pos]]

    def draw(self) -> tuple[int, TaskT]:
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

    def state_dict(self, exclude: Sequence[int] = ()) -> ShuffledOrderState:
        """`exclude`: draws whose groups are saved elsewhere (finished, in the buffer)."""
        with self._lock:
            pending = sorted((self._pending | set(self._redo)) - set(exclude))
            return {"kind": "shuffled", "seed": self.seed, "next": self._next, "redo": pending}

    def load_state_dict(self, state: SamplerState) -> None:
        if state.get("kind", "shuffled") != "shuffled":
            raise RidgelineError(f"the checkpoint's task order is a {state['kind']} "
                                 "scheduler's, not a shuffled order",
                                 hint="resume with the scheduler setting the run started with")
        with self._lock:
            self.seed, self._next = int(state["seed"]), int(state["next"])
            self._redo, self._pending = [int(i) for i in state["redo"]], set()
