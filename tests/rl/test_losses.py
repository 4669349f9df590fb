"""The decoupled PPO loss on hand-computed tokens (each clipping branch, masks, both
aggregations, k1/k3, the behaviour weight and its cap), the step-0 invariants, the
direction of one SGD step on a tiny policy, and `token_logprobs` against a direct gather."""

from __future__ import annotations

import math

import pytest
import torch

from ridgeline.errors import ConfigError
from ridgeline.rl.losses import kl_estimate, policy_loss, token_logprobs

LN = math.log


def _one_token(log_ratio: float, adv: float, **kw):
    """The loss, metrics and d loss / d new_logprob of a single token with pi_new / pi_prox
    = exp(log_ratio) (behaviour = proximal unless given)."""
    behav = torch.tensor([[-1.0]])
    new = (behav + log_ratio).requires_grad_(True)
    loss, metrics = policy_loss(new, behav, torch.tensor([adv]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), metrics, new.grad.item()


def test_unclipped_ratio_gives_minus_ratio_times_advantage() -> None:
    loss, m, grad = _one_token(LN(1.1), 2.0)
    assert loss == pytest.approx(-2.2)
    assert grad == pytest.approx(-2.2)  # d(-r A)/d logp = -r A
    assert m["clip_fraction"] == 0.0 and m["importance_ratio"] == pytest.approx(1.1)


def test_clip_high_is_active_for_positive_advantage_above_one_plus_eps_high() -> None:
    loss, m, grad = _one_token(LN(1.5), 1.0, eps_low=0.2, eps_high=0.28)
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert m["clip_fraction"] == 1.0 and m["clip_high_fraction"] == 1.0
    assert m["clip_low_fraction"] == 0.0


def test_clip_higher_leaves_room_that_symmetric_clipping_does_not() -> None:
    sym_loss, sym, sym_grad = _one_token(LN(1.25), 1.0, eps_low=0.2, eps_high=0.2)
    dapo_loss, dapo, dapo_grad = _one_token(LN(1.25), 1.0, eps_low=0.2, eps_high=0.28)
    assert sym_loss == pytest.approx(-1.2) and sym_grad == 0.0 and sym["clip_fraction"] == 1
    assert dapo_loss == pytest.approx(-1.25) and dapo_grad == pytest.approx(-1.25)
    assert dapo["clip_fraction"] == 0.0


def test_clip_low_is_active_for_negative_advantage_below_one_minus_eps_low() -> None:
    loss, m, grad = _one_token(LN(0.5), -1.0, eps_low=0.2, eps_high=0.28)
    assert loss == pytest.approx(0.8)  # -min(-0.5, -0.8)
    assert grad == 0.0
    assert m["clip_fraction"] == 1.0 and m["clip_low_fraction"] == 1.0


@pytest.mark.parametrize("log_ratio,adv,expected", [
    (LN(1.5), -1.0, 1.5),   # A < 0, ratio high: the unclipped (worse) term wins
    (LN(0.5), 1.0, -0.5),   # A > 0, ratio low: likewise
])
def test_pessimistic_side_is_never_clipped(log_ratio: float, adv: float,
                                           expected: float) -> None:
    loss, m, grad = _one_token(log_ratio, adv)
    assert loss == pytest.approx(expected)
    assert grad == pytest.approx(expected)  # -r A
    assert m["clip_fraction"] == 0.0


def test_masked_tokens_are_ignored_even_when_garbage() -> None:
    new = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, float("-inf"), float("nan")]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    ent = torch.tensor([[0.5, float("nan"), 9.0]])
    loss, m = policy_loss(new, behav, torch.tensor([[3.0, float("nan"), 100.0]]), mask,
                          ref_logprobs=torch.tensor([[-1.0, float("nan"), 5.0]]),
                          kl_coef=0.1, entropy=ent)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0)
    assert new.grad.tolist() == [[pytest.approx(-3.0), 0.0, 0.0]]
    assert m["num_tokens"] == 1.0 and m["entropy"] == 0.5
    assert all(math.isfinite(v) for v in m.values())


def test_token_mean_versus_seq_mean_token_mean() -> None:
    # ratio 1 everywhere, so each token's loss is -A: seq 0 has one token, seq 1 three
    new = torch.zeros(2, 4, requires_grad=True)
    adv = torch.tensor([[4.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    tok, m = policy_loss(new, new.detach(), adv, mask, aggregation="token-mean")
    seq, _ = policy_loss(new, new.detach(), adv, mask, aggregation="seq-mean-token-mean")
    assert tok.item() == pytest.approx(-(4 + 1 + 2 + 3) / 4)
    assert seq.item() == pytest.approx(-(4 + (1 + 2 + 3) / 3) / 2)
    assert m["num_tokens"] == 4.0
    # a sequence without policy tokens does not count as a sequence
    mask3 = torch.cat([mask, torch.zeros(1, 4)])
    seq3, _ = policy_loss(torch.zeros(3, 4), torch.zeros(3, 4), torch.tensor([1.0, 1.0, 5.0]),
                          mask3, aggregation="seq-mean-token-mean")
    assert seq3.item() == pytest.approx(-1.0)


def test_sequence_advantages_broadcast_like_token_advantages() -> None:
    new = torch.log(torch.tensor([[0.5, 0.6, 0.2], [0.3, 0.9, 0.4]]))
    behav = torch.log(torch.tensor([[0.4, 0.5, 0.3], [0.3, 0.8, 0.5]]))
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    a = policy_loss(new, behav, torch.tensor([1.5, -0.5]), mask)
    b = policy_loss(new, behav, torch.tensor([[1.5] * 3, [-0.5] * 3]), mask)
    assert a[0].item() == pytest.approx(b[0].item()) and a[1] == b[1]


def test_k1_and_k3_values() -> None:
    x = torch.tensor([[LN(2.0), -LN(2.0), 0.0]])  # logprob - ref_logprob
    ref = torch.zeros(1, 3)
    assert kl_estimate(x, ref, "k1").tolist()[0] == pytest.approx([LN(2), -LN(2), 0.0])
    # k3 = exp(-x) + x - 1
    assert kl_estimate(x, ref, "k3").tolist()[0] == pytest.approx(
        [0.5 + LN(2) - 1, 2 - LN(2) - 1, 0.0])


@pytest.mark.parametrize("estimator,kl", [("k1", LN(2.0)), ("k3", 0.5 + LN(2.0) - 1)])
def test_kl_penalty_is_added_per_token(estimator: str, kl: float) -> None:
    behav = torch.tensor([[-1.0]])
    ref = behav - LN(2.0)  # new = behav, so ratio 1 and new - ref = ln 2
    args = (behav.clone(), behav, torch.tensor([1.0]), torch.ones(1, 1))
    loss, m = policy_loss(*args, ref_logprobs=ref, kl_coef=0.5, kl_estimator=estimator)
    assert loss.item() == pytest.approx(-1.0 + 0.5 * kl)
    assert m["kl_to_ref"] == pytest.approx(kl)
    # kl_coef = 0: measured, not added
    loss0, m0 = policy_loss(*args, ref_logprobs=ref, kl_coef=0.0, kl_estimator=estimator)
    assert loss0.item() == pytest.approx(-1.0) and m0["kl_to_ref"] == pytest.approx(kl)


def test_decoupled_weight_is_one_when_proximal_equals_behaviour() -> None:
    torch.manual_seed(0)
    behav = -torch.rand(3, 5) * 3
    new = behav + 0.3 * torch.randn(3, 5)
    adv, mask = torch.randn(3), (torch.rand(3, 5) > 0.3).float()
    standard, ms = policy_loss(new, behav, adv, mask)
    decoupled, md = policy_loss(new, behav, adv, mask, proximal_logprobs=behav.clone())
    assert decoupled.item() == pytest.approx(standard.item())
    assert md["behaviour_weight"] == pytest.approx(1.0) and ms["behaviour_weight"] == 1.0
    assert md == ms


def test_decoupled_weight_corrects_off_policy_tokens_and_is_capped() -> None:
    behav = torch.tensor([[-1.0]])
    prox = behav + LN(2.0)  # the proximal policy likes the token twice as much: w = 2
    new = (prox + LN(1.1)).requires_grad_(True)  # ratio to the proximal policy: 1.1
    loss, m = policy_loss(new, behav, torch.tensor([1.0]), torch.ones(1, 1),
                          proximal_logprobs=prox)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 * 1.1)
    assert new.grad.item() == pytest.approx(-2.0 * 1.1)
    assert m["importance_ratio"] == pytest.approx(1.1)
    assert m["behaviour_weight"] == pytest.approx(2.0)
    # clipping is relative to the proximal policy, not the behaviour one
    assert m["clip_fraction"] == 0.0
    capped, mc = policy_loss(new, behav, torch.tensor([1.0]), torch.ones(1, 1),
                             proximal_logprobs=prox, max_behaviour_weight=1.5)
    assert capped.item() == pytest.approx(-1.5 * 1.1)
    assert mc["behaviour_weight"] == pytest.approx(1.5) and mc["behaviour_weight_capped"] == 1


def test_step_zero_invariants_kl_zero_ratio_one() -> None:
    torch.manual_seed(1)
    behav = -torch.rand(4, 6) * 5
    mask = (torch.rand(4, 6) > 0.5).float()
    loss, m = policy_loss(behav.clone(), behav, torch.randn(4), mask,
                          ref_logprobs=behav.clone(), kl_coef=0.1)
    assert m["kl"] == 0.0 and m["kl_to_ref"] == 0.0
    assert m["importance_ratio"] == 1.0 and m["behaviour_weight"] == 1.0
    assert m["clip_fraction"] == 0.0


def test_kl_metric_is_k3_of_new_versus_behaviour() -> None:
    behav = torch.tensor([[-1.0, -2.0]])
    new = behav + torch.tensor([[LN(2.0), 0.0]])
    _, m = policy_loss(new, behav, torch.tensor([1.0]), torch.tensor([[1.0, 1.0]]))
    assert m["kl"] == pytest.approx((0.5 + LN(2) - 1) / 2)


def test_all_masked_batch_gives_zero_loss_that_backpropagates() -> None:
    new = torch.zeros(2, 3, requires_grad=True)
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, m = policy_loss(new, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3),
                              aggregation=agg)
        loss.backward()
        assert loss.item() == 0.0 and m["num_tokens"] == 0.0 and m["clip_fraction"] == 0.0
        assert new.grad.abs().sum() == 0


def test_positive_advantage_raises_the_chosen_tokens_logprob() -> None:
    torch.manual_seed(0)
    policy = torch.nn.Linear(8, 5)
    states = torch.randn(1, 3, 8)
    tokens = torch.tensor([[1, 3, 2]])

    def logprobs() -> torch.Tensor:
        return torch.log_softmax(policy(states), -1).gather(-1, tokens[..., None])[..., 0]

    for adv in (1.0, -1.0):
        before = logprobs().detach()
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        loss, _ = policy_loss(logprobs(), before, torch.tensor([adv]), torch.ones(1, 3))
        opt.zero_grad()
        loss.backward()
        opt.step()
        change = (logprobs().detach() - before).sum().item()
        assert change > 0 if adv > 0 else change < 0


def _bad(**kw):
    args = dict(new_logprobs=torch.zeros(2, 3), behaviour_logprobs=torch.zeros(2, 3),
                advantages=torch.zeros(2), loss_mask=torch.ones(2, 3))
    args.update(kw)
    return lambda: policy_loss(**args)


@pytest.mark.parametrize("call,match", [
    (_bad(aggregation="seq-sum"), "aggregation"),
    (_bad(kl_estimator="k2", ref_logprobs=torch.zeros(2, 3)), "estimator"),
    (_bad(behaviour_logprobs=torch.zeros(2, 4)), "behaviour_logprobs"),
    (_bad(proximal_logprobs=torch.zeros(3, 3)), "proximal_logprobs"),
    (_bad(ref_logprobs=torch.zeros(2, 2)), "ref_logprobs"),
    (_bad(loss_mask=torch.ones(2)), "loss_mask"),
    (_bad(advantages=torch.zeros(3)), "advantages"),
    (_bad(new_logprobs=torch.zeros(2, 3, 1)), "new_logprobs"),
    (_bad(entropy=torch.zeros(1, 3)), "entropy"),
    (_bad(kl_coef=0.1), "ref_logprobs"),
    (_bad(eps_low=1.0), "eps_low"),
    (_bad(max_behaviour_weight=0.0), "max_behaviour_weight"),
    (_bad(rollout_correction="clip"), "rollout correction"),
    (_bad(correction_level="batch"), "level"),
    (_bad(rollout_correction="mis"), "needs max_behaviour_weight"),
    (_bad(rollout_correction="mis", max_behaviour_weight=2.0, min_behaviour_weight=3.0),
     "below"),
    (_bad(min_behaviour_weight=0.5, max_behaviour_weight=2.0), "only applies"),
    (_bad(correction_level="sequence"), "without a cap"),
])
def test_bad_arguments_raise_config_error(call, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        call()


def _direct(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logprob of ids[:, t] from log_softmax(logits[:, t - 1]), one position at a time."""
    out = torch.zeros(ids.shape)
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            out[b, t] = torch.log_softmax(logits[b, t - 1].float(), -1)[ids[b, t]]
    return out


def test_token_logprobs_equal_a_direct_gather_of_shifted_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7) * 3
    ids = torch.randint(0, 7, (2, 5))
    lp, ent = token_logprobs(logits, ids, with_entropy=True)
    assert torch.allclose(lp, _direct(logits, ids), atol=1e-6)
    assert lp[:, 0].abs().sum() == 0 and ent[:, 0].abs().sum() == 0
    expected_ent = torch.distributions.Categorical(logits=logits[:, :-1]).entropy()
    assert torch.allclose(ent[:, 1:], expected_ent, atol=1e-5)
    assert torch.equal(token_logprobs(logits, ids), lp)
    hot = token_logprobs(logits, ids, temperature=0.5)
    assert torch.allclose(hot, _direct(logits / 0.5, ids), atol=1e-5)


def test_token_logprobs_is_stable_and_float32_under_bf16_autocast() -> None:
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 50)
    x = torch.randn(2, 6, 16) * 100  # logits in the thousands: naive softmax overflows
    ids = torch.randint(0, 50, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = proj(x)
        lp = token_logprobs(logits, ids)
    assert logits.dtype == torch.bfloat16 and lp.dtype == torch.float32
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    assert torch.allclose(lp, _direct(logits.float(), ids), atol=1e-4)


def test_token_logprobs_gradient_flows_to_the_logits() -> None:
    logits = torch.zeros(1, 3, 4, requires_grad=True)
    token_logprobs(logits, torch.tensor([[0, 2, 1]])).sum().backward()
    # d log p(2) / d logits[0, 0] = onehot(2) - softmax = 1 - 1/4 at 2, -1/4 elsewhere
    assert logits.grad[0, 0].tolist() == pytest.approx([-0.25, -0.25, 0.75, -0.25])
    assert logits.grad[0, 2].abs().sum() == 0  # the last position predicts nothing here


@pytest.mark.parametrize("logits,ids", [
    (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)),
    (torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long)),
    (torch.zeros(1, 2, 4), torch.tensor([[0, 4]])),
    (torch.zeros(1, 2, 4), torch.tensor([[0, -100]])),
])
def test_token_logprobs_bad_arguments(logits: torch.Tensor, ids: torch.Tensor) -> None:
    with pytest.raises(ConfigError):
        token_logprobs(logits, ids)


# ---- rollout corrections: w = pi_prox / pi_behav per token or per sequence ---------------

def _weighted(log_w: list[list[float]], mask: list[list[float]] | None = None, **kw):
    """Loss, metrics and d loss / d new for tokens with ratio 1 to the proximal policy,
    advantage 1 and behaviour weight exp(log_w): each token's loss is -w (token-mean)."""
    log_w_t = torch.tensor(log_w)
    prox = torch.full_like(log_w_t, -1.0)
    new = prox.clone().requires_grad_(True)
    mask_t = torch.ones_like(log_w_t) if mask is None else torch.tensor(mask)
    loss, m = policy_loss(new, prox - log_w_t, torch.ones(len(log_w)), mask_t,
                          proximal_logprobs=prox, **kw)
    loss.backward()
    return loss.item(), m, new.grad


def test_mis_zeroes_the_tokens_outside_the_thresholds_and_tis_truncates_them() -> None:
    log_w = [[LN(0.2), LN(0.8), LN(1.5), LN(4.0)]]
    loss, m, grad = _weighted(log_w, rollout_correction="mis", max_behaviour_weight=2.0,
                              min_behaviour_weight=0.5)
    # kept: 0.8 and 1.5; masked tokens weigh 0 but stay in the mean's denominator
    assert loss == pytest.approx(-(0.8 + 1.5) / 4)
    assert grad.tolist()[0] == pytest.approx([0.0, -0.8 / 4, -1.5 / 4, 0.0])
    assert m["behaviour_weight_masked"] == 0.5 and m["behaviour_weight_capped"] == 0.0
    assert m["behaviour_weight"] == pytest.approx((0.8 + 1.5) / 4)
    loss, m, grad = _weighted(log_w, rollout_correction="tis", max_behaviour_weight=2.0)
    assert loss == pytest.approx(-(0.2 + 0.8 + 1.5 + 2.0) / 4)
    assert m["behaviour_weight_capped"] == 0.25 and m["behaviour_weight_masked"] == 0.0
    # mis without a lower bound keeps the small weights
    loss, m, _ = _weighted(log_w, rollout_correction="mis", max_behaviour_weight=2.0)
    assert loss == pytest.approx(-(0.2 + 0.8 + 1.5) / 4) and m["behaviour_weight_masked"] == 0.25
    # none: w = 1, the mismatch ignored
    loss, m, _ = _weighted(log_w, rollout_correction="none")
    assert loss == pytest.approx(-1.0) and m["behaviour_weight"] == 1.0


def test_sequence_level_weights_are_the_product_over_each_sequence() -> None:
    # sequence 0: w = 2 * 1.5 = 3 (over the cap 2.5), sequence 1: 0.5 * 2 = 1 (2 tokens, the
    # third is masked out of the loss and does not count)
    log_w = [[LN(2.0), LN(1.5), 0.0], [LN(0.5), LN(2.0), 7.0]]
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    loss, m, grad = _weighted(log_w, mask, rollout_correction="tis", correction_level="sequence",
                              max_behaviour_weight=2.5)
    assert loss == pytest.approx(-(2.5 * 2 + 1.0 * 2) / 4)
    assert grad.tolist() == [[pytest.approx(-2.5 / 4)] * 2 + [0.0],
                             [pytest.approx(-1.0 / 4)] * 2 + [0.0]]
    assert m["behaviour_weight_capped"] == 0.5
    loss, m, grad = _weighted(log_w, mask, rollout_correction="mis", correction_level="sequence",
                              max_behaviour_weight=2.5)
    assert loss == pytest.approx(-(1.0 * 2) / 4) and m["behaviour_weight_masked"] == 0.5
    assert grad[0].abs().sum() == 0     # the whole sequence is masked
    # geometric: sequence 0's weight is sqrt(3) (under the cap), sequence 1's is 1
    loss, m, _ = _weighted(log_w, mask, rollout_correction="mis", correction_level="geometric",
                           max_behaviour_weight=2.5)
    assert loss == pytest.approx(-(3 ** 0.5 * 2 + 2) / 4) and m["behaviour_weight_masked"] == 0


def test_a_sequence_product_beyond_float_range_is_masked_or_truncated_not_inf() -> None:
    log_w = [[50.0] * 4]          # e^200: inf in float32
    for correction in ("tis", "mis"):
        loss, m, grad = _weighted(log_w, rollout_correction=correction,
                                  correction_level="sequence", max_behaviour_weight=2.0)
        assert math.isfinite(loss) and torch.isfinite(grad).all()
        assert m["behaviour_weight"] == (2.0 if correction == "tis" else 0.0)


def test_mismatch_metrics_on_hand_computed_tokens() -> None:
    # trainer vs behaviour: token log ratios ln 2 and 0 in sequence 0, -ln 2 in sequence 1
    behav = torch.tensor([[-1.0, -2.0], [-1.0, -3.0]])
    trainer = behav + torch.tensor([[LN(2.0), 0.0], [-LN(2.0), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    _, m = policy_loss(trainer, behav, torch.ones(2), mask)
    k3 = [(2 - 1 - LN(2)), 0.0, (0.5 - 1 + LN(2))]      # r - 1 - log r, r = pi / mu
    assert m["mismatch/kl_k3"] == pytest.approx(sum(k3) / 3)
    assert m["mismatch/kl_k1"] == pytest.approx((-LN(2) + 0 + LN(2)) / 3)
    # per sequence mean of log mu - log pi: -ln2 / 2 and ln 2; then over the sequences
    assert m["mismatch/log_ppl_ratio"] == pytest.approx((-LN(2) / 2 + LN(2)) / 2)
    _, same = policy_loss(behav.clone(), behav, torch.ones(2), mask)
    assert same["mismatch/kl_k3"] == 0.0 and same["mismatch/log_ppl_ratio"] == 0.0
