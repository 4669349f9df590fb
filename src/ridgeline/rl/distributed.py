"""The same training run on Ray: rollout workers (each with its own engine replica) and
the trainer are actors; the driver keeps the loop, the buffer and the task scheduler.

    ridgeline train --config train.yaml      # with `ray: {enabled: true}` in it

`RayRun(config)` starts (or joins, `ray.address`) a cluster and builds:

- `rollout`: a `GroupRollout` that plays each group on the least busy `RolloutWorker`
  actor. A worker builds exactly what a single-process run builds (`parts.make_rollout` on
  an `LLM` of the policy's model, resolved on its own node, then given the trainer's
  weights as version 0), so episodes are identical in shape. Workers
  are threaded actors: the groups the loop's rollout threads send one worker at a time
  are batched by its engine.
- `trainer`: a `protocols.ResumableTrainer` (`step`, `gradient`, `sync`, `state_dict`,
  `version`) whose model lives in the `TrainerActor`.
- `weights`: where `sync` sends a version (a `protocols.WeightsSink`). The trainer actor puts the weights in the
  object store once (`ray.put`) and every worker reads them from there (one copy per
  node, not one per worker through the driver), then swaps them into its engine between
  two steps (`update_weights`; in-flight groups continue, later tokens carry the new
  version).
- `policy`: the checkpoint's view of the trainer's model (`save_pretrained`, `identity`);
  on a multi-node cluster the run directory must be on storage the trainer's node can
  write (checkpoints are written there).

`ray_parts(config)` hands them to the run as its `parts.RunParts`. Nothing here runs
without Ray installed; the single-machine default never imports it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.rl.config import TrainConfig
from ridgeline.rl.parts import RunParts
from ridgeline.rl.protocols import EpisodeRollout, GroupRollout, NamedTensors, RLTask, WeightsSink

if TYPE_CHECKING:
    from ridgeline.rl.filters import EpisodeOutcome
    from ridgeline.rl.policy import PolicyIdentity
    from ridgeline.rl.rollouts import EpisodeGroup
    from ridgeline.rl.tokens import TokenBatch
    from ridgeline.rl.trainer import TrainerState
    from ridgeline.tasks import Task

log = logging.getLogger(__name__)

#: A Ray actor handle (`handle.method.remote(...)` is resolved at run time: untyped).
ActorHandle: TypeAlias = Any
#: A reference into Ray's object store: opaque, handed back to Ray.
ObjectRef: TypeAlias = object


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise ConfigError("ray.enabled needs Ray", hint="pip install 'ridgeline[ray]'") from None
    return ray


class RolloutWorker:
    """An actor: one engine replica and the run's rollout on it."""

    def __init__(self, config_json: str) -> None:
        from ridgeline.engine import LLM
        from ridgeline.llm.engine_client import EngineClient
        from ridgeline.rl.parts import make_rollout
        from ridgeline.rl.policy import hf_model_dir

        cfg = TrainConfig.model_validate_json(config_json)
        # resolved on this worker's node (a GGUF default is converted into its own cache);
        # the trainer's exact weights arrive as version 0 right after start
        model_dir = hf_model_dir(cfg.policy.model, cache_dir=cfg.policy.cache_dir)
        self.llm = LLM(str(model_dir), **cfg.engine.engine_kwargs())
        generator = EngineClient(self.llm) if self.llm.tokenizer is not None else None
        self.rollout: GroupRollout[Any]
        self.rollout, self.verifier = make_rollout(cfg, self.llm, generator, self.llm.tokenizer)

    def play(self, task: RLTask, seeds: list[int]) -> EpisodeGroup:
        return self.rollout(task, seeds)

    def episode(self, task: Task, seed: int, sample: int) -> EpisodeOutcome:
        # held-out tasks are terminal tasks, whose (agent) rollout plays single episodes
        assert isinstance(self.rollout, EpisodeRollout)
        outcome, _ = self.rollout.episode(task, seed, sample)
        return outcome

    def update_weights(self, named_tensors: NamedTensors, version: int) -> int:
        return self.llm.worker.update_weights(named_tensors, version=version)

    def version(self) -> int:
        return self.llm.worker.call(lambda engine: engine.policy_version)

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()
        self.llm.worker.stop()


class TrainerActor:
    """An actor: the policy and its `PolicyTrainer`."""

    def __init__(self, config_json: str) -> None:
        from ridgeline.rl.parts import make_trainer
        from ridgeline.rl.policy import load_policy

        cfg = TrainConfig.model_validate_json(config_json)
        self.policy = load_policy(cfg.policy)
        self.trainer = make_trainer(cfg, self.policy)

    def identity(self) -> PolicyIdentity:
        return self.policy.identity

    def step(self, batch: TokenBatch) -> dict[str, float]:
        return self.trainer.step(batch)

    def gradient(self, batch: TokenBatch) -> torch.Tensor:
        return self.trainer.gradient(batch)

    def publish(self, version: int, full: bool = False) -> list[ObjectRef]:
        """The weights of `version` put in the object store; the reference in a list (so
        the caller receives it, not the tensors)."""
        ray = _ray()
        self.trainer.version = version
        tensors = self.policy.full_weights() if full else self.policy.engine_weights()
        return [ray.put([(n, t.detach().contiguous()) for n, t in tensors])]

    def state_dict(self) -> TrainerState:
        return self.trainer.state_dict()

    def load_state_dict(self, state: TrainerState) -> None:
        self.trainer.load_state_dict(state)

    def save_pretrained(self, path: str) -> str:
        return str(self.policy.save_pretrained(path))


class RayTrainer:
    """The `TrainerActor` as a `protocols.ResumableTrainer`."""

    def __init__(self, actor: ActorHandle, ray: ModuleType) -> None:
        self.actor = actor
        self.ray = ray
        self.version = 0

    def step(self, batch: TokenBatch) -> dict[str, float]:
        return self.ray.get(self.actor.step.remote(batch))

    def gradient(self, batch: TokenBatch) -> torch.Tensor:
        return self.ray.get(self.actor.gradient.remote(batch))

    def sync(self, sink: WeightsSink) -> dict[str, float]:
        """The trainer actor puts the new version in the object store once; the rollout
        workers read it from there (any other sink gets the tensors themselves)."""
        t0 = time.perf_counter()
        self.version += 1
        [ref] = self.ray.get(self.actor.publish.remote(self.version))
        t1 = time.perf_counter()
        if isinstance(sink, RayWeights):
            sink.broadcast(ref, self.version)
        else:
            sink.update_weights(self.ray.get(ref), version=self.version)
        return {"sync_seconds": time.perf_counter() - t0, "sync_publish_seconds": t1 - t0,
                "version": float(self.version)}

    def state_dict(self) -> TrainerState:
        return self.ray.get(self.actor.state_dict.remote())

    def load_state_dict(self, state: TrainerState) -> None:
        self.ray.get(self.actor.load_state_dict.remote(state))
        self.version = int(state["version"])


class RayPolicy:
    """What a checkpoint needs of the policy that lives in the trainer actor."""

    def __init__(self, actor: ActorHandle, ray: ModuleType) -> None:
        self.actor = actor
        self.ray = ray
        self.identity: PolicyIdentity = ray.get(actor.identity.remote())

    def save_pretrained(self, path: object) -> str:
        return self.ray.get(self.actor.save_pretrained.remote(str(path)))


class RayWeights:
    """The rollout workers' engines as one `protocols.WeightsSink`."""

    def __init__(self, workers: list[ActorHandle], ray: ModuleType) -> None:
        self.workers = workers
        self.ray = ray

    def broadcast(self, ref: ObjectRef, version: int) -> None:
        """Every worker loads the weights behind `ref` (from the object store)."""
        self.ray.get([w.update_weights.remote(ref, version) for w in self.workers])

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> int:
        ref = self.ray.put([(n, t.detach().contiguous()) for n, t in named_tensors])
        self.broadcast(ref, int(version or 0))
        return len(self.ray.get(ref))

    def versions(self) -> list[int]:
        return self.ray.get([w.version.remote() for w in self.workers])


class RayRollout:
    """An `EpisodeRollout` over the worker actors: each group (or held-out episode) goes
    to the worker with the fewest in flight."""

    def __init__(self, workers: list[ActorHandle], ray: ModuleType) -> None:
        self.workers = workers
        self.ray = ray
        self._busy = [0] * len(workers)
        self._lock = threading.Lock()
        self.groups_per_worker = [0] * len(workers)

    def _acquire(self) -> int:
        with self._lock:
            k = min(range(len(self.workers)), key=lambda i: (self._busy[i], i))
            self._busy[k] += 1
            self.groups_per_worker[k] += 1
            return k

    def _release(self, k: int) -> None:
        with self._lock:
            self._busy[k] -= 1

    def __call__(self, task: RLTask, seeds: list[int]) -> EpisodeGroup:
        k = self._acquire()
        try:
            return self.ray.get(self.workers[k].play.remote(task, seeds))
        finally:
            self._release(k)

    def episode(self, task: Task, seed: int, sample: int) -> tuple[EpisodeOutcome, None]:
        k = self._acquire()
        try:
            return self.ray.get(self.workers[k].episode.remote(task, seed, sample)), None
        finally:
            self._release(k)


class RayRun:
    """The actors of one run, and the driver-side objects the loop uses."""

    def __init__(self, config: TrainConfig) -> None:
        ray = self.ray = _ray()
        r = config.ray
        self._started_ray = False
        if not ray.is_initialized():
            try:
                ray.init(address=r.address, include_dashboard=False, log_to_driver=False,
                         ignore_reinit_error=True)
            except ConnectionError as e:
                raise ConfigError(f"cannot reach the Ray cluster at {r.address!r}: {e}",
                                  hint="start it (`ray start --head`) or unset ray.address"
                                  ) from None
            self._started_ray = r.address is None
        cfg_json = config.model_dump_json()
        concurrency = max(2, config.loop.rollout_threads)
        self.trainer_actor = ray.remote(TrainerActor).options(
            num_cpus=r.trainer_cpus, num_gpus=r.trainer_gpus, name=None).remote(cfg_json)
        try:
            self.policy = RayPolicy(self.trainer_actor, ray)
        except Exception as e:  # noqa: BLE001 - a failed actor start is the user's setup
            self.close()
            raise _actor_error("the trainer actor", e) from None
        worker_cls = ray.remote(RolloutWorker).options(
            num_cpus=r.worker_cpus, num_gpus=r.worker_gpus, max_concurrency=concurrency)
        self.workers = [worker_cls.remote(cfg_json) for _ in range(r.rollout_workers)]
        try:
            ray.get([w.version.remote() for w in self.workers])   # started, or why not
        except Exception as e:  # noqa: BLE001
            self.close()
            raise _actor_error("a rollout worker", e) from None
        self.trainer = RayTrainer(self.trainer_actor, ray)
        self.weights = RayWeights(self.workers, ray)
        # every engine starts from the trainer's exact weights (files on another node
        # may differ), as version 0
        [ref] = ray.get(self.trainer_actor.publish.remote(0, True))
        self.weights.broadcast(ref, 0)
        self.rollout = RayRollout(self.workers, ray)
        log.info("Ray: %d rollout workers and a trainer actor on %s", len(self.workers),
                 r.address or "a local cluster")

    def metrics(self) -> dict[str, float]:
        """Groups each worker played and the weights version its engine holds."""
        out: dict[str, float] = {}
        for k, (n, v) in enumerate(zip(self.rollout.groups_per_worker, self.weights.versions())):
            out[f"ray/worker/{k}/groups"] = float(n)
            out[f"ray/worker/{k}/version"] = float(v)
        return out

    def close(self) -> None:
        ray = self.ray
        for w in getattr(self, "workers", []):
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to close
                pass
            ray.kill(w)
        if getattr(self, "trainer_actor", None) is not None:
            ray.kill(self.trainer_actor)
        if self._started_ray:
            ray.shutdown()


def ray_parts(config: TrainConfig) -> RunParts:
    """Rollout workers (each with its engine replica) and the trainer as Ray actors;
    weights go from the trainer to the workers through the object store."""
    cluster = RayRun(config)
    return RunParts(cluster.policy, cluster.trainer, cluster.rollout, cluster.weights,
                    load=[cluster], closers=[cluster.close])


def _actor_error(what: str, e: BaseException) -> RidgelineError:
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, RidgelineError):
        return cause
    return RidgelineError(f"{what} failed to start: {type(cause).__name__}: {str(cause)[:300]}",
                          hint="see the Ray logs (/tmp/ray/session_latest/logs)")
