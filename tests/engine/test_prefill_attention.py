"""The C prefill-attention kernel (causal attention of long query runs over the paged
cache) equals float64 attention in each of its builds, and the engine's prefill through it
equals PyTorch's SDPA path and transformers' greedy output."""

from __future__ import annotations

import random

import pytest
import torch

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.kernels import cpu_kernels
from ridgeline.engine.model_executor.attention import build_attention_metadata, paged_attention
from ridgeline.engine.model_executor.kv_quant import make_kv_cache
from tests.helpers.engine_fixtures import (
    KERNEL_BUILDS,
    cached_model,
    hf_greedy,
    kernel_build,
    random_prompts,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="no C compiler to build the kernel")

BUILDS = KERNEL_BUILDS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


_lib = kernel_build


def _attend(heads: int, kv_heads: int, head_dim: int, block_size: int,
            seqs: list[tuple[int, int]], cache_dtype: str = "float32",
            q_dtype: str = "float32", *, build: str = "native", threads: int = 1,
            cuts: list[int] | None = None, seed: int = 0, key_growth: float = 0.0,
            q_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kernel output, float64 reference, the bound of its bf16 softmax weights' rounding)
    for sequences given as (context length, new rows): the new rows are the last positions
    of the context. Every slot no sequence owns
    (the null block, spare blocks, the tail of each last block) holds NaN, which must never
    reach an output; key_growth scales keys of later positions up (a rising running max:
    the rescaling path)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    g = heads // kv_heads
    num_blocks = 1 + sum(-(-c // block_size) for c, _ in seqs) + 2
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c, _ in seqs]
    keys, values = [], []
    for (c, _), table in zip(seqs, tables):
        k = torch.randn(c, kv_heads, head_dim) * (1 + key_growth * torch.arange(c))[:, None,
                                                                                    None]
        v = torch.randn(c, kv_heads, head_dim)
        k = k.to(DTYPES[cache_dtype]).float()
        v = v.to(DTYPES[cache_dtype]).float()
        for p in range(c):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    k_cache = k_cache.to(DTYPES[cache_dtype])
    v_cache = v_cache.to(DTYPES[cache_dtype])
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q_lens = [n for _, n in seqs]
    total = sum(q_lens)
    # q strided within rows, as the model's fused qkv projection leaves it
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim) * q_scale
    q = qkv.to(DTYPES[q_dtype])[:, :heads]
    out = torch.full((total, heads, head_dim), float("nan"), dtype=DTYPES[q_dtype])
    starts = [sum(q_lens[:i]) for i in range(len(seqs))]
    ctx = [c for c, _ in seqs]
    work, default_cuts = cpu_kernels.prefill_work(q_lens, ctx, kv_heads, g, threads)
    cpu_kernels.paged_prefill_attention(
        q, k_cache, v_cache, block_table, torch.tensor(starts), torch.tensor(q_lens),
        torch.tensor(ctx), out, work, cuts if cuts is not None else default_cuts,
        lib=_lib(build))
    ref = torch.empty(total, heads, head_dim, dtype=torch.float64)
    terms = torch.zeros_like(ref)
    # bf16 q and cache with vdpbf16ps: P is rounded to bf16 for P V, 2^-9 of each term
    dot = q_dtype == cache_dtype == "bfloat16" and cpu_kernels.bf16_dot_scores(_lib(build))
    for (c, n), s, k, v in zip(seqs, starts, keys, values):
        qq = q[s:s + n].double().transpose(0, 1)  # [h, n, d]
        kk = k.double().repeat_interleave(g, 1).transpose(0, 1)  # [h, c, d]
        vv = v.double().repeat_interleave(g, 1).transpose(0, 1)
        scores = qq @ kk.transpose(1, 2) * head_dim ** -0.5
        pos = torch.arange(c - n, c)[:, None]
        scores = scores.masked_fill(torch.arange(c)[None, :] > pos, float("-inf"))
        ref[s:s + n] = (scores.softmax(-1) @ vv).transpose(0, 1)
        if dot:
            terms[s:s + n] = (scores.softmax(-1) @ vv.abs()).transpose(0, 1) * 2 ** -8
    return out, ref, terms


def _check(out: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    if out.dtype == torch.bfloat16:  # the float32 result, rounded once to bfloat16
        err = (out.double() - ref).abs()
        assert (err <= ref.abs() * 2 ** -8 + terms + 1e-5).all(), err.max()
    else:
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


# (context, new rows): fresh prompts (context == rows) and chunks over cached context, of
# lengths that are multiples of no tile, chunk or block size, including single rows
MIXED = [(100, 100), (37, 37), (300, 70), (1, 1), (129, 9), (65, 23), (2, 2), (200, 130)]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 40),
                                                      (8, 2, 64)])
@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                    ("bfloat16", "float32")])
def test_matches_float64_reference(build, heads, kv_heads, head_dim, dtypes):
    cache_dtype, q_dtype = dtypes
    _check(*_attend(heads, kv_heads, head_dim, 16, MIXED, cache_dtype, q_dtype, build=build,
                    threads=2))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("block_size", [1, 5, 8, 32, 256])
def test_block_sizes(build, block_size):
    _check(*_attend(6, 2, 64, block_size, [(90, 90), (257, 41), (33, 17)], build=build))
    _check(*_attend(6, 2, 64, block_size, [(90, 90), (257, 41)], "bfloat16", "bfloat16",
                    build=build))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("heads,kv_heads", [(1, 1), (3, 1), (16, 2), (64, 1)])
def test_group_sizes(build, heads, kv_heads):
    """From one query vector per row to a whole tile's worth of heads per row."""
    _check(*_attend(heads, kv_heads, 32, 16, [(70, 70), (90, 25)], build=build))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_rising_and_large_scores(build, dtypes):
    """Keys that grow along the context keep raising each row's running max (every chunk
    rescales); large queries give peaked softmaxes."""
    _check(*_attend(9, 3, 64, 16, [(300, 300), (400, 120)], *dtypes, build=build,
                    key_growth=0.02, q_scale=4.0))


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_thread_splits(threads):
    seqs = [(512, 512), (64, 64), (700, 200), (90, 90), (33, 33)]
    _check(*_attend(9, 3, 64, 16, seqs, threads=threads))
    work, cuts = cpu_kernels.prefill_work([n for _, n in seqs], [c for c, _ in seqs], 3, 3,
                                          threads)
    assert cuts[0] == 0 and cuts[-1] == work.shape[0] and cuts == sorted(cuts)
    assert len(cuts) - 1 == threads


def test_any_cut_gives_the_same_output():
    seqs = [(150, 150), (80, 30)]
    work, _ = cpu_kernels.prefill_work([150, 30], [150, 80], 2, 2, 1)
    items = work.shape[0]
    base, _, _ = _attend(4, 2, 64, 16, seqs, cuts=[0, items])
    for cut in range(items + 1):
        out, _, _ = _attend(4, 2, 64, 16, seqs, cuts=[0, cut, items])
        assert torch.equal(out, base)
    out, _, _ = _attend(4, 2, 64, 16, seqs, cuts=list(range(items + 1)))
    assert torch.equal(out, base)


def test_work_items_cover_every_row_once_and_balance():
    q_len, ctx = [64, 512, 1, 100], [64, 512, 1, 300]
    for g in (1, 3, 4, 8):
        work, cuts = cpu_kernels.prefill_work(q_len, ctx, 2, g, 2)
        assert len(cuts) == 3 and cuts[-1] == work.shape[0]
        rows = torch.zeros(len(q_len), 2, max(q_len), dtype=torch.long)
        for n, j, r0, nr in work.tolist():
            assert 1 <= nr and nr * g <= cpu_kernels.PREFILL_LANES
            rows[n, j, r0:r0 + nr] += 1
        for n, ql in enumerate(q_len):
            assert (rows[n, :, :ql] == 1).all() and (rows[n, :, ql:] == 0).all()
    work, _ = cpu_kernels.prefill_work([0, 5], [3, 5], 2, 3, 2)  # no rows, no items
    assert work[:, 0].tolist() == [1, 1]
    # 64 rows of 3 heads: 4 tiles of 16 rows (48 query vectors each), not 21+21+21+1
    work, _ = cpu_kernels.prefill_work([64], [64], 1, 3, 1)
    assert work[:, 3].tolist() == [16, 16, 16, 16]
    # the split is by cost: the long sequence's later tiles weigh more than its first
    costs = [1] * 10 + [100]
    assert cpu_kernels.balanced_cuts(costs, 2) == [0, 10, 11]
    assert cpu_kernels.balanced_cuts([5, 5, 5, 5], 2) == [0, 2, 4]
    assert cpu_kernels.balanced_cuts([5, 5], 2, min_total=100) == [0, 2]


def test_bad_shapes_raise():
    lib = cpu_kernels.load()
    q = torch.randn(4, 2, 12)
    cache = torch.randn(2, 4, 1, 12)
    with pytest.raises(RuntimeError, match="prefill"):
        cpu_kernels.paged_prefill_attention(
            q, cache, cache, torch.tensor([[1]]), torch.tensor([0]), torch.tensor([4]),
            torch.tensor([4]), torch.empty(4, 2, 12), lib=lib)


def _paged_batch(cache_dtype: torch.dtype, model_dtype: torch.dtype, use_kernel: bool,
                 seed: int = 0) -> torch.Tensor:
    """paged_attention over one step that mixes every kind of sequence: fresh prompts, a
    chunk and a prefix hit over cached context, decodes; first a step that fills the
    cached context. The output of the second step."""
    torch.manual_seed(seed)
    heads, kvh, d, bs = 9, 3, 64, 16
    cache = make_kv_cache("auto" if cache_dtype == model_dtype else
                          {torch.float32: "float32", torch.bfloat16: "bfloat16"}[cache_dtype],
                          num_layers=1, num_blocks=64, block_size=bs, num_kv_heads=kvh,
                          head_dim=d, model_dtype=model_dtype)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(6)]
    # step 1: fresh prompts that become the cached context of step 2
    step1 = [(tables[0], 0, 40), (tables[1], 0, 77), (tables[2], 0, 16)]
    # step 2: a chunk over 40 cached, a decode over 77, a 3-token verify over 16, fresh
    step2 = [(tables[0], 40, 50), (tables[1], 77, 1), (tables[2], 16, 3), (tables[3], 0, 60),
             (tables[4], 0, 9), (tables[5], 0, 1)]
    out = None
    for batch in (step1, step2):
        meta = build_attention_metadata(batch, bs, heads, kvh, torch.device("cpu"),
                                        use_kernel=use_kernel, prefill_kernel=use_kernel)
        assert (meta.prefill is not None) == use_kernel
        assert (not meta.fresh and not meta.chunks) == use_kernel  # one path's metadata
        total = sum(n for _, _, n in batch)
        q = torch.randn(total, heads, d).to(model_dtype)
        k = torch.randn(total, kvh, d).to(model_dtype)
        v = torch.randn(total, kvh, d).to(model_dtype)
        out = paged_attention(q, k, v, cache, 0, meta)
    assert out is not None
    return out


@pytest.mark.parametrize("model_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16)])
def test_paged_attention_matches_sdpa(model_dtype, cache_dtype):
    kernel = _paged_batch(cache_dtype, model_dtype, use_kernel=True)
    sdpa = _paged_batch(cache_dtype, model_dtype, use_kernel=False)
    if model_dtype == torch.float32 and cache_dtype == torch.float32:
        torch.testing.assert_close(kernel, sdpa, rtol=1e-5, atol=1e-5)
    elif model_dtype == torch.bfloat16:
        torch.testing.assert_close(kernel.float(), sdpa.float(), rtol=2 ** -7, atol=1e-2)
    else:  # SDPA's fresh path attends to the unrounded keys, the kernel to the cache's
        torch.testing.assert_close(kernel, sdpa, rtol=1e-2, atol=1e-2)


def test_engine_prefill_through_the_kernel_matches_transformers(monkeypatch):
    """Fresh prompts, 24-token chunks and prefix-cache hits all take the prefill kernel,
    and greedy output stays transformers' own."""
    calls = []
    real = cpu_kernels.paged_prefill_attention

    def counting(*args, **kwargs):
        calls.append(int(args[5].max()))  # longest new-row run of the call
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "paged_prefill_attention", counting)
    model = cached_model("llama")
    prompts = random_prompts(8, 512, seed=3, min_len=20, max_len=90, shared_prefix=33)
    llm = LLM.from_hf_model(model, num_kv_blocks=300, block_size=8, max_num_seqs=8,
                            max_num_batched_tokens=48)
    assert llm.engine.runner.use_kernel
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                ignore_eos=True))
    assert calls and max(calls) > 8
    assert llm.engine.stats().prefix_cache_hits > 0
    for i, (out, p) in enumerate(zip(outs, prompts)):
        ids, lps = hf_greedy(model, p, 16)
        assert out.outputs[0].token_ids == ids, f"prompt {i} diverged"
        assert max(abs(a - b) for a, b in zip(out.outputs[0].logprobs, lps)) < 1e-4
