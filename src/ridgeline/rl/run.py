"""A training run: `ridgeline train --config FILE [--resume]`.

    config = load_train_config("train.yaml")
    result = train(config)                  # or train(config, resume=True)

Builds the policy (`load_policy`: the engine's own weights), the in-process engine on
the same Hugging Face directory, the tasks (terminal tasks played by the agent in task
sandboxes, or the token family `shift` for quick experiments), the rollout, the
asynchronous loop and the run directory (`run_log`), then trains. After every step the
metrics line is written (fsynced), then every `checkpoint_every` steps a checkpoint;
`--resume` restores the newest one (weights, optimizer, buffer, task order, RNG),
drops the metrics of later steps and goes on with the step after it.

Problems that would otherwise surface mid-run are checked at the start: a missing model,
a task selection that is empty or where every task fails its quality check (the oracle
must pass and the null agent fail), a checkpoint of another model, a sandbox backend that
cannot start.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ridgeline.config import load_config
from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.llm.base import Sampling
from ridgeline.rl import checkpoint
from ridgeline.rl.loop import AsyncRLLoop, LoopConfig
from ridgeline.rl.policy import PolicyConfig, load_policy
from ridgeline.rl.rollouts import TokenTaskRollout, passed
from ridgeline.rl.run_log import RunLog
from ridgeline.rl.run_plots import plot_run
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.scheduler import DomainScheduler, SchedulerConfig
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig

log = logging.getLogger(__name__)


class TaskSelection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field("builtin", description="'builtin', a task or suite dir, or 'shift' "
                        "(the token-level digit family, for quick experiments)")
    ids: list[str] = Field(default_factory=list, description="training tasks (empty: all)")
    eval_ids: list[str] = Field(default_factory=list, description="held-out tasks, "
                                "evaluated before training, every `eval_every` steps and at the end")
    check: bool = Field(True, description="run each training task's quality check first "
                        "(oracle passes, null agent fails) and leave out those that fail")
    check_runs: int = Field(2, ge=1, description="oracle runs per task in the check: a task "
                            "whose verdicts differ between runs is flaky and left out")


class EngineSettings(BaseModel):
    """The in-process engine, or with `url` a `ridgeline serve --enable-weight-updates`
    serving the policy's model: rollouts go there over HTTP (token ids in and out) and
    each step's weights are pushed to it (`POST /v1/weights`)."""

    model_config = ConfigDict(extra="forbid")

    url: str | list[str] | None = Field(None, description="the base URL of a ridgeline "
                                        "serve (e.g. http://127.0.0.1:8000/v1), or a list of "
                                        "them (replicas); empty: in-process")
    replicas: int = Field(1, ge=1, description="in-process engine replicas (each holds the "
                          "weights and its own KV cache); requests are routed by load and "
                          "prefix affinity")
    served_model: str | None = Field(None, description="the model's name on that server "
                                     "(default: the first it lists)")
    api_key: str | None = Field(None, description="the server's API key (default: "
                                "$RIDGELINE_API_KEY)")
    max_num_seqs: int = Field(32, ge=1)
    max_model_len: int | None = Field(None, ge=64)
    num_kv_blocks: int | None = Field(None, ge=16)


class RolloutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, gt=0, description="the trainer computes logprobs at the "
                               "same temperature (the behaviour policy)")
    top_p: float = Field(1.0, description="always 1 for training (see `_whole_distribution`)")
    max_tokens: int = Field(256, ge=1, description="per model reply")
    step_limit: int = Field(6, ge=1, description="agent replies per episode")
    backend: str = Field("bwrap", description="sandbox backend")

    @field_validator("top_p")
    @classmethod
    def _whole_distribution(cls, v: float) -> float:
        if v != 1:
            raise ValueError(f"must be 1 for training, got {v:g}: the trainer cannot "
                             f"reproduce a nucleus filter's renormalisation, so the "
                             f"behaviour logprobs would be of another distribution "
                             f"(top_p is for evaluation and serving)")
        return v


class RaySettings(BaseModel):
    """Rollout workers and the trainer as Ray actors (`pip install ray`); off: one process."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    address: str | None = Field(None, description="a running cluster ('auto', or "
                                "ray://host:10001); empty: start a local one")
    rollout_workers: int = Field(2, ge=1, description="actors, each with an engine replica")
    worker_cpus: float = Field(1.0, ge=0, description="CPUs each rollout worker reserves")
    worker_gpus: float = Field(0.0, ge=0, description="GPUs each rollout worker reserves")
    trainer_cpus: float = Field(1.0, ge=0)
    trainer_gpus: float = Field(0.0, ge=0)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    tasks: TaskSelection = Field(default_factory=TaskSelection)
    steps: int = Field(20, ge=1)
    time_limit_s: float | None = Field(None, gt=0, description="stop after the step that "
                                       "passes this much training time (then the final eval)")
    seed: int = 0
    out: Path = Path("runs/train")
    checkpoint_every: int = Field(1, ge=1)
    eval_every: int = Field(0, ge=0, description="0: only before and after training")
    eval_samples: int = Field(2, ge=1)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    ray: RaySettings = Field(default_factory=RaySettings)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig,
                                       description="domains, shares, caps and curriculum "
                                       "of terminal tasks")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    plots: bool = True

    @model_validator(mode="after")
    def _one_temperature(self) -> "TrainConfig":
        # the trainer's logprobs must be of the distribution the rollouts sampled from:
        # rollout.temperature is that one; trainer.temperature may only repeat it
        if "temperature" in self.trainer.model_fields_set and \
                self.trainer.temperature != self.rollout.temperature:
            raise ValueError(
                f"trainer.temperature ({self.trainer.temperature:g}) differs from "
                f"rollout.temperature ({self.rollout.temperature:g}): the trainer computes "
                f"logprobs at the temperature the rollouts sample with; set only "
                f"rollout.temperature")
        return self


def load_train_config(path: str | Path) -> TrainConfig:
    return load_config(TrainConfig, path)


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    history: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)


# ---- tasks --------------------------------------------------------------------------------


def _terminal_tasks(sel: TaskSelection) -> dict[str, Any]:
    """The suite the selection names, by id (loaded once for both splits)."""
    from ridgeline.tasks import load_tasks
    from ridgeline.tasks.loader import builtin_suite_dir

    root = str(builtin_suite_dir()) if sel.source == "builtin" else sel.source
    return {t.id: t for t in load_tasks(root)}


def _pick(suite: dict[str, Any], ids: list[str], source: str) -> list[Any]:
    missing = [i for i in ids if i not in suite]
    if missing:
        raise ConfigError(f"tasks not found in {source}: {', '.join(missing)}",
                          hint="`ridgeline tasks list` shows the ids")
    return [suite[i] for i in ids]


def quality_checked(tasks: list[Any], backend: str, runs: int = 2
                    ) -> tuple[list[Any], dict[str, str]]:
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


# ---- the run ------------------------------------------------------------------------------


class _Run:
    """Everything one training run holds, built from the config."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = cfg = config
        self.excluded: dict[str, str] = {}
        self.verifier = None
        self.eval_tasks: list[Any] = []
        probe_sandbox(cfg.rollout.backend)
        # tasks before the model: a bad selection fails in seconds, not after a load
        tasks = None if cfg.tasks.source == "shift" else self._select_tasks()
        if tasks is None and cfg.engine.url:
            raise ConfigError("the token family 'shift' runs on the in-process engine only",
                              hint="remove engine.url, or train on terminal tasks")
        self.llm: Any = None
        self.cluster: Any = None
        self.generator: Any = None
        self.sampler = make_sampler(cfg, tasks)
        if cfg.ray.enabled:
            self._ray_cluster()
            return
        self.policy = load_policy(cfg.policy)
        self.identity = self.policy.identity
        self.trainer = make_trainer(cfg, self.policy)
        if cfg.engine.url:
            self._remote_engine()
        else:
            self._local_engine()
        self.rollout, self.verifier = make_rollout(cfg, self.llm, self.generator,
                                                   self.tokenizer)

    def _ray_cluster(self) -> None:
        """Rollout workers (each with its engine replica) and the trainer as Ray actors;
        weights go from the trainer to the workers through the object store."""
        from ridgeline.rl.distributed import RayRun

        cfg = self.config
        if cfg.engine.url:
            raise ConfigError("ray.enabled and engine.url both set",
                              hint="with Ray, each rollout worker runs its own engine replica")
        self.cluster = RayRun(cfg)
        self.policy = self.cluster.policy
        self.identity = self.cluster.policy.identity
        self.trainer = self.cluster.trainer
        self.rollout = self.cluster.rollout
        self.weights = self.cluster.weights

    def _local_engine(self) -> None:
        """The engine in this process, on the policy's model directory."""
        from ridgeline.engine import LLM
        from ridgeline.llm.engine_client import EngineClient

        e = self.config.engine
        self.llms = [LLM(str(self.policy.model_dir), **engine_kwargs(e))
                     for _ in range(e.replicas)]
        self.llm = self.llms[0]                   # the token family's engine
        self.tokenizer = self.llm.tokenizer
        # the agent's model (terminal tasks; a model without a tokenizer has none)
        if self.tokenizer is not None:
            self.generator = _routed([EngineClient(llm) for llm in self.llms])
        # where each step's weights go
        self.weights: Any = _fanout([llm.worker for llm in self.llms])

    def _remote_engine(self) -> None:
        """`ridgeline serve` at `engine.url`: checked to serve this policy's model and to
        take weight updates, then given the policy's weights as version 0 (a server left
        with another run's weights would otherwise sample from them)."""
        import os

        from ridgeline.llm.openai_client import OpenAIClient
        from ridgeline.llm.remote_weights import RemoteWeights

        e = self.config.engine
        assert e.url is not None
        urls = [e.url] if isinstance(e.url, str) else list(e.url)
        key = e.api_key or os.environ.get("RIDGELINE_API_KEY") or None
        clients, targets = [], []
        full = self.policy.full_weights()          # with LoRA, the base too
        for url in urls:
            client = OpenAIClient(url, model=e.served_model, api_key=key,
                                  context_window=e.max_model_len)
            name = client.model  # asks the server: an unreachable one fails here
            target = RemoteWeights(url, name, api_key=key)
            target.check_compatible(full)
            clients.append(client)
            targets.append(target)
        self.tokenizer = _local_tokenizer(self.policy.model_dir)
        self.generator = _routed(clients)
        self.weights = _fanout(targets)
        t0 = time.perf_counter()
        self.weights.update_weights(full, version=self.trainer.version)
        log.info("weights of %s pushed to %d server(s) as version %d in %.1f s",
                 self.config.policy.model, len(urls), self.trainer.version,
                 time.perf_counter() - t0)

    def _select_tasks(self) -> list[Any]:
        cfg = self.config
        suite = _terminal_tasks(cfg.tasks)
        tasks = _pick(suite, cfg.tasks.ids, cfg.tasks.source) if cfg.tasks.ids \
            else list(suite.values())
        if cfg.tasks.check:
            tasks, self.excluded = quality_checked(tasks, cfg.rollout.backend,
                                                   cfg.tasks.check_runs)
            for tid, why in self.excluded.items():
                log.warning("task %s left out: %s", tid, why)
            if not tasks:
                raise ConfigError("every training task failed its quality check: "
                                  + "; ".join(f"{k}: {v}" for k, v in
                                              list(self.excluded.items())[:3]),
                                  hint="`ridgeline tasks check` shows why; fix or pick other tasks")
        self.eval_tasks = _pick(suite, cfg.tasks.eval_ids, cfg.tasks.source)
        overlap = {t.id for t in tasks} & {t.id for t in self.eval_tasks}
        if overlap:
            raise ConfigError(f"tasks both trained on and held out: {', '.join(sorted(overlap))}",
                              hint="a held-out task must not be in the training split")
        return tasks

    def evaluate(self, step: int) -> dict[str, Any]:
        """The held-out tasks, `eval_samples` episodes each, with the rollout's sampling."""
        from ridgeline.rl.sampler import episode_seed

        cfg = self.config
        t0 = time.perf_counter()
        jobs = [(i, t, j) for i, t in enumerate(self.eval_tasks)
                for j in range(cfg.eval_samples)]
        with ThreadPoolExecutor(min(len(jobs), cfg.engine.max_num_seqs) or 1) as ex:
            # seeds apart from training's (negative draws), the same at every eval
            records = list(ex.map(lambda job: self.rollout.episode(
                job[1], episode_seed(cfg.seed + 1, -1 - job[0], job[2]), job[2])[0], jobs))
        per_task: dict[str, list[bool]] = {}
        for (_, task, _), rec in zip(jobs, records):
            per_task.setdefault(task.id, []).append(passed(rec))
        graded = [rec for rec in records if rec.reward is not None]
        why = Counter(f"{r.verdict}:{r.detail}" for r in records if r.reward is None)
        return {"step": step, "version": self.trainer.version,
                "pass_rate": sum(passed(r) for r in graded) / len(graded) if graded else None,
                "episodes": len(records), "ungraded": len(records) - len(graded),
                "ungraded_reasons": dict(why),
                "per_task": {k: sum(v) / len(v) for k, v in per_task.items()},
                "seconds": round(time.perf_counter() - t0, 1)}

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()
        if self.cluster is not None:
            self.cluster.close()
        elif self.llm is not None:
            for llm in self.llms:
                llm.worker.stop()
        else:
            self.weights.close()


def make_trainer(cfg: TrainConfig, policy: Any) -> PolicyTrainer:
    # the trainer's logprobs are of the distribution the rollouts sample from
    return PolicyTrainer(policy, cfg.trainer.model_copy(
        update={"temperature": cfg.rollout.temperature}))


def make_sampler(cfg: TrainConfig, tasks: list[Any] | None) -> Any:
    """The task order: the token family's, or the domain scheduler (a shuffled order
    with `scheduler.enabled: false`) over the terminal tasks."""
    if tasks is None:
        from ridgeline.rl.digits import shift_tasks

        return TaskSampler(shift_tasks(cfg.seed), cfg.seed)
    if cfg.scheduler.enabled:
        return DomainScheduler(tasks, cfg.scheduler, slots=cfg.loop.rollout_threads,
                               group_size=cfg.loop.group_size, seed=cfg.seed)
    return TaskSampler(tasks, cfg.seed)


def make_rollout(cfg: TrainConfig, llm: Any, generator: Any, tokenizer: Any
                 ) -> tuple[Any, Any]:
    """(group rollout, verifier to close or None): single-turn token tasks scored in a
    sandbox on `llm` for the token family, else the agent on terminal tasks talking to
    `generator` (token ids through `tokenizer`). Also what each Ray worker builds."""
    r = cfg.rollout
    if cfg.tasks.source == "shift":
        from ridgeline.rl.digits import DIGITS, SHIFT_VERIFIER
        from ridgeline.rl.rollouts import SandboxVerifier

        verifier = SandboxVerifier(SHIFT_VERIFIER)
        return TokenTaskRollout(llm, verifier, max_tokens=DIGITS,
                                temperature=r.temperature), verifier
    from ridgeline.agent import AgentConfig
    from ridgeline.rl.agent_rollout import AgentRollout

    if tokenizer is None or generator is None:
        raise ConfigError(f"model {cfg.policy.model!r} has no tokenizer, so the agent "
                          "cannot talk to it", hint="use a model directory with tokenizer files")
    return AgentRollout(
        generator, tokenizer, AgentConfig(step_limit=r.step_limit),
        Sampling(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                 logprobs_mode="tempered"),
        backend=r.backend), None


def engine_kwargs(e: EngineSettings) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_num_seqs": e.max_num_seqs}
    if e.max_model_len is not None:
        kwargs["max_model_len"] = e.max_model_len
    if e.num_kv_blocks is not None:
        kwargs["num_kv_blocks"] = e.num_kv_blocks
    return kwargs


def _routed(generators: list[Any]) -> Any:
    from ridgeline.llm.router import ReplicaRouter

    return generators[0] if len(generators) == 1 else ReplicaRouter(generators)


def _fanout(targets: list[Any]) -> Any:
    from ridgeline.llm.router import WeightFanout

    return targets[0] if len(targets) == 1 else WeightFanout(targets)


def _local_tokenizer(model_dir: Any) -> Any:
    """The tokenizer of the policy's model directory (rollouts on a server still encode
    turns here, so every id is the trainer's), or None when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError):
        return None


def probe_sandbox(backend: str) -> None:
    """Start and stop one sandbox of `backend`: a backend that cannot start fails the run
    here, not as every episode's infra error."""
    from ridgeline.sandbox import SandboxSpec, create_sandbox

    try:
        create_sandbox(SandboxSpec(), backend=backend).close()
    except RidgelineError as e:
        raise ConfigError(f"the sandbox backend {backend!r} cannot start a sandbox: {e}",
                          hint="`ridgeline sandbox run -- true` shows the problem; or set "
                               "rollout.backend") from None


def write_report(run_dir: Path, run: _Run, loop: AsyncRLLoop) -> None:
    """report.json: the tasks left out and why (quality check, flaky oracle), each
    domain's share of rollouts and its state, and the domain conflicts flagged."""
    report = {"excluded_tasks": run.excluded, "domains": run.sampler.domain_report(),
              "conflicts": loop.conflicts.report(), "rollout_errors": loop.errors[-20:]}
    tmp = run_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(run_dir / "report.json")


def _append_json(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train(config: TrainConfig, *, resume: bool = False,
          on_step: Callable[[int, dict[str, Any]], None] | None = None) -> TrainResult:
    run_dir = config.out
    if not resume and checkpoint.find(run_dir) is not None:
        raise ConfigError(f"{run_dir} already holds a run",
                          hint="pass --resume to continue it, or choose another --out")
    run = _Run(config)
    try:
        return _train(run, run_dir, resume, on_step)
    finally:
        run.close()


def _train(run: _Run, run_dir: Path, resume: bool,
           on_step: Callable[[int, dict[str, Any]], None] | None) -> TrainResult:
    cfg = run.config
    loop = AsyncRLLoop(run.trainer, run.sampler, run.rollout, run.weights, cfg.loop)
    start = 0
    if resume:
        ckpt = checkpoint.load(run_dir, run.identity)
        run.trainer.load_state_dict(ckpt.trainer)
        run.trainer.version -= 1      # sync() makes it the checkpoint's version again
        run.trainer.sync(run.weights)
        loop.buffer.load_state_dict(ckpt.buffer)
        run.sampler.load_state_dict(ckpt.state["sampler"])
        loop.conflicts.load_state_dict(ckpt.state.get("extra", {}).get("conflicts", {}))
        checkpoint.set_rng_state(ckpt.rng)
        start = ckpt.step + 1
        runlog = RunLog(run_dir, resume_step=ckpt.step)
        log.info("resumed %s at step %d (version %d)", run_dir, start, run.trainer.version)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        runlog = RunLog(run_dir)
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
    result = TrainResult(run_dir, start, excluded=run.excluded)
    if run.excluded:
        (run_dir / "excluded_tasks.json").write_text(json.dumps(run.excluded, indent=1))
    def held_out(done: int) -> dict[str, Any]:
        ev = run.evaluate(done)
        _append_json(run_dir / "eval.jsonl", ev)
        result.evals.append(ev)
        return ev

    if run.eval_tasks and start == 0:
        held_out(0)         # the base policy, with the same sampling as every later eval
    started = time.monotonic()

    def step_done(step: int, metrics: dict[str, Any]) -> None:
        done = step + 1
        last = done == cfg.steps or (cfg.time_limit_s is not None
                                     and time.monotonic() - started >= cfg.time_limit_s)
        if run.eval_tasks and (last or (cfg.eval_every and done % cfg.eval_every == 0)):
            ev = held_out(done)
            if ev["pass_rate"] is not None:
                metrics["eval/pass_rate"] = ev["pass_rate"]
        for source in (run.generator, run.cluster):   # per-replica / per-worker load
            if hasattr(source, "metrics"):
                metrics.update(source.metrics())
        runlog.log(step, metrics)  # before the checkpoint: a kill between loses nothing
        if done % cfg.checkpoint_every == 0 or last:
            # the buffer first, then the sampler: a group finishing in between is
            # handed out again on resume, never both restored and redone
            buffer_state = loop.buffer.state_dict()
            ready = [e["group"].index for e in buffer_state["ready"]]
            t0 = time.perf_counter()
            checkpoint.save(run_dir, step, policy=run.policy, trainer=run.trainer,
                            buffer_state=buffer_state,
                            sampler_state=run.sampler.state_dict(ready), identity=run.identity,
                            extra={"conflicts": loop.conflicts.state_dict()})
            log.info("checkpoint of step %d written in %.1f s", step, time.perf_counter() - t0)
        result.steps_done = done
        result.history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
        if last:
            loop.stop()

    try:
        loop.run(cfg.steps, on_step=step_done, start_step=start)
    finally:
        runlog.close()
        write_report(run_dir, run, loop)
        if cfg.plots:
            try:
                plot_run(run_dir)
            except Exception as e:  # noqa: BLE001 - plots are a convenience
                log.warning("could not draw the run's plots: %s", e)
    if loop.errors:
        log.warning("%d rollouts failed; last: %s", len(loop.errors), loop.errors[-1])
    return result

