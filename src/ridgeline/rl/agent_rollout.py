"""Agentic rollouts: the agent on terminal tasks, each episode in its own task sandbox,
recorded token by token for the trainer.

    rollout = AgentRollout(EngineClient(llm), tokenizer, agent_config, sampling)
    group = rollout(task, seeds)          # len(seeds) episodes of one task, in parallel

Each episode is exactly what evaluation runs (`agent.run_task_episode`: the task's
environment, the agent acts, the task's tests grade it); the group's environments are one
prepared environment forked copy-on-write (`TaskSandbox.fork`), so the task's setup runs
once per group; only
the model differs: a `TokenChat` that generates token-in and records every sampled id,
its behaviour logprob and weights version, with observations appended as ids. The
verdict becomes the `EpisodeOutcome` the filters read: an episode whose environment could
not be set up, whose verifier failed or whose sandbox failed its health probe is masked
(reason kept), never scored 0. Episodes of a group run in parallel threads, so the
engine decodes them in one batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ridgeline.agent import AgentConfig
from ridgeline.agent.run import TaskEpisode, run_task_episode
from ridgeline.llm.base import Sampling
from ridgeline.rl.filters import EpisodeOutcome
from ridgeline.rl.protocols import TokenGenerator, Tokenizer
from ridgeline.rl.rollouts import EpisodeGroup
from ridgeline.rl.token_chat import TokenChat
from ridgeline.errors import RidgelineError
from ridgeline.tasks import Task, TaskSandbox, prepare_environment

log = logging.getLogger(__name__)


def rl_agent_config(config: AgentConfig | None = None) -> AgentConfig:
    """The agent config for training: no history condensation (an episode must stay one
    token sequence; condensing would rewrite earlier turns) and no forced tool calls (a
    grammar-masked reply is not trainable: token_chat.GRAMMAR_CONSTRAINED), else as
    given."""
    config = config or AgentConfig()
    return config.model_copy(update={"condense_at_fraction": 1.0, "summary_by_model": False,
                                     "constrained_tool_calls": False})


class AgentRollout:
    """Groups of agent episodes on terminal tasks (an `EpisodeRollout`)."""

    def __init__(self, generator: TokenGenerator, tokenizer: Tokenizer,
                 agent_config: AgentConfig | None = None, sampling: Sampling | None = None, *,
                 backend: str = "bwrap", trajectory_dir: Path | None = None,
                 version: Callable[[], int] | None = None) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.agent_config = rl_agent_config(agent_config)
        self.sampling = sampling or Sampling(temperature=1.0, max_tokens=256)
        self.backend = backend
        self.trajectory_dir = trajectory_dir
        # the current weights version, for servers that do not report one per token
        self.version = version

    def episode(self, task: Task, seed: int, sample: int,
                prepared: TaskSandbox | None = None) -> tuple[EpisodeOutcome, TaskEpisode]:
        chat = TokenChat(self.generator, self.tokenizer,
                         sampling=self.sampling.model_copy(update={"seed": seed}),
                         version=self.version() if callable(self.version) else 0)
        path = None
        if self.trajectory_dir is not None:
            path = self.trajectory_dir / f"{task.id}.{seed}.jsonl"
        ep = run_task_episode(task, chat, self.agent_config, backend=self.backend,
                              trajectory_path=path, prepared=prepared)
        status = ep.agent.result.status if ep.agent is not None else "error"
        if not ep.verdict.status.scored:
            log.warning("episode of %s masked: %s (%s): %s", task.id, ep.verdict.status.value,
                        ep.verdict.reason, (ep.verdict.detail or "")[:500])
        sample_ep, unusable = chat.sample()
        outcome = EpisodeOutcome.from_verdict(ep.verdict, status, sample=sample_ep)
        outcome.unusable = unusable
        return outcome, ep

    def forks(self, task: Task, n: int) -> list[TaskSandbox | None]:
        """The group's environments: one prepared, forked n times (copy-on-write; the
        environment is built once, not n times). Where that cannot be (a task that fails
        to prepare, a backend or task that cannot fork), each episode prepares its own
        and reports its own failure."""
        if n < 2 or self.backend != "bwrap":
            return [None] * n
        try:
            with prepare_environment(task, backend=self.backend) as base:
                return list(base.fork(n))
        except (RidgelineError, OSError) as e:
            log.info("group of %s not forked (%s): each episode prepares its own", task.id, e)
            return [None] * n

    def __call__(self, task: Task, seeds: list[int]) -> EpisodeGroup:
        t0 = time.perf_counter()
        prepared = self.forks(task, len(seeds))
        with ThreadPoolExecutor(len(seeds), thread_name_prefix="ridgeline-episode") as ex:
            results = list(ex.map(lambda js: self.episode(task, js[1][0], js[0], js[1][1]),
                                  enumerate(zip(seeds, prepared))))
        group = EpisodeGroup(task, [o for o, _ in results], time.perf_counter() - t0)
        group.tokens = sum(s.num_policy_tokens for s in group.samples if s is not None)
        return group
