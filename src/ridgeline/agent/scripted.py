"""Scripted agents for the harness: `OracleAgent` runs the task's reference solution,
`NullAgent` does nothing. They bound a suite from above (the oracle must pass every
task) and below (doing nothing must pass none), and write trajectories of the same
shape as the LLM agent so reports treat all agents alike."""

from __future__ import annotations

import time
from pathlib import Path

from ridgeline.agent.loop import TaskLike, as_task
from ridgeline.agent.observation import truncate_middle
from ridgeline.agent.trajectory import (
    Action, AgentResult, ExitStatus, Observation, StepRecord, StepTimings, TrajectoryHeader,
    TrajectoryResult, TrajectoryWriter,
)
from ridgeline.errors import RidgelineError
from ridgeline.llm.base import Message
from ridgeline.sandbox.base import ExecResult, Sandbox

MAX_LOG_BYTES = 16_000


class NullAgent:
    name = "null"

    def run(self, task: TaskLike | str, sandbox: Sandbox,
            trajectory_path: str | Path | None = None) -> AgentResult:
        info = as_task(task, sandbox)
        path = Path(trajectory_path) if trajectory_path is not None else None
        writer = TrajectoryWriter(path, TrajectoryHeader(task_id=info.id,
                                                         instruction=info.instruction,
                                                         agent=self.name))
        trajectory = writer.finish(TrajectoryResult(status=ExitStatus.FINISHED,
                                                    summary="did nothing"))
        return AgentResult(trajectory, path)


class OracleAgent:
    """Runs `ridgeline.tasks.apply_solution(task, sandbox)`: one step whose observation
    is the solution's output. A solution that fails ends the episode with `error`."""

    name = "oracle"

    def run(self, task: TaskLike, sandbox: Sandbox,
            trajectory_path: str | Path | None = None) -> AgentResult:
        from ridgeline.tasks import apply_solution  # tasks sit left of agent; loaded on use

        path = Path(trajectory_path) if trajectory_path is not None else None
        writer = TrajectoryWriter(path, TrajectoryHeader(task_id=task.id,
                                                         instruction=task.instruction,
                                                         agent=self.name))
        t0 = time.perf_counter()
        started_at = time.time()
        status, error, error_type = ExitStatus.FINISHED, None, None
        exception: RidgelineError | None = None
        try:
            obs = _observation(apply_solution(task, sandbox))
        except RidgelineError as e:  # e.g. TaskUnsupported: the verdict will say so
            status, exception = ExitStatus.ERROR, e
            error, error_type = f"{type(e).__name__}: {e}", type(e).__name__
            obs = Observation(text=f"error: {e}", ok=False)
        if not obs.ok and status is ExitStatus.FINISHED:
            status, error = ExitStatus.ERROR, f"the reference solution failed: {obs.text[-300:]}"
            error_type = "SolutionFailed"
        elapsed = time.perf_counter() - t0
        writer.step(StepRecord(
            index=1, started_at=started_at,
            response=Message(role="assistant", content="(runs the reference solution)"),
            action=Action(tool="solution"), observation=obs,
            timings=StepTimings(exec_s=elapsed, total_s=elapsed)))
        trajectory = writer.finish(TrajectoryResult(status=status, steps=1, wall_s=elapsed,
                                                    summary="ran the reference solution",
                                                    error=error, error_type=error_type))
        return AgentResult(trajectory, path, exception)


def _observation(res: ExecResult) -> Observation:
    """The solution's output as the step's observation (head and tail when long)."""
    text = "\n".join(part for part in (res.stdout, res.stderr) if part)
    return Observation(text=truncate_middle(text, MAX_LOG_BYTES)[0], ok=res.ok,
                       exit_code=res.exit_code, duration_s=res.duration_s,
                       timed_out=res.timed_out)
