"""The same training run on Ray: rollout workers (each with its own engine replica) and
the trainer are actors; the driver keeps the loop, the buffer and the task scheduler.

    ridgeline train --config train.yaml      # with `ray: {enabled: true}` in it

`RayRun(config)` starts (or joins, `ray.address`) a cluster and builds:

- `rollout`: a `GroupRollout` that plays each group on the least busy `RolloutWorker`
  actor. A worker builds exactly what a single-process run builds (`run.make_rollout` on
  an `LLM` of the policy's model, resolved on its own node, then given the trainer's
  weights as version 0), so episodes are identical in shape. Workers
  are threaded actors: the groups the loop's rollout threads send one worker at a time
  are batched by its engine.
- `trainer`: a proxy with `PolicyTrainer`'s interface (`step`, `gradient`, `sync`,
  `state_dict`, `version`) whose model lives in the `TrainerActor`.
- `weights`: where `sync` sends a version. The trainer actor puts the weights in the
  object store once (`ray.put`) and every worker reads them from there (one copy per
  node, not one per worker through the driver), then swaps them into its engine between
  two steps (`update_weights`; in-flight groups continue, later tokens carry the new
  version).
- `policy`: the checkpoint's view of the trainer's model (`save_pretrained`, `identity`);
  on a multi-node cluster the run directory must be on storage the trainer's node can
  write (checkpoints are written there).

Nothing here runs without Ray installed; the single-machine default never imports it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ridgeline.errors import ConfigError, RidgelineError

log = logging.getLogger(__name__)


def _ray() -> Any:
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
        from ridgeline.rl.policy import hf_model_dir
        from ridgeline.rl.run import TrainConfig, engine_kwargs, make_rollout

        cfg = TrainConfig.model_validate_json(config_json)
        # resolved on this worker's node (a GGUF default is converted into its own cache);
        # the trainer's exact weights arrive as version 0 right after start
        model_dir = hf_model_dir(cfg.policy.model, cache_dir=cfg.policy.cache_dir)
        self.llm = LLM(str(model_dir), **engine_kwargs(cfg.engine))
        generator = EngineClient(self.llm) if self.llm.tokenizer is not None else None
        self.rollout, self.verifier = make_rollout(cfg, self.llm, generator, self.llm.tokenizer)

    def play(self, task: Any, seeds: list[int]) -> Any:
        return self.rollout(task, seeds)

    def episode(self, task: Any, seed: int, sample: int) -> Any:
        record, _ = self.rollout.episode(task, seed, sample)
        return record

    def update_weights(self, tensors: list[tuple[str, Any]], version: int) -> int:
        return self.llm.worker.update_weights(tensors, version=version)

    def version(self) -> int:
        return self.llm.worker.call(lambda engine: engine.policy_version)

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()
        self.llm.worker.stop()


class TrainerActor:
    """An actor: the policy and its `PolicyTrainer`."""

    def __init__(self, config_json: str) -> None:
        from ridgeline.rl.policy import load_policy
        from ridgeline.rl.run import TrainConfig, make_trainer

        cfg = TrainConfig.model_validate_json(config_json)
        self.policy = load_policy(cfg.policy)
        self.trainer = make_trainer(cfg, self.policy)

    def describe(self) -> dict[str, Any]:
        return {"identity": self.policy.identity, "model_dir": str(self.policy.model_dir)}

    def step(self, batch: Any) -> dict[str, float]:
        return self.trainer.step(batch)

    def gradient(self, batch: Any) -> Any:
        return self.trainer.gradient(batch)

    def publish(self, version: int, full: bool = False) -> list[Any]:
        """The weights of `version` put in the object store; the reference in a list (so
        the caller receives it, not the tensors)."""
        ray = _ray()
        self.trainer.version = version
        tensors = self.policy.full_weights() if full else self.policy.engine_weights()
        return [ray.put([(n, t.detach().contiguous()) for n, t in tensors])]

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def save_pretrained(self, path: str) -> str:
        return str(self.policy.save_pretrained(path))


class RayTrainer:
    """`PolicyTrainer`'s interface, driving the `TrainerActor`."""

    def __init__(self, actor: Any, ray: Any) -> None:
        self.actor = actor
        self.ray = ray
        self.version = 0
        self.num_steps = 0

    def step(self, batch: Any) -> dict[str, float]:
        out = self.ray.get(self.actor.step.remote(batch))
        self.num_steps += 1
        return out

    def gradient(self, batch: Any) -> Any:
        return self.ray.get(self.actor.gradient.remote(batch))

    def sync(self, target: RayWeights) -> dict[str, float]:
        t0 = time.perf_counter()
        self.version += 1
        [ref] = self.ray.get(self.actor.publish.remote(self.version))
        t1 = time.perf_counter()
        target.broadcast(ref, self.version)
        return {"sync_seconds": time.perf_counter() - t0, "sync_publish_seconds": t1 - t0,
                "version": float(self.version)}

    def state_dict(self) -> dict[str, Any]:
        return self.ray.get(self.actor.state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ray.get(self.actor.load_state_dict.remote(state))
        self.version = int(state["version"])
        self.num_steps = int(state["num_steps"])


class RayPolicy:
    """What a checkpoint needs of the policy that lives in the trainer actor."""

    def __init__(self, actor: Any, ray: Any) -> None:
        self.actor = actor
        self.ray = ray
        info = ray.get(actor.describe.remote())
        self.identity = info["identity"]
        self.model_dir = info["model_dir"]

    def save_pretrained(self, path: Any) -> str:
        return self.ray.get(self.actor.save_pretrained.remote(str(path)))


class RayWeights:
    """The rollout workers' engines as one weights target."""

    def __init__(self, workers: list[Any], ray: Any) -> None:
        self.workers = workers
        self.ray = ray

    def broadcast(self, ref: Any, version: int) -> None:
        """Every worker loads the weights behind `ref` (from the object store)."""
        self.ray.get([w.update_weights.remote(ref, version) for w in self.workers])

    def update_weights(self, tensors: Any, version: int | None = None) -> int:
        ref = self.ray.put([(n, t.detach().contiguous()) for n, t in tensors])
        self.broadcast(ref, int(version or 0))
        return len(self.ray.get(ref))

    def versions(self) -> list[int]:
        return self.ray.get([w.version.remote() for w in self.workers])


class RayRollout:
    """A `GroupRollout` over the worker actors: each group goes to the worker with the
    fewest groups in flight."""

    def __init__(self, workers: list[Any], ray: Any) -> None:
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

    def __call__(self, task: Any, seeds: list[int]) -> Any:
        k = self._acquire()
        try:
            return self.ray.get(self.workers[k].play.remote(task, seeds))
        finally:
            self._release(k)

    def episode(self, task: Any, seed: int, sample: int) -> tuple[Any, None]:
        k = self._acquire()
        try:
            return self.ray.get(self.workers[k].episode.remote(task, seed, sample)), None
        finally:
            self._release(k)


class RayRun:
    """The actors of one run, and the driver-side objects the loop uses."""

    def __init__(self, config: Any) -> None:
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


def _actor_error(what: str, e: BaseException) -> RidgelineError:
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, RidgelineError):
        return cause
    return RidgelineError(f"{what} failed to start: {type(cause).__name__}: {str(cause)[:300]}",
                          hint="see the Ray logs (/tmp/ray/session_latest/logs)")
