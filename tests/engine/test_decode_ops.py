"""The decode step's small ops in C (`engine.decode_ops`) against PyTorch's formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ridgeline.engine.kernels import decode_ops
from ridgeline.engine.model_executor.models.layers import RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(decode_ops.load() is None, reason="no C compiler here")

DTYPES = [torch.float32, torch.bfloat16]


def reference_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 576), (3, 64), (16, 100), (5, 7), (200, 96), (2, 5000)])
def test_rms_norm_matches_the_formula(dtype, rows, d):
    g = torch.Generator().manual_seed(rows * d)
    x = torch.randn(rows, d, generator=g).to(dtype) * 3
    w = torch.randn(d, generator=g).to(dtype)
    got = decode_ops.rms_norm(x.clone(), w, 1e-5)
    want = reference_rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    # only the sum of squares is summed in another order: at most an ulp of the scale
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # rounding mismatches are rare single ulps
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_delta_adds_the_residual_in_place(dtype):
    x = torch.randn(4, 96).to(dtype)
    delta = torch.randn(4, 96).to(dtype)
    w = torch.rand(96).to(dtype)
    want_x = x + delta
    want = reference_rms_norm(want_x, w, 1e-6)
    got = decode_ops.rms_norm(x, w, 1e-6, delta)
    assert torch.equal(x, want_x)  # the residual stream, bit for bit
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_rms_norm_reads_strided_rows():
    base = torch.randn(3, 200)
    x = base[:, :128]  # rows of stride 200
    w = torch.rand(128)
    got = decode_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, reference_rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)


def test_rms_norm_module_takes_the_kernel_at_any_row_count_but_not_under_autograd(
        monkeypatch):
    calls = []
    real = decode_ops.rms_norm
    monkeypatch.setattr(decode_ops, "rms_norm", lambda *a: calls.append(1) or real(*a))
    norm = RMSNorm(64, 1e-5, torch.float32, "cpu")
    norm.weight.data.uniform_(0.5, 1.5)
    for rows in (1, 300, decode_ops.SPLIT_ROWS + 3):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got = norm(x)
        torch.testing.assert_close(got, reference_rms_norm(x, norm.weight, 1e-5),
                                   rtol=1e-6, atol=1e-6)
    assert len(calls) == 3
    assert not decode_ops.usable(torch.randn(4, 64, dtype=torch.float64))
    with torch.enable_grad():  # autograd needs PyTorch's ops
        assert not decode_ops.usable(torch.randn(1, 64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rms_norm_split_over_threads_is_the_same(dtype, threads):
    """Prefill-sized norms run a share of the rows per thread; each row's result does not
    depend on the split, and the residual add lands in every row."""
    rows, d = 2 * decode_ops.SPLIT_ROWS + 5, 96
    g = torch.Generator().manual_seed(threads)
    base = torch.randn(rows, d + 8, generator=g).to(dtype)
    x = base[:, :d]  # strided rows
    delta = torch.randn(rows, d, generator=g).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    one_row_at_a_time = torch.cat([decode_ops.rms_norm(x[i:i + 1].clone(), w, 1e-5,
                                                       delta[i:i + 1]) for i in range(rows)])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xs = x.clone()
        got = decode_ops.rms_norm(xs, w, 1e-5, delta)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, one_row_at_a_time)
    assert torch.equal(xs, (x.float() + delta.float()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (7, 40), (16, 3), (64, 333)])
def test_silu_mul_matches_pytorch(dtype, rows, n):
    gu = (torch.randn(rows, 2 * n) * 4).to(dtype)
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps and its middle
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = decode_ops.silu_mul(gu)
    assert got.shape == (rows, n) and got.dtype == dtype
    if dtype == torch.float32:  # libm's expf against PyTorch's: a few ulps
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3)
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,d", [(1, 12, 64), (5, 3, 32), (2, 4, 128)])
def test_rotary_is_bit_identical_to_apply_rotary(dtype, rows, heads, d):
    """Separate roundings of each product and the sum, as PyTorch's three ops."""
    qkv = torch.randn(rows, (heads + 2) * d).to(dtype)
    cos = torch.randn(rows, 1, d).to(dtype)
    sin = torch.randn(rows, 1, d).to(dtype)
    view = qkv[:, :heads * d].view(rows, heads, d)  # strided rows, as in the layer
    want = apply_rotary(view.clone(), cos, sin)
    rest = qkv[:, heads * d:].clone()
    got = decode_ops.rotary_(view, cos, sin)
    assert got.data_ptr() == view.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, heads * d:], rest)  # the V part is untouched


@pytest.mark.parametrize("rows,n", [(1, 49152), (7, 1000), (64, 333), (3, 5)])
def test_argmax_logsumexp_matches_pytorch(rows, n):
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n, generator=g) * 6
    x[0, n // 2] = x[0].max() + 1  # the largest value twice: the first index wins
    x[0, n - 1] = x[0, n // 2]
    idx, top, lse = decode_ops.argmax_logsumexp(x)
    assert torch.equal(idx, x.argmax(dim=-1)) and idx[0] == n // 2
    assert torch.equal(top, x.max(dim=-1).values)
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), rtol=2e-6, atol=2e-6)


def test_argmax_logsumexp_leaves_nan_inf_and_other_layouts_to_pytorch():
    x = torch.randn(3, 64)
    assert decode_ops.argmax_logsumexp(x) is not None
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 5] = bad
        assert decode_ops.argmax_logsumexp(y) is None
    assert decode_ops.argmax_logsumexp(x.t()) is None  # columns are not rows
    assert decode_ops.argmax_logsumexp(x.bfloat16()) is None


@pytest.mark.parametrize("dtype", DTYPES + [torch.int8])
@pytest.mark.parametrize("rows", [0, 1, 64, 1500])
def test_scatter_rows_is_index_copy(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    # k of a fused qkv projection: rows of 3 heads x 64, 15 x 64 apart
    qkv = (torch.randn(rows, 15 * 64, generator=g) * 50).to(dtype)
    k = qkv[:, 9 * 64:12 * 64].view(rows, 3, 64)
    index = torch.randperm(4096, generator=g)[:rows]
    got = torch.zeros(4096, 3, 64, dtype=dtype)
    want = got.clone()
    assert decode_ops.scatter_rows(got, index, k)
    want.index_copy_(0, index, k)
    assert torch.equal(got, want)


def test_scatter_rows_refuses_what_it_cannot_copy_and_out_of_range_slots():
    dst = torch.zeros(8, 2, 4)
    src = torch.ones(2, 2, 4)
    assert not decode_ops.scatter_rows(dst, torch.tensor([0, 1]), src.double())  # dtype
    assert not decode_ops.scatter_rows(dst, torch.tensor([0, 1]), src.transpose(1, 2)
                                       .contiguous().transpose(1, 2))  # rows not contiguous
    assert not decode_ops.scatter_rows(dst[:, :1], torch.tensor([0, 1]), src[:, :1])
    assert not decode_ops.scatter_rows(dst, torch.tensor([0, 1], dtype=torch.int32), src)
    for bad in (8, -1):
        with pytest.raises(IndexError, match="out of range"):
            decode_ops.scatter_rows(dst, torch.tensor([0, bad]), src)
        assert not dst.any()  # nothing written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e4])
def test_scatter_int8_rows_writes_what_kv_quant_quantizes(dtype, magnitude):
    from ridgeline.engine.model_executor.kv_quant import quantize

    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(40, 15 * 64, generator=g) * magnitude).to(dtype)
    k = qkv[:, 9 * 64:12 * 64].view(40, 3, 64)  # strided rows, as the model leaves them
    k[3] = 0.0                                   # an all-zero head: scale 1e-12, codes 0
    k[5, 1] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 58).to(dtype)  # ties
    index = torch.randperm(300, generator=g)[:40]
    codes = torch.zeros(300, 3, 64, dtype=torch.int8)
    scales = torch.zeros(300, 3)
    assert decode_ops.scatter_int8_rows(codes, scales, index, k)
    want_codes, want_scales = quantize(k, "int8")
    assert torch.equal(codes[index], want_codes) and torch.equal(scales[index], want_scales)
    assert codes[index[5], 1, :6].tolist() == [127, 0, 2, 2, 0, -2]  # half to even
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[index] = False
    assert not codes[untouched].any() and not scales[untouched].any()


def test_scatter_int8_rows_refuses_other_layouts_and_out_of_range_slots():
    codes, scales = torch.zeros(8, 2, 4, dtype=torch.int8), torch.zeros(8, 2)
    src = torch.ones(2, 2, 4)
    assert not decode_ops.scatter_int8_rows(codes, scales, torch.tensor([0, 1]), src.double())
    assert not decode_ops.scatter_int8_rows(codes.to(torch.uint8), scales, torch.tensor([0, 1]),
                                            src)  # fp8 codes: PyTorch's path
    assert not decode_ops.scatter_int8_rows(codes, scales, torch.tensor([0, 1]),
                                            src.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(IndexError, match="out of range"):
        decode_ops.scatter_int8_rows(codes, scales, torch.tensor([0, 8]), src)
    assert not codes.any() and not scales.any()  # nothing written


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_and_rotary_split_over_threads_are_the_same(dtype):
    rows = 2 * decode_ops.SPLIT_ROWS + 7
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(rows, 2 * 96 + 16, generator=g) * 4).to(dtype)[:, :2 * 96]
    qk = torch.randn(rows, 5, 64, generator=g).to(dtype)
    cos = torch.randn(rows, 64, generator=g).to(dtype)
    sin = torch.randn(rows, 64, generator=g).to(dtype)
    before = torch.get_num_threads()
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        try:
            outs.append((decode_ops.silu_mul(gate_up), decode_ops.rotary_(qk.clone(), cos, sin)))
        finally:
            torch.set_num_threads(before)
    for silu, rot in outs[1:]:
        assert torch.equal(silu, outs[0][0]) and torch.equal(rot, outs[0][1])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(outs[0][0].float(), (F.silu(gate) * up).float(),
                               rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
    assert torch.equal(outs[0][1], apply_rotary(qk, cos[:, None], sin[:, None]))
