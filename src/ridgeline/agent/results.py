"""Graded episodes: what one became (`EpisodeResult`), many run at once (`run_jobs`), and
the summary an evaluation reports over them (`summarize`: pass rate, pass@k, the 95%
bootstrap interval of pass@1 over tasks). `ridgeline eval` (`eval.runner`) and the
held-out evaluation of a training run (`rl.run`) both use these, so their numbers mean
the same; `results.json` (`write_results`) is the machine-readable form both write.

Scoring rule: an episode that ended in an infrastructure error or on an unsupported task
is *not scored* (it is neither a pass nor a fail); it is counted and reported separately,
so harness noise never reads as agent failure.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, Field

from ridgeline.agent.trajectory import AgentResult, ExitStatus, TrajectoryResult
from ridgeline.errors import ModelEndpointError
from ridgeline.tasks.verifier import Verdict, VerdictStatus

if TYPE_CHECKING:
    from ridgeline.agent.run import TaskEpisode

#: The failure class of an episode whose model endpoint failed: it stops the run.
MODEL_ERROR = "model_error"

Job = tuple[Any, int]  # (task, sample)

log = logging.getLogger(__name__)


class EpisodeResult(BaseModel):
    task_id: str
    domain: str = "unknown"
    difficulty: str = "unknown"
    sample: int = 0
    status: VerdictStatus
    tests_passed: int = 0
    tests_total: int = 0
    steps: int = 0
    #: replies that held no valid action (the agent answered them with a format hint)
    format_errors: int = 0
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


# ---- one episode's result --------------------------------------------------------------


class EvalTask(Protocol):
    """What an episode's result names: a terminal `Task` and a toolbench `ToolTask`."""

    @property
    def id(self) -> str: ...

    @property
    def domain(self) -> str: ...

    @property
    def difficulty(self) -> str: ...


def _failure_class(verdict: Verdict, run: TrajectoryResult | None) -> str | None:
    if verdict.status is VerdictStatus.PASSED:
        return None
    if verdict.status is VerdictStatus.UNSUPPORTED:
        return f"unsupported:{verdict.detail[:80]}"
    if verdict.status is VerdictStatus.INFRA_ERROR:
        return f"infra:{verdict.reason or 'error'}"
    if run is not None and run.status is not ExitStatus.FINISHED:
        return "agent_error" if run.status is ExitStatus.ERROR else run.status.value
    return verdict.reason or "tests_failed"


def episode_result(task: EvalTask, sample: int, verdict: Verdict, agent: AgentResult | None,
                   wall_s: float, trajectory_path: Path,
                   endpoint_error: ModelEndpointError | None = None,
                   steps: int | None = None) -> EpisodeResult:
    """The one place a graded episode becomes its result (terminal tasks and toolbench).

    A model endpoint that failed, before the agent ran (`endpoint_error`) or during its
    episode (the agent's exception), is infrastructure: `infra_error` and `model_error`,
    never the agent's fault, with the endpoint's message as the detail. `steps` counts
    the episode when no agent result does (toolbench's oracle)."""
    run = agent.result if agent is not None else None
    if endpoint_error is None and agent is not None and \
            isinstance(agent.exception, ModelEndpointError):
        endpoint_error = agent.exception
    if endpoint_error is not None:
        status, failure, detail = VerdictStatus.INFRA_ERROR, MODEL_ERROR, str(endpoint_error)
    else:
        status, failure = verdict.status, _failure_class(verdict, run)
        detail = verdict.detail or (run.error if run is not None else None) or ""
    return EpisodeResult(
        task_id=task.id, domain=task.domain, difficulty=str(task.difficulty), sample=sample,
        status=status, tests_passed=verdict.tests_passed, tests_total=verdict.tests_total,
        steps=run.steps if run is not None else steps or 0,
        format_errors=run.n_format_errors if run is not None else 0,
        tokens=run.total_tokens if run is not None else 0, wall_s=wall_s,
        failure_class=failure, agent_exit=run.status.value if run is not None else None,
        detail=detail[:500], trajectory=str(trajectory_path) if agent is not None else None)


def record_verdict(agent: AgentResult | None, verdict: Verdict) -> None:
    """Append the verdict to the agent's trajectory file. The file is a convenience for
    reading an episode later: one that cannot be written is logged, and the episode's
    result (results.json) still counts."""
    if agent is None:
        return
    try:
        agent.attach_verdict(verdict)
    except OSError as e:
        log.warning("could not append the verdict to %s: %s", agent.trajectory_path, e)


def task_episode_result(task: EvalTask, sample: int, ep: TaskEpisode,
                        trajectory_path: Path) -> EpisodeResult:
    """The result of a terminal task's episode (`agent.run.run_task_episode`), its verdict
    appended to its trajectory. An endpoint error raised outside the agent loop (e.g.
    probing the endpoint) makes it a `model_error`, which stops `run_jobs`."""
    endpoint_error = ep.error if isinstance(ep.error, ModelEndpointError) else None
    record_verdict(ep.agent, ep.verdict)
    return episode_result(task, sample, ep.verdict, ep.agent, ep.seconds, trajectory_path,
                          endpoint_error)


# ---- many episodes at once -------------------------------------------------------------


def run_jobs(jobs: list[Job], run_one: Callable[[Job], EpisodeResult], concurrency: int,
             on_result: Callable[[EpisodeResult], None] | None = None,
             ) -> tuple[list[EpisodeResult], str | None]:
    """Run `run_one` over `jobs`, `concurrency` at once, in completion order. A result of
    class `model_error` stops starting new jobs (the endpoint is down; the results so far
    are kept). Returns the results and that endpoint error, if any."""
    results: list[EpisodeResult] = []
    stop = threading.Event()
    endpoint_error: str | None = None
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eval") as pool:
        pending: dict[Future, Job] = {}
        it = iter(jobs)

        def submit_next() -> bool:
            if stop.is_set():
                return False
            job = next(it, None)
            if job is None:
                return False
            pending[pool.submit(run_one, job)] = job
            return True

        for _ in range(concurrency):
            if not submit_next():
                break
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                pending.pop(fut)
                res = fut.result()
                results.append(res)
                if on_result is not None:
                    on_result(res)
                if res.failure_class == MODEL_ERROR:
                    stop.set()
                    endpoint_error = res.detail
                submit_next()
    return results, endpoint_error


# ---- the summary -----------------------------------------------------------------------


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
    mean_format_errors: float = 0.0
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
        mean_format_errors=(sum(r.format_errors for r in results) / len(results)
                            if results else 0.0),
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


def write_results(out_dir: Path, results: list[EpisodeResult], summary: Summary,
                  meta: dict[str, Any]) -> Path:
    """`out_dir/results.json`: the run's description, its summary and every episode."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "summary": summary.model_dump(),
                               "episodes": [r.model_dump() for r in results]}, indent=2))
    tmp.replace(path)  # atomic: a crash mid-write never leaves a half file
    return path
