"""Per-episode results and the summary an evaluation reports.

Scoring rule: an episode that ended in an infrastructure error or on an unsupported task
is *not scored* (it is neither a pass nor a fail); it is counted and reported separately,
so harness noise never reads as agent failure.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any

from pydantic import BaseModel, Field

from ridgeline.tasks.verifier import VerdictStatus

#: The failure class of an episode whose model endpoint failed: it stops the run.
MODEL_ERROR = "model_error"


class EpisodeResult(BaseModel):
    task_id: str
    domain: str = "unknown"
    difficulty: str = "unknown"
    sample: int = 0
    status: VerdictStatus
    tests_passed: int = 0
    tests_total: int = 0
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    #: Why the episode did not pass: tests_failed, step_limit, time_limit, token_limit,
    #: context_limit, model_error, infra:<what>, unsupported:<why>; None when it passed.
    failure_class: str | None = None
    agent_exit: str | None = None
    detail: str = ""
    trajectory: str | None = None

    @property
    def scored(self) -> bool:
        return self.status.scored


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Summary(BaseModel):
    n_tasks: int
    n_episodes: int
    n_scored: int
    n_passed: int
    n_failed: int
    n_infra_error: int
    n_unsupported: int
    pass_rate: float = Field(description="passed / scored episodes (0 when nothing was scored)")
    pass_at_k: dict[str, float] = Field(default_factory=dict)
    pass_at_1_ci95: tuple[float, float] | None = Field(
        None, description="95% interval of pass@1: a bootstrap over tasks (each task's "
                          "scored samples stay together), 2000 resamples, fixed seed")
    by_domain: dict[str, dict[str, float]] = Field(default_factory=dict)
    failure_classes: dict[str, int] = Field(default_factory=dict)
    mean_steps: float = 0.0
    total_tokens: int = 0
    wall_s: float = 0.0


def summarize(results: list[EpisodeResult], samples: int = 1, wall_s: float = 0.0) -> Summary:
    per_task: dict[str, list[EpisodeResult]] = defaultdict(list)
    for r in results:
        per_task[r.task_id].append(r)
    scored = [r for r in results if r.scored]
    passed = [r for r in scored if r.status is VerdictStatus.PASSED]

    pass_k: dict[str, float] = {}
    for k in sorted({1, samples} | ({2} if samples >= 4 else set())):
        vals = []
        for rs in per_task.values():
            s = [r for r in rs if r.scored]
            if len(s) >= k:
                vals.append(pass_at_k(len(s), sum(r.status is VerdictStatus.PASSED for r in s), k))
        if vals:
            pass_k[f"pass@{k}"] = sum(vals) / len(vals)

    per_task_rate = [sum(r.status is VerdictStatus.PASSED for r in s) / len(s)
                     for rs in per_task.values() if (s := [r for r in rs if r.scored])]
    by_domain: dict[str, dict[str, float]] = {}
    for dom in sorted({r.domain for r in results}):
        d_scored = [r for r in scored if r.domain == dom]
        d_pass = sum(r.status is VerdictStatus.PASSED for r in d_scored)
        by_domain[dom] = {
            "episodes": float(sum(r.domain == dom for r in results)),
            "scored": float(len(d_scored)),
            "passed": float(d_pass),
            "pass_rate": d_pass / len(d_scored) if d_scored else 0.0,
        }

    classes: dict[str, int] = defaultdict(int)
    for r in results:
        if r.failure_class:
            classes[r.failure_class.split(":", 1)[0]] += 1

    return Summary(
        n_tasks=len(per_task), n_episodes=len(results), n_scored=len(scored), n_passed=len(passed),
        n_failed=len(scored) - len(passed),
        n_infra_error=sum(r.status is VerdictStatus.INFRA_ERROR for r in results),
        n_unsupported=sum(r.status is VerdictStatus.UNSUPPORTED for r in results),
        pass_rate=len(passed) / len(scored) if scored else 0.0,
        pass_at_k=pass_k, pass_at_1_ci95=bootstrap_ci(per_task_rate), by_domain=by_domain, failure_classes=dict(sorted(classes.items())),
        mean_steps=sum(r.steps for r in results) / len(results) if results else 0.0,
        total_tokens=sum(r.tokens for r in results), wall_s=wall_s,
    )


def bootstrap_ci(values: list[float], resamples: int = 2000, seed: int = 0
                 ) -> tuple[float, float] | None:
    """The 95% percentile bootstrap interval of the mean of `values` (per-task pass
    rates: tasks are the unit that varies, samples of one task are not independent)."""
    if not values:
        return None
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(resamples))
    return (round(means[int(0.025 * resamples)], 4), round(means[int(0.975 * resamples) - 1], 4))


def summary_json(summary: Summary, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one JSON object `ridgeline eval --json` prints."""
    out = summary.model_dump()
    out.update(extra or {})
    return out
