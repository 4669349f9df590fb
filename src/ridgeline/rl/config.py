"""A training run's config: `ridgeline train --config FILE` loads a `TrainConfig`.

    config = load_train_config("train.yaml")

Its sections: the policy, the tasks (training and held-out), the trainer, the loop (with
its filters and conflict monitor), the domain scheduler, the rollouts, the engine the
rollouts sample from (in-process, servers at `engine.url`, or Ray actors with `ray`)
and the run's own steps, checkpoints and evaluations.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from ridgeline.config import load_config
from ridgeline.engine.config import EngineConfig
from ridgeline.rl.loop import LoopConfig
from ridgeline.rl.policy import PolicyConfig
from ridgeline.rl.scheduler import SchedulerConfig
from ridgeline.rl.sharded import DistributedConfig
from ridgeline.rl.trainer import TrainerConfig

#: The `EngineConfig` fields `engine:` sets for an in-process engine.
ENGINE_FIELDS = ("max_num_seqs", "max_model_len", "num_kv_blocks")


def _engine_field(name: str) -> FieldInfo:
    """`EngineConfig`'s field `name`, so its default and bounds have one definition."""
    return copy.copy(EngineConfig.model_fields[name])


class FamilySelection(BaseModel):
    """Tasks generated from built-in task families (`ridgeline tasks families`): the
    instances of seeds `seed` .. `seed + instances - 1` of each family named, or of every
    family of `split`; each quality-checked when generated, failures left out."""

    model_config = ConfigDict(extra="forbid")

    split: Literal["train", "heldout"] | None = Field(None, description="every family of "
                                                      "this split (with names: a check)")
    names: list[str] = Field(default_factory=list, description="families by name")
    instances: int = Field(8, ge=1, description="instances per family")
    seed: int = Field(0, ge=0, description="the first instance's seed")

    @model_validator(mode="after")
    def _some(self) -> "FamilySelection":
        if not self.names and self.split is None:
            raise ValueError("name the families (names) or a split ('train' or 'heldout')")
        return self


class TaskSelection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field("builtin", description="'builtin', a task or suite dir, or 'shift' "
                        "(the token-level digit family, for quick experiments)")
    families: FamilySelection | None = Field(None, description="train on generated family "
                                             "instances (instead of source and ids)")
    eval_families: FamilySelection | None = Field(None, description="held-out tasks generated "
                                                  "from families (instead of eval_ids)")
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
    each step's weights are pushed to it (`POST /v1/weights`). The in-process engine's
    sizing fields are `EngineConfig`'s own (type, bounds and default)."""

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
    max_num_seqs: int = _engine_field("max_num_seqs")
    max_model_len: int | None = _engine_field("max_model_len")
    num_kv_blocks: int | None = _engine_field("num_kv_blocks")

    def engine_kwargs(self) -> dict[str, int]:
        """The `EngineConfig` fields an in-process engine (`LLM`) is built with; unset
        ones (None) are left to the engine."""
        return self.model_dump(include=set(ENGINE_FIELDS), exclude_none=True)


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
    distributed: DistributedConfig = Field(default_factory=DistributedConfig,
                                           description="the trainer over N processes "
                                           "(FSDP2; `--nproc` sets nproc)")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig,
                                       description="domains, shares, caps and curriculum "
                                       "of terminal tasks")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    plots: bool = True

    @model_validator(mode="after")
    def _one_trainer_kind(self) -> "TrainConfig":
        if self.distributed.nproc > 1 and self.ray.enabled:
            raise ValueError("distributed.nproc > 1 and ray.enabled: the sharded trainer "
                             "runs in the ranks `ridgeline train --nproc` starts, not in "
                             "a Ray actor; set one of them")
        if self.distributed.nproc > 1 and self.loop.conflicts.every:
            raise ValueError("loop.conflicts measures per-domain gradients, which the "
                             "sharded trainer (distributed.nproc > 1) does not compute "
                             "yet; set loop.conflicts.every: 0")
        return self

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
