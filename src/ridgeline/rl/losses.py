"""The token-level policy loss of asynchronous RL, and the logprobs it is computed from.

`policy_loss` is the decoupled PPO objective (Hilton et al. 2021, "Batch size-invariance
for policy optimization"; AReaL): with rollouts sampled by a *behaviour* policy that may be
several versions behind, the trust region is anchored to a *proximal* policy instead:

    r = pi_new / pi_prox                 (the PPO ratio, clipped)
    w = pi_prox / pi_behav               (importance weight, detached, optionally capped)
    loss_t = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)   [+ kl_coef * KL_t]

With proximal = behaviour (the default, `proximal_logprobs=None`) w = 1 and this is
standard PPO. Without the correction, naive PPO on stale samples collapses (AReaL: 42 ->
23 AIME24 at staleness 4; the decoupled objective kept 42). `eps_high > eps_low` is DAPO's
clip-higher, which lets rare tokens grow and keeps entropy from collapsing.

w is also the *rollout correction* between the sampler and the trainer (slime, verl and
NeMo-RL's TIS/MIS): the sampler's logprobs come from another numeric path (a bf16 or int8
engine, other kernels) and, asynchronously, older weights, so pi_behav != pi_prox even on
fresh tokens. `rollout_correction` says how w enters the loss: "tis" truncates it at
`max_behaviour_weight` (None: plain importance sampling), "mis" zeroes the tokens whose w
lies outside [`min_behaviour_weight`, `max_behaviour_weight`] (a masked token still counts
in the mean's denominator, so the loss scale does not move with the share masked), "none"
uses w = 1 (the mismatch ignored). `correction_level`: "token" (w per token), "sequence"
(prod_t w_t, one weight for all of a sequence's tokens) or "geometric" (its geometric
mean, exp(mean_t log w_t): comparable across lengths, where the product of a long agent
episode is almost always far from 1).

Tokens are aggregated by "token-mean" (every unmasked token in the batch weighs the same:
Dr.GRPO, DAPO; long answers are not down-weighted per token) or "seq-mean-token-mean"
(original GRPO: mean over each sequence's tokens, then over sequences).

Shapes: B sequences, T positions (right-padded), V vocabulary. Logprob tensors are [B, T]
and aligned with the token ids: position t holds the logprob of token t given tokens < t.
Values at positions where `loss_mask` is 0 are ignored, even NaN or -inf.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
from torch.utils.checkpoint import checkpoint

from ridgeline.errors import ConfigError

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k3")
CORRECTIONS = ("none", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
#: metrics that are means over sequences, not tokens (a trainer accumulating micro-batches
#: weighs them by sequences)
SEQUENCE_METRICS = ("mismatch/log_ppl_ratio",)


def policy_loss(
    new_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    max_behaviour_weight: float | None = None,
    min_behaviour_weight: float | None = None,
    rollout_correction: str = "tis",
    correction_level: str = "token",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token-mean",
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled clipped policy loss (a scalar to minimise) and its metrics.

    new_logprobs [B, T]: the current policy's, with grad. behaviour_logprobs [B, T]: what
    the sampler recorded. proximal_logprobs [B, T] or None (= behaviour): the policy the
    update is anchored to. advantages [B] (one per sequence) or [B, T]. loss_mask [B, T]:
    1 on policy tokens only. rows are sequences (the sequence levels need it).
    rollout_correction / correction_level / max_behaviour_weight / min_behaviour_weight:
    how w = pi_prox / pi_behav weighs each token (the module docstring; "tis" with
    max_behaviour_weight None is uncapped importance sampling). ref_logprobs [B, T] with
    kl_coef > 0 adds kl_coef * KL(new || ref) per token ("k1": log ratio, unbiased; "k3": Schulman's
    exp(-x) + x - 1, unbiased and never negative); with kl_coef = 0 it is only measured.
    entropy [B, T] (per-token entropies of the new policy) is only measured.

    Metrics (floats, token-means over unmasked tokens): clip_fraction (the clipped term
    was the active one), clip_low_fraction / clip_high_fraction (of all tokens),
    importance_ratio (pi_new / pi_prox), behaviour_weight (after the correction),
    behaviour_weight_capped (share of tokens truncated at the cap, "tis"),
    behaviour_weight_masked (share of tokens zeroed, "mis"), kl (k3 estimate of
    KL(new || behaviour): 0 exactly when they agree; the step-0 invariant), entropy and
    kl_to_ref when given, num_tokens, and the sampler/trainer mismatch on the recorded
    tokens (`mismatch_metrics`: mismatch/kl_k3, mismatch/kl_k1, mismatch/log_ppl_ratio).
    """
    _check_options(aggregation, kl_estimator, eps_low, eps_high, max_behaviour_weight,
                   kl_coef, ref_logprobs, rollout_correction, correction_level,
                   min_behaviour_weight)
    shape = _check_shapes(new_logprobs, behaviour_logprobs, advantages, loss_mask,
                          proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                          entropy=entropy)
    mask = loss_mask.to(torch.bool)
    fmask = mask.to(new_logprobs.dtype)
    adv = advantages.detach().to(new_logprobs.dtype)
    adv = adv[:, None].expand(shape) if adv.dim() == 1 else adv
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    behav = behaviour_logprobs.detach()
    prox = behav if proximal_logprobs is None else proximal_logprobs.detach()

    log_ratio = _masked(new_logprobs - prox, mask)
    ratio = torch.exp(log_ratio)
    weight, capped, dropped = behaviour_weights(
        prox, behav, mask, rollout_correction, correction_level, max_behaviour_weight,
        min_behaviour_weight)
    surrogate, clipped_low, clipped_high = _clipped_surrogate(ratio, adv, eps_low, eps_high)
    per_token = -weight * surrogate

    kl_ref = None
    if ref_logprobs is not None:
        kl_ref = kl_estimate(new_logprobs, ref_logprobs.detach(), kl_estimator, mask)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl_ref
    loss = aggregate(per_token, fmask, aggregation)

    with torch.no_grad():
        behav_kl = kl_estimate(new_logprobs.detach(), behav, "k3", mask)
        metrics = {
            "clip_fraction": _token_mean(clipped_low | clipped_high, mask),
            "clip_low_fraction": _token_mean(clipped_low, mask),
            "clip_high_fraction": _token_mean(clipped_high, mask),
            "importance_ratio": _token_mean(ratio, mask),
            "behaviour_weight": _token_mean(weight, mask),
            "behaviour_weight_capped": _token_mean(capped, mask),
            "behaviour_weight_masked": _token_mean(dropped, mask),
            "kl": _token_mean(behav_kl, mask),
            "num_tokens": float(mask.sum()),
            **mismatch_metrics(new_logprobs.detach(), behav, mask),
        }
        if entropy is not None:
            metrics["entropy"] = _token_mean(_masked(entropy.detach(), mask), mask)
        if kl_ref is not None:
            metrics["kl_to_ref"] = _token_mean(kl_ref.detach(), mask)
    return loss, metrics


def behaviour_weights(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor,
                      correction: str = "tis", level: str = "token",
                      max_weight: float | None = None, min_weight: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token weights [B, T] of the rollout correction (detached; 0 off the mask),
    and where they were truncated ("tis") and masked ("mis"), as bool [B, T].

    log w_t = log pi_prox - log pi_behav; "sequence" sums it over each row's tokens,
    "geometric" averages it, and every token of the row gets that weight. Weights are
    compared in log space and exponentiated only below the cap, so a sequence product
    far beyond float range is truncated or masked, never inf."""
    log_w = _masked(prox - behav, mask)
    if level != "token":
        per_seq = log_w.sum(dim=1, keepdim=True)
        if level == "geometric":
            per_seq = per_seq / mask.sum(dim=1, keepdim=True).clamp(min=1)
        log_w = torch.where(mask, per_seq.expand_as(log_w), torch.zeros_like(log_w))
    none = torch.zeros_like(mask)
    if correction == "none":
        return mask.to(prox.dtype), none, none
    upper = math.inf if max_weight is None else math.log(max_weight)
    if correction == "tis":
        capped = mask & (log_w > upper)
        return torch.exp(log_w.clamp(max=upper)) * mask, capped, none
    lower = -math.inf if min_weight is None else math.log(min_weight)
    dropped = mask & ((log_w > upper) | (log_w < lower))
    weight = torch.exp(log_w.clamp(max=upper))
    return torch.where(dropped | ~mask, torch.zeros_like(weight), weight), none, dropped


def mismatch_metrics(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's recorded logprobs are from the trainer's on the recorded
    tokens (sampled from the behaviour policy mu, scored by the trainer's pi):
    mismatch/kl_k3 and mismatch/kl_k1 estimate KL(mu || pi) from these samples, k3 =
    r - 1 - log r with r = pi / mu (unbiased, >= 0) and k1 = log mu - log pi (unbiased,
    noisier, can be negative); mismatch/log_ppl_ratio = log(PPL_pi / PPL_mu) per sequence
    (the mean over its tokens of log mu - log pi), averaged over the sequences (> 0: the
    trainer finds the sampled text less likely than the sampler did). All 0 when the two
    agree; with stale rollouts they include the staleness, not only numerics."""
    log_r = _masked(trainer_logprobs - behaviour_logprobs, mask).float()
    k3 = torch.expm1(log_r) - log_r
    counts = mask.sum(dim=1)
    per_seq = -(log_r * mask).sum(dim=1) / counts.clamp(min=1)
    seqs = int((counts > 0).sum())
    return {"mismatch/kl_k3": _token_mean(k3, mask),
            "mismatch/kl_k1": _token_mean(-log_r, mask),
            "mismatch/log_ppl_ratio": float(per_seq[counts > 0].sum()) / seqs if seqs else 0.0}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate [B, T] of KL(pi || pi_ref) on tokens sampled from pi
    (Schulman, "Approximating KL divergence"): with x = logprob - ref_logprob,
    "k1" = x (unbiased, high variance, can be negative) and "k3" = exp(-x) + x - 1
    (unbiased, low variance, >= 0). 0 where `mask` is False."""
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(f"unknown KL estimator {estimator!r}: use one of {KL_ESTIMATORS}")
    x = logprobs - ref_logprobs
    if mask is not None:
        x = _masked(x, mask)
    return x if estimator == "k1" else torch.expm1(-x) + x


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The scalar loss from per-token losses [B, T] over `mask` [B, T] (float 0/1).

    "token-mean": sum over all unmasked tokens / their number. "seq-mean-token-mean": each
    sequence's token mean, averaged over the sequences with at least one unmasked token.
    0 (still connected to the graph) when no token is unmasked."""
    per_token = per_token * mask  # masked positions are already 0; keeps NaN-free grads
    if aggregation == "token-mean":
        return per_token.sum() / mask.sum().clamp(min=1)
    if aggregation == "seq-mean-token-mean":
        counts = mask.sum(dim=1)
        seq = per_token.sum(dim=1) / counts.clamp(min=1)
        return seq.sum() / (counts > 0).sum().clamp(min=1)
    raise ConfigError(f"unknown aggregation {aggregation!r}: use one of {AGGREGATIONS}")


@overload
def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *,
                   with_entropy: Literal[False] = ..., temperature: float = ...
                   ) -> torch.Tensor: ...


@overload
def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *,
                   with_entropy: Literal[True], temperature: float = ...
                   ) -> tuple[torch.Tensor, torch.Tensor]: ...


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs [B, T] float32 (and entropies [B, T]) of `token_ids` [B, T] under
    the model whose output on those same ids is `logits` [B, T, V].

    The shift: a causal LM's logits[:, t] is the distribution of token t + 1, so
    logprob[:, t] = log_softmax(logits[:, t - 1])[token_ids[:, t]] - the logprob of token t
    given tokens < t, aligned with the ids, the loss mask and the sampler's recorded
    logprobs. Position 0 has no prediction: its logprob and entropy are 0 and it must never
    be a policy token (it is a prompt token). entropy[:, t] is that of the same
    distribution logits[:, t - 1], returned without grad (it is measured, not trained:
    keeping it differentiable would hold two more [B, T, V] tensors for backward).

    log_softmax runs in float32 with autocast off, so bf16 logits lose nothing beyond their
    own rounding. `temperature` divides the logits first; keep it 1.0 when the sampler
    records logprobs of the raw model distribution (Ridgeline's engine does).
    """
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ConfigError(
            f"logits must be [B, T, V] and token_ids [B, T]; got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}: pass the model's logits for exactly these ids")
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    vocab = logits.shape[-1]
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        raise ConfigError(f"token ids must lie in [0, {vocab}); pad with a real id (e.g. 0) "
                          "and mask the padding in the loss mask")
    chosen, ent = _picked_logprobs(logits[:, :-1], token_ids[:, 1:], temperature,
                                   with_entropy)
    out = torch.nn.functional.pad(chosen, (1, 0))
    if not with_entropy:
        return out
    assert ent is not None
    return out, torch.nn.functional.pad(ent, (1, 0))


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, *,
                  temperature: float = 1.0, chunk_tokens: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob [N] (float32, with grad) of `targets` [N] and entropy [N] (no grad) under
    log_softmax(head(hidden) / temperature), hidden [N, H]: the LM head on the positions
    that predict a trained token, `chunk_tokens` positions at a time.

    A whole [N, V] logits tensor (V = 49K for SmolLM2, 152K for Qwen) is several GB for a
    long agent trajectory, and backward would keep it and its log_softmax. Each chunk runs
    under non-reentrant activation checkpointing: only its [C, H] input is kept, and
    backward recomputes its head and log_softmax one chunk at a time, so the peak is about
    a few [C, V] tensors whatever N is. The gradient is the unchunked one (same ops, same
    autocast: checkpointing replays the forward's autocast state). None: one chunk."""
    n = hidden.shape[0]
    size = n if chunk_tokens is None else max(1, int(chunk_tokens))
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    picked, entropy = [], []
    for start in range(0, n, size):
        h, t = hidden[start:start + size], targets[start:start + size]
        if grad and size < n:
            lp, ent = checkpoint(_chunk_logprobs, h, t, head, temperature,
                                 use_reentrant=False)
        else:  # one chunk, or no backward: nothing to keep
            lp, ent = _chunk_logprobs(h, t, head, temperature)
        picked.append(lp)
        entropy.append(ent)
    if not picked:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(picked), torch.cat(entropy)


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    # the head under the caller's autocast
    picked, entropy = _picked_logprobs(head(hidden), targets, temperature, True)
    assert entropy is not None
    return picked, entropy


def _picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature) [..., V] at `targets` [...] in float32 with
    autocast off (bf16 logits lose nothing beyond their own rounding), and the entropy
    of each distribution without grad (a metric: no [..., V] tensor kept for backward)."""
    with torch.autocast(device_type=logits.device.type, enabled=False):
        scaled = logits.float()
        if temperature != 1.0:
            scaled = scaled / temperature
        logp = torch.log_softmax(scaled, dim=-1)
        picked = logp.gather(-1, targets[..., None].long()).squeeze(-1)
        if not with_entropy:
            return picked, None
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(dim=-1)
    return picked, entropy


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float,
                       eps_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate min(r A, clip(r) A) per token, and where the clipped
    term won (it then carries no gradient): r > 1 + eps_high with A > 0, r < 1 - eps_low
    with A < 0."""
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    with torch.no_grad():
        high = (adv > 0) & (ratio > 1.0 + eps_high)
        low = (adv < 0) & (ratio < 1.0 - eps_low)
    return surrogate, low, high


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with masked-out positions set to 0 before any exp, so padding (NaN, -inf) never
    reaches a value or a gradient."""
    return torch.where(mask, x, torch.zeros_like(x))


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over the unmasked tokens as a float (0.0 when there are none)."""
    n = int(mask.sum())
    return float((x.float() * mask).sum()) / n if n else 0.0


def _check_options(aggregation: str, kl_estimator: str, eps_low: float, eps_high: float,
                   max_behaviour_weight: float | None, kl_coef: float,
                   ref_logprobs: torch.Tensor | None, correction: str = "tis",
                   level: str = "token", min_behaviour_weight: float | None = None) -> None:
    """Every bad option named, with what to pass instead."""
    check_correction(correction, level, max_behaviour_weight, min_behaviour_weight)
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"unknown aggregation {aggregation!r}: use one of {AGGREGATIONS}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"unknown KL estimator {kl_estimator!r}: use one of {KL_ESTIMATORS}")
    if not 0 <= eps_low < 1 or eps_high < 0:
        raise ConfigError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0; got "
                          f"eps_low={eps_low}, eps_high={eps_high} (PPO: 0.2, DAPO: 0.2/0.28)")
    if kl_coef < 0:
        raise ConfigError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ConfigError(f"kl_coef={kl_coef} needs ref_logprobs: pass the reference "
                          "policy's logprobs, or set kl_coef to 0")


def check_correction(correction: str, level: str, max_weight: float | None,
                     min_weight: float | None) -> None:
    """A rollout correction that can be applied as configured, or a ConfigError."""
    if correction not in CORRECTIONS:
        raise ConfigError(f"unknown rollout correction {correction!r}: use one of "
                          f"{CORRECTIONS}", hint="tis truncates, mis masks, none ignores")
    if level not in CORRECTION_LEVELS:
        raise ConfigError(f"unknown rollout correction level {level!r}: use one of "
                          f"{CORRECTION_LEVELS}")
    if max_weight is not None and max_weight <= 0:
        raise ConfigError(f"max_behaviour_weight must be > 0 or None, got {max_weight}")
    if min_weight is not None and min_weight <= 0:
        raise ConfigError(f"min_behaviour_weight must be > 0 or None, got {min_weight}")
    if min_weight is not None and correction != "mis":
        raise ConfigError(f"min_behaviour_weight={min_weight} only applies to the 'mis' "
                          f"correction, not {correction!r}",
                          hint="set rollout_correction: mis, or drop min_behaviour_weight")
    if correction == "mis" and max_weight is None:
        raise ConfigError("the 'mis' correction needs max_behaviour_weight: tokens whose "
                          "weight exceeds it are masked", hint="e.g. max_behaviour_weight: 2")
    if correction == "tis" and level != "token" and max_weight is None:
        raise ConfigError(f"'{level}'-level importance weights without a cap: a product "
                          "over a sequence's tokens is unbounded",
                          hint="set max_behaviour_weight (e.g. 2), or use level token")
    if min_weight is not None and max_weight is not None and min_weight >= max_weight:
        raise ConfigError(f"min_behaviour_weight {min_weight} must be below "
                          f"max_behaviour_weight {max_weight}")


def _check_shapes(new: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                  loss_mask: torch.Tensor, **optional: torch.Tensor | None) -> torch.Size:
    """The common [B, T] shape; every tensor must have it (advantages: [B] or [B, T])."""
    if new.dim() != 2:
        raise ConfigError(f"new_logprobs must be [B, T], got {tuple(new.shape)}: pad the "
                          "batch to one length and pass per-token logprobs")
    shape = new.shape
    named = {"behaviour_logprobs": behaviour, "loss_mask": loss_mask, **optional}
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ConfigError(f"{name} has shape {tuple(t.shape)} but new_logprobs has "
                              f"{tuple(shape)}: pass one value per token of the same batch")
    if advantages.shape not in (shape, shape[:1]):
        raise ConfigError(f"advantages must be [B] or [B, T] = {tuple(shape)}, got "
                          f"{tuple(advantages.shape)}: pass one per sequence or per token")
    return shape
