"""`run_agent`: one episode of any agent (LLM, oracle, null) on one task in one sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ridgeline.agent.config import AgentConfig
from ridgeline.agent.loop import Agent, TaskLike
from ridgeline.agent.scripted import NullAgent, OracleAgent
from ridgeline.agent.trajectory import AgentResult
from ridgeline.errors import ConfigError
from ridgeline.llm.base import ChatModel
from ridgeline.sandbox.base import Sandbox

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
