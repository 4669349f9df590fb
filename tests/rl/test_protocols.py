"""One vocabulary for RL's parts: the task sources, weights sinks, trainers, policies and
rollouts each satisfy their `ridgeline.rl.protocols` interface (checked with isinstance
on the runtime-checkable protocols), the FIFO has none of the scheduler's hooks, the run
and its Ray path do not import each other, and `Any` stays rare in `ridgeline.rl`."""

from __future__ import annotations

import ast
import re
import types
from dataclasses import dataclass
from pathlib import Path

import torch

import ridgeline.rl
from ridgeline.engine import LLM
from ridgeline.engine.config import EngineConfig
from ridgeline.llm.engine_client import EngineClient
from ridgeline.llm.remote_weights import RemoteWeights
from ridgeline.llm.router import ReplicaRouter, WeightFanout
from ridgeline.rl.advantages import group_advantages, zero_variance
from ridgeline.rl.agent_rollout import AgentRollout
from ridgeline.rl.config import EngineSettings
from ridgeline.rl.curriculum import Curriculum, CurriculumConfig
from ridgeline.rl.digits import shift_reward, shift_tasks, tiny_policy
from ridgeline.rl.distributed import RayPolicy, RayRollout, RayTrainer, RayWeights
from ridgeline.rl.filters import EpisodeOutcome, filter_group
from ridgeline.rl.policy import Policy
from ridgeline.rl.protocols import (
    AdaptiveTaskSource, CheckpointPolicy, EpisodeRollout, GroupRollout, MetricsSource,
    ResumableTrainer, TaskSource, TokenGenerator, Trainer, WeightsSink,
)
from ridgeline.rl.rollouts import TokenTaskRollout
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.scheduler import DomainScheduler
from ridgeline.rl.trainer import PolicyTrainer
from tests.helpers.tiny_tokenizer import tiny_tokenizer

RL = Path(ridgeline.rl.__file__).parent
ADAPTIVE_HOOKS = ("finished", "close", "metrics", "domain_report", "scale_weight")


@dataclass(frozen=True)
class Task:
    id: str
    domain: str


def test_the_fifo_and_the_scheduler_are_task_sources_and_only_the_scheduler_adapts():
    tasks = [Task("a", "x"), Task("b", "y")]
    fifo, sched = TaskSampler(tasks), DomainScheduler(tasks, slots=2)
    assert isinstance(fifo, TaskSource) and isinstance(sched, TaskSource)
    assert isinstance(sched, AdaptiveTaskSource) and isinstance(sched, MetricsSource)
    assert not isinstance(fifo, AdaptiveTaskSource)
    # no empty stand-ins for hooks a FIFO has no use for
    assert not any(hasattr(fifo, hook) for hook in ADAPTIVE_HOOKS)


def test_every_weights_sink_trainer_policy_and_rollout_has_its_interface():
    # a tokenizer: the agent talks to the engine through it (nothing is generated here)
    llm = LLM.from_hf_model(tiny_policy(), tiny_tokenizer(), num_kv_blocks=64, block_size=4,
                            max_num_seqs=4)
    try:
        remote = RemoteWeights("http://127.0.0.1:9/v1", "tiny")
        ray_weights = RayWeights([], types.ModuleType("ray"))
        for sink in (llm.worker, remote, WeightFanout([llm.worker, remote]), ray_weights):
            assert isinstance(sink, WeightsSink), sink
        remote.close()

        policy = Policy.from_module(tiny_policy())
        fake_ray = types.SimpleNamespace(get=lambda ref: policy.identity)
        actor = types.SimpleNamespace(identity=types.SimpleNamespace(remote=lambda: None))
        for trainer in (PolicyTrainer(policy), RayTrainer(actor, fake_ray)):
            assert isinstance(trainer, Trainer) and isinstance(trainer, ResumableTrainer)
        for p in (policy, RayPolicy(actor, fake_ray)):
            assert isinstance(p, CheckpointPolicy) and p.identity == policy.identity

        token = TokenTaskRollout(llm, shift_reward)
        agent = AgentRollout(EngineClient(llm), llm.tokenizer)
        ray_rollout = RayRollout([], fake_ray)
        assert all(isinstance(r, GroupRollout) for r in (token, agent, ray_rollout))
        # held-out evaluation plays single episodes: not the token family's rollout
        assert isinstance(agent, EpisodeRollout) and isinstance(ray_rollout, EpisodeRollout)
        assert not isinstance(token, EpisodeRollout)

        router = ReplicaRouter([EngineClient(llm), EngineClient(llm)])
        assert isinstance(EngineClient(llm), TokenGenerator) and isinstance(router, TokenGenerator)
        assert isinstance(router, MetricsSource) and not isinstance(EngineClient(llm),
                                                                    MetricsSource)
    finally:
        llm.worker.stop()


def test_the_ray_trainer_syncs_into_any_sink():
    """Ray's own sink reads the weights from the object store; any other gets them."""
    tensors = [("w", torch.ones(2))]

    class Sink:
        def __init__(self) -> None:
            self.got: list[tuple[list, int | None]] = []

        def update_weights(self, named_tensors, version=None) -> int:
            self.got.append((list(named_tensors), version))
            return 1

    store = {"ref": tensors}
    fake_ray = types.SimpleNamespace(get=lambda x: ["ref"] if x == "published" else store[x])
    actor = types.SimpleNamespace(publish=types.SimpleNamespace(remote=lambda v: "published"))
    trainer, sink = RayTrainer(actor, fake_ray), Sink()
    metrics = trainer.sync(sink)
    assert sink.got == [(tensors, 1)] and metrics["version"] == 1.0


def test_zero_variance_is_one_test_that_advantages_filters_and_curriculum_share():
    assert zero_variance([1.0, 1.0]) and zero_variance([0.5]) and zero_variance([])
    assert not zero_variance([0.0, 1.0]) and zero_variance([0.0, 1e-7], tol=1e-6)
    groups = [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.3, 0.3 + 1e-9]]
    flat = group_advantages(groups, normalize_std=False).zero_variance.tolist()
    skipped = [filter_group([EpisodeOutcome(reward=r) for r in g]).skipped for g in groups]
    assert flat == skipped == [zero_variance(g) for g in groups] == [True, False, False]
    cur = Curriculum(CurriculumConfig(min_episodes=2))
    cur.record("always", [True, True])
    cur.record("mixed", [True, False])
    assert cur.saturated("always") and not cur.saturated("mixed")


def test_the_engine_settings_are_the_engine_configs_fields():
    ours, engine = EngineSettings(), EngineConfig()
    for name in ("max_num_seqs", "max_model_len", "num_kv_blocks"):
        assert getattr(ours, name) == getattr(engine, name)
        assert EngineSettings.model_fields[name].metadata == \
            EngineConfig.model_fields[name].metadata       # the same bounds
    assert EngineSettings(max_model_len=512).engine_kwargs() == {
        "max_num_seqs": engine.max_num_seqs, "max_model_len": 512}


def _rl_imports(path: Path) -> set[str]:
    """Every `ridgeline.rl.*` module a file imports, lazy imports inside functions too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("ridgeline.rl.")}


def test_the_run_and_its_ray_path_do_not_import_each_other():
    assert "ridgeline.rl.run" not in _rl_imports(RL / "distributed.py")
    assert "ridgeline.rl.run" not in _rl_imports(RL / "parts.py")


def test_any_is_rare_in_rl():
    """Fewer than 10 `Any` per 1,000 lines: real types and protocols instead."""
    files = sorted(RL.glob("*.py"))
    lines = sum(len(f.read_text().splitlines()) for f in files)
    anys = sum(len(re.findall(r"\bAny\b", f.read_text())) for f in files)
    assert anys * 1000 / lines < 10, f"{anys} Any in {lines} lines"


def test_shift_tasks_are_tasks_of_a_task_source():
    sampler = TaskSampler(shift_tasks(0))
    draw, task = sampler.draw()
    assert draw == 0 and task.id == "shift-0" and isinstance(sampler, TaskSource)
