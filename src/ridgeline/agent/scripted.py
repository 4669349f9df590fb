"""Scripted agents for the harness: `OracleAgent` runs the task's reference solution,
`NullAgent` does nothing. They bound a suite from above (the oracle must pass every
task) and below (doing nothing must pass none), and write trajectories of the same
shape as the LLM agent so reports treat all agents alike."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ridgeline.agent.loop import TaskInfo, TaskLike
from ridgeline.agent.observation import truncate_middle
from ridgeline.agent.trajectory import (
    ActionRecord, AgentResult, ExitStatus, ObservationRecord, StepRecord, StepTimings,
    TrajectoryHeader, TrajectoryResult, TrajectoryWriter,
)
from ridgeline.errors import RidgelineError
from ridgeline.llm.base import Message
from ridgeline.sandbox.base import Sandbox

MAX_LOG_BYTES = 16_000


class NullAgent:
    name = "null"

    def run(self, task: TaskLike | str, sandbox: Sandbox,
            trajectory_path: str | Path | None = None) -> AgentResult:
        info = TaskInfo.of(task, sandbox)
        path = Path(trajectory_path) if trajectory_path is not None else None
        writer = TrajectoryWriter(path, TrajectoryHeader(task_id=info.id,
                                                         instruction=info.instruction,
                                                         agent=self.name))
        trajectory = writer.finish(TrajectoryResult(status=ExitStatus.FINISHED,
                                                    summary="did nothing"))
        return AgentResult.from_trajectory(trajectory, path)


class OracleAgent:
    """Runs `ridgeline.tasks.apply_solution(task, sandbox)`: one step whose observation
    is the solution's output. A solution that fails ends the episode with `error`."""

    name = "oracle"

    def run(self, task: TaskLike, sandbox: Sandbox,
            trajectory_path: str | Path | None = None) -> AgentResult:
        from ridgeline.tasks import apply_solution  # tasks sit left of agent; loaded on use

        info = TaskInfo.of(task, sandbox)
        path = Path(trajectory_path) if trajectory_path is not None else None
        writer = TrajectoryWriter(path, TrajectoryHeader(task_id=info.id,
                                                         instruction=info.instruction,
                                                         agent=self.name))
        t0 = time.perf_counter()
        started_at = time.time()
        status, error, error_type = ExitStatus.FINISHED, None, None
        try:
            outcome = apply_solution(task, sandbox)
            obs = _observation(outcome)
        except RidgelineError as e:  # e.g. TaskUnsupported: the caller reads error_type
            status, error, error_type = ExitStatus.ERROR, f"{type(e).__name__}: {e}", type(e).__name__
            obs = ObservationRecord(text=f"error: {e}", ok=False)
        if not obs.ok and status is ExitStatus.FINISHED:
            status, error = ExitStatus.ERROR, f"the reference solution failed: {obs.text[-300:]}"
            error_type = "SolutionFailed"
        elapsed = time.perf_counter() - t0
        writer.step(StepRecord(
            index=1, started_at=started_at,
            response=Message(role="assistant", content="(runs the reference solution)"),
            action=ActionRecord(tool="solution"), observation=obs,
            timings=StepTimings(exec_s=elapsed, total_s=elapsed)))
        trajectory = writer.finish(TrajectoryResult(status=status, steps=1, wall_s=elapsed,
                                                    summary="ran the reference solution",
                                                    error=error, error_type=error_type))
        return AgentResult.from_trajectory(trajectory, path)


def _observation(outcome: Any) -> ObservationRecord:
    """Whatever `apply_solution` returns: an ExecResult-like object, a bool, or None."""
    if outcome is None or outcome is True:
        return ObservationRecord(text="solution applied", ok=True)
    if outcome is False:
        return ObservationRecord(text="solution failed", ok=False)
    exit_code = getattr(outcome, "exit_code", None)
    text = "\n".join(part for part in (getattr(outcome, "stdout", ""),
                                       getattr(outcome, "stderr", "")) if part)
    ok = getattr(outcome, "ok", exit_code == 0)
    return ObservationRecord(text=truncate_middle(text, MAX_LOG_BYTES)[0], ok=bool(ok),
                             exit_code=exit_code,
                             duration_s=float(getattr(outcome, "duration_s", 0.0) or 0.0),
                             timed_out=bool(getattr(outcome, "timed_out", False)))
