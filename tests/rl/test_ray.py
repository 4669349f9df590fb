"""The same run on a local Ray cluster started by the test: two rollout workers (each
with its own engine replica) and a trainer actor complete steps identical in shape to
the single-process run, and every worker's engine holds each new weights version."""

from __future__ import annotations

import pytest

from ridgeline.errors import ConfigError
from ridgeline.rl.digits import tiny_policy
from ridgeline.rl.run import TrainConfig, train
from ridgeline.rl.run_log import read_metrics

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(model, out, **over) -> TrainConfig:
    cfg = {"policy": {"model": str(model)}, "tasks": {"source": "shift"}, "steps": 3,
           "out": str(out), "plots": False, "checkpoint_every": 3,
           "trainer": {"lr": 5e-4, "micro_batch_size": 64},
           "loop": {"group_size": 8, "batch_groups": 4, "eta": 1, "rollout_threads": 4},
           "engine": {"max_num_seqs": 64, "num_kv_blocks": 256}}
    cfg.update(over)
    return TrainConfig.model_validate(cfg)


# the loop's own numbers; time splits and transport details differ by design
SHAPE_KEYS = {"reward_mean", "pass_rate", "staleness_max", "staleness_mean", "policy_tokens",
              "episodes_masked", "groups_skipped", "version", "loss", "kl", "entropy",
              "clip_fraction", "importance_ratio", "grad_norm"}


def test_two_workers_and_a_trainer_actor_run_steps_like_one_process(tmp_path, cluster):
    model = tmp_path / "model"
    tiny_policy(0).save_pretrained(model)
    single = train(config(model, tmp_path / "one"))
    ray_cfg = {"enabled": True, "rollout_workers": 2, "worker_cpus": 0.5, "trainer_cpus": 0.5}
    spread = train(config(model, tmp_path / "ray", ray=ray_cfg))
    assert single.steps_done == spread.steps_done == 3
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ray")
    for x, y in zip(a, b):
        keys = SHAPE_KEYS & set(x)
        assert keys == SHAPE_KEYS & set(y) and len(keys) >= 10
        # whole groups of 8 episodes of 3 sampled tokens (flat groups are skipped)
        assert x["policy_tokens"] % 24 == 0 and y["policy_tokens"] % 24 == 0
    assert [m["version"] for m in b] == [1.0, 2.0, 3.0]
    last = b[-1]
    assert last["ray/worker/0/version"] == last["ray/worker/1/version"] == 3.0
    assert last["ray/worker/0/groups"] > 0 and last["ray/worker/1/groups"] > 0
    # the trainer actor wrote the checkpoint: a model directory with the trained weights
    assert (tmp_path / "ray" / "checkpoint" / "model.safetensors").is_file()


def test_ray_with_a_served_engine_is_refused_at_the_start(tmp_path, cluster):
    cfg = config(tmp_path / "none", tmp_path / "run",
                 tasks={"source": "builtin", "ids": ["hello-file"], "check": False},
                 ray={"enabled": True}, engine={"url": "http://127.0.0.1:9/v1"})
    with pytest.raises(ConfigError, match="ray.enabled and engine.url"):
        train(cfg)
