"""A curriculum over tasks from their recent pass rates: GRPO learns nothing from a
group whose episodes all pass or all fail (zero advantage), so tasks the policy always
or never solves are *rested* for a while and tasks in between are favoured.

    cur = Curriculum(CurriculumConfig())
    cur.record("task-a", [True, False, True, True])   # one group's pass flags
    cur.weight("task-a")                              # 4 p (1 - p), floored
    cur.resting("task-b")                             # all 0 or all 1 lately?

A task with no history has weight 1 (explore it). A rested task sits out `rest_draws`
draws (of any task), then is a candidate again (weight 1) until it is drawn once, a
probe; its next group decides whether it rests again. Everything here is plain data and
restores from `state_dict()`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TypedDict

from pydantic import BaseModel, ConfigDict, Field

from ridgeline.rl.advantages import zero_variance


class CurriculumConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    window: int = Field(16, ge=1, description="recent episodes per task that its pass rate "
                        "is measured on")
    min_episodes: int = Field(8, ge=1, description="episodes seen before a task may rest")
    rest_draws: int = Field(8, ge=1, description="draws (of any task) a rested task sits out")
    floor: float = Field(0.05, gt=0, le=1, description="least weight of a task that is "
                         "not resting (so every task is still seen now and then)")


class CurriculumState(TypedDict, total=False):
    """`Curriculum.state_dict()` (every key optional when loading)."""

    recent: dict[str, list[bool]]
    rest_until: dict[str, int]
    draws: int


class Curriculum:
    """Recent pass flags per task, the rests they earn, and the draw count rests end at."""

    def __init__(self, config: CurriculumConfig | None = None) -> None:
        self.config = config or CurriculumConfig()
        self._recent: dict[str, deque[bool]] = {}
        self._rest_until: dict[str, int] = {}   # task -> draw count it rests until
        # Rests are counted in draws of any task: a domain whose tasks all rest is not
        # drawn at all, so its own draws would never end their rest.
        self._draws = 0

    def record(self, task_id: str, passes: Iterable[bool]) -> None:
        """Pass flags of a finished group's graded episodes (masked ones left out)."""
        q = self._recent.setdefault(task_id, deque(maxlen=self.config.window))
        q.extend(bool(p) for p in passes)
        if not self.saturated(task_id):
            self._rest_until.pop(task_id, None)
        elif task_id not in self._rest_until:   # saturated now: its rest starts
            self._rest_until[task_id] = self._draws + self.config.rest_draws

    def pass_rate(self, task_id: str) -> float | None:
        q = self._recent.get(task_id)
        return sum(q) / len(q) if q else None

    def saturated(self, task_id: str) -> bool:
        """Seen enough, and recently always or never passed: its groups would be flat."""
        q = self._recent.get(task_id)
        if not self.config.enabled or q is None or len(q) < self.config.min_episodes:
            return False
        return zero_variance([float(p) for p in q])

    def weight(self, task_id: str) -> float:
        """How strongly to favour the task: 4 p (1 - p) (1 at p = 0.5), floored; 1 for a
        task not yet seen, and for a saturated one whose rest is over (its probe)."""
        rate = self.pass_rate(task_id)
        if not self.config.enabled or rate is None or self.saturated(task_id):
            return 1.0
        return max(self.config.floor, 4.0 * rate * (1.0 - rate))

    def drawn(self, task_id: str) -> None:
        """The task was chosen (one more draw). A saturated task's probe starts its next
        rest; its group's outcome decides whether it keeps resting."""
        self._draws += 1
        if self.saturated(task_id):
            self._rest_until[task_id] = self._draws + self.config.rest_draws

    def resting(self, task_id: str) -> bool:
        """Sitting out: saturated, and its rest not over. Once the rest is over the task
        is a candidate until drawn (its probe)."""
        return self.saturated(task_id) and self._draws < self._rest_until.get(task_id, 0)

    def state_dict(self) -> CurriculumState:
        return {"recent": {k: list(v) for k, v in self._recent.items()},
                "rest_until": dict(self._rest_until), "draws": self._draws}

    def load_state_dict(self, state: CurriculumState) -> None:
        self._recent = {k: deque(v, maxlen=self.config.window)
                        for k, v in state.get("recent", {}).items()}
        self._rest_until = {k: int(v) for k, v in state.get("rest_until", {}).items()}
        self._draws = int(state.get("draws", 0))
