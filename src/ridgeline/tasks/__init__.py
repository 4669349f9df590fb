"""Terminal tasks: the format (both Terminal-Bench layouts), their environment without
Docker, the verifier, quality checks and the built-in suite.

    from ridgeline.tasks import load_tasks, prepare_environment, apply_solution, verify
    for task in load_tasks("builtin"):
        with prepare_environment(task) as sb:      # sandbox: /app seeded, Dockerfile built
            ...                                    # an agent acts in sb
            verdict = verify(task, sb)             # passed | failed | infra_error | unsupported
"""

from ridgeline.tasks.checks import TaskCheck, cached_check, check_task, check_tasks
from ridgeline.tasks.environment import (
    EnvironmentSetupError, TaskSandbox, TaskUnsupported, prepare_environment,
)
from ridgeline.tasks.loader import builtin_suite_dir, load_task, load_tasks
from ridgeline.tasks.model import Resources, SolutionStep, Task, TaskLayout
from ridgeline.tasks.pytest_output import Outcome, TestResult, parse_pytest_output
from ridgeline.tasks.solution import apply_solution
from ridgeline.tasks.verifier import Verdict, VerdictStatus, verdict_from_error, verify
from ridgeline.errors import TaskError

__all__ = [
    "EnvironmentSetupError", "Outcome", "Resources", "SolutionStep", "Task", "TaskCheck",
    "TaskError", "TaskLayout", "TaskSandbox", "TaskUnsupported", "TestResult", "Verdict",
    "VerdictStatus", "apply_solution", "builtin_suite_dir", "cached_check", "check_task",
    "check_tasks", "load_task", "load_tasks", "parse_pytest_output", "prepare_environment",
    "verdict_from_error", "verify",
]
