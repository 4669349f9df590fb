"""Applying a task's reference (oracle) solution in its prepared sandbox."""

from __future__ import annotations

from ridgeline.errors import TaskError
from ridgeline.sandbox import hostfs
from ridgeline.sandbox.base import ExecResult
from ridgeline.tasks.environment import (
    SOLUTION_PATH, TaskSandbox, TaskUnsupported, stage_copy,
)
from ridgeline.tasks.model import Task


def apply_solution(task: Task, sandbox: TaskSandbox, timeout: float | None = None
                   ) -> ExecResult:
    """Run the oracle: `solution.sh` / Harbor's `solution/solve.sh` (copied to
    /solution and run with bash in the working directory), or the commands of a
    `solution.yaml`, typed one by one into a persistent shell."""
    if not task.has_solution:
        raise TaskError(f"task {task.id!r} has no oracle solution (solution.sh, "
                        f"solution.yaml or solution/solve.sh)",
                        hint="add one; the quality checks need it")
    limit = timeout if timeout is not None else task.agent_timeout_s
    hostfs.clear_dir(sandbox.solution_host_dir)
    if task.solution_steps is not None:
        return _type_steps(task, sandbox, limit)
    assert task.solution_script is not None
    if task.solution_dir is not None:
        for child in task.solution_dir.iterdir():
            stage_copy(child, sandbox.solution_host_dir)
        script = f"{SOLUTION_PATH}/{task.solution_script.name}"
    else:
        stage_copy(task.solution_script, sandbox.solution_host_dir, "solution.sh")
        script = f"{SOLUTION_PATH}/solution.sh"
    return sandbox.run(["bash", script], timeout=limit, env=task.solution_env or None,
                       cwd=task.workdir)


def _type_steps(task: Task, sandbox: TaskSandbox, limit: float) -> ExecResult:
    steps = task.solution_steps or ()
    interactive = [s.command for s in steps if not s.block or not s.append_enter]
    if interactive:
        raise TaskUnsupported(task.id, f"solution.yaml sends keystrokes to an interactive "
                              f"program ({interactive[0]!r}); only blocking commands can "
                              f"be replayed")
    out, err = [], []
    duration = 0.0
    last: ExecResult | None = None
    shell = sandbox.shell()
    try:
        for step in steps:
            last = shell.send(step.command, timeout=max(limit, step.min_timeout_sec))
            out.append(last.stdout_bytes)
            err.append(last.stderr_bytes)
            duration += last.duration_s
            if last.timed_out:
                break
    finally:
        shell.close()
    if last is None:
        return ExecResult(0, b"", b"", 0.0)
    return ExecResult(last.exit_code, b"".join(out), b"".join(err), duration,
                      last.timed_out, last.killed_by, last.truncated)
