"""The trainer sharded over 2 processes (FSDP2 on gloo) against one process: the same
loss and the same updated weights after a step; a checkpoint written by 2 ranks resumes
in one process with the same weights, optimizer state and next step; bad input is a
ConfigError before any collective."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.helpers.engine_fixtures import tiny_model
from transformers import AutoModelForCausalLM

from ridgeline.errors import ConfigError
from ridgeline.rl import checkpoint, sharded
from ridgeline.rl.config import TrainConfig
from ridgeline.rl.policy import PolicyConfig, load_policy
from ridgeline.rl.run import export
from ridgeline.rl.sharded import DistributedConfig, ShardedTrainer
from ridgeline.rl.tokens import TokenBatch, TokenEpisode
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig

def episodes_batch(seed: int = 0, n: int = 5) -> TokenBatch:
    """Episodes of different lengths with prompt, policy and observation tokens; an odd
    count, so the two ranks get different numbers of micro-batches."""
    rng = random.Random(seed)
    eps = []
    for i in range(n):
        ep = TokenEpisode.start([rng.randrange(3, 500) for _ in range(3 + i)])
        for _ in range(2):
            k = rng.randint(2, 5)
            ep.add_completion([rng.randrange(3, 500) for _ in range(k)],
                              [-rng.uniform(4.0, 8.0) for _ in range(k)], [0] * k)
            ep.add_context([rng.randrange(3, 500) for _ in range(2)])
        eps.append(ep)
    return TokenBatch.of(eps, [rng.uniform(-1, 1) for _ in range(n)])


def model(tie: bool = False) -> torch.nn.Module:
    return tiny_model("llama", seed=3, tie=tie).train()


def trainer_config(aggregation: str) -> TrainerConfig:
    return TrainerConfig(lr=1e-2, micro_batch_size=1, dtype="float32",
                         aggregation=aggregation, gradient_checkpointing=False)


def _ranks(out: str, model_dir: str) -> None:
    """Each rank: (a) the policy of `model_dir`, a step on its share of the batch, a
    sharded checkpoint of the run's step 0; (b) a tied model with seq-mean-token-mean,
    one step; (c) one process's trainer state after a step (one.pt), resumed sharded,
    and the next step; then rank 1 fails while rank 0 waits in a collective."""
    env = sharded.current()
    assert env is not None and env.world_size == 2
    policy = load_policy(PolicyConfig(model=model_dir))
    first = ShardedTrainer(policy, trainer_config("token-mean"), env=env)
    second = ShardedTrainer(model(tie=True), trainer_config("seq-mean-token-mean"), env=env)
    third = ShardedTrainer(model(), trainer_config("token-mean"), env=env)
    if env.rank == 0:
        metrics = [first.step(episodes_batch())]
        checkpoint.save(Path(out), 0, policy=policy, trainer=first,
                        buffer_state={"ready": []}, sampler_state={}, identity=policy.identity)
        first.close()
        metrics.append(second.step(episodes_batch()))
        second.close()
        third.load_state_dict(torch.load(Path(out) / "one.pt", weights_only=False))
        metrics.append(third.step(episodes_batch(seed=1)))
        metrics.append({"num_steps": float(third.num_steps)})
        third.close()
        torch.save(metrics, Path(out) / "metrics.pt")
        dist.barrier()          # never passes: rank 1 fails
    else:
        first.follow()
        second.follow()
        third.follow()
        raise ConfigError("rank 1 fails here", hint="the launcher must end rank 0 too")


def test_two_ranks_step_as_one_process_resume_in_one_and_export(tmp_path):
    model_dir = tmp_path / "model"
    model().save_pretrained(model_dir)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(TrainConfig(
        policy=PolicyConfig(model=str(model_dir)), out=run).model_dump_json())
    one = PolicyTrainer(load_policy(PolicyConfig(model=str(model_dir))),
                        trainer_config("token-mean"))
    expected = [one.step(episodes_batch())]
    torch.save(one.state_dict(), run / "one.pt")
    tied = PolicyTrainer(model(tie=True), trainer_config("seq-mean-token-mean"))
    expected.append(tied.step(episodes_batch()))
    # rank 1's error ends the run (rank 0 is left waiting in a collective: no hang)
    with pytest.raises(ConfigError, match="rank 1 fails here"):
        sharded.launch(2, _ranks, (str(run), str(model_dir)),
                       DistributedConfig(timeout_s=120))
    got = torch.load(run / "metrics.pt")
    for metrics, want in zip(got, expected):
        assert metrics["policy_tokens"] == want["policy_tokens"]
        for k in ("loss", "grad_norm", "importance_ratio", "kl"):
            assert metrics[k] == pytest.approx(want[k], abs=1e-5), k

    # the checkpoint of 2 ranks, resumed by one process: same weights, AdamW state, step
    ckpt = checkpoint.load(run)
    assert ckpt.step + 1 == 1 and ckpt.sharded is not None
    resumed = PolicyTrainer(model(), trainer_config("token-mean"))
    checkpoint.restore_trainer(ckpt, resumed)
    assert (resumed.num_steps, resumed.version) == (1, 0)
    want, have = one.state_dict(), resumed.state_dict()
    assert want["model"].keys() == have["model"].keys()
    for k, v in want["model"].items():
        torch.testing.assert_close(have["model"][k], v, atol=1e-5, rtol=0, msg=k)
    assert want["optimizer"]["state"].keys() == have["optimizer"]["state"].keys()
    for i, s in want["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(have["optimizer"]["state"][i][k], s[k],
                                       atol=1e-5, rtol=0)
    # the Hugging Face files rank 0 wrote beside the shards are the trained weights
    saved = AutoModelForCausalLM.from_pretrained(ckpt.path)
    for k, v in saved.state_dict().items():
        torch.testing.assert_close(v, want["model"][k], atol=1e-5, rtol=0, msg=k)
    # `ridgeline train export`: a Hugging Face directory of the same weights
    exported = AutoModelForCausalLM.from_pretrained(export(run, tmp_path / "hf"))
    for k, v in exported.state_dict().items():
        torch.testing.assert_close(v, want["model"][k], atol=1e-5, rtol=0, msg=k)
    # and both go on to the same second step, as does one process's state resumed by 2
    batch = episodes_batch(seed=1)
    second = one.step(batch)
    assert resumed.step(batch)["loss"] == pytest.approx(second["loss"], abs=1e-5)
    assert got[2]["loss"] == pytest.approx(second["loss"], abs=1e-5)
    assert got[2]["grad_norm"] == pytest.approx(second["grad_norm"], abs=1e-5)
    assert got[3]["num_steps"] == 2


def test_bad_mesh_and_backend_are_config_errors_before_any_process(monkeypatch):
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        sharded.launch(3, print, (), DistributedConfig(shard_size=2))
    assert sharded.mesh_shape(4, 2) == (2, 2) and sharded.mesh_shape(2, None) == (2,)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="nccl"):
            sharded.launch(2, print, (), DistributedConfig(backend="nccl"))
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda name: False)
    with pytest.raises(ConfigError, match="no 'gloo' process group backend"):
        sharded.launch(2, print, (), DistributedConfig(backend="gloo"))
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="no torchrun environment"):
        sharded.init_distributed(DistributedConfig())


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    other = PolicyTrainer(tiny_model("llama", seed=3, vocab=256), trainer_config("token-mean"))
    sharded.save_trainer(other, tmp_path / "trainer")
    mine = PolicyTrainer(model(), trainer_config("token-mean"))
    before = {k: v.clone() for k, v in mine.model.state_dict().items()}
    with pytest.raises(ConfigError, match="other shapes than this model's"):
        sharded.load_trainer(mine, tmp_path / "trainer")
    assert all(torch.equal(v, mine.model.state_dict()[k]) for k, v in before.items())
    three_layers = PolicyTrainer(tiny_model("llama", seed=3, layers=3),
                               trainer_config("token-mean"))
    with pytest.raises(ConfigError, match="another model"):
        sharded.load_trainer(three_layers, tmp_path / "trainer")
