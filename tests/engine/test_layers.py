"""The small-batch CPU matmul path computes what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ridgeline.engine.models.layers import SMALL_BATCH_ROWS, linear


@pytest.mark.parametrize("rows", [1, 2, 7, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 96), torch.randn(200, 96)
    b = torch.randn(200) if bias else None
    got = linear(x, w, b)
    assert got.shape == (rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_onednn_path_follows_in_place_weight_updates():
    """From ONEDNN_MIN_ROWS rows float32 goes to oneDNN with a cached blocked copy of the
    weight; an in-place update (RL's update_weights) must not leave that copy stale."""
    import torch.nn.functional as F

    from ridgeline.engine.models import layers

    torch.manual_seed(0)
    w = torch.randn(96, 40)
    x = torch.randn(layers.ONEDNN_MIN_ROWS + 3, 40)
    with torch.inference_mode():
        assert torch.allclose(layers.linear(x, w), F.linear(x, w), atol=1e-5)
    with torch.no_grad():
        w.copy_(torch.randn(96, 40))
    with torch.inference_mode():
        assert torch.allclose(layers.linear(x, w), F.linear(x, w), atol=1e-5)
        small = x[:2]
        assert torch.allclose(layers.linear(small, w), F.linear(small, w), atol=1e-5)
