"""Supervised fine-tuning on agent episodes: `ridgeline sft --config FILE [--resume]`.

    config = load_sft_config("sft.yaml")
    result = sft(config)                    # or sft(config, resume=True)
    # then RL from it: `policy: {model: <out>}` in the train config

The data is episodes in exactly the token format the agent samples in RL (`sft_data`):
the training tasks' reference solutions played by the agent loop (`oracle`), episode
files written before (`episodes`), and with `rejection_sampling.rounds` the policy's own
passing rollouts, sampled after the oracle epochs from the weights trained so far
(rejection-sampling fine-tuning). The loss is the negative log-likelihood of the policy's
tokens only (`PolicyTrainer.supervised_step`): prompts and observations are context.

It is `ridgeline train`'s machinery with another objective: the same policy loading
(LoRA option), trainer (dtype, micro-batches, clipping), run directory (metrics.jsonl,
TensorBoard, plots), checkpoints (a Hugging Face directory `ridgeline train`, `eval` and
`serve` take) and `--resume`. The episodes trained on are kept in RUN/episodes/*.jsonl
(a resumed run reads them back rather than replaying or resampling).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ridgeline.config import load_config
from ridgeline.errors import ConfigError
from ridgeline.rl import checkpoint
from ridgeline.rl.config import EngineSettings, RolloutSettings, TaskSelection
from ridgeline.rl.policy import Policy, PolicyConfig, load_policy
from ridgeline.rl.run_log import RunLog
from ridgeline.rl.sft_data import (
    ORACLE_REPLIES, OracleStyle, SFTEpisode, oracle_episodes, read_episodes, rejection_sampled,
    write_episodes,
)
from ridgeline.rl.tokens import TokenBatch
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig

__all__ = ["SFTConfig", "SFTResult", "load_sft_config", "sft"]

log = logging.getLogger(__name__)


class RejectionSampling(BaseModel):
    """After the oracle epochs: `rounds` times, sample `samples` episodes per training
    task from the current weights, keep the passing ones, train `epochs` more epochs on
    everything kept so far."""

    model_config = ConfigDict(extra="forbid")

    rounds: int = Field(0, ge=0)
    samples: int = Field(4, ge=1, description="episodes per task and round")
    epochs: int = Field(1, ge=1, description="epochs after each round")


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    tasks: TaskSelection = Field(default_factory=TaskSelection, description="the tasks "
                                 "whose reference solutions become episodes (and that "
                                 "rejection sampling plays)")
    oracle: bool = Field(True, description="train on the tasks' oracle episodes")
    oracle_style: OracleStyle = Field(
        "inspect", description="inspect: look at the named inputs, solve, check the result, "
        "finish (4 replies: rollout.step_limit must allow them); direct: solve, finish")
    episodes: list[Path] = Field(default_factory=list, description="episode files "
                                 "(RUN/episodes/*.jsonl of an earlier run) to train on too")
    rejection_sampling: RejectionSampling = Field(default_factory=RejectionSampling)
    epochs: int = Field(3, ge=1, description="epochs over the oracle and file episodes")
    batch_size: int = Field(8, ge=1, description="episodes per optimizer step")
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig(lr=2e-5))
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="the "
                                     "agent's limits (the prompts are RL's) and rejection "
                                     "sampling's temperature and sandbox backend")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="the "
                                   "in-process engine rejection sampling samples from")
    seed: int = 0
    out: Path = Path("runs/sft")
    checkpoint_every: int = Field(20, ge=1, description="steps between checkpoints "
                                  "(and one at the end)")
    plots: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> "SFTConfig":
        if self.tasks.source == "shift":
            raise ValueError("SFT trains on agent episodes of terminal tasks, not the token "
                             "family 'shift'")
        if self.tasks.eval_ids or self.tasks.eval_families is not None:
            raise ValueError("sft does not evaluate: leave tasks.eval_ids / eval_families "
                             "out and run `ridgeline eval --model RUN_DIR` on held-out tasks")
        if self.trainer.temperature != 1:
            raise ValueError("SFT fits the plain distribution: trainer.temperature must be 1")
        replies = ORACLE_REPLIES[self.oracle_style]
        if self.oracle and self.rollout.step_limit < replies:
            raise ValueError(f"{self.oracle_style} oracle episodes take {replies} replies: "
                             f"raise rollout.step_limit to {replies} or more (it is "
                             f"{self.rollout.step_limit})")
        if not self.oracle and not self.episodes and not self.rejection_sampling.rounds:
            raise ValueError("no data: set oracle, episodes or rejection_sampling.rounds")
        if self.engine.url:
            raise ValueError("rejection sampling runs on the in-process engine; remove "
                             "engine.url")
        return self


def load_sft_config(path: str | Path) -> SFTConfig:
    return load_config(SFTConfig, path)


@dataclass
class SFTResult:
    run_dir: Path
    steps_done: int
    episodes: dict[str, int] = field(default_factory=dict)   # source -> episodes
    excluded: dict[str, str] = field(default_factory=dict)   # task -> why no oracle episode
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class _Phase:
    """A stretch of training on one dataset: the oracle/file episodes, or after round r
    of rejection sampling everything kept so far."""

    index: int
    epochs: int
    episodes: list[SFTEpisode]

    def batches(self, seed: int, batch_size: int) -> Iterator[list[SFTEpisode]]:
        for epoch in range(self.epochs):
            order = list(range(len(self.episodes)))
            random.Random(f"{seed}:{self.index}:{epoch}").shuffle(order)
            for i in range(0, len(order), batch_size):
                yield [self.episodes[j] for j in order[i:i + batch_size]]


def sft(config: SFTConfig, *, resume: bool = False,
        on_step: Callable[[int, dict[str, float]], None] | None = None) -> SFTResult:
    from ridgeline.rl.parts import _local_tokenizer, rollout_agent_config, training_tasks
    from ridgeline.rl.run import probe_sandbox

    run_dir = config.out
    if not resume and checkpoint.find(run_dir) is not None:
        raise ConfigError(f"{run_dir} already holds a run",
                          hint="pass --resume to continue it, or choose another --out")
    probe_sandbox(config.rollout.backend)
    tasks, excluded = training_tasks(config.tasks, run_dir, config.rollout.backend)
    policy = load_policy(config.policy)
    tokenizer = _local_tokenizer(policy.model_dir)
    if tokenizer is None:
        raise ConfigError(f"model {config.policy.model!r} has no tokenizer",
                          hint="SFT episodes are in the agent's token format: use a model "
                               "directory with tokenizer files")
    ckpt = checkpoint.load(run_dir, policy.identity) if resume else None
    trainer = PolicyTrainer(policy, config.trainer)
    if ckpt is not None:
        trainer.load_state_dict(ckpt.trainer)
        checkpoint.set_rng_state(ckpt.rng)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ckpt is None:
        (run_dir / "config.json").write_text(config.model_dump_json(indent=1))
    agent_config = rollout_agent_config(config.rollout)
    context = int(getattr(policy.model.config, "max_position_embeddings", 8192))

    # the first phase's data: oracle episodes (played once, then read back) and files
    data: list[SFTEpisode] = []
    episodes_dir = run_dir / "episodes"
    if config.oracle:
        path = episodes_dir / "oracle.jsonl"
        if path.is_file() and ckpt is not None:
            oracle = read_episodes(path, tokenizer, policy.identity)
        else:
            oracle, why = oracle_episodes(tasks, tokenizer, agent_config, context_window=context,
                                          backend=config.rollout.backend,
                                          style=config.oracle_style)
            excluded.update(why)
            if not oracle:
                raise ConfigError("no task gave a usable oracle episode: " + "; ".join(
                    f"{k}: {v}" for k, v in list(why.items())[:3]),
                    hint="the tasks need shell solutions the agent can type")
            write_episodes(path, oracle, tokenizer, policy.identity)
        data += oracle
    for path in config.episodes:
        data += read_episodes(Path(path), tokenizer, policy.identity)
    if excluded:
        (run_dir / "excluded_tasks.json").write_text(json.dumps(excluded, indent=1))
    result = SFTResult(run_dir, 0, excluded=excluded)

    start = ckpt.step + 1 if ckpt is not None else 0
    runlog = RunLog(run_dir, resume_step=ckpt.step if ckpt is not None else None)
    engine = None
    step = 0
    try:
        phases = [_Phase(0, config.epochs, data)] if data else []
        rs = config.rejection_sampling
        kept: list[SFTEpisode] = []
        for r in range(rs.rounds + 1):
            if r > 0:  # sample from the weights trained so far, keep what passes
                path = episodes_dir / f"rejection-{r}.jsonl"
                if path.is_file() and step <= start:
                    new = read_episodes(path, tokenizer, policy.identity)
                else:
                    if engine is None:
                        engine = _Sampler(config, policy.model_dir, tokenizer, agent_config)
                    engine.sync(trainer)
                    new, played = rejection_sampled(engine.rollout, tasks, rs.samples,
                                                    seed=config.seed * 1000 + r)
                    log.info("rejection sampling round %d: %d of %d episodes kept", r,
                             len(new), played)
                    write_episodes(path, new, tokenizer, policy.identity)
                kept += new
                if not data and not kept:
                    continue
                phases = [_Phase(r, rs.epochs, data + kept)]
            for phase in phases:
                for batch in phase.batches(config.seed, config.batch_size):
                    if step >= start:
                        metrics = _train_step(trainer, batch, tokenizer)
                        metrics.update({"sft/phase": phase.index,
                                        "sft/episodes": len(phase.episodes)})
                        runlog.log(step, metrics)
                        result.history.append(metrics)
                        if (step + 1) % config.checkpoint_every == 0:
                            _save(run_dir, step, config.seed, policy, trainer)
                        if on_step is not None:
                            on_step(step, metrics)
                    step += 1
            phases = []
        if step > start:
            _save(run_dir, step - 1, config.seed, policy, trainer)
        result.steps_done = step
    finally:
        runlog.close()
        if engine is not None:
            engine.close()
        if config.plots:
            _plots(run_dir)
    sources: dict[str, int] = {}
    for ep in data + kept:
        sources[ep.source] = sources.get(ep.source, 0) + 1
    result.episodes = sources
    return result


def _train_step(trainer: PolicyTrainer, batch: list[SFTEpisode],
                tokenizer: object) -> dict[str, float]:
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    tokens = TokenBatch.of([e.tokens for e in batch], [0.0] * len(batch), pad_id=pad)
    return trainer.supervised_step(tokens)


def _save(run_dir: Path, step: int, seed: int, policy: Policy, trainer: PolicyTrainer
          ) -> None:
    from ridgeline.rl.buffer import RolloutBuffer

    empty = RolloutBuffer(batch_groups=1, eta=0).state_dict()   # SFT has no rollouts
    checkpoint.save(run_dir, step, policy=policy, trainer=trainer, buffer_state=empty,
                    # the data order is a function of the seed and the step
                    sampler_state={"kind": "shuffled", "seed": seed, "next": step + 1,
                                   "redo": []},
                    identity=policy.identity)


class _Sampler:
    """The in-process engine and agent rollout rejection sampling plays episodes with."""

    def __init__(self, config: SFTConfig, model_dir: Path | None, tokenizer: object,
                 agent_config: object) -> None:
        from ridgeline.engine import LLM
        from ridgeline.llm.base import Sampling
        from ridgeline.llm.engine_client import EngineClient
        from ridgeline.rl.agent_rollout import AgentRollout

        r = config.rollout
        self.llm = LLM(str(model_dir), **config.engine.engine_kwargs())
        self.rollout = AgentRollout(
            EngineClient(self.llm), tokenizer, agent_config,  # type: ignore[arg-type]
            Sampling(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                     logprobs_mode="tempered"), backend=r.backend)

    def sync(self, trainer: PolicyTrainer) -> None:
        trainer.sync(self.llm.worker)

    def close(self) -> None:
        self.llm.worker.stop()


def _plots(run_dir: Path) -> None:
    try:
        from ridgeline.rl.run_plots import plot_run

        plot_run(run_dir)
    except Exception as e:  # noqa: BLE001 - plots are a convenience
        log.warning("could not draw the run's plots: %s", e)
