"""GRPO group-relative advantages, and what dynamic sampling and the loss need beside them.

Several episodes are sampled per prompt (a *group*); an episode's advantage is its reward
minus the mean reward of its group, so the group itself is the baseline and no value model
is needed. Dividing by the group's reward std (original GRPO) is optional and off by
default: Dr.GRPO shows it biases updates toward prompts that are almost always solved or
almost never (tiny std, huge advantages).

Two kinds of samples carry no learning signal and must be visible to the caller:

- *masked* samples (an infrastructure error, a sandbox that failed its health probe): their
  reward is unknown, not 0. They are left out of their group's mean and std, get advantage
  0 and `mask` False, so they never reach a gradient or a token-mean denominator.
- groups with *zero reward variance* (all valid rewards equal, or fewer than two valid
  samples): every advantage is 0, so their tokens only dilute the batch. They are flagged
  per group and per sample so dynamic sampling (DAPO) can drop them and sample more.

Shapes: N samples, G groups. All outputs are on the rewards' device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ridgeline.errors import ConfigError


def zero_variance(valid_rewards: Sequence[float], tol: float = 0.0) -> bool:
    """No learning signal in a group: its valid (unmasked) rewards span at most `tol`
    (max - min), so every advantage is 0; fewer than two rewards are flat too. The one
    test of it: `group_advantages`, the filters (dynamic sampling) and the curriculum's
    saturated tasks all ask here."""
    return len(valid_rewards) < 2 or max(valid_rewards) - min(valid_rewards) <= tol


@dataclass(frozen=True)
class GroupAdvantages:
    """The result of `group_advantages`; per-sample fields are [N], per-group ones [G]."""

    advantages: torch.Tensor  # [N] float32; exactly 0 where mask is False or the group is flat
    mask: torch.Tensor  # [N] bool; False for masked samples (unknown reward)
    group_index: torch.Tensor  # [N] long in 0..G-1; which group each sample belongs to
    group_keys: torch.Tensor  # [G] long; the caller's group id of each group, ascending
    group_mean: torch.Tensor  # [G] float32; mean of the valid rewards (0 if none)
    group_std: torch.Tensor  # [G] float32; Bessel-corrected std of the valid rewards (0 if < 2)
    group_size: torch.Tensor  # [G] long; number of valid samples
    zero_variance: torch.Tensor  # [G] bool; no learning signal in this group

    @property
    def sample_zero_variance(self) -> torch.Tensor:
        """[N] bool: the sample's group has zero reward variance."""
        return self.zero_variance[self.group_index]

    @property
    def trainable(self) -> torch.Tensor:
        """[N] bool: valid samples in groups with a learning signal (what dynamic sampling
        keeps)."""
        return self.mask & ~self.sample_zero_variance


def group_advantages(
    rewards: torch.Tensor | Sequence[Sequence[float | None]],
    group_ids: torch.Tensor | Sequence[int] | None = None,
    mask: torch.Tensor | Sequence[bool] | None = None,
    *,
    normalize_std: bool,
    eps: float = 1e-6,
    zero_variance_tol: float = 0.0,
) -> GroupAdvantages:
    """Group-relative advantages: `reward - group mean`, divided by `(group std + eps)`
    when `normalize_std` (the choice and its default: `LoopConfig.normalize_std`).

    `rewards` is either a 1-D tensor [N] with `group_ids` [N] (any integers; samples with
    equal ids form a group) and an optional `mask` [N] (False = reward unknown, e.g. an
    infra error; its reward value is ignored and may be NaN), or a list of groups, each a
    list of rewards where None marks a masked sample (then `group_ids` and `mask` must be
    None; the flat order is the groups concatenated).

    A group has zero variance when its valid rewards span at most `zero_variance_tol`
    (max - min), including groups with fewer than two valid samples; its advantages are
    exactly 0 whether or not `normalize_std` is set. Statistics are computed in float64.
    """
    rewards_t, group_t, mask_t = _as_tensors(rewards, group_ids, mask)
    if eps < 0 or zero_variance_tol < 0:
        raise ConfigError(f"eps ({eps}) and zero_variance_tol ({zero_variance_tol}) must be"
                          " >= 0; pass a small non-negative number")
    keys, index = torch.unique(group_t, sorted=True, return_inverse=True)
    num_groups = keys.numel()
    r = torch.where(mask_t, rewards_t, torch.zeros_like(rewards_t))
    size = _group_sum(mask_t.double(), index, num_groups)
    mean = _group_sum(r, index, num_groups) / size.clamp(min=1)
    dev = torch.where(mask_t, r - mean[index], torch.zeros_like(r))
    var = _group_sum(dev * dev, index, num_groups) / (size - 1).clamp(min=1)
    std = torch.where(size >= 2, var.sqrt(), torch.zeros_like(var))
    flat = torch.tensor([zero_variance(r[mask_t & (index == g)].tolist(), zero_variance_tol)
                         for g in range(num_groups)], dtype=torch.bool, device=r.device)
    adv = dev / (std[index] + eps) if normalize_std else dev
    adv = torch.where(mask_t & ~flat[index], adv, torch.zeros_like(adv))
    return GroupAdvantages(
        advantages=adv.float(), mask=mask_t, group_index=index, group_keys=keys,
        group_mean=mean.float(), group_std=std.float(), group_size=size.long(),
        zero_variance=flat,
    )


def broadcast_to_tokens(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages [B] as per-token ones [B, T]: every policy token of a
    sequence gets its sequence's advantage (the outcome-reward credit assignment of GRPO),
    and every other token (prompt, observations, padding) gets 0."""
    if advantages.dim() != 1 or loss_mask.dim() != 2 or advantages.shape[0] != loss_mask.shape[0]:
        raise ConfigError(
            f"advantages must be [B] and loss_mask [B, T] with the same B; got "
            f"{tuple(advantages.shape)} and {tuple(loss_mask.shape)}: pass one advantage "
            "per sequence (row of the loss mask)")
    return advantages.to(torch.float32)[:, None] * loss_mask.to(torch.float32)


def mask_samples(loss_mask: torch.Tensor, sample_mask: torch.Tensor) -> torch.Tensor:
    """The loss mask [B, T] with the rows of dropped samples (sample_mask [B] False, e.g.
    `GroupAdvantages.mask` or `.trainable`) zeroed, so they count neither in the gradient
    nor in a token-mean denominator."""
    if sample_mask.dim() != 1 or loss_mask.dim() != 2 or sample_mask.shape[0] != loss_mask.shape[0]:
        raise ConfigError(
            f"sample_mask must be [B] and loss_mask [B, T] with the same B; got "
            f"{tuple(sample_mask.shape)} and {tuple(loss_mask.shape)}: pass one flag per "
            "sequence (row of the loss mask)")
    return loss_mask * sample_mask.to(loss_mask.dtype)[:, None]


def _as_tensors(
    rewards: torch.Tensor | Sequence[Sequence[float | None]],
    group_ids: torch.Tensor | Sequence[int] | None,
    mask: torch.Tensor | Sequence[bool] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards float64 [N], group ids long [N], mask bool [N]) from either input form,
    checked: equal lengths, 1-D, and every unmasked reward finite."""
    if not isinstance(rewards, torch.Tensor):
        rewards, group_ids, mask = _from_groups(rewards, group_ids, mask)
    if group_ids is None:
        raise ConfigError("group_ids is required with a rewards tensor: pass one group id "
                          "(e.g. the prompt index) per reward, or pass a list of groups")
    rewards_t = rewards.detach().to(torch.float64)
    device = rewards_t.device
    group_t = torch.as_tensor(group_ids, device=device)
    mask_t = (torch.ones_like(rewards_t, dtype=torch.bool) if mask is None
              else torch.as_tensor(mask, device=device).to(torch.bool))
    if rewards_t.dim() != 1 or group_t.shape != rewards_t.shape or mask_t.shape != rewards_t.shape:
        raise ConfigError(
            f"rewards, group_ids and mask must be 1-D of one length; got "
            f"{tuple(rewards_t.shape)}, {tuple(group_t.shape)}, {tuple(mask_t.shape)}: "
            "flatten the groups and pass one group id and mask flag per reward")
    if group_t.is_floating_point() or group_t.dtype == torch.bool:
        raise ConfigError("group_ids must be integers: pass e.g. the prompt index per sample")
    bad = mask_t & ~torch.isfinite(rewards_t)
    if bool(bad.any()):
        raise ConfigError(
            f"{int(bad.sum())} unmasked rewards are not finite (first at index "
            f"{int(bad.nonzero()[0])}): mask samples whose reward is unknown instead")
    return rewards_t, group_t.long(), mask_t


def _from_groups(
    groups: Sequence[Sequence[float | None]],
    group_ids: object,
    mask: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flat form of a list of groups; None rewards become masked samples."""
    if group_ids is not None or mask is not None:
        raise ConfigError("with a list of groups, the grouping and the mask come from the "
                          "list itself (None = masked): do not pass group_ids or mask")
    if isinstance(groups, (str, bytes)) or not all(
            isinstance(g, Sequence) and not isinstance(g, (str, bytes)) for g in groups):
        raise ConfigError("rewards must be a 1-D tensor or a list of groups (lists of "
                          "floats or None); wrap each group's rewards in a list")
    flat = [r for g in groups for r in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    valid = [r is not None for r in flat]
    values = [math.nan if r is None else float(r) for r in flat]
    return (torch.tensor(values, dtype=torch.float64), torch.tensor(ids, dtype=torch.long),
            torch.tensor(valid, dtype=torch.bool))


def _group_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[G] sums of `values` [N] per group."""
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, index, values)
