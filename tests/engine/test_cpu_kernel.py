"""The C decode-attention kernel equals PyTorch attention over the same paged context."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ridgeline.engine import cpu_kernels
from ridgeline.engine.kv_quant import dequantize, quantize

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="no C compiler to build the kernel")


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 32, 1), (8, 2, 128, 4), (6, 1, 16, 32),
    (2, 1, 8, 8), (4, 2, 40, 16)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
def test_kernel_matches_reference(heads, kv_heads, head_dim, block_size, threads,
                                  storage) -> None:
    int8 = storage == "int8"
    rng = random.Random(heads * 100 + block_size)
    torch.manual_seed(0)
    g = heads // kv_heads
    n = 7
    q_lens = [rng.randint(1, min(8, 64 // g)) for _ in range(n)]
    ctx = [rng.randint(q, 120) for q in q_lens]
    num_blocks = 1 + sum(-(-c // block_size) for c in ctx) + 10
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    scales: dict[str, torch.Tensor] = {}
    if int8:  # the kernel reads codes + scales; the reference their dequantized values
        (kq, ks), (vq, vs) = quantize(k_cache, "int8"), quantize(v_cache, "int8")
        k_cache, v_cache = (dequantize(kq, ks, "int8", torch.float32),
                            dequantize(vq, vs, "int8", torch.float32))
        scales = {"k_scale": ks, "v_scale": vs}
    if storage == "bfloat16":  # the kernel reads bf16 blocks; the reference their values
        kq, vq = k_cache.bfloat16(), v_cache.bfloat16()
        k_cache, v_cache = kq.float(), vq.float()
    tables = []
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    for c in ctx:
        nb = -(-c // block_size)
        tables.append([free.pop() for _ in range(nb)])
    total = sum(q_lens)
    # a strided q, as the model passes a slice of the fused qkv projection
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim)
    q = qkv[:, :heads]
    starts = [sum(q_lens[:i]) for i in range(n)]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = torch.full((total, heads, head_dim), float("nan"))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = storage != "float32"
        cpu_kernels.paged_decode_attention(q, kq if packed else k_cache, vq if packed else v_cache,
                                           table, torch.tensor(starts), torch.tensor(q_lens),
                                           torch.tensor(ctx), out, **scales)
    finally:
        torch.set_num_threads(old)
    for i in range(n):
        kc = k_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:ctx[i]]
        vc = v_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:ctx[i]]
        ql = q_lens[i]
        mask = torch.arange(ctx[i])[None, :] <= torch.arange(ql)[:, None] + ctx[i] - ql
        ref = F.scaled_dot_product_attention(
            q[starts[i]:starts[i] + ql].transpose(0, 1)[None],
            kc.transpose(0, 1).repeat_interleave(g, 0)[None],
            vc.transpose(0, 1).repeat_interleave(g, 0)[None], attn_mask=mask[None, None])
        got = out[starts[i]:starts[i] + ql]
        assert torch.allclose(got, ref[0].transpose(0, 1), atol=2e-5), i


def test_split_work_balances_context_and_skips_tiny_batches() -> None:
    # 3 sequences x 2 KV heads = 6 items; the long sequence's items fill one share
    assert cpu_kernels.split_work([4000, 2000, 2000], 2, 2) == [0, 2, 6]
    assert cpu_kernels.split_work([3000] * 4, 1, 2) == [0, 2, 4]
    assert cpu_kernels.split_work([3000] * 6, 1, 3) == [0, 2, 4, 6]
    assert cpu_kernels.split_work([10, 20], 2, 2) == [0, 4]  # not worth a hand-off
    assert cpu_kernels.split_work([5000], 1, 4) == [0, 1]  # never more shares than items


def test_a_bfloat16_query_goes_through_a_float32_copy() -> None:
    """A bf16 model's q and out (the kernel computes in float32) against the float32 call."""
    torch.manual_seed(1)
    k = torch.randn(4, 16, 2, 64).bfloat16()
    v = torch.randn(4, 16, 2, 64).bfloat16()
    q = torch.randn(3, 4, 64)
    args = (torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([3]), torch.tensor([40]))
    ref = torch.empty(3, 4, 64)
    cpu_kernels.paged_decode_attention(q, k, v, *args, ref)
    got = torch.empty(3, 4, 64, dtype=torch.bfloat16)
    cpu_kernels.paged_decode_attention(q.bfloat16(), k, v, *args, got)
    assert torch.allclose(got.float(), ref, atol=0.03)
