"""Per-episode results and the summary an evaluation reports.

They live in `ridgeline.agent.results`, shared with the held-out evaluation of a training
run (which may not import `eval`, beside it): see there for the scoring rule (infra errors
and unsupported tasks are never scored) and the 95% bootstrap interval of pass@1.

An evaluation of a suite also says how much of it ran (`EvalSummary`): the pass rate
over *all* its tasks (unsupported tasks, broken task directories and infrastructure
errors count as not passed) beside the pass rate over the scored episodes, and which
tasks were unsupported or broken and why. A suite that was mostly unsupported can then
never read as a pass rate of 100% alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import Field

from ridgeline.agent.results import (
    MODEL_ERROR, EpisodeResult, Summary, bootstrap_ci, pass_at_k, summarize, summary_json,
)
from ridgeline.tasks.loader import BrokenTask
from ridgeline.tasks.verifier import VerdictStatus

__all__ = ["MODEL_ERROR", "EpisodeResult", "EvalSummary", "Summary", "bootstrap_ci",
           "pass_at_k", "summarize", "summarize_suite", "summary_json"]


class EvalSummary(Summary):
    n_broken: int = Field(0, description="task directories of the suite that do not load")
    pass_rate_all: float = Field(
        0.0, description="passed / every episode the suite asked for, broken tasks' "
                         "included: unsupported, broken and infra errors are not passes")
    pass_rate_supported: float = Field(
        0.0, description="passed / scored episodes (= pass_rate): the tasks that ran")
    unsupported_tasks: dict[str, str] = Field(
        default_factory=dict, description="task id -> why this machine cannot run it")
    broken_tasks: dict[str, str] = Field(
        default_factory=dict, description="task directory -> why it does not load")


def summarize_suite(results: list[EpisodeResult], samples: int = 1, wall_s: float = 0.0,
                    broken: Iterable[BrokenTask] = ()) -> EvalSummary:
    """`summarize`, plus the all-tasks pass rate and the tasks that did not run."""
    broken = list(broken)
    base = summarize(results, samples=samples, wall_s=wall_s)
    asked = len(results) + len(broken) * samples
    unsupported: dict[str, str] = {}
    for r in sorted(results, key=lambda r: (r.task_id, r.sample)):
        if r.status is VerdictStatus.UNSUPPORTED:
            unsupported.setdefault(r.task_id, r.detail or (r.failure_class or ""))
    return EvalSummary(
        **base.model_dump(), n_broken=len(broken),
        pass_rate_all=base.n_passed / asked if asked else 0.0,
        pass_rate_supported=base.pass_rate, unsupported_tasks=unsupported,
        broken_tasks={b.id: b.reason for b in sorted(broken, key=lambda b: b.id)})
