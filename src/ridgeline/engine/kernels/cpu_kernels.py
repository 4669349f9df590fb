"""C kernels for attention straight over the paged KV pool (CPU): decode (a few new tokens
per sequence) and prefill (long causal runs of new tokens); the C is csrc/paged_attention.c.

In PyTorch alone, decode attention over a paged context first gathers every sequence's
blocks into a padded copy (the KV read twice and written once per layer and step), and the
fused CPU attention kernel is built for long queries, not one token per sequence. These
kernels read each block once, where it lies, with an online softmax in float32. A decode
work item is a (sequence, KV head) pair, so grouped-query heads share each key and value
they load; a prefill work item is a tile of up to 64 query vectors (flash-style).

Three paths in one source, chosen at compile time by `-march=native`: AVX-512 (16 wide;
with AVX512_BF16, bfloat16 scores and P V by vdpbf16ps), AVX2 + FMA (8 wide) and a portable
8-wide path (GCC/Clang vector extensions); the C's comments describe each. K/V may be
float32, bfloat16 or (decode) int8; q and out float32 or bfloat16, read and written as
such. `avx2_library()` and `portable_library()` build the narrower paths on CPUs that
compile a wider one, for tests and benchmarks; `kernel_path()` says which path a build has.

Attention sinks (gpt-oss: a learned logit per query head that joins the softmax's
denominator, with no value) are an optional float32 [heads] argument of both kernels:
the online softmax's final sum gains exp(sink - max), the max taken over the sink too.

Built on first use (`kernel_build`) and called through ctypes, which releases the GIL, so
work items are split over a few Python threads. Without a compiler the engine falls back
to the PyTorch path, which computes the same thing.
Measurements: docs/benchmarks.md, "Engine C kernels".
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from ridgeline.engine.kernels import kernel_build

# Other modules and tests use these through this module.
from ridgeline.engine.kernels.kernel_build import LazyLibrary, cpu_flags  # noqa: F401

# The C source's MAXQV, MAXD and MAXBS (tests/engine/test_kernel_sources.py checks them).
MAX_QUERY_VECTORS = 64  # query heads per KV head x new tokens per sequence
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 256

# Tried in order: with fast math the reductions and expf vectorise (glibc's libmvec);
# without it the kernel is slower but needs nothing beyond a C compiler and libm.
_FLAG_SETS = [
    ["-O3", "-march=native", "-ffast-math", "-shared", "-fPIC", "-lmvec", "-lm"],
    ["-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC", "-lm"],
    ["-O3", "-fno-math-errno", "-shared", "-fPIC", "-lm"],  # compilers without -march
]


def _build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    target = kernel_build.compile_library("paged_attention",
                                          kernel_build.read_source("paged_attention"),
                                          [[*flags, *extra_flags] for flags in _FLAG_SETS])
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    # the decode entry points with a trailing sliding window (0: the whole context) and
    # attention sinks (NULL: none); the plain ones, without them, are the decode stack's
    # (it calls them by pointer)
    for fn in (lib.paged_attention_window_f32, lib.paged_attention_window_bf16):
        fn.argtypes = [ptr, i64, i64, c_int, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64,
                       i64, c_int, c_int, c_int, c_int, ctypes.c_float, i64, ptr]
        fn.restype = ctypes.c_int
    fn = lib.paged_attention_window_i8
    fn.argtypes = [ptr, i64, i64, c_int, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64,
                   i64, i64, c_int, c_int, c_int, c_int, ctypes.c_float, i64, ptr]
    fn.restype = ctypes.c_int
    fn = lib.paged_prefill_attention
    fn.argtypes = [ptr, i64, i64, c_int, ptr, ptr, c_int, ptr, i64, ptr, ptr, ptr, ptr, i64,
                   c_int, ptr, i64, i64, c_int, c_int, c_int, c_int, ctypes.c_float, i64, ptr]
    fn.restype = ctypes.c_int
    for fn in (lib.paged_attention_vector_width, lib.paged_attention_path,
               lib.paged_prefill_lanes, lib.paged_attention_bf16_dot):
        fn.argtypes = []
        fn.restype = c_int
    return lib


# x86 compilers only know the flag; elsewhere there is no AVX-512 to turn off
_NO_AVX512 = ("-mno-avx512f",) if platform.machine().lower() in ("x86_64", "amd64") else ()


@functools.cache
def portable_library() -> ctypes.CDLL | None:
    """The kernel's portable path (GCC vector extensions), as CPUs with neither AVX-512 nor
    AVX2 + FMA build it, compiled for this CPU without AVX-512: for tests and benchmarks
    on machines that build a faster path. None without a C compiler. The engine always
    uses `load()`."""
    return _build((*_NO_AVX512, "-DRIDGELINE_PORTABLE"))


@functools.cache
def avx2_library() -> ctypes.CDLL | None:
    """The kernel as CPUs with AVX2 + FMA and no AVX-512 build it (`-mno-avx512f`), for
    tests and benchmarks on a machine that has AVX-512; on a CPU without AVX2 it is the
    portable path (see `kernel_path`). None without a C compiler."""
    return _build(_NO_AVX512)


def vector_width(lib: ctypes.CDLL | None = None) -> int:
    """Floats per vector register in the kernel as compiled here (16 with AVX-512, else 8;
    0 when it cannot be built)."""
    lib = lib if lib is not None else load()
    return lib.paged_attention_vector_width() if lib is not None else 0


def bf16_dot_scores(lib: ctypes.CDLL | None = None) -> bool:
    """Whether `lib` (default `load()`) scores bfloat16 q against a bfloat16 cache with
    AVX512_BF16's vdpbf16ps (AVX-512 path, compiled where the CPU has it)."""
    lib = lib if lib is not None else load()
    return lib is not None and bool(lib.paged_attention_bf16_dot())


def kernel_path(lib: ctypes.CDLL | None = None) -> str:
    """Which of the kernel's paths `lib` (default `load()`) was compiled with: "avx512",
    "avx2" or "portable"; "" when it cannot be built."""
    lib = lib if lib is not None else load()
    if lib is None:
        return ""
    return {2: "avx512", 1: "avx2"}.get(lib.paged_attention_path(), "portable")


_pool: ThreadPoolExecutor | None = None

#: The compiled attention kernel, or None when it cannot be built here.
load = LazyLibrary(_build)


def available() -> bool:
    return load() is not None


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             max_query_len: int) -> bool:
    return (head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0 and block_size <= MAX_BLOCK_SIZE
            and (num_heads // num_kv_heads) * max_query_len <= MAX_QUERY_VECTORS)


def split_work(ctx_len: list[int], kvh: int, threads: int) -> list[int]:
    """Boundaries [0, ..., items] of the per-thread shares of the decode kernel's work
    items (sequence x KV head), balanced by context length; one share when the work is
    too small to be worth a thread hand-off. The same for every layer of a step, so
    computed once per step."""
    return balanced_cuts([c for c in ctx_len for _ in range(kvh)], threads, min_total=4096)


def _needs_float32(q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the attention kernels must run on float32 copies of q and out (they read
    and write float32 or bfloat16, the same dtype for both)."""
    return q.dtype not in (torch.float32, torch.bfloat16) or out.dtype != q.dtype


def _in_float32(call: Callable[[torch.Tensor, torch.Tensor], None], q: torch.Tensor,
                out: torch.Tensor) -> None:
    """call(q as float32, a float32 out), then out = that result."""
    out32 = torch.empty(out.shape, dtype=torch.float32)
    call(q.float(), out32)
    out.copy_(out32)  # rows of other paths are written after this call


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, q_start: torch.Tensor,
                           q_len: torch.Tensor, ctx_len: torch.Tensor,
                           out: torch.Tensor, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           cuts: list[int] | None = None,
                           lib: ctypes.CDLL | None = None, *, window: int = 0,
                           scale: float | None = None,
                           sinks: torch.Tensor | None = None) -> None:
    """out[rows of each sequence] = attention of q's rows over the paged context (with
    `window` > 0, transformers' sliding window: a row at position p sees the keys at
    positions (p - window, p], and blocks before the first row's window are not read);
    scores are scaled by `scale` (default head_dim ** -0.5); `sinks`: each query head's
    attention sink ([heads], any float dtype), a logit in the softmax's denominator only.

    q, out: [T, heads, d] with unit stride on d (rows and q's heads may be strided; out's
    heads d apart), both float32 or both bfloat16, read and written as such (other dtypes
    go through float32 copies; the kernel accumulates in float32; bfloat16 q with a
    bfloat16 cache scores by AVX512_BF16's vdpbf16ps where compiled in, see
    `bf16_dot_scores`);
    k_cache, v_cache: contiguous [blocks, block_size, kv_heads, d], float32, bfloat16, or
    int8 codes with `k_scale`/`v_scale` contiguous float32 [blocks, block_size, kv_heads];
    block_table: contiguous int64 [n, max_blocks]; q_start/q_len/ctx_len: int64 [n];
    cuts: the per-thread shares (`split_work`), computed here when not given; lib: the
    compiled kernel to call (default `load()`; tests pass `portable_library()`)."""
    if _needs_float32(q, out):
        return _in_float32(lambda q32, out32: paged_decode_attention(
            q32, k_cache, v_cache, block_table, q_start, q_len, ctx_len, out32, k_scale,
            v_scale, cuts, lib, window=window, scale=scale, sinks=sinks), q, out)
    lib = lib if lib is not None else load()
    assert lib is not None
    _, bs, kvh, d = k_cache.shape
    g = q.shape[1] // kvh
    if k_scale is None:
        kernel = (lib.paged_attention_window_bf16 if k_cache.dtype == torch.bfloat16
                  else lib.paged_attention_window_f32)
        caches: tuple[int, ...] = (k_cache.data_ptr(), v_cache.data_ptr())
    else:
        assert v_scale is not None and k_cache.dtype == torch.int8
        kernel = lib.paged_attention_window_i8
        caches = (k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(),
                  v_scale.data_ptr())
    assert q.stride(2) == 1 and out.stride(2) == 1 and out.stride(1) == d
    args = (q.data_ptr(), q.stride(0), q.stride(1), int(q.dtype == torch.bfloat16), *caches,
            block_table.data_ptr(), block_table.stride(0), q_start.data_ptr(),
            q_len.data_ptr(), ctx_len.data_ptr(), out.data_ptr(), out.stride(0))
    sinks = _sinks(sinks, q.shape[1])
    tail = (kvh, g, d, bs, ctypes.c_float(d ** -0.5 if scale is None else scale), window,
            None if sinks is None else sinks.data_ptr())
    if cuts is None:
        cuts = split_work(ctx_len.tolist(), kvh, torch.get_num_threads())
    run_shares(kernel, args, tail, cuts, "paged attention")


def _sinks(sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The kernels' sinks argument: contiguous float32 [heads] (the caller keeps the
    returned tensor alive through the call)."""
    if sinks is None:
        return None
    sinks = sinks.detach().to(torch.float32).contiguous()
    if sinks.shape != (heads,) or not sinks.is_cpu:
        raise ValueError(f"sinks must be one value per query head ({heads}), on the CPU; "
                         f"got {tuple(sinks.shape)}")
    return sinks


def run_shares(kernel: Callable[..., int], args: tuple, tail: tuple, cuts: list[int],
                what: str) -> None:
    """kernel(*args, begin, end, *tail) for each share [cuts[t], cuts[t + 1]), the shares
    on the pool's threads and this one (ctypes releases the GIL); a nonzero return is a
    failure. The one pool of the engine's C kernels (`decode_ops` splits over it too)."""
    global _pool
    shares = len(cuts) - 1
    futures = []
    if shares > 1:
        if _pool is None or _pool._max_workers < shares - 1:  # noqa: SLF001
            _pool = ThreadPoolExecutor(shares - 1, thread_name_prefix="ridgeline-kernel")
        futures = [_pool.submit(kernel, *args, cuts[t], cuts[t + 1], *tail)
                   for t in range(shares - 1) if cuts[t] < cuts[t + 1]]
    # the calling thread takes the last share: one hand-off fewer, one thread fewer
    rcs = [kernel(*args, cuts[-2], cuts[-1], *tail)]
    rcs += [f.result() for f in futures]
    if any(rcs):
        raise RuntimeError(f"{what} kernel failed ({rcs})")


#: Query vectors (rows x grouped heads) per prefill tile; the C source's PLANES.
PREFILL_LANES = 64


def prefill_work(q_len: list[int], ctx_len: list[int], kvh: int, g: int,
                 threads: int) -> tuple[torch.Tensor, list[int]]:
    """The prefill kernel's work items, int64 [items, 4] (sequence, KV head, first row,
    rows), and the per-thread shares of them (boundaries [0, ..., items]), balanced by
    cost: a tile costs its query vectors (padded to 16) times the keys its rows see, so
    later tiles of a sequence weigh more. A sequence's rows are cut into equal tiles of at
    most PREFILL_LANES // g rows (64 rows, 3 heads: 3 tiles of 22, not 21 + 21 + 21 + 1).
    Computed once per step: every layer has the same."""
    max_rows = max(1, PREFILL_LANES // g)
    items: list[tuple[int, int, int, int]] = []
    costs: list[int] = []
    for n, (ql, ctx) in enumerate(zip(q_len, ctx_len)):
        if ql <= 0:
            continue
        tiles = -(-ql // max_rows)
        rows = -(-ql // tiles)
        tiles_of_seq = []
        for r0 in range(0, ql, rows):
            nr = min(rows, ql - r0)
            lanes = -(-nr * g // 16) * 16
            # keys seen + a fixed part (packing q, writing out), both per lane
            tiles_of_seq.append((r0, nr, lanes * (ctx - ql + r0 + nr + 16)))
        for j in range(kvh):
            for r0, nr, cost in tiles_of_seq:
                items.append((n, j, r0, nr))
                costs.append(cost)
    work = torch.tensor(items, dtype=torch.long).view(-1, 4)
    return work, balanced_cuts(costs, threads, min_total=64 * 4096)


def balanced_cuts(costs: list[int], threads: int, min_total: int = 0) -> list[int]:
    """Boundaries [0, ..., len(costs)] of `threads` contiguous shares of nearly equal
    total cost; one share when the total is below `min_total` (not worth a hand-off)."""
    items = len(costs)
    total = sum(costs)
    threads = min(threads, items)
    if threads <= 1 or total < min_total:
        return [0, items]
    cuts = [0]
    acc = 0
    i = 0
    for t in range(1, threads):
        target = total * t / threads
        while i < items and acc + costs[i] <= target:
            acc += costs[i]
            i += 1
        # take item i too when that lands nearer the target than stopping before it
        if i < items and acc + costs[i] - target < target - acc:
            acc += costs[i]
            i += 1
        cuts.append(i)
    cuts.append(items)
    return cuts


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, q_start: torch.Tensor,
                            q_len: torch.Tensor, ctx_len: torch.Tensor, out: torch.Tensor,
                            work: torch.Tensor | None = None, cuts: list[int] | None = None,
                            lib: ctypes.CDLL | None = None, *, window: int = 0,
                            scale: float | None = None,
                            sinks: torch.Tensor | None = None) -> None:
    """Causal attention of long query runs over the paged cache: sequence n's q_len[n]
    new rows (flat rows q_start[n]...) are positions [ctx_len - q_len, ctx_len) and each
    attends to positions [0, its own] of the cache (with `window` > 0: (its own - window,
    its own], transformers' sliding window; scores scaled by `scale`, default
    head_dim ** -0.5; `sinks` as in `paged_decode_attention`), which already holds their
    keys and
    values (the engine writes them first), so fresh prompts (ctx_len == q_len) and later
    chunks over cached context are the same call.

    q, out: [T, heads, d] with unit stride on d (rows and q's heads may be strided; out's
    heads d apart), float32 or bfloat16, read and written as such (other dtypes go through
    float32 copies); k_cache, v_cache: contiguous [blocks, block_size, kv_heads, d],
    float32 or bfloat16; block_table: contiguous int64 [n, max_blocks]; q_start/q_len/
    ctx_len: contiguous int64 [n]; work/cuts: `prefill_work`'s (computed here when not
    given); lib: the compiled kernel (default `load()`)."""
    if _needs_float32(q, out):
        return _in_float32(lambda q32, out32: paged_prefill_attention(
            q32, k_cache, v_cache, block_table, q_start, q_len, ctx_len, out32, work, cuts,
            lib, window=window, scale=scale, sinks=sinks), q, out)
    lib = lib if lib is not None else load()
    assert lib is not None
    _, bs, kvh, d = k_cache.shape
    g = q.shape[1] // kvh
    assert k_cache.dtype in (torch.float32, torch.bfloat16) and v_cache.dtype == k_cache.dtype
    assert q.stride(2) == 1 and out.stride(2) == 1 and out.stride(1) == d
    if work is None:
        work, cuts = prefill_work(q_len.tolist(), ctx_len.tolist(), kvh, g,
                                  torch.get_num_threads())
    elif cuts is None:
        cuts = [0, work.shape[0]]
    if work.shape[0] == 0:
        return
    bf16 = int(q.dtype == torch.bfloat16)
    args = (q.data_ptr(), q.stride(0), q.stride(1), bf16, k_cache.data_ptr(),
            v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), block_table.data_ptr(),
            block_table.stride(0), q_start.data_ptr(), q_len.data_ptr(), ctx_len.data_ptr(),
            out.data_ptr(), out.stride(0), bf16, work.data_ptr())
    sinks = _sinks(sinks, q.shape[1])
    tail = (kvh, g, d, bs, ctypes.c_float(d ** -0.5 if scale is None else scale), window,
            None if sinks is None else sinks.data_ptr())
    run_shares(lib.paged_prefill_attention, args, tail, cuts, "paged prefill attention")
