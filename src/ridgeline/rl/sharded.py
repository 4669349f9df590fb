"""The trainer over N processes with PyTorch's own distributed engine: FSDP2 data parallel
(`fully_shard` over each decoder layer and the root), gloo on CPU and NCCL on CUDA.

    ridgeline train --config train.yaml --nproc 2     # or: torchrun --nproc-per-node 2 ...

`launch` starts the ranks (or joins torchrun's), `init_distributed` makes the process
group (every collective under `timeout_s`) and the mesh, and `ShardedTrainer` is a
`PolicyTrainer` whose model is sharded over the mesh's ranks.

Rank 0 is the run: it plays the rollouts, keeps the loop, the buffer and the run
directory, and calls the trainer as any run does. The other ranks only follow the
trainer (`ShardedTrainer.follow`): each public call on rank 0 (`step`, `sync`, checkpoint
save and load, `close`) first broadcasts itself with its arguments (the whole batch for
a step) over a command group, whose timeout is long (`command_timeout_s`: rank 0 may be
rolling out between steps), then every rank runs it. In a step each rank trains on its
share of the batch's episodes (longest first, dealt round-robin) and the loss is
normalised by the whole batch's policy tokens (or sequences), all-reduced, with FSDP's
gradient averaging turned off: the gradient is the one of one process on the whole
batch. FSDP all-gathers in every forward, so every rank runs as many forward/backward
passes as the rank with the most micro-batches (the others add passes of zero loss).

A rank that fails ends the run: the launcher terminates the others and raises the
failed rank's error; under torchrun, torchrun does.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.rl.policy import Policy
from ridgeline.rl.protocols import WeightsSink
from ridgeline.rl.tokens import TokenBatch
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig, TrainerState

log = logging.getLogger(__name__)

Backend = Literal["auto", "gloo", "nccl"]


class DistributedConfig(BaseModel):
    """`distributed:` in a training config: how many trainer processes and how they
    shard the model."""

    model_config = ConfigDict(extra="forbid")

    nproc: int = Field(1, ge=1, description="trainer processes (ranks) on this machine; "
                       "1: one process, no torch.distributed (--nproc sets it)")
    backend: Backend = Field("auto", description="process group backend; auto: nccl "
                             "with CUDA, else gloo")
    shard_size: int | None = Field(None, ge=1, description="ranks each parameter is "
                                   "sharded over (FSDP); fewer than the world size: "
                                   "replicated across groups of that many (HSDP). None: "
                                   "all ranks. Must divide the world size")
    mixed_precision: bool = Field(True, description="with the trainer's bfloat16 dtype, "
                                  "gather parameters in bfloat16 and reduce gradients in "
                                  "float32 (the weights stay float32 shards)")
    cpu_offload: bool = Field(False, description="keep the parameter shards, gradients "
                              "and optimizer state in CPU memory (CUDA only; on CPU they "
                              "are there already)")
    timeout_s: float = Field(600.0, gt=0, description="timeout of every training "
                             "collective: a rank that stops answering fails the run")
    command_timeout_s: float = Field(3600.0, gt=0, description="how long the other ranks "
                                     "wait for rank 0's next trainer call (it rolls out "
                                     "meanwhile)")


# ---- the process group ------------------------------------------------------------------


@dataclass
class DistEnv:
    """This process's place: rank, world, the data-parallel mesh, the command group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any                       # torch DeviceMesh: ("dp",) or ("replicate", "shard")
    commands: Any                   # a gloo group with command_timeout_s
    config: DistributedConfig


_ENV: DistEnv | None = None


def current() -> DistEnv | None:
    """The distributed environment `init_distributed` made in this process, if any."""
    return _ENV


def resolve_backend(backend: Backend) -> str:
    """The backend `backend` means here, or a ConfigError when it is not built in."""
    name = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
    if not dist.is_available() or not dist.is_backend_available(name):
        raise ConfigError(f"this PyTorch has no {name!r} process group backend",
                          hint="use backend: gloo (CPU) or auto, or a PyTorch build with "
                               f"{name}")
    if name == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend nccl needs CUDA devices, and none is visible",
                          hint="use backend: gloo (or auto) on CPU")
    return name


def mesh_shape(world_size: int, shard_size: int | None) -> tuple[int, ...]:
    """(dp,) for FSDP over all ranks, (replicas, shard) for HSDP; a ConfigError when the
    shard size does not divide the world size."""
    shard = shard_size or world_size
    if shard > world_size or world_size % shard:
        raise ConfigError(f"distributed.shard_size {shard} does not divide the world size "
                          f"{world_size}",
                          hint=f"pick a shard_size that divides {world_size} (or leave it "
                               "unset: shard over all ranks)")
    return (world_size,) if shard == world_size else (world_size // shard, shard)


def init_distributed(config: DistributedConfig) -> DistEnv:
    """The process group of the ranks torchrun's variables describe (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT), the mesh and the command group. Everything
    that can be wrong is checked before the first collective."""
    global _ENV
    if _ENV is not None:
        return _ENV
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise ConfigError("no torchrun environment (RANK, WORLD_SIZE) in this process",
                          hint="start it with `ridgeline train --nproc N` or torchrun") from None
    shape = mesh_shape(world, config.shard_size)
    backend = resolve_backend(config.backend)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=config.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    commands = dist.new_group(backend="gloo", timeout=datetime.timedelta(
        seconds=config.command_timeout_s))
    _ENV = DistEnv(rank, world, local_rank, device, mesh, commands, config)
    log.info("rank %d of %d (%s, mesh %s)", rank, world, backend, shape)
    return _ENV


def shutdown() -> None:
    global _ENV
    _ENV = None
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- launching the ranks ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(nproc: int, fn: Callable[..., object], args: Sequence[object],
           config: DistributedConfig) -> None:
    """Run `fn(*args)` on every rank, the process group up: in this process when torchrun
    started it (its environment is there), else in `nproc` new processes with a
    torchrun environment. A rank's failure ends the others and raises its error here."""
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if nproc not in (1, world):
            raise ConfigError(f"--nproc {nproc} under torchrun's world size {world}",
                              hint="leave --nproc out under torchrun (it sets the ranks)")
        _rank_main(fn, args, config)
        return
    mesh_shape(nproc, config.shard_size)     # a bad mesh fails before any process starts
    resolve_backend(config.backend)
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ridgeline-ranks.") as errors:
        ctx = mp.start_processes(_spawned, args=(nproc, port, fn, tuple(args), config,
                                                 errors),
                                 nprocs=nproc, join=False, start_method="spawn")
        try:
            while not ctx.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise _rank_error(Path(errors), e) from None


def _spawned(index: int, nproc: int, port: int, fn: Callable[..., object],
             args: tuple[object, ...], config: DistributedConfig, errors: str) -> None:
    os.environ.update(RANK=str(index), WORLD_SIZE=str(nproc), LOCAL_RANK=str(index),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        _rank_main(fn, args, config)
    except BaseException as e:
        # the launcher re-raises the original (a ConfigError keeps its hint)
        with contextlib.suppress(Exception):
            (Path(errors) / f"rank{index}").write_bytes(pickle.dumps(e))
        raise


def _rank_main(fn: Callable[..., object], args: Sequence[object],
               config: DistributedConfig) -> None:
    init_distributed(config)
    try:
        fn(*args)
    finally:
        shutdown()


def _rank_error(errors: Path, e: Exception) -> BaseException:
    """The failed rank's own exception where it left one (the first rank to fail has
    the cause; the others fail on its absence), else a RidgelineError with the failure."""
    rank = getattr(e, "error_index", None)
    path = errors / f"rank{rank}"
    if path.is_file():
        with contextlib.suppress(Exception):
            err = pickle.loads(path.read_bytes())
            if isinstance(err, BaseException):
                return err
    return RidgelineError(f"trainer rank {rank} failed: {e}",
                          hint="its traceback is above; the other ranks were stopped")


# ---- the sharded model ------------------------------------------------------------------


class _Root(torch.nn.Module):
    """The FSDP root around the policy: the trainer calls the decoder and the LM head
    separately (the head only on policy positions), not the model's forward, so the
    root's forward runs that call (`ShardedTrainer.logprobs`) between FSDP's hooks; the
    embeddings, final norm and head (tied or not) are its parameter group."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.policy = model

    def forward(self, run: Callable[[], Any]) -> Any:
        return run()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: transformers' `no_split_modules` classes (each decoder
    layer), found by class name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"{type(base).__name__} names no decoder layer class "
                          "(_no_split_modules), so it cannot be sharded per layer",
                          hint="use a transformers causal LM, or distributed.nproc: 1")
    return layers


def shard_model(model: torch.nn.Module, mesh: Any, *, param_dtype: torch.dtype | None,
                cpu_offload: bool) -> _Root:
    """`fully_shard` each decoder layer, then the root (what is left: embeddings, norm,
    head); FSDP's gradient averaging off (the trainer's loss is already the batch's
    mean). Returns the root."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
    )

    kwargs: dict[str, Any] = {"mesh": mesh}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                                   reduce_dtype=torch.float32)
    if cpu_offload and mesh.device_type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    else:
        kwargs["offload_policy"] = OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    root = _Root(model)
    fully_shard(root, **kwargs)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)   # gloo has no PREMUL_SUM
    return root


@contextlib.contextmanager
def full_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Within it the model's sharded parameters are whole tensors (float32, each rank a
    copy: a collective, every rank enters it), for code that reads `named_parameters()`
    (engine sync, `Policy.save_pretrained`); tied parameters stay tied."""
    from torch.distributed.tensor import DTensor

    saved: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    full: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if isinstance(p, DTensor):
                    if id(p) not in full:
                        full[id(p)] = torch.nn.Parameter(p.full_tensor(),
                                                         requires_grad=p.requires_grad)
                    saved.append((module, name, p))
                    module._parameters[name] = full[id(p)]
    try:
        yield
    finally:
        for module, name, p in saved:
            module._parameters[name] = p


class ShardedTrainer(PolicyTrainer):
    """A `PolicyTrainer` whose model is sharded over the ranks of `env.mesh` (FSDP2), and
    whose optimizer is built on the shards. Rank 0 calls it as any trainer; the other
    ranks call `follow()`."""

    def __init__(self, model: torch.nn.Module | Policy, config: TrainerConfig | None = None,
                 reference: torch.nn.Module | None = None, *, env: DistEnv) -> None:
        if isinstance(model, Policy) and model.lora is not None:
            raise ConfigError("LoRA policies are not sharded yet",
                              hint="train a LoRA policy with distributed.nproc: 1")
        super().__init__(model, config, reference)
        self.env = env
        cfg = self.config
        if cfg.pack:
            raise ConfigError("packed micro-batches are not sharded yet",
                              hint="set trainer.pack: false with distributed.nproc > 1")
        self.model.to(env.device)
        param_dtype = torch.bfloat16 if (env.config.mixed_precision
                                         and self.autocast_dtype == "bfloat16") else None
        self.root = shard_model(self.model, env.mesh, param_dtype=param_dtype,
                                cpu_offload=env.config.cpu_offload)
        self.device_type = env.device.type
        # fully_shard replaced the parameters by their shards: the optimizer is built on these
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr,
                                           weight_decay=cfg.weight_decay, betas=cfg.betas)
        self._idle_batch = TokenBatch(torch.tensor([[1, 1]]), torch.ones(1, 2, dtype=torch.long),
                                      torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2),
                                      torch.zeros(1))

    @property
    def rank(self) -> int:
        return self.env.rank

    # -- what rank 0 calls; each first tells the other ranks -------------------------------

    def _lead(self, command: str, *args: object) -> None:
        if self.rank == 0 and self.env.world_size > 1:
            dist.broadcast_object_list([(command, args)], src=0, group=self.env.commands)

    def follow(self) -> None:
        """On ranks other than 0: run the trainer calls rank 0 makes, until it closes."""
        assert self.rank != 0, "rank 0 leads"
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.env.commands)
            command, args = box[0]
            if command == "close":
                return
            getattr(self, command)(*args)

    def close(self) -> None:
        """Let the other ranks' `follow` return (rank 0, once, at the end of the run)."""
        self._lead("close")

    def step(self, batch: TokenBatch) -> dict[str, float]:
        self._lead("step", batch)
        return super().step(self.share(batch))

    def gradient(self, batch: TokenBatch) -> torch.Tensor:
        raise ConfigError("per-batch gradients (the conflict monitor) are not sharded yet",
                          hint="turn loop.conflicts off with distributed.nproc > 1")

    def supervised_step(self, batch: TokenBatch) -> dict[str, float]:
        raise ConfigError("SFT is not sharded yet", hint="run ridgeline sft in one process")

    def sync(self, sink: WeightsSink | None) -> dict[str, float]:
        """Rank 0 sends the whole weights to `sink` (the others only help gather them)."""
        self._lead("sync", None)
        with full_parameters(self.model):
            if self.rank == 0:
                assert sink is not None
                return super().sync(sink)
            self.version += 1
            return {}

    def state_dict(self) -> TrainerState:
        """The whole trainer state, as one process's (`PolicyTrainer.state_dict`) on rank 0:
        what a checkpoint of format 1 holds."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        self._lead("state_dict")
        model, optim = get_state_dict(self.model, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        return {"model": model, "optimizer": _by_index(optim, self._names()),
                "version": self.version, "num_steps": self.num_steps}

    def load_state_dict(self, state: TrainerState) -> None:
        """A whole trainer state (one process's, `PolicyTrainer.state_dict`), sharded."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        self._lead("load_state_dict", state)
        _check_model_keys(state["model"].keys(), self._names(state=True), "checkpoint")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=_by_name(state["optimizer"], self._names()),
                       options=StateDictOptions(full_state_dict=True))
        self.version = int(state["version"])
        self.num_steps = int(state["num_steps"])

    def save_sharded(self, path: Path, policy: Any = None) -> None:
        """Write the policy's Hugging Face files (rank 0, `policy.save_pretrained(path)`)
        and the trainer's shards under `path / "trainer"` (`torch.distributed.checkpoint`,
        every rank its own)."""
        self._lead("save_sharded", path)
        with full_parameters(self.model):
            if self.rank == 0 and policy is not None:
                policy.save_pretrained(path)
        dist.barrier()      # the directory exists before any rank writes into it
        save_trainer(self, path / "trainer")

    def load_sharded(self, path: Path, version: int, num_steps: int) -> None:
        self._lead("load_sharded", path, version, num_steps)
        load_trainer(self, path)
        self.version, self.num_steps = version, num_steps

    # -- the hooks of PolicyTrainer -------------------------------------------------------

    def share(self, batch: TokenBatch) -> TokenBatch:
        """This rank's episodes of the batch: longest first, dealt round-robin (similar
        token counts per rank)."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        order = sorted(range(len(batch)), key=lambda i: -lengths[i])
        mine = sorted(order[self.rank::self.env.world_size])
        local = batch.rows(mine)
        return TokenBatch(*(t.to(self.env.device) for t in (
            local.token_ids, local.attention_mask, local.loss_mask,
            local.behaviour_logprobs, local.advantages)))

    def _all_sum(self, values: list[float], op: Any = None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.env.device)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.tolist()

    def global_counts(self, tokens: float, sequences: float) -> tuple[float, float]:
        """The batch's policy tokens and sequences over all ranks: the loss's
        normalisation is the whole batch's, as in one process."""
        total_tokens, total_seqs = self._all_sum([tokens, sequences])
        return total_tokens, total_seqs

    def _micro_batches(self, batch: TokenBatch) -> Iterator[TokenBatch]:
        mine = [mb for mb in super()._micro_batches(batch) if float(mb.loss_mask.sum()) > 0]
        most = int(self._all_sum([float(len(mine))], dist.ReduceOp.MAX)[0])
        yield from mine
        # FSDP gathers the parameters in every forward, on every rank: a rank with fewer
        # micro-batches runs passes of zero loss until all have run as many
        for _ in range(most - len(mine)):
            logp, _ = self.logprobs(self._idle_batch)
            (logp.sum() * 0.0).backward()

    def _backward(self, batch: TokenBatch) -> tuple[dict[str, float], float]:
        sums, total_tokens = super()._backward(batch)
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, sums)
        merged: dict[str, float] = {}
        for part in gathered:
            for k, v in part.items():
                merged[k] = merged.get(k, 0.0) + v
        return merged, total_tokens

    def logprobs(self, batch: TokenBatch, model: torch.nn.Module | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if model is not None and model is not self.model:   # the (unsharded) reference
            return super().logprobs(batch, model)
        parent = super()
        return self.root(lambda: parent.logprobs(batch))

    def _names(self, state: bool = False) -> list[str]:
        """The trainable parameters' names in optimizer order (`state`: the model state's
        keys instead)."""
        if state:
            return list(self.model.state_dict().keys())
        return [n for n, p in self.model.named_parameters() if p.requires_grad]


# ---- sharded checkpoints (torch.distributed.checkpoint) ----------------------------------


def save_trainer(trainer: PolicyTrainer, path: Path) -> None:
    """The trainer's model and optimizer state under `path` in the format of
    `torch.distributed.checkpoint`: one file per rank, and metadata that lets `load_trainer`
    read it at any world size (also 1: a plain `PolicyTrainer`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(trainer.model, trainer.optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model, "optimizer": optim}, checkpoint_id=str(path))


def load_trainer(trainer: PolicyTrainer, path: Path) -> None:
    """What `save_trainer` wrote, into `trainer` (sharded at any world size, or one
    process's): a checkpoint of another model is a ConfigError before anything loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: tuple(getattr(v, "size", ())) for k, v in meta.items()
             if k.startswith("model.")}
    model, optim = get_state_dict(trainer.model, trainer.optimizer)
    mine = {k: tuple(v.shape) for k, v in model.items()}
    _check_model_keys(saved, list(mine), str(path))
    other = sorted(k for k in mine if saved[k] != mine[k])
    if other:
        raise ConfigError(f"the sharded checkpoint {path} holds tensors of other shapes than "
                          f"this model's ({other[:2]}: {[saved[k] for k in other[:2]]} vs "
                          f"{[mine[k] for k in other[:2]]})",
                          hint="resume with the model the run was started with")
    state = {"model": model, "optimizer": optim}
    with warnings.catch_warnings():
        # one process reading shards is intended (a checkpoint resumed at world size 1)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def _check_model_keys(saved: Any, expected: list[str], where: str) -> None:
    saved, want = set(saved), set(expected)
    if saved != want:
        raise ConfigError(f"{where} holds the state of another model (missing "
                          f"{sorted(want - saved)[:2]}, unexpected {sorted(saved - want)[:2]})",
                          hint="resume with the model (and LoRA config) the run was started "
                               "with, or start a new run directory")


def _by_index(optim: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (torch's distributed form) as
    `Optimizer.state_dict()` keys it: by the parameter's position."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in optim["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in optim["param_groups"]]}


def _by_name(optim: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"state": {names[i]: s for i, s in optim["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in optim["param_groups"]]}
