"""A C kernel for decode attention straight over the paged KV pool (CPU, float32).

In PyTorch alone, attending a batch of decoding sequences to their paged context means
gathering every sequence's blocks into a padded copy first, then running attention over
the copy: the KV is read twice and written once per layer and step, and the fused CPU
attention kernel is built for long queries, not for one token per sequence. This kernel
reads each block once, where it lies, with an online softmax; one work item is one
(sequence, KV head) pair, so grouped-query heads share each key and value they load.

It is compiled on first use with the system C compiler (about a second) into
`~/.cache/ridgeline/kernels/` and called through ctypes, which releases the GIL, so work
items are split over a few Python threads. Without a compiler the engine falls back to
the PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_QUERY_VECTORS = 64  # query heads per KV head x new tokens per sequence
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 256

SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAXQV %(maxqv)d
#define MAXD %(maxd)d
#define MAXBS %(maxbs)d

/* 8 floats in one register on AVX (two on SSE/NEON): GCC and Clang vector extensions, so
   the loops below are vectorised on any target without intrinsics. memcpy = unaligned. */
typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld8(const float* p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void st8(float* p, v8 v) { memcpy(p, &v, sizeof v); }
typedef signed char c8 __attribute__((vector_size(8)));
static inline v8 ldq8(const signed char* p) {
  c8 r; memcpy(&r, p, sizeof r); return __builtin_convertvector(r, v8);
}
/* bfloat16 is the top half of a float32: widen to 32 bits and shift into place */
typedef unsigned short h8 __attribute__((vector_size(16)));
typedef unsigned int w8 __attribute__((vector_size(32)));
static inline v8 ldb8(const unsigned short* p) {
  h8 r; memcpy(&r, p, sizeof r);
  w8 w = __builtin_convertvector(r, w8) << 16;
  v8 f; memcpy(&f, &w, sizeof f); return f;
}
static inline float hsum8(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* kept out of line so the compiler vectorises it (with glibc's vector expf) */
__attribute__((noinline)) static void exp_inplace(float* p, int n) {
  for (int t = 0; t < n; ++t) p[t] = expf(p[t]);
}

/* Items [item_begin, item_end): item = sequence * kvh + kv head. For each of the g query
   heads of that KV head and each new query row r of the sequence (row r sees positions
   < ctx - (q_len - 1 - r)), softmax(q k^T * scale) v over the context, block by block:
   each key row is loaded once for all query vectors, the next block is prefetched (it
   lies anywhere in the pool), and values accumulate 32 channels at a time in registers.
   MODE (a compile-time constant after inlining) is how K/V are stored: 0 float32;
   1 int8 codes with a float scale per (slot, head), dequantized as they are loaded (scale
   folded into score and weight); 2 bfloat16, widened as loaded. */
#define LOADK(ptr, x) \
  (MODE == 1 ? ldq8((const signed char*)(ptr) + (x)) \
   : MODE == 2 ? ldb8((const unsigned short*)(ptr) + (x)) : ld8((const float*)(ptr) + (x)))
static inline __attribute__((always_inline)) int attention_body(
    const int MODE,
    const float* q, int64_t q_row_stride, int64_t q_head_stride,
    const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    float* out, int64_t out_row_stride,
    int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale) {
  const int QUANT = MODE == 1;
  const int64_t esize = MODE == 1 ? 1 : MODE == 2 ? 2 : 4;
  if (d > MAXD || bs > MAXBS || d %% 8 != 0) return -1;
  float m[MAXQV], l[MAXQV];
  float s[MAXQV][MAXBS];
  float qs[MAXQV][MAXD];
  float acc[MAXQV][MAXD];
  int64_t lim[MAXQV];
  const int64_t tok_stride = (int64_t)kvh * d;
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t i = item / kvh, j = item %% kvh;
    const int ql = (int)q_len[i];
    const int nq = g * ql;
    if (nq > MAXQV) return -2;
    const int64_t ctx = ctx_len[i];
    for (int a = 0; a < nq; ++a) {
      const int gi = a / ql, r = a %% ql;
      const float* src = q + (q_start[i] + r) * q_row_stride + (j * g + gi) * q_head_stride;
      for (int x = 0; x < d; ++x) { qs[a][x] = src[x] * scale; acc[a][x] = 0.f; }
      lim[a] = ctx - (ql - 1 - r);
      m[a] = -FLT_MAX; /* finite: the kernel may be built with finite-math-only */
      l[a] = 0.f;
    }
    const int64_t nblocks = (ctx + bs - 1) / bs;
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t blk = block_table[i * table_stride + b];
      const int64_t t0 = b * bs;
      const char* kb = (const char*)k_cache + (blk * bs * kvh + j) * d * esize;
      const char* vb = (const char*)v_cache + (blk * bs * kvh + j) * d * esize;
      const float* ksb = QUANT ? k_scale + blk * bs * kvh + j : 0;
      const float* vsb = QUANT ? v_scale + blk * bs * kvh + j : 0;
      const int nt = (int)(ctx - t0 < bs ? ctx - t0 : bs);
      if (b + 1 < nblocks) {
        const int64_t nblk = block_table[i * table_stride + b + 1];
        const char* nk = (const char*)k_cache + (nblk * bs * kvh + j) * d * esize;
        const char* nv = (const char*)v_cache + (nblk * bs * kvh + j) * d * esize;
        for (int t = 0; t < bs; ++t)
          for (int64_t x = 0; x < d * esize; x += 64) {
            __builtin_prefetch(nk + t * tok_stride * esize + x);
            __builtin_prefetch(nv + t * tok_stride * esize + x);
          }
      }
      for (int t = 0; t < nt; ++t) {
        const char* kr = kb + t * tok_stride * esize;
        const float ksc = QUANT ? ksb[t * kvh] : 1.f;
        int a = 0;
        for (; a + 1 < nq; a += 2) {
          v8 s0 = {0}, s1 = {0};
          for (int x = 0; x < d; x += 8) {
            const v8 kv = LOADK(kr, x);
            s0 += ld8(qs[a] + x) * kv;
            s1 += ld8(qs[a + 1] + x) * kv;
          }
          s[a][t] = hsum8(s0) * ksc;
          s[a + 1][t] = hsum8(s1) * ksc;
        }
        if (a < nq) {
          v8 s0 = {0}, s1 = {0};
          int x = 0;
          for (; x + 16 <= d; x += 16) {
            s0 += ld8(qs[a] + x) * LOADK(kr, x);
            s1 += ld8(qs[a] + x + 8) * LOADK(kr, x + 8);
          }
          if (x < d) s0 += ld8(qs[a] + x) * LOADK(kr, x);
          s[a][t] = hsum8(s0 + s1) * ksc;
        }
      }
      for (int a = 0; a < nq; ++a) {
        const int64_t lv = lim[a] - t0;
        const int valid = (int)(lv > nt ? nt : lv);
        if (valid <= 0) continue;
        float* sa = s[a];
        float bm = m[a];
        for (int t = 0; t < valid; ++t) bm = sa[t] > bm ? sa[t] : bm;
        const float corr = expf(m[a] - bm); /* 0 on the first block */
        for (int t = 0; t < valid; ++t) sa[t] -= bm;
        exp_inplace(sa, valid);
        float psum = 0.f;
        for (int t = 0; t < valid; ++t) psum += sa[t];
        l[a] = l[a] * corr + psum;
        m[a] = bm;
        if (QUANT)  /* fold each value row's scale into its weight */
          for (int t = 0; t < valid; ++t) sa[t] *= vsb[t * kvh];
        float* ac = acc[a];
        int x = 0;
        for (; x + 32 <= d; x += 32) {
          v8 c0 = ld8(ac + x) * corr, c1 = ld8(ac + x + 8) * corr;
          v8 c2 = ld8(ac + x + 16) * corr, c3 = ld8(ac + x + 24) * corr;
          for (int t = 0; t < valid; ++t) {
            const char* vr = vb + t * tok_stride * esize;
            const float p = sa[t];
            c0 += p * LOADK(vr, x);
            c1 += p * LOADK(vr, x + 8);
            c2 += p * LOADK(vr, x + 16);
            c3 += p * LOADK(vr, x + 24);
          }
          st8(ac + x, c0); st8(ac + x + 8, c1); st8(ac + x + 16, c2); st8(ac + x + 24, c3);
        }
        for (; x < d; x += 8) {
          v8 c0 = ld8(ac + x) * corr;
          for (int t = 0; t < valid; ++t) c0 += sa[t] * LOADK(vb + t * tok_stride * esize, x);
          st8(ac + x, c0);
        }
      }
    }
    for (int a = 0; a < nq; ++a) {
      const int gi = a / ql, r = a %% ql;
      float* o = out + (q_start[i] + r) * out_row_stride + (j * g + gi) * d;
      const float inv = 1.f / l[a];
      for (int x = 0; x < d; ++x) o[x] = acc[a][x] * inv;
    }
  }
  return 0;
}

int paged_attention_f32(
    const float* q, int64_t q_row_stride, int64_t q_head_stride,
    const float* k_cache, const float* v_cache,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    float* out, int64_t out_row_stride,
    int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale) {
  return attention_body(0, q, q_row_stride, q_head_stride, k_cache, v_cache, 0, 0,
                        block_table, table_stride, q_start, q_len, ctx_len, out,
                        out_row_stride, item_begin, item_end, kvh, g, d, bs, scale);
}

int paged_attention_bf16(
    const float* q, int64_t q_row_stride, int64_t q_head_stride,
    const unsigned short* k_cache, const unsigned short* v_cache,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    float* out, int64_t out_row_stride,
    int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale) {
  return attention_body(2, q, q_row_stride, q_head_stride, k_cache, v_cache, 0, 0,
                        block_table, table_stride, q_start, q_len, ctx_len, out,
                        out_row_stride, item_begin, item_end, kvh, g, d, bs, scale);
}

int paged_attention_i8(
    const float* q, int64_t q_row_stride, int64_t q_head_stride,
    const signed char* k_cache, const signed char* v_cache,
    const float* k_scale, const float* v_scale,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    float* out, int64_t out_row_stride,
    int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale) {
  return attention_body(1, q, q_row_stride, q_head_stride, k_cache, v_cache, k_scale,
                        v_scale, block_table, table_stride, q_start, q_len, ctx_len, out,
                        out_row_stride, item_begin, item_end, kvh, g, d, bs, scale);
}
""" % {"maxqv": MAX_QUERY_VECTORS, "maxd": MAX_HEAD_DIM, "maxbs": MAX_BLOCK_SIZE}

# Tried in order: with fast math the reductions and expf vectorise (glibc's libmvec);
# without it the kernel is slower but needs nothing beyond a C compiler and libm.
_FLAG_SETS = [
    ["-O3", "-march=native", "-ffast-math", "-shared", "-fPIC", "-lmvec", "-lm"],
    ["-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC", "-lm"],
    ["-O3", "-fno-math-errno", "-shared", "-fPIC", "-lm"],  # compilers without -march
]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere), read once."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def _cpu_signature() -> str:
    return platform.machine() + " ".join(sorted(cpu_flags()))


def _cache_dir() -> Path:
    env = os.environ.get("RIDGELINE_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "ridgeline") / "kernels"


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: decode attention uses the PyTorch path")
        return None
    key = hashlib.sha256((SOURCE + repr(_FLAG_SETS) + compiler + _cpu_signature())
                         .encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{key}.so"
    if not target.is_file():
        errors = []
        for flags in _FLAG_SETS:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                    src = Path(tmp) / "paged_attention.c"
                    src.write_text(SOURCE)
                    so = Path(tmp) / "out.so"
                    libs = [f for f in flags if f.startswith("-l")]
                    cmd = [compiler, *[f for f in flags if not f.startswith("-l")], "-o",
                           str(so), str(src), *libs]
                    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                    os.replace(so, target)  # atomic: concurrent builders race harmlessly
                break
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(str(e))
        else:
            log.warning("could not compile the decode attention kernel (%s); using the "
                        "PyTorch path", "; ".join(errors))
            return None
    lib = ctypes.CDLL(str(target))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for fn in (lib.paged_attention_f32, lib.paged_attention_bf16):
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64,
                       c_int, c_int, c_int, c_int, ctypes.c_float]
        fn.restype = ctypes.c_int
    fn = lib.paged_attention_i8
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64,
                   i64, c_int, c_int, c_int, c_int, ctypes.c_float]
    fn.restype = ctypes.c_int
    return lib


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be built here."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            _lib = _build()
    return _lib


def available() -> bool:
    return load() is not None


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             max_query_len: int) -> bool:
    return (head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0 and block_size <= MAX_BLOCK_SIZE
            and (num_heads // num_kv_heads) * max_query_len <= MAX_QUERY_VECTORS)


def split_work(ctx_len: list[int], kvh: int, threads: int) -> list[int]:
    """Boundaries [0, ..., items] of the per-thread shares of the work items (sequence x KV
    head), balanced by context length; one share when the work is too small to be worth
    a thread hand-off. The same for every layer of a step, so computed once per step."""
    items = len(ctx_len) * kvh
    threads = min(threads, items)
    total = sum(ctx_len) * kvh
    if threads <= 1 or total < 4096:
        return [0, items]
    costs: list[int] = []
    acc = 0
    for c in ctx_len:
        for _ in range(kvh):
            acc += c
            costs.append(acc)
    cuts = [0]
    for t in range(1, threads):
        target = total * t / threads
        i = cuts[-1]
        while i < items and costs[i] < target:
            i += 1
        # cut after item i when that lands nearer the target than cutting before it
        before = costs[i - 1] if i > 0 else 0
        if i < items and costs[i] - target <= target - before:
            i += 1
        cuts.append(max(i, cuts[-1]))
    cuts.append(items)
    return cuts


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, q_start: torch.Tensor,
                           q_len: torch.Tensor, ctx_len: torch.Tensor,
                           out: torch.Tensor, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           cuts: list[int] | None = None) -> None:
    """out[rows of each sequence] = attention of q's rows over the paged context.

    q, out: [T, heads, d] with unit stride on d (rows may be strided), float32 (other
    dtypes go through a float32 copy: the kernel accumulates in float32);
    k_cache, v_cache: contiguous [blocks, block_size, kv_heads, d], float32, bfloat16, or
    int8 codes with `k_scale`/`v_scale` contiguous float32 [blocks, block_size, kv_heads];
    block_table: contiguous int64 [n, max_blocks]; q_start/q_len/ctx_len: int64 [n];
    cuts: the per-thread shares (`split_work`), computed here when not given."""
    if q.dtype != torch.float32:
        out32 = torch.empty(out.shape, dtype=torch.float32)
        paged_decode_attention(q.float(), k_cache, v_cache, block_table, q_start, q_len,
                               ctx_len, out32, k_scale, v_scale, cuts)
        out.copy_(out32)  # rows of other paths are written after this call
        return
    lib = load()
    assert lib is not None
    _, bs, kvh, d = k_cache.shape
    g = q.shape[1] // kvh
    if k_scale is None:
        kernel = (lib.paged_attention_bf16 if k_cache.dtype == torch.bfloat16
                  else lib.paged_attention_f32)
        caches: tuple[int, ...] = (k_cache.data_ptr(), v_cache.data_ptr())
    else:
        assert v_scale is not None and k_cache.dtype == torch.int8
        kernel = lib.paged_attention_i8
        caches = (k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(),
                  v_scale.data_ptr())
    args = (q.data_ptr(), q.stride(0), q.stride(1), *caches,
            block_table.data_ptr(), block_table.stride(0), q_start.data_ptr(),
            q_len.data_ptr(), ctx_len.data_ptr(), out.data_ptr(), out.stride(0))
    tail = (kvh, g, d, bs, ctypes.c_float(d ** -0.5))
    if cuts is None:
        cuts = split_work(ctx_len.tolist(), kvh, torch.get_num_threads())
    global _pool
    shares = len(cuts) - 1
    futures = []
    if shares > 1:
        if _pool is None or _pool._max_workers < shares - 1:  # noqa: SLF001
            _pool = ThreadPoolExecutor(shares - 1, thread_name_prefix="ridgeline-attn")
        futures = [_pool.submit(kernel, *args, cuts[t], cuts[t + 1], *tail)
                   for t in range(shares - 1) if cuts[t] < cuts[t + 1]]
    # the calling thread takes the last share: one hand-off fewer, one thread fewer
    rcs = [kernel(*args, cuts[-2], cuts[-1], *tail)]
    rcs += [f.result() for f in futures]
    if any(rcs):
        raise RuntimeError(f"paged attention kernel failed ({rcs})")
