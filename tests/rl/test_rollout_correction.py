"""Rollout corrections against a sampler on another numeric path: episodes sampled by a
bf16 (and an int8-weight) engine, trained by the float32 trainer. The mismatch metrics see
the difference (and nothing with a float32 engine), TIS truncates and MIS masks exactly the
tokens / sequences the thresholds say, and the metrics reach the run's log and plots."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.engine_fixtures import tiny_model
from tests.rl.test_trainer import multi_turn_episodes

from ridgeline.engine import LLM
from ridgeline.errors import ConfigError
from ridgeline.rl.run_log import RunLog, read_metrics
from ridgeline.rl.run_plots import plot_run
from ridgeline.rl.tokens import TokenBatch
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig

ADVANTAGES = [1.0, -1.0, 0.5, -0.5]
ENGINES = {"float32": {}, "bfloat16": {"dtype": "bfloat16"},
           "int8": {"dtype": "bfloat16", "weight_quant": "int8"}}


@pytest.fixture(scope="module")
def batches() -> dict[str, TokenBatch]:
    """The same tiny policy sampled (3 turns, 36 policy tokens per episode) by an engine of
    each numeric path."""
    out = {}
    for name, kw in ENGINES.items():
        llm = LLM.from_hf_model(tiny_model("llama", seed=4), num_kv_blocks=256, block_size=4,
                                **kw)
        out[name] = TokenBatch.of(multi_turn_episodes(llm, turns=3), ADVANTAGES)
    return out


def _log_weights(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi_trainer - log pi_behaviour per token (the float32 trainer, before a step),
    and the loss mask as bool."""
    with torch.no_grad():
        trainer, _ = PolicyTrainer(tiny_model("llama", seed=4)).logprobs(batch)
    mask = batch.loss_mask.bool()
    return torch.where(mask, trainer - batch.behaviour_logprobs, 0.0), mask


def test_mismatch_metrics_see_a_bf16_or_int8_sampler_and_not_a_float32_one(batches):
    metrics = {name: PolicyTrainer(tiny_model("llama", seed=4)).step(b)
               for name, b in batches.items()}
    fp32, bf16, int8 = metrics["float32"], metrics["bfloat16"], metrics["int8"]
    assert fp32["mismatch/kl_k3"] < 1e-7 and abs(fp32["mismatch/log_ppl_ratio"]) < 1e-5
    assert bf16["mismatch/kl_k3"] > 1e-5 > 100 * fp32["mismatch/kl_k3"]
    assert int8["mismatch/kl_k3"] > bf16["mismatch/kl_k3"]
    # the estimate is the k3 one of the trainer's own logprobs against the recorded ones
    log_r, mask = _log_weights(batches["int8"])
    k3 = (torch.expm1(log_r) - log_r)[mask].mean().item()
    assert int8["mismatch/kl_k3"] == pytest.approx(k3, rel=1e-4)
    per_seq = -(log_r.sum(1) / mask.sum(1))
    assert int8["mismatch/log_ppl_ratio"] == pytest.approx(per_seq.mean().item(), abs=1e-6)


@pytest.mark.parametrize("engine", ["bfloat16", "int8"])
def test_token_level_mis_masks_and_tis_truncates_the_mismatched_tokens(batches, engine):
    batch = batches[engine]
    log_w, mask = _log_weights(batch)
    hi, lo = 1.005, 1 / 1.005
    above = (log_w > math.log(hi))[mask].float().mean().item()
    outside = ((log_w > math.log(hi)) | (log_w < math.log(lo)))[mask].float().mean().item()
    assert 0 < above < outside < 1      # the sampler really is off, on some tokens only
    mis = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(
        rollout_correction="mis", max_behaviour_weight=hi, min_behaviour_weight=lo))
    m = mis.step(batch)
    assert m["behaviour_weight_masked"] == pytest.approx(outside)
    assert m["behaviour_weight_capped"] == 0.0
    tis = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(
        rollout_correction="tis", max_behaviour_weight=hi))
    m = tis.step(batch)
    assert m["behaviour_weight_capped"] == pytest.approx(above)
    assert m["behaviour_weight_masked"] == 0.0
    # masking really removes those tokens' pull: the gradient differs from no correction
    none = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(rollout_correction="none"))
    mis2 = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(
        rollout_correction="mis", max_behaviour_weight=hi, min_behaviour_weight=lo))
    g_none, g_mis = none.gradient(batch), mis2.gradient(batch)
    assert (g_none - g_mis).norm() > 0.1 * g_none.norm()


def test_sequence_level_mis_masks_whole_episodes(batches):
    batch = batches["int8"]
    log_w, mask = _log_weights(batch)
    per_seq = log_w.sum(dim=1)                  # log of the product over each episode
    sizes = per_seq.abs().sort().values
    cap = math.exp(float(sizes[1] + sizes[2]) / 2)     # two episodes inside, two outside
    dropped = per_seq.abs() > math.log(cap)
    assert int(dropped.sum()) == 2
    share = (mask.sum(1) * dropped).sum() / mask.sum()
    trainer = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(
        rollout_correction="mis", rollout_correction_level="sequence",
        max_behaviour_weight=cap, min_behaviour_weight=1 / cap))
    m = trainer.step(batch)
    assert m["behaviour_weight_masked"] == pytest.approx(float(share))


def test_mismatch_metrics_reach_the_run_log_and_its_plots(batches, tmp_path):
    trainer = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(
        rollout_correction="mis", max_behaviour_weight=1.005))
    with RunLog(tmp_path, tensorboard=False) as run:
        for step in range(2):
            run.log(step, trainer.step(batches["bfloat16"]))
    records = read_metrics(tmp_path)
    assert all(r["mismatch/kl_k3"] > 0 and "behaviour_weight_masked" in r for r in records)
    paths = plot_run(tmp_path)
    assert paths["mismatch"].exists() and paths["mismatch"].stat().st_size > 1000


@pytest.mark.parametrize("config,match", [
    (dict(rollout_correction="mis", max_behaviour_weight=None), "needs max_behaviour_weight"),
    (dict(rollout_correction="tis", rollout_correction_level="sequence",
          max_behaviour_weight=None), "without a cap"),
    (dict(rollout_correction="mis", decoupled=False), "decoupled"),
    (dict(rollout_correction="mis", min_behaviour_weight=6.0), "below"),
    (dict(min_behaviour_weight=0.5), "only applies"),
])
def test_bad_correction_options_are_config_errors_at_start(config, match):
    with pytest.raises(ConfigError, match=match):
        PolicyTrainer(tiny_model("llama"), TrainerConfig(**config))
    # the default stays valid with the coupled loss (the correction then does not apply)
    PolicyTrainer(tiny_model("llama"), TrainerConfig(decoupled=False))
