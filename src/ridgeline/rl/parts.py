"""What a training run is built from, typed: its tasks (`RunTasks`) and the parts it
trains with (`RunParts`).

    tasks = select_tasks(config)       # before the model: a bad selection fails in seconds
    parts = local_parts(config)        # or remote_parts (engine.url), distributed.ray_parts

`RunParts` is the same whichever way it was built: the in-process engine on the policy's
model directory (`local_parts`), `ridgeline serve` at `engine.url` (`remote_parts`), or
Ray actors (`distributed.ray_parts`). `make_trainer` and `make_rollout` are also what the
Ray trainer actor and each rollout worker build, so every way plays identical episodes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ridgeline.errors import ConfigError
from ridgeline.llm.base import Sampling
from ridgeline.rl.config import FamilySelection, RolloutSettings, TaskSelection, TrainConfig
from ridgeline.rl.policy import Policy, load_policy
from ridgeline.rl.protocols import (
    CheckpointPolicy, GroupRollout, MetricsSource, ResumableTrainer, RLTask, TaskSource,
    TokenGenerator, Tokenizer, WeightsSink,
)
from ridgeline.rl.rollouts import SandboxVerifier, TokenTaskRollout
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.scheduler import DomainScheduler
from ridgeline.rl.trainer import PolicyTrainer

if TYPE_CHECKING:
    from ridgeline.agent import AgentConfig
    from ridgeline.engine import LLM
    from ridgeline.llm.router import WeightFanout
    from ridgeline.tasks import Task

log = logging.getLogger(__name__)

SinkT = TypeVar("SinkT", bound=WeightsSink)


@dataclass
class RunTasks:
    """The run's tasks: the source the loop draws training tasks from, the held-out
    tasks, and the training tasks the quality check left out (id -> why)."""

    source: TaskSource[RLTask]      # token tasks (`shift`) or terminal tasks
    held_out: list[Task] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)


@dataclass
class RunParts:
    """What the loop and the checkpoints train with, however it was built."""

    policy: CheckpointPolicy
    trainer: ResumableTrainer
    # of the tasks in `RunTasks.source`: which kind only the config says, hence Any
    rollout: GroupRollout[Any]
    weights: WeightsSink
    load: list[MetricsSource] = field(default_factory=list)    # per replica / per worker
    closers: list[Callable[[], None]] = field(default_factory=list)   # in order

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for source in self.load:
            out.update(source.metrics())
        return out

    def close(self) -> None:
        for close in self.closers:
            close()


# ---- tasks --------------------------------------------------------------------------------


def select_tasks(cfg: TrainConfig) -> RunTasks:
    """The token family, or the terminal tasks of the selection (quality-checked), the
    held-out ones apart; the task source over the training tasks. Family instances are
    generated under `out/tasks/` (and checked as they are generated)."""
    sel = cfg.tasks
    if sel.source == "shift":
        if cfg.engine.url:
            raise ConfigError("the token family 'shift' runs on the in-process engine only",
                              hint="remove engine.url, or train on terminal tasks")
        return RunTasks(make_sampler(cfg, None))
    # the suite both splits pick from, loaded once (None: both are generated)
    suite = _terminal_tasks(sel) if sel.families is None or (
        sel.eval_families is None and sel.eval_ids) else None
    tasks, excluded = training_tasks(sel, cfg.out, cfg.rollout.backend, suite)
    if sel.eval_families is not None:
        held_out, eval_excluded = family_tasks(sel.eval_families, cfg.out / "tasks" / "heldout",
                                               cfg.rollout.backend)
        for tid, why in eval_excluded.items():
            log.warning("held-out task %s left out: %s", tid, why)
    else:
        held_out = _pick(suite, sel.eval_ids, sel.source) if suite is not None else []
    overlap = {t.id for t in tasks} & {t.id for t in held_out}
    if overlap:
        raise ConfigError(f"tasks both trained on and held out: {', '.join(sorted(overlap))}",
                          hint="a held-out task must not be in the training split")
    return RunTasks(make_sampler(cfg, tasks), held_out, excluded)


def training_tasks(sel: TaskSelection, out: Path, backend: str,
                   suite: dict[str, Task] | None = None) -> tuple[list[Task], dict[str, str]]:
    """The selection's training tasks that passed their quality check (generated family
    instances under `out/tasks/train`, or tasks of `source`), and those left out -> why.
    `ConfigError` when none is left."""
    if sel.families is not None:
        tasks, excluded = family_tasks(sel.families, out / "tasks" / "train", backend)
    else:
        suite = suite if suite is not None else _terminal_tasks(sel)
        tasks = _pick(suite, sel.ids, sel.source) if sel.ids else list(suite.values())
        excluded = {}
        if sel.check:
            tasks, excluded = quality_checked(tasks, backend, sel.check_runs)
    for tid, why in excluded.items():
        log.warning("task %s left out: %s", tid, why)
    if not tasks:
        raise ConfigError("every training task failed its quality check: "
                          + "; ".join(f"{k}: {v}" for k, v in list(excluded.items())[:3]),
                          hint="`ridgeline tasks check` shows why; fix or pick other tasks")
    return tasks, excluded


def family_tasks(sel: FamilySelection, root: Path, backend: str
                 ) -> tuple[list[Task], dict[str, str]]:
    """The instances `sel` names, generated under `root` and quality-checked (oracle
    passes, untouched workspace fails); those that fail: id -> why."""
    from ridgeline.tasks.families import families, generate, get_family
    from ridgeline.tasks.loader import load_task

    fams = [get_family(n) for n in sel.names] if sel.names else families(sel.split)
    wrong = [f.name for f in fams if sel.split is not None and f.split != sel.split]
    if wrong:
        raise ConfigError(f"families not of the {sel.split} split: {', '.join(wrong)}",
                          hint="`ridgeline tasks families` shows each family's split")
    gen = generate(fams, range(sel.seed, sel.seed + sel.instances), root, backend=backend,
                   concurrency=2)
    excluded = {name: "; ".join(reasons)[:300] for name, reasons in gen.excluded.items()}
    return [load_task(d) for d in gen.tasks], excluded


def _terminal_tasks(sel: TaskSelection) -> dict[str, Task]:
    """The suite the selection names, by id."""
    from ridgeline.tasks import load_tasks
    from ridgeline.tasks.loader import builtin_suite_dir

    root = str(builtin_suite_dir()) if sel.source == "builtin" else sel.source
    return {t.id: t for t in load_tasks(root)}


def _pick(suite: dict[str, Task], ids: list[str], source: str) -> list[Task]:
    missing = [i for i in ids if i not in suite]
    if missing:
        raise ConfigError(f"tasks not found in {source}: {', '.join(missing)}",
                          hint="`ridgeline tasks list` shows the ids")
    return [suite[i] for i in ids]


def quality_checked(tasks: list[Task], backend: str, runs: int = 2
                    ) -> tuple[list[Task], dict[str, str]]:
    """The tasks whose quality check (cached with at least `runs` oracle runs, or run
    now) passed: the oracle passes every run and the untouched environment fails. The
    others (flaky ones among them): id -> reason."""
    from ridgeline.tasks.checks import cached_check, check_tasks

    results = {t.id: c for t in tasks if (c := cached_check(t)) is not None
               and (len(c.oracle) >= runs or not c.ok)}
    unchecked = [t for t in tasks if t.id not in results]
    for c in check_tasks(unchecked, runs=runs, backend=backend, concurrency=2):
        results[c.task_id] = c
    kept = [t for t in tasks if results[t.id].ok]
    excluded = {t.id: "; ".join(results[t.id].reasons)[:300] or "quality check failed"
                for t in tasks if not results[t.id].ok}
    return kept, excluded


def make_sampler(cfg: TrainConfig, tasks: list[Task] | None) -> TaskSource[RLTask]:
    """The task order: the token family's, or the domain scheduler (a shuffled order
    with `scheduler.enabled: false`) over the terminal tasks."""
    if tasks is None:
        from ridgeline.rl.digits import shift_tasks

        return TaskSampler(shift_tasks(cfg.seed), cfg.seed)
    if cfg.scheduler.enabled:
        return DomainScheduler(tasks, cfg.scheduler, slots=cfg.loop.rollout_threads,
                               group_size=cfg.loop.group_size, seed=cfg.seed)
    return TaskSampler(tasks, cfg.seed)


# ---- what the trainer and each rollout worker build ------------------------------------------


def make_trainer(cfg: TrainConfig, policy: Policy) -> PolicyTrainer:
    """The policy's trainer: sharded over the ranks when this process is one of them
    (`ridgeline train --nproc N`, `sharded.launch`), else one process's."""
    from ridgeline.rl import sharded

    # the trainer's logprobs are of the distribution the rollouts sample from
    config = cfg.trainer.model_copy(update={"temperature": cfg.rollout.temperature})
    env = sharded.current()
    if env is not None:
        return sharded.ShardedTrainer(policy, config, env=env)
    return PolicyTrainer(policy, config)


def rollout_agent_config(r: RolloutSettings) -> AgentConfig:
    """The agent's config in rollouts, and in SFT's oracle episodes: the prompts are the
    same, so SFT trains on the token format RL samples."""
    from ridgeline.agent import AgentConfig
    from ridgeline.rl.agent_rollout import rl_agent_config

    return rl_agent_config(AgentConfig(step_limit=r.step_limit))


def make_rollout(cfg: TrainConfig, llm: LLM | None, generator: TokenGenerator | None,
                 tokenizer: Tokenizer | None
                 ) -> tuple[GroupRollout[Any], SandboxVerifier | None]:
    """(group rollout, verifier to close or None): single-turn token tasks scored in a
    sandbox on `llm` for the token family, else the agent on terminal tasks talking to
    `generator` (token ids through `tokenizer`). Also what each Ray worker builds."""
    r = cfg.rollout
    if cfg.tasks.source == "shift":
        from ridgeline.rl.digits import DIGITS, SHIFT_VERIFIER

        assert llm is not None, "the token family runs on the in-process engine"
        verifier = SandboxVerifier(SHIFT_VERIFIER)
        return TokenTaskRollout(llm, verifier, max_tokens=DIGITS,
                                temperature=r.temperature), verifier
    from ridgeline.rl.agent_rollout import AgentRollout

    if tokenizer is None or generator is None:
        raise ConfigError(f"model {cfg.policy.model!r} has no tokenizer, so the agent "
                          "cannot talk to it", hint="use a model directory with tokenizer files")
    return AgentRollout(
        generator, tokenizer, rollout_agent_config(r),
        Sampling(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                 logprobs_mode="tempered"),
        backend=r.backend), None


# ---- the parts, built one of two ways here (Ray: distributed.ray_parts) ---------------------


def local_parts(cfg: TrainConfig) -> RunParts:
    """The policy and its trainer, and the engine in this process on the policy's model
    directory (`engine.replicas` of it, requests routed between them)."""
    from ridgeline.engine import LLM
    from ridgeline.llm.engine_client import EngineClient

    policy = load_policy(cfg.policy)
    trainer = make_trainer(cfg, policy)
    llms = [LLM(str(policy.model_dir), **cfg.engine.engine_kwargs())
            for _ in range(cfg.engine.replicas)]
    tokenizer = llms[0].tokenizer
    # the agent's model (terminal tasks; a model without a tokenizer has none)
    generator = _routed([EngineClient(llm) for llm in llms]) if tokenizer is not None else None
    rollout, verifier = make_rollout(cfg, llms[0], generator, tokenizer)
    closers = [verifier.close] if verifier is not None else []
    return RunParts(policy, trainer, rollout, _fanout([llm.worker for llm in llms]),
                    _load_metrics(generator), closers + [llm.worker.stop for llm in llms])


def remote_parts(cfg: TrainConfig) -> RunParts:
    """`ridgeline serve` at `engine.url`: checked to serve this policy's model and to
    take weight updates, then given the policy's weights as version 0 (a server left
    with another run's weights would otherwise sample from them)."""
    from ridgeline.llm.openai_client import OpenAIClient
    from ridgeline.llm.remote_weights import RemoteWeights

    policy = load_policy(cfg.policy)
    trainer = make_trainer(cfg, policy)
    e = cfg.engine
    assert e.url is not None
    urls = [e.url] if isinstance(e.url, str) else list(e.url)
    key = e.api_key or os.environ.get("RIDGELINE_API_KEY") or None
    clients, targets = [], []
    full = policy.full_weights()          # with LoRA, the base too
    for url in urls:
        client = OpenAIClient(url, model=e.served_model, api_key=key,
                              context_window=e.max_model_len)
        name = client.model  # asks the server: an unreachable one fails here
        target = RemoteWeights(url, name, api_key=key)
        target.check_compatible(full)
        clients.append(client)
        targets.append(target)
    tokenizer = _local_tokenizer(policy.model_dir)
    generator = _routed(clients)
    weights = _fanout(targets)
    t0 = time.perf_counter()
    weights.update_weights(full, version=trainer.version)
    log.info("weights of %s pushed to %d server(s) as version %d in %.1f s",
             cfg.policy.model, len(urls), trainer.version, time.perf_counter() - t0)
    rollout, _ = make_rollout(cfg, None, generator, tokenizer)
    return RunParts(policy, trainer, rollout, weights, _load_metrics(generator),
                    [weights.close])


def _routed(generators: list[TokenGenerator]) -> TokenGenerator:
    from ridgeline.llm.router import ReplicaRouter

    return generators[0] if len(generators) == 1 else ReplicaRouter(generators)


def _fanout(targets: list[SinkT]) -> SinkT | WeightFanout:
    from ridgeline.llm.router import WeightFanout

    return targets[0] if len(targets) == 1 else WeightFanout(targets)


def _load_metrics(generator: TokenGenerator | None) -> list[MetricsSource]:
    """The generator's per-replica load, when it routes between replicas."""
    return [generator] if isinstance(generator, MetricsSource) else []


def _local_tokenizer(model_dir: Path | None) -> Tokenizer | None:
    """The tokenizer of the policy's model directory (rollouts on a server still encode
    turns here, so every id is the trainer's), or None when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError):
        return None
