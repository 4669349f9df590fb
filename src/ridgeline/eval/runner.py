"""The evaluation harness: every (task, sample) episode in its own sandbox, in parallel,
graded by the task's tests, gathered into results, a report and plots.

    config = EvalConfig(tasks="builtin", agent="oracle", concurrency=8)
    run = run_eval(config)            # writes results.json, report.md, PNGs under config.out
    run.summary.pass_rate

An endpoint that stays down ends the run early: results gathered so far are written, then
`ModelEndpointError` is raised. Tasks that hang are killed at their timeout by the sandbox
and reported as such; set-up failures are infrastructure errors, never scored. A task
directory of the suite that does not load is reported as broken, with its reason, and
the rest run (`summary.broken_tasks`, and in the all-tasks pass rate).
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from ridgeline.agent import AgentConfig, AgentResult
from ridgeline.agent.results import (
    EvalTask, Job, episode_result, record_verdict, run_jobs, task_episode_result,
)
from ridgeline.agent.run import run_task_episode
from ridgeline.errors import ConfigError, ModelEndpointError
from ridgeline.eval.report import write_report
from ridgeline.eval.results import EpisodeResult, EvalSummary, summarize_suite
from ridgeline.llm.base import ChatModel
from ridgeline.tasks import Task
from ridgeline.tasks.loader import BrokenTask, load_suite

# episode_result, record_verdict, run_jobs: shared with the held-out evaluation of a
# training run (`ridgeline.agent.results`); still importable from here
__all__ = ["DEMO_TASK_IDS", "EvalConfig", "EvalRun", "EvalTask", "Job", "episode_agent_config", "episode_result", "finish_run", "make_model",
           "record_verdict", "run_episode", "run_episodes", "run_eval", "run_jobs",
           "run_meta", "select_suite", "select_tasks"]

AgentKind = Literal["llm", "oracle", "null"]

log = logging.getLogger(__name__)

#: `--tasks demo`: a representative slice of the built-in suite (each domain, mostly easy
#: tasks) that the default 135M model finishes in minutes on 2 cores; used by `make demo`.
DEMO_TASK_IDS = [
    "hello-file", "create-directory", "copy-config", "uppercase-text", "extract-emails",
    "fizzbuzz", "fix-syntax-error", "git-commit-file", "dep-install-from-wheelhouse",
    "cube-obj", "clean-prices", "rename-function", "sh-write-greeting",
]


class EvalConfig(BaseModel):
    tasks: str = Field("builtin", description="'builtin', 'demo', 'toolbench', a task dir or a suite dir")
    agent: AgentKind = "llm"
    model: str = Field("default", description="'default', a model dir/GGUF, or an OpenAI-compatible URL")
    model_name: str | None = Field(None, description="model name to send to a URL endpoint")
    api_key: str | None = None
    concurrency: int = Field(4, ge=1, le=256)
    samples: int = Field(1, ge=1, le=100)
    limit: int | None = Field(None, ge=1, description="evaluate only the first N tasks")
    task_ids: list[str] = Field(default_factory=list, description="evaluate only these ids")
    out: Path | None = None
    backend: str = "bwrap"
    only_valid: bool = Field(False, description="leave out tasks failing the quality checks")
    agent_config: AgentConfig = Field(default_factory=AgentConfig)

    def out_dir(self) -> Path:
        if self.out is not None:
            return self.out
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        return Path("runs") / f"eval-{self.agent}-{stamp}"


@dataclass
class EvalRun:
    results: list[EpisodeResult]
    summary: EvalSummary
    out_dir: Path
    files: dict[str, Path]
    meta: dict[str, Any]


def make_model(config: EvalConfig) -> ChatModel:
    """The model behind the `llm` agent: an OpenAI-compatible URL or the in-process engine
    (`llm.make_chat_model`, the one place that tells them apart)."""
    from ridgeline.llm import make_chat_model

    if config.model.startswith(("http://", "https://")):
        # model=None lets the client discover the served model's name and context window.
        return make_chat_model(config.model, model=config.model_name, api_key=config.api_key)
    # a training run's directory stands for its checkpoint: the engine's model registry
    # resolves it (`registry._entry_for_path`), as for `serve` and `train`
    return make_chat_model(config.model)


def select_tasks(config: EvalConfig) -> list[Task]:
    return select_suite(config)[0]


def select_suite(config: EvalConfig) -> tuple[list[Task], list[BrokenTask]]:
    """The tasks to run and the selected task directories that do not load (reported,
    never run); `task_ids` and `limit` apply to both, in id order."""
    source = "builtin" if config.tasks == "demo" else config.tasks
    suite = load_suite(source, only_valid=config.only_valid, backend=config.backend)
    tasks, broken = suite.tasks, suite.broken
    if config.tasks == "demo":
        tasks, broken = [t for t in tasks if t.id in set(DEMO_TASK_IDS)], []
    if config.task_ids:
        known = {t.id for t in tasks} | {b.id for b in broken}
        missing = [i for i in config.task_ids if i not in known]
        if missing:
            raise ConfigError(f"unknown task ids: {', '.join(missing)}",
                              hint="see `ridgeline tasks list`")
        tasks = [t for t in tasks if t.id in set(config.task_ids)]
        broken = [b for b in broken if b.id in set(config.task_ids)]
    if config.limit is not None:
        first = set(sorted([t.id for t in tasks] + [b.id for b in broken])[: config.limit])
        tasks = [t for t in tasks if t.id in first][: config.limit]
        broken = [b for b in broken if b.id in first]
    return tasks, broken


def run_episode(task: Task, sample: int, agent_factory: Callable[[], Any], config: EvalConfig,
                traj_dir: Path) -> tuple[EpisodeResult, AgentResult | None]:
    """One episode: prepare the environment, let the agent act, verify. Never raises for
    task or sandbox problems; those become unsupported / infra_error results."""
    traj_path = traj_dir / f"{task.id}.{sample}.jsonl"
    ep = run_task_episode(task, agent_factory(), episode_agent_config(config, task.id, sample),
                          backend=config.backend, trajectory_path=traj_path)
    return task_episode_result(task, sample, ep, traj_path), ep.agent


def episode_agent_config(config: EvalConfig, task_id: str, sample: int) -> AgentConfig:
    """The agent's config for one episode: with a sampling seed, each (task, sample) gets
    its own, derived from it, so samples differ and a rerun repeats them."""
    sampling = config.agent_config.sampling
    if sampling.seed is None:
        return config.agent_config
    seed = zlib.crc32(f"{sampling.seed}:{task_id}:{sample}".encode())
    return config.agent_config.model_copy(
        update={"sampling": sampling.model_copy(update={"seed": seed})})


def run_meta(config: EvalConfig, model_label: str) -> dict[str, Any]:
    """The run's description that results.json and the report carry."""
    sampling = config.agent_config.sampling
    return {"agent": config.agent, "tasks": config.tasks, "model": model_label,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "seed": sampling.seed, "max_tokens": sampling.max_tokens,
            "samples": config.samples, "concurrency": config.concurrency,
            "backend": config.backend, "task_environment": task_environment(config.backend),
            "action_format": config.agent_config.action_format,
            "constrained_tool_calls": config.agent_config.constrained_tool_calls,
            "date": _dt.datetime.now().isoformat(timespec="seconds")}


def task_environment(backend: str) -> str:
    """How Dockerfile tasks are made in this run, for the report: `image` (built by
    podman) or `host` (the host-root fallback, with why), and whether tasks that
    declare allow_internet get it."""
    from ridgeline.tasks.environment import IMAGE_BACKENDS, operator_allows_internet
    from ridgeline.tasks.images import builder, environment_mode, uses_images
    mode = environment_mode()
    internet = ("internet for tasks that allow it" if operator_allows_internet()
                and backend == "bwrap" else "no internet")
    if backend in IMAGE_BACKENDS and uses_images(mode):
        return f"built as images, {internet}"
    why = "asked for" if mode == "host" else (
        builder().unavailable_reason() or f"backend {backend}")
    return f"host (fallback: {why}), {internet}"


def run_episodes(config: EvalConfig, tasks: list[Any],
                 run_one: Callable[[Any, int], EpisodeResult],
                 out_dir: Path, meta: dict[str, Any],
                 on_start: Callable[[int], None] | None = None,
                 on_result: Callable[[EpisodeResult], None] | None = None,
                 broken: Iterable[BrokenTask] = ()) -> EvalRun:
    """Every (task, sample) episode through `run_jobs`, then the report (`finish_run`)."""
    t0 = time.perf_counter()
    jobs = [(t, s) for s in range(config.samples) for t in tasks]
    if on_start is not None:
        on_start(len(jobs))
    results, endpoint_error = run_jobs(jobs, lambda job: run_one(job[0], job[1]),
                                       config.concurrency, on_result)
    return finish_run(config, out_dir, results, len(jobs), time.perf_counter() - t0, meta,
                      endpoint_error, broken)


def finish_run(config: EvalConfig, out_dir: Path, results: list[EpisodeResult], n_jobs: int,
               wall_s: float, meta: dict[str, Any], endpoint_error: str | None,
               broken: Iterable[BrokenTask] = ()) -> EvalRun:
    """Summarise and write the report; then raise if the endpoint went down."""
    summary = summarize_suite(results, samples=config.samples, wall_s=wall_s, broken=broken)
    files = write_report(out_dir, results, summary, meta)
    if endpoint_error is not None:
        raise ModelEndpointError(
            f"the model endpoint failed after retries ({endpoint_error}); "
            f"{len(results)} of {n_jobs} episodes were run and saved to {files['results']}",
            hint="check that the server is up, then run again")
    return EvalRun(results, summary, out_dir, files, meta)


def run_eval(config: EvalConfig, on_result: Callable[[EpisodeResult], None] | None = None,
             model: ChatModel | None = None,
             on_start: Callable[[int], None] | None = None) -> EvalRun:
    """Run every (task, sample) episode with `config.concurrency` sandboxes at once."""
    tasks, broken = select_suite(config)
    out_dir = config.out_dir()
    traj_dir = out_dir / "trajectories"
    traj_dir.mkdir(parents=True, exist_ok=True)

    made = None
    if config.agent == "llm":
        chat_model = model if model is not None else make_model(config)
        made = chat_model if model is None else None
        agent_factory: Callable[[], Any] = lambda: chat_model  # noqa: E731
        model_label = getattr(chat_model, "name", config.model)
    else:
        agent_factory = lambda: config.agent  # noqa: E731
        model_label = "-"
    try:
        return run_episodes(
            config, tasks, lambda task, sample: run_episode(task, sample, agent_factory,
                                                            config, traj_dir)[0],
            out_dir, run_meta(config, model_label), on_start, on_result, broken)
    finally:
        close = getattr(made, "close", None)
        if callable(close):   # an in-process engine made here: its memory goes with it
            close()
