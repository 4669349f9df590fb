"""Every decoder layer of a decode pass in one C call.

A decode step of one sequence on 2 cores spends ~8.5 ms in SmolLM2-135M's matmuls and
~3.5 ms around them (bfloat16, 12.1 ms a token): each of the 30 layers makes ~12 calls
from Python into the C kernels (norms, projections, rotary, the KV write, attention,
SwiGLU, the residual add), and each costs 3-15 us of Python (argument checks, a fresh
output tensor, ctypes conversions; in the engine twice what it costs in a microbenchmark,
since streaming the weights evicts the interpreter's own data from the caches).

`run_layers` hands the whole stack to `decoder_stack` below, which calls the very same
kernels, in the same order, with the same arguments (function pointers taken from their
libraries), on buffers allocated once per pass: its output is bit for bit the layer loop's.
It applies where every piece of a pass is one of those kernels (`applies`): a float32 or
bfloat16 model (int8 weights too) without q/k norms, rows few enough for the linear
kernel (`max_rows`; float32 passes of 17-64 rows too on AVX-512, where the layer loop
gives the products to oneDNN: there the stack is the layer loop with the kernel's
products), every sequence's attention through the decode kernel, a KV cache of the model's
dtype or of int8 codes (written as `kv_quant` quantizes, bit for bit). Attention's
per-thread shares, and the row-wise steps of a pass of several rows (norms, rotary and
the KV write, SwiGLU, the residual add), run on the linear kernel's thread pool
(`linear_parallel`), whose helpers are awake from the matmul before. The residual add
after a layer's MLP is done by the next layer's input norm (x += delta, then the norm),
the same sums as the layer loop's separate add. Anything else (prompts, large bf16 batches,
fp8 caches) runs the layer loop.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Any

import torch

from ridgeline.engine import cpu_kernels, decode_ops, linear_kernel

SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef int (*linear_fn)(const void* x, int64_t ldx, int xt, const void* w, int64_t ldw,
                         int wt, const void* scale, int scale_t, const void* bias, int bias_t,
                         void* y, int64_t ldy, int yt, int64_t m, int64_t n, int64_t k,
                         int threads);
typedef void (*norm_fn)(void* x, int64_t ldx, const void* delta, int64_t ldd, const void* w,
                        float eps, void* out, int64_t ldo, int64_t rows, int64_t d);
typedef void (*rotary_fn)(void* x, int64_t ldx, int64_t heads, int64_t d, const void* cos_,
                          const void* sin_, int64_t ldc, int64_t rows);
typedef int (*scatter_fn)(const char* src, int64_t lds, char* dst, int64_t row_bytes,
                          const int64_t* slots, int64_t rows, int64_t num_slots);
typedef int (*attention_fn)(const void* q, int64_t q_row_stride, int64_t q_head_stride,
                            int q_bf16, const void* k_cache, const void* v_cache,
                            const int64_t* block_table, int64_t table_stride,
                            const int64_t* q_start, const int64_t* q_len,
                            const int64_t* ctx_len, void* out, int64_t out_row_stride,
                            int64_t item_begin, int64_t item_end, int kvh, int g, int d,
                            int bs, float scale);
typedef int (*attention_i8_fn)(const void* q, int64_t q_row_stride, int64_t q_head_stride,
                               int q_bf16, const void* k_codes, const void* v_codes,
                               const float* k_scale, const float* v_scale,
                               const int64_t* block_table, int64_t table_stride,
                               const int64_t* q_start, const int64_t* q_len,
                               const int64_t* ctx_len, void* out, int64_t out_row_stride,
                               int64_t item_begin, int64_t item_end, int kvh, int g, int d,
                               int bs, float scale);
typedef int (*scatter_i8_fn)(const void* src, int64_t lds, int src_bf16, void* codes,
                             float* scales, int64_t heads, int64_t d, const int64_t* slots,
                             int64_t rows, int64_t num_slots);
typedef void (*silu_fn)(const void* gu, int64_t ldg, void* out, int64_t ldo, int64_t rows,
                        int64_t n);
typedef int (*task_fn)(void* ctx, int64_t share);
typedef int (*parallel_fn)(task_fn task, void* ctx, int64_t shares, int threads);

typedef struct {  /* the kernels, from their libraries; parallel: the linear kernel's pool */
  linear_fn linear; norm_fn norm; rotary_fn rotary; scatter_fn scatter;
  attention_fn attention; silu_fn silu; parallel_fn parallel;
  attention_i8_fn attention_i8; scatter_i8_fn scatter_i8;  /* int8 KV caches */
} kernels_t;

typedef struct {  /* the model's shape and dtypes (0 float32, 1 bfloat16, 2 int8) */
  int64_t hidden, heads, kv_heads, head_dim, inter, layers;
  int dt, block_size;
  float eps, scale;
} shape_t;

/* one layer's tensors: weights (w), int8 scales (s, or NULL), biases (b, or NULL) of
   qkv, o, gate_up and down; the two norm weights; its K and V blocks (int8 codes when
   k_scale/v_scale, their scales per slot and head, are set). wt/st/bt: dtype codes */
typedef struct {
  const void* norm_in; const void* norm_post;
  const void* w[4]; const void* s[4]; const void* b[4];
  int wt[4], st[4], bt[4];
  void* k_cache; void* v_cache; float* k_scale; float* v_scale;
} layer_t;

typedef struct {  /* one pass: t rows, attention metadata, buffers of t rows each */
  int64_t t, num_slots, table_stride;
  void* x; const void* cos_; const void* sin_; const int64_t* slots;
  const int64_t* block_table; const int64_t* q_start; const int64_t* q_len;
  const int64_t* ctx_len;
  void* xn; void* qkv; void* attn; void* o; void* gu; void* act; void* down;
  const int64_t* cuts; int64_t shares;  /* attention's work items per thread (split_work) */
  int threads;
} pass_t;

static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f;
  memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {  /* PyTorch's rounding: nearest even, NaN quiet */
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x += y, elementwise over n, rounded as PyTorch's add_ rounds */
static void add_into(int dt, void* x, const void* y, int64_t n) {
  if (dt == 0) {
    float* a = (float*)x; const float* b = (const float*)y;
    for (int64_t i = 0; i < n; ++i) a[i] = a[i] + b[i];
  } else {
    uint16_t* a = (uint16_t*)x; const uint16_t* b = (const uint16_t*)y;
    for (int64_t i = 0; i < n; ++i) a[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
  }
}

static int project(const kernels_t* K, const shape_t* S, const layer_t* L, int which,
                   const void* x, int64_t k, void* y, int64_t n, const pass_t* P) {
  return K->linear(x, k, S->dt, L->w[which], k, L->wt[which], L->s[which], L->st[which],
                   L->b[which], L->bt[which], y, n, S->dt, P->t, n, k, P->threads);
}

typedef struct {  /* one layer's attention, for its shares on the pool */
  const kernels_t* K; const shape_t* S; const layer_t* L; const pass_t* P;
} attention_job_t;

static int attention_share(void* ctx, int64_t share) {
  const attention_job_t* a = (const attention_job_t*)ctx;
  const shape_t* S = a->S;
  const pass_t* P = a->P;
  const int64_t h = S->heads, kvh = S->kv_heads, d = S->head_dim;
  if (a->L->k_scale)
    return a->K->attention_i8(P->qkv, (h + 2 * kvh) * d, d, S->dt == 1, a->L->k_cache,
                              a->L->v_cache, a->L->k_scale, a->L->v_scale, P->block_table,
                              P->table_stride, P->q_start, P->q_len, P->ctx_len, P->attn,
                              h * d, P->cuts[share], P->cuts[share + 1], (int)kvh,
                              (int)(h / kvh), (int)d, S->block_size, S->scale);
  return a->K->attention(P->qkv, (h + 2 * kvh) * d, d, S->dt == 1, a->L->k_cache,
                         a->L->v_cache, P->block_table, P->table_stride, P->q_start,
                         P->q_len, P->ctx_len, P->attn, h * d, P->cuts[share],
                         P->cuts[share + 1], (int)kvh, (int)(h / kvh), (int)d,
                         S->block_size, S->scale);
}

/* The row-wise steps between the matmuls. Each row's result depends on that row alone,
   so a pass of several rows splits them over the pool's helpers, which are awake from
   the matmul before; the sums are the same in any split. */
enum {
  NORM_IN,      /* xn = norm_in(x), after x += down of the layer before (delta) */
  ROTARY_KV,    /* rotate q and k in qkv, write k and v to the cache */
  NORM_POST,    /* x += o, xn = norm_post(x) */
  SILU,         /* act = silu(gate) * up */
  ADD_DOWN      /* x += down (the last layer; the others fold it into NORM_IN) */
};

typedef struct {
  const kernels_t* K; const shape_t* S; const layer_t* L; const pass_t* P;
  int step, shares; const void* delta;
} rows_job_t;

/* Below this many rows a pass runs its row-wise steps on the calling thread: a hand-off
   costs about what the rows do (a SmolLM2 bf16 pass, HEAD vs split, alternated: 4 rows
   7.67 -> 8.21 ms, 8 rows 9.08 -> 8.65, 16 rows 13.16 -> 12.80) */
#define SPLIT_ROWS 8

/* rows [lo, lo + n) of this pass's k or v (src, within the qkv rows) into the cache:
   rows of the model's dtype, or int8 codes and their scales */
static int write_rows(const kernels_t* K, const shape_t* S, const pass_t* P, const char* src,
                      void* cache, float* scales, int64_t lo, int64_t n) {
  const int64_t kvh = S->kv_heads, d = S->head_dim, es = S->dt == 0 ? 4 : 2;
  const int64_t qn = (S->heads + 2 * kvh) * d;
  if (scales)
    return K->scatter_i8(src, qn, S->dt == 1, cache, scales, kvh, d, P->slots + lo, n,
                         P->num_slots);
  return K->scatter(src, qn * es, (char*)cache, kvh * d * es, P->slots + lo, n, P->num_slots);
}

static int rows_share(void* ctx, int64_t share) {
  const rows_job_t* r = (const rows_job_t*)ctx;
  const kernels_t* K = r->K; const shape_t* S = r->S; const layer_t* L = r->L;
  const pass_t* P = r->P;
  const int64_t lo = P->t * share / r->shares, hi = P->t * (share + 1) / r->shares;
  const int64_t n = hi - lo, H = S->hidden, h = S->heads, kvh = S->kv_heads;
  const int64_t d = S->head_dim, qn = (h + 2 * kvh) * d, es = S->dt == 0 ? 4 : 2;
  if (n <= 0) return 0;
  char* x = (char*)P->x + lo * H * es;
  char* xn = (char*)P->xn + lo * H * es;
  char* qkv = (char*)P->qkv + lo * qn * es;
  switch (r->step) {
    case NORM_IN:
      K->norm(x, H, r->delta ? (const char*)r->delta + lo * H * es : NULL, H, L->norm_in,
              S->eps, xn, H, n, H);
      return 0;
    case ROTARY_KV:
      K->rotary(qkv, qn, h + kvh, d, (const char*)P->cos_ + lo * d * es,
                (const char*)P->sin_ + lo * d * es, d, n);
      return write_rows(K, S, P, qkv + h * d * es, L->k_cache, L->k_scale, lo, n) ||
                     write_rows(K, S, P, qkv + (h + kvh) * d * es, L->v_cache, L->v_scale, lo, n)
                 ? -1 : 0;
    case NORM_POST:
      K->norm(x, H, (const char*)P->o + lo * H * es, H, L->norm_post, S->eps, xn, H, n, H);
      return 0;
    case SILU:
      K->silu((const char*)P->gu + lo * 2 * S->inter * es, 2 * S->inter,
              (char*)P->act + lo * S->inter * es, S->inter, n, S->inter);
      return 0;
    default:  /* ADD_DOWN */
      add_into(S->dt, x, (const char*)P->down + lo * H * es, n * H);
      return 0;
  }
}

static int row_step(const kernels_t* K, const shape_t* S, const layer_t* L, const pass_t* P,
                    int step, const void* delta) {
  rows_job_t job = {K, S, L, P, step, 1, delta};
  if (P->t < SPLIT_ROWS || P->threads <= 1) return rows_share(&job, 0);
  job.shares = P->threads < P->t ? P->threads : (int)P->t;
  return K->parallel(rows_share, &job, job.shares, P->threads);
}

/* 0, or which step of which layer failed: -(layer * 8 + step + 1) */
int decoder_stack(const kernels_t* K, const shape_t* S, const layer_t* layers,
                  const pass_t* P) {
  const int64_t H = S->hidden, h = S->heads, kvh = S->kv_heads, d = S->head_dim;
  const int64_t qn = (h + 2 * kvh) * d;
  for (int64_t l = 0; l < S->layers; ++l) {
    const layer_t* L = layers + l;
    const int fail = -(int)(l * 8 + 1);
    row_step(K, S, L, P, NORM_IN, l ? P->down : NULL);  /* x += down: the layer before's */
    if (project(K, S, L, 0, P->xn, H, P->qkv, qn, P)) return fail;
    if (row_step(K, S, L, P, ROTARY_KV, NULL)) return fail - 1;
    attention_job_t job = {K, S, L, P};
    if (P->shares == 1 ? attention_share(&job, 0)
                       : K->parallel(attention_share, &job, P->shares, P->threads))
      return fail - 2;
    if (project(K, S, L, 1, P->attn, h * d, P->o, H, P)) return fail - 3;
    row_step(K, S, L, P, NORM_POST, NULL);
    if (project(K, S, L, 2, P->xn, H, P->gu, 2 * S->inter, P)) return fail - 4;
    row_step(K, S, L, P, SILU, NULL);
    if (project(K, S, L, 3, P->act, S->inter, P->down, H, P)) return fail - 5;
  }
  if (S->layers) row_step(K, S, layers + S->layers - 1, P, ADD_DOWN, NULL);
  return 0;
}
"""

_FLAGS = [["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"],
          ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]]
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_ptr, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in ("linear", "norm", "rotary", "scatter", "attention",
                                    "silu", "parallel", "attention_i8", "scatter_i8")]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("layers", _i64), ("dt", _int), ("block_size", _int),
                ("eps", _f32), ("scale", _f32)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm_in", _ptr), ("norm_post", _ptr), ("w", _ptr * 4), ("s", _ptr * 4),
                ("b", _ptr * 4), ("wt", _int * 4), ("st", _int * 4), ("bt", _int * 4),
                ("k_cache", _ptr), ("v_cache", _ptr), ("k_scale", _ptr), ("v_scale", _ptr)]


class _Pass(ctypes.Structure):
    _fields_ = [("t", _i64), ("num_slots", _i64), ("table_stride", _i64),
                ("x", _ptr), ("cos_", _ptr), ("sin_", _ptr), ("slots", _ptr),
                ("block_table", _ptr), ("q_start", _ptr), ("q_len", _ptr), ("ctx_len", _ptr),
                ("xn", _ptr), ("qkv", _ptr), ("attn", _ptr), ("o", _ptr), ("gu", _ptr),
                ("act", _ptr), ("down", _ptr), ("cuts", _ptr), ("shares", _i64),
                ("threads", _int)]


def _build() -> ctypes.CDLL | None:
    lib = cpu_kernels.open_library("decode_stack", SOURCE, _FLAGS)
    if lib is None:
        return None
    lib.decoder_stack.argtypes = [_ptr, _ptr, _ptr, _ptr]
    lib.decoder_stack.restype = _int
    return lib


load = cpu_kernels.LazyLibrary(_build)


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _kernels(dtype: torch.dtype) -> _Kernels | None:
    """The kernels of a `dtype` pass, or None where one of their libraries is missing."""
    ops, lin, att = decode_ops.load(), linear_kernel.load(), cpu_kernels.load()
    if ops is None or lin is None or att is None:
        return None
    f32 = dtype == torch.float32
    return _Kernels(
        _address(lin.linear_run), _address(ops.rms_norm_f32 if f32 else ops.rms_norm_bf16),
        _address(ops.rotary_f32 if f32 else ops.rotary_bf16), _address(ops.scatter_rows),
        _address(att.paged_attention_f32 if f32 else att.paged_attention_bf16),
        _address(ops.silu_mul_f32 if f32 else ops.silu_mul_bf16),
        _address(lin.linear_parallel), _address(att.paged_attention_i8),
        _address(ops.scatter_int8_rows))


_kernel_table: dict[torch.dtype, _Kernels | None] = {}

#: float32 passes of up to this many rows run as one stack call where the linear kernel
#: is 16 lanes wide (AVX-512), although `linear` gives products of more than 16 rows to
#: oneDNN: its float32 matmuls are faster there (all of a step's projections, 2 threads,
#: oneDNN vs the kernel: 32 rows 26.6 vs 31.3 ms, 64 rows 45.2 vs 59.0), but the stack
#: saves the layer loop's dozen Python calls a layer and splits the row-wise steps.
#: engine_bench's float32 workload (124 of 264 passes at 41-64 rows), limits alternated
#: on fresh prompts, 4 runs each, tok/s: 16 rows 293.7, 40 rows 304.4, 64 rows 318.6;
#: another 4 runs 322.5 vs 333.9 (16 vs 64).
FLOAT32_MAX_ROWS = 64


def max_rows(dtype: torch.dtype, quantized: bool) -> int:
    """The most rows of a pass the stack takes for a model of `dtype` (int8 weights:
    `quantized`): as many as the linear kernel takes, and float32 up to FLOAT32_MAX_ROWS
    on the 16-lane kernel."""
    from ridgeline.engine.models.layers import kernel_max_rows

    rows = kernel_max_rows(dtype, int8=quantized)
    if dtype == torch.float32 and not quantized and _sixteen_lanes():
        return max(rows, FLOAT32_MAX_ROWS)
    return rows


@functools.cache
def _sixteen_lanes() -> bool:
    return linear_kernel.vector_width() == 16


def applies(model: Any, rows: int, cache: Any, meta: Any) -> bool:
    """Whether a pass of `rows` tokens with this attention metadata can run as one
    `decoder_stack` call (see the module doc)."""
    dtype = model.dtype
    kb = meta.kernel
    if (dtype not in (torch.float32, torch.bfloat16) or kb is None or meta.prefill is not None
            or meta.fresh or meta.chunks or meta.groups
            or torch.is_grad_enabled() or model.cfg.qk_norm
            or model.cfg.head_dim > decode_ops.MAX_HEAD_DIM or model.embed.device.type != "cpu"
            or rows > max_rows(dtype, model.quantized)
            or load() is None):
        return False
    raw = cache.raw_blocks(0)
    if not ((raw is not None and raw[0].dtype == dtype)
            or (cache.int8_blocks(0) is not None and cache.dtype == dtype)):
        return False  # fp8 codes, or a cache stored in another dtype than the model's
    if dtype not in _kernel_table:
        _kernel_table[dtype] = _kernels(dtype)
    return _kernel_table[dtype] is not None


def _weights(proj: Any) -> tuple[int, int, int, int, int, int]:
    """(weight, scale, bias) pointers and dtype codes of a Linear (float or int8)."""
    if proj.qweight is not None:
        w, s = proj.qweight, proj.scales
    else:
        w, s = proj.weight, None
    b = proj.bias
    assert w.is_contiguous() and (b is None or b.is_contiguous())
    return (w.data_ptr(), 0 if s is None else s.data_ptr(),
            0 if b is None else b.data_ptr(), _CODES[w.dtype],
            0 if s is None else _CODES[s.dtype], 0 if b is None else _CODES[b.dtype])


def _layer_table(model: Any, cache: Any) -> tuple[Any, _Shape, int]:
    """The C view of the model's layers and KV blocks (pointers, dtype codes), its shape
    and the cache's number of slots, built once per model and cache storage: rebuilding it
    took ~0.4 ms a pass (5% of a single-request step). Weights change in place
    (`load_weights` copies into them), so their pointers hold; the cache's storage is new
    after sleep/wake, and int8 quantization replaces the weights, so both are in the key."""
    blocks0 = cache.raw_blocks(0) or cache.int8_blocks(0)
    key = (id(cache), blocks0[0].data_ptr(), model.quantized)
    hit = _tables.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    cfg = model.cfg
    layers = (_Layer * len(model.layers))()
    for i, layer in enumerate(model.layers):
        entry = layers[i]
        entry.norm_in = layer.input_norm.weight.data_ptr()
        entry.norm_post = layer.post_norm.weight.data_ptr()
        for j, proj in enumerate((layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                  layer.down_proj)):
            (entry.w[j], entry.s[j], entry.b[j], entry.wt[j], entry.st[j],
             entry.bt[j]) = _weights(proj)
        blocks = cache.raw_blocks(layer.index) or cache.int8_blocks(layer.index)
        entry.k_cache, entry.v_cache = blocks[0].data_ptr(), blocks[1].data_ptr()
        if len(blocks) == 4:  # int8 codes and their scales
            entry.k_scale, entry.v_scale = blocks[2].data_ptr(), blocks[3].data_ptr()
    shape = _Shape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size, len(model.layers), _CODES[model.dtype],
                   blocks0[0].shape[1], model.layers[0].input_norm.eps, cfg.head_dim ** -0.5)
    table = (layers, shape, blocks0[0].shape[0] * blocks0[0].shape[1])
    _tables[model] = (key, table)
    return table


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_layers(model: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: Any, meta: Any) -> torch.Tensor:
    """x [t, hidden] through every decoder layer of `model` (in place; returned), as the
    layer loop computes it. Callers check `applies` first."""
    cfg, dtype = model.cfg, model.dtype
    t, hidden = x.shape
    h, kvh, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    layers, shape, num_slots = _layer_table(model, cache)
    x = x.contiguous()
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    slots = meta.slot_mapping.contiguous()
    kb = meta.kernel

    def buf(width: int) -> torch.Tensor:
        return torch.empty(t, width, dtype=dtype)

    bufs = [buf(hidden), buf((h + 2 * kvh) * d), buf(h * d), buf(hidden), buf(2 * inter),
            buf(inter), buf(hidden)]
    cuts = (ctypes.c_int64 * len(kb.cuts))(*kb.cuts)
    one_pass = _Pass(t, num_slots, kb.block_table.stride(0),
                     x.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                     kb.block_table.data_ptr(), kb.q_start.data_ptr(), kb.q_len.data_ptr(),
                     kb.ctx_len.data_ptr(), *[b.data_ptr() for b in bufs],
                     ctypes.cast(cuts, ctypes.c_void_p), len(kb.cuts) - 1,
                     torch.get_num_threads())
    rc = load().decoder_stack(ctypes.byref(_kernel_table[dtype]), ctypes.byref(shape),
                              layers, ctypes.byref(one_pass))
    if rc:
        layer, step = divmod(-rc - 1, 8)
        if step == 1:
            raise IndexError(f"a KV slot of this pass is outside the cache of "
                             f"{one_pass.num_slots} slots (layer {layer})")
        raise RuntimeError(f"the decode stack failed in layer {layer}, step {step}")
    return x
