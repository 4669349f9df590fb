"""Sequence packing: episodes run as one row per micro-batch (no padding), position ids
restarting per episode and attention confined to each; logprobs, loss and gradients equal
the padded path's, and a model that would let packed episodes see each other is refused."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.engine_fixtures import tiny_model
from tests.rl.test_trainer import multi_turn_episodes

from ridgeline.engine import LLM
from ridgeline.errors import ConfigError
from ridgeline.rl.tokens import TokenBatch, TokenEpisode
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig, _first_fit


@pytest.fixture(scope="module")
def episodes() -> list[TokenEpisode]:
    """Episodes of very different lengths (1 to 4 turns)."""
    llm = LLM.from_hf_model(tiny_model("llama", seed=4), num_kv_blocks=256, block_size=4)
    short = multi_turn_episodes(llm, turns=1)
    long = multi_turn_episodes(llm, turns=4, seed=3)
    return [short[0], long[0], short[1], long[1], short[2], short[3]]


ADVANTAGES = [1.0, -0.5, 0.5, -1.0, 0.25, 0.75]


def test_packed_logprobs_equal_padded_and_episodes_do_not_see_each_other(episodes):
    model = tiny_model("llama", seed=4)
    batch = TokenBatch.of(episodes, ADVANTAGES)
    padded = PolicyTrainer(model, TrainerConfig())
    packed = PolicyTrainer(model, TrainerConfig(pack=True, micro_batch_tokens=10_000))
    lp, ent = padded.logprobs(batch)
    plp, pent = packed.logprobs(batch)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(plp[mask], lp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(pent[mask], ent[mask], rtol=0, atol=1e-4)
    assert (plp[~mask] == 0).all()
    # changing the first episode's tokens leaves every other episode's logprobs as they were
    other = TokenBatch.of(episodes, ADVANTAGES)
    other.token_ids[0, : int(other.attention_mask[0].sum())] = 7
    changed, _ = packed.logprobs(other)
    torch.testing.assert_close(changed[1:][mask[1:]], plp[1:][mask[1:]], rtol=0, atol=1e-5)
    assert (changed[0] - plp[0])[mask[0]].abs().max() > 1e-2


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_step_has_the_padded_loss_and_gradient(episodes, aggregation, checkpointing):
    batch = TokenBatch.of(episodes, ADVANTAGES)
    total = int(batch.attention_mask.sum())
    common = dict(aggregation=aggregation, gradient_checkpointing=checkpointing,
                  max_behaviour_weight=None, logprob_chunk_tokens=7)
    model = tiny_model("llama", seed=4)
    padded = PolicyTrainer(model, TrainerConfig(micro_batch_size=2, **common))
    # a budget of about half the tokens: several packed rows, episodes of both lengths mixed
    packed = PolicyTrainer(model, TrainerConfig(pack=True, micro_batch_tokens=total // 2,
                                                **common))
    parts = list(packed._micro_batches(batch))
    assert len(parts) >= 2
    g_pad, g_pack = padded.gradient(batch), packed.gradient(batch)
    torch.testing.assert_close(g_pack, g_pad, rtol=0, atol=1e-5)
    # the loss: the same step from the same weights on two copies
    a = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(micro_batch_size=2, **common))
    b = PolicyTrainer(tiny_model("llama", seed=4),
                      TrainerConfig(pack=True, micro_batch_tokens=total // 2, **common))
    ma, mb = a.step(batch), b.step(batch)
    assert mb["loss"] == pytest.approx(ma["loss"], abs=1e-5)
    assert ma["loss"] != 0.0
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=name)


def test_packed_micro_batches_fill_the_token_budget_without_padding(episodes):
    batch = TokenBatch.of(episodes, ADVANTAGES)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    budget = max(lengths) + min(lengths)
    trainer = PolicyTrainer(tiny_model("llama", seed=4),
                            TrainerConfig(pack=True, micro_batch_tokens=budget))
    parts = list(trainer._micro_batches(batch))
    seen = sorted(float(x) for p in parts for x in p.advantages)
    assert seen == sorted(ADVANTAGES)                  # every episode once
    assert all(int(p.attention_mask.sum()) <= budget for p in parts)
    padded = PolicyTrainer(tiny_model("llama", seed=4),
                           TrainerConfig(micro_batch_tokens=budget))
    assert len(parts) < len(list(padded._micro_batches(batch)))
    # first fit: an episode over the budget goes alone, the others share
    assert _first_fit([9, 3, 4, 2, 1], 6) == [[0], [2, 3], [1, 4]]


def test_packing_a_model_whose_attention_ignores_position_ids_is_refused():
    model = tiny_model("llama", seed=1)
    decoder = model.get_decoder()
    forward = decoder.forward

    def leaky(*args, position_ids=None, **kwargs):  # positions and the mask from them lost
        return forward(*args, **kwargs)

    decoder.forward = leaky
    with pytest.raises(ConfigError, match="packed episodes apart"):
        PolicyTrainer(model, TrainerConfig(pack=True))
    PolicyTrainer(model, TrainerConfig())           # unpacked it is fine


def test_pack_without_a_token_budget_or_a_decoder_is_a_config_error():
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        PolicyTrainer(tiny_model("llama"), TrainerConfig(pack=True, micro_batch_tokens=None))
    with pytest.raises(ConfigError, match="cannot be packed"):
        PolicyTrainer(torch.nn.Linear(2, 2), TrainerConfig(pack=True))


def test_packed_supervised_step_matches_padded(episodes):
    batch = TokenBatch.of(episodes, ADVANTAGES)
    # plain SGD at lr 1: the weight change is the gradient (AdamW's first step is about
    # lr * sign(grad), which a float32 difference in a near-zero gradient can flip)
    trainers = []
    for pack in (False, True):
        t = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(pack=pack, grad_clip=None))
        t.optimizer = torch.optim.SGD(t.params, lr=1.0)
        trainers.append(t)
    before = [p.detach().clone() for p in trainers[0].params]
    ma, mb = (t.supervised_step(batch) for t in trainers)
    assert mb["sft/nll"] == pytest.approx(ma["sft/nll"], abs=1e-5)
    moved = 0.0
    after = [[p.detach() for p in t.params] for t in trainers]
    for p0, p, q in zip(before, *after):
        torch.testing.assert_close(q - p0, p - p0, rtol=0, atol=1e-5)
        moved = max(moved, float((p - p0).abs().max()))
    assert moved > 1e-3
