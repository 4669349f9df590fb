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
