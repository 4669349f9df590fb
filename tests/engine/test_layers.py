"""The small-batch CPU matmul path computes what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ridgeline.engine.model_executor.models.layers import SMALL_BATCH_ROWS, linear


@pytest.mark.parametrize("rows", [1, 2, 7, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 96), torch.randn(200, 96)
    b = torch.randn(200) if bias else None
    got = linear(x, w, b)
    assert got.shape == (rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 128, 129, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_linear_is_the_exact_product_rounded_once(rows: int, bias: bool) -> None:
    # every bf16 path (the C kernel, a widened float32 GEMM, oneDNN) accumulates in float32
    # and rounds the output once: within half a bf16 step of the float64 product
    torch.manual_seed(rows)
    x = torch.randn(rows, 96).bfloat16()
    w = torch.randn(200, 96).bfloat16()
    b = torch.randn(200).bfloat16() if bias else None
    with torch.inference_mode():
        got = linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200) and got.is_contiguous()
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    err = (got.double() - exact).abs()
    assert bool((err <= 2.0 ** -8 * exact.abs() + 1e-4 * scale).all())


def test_the_onednn_path_follows_in_place_weight_updates():
    """From ONEDNN_MIN_ROWS rows float32 goes to oneDNN with a cached blocked copy of the
    weight; an in-place update (RL's update_weights) must not leave that copy stale."""
    import torch.nn.functional as F

    from ridgeline.engine.model_executor.models import layers

    torch.manual_seed(0)
    w = torch.randn(96, 40)
    # more rows than the C kernel takes, so oneDNN does it
    x = torch.randn(max(layers.ONEDNN_MIN_ROWS, layers.KERNEL_MAX_ROWS) + 3, 40)
    calls = []
    real = layers._onednn_weight
    with torch.inference_mode():
        layers._onednn_weight = lambda weight: calls.append(1) or real(weight)
        try:
            assert torch.allclose(layers.linear(x, w), F.linear(x, w), atol=1e-5)
        finally:
            layers._onednn_weight = real
        assert calls or not layers._ONEDNN
    with torch.no_grad():
        w.copy_(torch.randn(96, 40))
    with torch.inference_mode():
        assert torch.allclose(layers.linear(x, w), F.linear(x, w), atol=1e-5)
        small = x[:2]
        assert torch.allclose(layers.linear(small, w), F.linear(small, w), atol=1e-5)


def test_without_a_working_packed_onednn_linear_takes_pytorch(monkeypatch):
    """The packed oneDNN call is a private torch op, checked once per dtype: where the
    check fails, products of many rows take PyTorch's path (and give F.linear's result)."""
    from ridgeline.engine.model_executor.models import layers

    assert layers._onednn_works(torch.float32) in (True, False)
    monkeypatch.setattr(layers, "_onednn_works", lambda dtype: False)
    monkeypatch.setattr(layers, "_onednn_weight", lambda w: pytest.fail("packed anyway"))
    w, b = torch.randn(96, 40), torch.randn(96)
    x = torch.randn(max(layers.ONEDNN_MIN_ROWS, layers.KERNEL_MAX_ROWS) + 3, 40)
    with torch.inference_mode():
        torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)
