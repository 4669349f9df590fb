"""GRPO group advantages: hand-computed means and stds, zero-variance groups flagged for
dynamic sampling, masked samples (unknown reward) kept out of the statistics, and the
per-token broadcast."""

from __future__ import annotations

import math

import pytest
import torch

from ridgeline.errors import ConfigError
from ridgeline.rl.advantages import broadcast_to_tokens, group_advantages, mask_samples


def test_reward_minus_group_mean_without_std_by_default() -> None:
    out = group_advantages([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0]], normalize_std=False)
    assert out.advantages.tolist() == [0.5, -0.5, -0.5, 0.5, 1.0, -1.0]
    assert out.group_mean.tolist() == [0.5, 2.0]
    assert out.group_index.tolist() == [0, 0, 0, 0, 1, 1]
    assert out.mask.all() and not out.zero_variance.any()
    assert out.advantages.dtype == torch.float32


def test_normalize_std_divides_by_bessel_std_plus_eps() -> None:
    # group 0: deviations +-0.5, sample variance 4 * 0.25 / 3 = 1/3
    out = group_advantages([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0]], normalize_std=True, eps=0.0)
    std0 = math.sqrt(1 / 3)
    assert out.group_std[0].item() == pytest.approx(std0)
    assert out.group_std[1].item() == pytest.approx(math.sqrt(2.0))
    expected = [0.5 / std0, -0.5 / std0, -0.5 / std0, 0.5 / std0,
                1 / math.sqrt(2), -1 / math.sqrt(2)]
    assert out.advantages.tolist() == pytest.approx(expected, rel=1e-6)
    eps = group_advantages([[1.0, 0.0]], normalize_std=True, eps=0.5)
    assert eps.advantages.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 0.5),
                                                     -0.5 / (math.sqrt(0.5) + 0.5)])


def test_zero_variance_groups_are_flagged_with_zero_advantage() -> None:
    # all solved, all failed, one valid sample, no valid sample, and one with signal
    groups = [[1.0, 1.0, 1.0], [0.0, 0.0], [0.7, None], [None, None], [1.0, 0.0]]
    for normalize in (False, True):
        out = group_advantages(groups, normalize_std=normalize)
        assert out.zero_variance.tolist() == [True, True, True, True, False]
        assert out.group_size.tolist() == [3, 2, 1, 0, 2]
        assert out.sample_zero_variance.tolist() == [True] * 9 + [False] * 2
        assert out.trainable.tolist() == [False] * 9 + [True, True]
        assert torch.isfinite(out.advantages).all()
        assert out.advantages[:9].abs().sum() == 0
        assert out.advantages[9] > 0 > out.advantages[10]


def test_zero_variance_tolerance() -> None:
    rewards = [[0.3, 0.3 + 1e-9, 0.3]]
    assert not group_advantages(rewards, normalize_std=False).zero_variance[0]
    out = group_advantages(rewards, zero_variance_tol=1e-6, normalize_std=True)
    assert out.zero_variance[0] and out.advantages.abs().sum() == 0


def test_masked_samples_are_excluded_from_group_statistics() -> None:
    # an infra error is not a reward of 0: the mean is that of 0.5 and 1.5 only
    out = group_advantages([[0.5, None, 1.5]], normalize_std=False)
    assert out.group_mean.tolist() == [1.0]
    assert out.advantages.tolist() == [-0.5, 0.0, 0.5]
    assert out.mask.tolist() == [True, False, True]
    assert out.trainable.tolist() == [True, False, True]
    # if the masked sample had counted as 0, the mean would be 2/3
    naive = group_advantages([[0.5, 0.0, 1.5]], normalize_std=False)
    assert naive.group_mean[0].item() == pytest.approx(2 / 3)


def test_tensor_input_with_arbitrary_group_ids_and_mask() -> None:
    rewards = torch.tensor([1.0, 4.0, 3.0, float("nan"), 2.0, 0.0])
    group_ids = torch.tensor([7, 3, 7, 3, 3, 7])
    mask = torch.tensor([True, True, True, False, True, True])
    out = group_advantages(rewards, group_ids, mask, normalize_std=False)
    assert out.group_keys.tolist() == [3, 7]
    # group 3: rewards 4, 2 (the NaN is masked) -> mean 3; group 7: 1, 3, 0 -> mean 4/3
    assert out.group_mean.tolist() == pytest.approx([3.0, 4 / 3])
    assert out.advantages.tolist() == pytest.approx([-1 / 3, 1.0, 5 / 3, 0.0, -1.0, -4 / 3])
    assert out.group_index.tolist() == [1, 0, 1, 0, 0, 1]
    # the same groups as lists give the same statistics
    lists = group_advantages([[4.0, None, 2.0], [1.0, 3.0, 0.0]], normalize_std=False)
    assert lists.group_mean.tolist() == pytest.approx(out.group_mean.tolist())


def _centred(*args, **kwargs):
    return group_advantages(*args, normalize_std=False, **kwargs)


@pytest.mark.parametrize("call", [
    lambda: _centred(torch.tensor([1.0, 0.0])),                               # no group ids
    lambda: _centred(torch.tensor([1.0, 0.0]), torch.tensor([0])),            # lengths differ
    lambda: _centred(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)),  # 2-D
    lambda: _centred(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])),     # float ids
    lambda: _centred(torch.tensor([float("nan"), 0.0]), torch.tensor([0, 0])),
    lambda: _centred([[1.0]], group_ids=[0]),                                 # lists + ids
    lambda: _centred([1.0, 0.0]),                                             # not groups
    lambda: _centred([[1.0, 0.0]], eps=-1.0),
])
def test_bad_arguments_raise_config_error(call) -> None:
    with pytest.raises(ConfigError):
        call()


def test_broadcast_to_tokens_fills_policy_tokens_only() -> None:
    loss_mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.float32)
    tok = broadcast_to_tokens(torch.tensor([2.0, -1.0]), loss_mask)
    assert tok.tolist() == [[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, -1.0, -1.0]]
    with pytest.raises(ConfigError):
        broadcast_to_tokens(torch.tensor([1.0, 2.0, 3.0]), loss_mask)


def test_mask_samples_zeroes_dropped_rows() -> None:
    loss_mask = torch.tensor([[0, 1, 1], [1, 1, 0]], dtype=torch.float32)
    out = group_advantages([[1.0, None]], normalize_std=False)
    assert mask_samples(loss_mask, out.mask).tolist() == [[0, 1, 1], [0, 0, 0]]
    with pytest.raises(ConfigError):
        mask_samples(loss_mask, torch.tensor([True]))
