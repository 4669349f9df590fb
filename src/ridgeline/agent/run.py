"""`run_agent`: one episode of any agent (LLM, oracle, null) on one task in one sandbox;
`run_task_episode`: the whole episode of a terminal task (environment, agent, verifier),
as evaluation and RL both run it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ridgeline.agent.config import AgentConfig
from ridgeline.agent.loop import Agent, TaskLike
from ridgeline.agent.scripted import NullAgent, OracleAgent
from ridgeline.agent.trajectory import AgentResult
from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.llm.base import ChatModel
from ridgeline.sandbox.base import Sandbox
from ridgeline.tasks import (Task, TaskSandbox, Verdict, VerdictStatus, prepare_environment,
                             verdict_from_error)
from ridgeline.tasks.steps import run_steps

SCRIPTED_AGENTS = {"oracle": OracleAgent, "null": NullAgent}


class EpisodeRunner(Protocol):
    """Anything that can play one episode: `Agent`, `OracleAgent`, `NullAgent`."""

    name: str

    def run(self, task: TaskLike, sandbox: Sandbox,
            trajectory_path: str | Path | None = None) -> AgentResult: ...


def make_agent(agent: ChatModel | EpisodeRunner | str,
               config: AgentConfig | None = None) -> EpisodeRunner:
    """`"oracle"`/`"null"`, a `ChatModel` (wrapped in `Agent` with `config`), or an agent."""
    if isinstance(agent, str):
        if agent not in SCRIPTED_AGENTS:
            raise ConfigError(f"unknown agent {agent!r}",
                              hint=f"use one of {', '.join(SCRIPTED_AGENTS)}, or pass a ChatModel")
        return SCRIPTED_AGENTS[agent]()
    # Duck-typed, not isinstance(ChatModel): a runtime protocol check reads every
    # attribute, and a client's `context_window` may ask its server.
    if callable(getattr(agent, "chat", None)):
        return Agent(agent, config)  # type: ignore[arg-type]
    if callable(getattr(agent, "run", None)):
        return agent
    raise ConfigError(f"cannot make an agent of {type(agent).__name__}",
                      hint="pass 'oracle', 'null', a ChatModel or an object with run()")


def run_agent(task: TaskLike, sandbox: Sandbox, agent: ChatModel | EpisodeRunner | str,
              config: AgentConfig | None = None,
              trajectory_path: str | Path | None = None) -> AgentResult:
    return make_agent(agent, config).run(task, sandbox, trajectory_path)


@dataclass
class TaskEpisode:
    """What one episode of a terminal task produced. `error` is the exception that ended
    it before or outside the agent loop (set-up failure, endpoint down), already turned
    into the verdict (infra_error or unsupported); `agent` is None then."""

    verdict: Verdict
    agent: AgentResult | None
    error: BaseException | None
    seconds: float


def _prior_session(task: Task, view: Task, last: AgentResult | None) -> list | None:
    """The conversation a multi-step task's step continues (`inherit_prior_session`):
    the previous step's, for an LLM agent; None otherwise."""
    step = next((s for s in task.steps if s.name == view.metadata.get("step")), None)
    if step is None or not step.inherit_prior_session or last is None:
        return None
    record = last.trajectory.result
    return list(record.messages) if record is not None and record.messages else None


def run_task_episode(task: Task, agent: ChatModel | EpisodeRunner | str,
                     config: AgentConfig | None = None, *, backend: str = "bwrap",
                     trajectory_path: str | Path | None = None,
                     env: dict[str, Any] | None = None,
                     prepared: TaskSandbox | None = None) -> TaskEpisode:
    """Prepare the task's environment, let the agent act, verify. Never raises for task,
    sandbox or endpoint problems: they become the verdict (never a reward). `prepared`
    is an environment made already (a fork of a prepared one: an RL group's); it is
    closed with the episode."""
    t0 = time.perf_counter()
    result: AgentResult | None = None
    runner = make_agent(agent, config)
    if isinstance(runner, OracleAgent) and not all(v.has_solution for v in task.step_views()):
        # nothing to play: the task cannot be graded with the oracle (never a failure)
        if prepared is not None:
            prepared.close()
        verdict = Verdict(VerdictStatus.UNSUPPORTED, reason="unsupported",
                          detail="the task has no oracle solution to run")
        return TaskEpisode(verdict, None, None, time.perf_counter() - t0)
    try:
        with prepared if prepared is not None else \
                prepare_environment(task, backend=backend, env=env) as sb:

            def act(view: Task, box) -> None:   # a multi-step task: one run per step
                nonlocal result
                path = trajectory_path
                if task.steps and path is not None:
                    path = Path(path).with_name(f"{Path(path).stem}.{view.metadata['step']}"
                                                f"{Path(path).suffix}")
                prior = (_prior_session(task, view, result) if isinstance(runner, Agent)
                         else None)
                result = (runner.run(view, box, path, prior=prior) if prior is not None
                          else runner.run(view, box, path))

            verdict = run_steps(task, sb, act)
        error = None
    except (RidgelineError, OSError) as e:  # unsupported task, set-up, sandbox, endpoint
        verdict, error = verdict_from_error(e, time.perf_counter() - t0), e
    return TaskEpisode(verdict, result, error, time.perf_counter() - t0)
