"""The C decode-attention kernel equals PyTorch attention over the same paged context, in
each of its paths this CPU runs: the one it compiles natively (AVX-512, AVX2 + FMA or
portable), the AVX2 path (built without AVX-512) and the portable 8-wide path."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ridgeline.engine.kernels import cpu_kernels
from ridgeline.engine.model_executor.kv_quant import dequantize, quantize
from tests.helpers.engine_fixtures import KERNEL_BUILDS, kernel_build

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="no C compiler to build the kernel")

BUILDS = KERNEL_BUILDS


_lib = kernel_build


def _attend(heads: int, kv_heads: int, head_dim: int, block_size: int, ctx: list[int],
            q_lens: list[int], storage: str, *, build: str = "native", threads: int = 1,
            seed: int = 0, key_growth: float = 0.0, q_scale: float = 1.0,
            poison_free_slots: bool = False,
            cuts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference) for sequences with these contexts and new-token counts.

    key_growth: keys of later positions are scaled up by (1 + key_growth * position), so the
    running max of the scores keeps rising (the rescaling path); poison_free_slots: every
    slot no sequence owns (the null block, the tail of each last block) holds NaN, which
    must never reach an output; cuts: the work items' split over threads (default
    `split_work`'s)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    g = heads // kv_heads
    n = len(ctx)
    num_blocks = 1 + sum(-(-c // block_size) for c in ctx) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    tables = []
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    for c in ctx:
        tables.append([free.pop() for _ in range(-(-c // block_size))])
    if key_growth:
        for t, c in zip(tables, ctx):
            pos = torch.arange(len(t) * block_size, dtype=torch.float32)
            grow = (1 + key_growth * pos).view(len(t), block_size, 1, 1)
            k_cache[t] *= grow
    scales: dict[str, torch.Tensor] = {}
    kq, vq = k_cache, v_cache  # what the kernel reads
    if storage == "int8":  # the kernel reads codes + scales; the reference their values
        (kq, ks), (vq, vs) = quantize(k_cache, "int8"), quantize(v_cache, "int8")
        k_cache, v_cache = (dequantize(kq, ks, "int8", torch.float32),
                            dequantize(vq, vs, "int8", torch.float32))
        scales = {"k_scale": ks, "v_scale": vs}
    elif storage == "bfloat16":  # the kernel reads bf16 blocks; the reference their values
        kq, vq = k_cache.bfloat16(), v_cache.bfloat16()
        k_cache, v_cache = kq.float(), vq.float()
    if poison_free_slots:
        owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for t, c in zip(tables, ctx):
            owned.view(-1)[torch.tensor([t[p // block_size] * block_size + p % block_size
                                         for p in range(c)])] = True
        for cache in (kq, vq):
            if cache.dtype == torch.int8:
                scale = scales["k_scale" if cache is kq else "v_scale"]
                scale[~owned] = float("nan")
            else:
                cache[~owned] = float("nan")
    total = sum(q_lens)
    # a strided q, as the model passes a slice of the fused qkv projection
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim) * q_scale
    q = qkv[:, :heads]
    starts = [sum(q_lens[:i]) for i in range(n)]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = torch.full((total, heads, head_dim), float("nan"))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernels.paged_decode_attention(q, kq, vq, table, torch.tensor(starts),
                                           torch.tensor(q_lens), torch.tensor(ctx), out,
                                           cuts=cuts, lib=_lib(build), **scales)
    finally:
        torch.set_num_threads(old)
    ref = torch.empty_like(out)
    for i in range(n):
        kc = k_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:ctx[i]]
        vc = v_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:ctx[i]]
        ql = q_lens[i]
        mask = torch.arange(ctx[i])[None, :] <= torch.arange(ql)[:, None] + ctx[i] - ql
        o = F.scaled_dot_product_attention(
            q[starts[i]:starts[i] + ql].transpose(0, 1)[None],
            kc.transpose(0, 1).repeat_interleave(g, 0)[None],
            vc.transpose(0, 1).repeat_interleave(g, 0)[None], attn_mask=mask[None, None])
        ref[starts[i]:starts[i] + ql] = o[0].transpose(0, 1)
    return out, ref


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 32, 1), (8, 2, 128, 4), (6, 1, 16, 32),
    (2, 1, 8, 8), (4, 2, 40, 16)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_kernel_matches_reference(heads, kv_heads, head_dim, block_size, threads, storage,
                                  build) -> None:
    rng = random.Random(heads * 100 + block_size)
    g = heads // kv_heads
    q_lens = [rng.randint(1, min(8, 64 // g)) for _ in range(7)]
    ctx = [rng.randint(q, 120) for q in q_lens]
    got, ref = _attend(heads, kv_heads, head_dim, block_size, ctx, q_lens, storage,
                       build=build, threads=threads)
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


# contexts around the kernel's 16-row chunks and its block boundaries, one long one
CONTEXTS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 100, 449]


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_grouped_query_ratios_and_chunk_edges(group, head_dim, storage, build) -> None:
    """One new token per sequence (decode), GQA ratios 1-8 (8 = two tiles of 4 query
    vectors in the wide path), contexts at and around multiples of 16, block size 16."""
    got, ref = _attend(2 * group, 2, head_dim, 16, CONTEXTS, [1] * len(CONTEXTS), storage,
                       build=build, seed=group)
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


@pytest.mark.parametrize("block_size", [3, 5, 24, 48])
@pytest.mark.parametrize("build", BUILDS)
def test_block_sizes_that_split_the_chunks(block_size, build) -> None:
    """Blocks that are not a multiple of 16 rows: a chunk of rows spans several blocks."""
    got, ref = _attend(6, 2, 64, block_size, CONTEXTS, [1] * len(CONTEXTS), "bfloat16",
                       build=build, seed=block_size)
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


@pytest.mark.parametrize("head_dim", [8, 24, 40, 136, 256])
@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_head_dims_off_the_vector_width(head_dim, storage, build) -> None:
    """head_dim a multiple of 8 but not of 16 or 64: masked channel tails (AVX-512), last
    channel tiles of every length (AVX2), several tiles."""
    got, ref = _attend(4, 2, head_dim, 16, [5, 16, 70, 200], [1, 1, 3, 1], storage,
                       build=build, seed=head_dim)
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [8, 16, 24, 40, 56, 72])
@pytest.mark.parametrize("build", BUILDS)
def test_every_channel_tail_per_query_tile(heads, kv_heads, head_dim, build) -> None:
    """Each tile of 1-4 query vectors with head_dims that leave every possible number of
    channel vectors after the last full tile (the AVX2 path's tiles are 8, 4 or 2 vectors
    wide, by the number of query vectors)."""
    got, ref = _attend(heads, kv_heads, head_dim, 16, [3, 25, 61], [1, 2, 1], "bfloat16",
                       build=build, seed=head_dim + heads)
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_many_query_rows_per_kv_head(storage, build) -> None:
    """Speculative verification: 8 query heads x 8 new tokens = 64 query vectors per KV
    head (the limit), each row with its own causal limit inside the last chunk."""
    ctx = [8, 9, 23, 64, 130]
    got, ref = _attend(16, 2, 64, 16, ctx, [8] * len(ctx), storage, build=build)
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_shares_that_split_a_sequences_kv_heads(storage, build) -> None:
    """Work items are (sequence, KV head); a share of them may start or end inside a
    sequence's heads (the AVX2 path walks the heads of one sequence in a share together)."""
    ctx = [7, 40, 100, 3]  # 4 sequences x 3 KV heads = 12 items
    got, ref = _attend(9, 3, 64, 16, ctx, [1, 2, 1, 1], storage, build=build, threads=4,
                       cuts=[0, 1, 5, 6, 12])
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


@pytest.mark.parametrize("build", BUILDS)
def test_a_share_writes_only_its_own_items(build) -> None:
    """Items 1-4 only (sequence 0's KV heads 1-2, sequence 1's heads 0-1): every other
    head's output is left as it was (NaN here)."""
    got, ref = _attend(9, 3, 64, 16, [20, 33, 9], [1, 2, 1], "float32", build=build,
                       cuts=[1, 5])
    done = torch.zeros(got.shape[:2], dtype=torch.bool)
    done[0, 3:] = True  # sequence 0 (row 0): query heads of KV heads 1 and 2
    done[1:3, :6] = True  # sequence 1 (rows 1-2): query heads of KV heads 0 and 1
    assert torch.allclose(got[done], ref[done], atol=2e-5)
    assert torch.isnan(got[~done]).all()


@pytest.mark.parametrize("heads,kv_heads,q_len", [(16, 4, 5), (16, 8, 8), (12, 6, 11)])
@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_more_query_vectors_than_one_pass_holds(heads, kv_heads, q_len, storage,
                                                build) -> None:
    """A sequence's KV heads together have more query vectors than the kernel's limit per
    KV head (64): 4 x 4 x 5 = 80, 2 x 8 x 8 = 128, 2 x 6 x 11 = 132, so the heads go in
    several passes over the context."""
    ctx = [q_len, 30, 77]
    got, ref = _attend(heads, kv_heads, 32, 16, ctx, [q_len] * 3, storage, build=build,
                       seed=heads + q_len)
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_rising_and_large_scores(storage, build) -> None:
    """Scores that keep passing the running max (keys growing along the context) and
    scores in the hundreds (no overflow in the unnormalised sums) stay accurate."""
    ctx = [40, 300, 517]
    got, ref = _attend(6, 2, 64, 16, ctx, [1, 2, 1], storage, build=build, key_growth=0.05,
                       q_scale=4.0)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_slots_outside_the_context_are_never_read(storage, build) -> None:
    """NaN in every slot that no sequence owns (padding of each last block, the null
    block) leaves every output finite and correct."""
    got, ref = _attend(6, 2, 40, 16, [1, 17, 33, 95], [1, 1, 2, 1], storage, build=build,
                       poison_free_slots=True)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


def test_each_cpu_builds_its_widest_path() -> None:
    flags = cpu_kernels.cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    wide = {"avx512f", "avx512bw", "avx512vl"} <= flags
    avx2 = {"avx2", "fma"} <= flags
    assert cpu_kernels.kernel_path() == ("avx512" if wide else "avx2" if avx2 else "portable")
    assert cpu_kernels.vector_width() == (16 if wide else 8)
    assert cpu_kernels.kernel_path(cpu_kernels.avx2_library()) == (
        "avx2" if avx2 else "portable")
    assert cpu_kernels.kernel_path(cpu_kernels.portable_library()) == "portable"
    assert cpu_kernels.vector_width(cpu_kernels.portable_library()) == 8


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


def test_loading_the_kernel_keeps_subnormal_floats() -> None:
    """Linking with -ffast-math would set flush-to-zero for the whole process when the
    library loads; every float op afterwards (Python, numpy, torch) would lose subnormals."""
    import subprocess
    import sys

    code = ("import sys; from ridgeline.engine.kernels import cpu_kernels as k; "
            "tiny = sys.float_info.min; before = tiny / 2 > 0; "
            "assert k.load() is not None; "
            "print(before, tiny / 2 > 0, (tiny / 2) * 1.0 != 0.0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "True", "True"]


def test_a_lazy_library_is_built_once_and_no_concurrent_first_caller_sees_none():
    """While the first caller builds, others wait for the library instead of reading
    "not available" (which would send them down the slow PyTorch path)."""
    import threading
    import time

    calls = []

    def build():
        calls.append(1)
        time.sleep(0.2)  # a compile takes seconds
        return "lib"

    load = cpu_kernels.LazyLibrary(build)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(load())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == ["lib"] * 8 and calls == [1]
    assert load() == "lib" and calls == [1]


def _paged_case(heads: int, kv_heads: int, head_dim: int, ctx: list[int], storage: str,
                seed: int = 0, block_size: int = 16) -> dict:
    """Paged K/V for sequences of these contexts (blocks scattered), as the kernel reads
    them, and their values in float64 for a reference."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 1 + sum(-(-c // block_size) for c in ctx)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx]
    width = max(len(t) for t in tables)
    case = {"table": torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            "tables": tables, "scales": {}}
    if storage == "int8":
        (kq, ks), (vq, vs) = quantize(k, "int8"), quantize(v, "int8")
        case["scales"] = {"k_scale": ks, "v_scale": vs}
        k, v = dequantize(kq, ks, "int8", torch.float32), dequantize(vq, vs, "int8", torch.float32)
    elif storage == "bfloat16":
        kq, vq = k.bfloat16(), v.bfloat16()
        k, v = kq.float(), vq.float()
    else:
        kq, vq = k, v
    case.update(kq=kq, vq=vq, k64=k.double(), v64=v.double())
    return case


def _call(case: dict, q: torch.Tensor, q_lens: list[int], ctx: list[int], build: str,
          rows: list[int] | None = None) -> torch.Tensor:
    """The kernel over `case` for q's rows (dtype of q, out the same), sequences `rows` of
    the case (default all)."""
    rows = rows if rows is not None else list(range(len(ctx)))
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    cpu_kernels.paged_decode_attention(
        q, case["kq"], case["vq"], case["table"][rows].contiguous(),
        torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))]), torch.tensor(q_lens),
        torch.tensor(ctx), out, cuts=[0, len(ctx) * case["kq"].shape[2]], lib=_lib(build),
        **case["scales"])
    return out


def _reference64(case: dict, q: torch.Tensor, q_lens: list[int], ctx: list[int],
                absolute: bool = False) -> torch.Tensor:
    """Causal attention in float64 over the case's K/V values (q's values as given); with
    `absolute`, of |V|: the scale of the terms each output sums."""
    kvh, d = case["kq"].shape[2], case["kq"].shape[3]
    g = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for n, (ql, c) in enumerate(zip(q_lens, ctx)):
        t = case["tables"][n]
        kc = case["k64"][t].reshape(-1, kvh, d)[:c].repeat_interleave(g, 1)  # [c, heads, d]
        vc = case["v64"][t].reshape(-1, kvh, d)[:c].repeat_interleave(g, 1)
        vc = vc.abs() if absolute else vc
        qs = q[start:start + ql].double()
        s = torch.einsum("rhd,chd->hrc", qs, kc) * d ** -0.5
        mask = torch.arange(c)[None, :] <= torch.arange(ql)[:, None] + c - ql
        s = s.masked_fill(~mask[None], float("-inf"))
        out[start:start + ql] = torch.einsum("hrc,chd->rhd", s.softmax(-1), vc)
        start += ql
    return out


@pytest.mark.parametrize("head_dim", [8, 40, 64, 96, 128, 256])
@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_bfloat16_q_and_out_are_read_and_written_directly(head_dim, storage, build) -> None:
    """bfloat16 q/out (a bf16 model) straight through the kernel, no float32 copies: within
    a bfloat16 rounding of the float64 reference, in every path and storage (with a
    bfloat16 cache on AVX512_BF16 this is the vdpbf16ps score path); paths that widen q
    give exactly the float32 call's output rounded to bfloat16. The vdpbf16ps path also
    rounds the softmax weights to bfloat16 for P V (2^-9 of each term, as FlashAttention
    in bf16): it is held to that on the scale of the terms, sum p |v|."""
    ctx, q_lens = [1, 16, 17, 70, 333], [1, 1, 2, 1, 8]
    case = _paged_case(6, 2, head_dim, ctx, storage, seed=head_dim)
    qkv = torch.randn(sum(q_lens), 10, head_dim).bfloat16()
    q = qkv[:, :6]  # strided rows, as the model passes them
    got = _call(case, q, q_lens, ctx, build)
    assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    ref = _reference64(case, q, q_lens, ctx)
    dot = storage == "bfloat16" and cpu_kernels.bf16_dot_scores(_lib(build))
    terms = _reference64(case, q, q_lens, ctx, absolute=True) * 2 ** -8 if dot else 0.0
    err = (got.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -8 + terms + 2e-5).all(), err.max()
    if dot:  # a one-row context is that row's V exactly: no weight to round
        assert torch.equal(got[0], case["v64"][case["tables"][0]].reshape(-1, 2, head_dim)[0]
                           .repeat_interleave(3, 0).bfloat16())
    if not dot:
        want = _call(case, q.float(), q_lens, ctx, build)
        assert torch.equal(got, want.bfloat16())


def test_the_bfloat16_dot_path_is_compiled_where_the_cpu_has_it() -> None:
    flags = cpu_kernels.cpu_flags()
    wide = {"avx512f", "avx512bw", "avx512vl"} <= flags
    assert cpu_kernels.bf16_dot_scores() == (wide and "avx512_bf16" in flags)
    assert not cpu_kernels.bf16_dot_scores(cpu_kernels.avx2_library())
    assert not cpu_kernels.bf16_dot_scores(cpu_kernels.portable_library())


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (16, 2), (4, 4)])
@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("build", BUILDS)
def test_a_verify_row_equals_the_decode_of_that_row_bit_for_bit(q_dtype, heads, kv_heads,
                                                                storage, build) -> None:
    """Speculative verification: row r of a sequence's 1-8 new rows (in a batch with other
    sequences, its query vectors in other tiles) gives exactly what decoding that row
    alone over its own context gives."""
    ctx = [40, 129, 300]
    q_lens = [3, 8, 5]
    case = _paged_case(heads, kv_heads, 64, ctx, storage, seed=heads)
    q = torch.randn(sum(q_lens), heads, 64).to(q_dtype)
    batch = _call(case, q, q_lens, ctx, build)
    start = 0
    for n, (ql, c) in enumerate(zip(q_lens, ctx)):
        for r in range(ql):
            alone = _call(case, q[start + r:start + r + 1], [1], [c - (ql - 1 - r)], build,
                          rows=[n])
            assert torch.equal(alone[0], batch[start + r]), (n, r)
        start += ql
