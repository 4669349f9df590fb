"""Multi-step tasks (Harbor `[[steps]]`): each step acted on and verified in turn, in one
environment, as its own instruction and tests see it (`Task.step_views`).

The episode goes on to the next step only when a step's reward reaches its
`min_reward`; its verdict is the last step's that ran, passed only when every step
passed, with each step's outcome in `detail` and its reward the fraction of steps
passed. A task without steps is one step. The agent starts each step with a new
conversation in the same environment, or, for a step with `inherit_prior_session`, goes
on with the previous step's (agent/run.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from ridgeline.tasks.environment import TaskSandbox
from ridgeline.tasks.model import Task
from ridgeline.tasks.verifier import Verdict, VerdictStatus, verify

#: act(step_view, sandbox): the agent's or the oracle's work on one step
Act = Callable[[Task, TaskSandbox], object]


def run_steps(task: Task, sandbox: TaskSandbox, act: Act) -> Verdict:
    views = task.step_views()
    if len(views) == 1:
        act(views[0], sandbox)
        return verify(views[0], sandbox)
    t0 = time.perf_counter()
    done: list[str] = []
    passed = 0
    verdict: Verdict | None = None
    for view, step in zip(views, task.steps):
        act(view, sandbox)
        verdict = verify(view, sandbox)
        reached = (verdict.status is VerdictStatus.PASSED and verdict.reward is not None
                   and verdict.reward >= step.min_reward)
        passed += reached
        done.append(f"{step.name}: {verdict.status.value}"
                    + (f" (reward {verdict.reward:g})" if verdict.reward is not None else ""))
        if not reached:
            break
    assert verdict is not None
    summary = f"steps {len(done)}/{len(views)} run, {passed} passed: " + "; ".join(done)
    if passed == len(views):
        return replace(verdict, detail=f"{summary}. {verdict.detail}".strip(),
                       duration_s=time.perf_counter() - t0)
    status = verdict.status
    if status is VerdictStatus.PASSED:   # passed, but under the step's min_reward
        status = VerdictStatus.FAILED
    # the agent's result: the share of steps it got through; an infra error stays one
    reward = passed / len(views) if status is VerdictStatus.FAILED else None
    return replace(verdict, status=status, detail=f"{summary}. {verdict.detail}".strip(),
                   reward=reward, duration_s=time.perf_counter() - t0)
