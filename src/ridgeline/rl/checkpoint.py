"""Checkpoints of a training run: everything `--resume` needs to go on as if the run had
never stopped.

    RUN_DIR/checkpoint/
      config.json, model.safetensors, tokenizer files   the policy as a Hugging Face dir
                                                       (`ridgeline eval --model RUN_DIR/checkpoint`)
      trainer.pt     trainer state (weights as trained, LoRA adapters included; AdamW
                     moments; version), the rollout buffer (finished groups not yet
                     trained on) and the RNG states
      state.json     step, policy identity, task sampler position (draws handed out but
                     not trained on are handed out again), written last

A sharded trainer (`sharded.ShardedTrainer`, `--nproc N`) writes its model and AdamW state
with `torch.distributed.checkpoint` instead, every rank its shards:

      trainer/       .metadata and one file per rank (read at any world size: by N
                     ranks, or by one process's `PolicyTrainer`, `restore_trainer`)
      trainer.pt     the version and steps taken, the buffer and the RNG states (rank 0)

A checkpoint is written to `checkpoint.tmp` and swapped in by renames, so a run killed at
any moment leaves the previous checkpoint (or `checkpoint.old` during the swap) intact;
`load` picks whichever is complete and deletes a torn `checkpoint.tmp`. A checkpoint of
another model (identity differs) is refused.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeGuard

import numpy as np
import torch

from ridgeline.errors import ConfigError

if TYPE_CHECKING:
    from ridgeline.rl.buffer import BufferState
    from ridgeline.rl.sharded import ShardedTrainer
    from ridgeline.rl.conflicts import ConflictState
    from ridgeline.rl.policy import PolicyIdentity
    from ridgeline.rl.protocols import CheckpointPolicy, ResumableTrainer
    from ridgeline.rl.rollouts import EpisodeGroup
    from ridgeline.rl.sampler import SamplerState
    from ridgeline.rl.trainer import TrainerState

FORMAT = 1
NAME = "checkpoint"


class RunExtra(TypedDict, total=False):
    """More run state in state.json: the conflict monitor's."""

    conflicts: ConflictState


class CheckpointState(TypedDict):
    """state.json."""

    format: int
    step: int
    version: int
    identity: PolicyIdentity
    sampler: SamplerState
    extra: RunExtra
    time: float


class RngState(TypedDict):
    torch: torch.Tensor
    python: tuple[object, ...]      # random.getstate()
    numpy: tuple[object, ...]       # np.random.get_state()


@dataclass
class Checkpoint:
    """A checkpoint as loaded: what `--resume` restores."""

    step: int                   # the last train step it includes
    path: Path
    state: CheckpointState
    trainer: TrainerState           # sharded: only its version and num_steps
    buffer: BufferState[EpisodeGroup]
    rng: RngState
    sharded: Path | None = None     # the trainer's torch.distributed.checkpoint directory


def rng_state() -> RngState:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save(run_dir: Path, step: int, *, policy: CheckpointPolicy | None,
         trainer: ResumableTrainer, buffer_state: BufferState[EpisodeGroup],
         sampler_state: SamplerState, identity: PolicyIdentity,
         extra: RunExtra | None = None) -> Path:
    """Write the checkpoint of `step` (the trainer between two steps, rollouts may run);
    `extra`: more JSON-able run state (e.g. the conflict monitor's)."""
    final, tmp, old = run_dir / NAME, run_dir / f"{NAME}.tmp", run_dir / f"{NAME}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    if _is_sharded(trainer):
        tmp.mkdir(parents=True, exist_ok=True)
        trainer.save_sharded(tmp, policy)       # every rank writes its shards
        trainer_state: object = {"version": trainer.version, "num_steps": trainer.num_steps}
        mesh: dict[str, object] = {"world_size": trainer.env.world_size,
                                   "mesh": list(trainer.env.mesh.shape)}
    else:
        if policy is not None:
            policy.save_pretrained(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        trainer_state, mesh = trainer.state_dict(), {}
    torch.save({"trainer": trainer_state, "buffer": buffer_state, "rng": rng_state(),
                "sharded": "trainer" if mesh else None, "mesh": mesh}, tmp / "trainer.pt")
    state: CheckpointState = {"format": FORMAT, "step": step, "version": trainer.version,
                              "identity": identity, "sampler": sampler_state,
                              "extra": extra or {}, "time": time.time()}
    with open(tmp / "state.json", "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _complete(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "trainer.pt").is_file()


def find(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of the run, if any."""
    for name in (NAME, f"{NAME}.old"):
        if _complete(run_dir / name):
            return run_dir / name
    return None


def load(run_dir: Path, identity: PolicyIdentity | None = None) -> Checkpoint:
    path = find(run_dir)
    if path is None:
        raise ConfigError(f"{run_dir} has no complete checkpoint to resume from",
                          hint="start the run without --resume (or point --out at the run)")
    shutil.rmtree(run_dir / f"{NAME}.tmp", ignore_errors=True)  # a torn write
    state = json.loads((path / "state.json").read_text())
    if state.get("format") != FORMAT:
        raise ConfigError(f"{path} is a checkpoint of format {state.get('format')}, "
                          f"this Ridgeline reads {FORMAT}", hint="resume it with the version "
                          "that wrote it, or start a new run")
    if identity is not None and not same_model(state.get("identity"), identity):
        raise ConfigError(
            f"the checkpoint in {path} is of another model ({_describe(state.get('identity'))}) "
            f"than the config's ({_describe(identity)})",
            hint="resume with the config the run was started with, or start a new run dir")
    blob = torch.load(path / "trainer.pt", weights_only=False, pickle_module=_PICKLE)
    sharded = path / blob["sharded"] if blob.get("sharded") else None
    if sharded is not None and not (sharded / ".metadata").is_file():
        raise ConfigError(f"{path} is a sharded checkpoint without its shards ({sharded})",
                          hint="resume from a complete run directory (every rank's files)")
    return Checkpoint(int(state["step"]), path, state, blob["trainer"], blob["buffer"],
                      blob["rng"], sharded)


def restore_trainer(ckpt: Checkpoint, trainer: ResumableTrainer) -> None:
    """Load the checkpoint's trainer state into `trainer`, whichever wrote it and at
    whatever world size: a whole state (one process) into a sharded trainer shards it; a
    sharded one is read by the ranks of a sharded trainer or by one in-process trainer."""
    if ckpt.sharded is None:
        trainer.load_state_dict(ckpt.trainer)
        return
    version, steps = int(ckpt.trainer["version"]), int(ckpt.trainer["num_steps"])
    if _is_sharded(trainer):
        trainer.load_sharded(ckpt.sharded, version, steps)
        return
    from ridgeline.rl.sharded import load_trainer
    from ridgeline.rl.trainer import PolicyTrainer

    if not isinstance(trainer, PolicyTrainer):
        raise ConfigError(f"{ckpt.path} was written by a sharded trainer, which only an "
                          "in-process or sharded trainer reads",
                          hint="resume with distributed.nproc (or --nproc) instead of Ray")
    load_trainer(trainer, ckpt.sharded)
    trainer.version, trainer.num_steps = version, steps


def _is_sharded(trainer: object) -> TypeGuard[ShardedTrainer]:
    from ridgeline.rl.sharded import ShardedTrainer

    return isinstance(trainer, ShardedTrainer)


def same_model(a: object, b: PolicyIdentity) -> bool:
    """Whether two policy identities are of one base model (the name it was given by may
    differ: "default" and the path of its conversion are the same weights)."""
    if not isinstance(a, dict):
        return False
    return {k: v for k, v in a.items() if k != "model"} == \
        {k: v for k, v in b.items() if k != "model"}


def _describe(identity: object) -> str:
    if not isinstance(identity, dict):
        return "unknown"
    keys = ("name", "architecture", "num_layers", "hidden_size", "fingerprint")
    return ", ".join(f"{k}={str(identity[k])[:16]}" for k in keys if k in identity)


#: Classes renamed since checkpoints of this format were first written: (module, old
#: name) -> new name, so an older run still resumes.
_RENAMED = {("ridgeline.rl.filters", "EpisodeRecord"): "EpisodeOutcome"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        return super().find_class(module, _RENAMED.get((module, name), name))


# torch.load takes the pickle module to unpickle with
_PICKLE = types.ModuleType("ridgeline_checkpoint_pickle")
_PICKLE.Unpickler = _Unpickler  # type: ignore[attr-defined]
_PICKLE.load = pickle.load  # type: ignore[attr-defined]
