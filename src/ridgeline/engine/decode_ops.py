"""The small per-layer operations of a decode step (RMSNorm, residual add + RMSNorm,
SwiGLU's silu(gate) * up, rotary embedding) as one C call each, for up to a few hundred
rows.

At 1..16 tokens a decoder layer's matmuls are fast (`linear_kernel`) and what is left is
PyTorch's per-op cost: F.rms_norm is five ops (~16 us for one 576-wide row), rotary
four, SwiGLU three, each a dispatch and a fresh tensor, and above ~32K elements an
OpenMP hand-off to a sleeping thread. Over SmolLM2's 30 layers that is several ms per
step, a third of a single-request step once the matmuls stream at memory speed.

The numerics are PyTorch's (and so transformers'): the same formulas, the same order
and rounding of every multiply and add (compiled with -ffp-contract=off, so no FMA
contracts two roundings into one), bfloat16 rounded where PyTorch rounds it. Two places
can differ in the last bit: the sum of squares of RMSNorm (summed in 16 lanes, then
folded) and the exp of SiLU (a polynomial of our own against PyTorch's vectorised one).

Single-threaded: at these sizes a second thread's wake-up costs more than the work (the
loops are written so that GCC vectorises them; SiLU's exp is a polynomial for that).
Callers fall back to PyTorch where `usable(x)` is False: no compiler, other dtypes or
devices, autograd. Prefill-sized inputs (`SPLIT_ROWS` rows and more) are split by rows
over torch's intra-op threads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ridgeline.engine import cpu_kernels

#: From this many rows (prefill chunks) each op is split by rows over torch's intra-op
#: threads: a C call a share, the calling thread taking the last one (below it, waking a
#: thread costs more than the op). 2 cores, OMP_WAIT_POLICY=PASSIVE as the engine runs,
#: PyTorch -> C split, us: 1024 rows, SwiGLU (x 1536) float32 945 -> 547, bfloat16 750 ->
#: 623; rotary (x 12 x 64) 570 -> 147 / 824 -> 330; RMSNorm of 2048 x 576, F.rms_norm
#: float32 466, the bfloat16 formula 772 -> C on one thread 500 / 425. At 64 rows
#: (float32, one thread): RMSNorm 88 -> 13, rotary 88 -> 21, SwiGLU 156 -> 98.
SPLIT_ROWS = 512


SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* bfloat16 <-> float32 as PyTorch does it (round to nearest even; NaN stays NaN) */
static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f;
  memcpy(&f, &u, 4); return f; }
/* the bf16 bits of a float's bits, on integers only (so a loop of it vectorises) */
static inline uint32_t f2bf_bits(uint32_t u) {
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;  /* no branch */
}
static inline uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4);
  return (uint16_t)f2bf_bits(u); }

#define LANES 16
/* acc[i % LANES] += x[i]^2 for i < n, in order (a row in pieces of multiples of LANES
   sums as the whole row does) */
static inline void add_squares(const float* x, int64_t n, float* acc) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += x[i + l] * x[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += x[i] * x[i];
}

/* 1/sqrt(mean(x^2) + eps) of a row of d from its lane-wise sums, folded */
static inline float rms_scale(float* acc, int64_t d, float eps) {
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return 1.0f / sqrtf(acc[0] / (float)d + eps);
}

static inline float inv_rms(const float* x, int64_t d, float eps) {
  float acc[LANES] = {0};
  add_squares(x, d, acc);
  return rms_scale(acc, d, eps);
}

/* out = rms_norm(x (+ delta)) * w; with delta, x is updated in place to x + delta first */
void rms_norm_f32(float* x, int64_t ldx, const float* delta, int64_t ldd, const float* w,
                  float eps, float* out, int64_t ldo, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * ldx;
    if (delta) { const float* dr = delta + r * ldd; for (int64_t i = 0; i < d; ++i) xr[i] += dr[i]; }
    float s = inv_rms(xr, d, eps);
    float* o = out + r * ldo;
    for (int64_t i = 0; i < d; ++i) o[i] = (xr[i] * s) * w[i];
  }
}

#define NORM_BLOCK 4096  /* a multiple of LANES: the row is widened a block at a time */
void rms_norm_bf16(uint16_t* x, int64_t ldx, const uint16_t* delta, int64_t ldd,
                   const uint16_t* w, float eps, uint16_t* out, int64_t ldo, int64_t rows,
                   int64_t d) {
  float wide[NORM_BLOCK];  /* float32 copies of the row: loops over floats vectorise */
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* xr = x + r * ldx;
    if (delta) {
      const uint16_t* dr = delta + r * ldd;
      for (int64_t i = 0; i < d; ++i) xr[i] = f2bf(bf2f(xr[i]) + bf2f(dr[i]));
    }
    float acc[LANES] = {0};  /* inv_rms's sums, block by block */
    for (int64_t b0 = 0; b0 < d; b0 += NORM_BLOCK) {
      const int64_t n = d - b0 < NORM_BLOCK ? d - b0 : NORM_BLOCK;
      for (int64_t i = 0; i < n; ++i) wide[i] = bf2f(xr[b0 + i]);
      add_squares(wide, n, acc);
    }
    const float s = rms_scale(acc, d, eps);
    uint16_t* o = out + r * ldo;
    /* transformers: weight * (x_f32 * s).to(bf16), the product rounded to bf16 */
    for (int64_t b0 = 0; b0 < d; b0 += NORM_BLOCK) {
      const int64_t n = d - b0 < NORM_BLOCK ? d - b0 : NORM_BLOCK;
      if (b0 > 0 || n < d)
        for (int64_t i = 0; i < n; ++i) wide[i] = bf2f(xr[b0 + i]);
      for (int64_t i = 0; i < n; ++i)
        o[b0 + i] = f2bf(bf2f(w[b0 + i]) * bf2f(f2bf(wide[i] * s)));
    }
  }
}

/* exp(x) in a form GCC vectorises (no libm call, no branch): 2^k * p(r), r = x - k ln 2
   in two parts, p a degree-6 polynomial (Cephes); within 2 ulp of expf on [-87.3, 88.7],
   inf above, 2^-126 below */
#define VEC_EXP __attribute__((optimize("finite-math-only")))  /* lets min/max vectorise */
static inline VEC_EXP float exp_vec(float x) {
  x = __builtin_fminf(__builtin_fmaxf(x, -87.3f), 89.0f);  /* above 88.72: 2^128 = inf */
  /* floor by truncating a positive number: a conversion, not a libm call */
  float k = (float)(int32_t)(x * 1.44269504f + 128.5f) - 128.0f;
  float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f; p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  int32_t bits = ((int32_t)k + 127) << 23;
  float scale; memcpy(&scale, &bits, 4);
  return p * scale;
}

/* out[r, :n] = silu(gu[r, :n]) * gu[r, n:2n] */
VEC_EXP void silu_mul_f32(const float* gu, int64_t ldg, float* out, int64_t ldo, int64_t rows,
                  int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * ldg; const float* u = g + n; float* o = out + r * ldo;
    for (int64_t i = 0; i < n; ++i) o[i] = (g[i] / (1.0f + exp_vec(-g[i]))) * u[i];
  }
}

/* In blocks of widened floats, the bits reinterpreted through a union: a loop that
   converts with memcpy, divides and rounds element by element stays scalar in GCC
   (1.5 ms for 64 x 1536 on Zen 4, 30x PyTorch). */
#define SILU_BLOCK 256
typedef union { float f[SILU_BLOCK]; uint32_t u[SILU_BLOCK]; } block_t;
VEC_EXP void silu_mul_bf16(const uint16_t* gu, int64_t ldg, uint16_t* out, int64_t ldo,
                   int64_t rows, int64_t n) {
  block_t g, u;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gr = gu + r * ldg; const uint16_t* ur = gr + n; uint16_t* o = out + r * ldo;
    for (int64_t i0 = 0; i0 < n; i0 += SILU_BLOCK) {
      const int64_t m = n - i0 < SILU_BLOCK ? n - i0 : SILU_BLOCK;
      for (int64_t i = 0; i < m; ++i) g.u[i] = (uint32_t)gr[i0 + i] << 16;
      for (int64_t i = 0; i < m; ++i) u.u[i] = (uint32_t)ur[i0 + i] << 16;
      for (int64_t i = 0; i < m; ++i) g.f[i] = g.f[i] / (1.0f + exp_vec(-g.f[i]));
      /* PyTorch: silu(gate) rounded to bf16, then the product rounded */
      for (int64_t i = 0; i < m; ++i) g.u[i] = f2bf_bits(g.u[i]) << 16;
      for (int64_t i = 0; i < m; ++i) g.f[i] = g.f[i] * u.f[i];
      for (int64_t i = 0; i < m; ++i) o[i0 + i] = (uint16_t)f2bf_bits(g.u[i]);
    }
  }
}

/* Greedy sampling's two reductions of a logits row in two passes over it (the second
   from cache): the first index of its largest value (torch.argmax's tie rule) with that
   value, then log(sum(exp(x - max))) + max (torch.logsumexp's form). A row holding NaN
   or an infinity reports nonfinite[r] = 1 and the caller takes PyTorch's ops, so the
   maximum may assume finite numbers (fmaxf vectorises only then: 64 -> 2 us a 49152 row). */
static int row_nonfinite(const float* x, int64_t n) {
  int b[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) b[l] |= (x[i + l] - x[i + l]) != 0.0f;
  int bad = 0;
  for (; i < n; ++i) bad |= (x[i] - x[i]) != 0.0f;
  for (int l = 0; l < LANES; ++l) bad |= b[l];
  return bad;
}

static VEC_EXP float row_max(const float* x, int64_t n) {
  float lm[LANES];
  for (int l = 0; l < LANES; ++l) lm[l] = -FLT_MAX;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) lm[l] = __builtin_fmaxf(lm[l], x[i + l]);
  float m = -FLT_MAX;
  for (; i < n; ++i) m = __builtin_fmaxf(m, x[i]);
  for (int l = 0; l < LANES; ++l) m = __builtin_fmaxf(m, lm[l]);
  return m;
}

static VEC_EXP float sum_exp(const float* x, int64_t n, float m) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += exp_vec(x[i + l] - m);
  for (int l = 0; i < n; ++i, ++l) acc[l] += exp_vec(x[i] - m);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

void argmax_logsumexp_f32(const float* x, int64_t ldx, int64_t rows, int64_t n,
                          int64_t* idx, float* maxv, float* lse, int32_t* nonfinite) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * ldx;
    nonfinite[r] = row_nonfinite(row, n);
    if (nonfinite[r]) { idx[r] = 0; maxv[r] = 0.f; lse[r] = 0.f; continue; }
    const float m = row_max(row, n);
    int64_t i = 0;  /* the first chunk holding m (a vector compare each), then in it */
    for (; i + LANES <= n; i += LANES) {
      int hit = 0;
      for (int l = 0; l < LANES; ++l) hit |= row[i + l] == m;
      if (hit) break;
    }
    while (row[i] != m) ++i;
    idx[r] = i; maxv[r] = m;
    lse[r] = m + logf(sum_exp(row, n, m));
  }
}

/* In place on heads [rows, heads, d] (row stride ldx, head stride d):
   x = x * cos + swap_halves(x) * signed_sin, cos/sin rows [rows, d] */
void rotary_f32(float* x, int64_t ldx, int64_t heads, int64_t d, const float* cos_,
                const float* sin_, int64_t ldc, int64_t rows) {
  float tmp[512];
  int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos_ + r * ldc; const float* s = sin_ + r * ldc;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * ldx + h * d;
      for (int64_t i = 0; i < d; ++i) tmp[i] = v[i];
      for (int64_t i = 0; i < half; ++i) v[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
      for (int64_t i = half; i < d; ++i) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
    }
  }
}

void rotary_bf16(uint16_t* x, int64_t ldx, int64_t heads, int64_t d, const uint16_t* cos_,
                 const uint16_t* sin_, int64_t ldc, int64_t rows) {
  float tmp[512];
  int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* c = cos_ + r * ldc; const uint16_t* s = sin_ + r * ldc;
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* v = x + r * ldx + h * d;
      for (int64_t i = 0; i < d; ++i) tmp[i] = bf2f(v[i]);
      /* PyTorch: (x * cos) rounded, (swapped * sin) rounded, their sum rounded */
      for (int64_t i = 0; i < d; ++i) {
        float sw = i < half ? tmp[i + half] : tmp[i - half];
        v[i] = f2bf(bf2f(f2bf(tmp[i] * bf2f(c[i]))) + bf2f(f2bf(sw * bf2f(s[i]))));
      }
    }
  }
}

/* dst row slots[t] = src row t, for t < rows (rows of row_bytes; src rows lds bytes
   apart). Returns the first out-of-range slot's row + 1 (nothing written), else 0. */
int scatter_rows(const char* src, int64_t lds, char* dst, int64_t row_bytes,
                 const int64_t* slots, int64_t rows, int64_t num_slots) {
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return (int)(t + 1);
  for (int64_t t = 0; t < rows; ++t)
    memcpy(dst + slots[t] * row_bytes, src + t * lds, (size_t)row_bytes);
  return 0;
}

/* The int8 KV write (kv_quant.quantize, then the scatter): for row t < rows of src (heads
   x d values, float32 or bfloat16, rows lds elements apart) and each head, s = max(max|x| /
   127, 1e-12) and codes round(x / s) (half to even) clamped to +-127, at slot slots[t] of
   codes [slots, heads, d] and scales [slots, heads]. Returns as scatter_rows. */
static inline float value_at(const void* src, int bf16, int64_t i) {
  return bf16 ? bf2f(((const uint16_t*)src)[i]) : ((const float*)src)[i];
}

int scatter_int8_rows(const void* src, int64_t lds, int src_bf16, signed char* codes,
                      float* scales, int64_t heads, int64_t d, const int64_t* slots,
                      int64_t rows, int64_t num_slots) {
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return (int)(t + 1);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = t * lds + h * d;
      float amax = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        const float a = fabsf(value_at(src, src_bf16, at + i));
        amax = a > amax ? a : amax;
      }
      float s = amax / 127.0f;
      s = s < 1e-12f ? 1e-12f : s;
      signed char* c = codes + (slots[t] * heads + h) * d;
      for (int64_t i = 0; i < d; ++i) {
        float q = nearbyintf(value_at(src, src_bf16, at + i) / s);
        q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
        c[i] = (signed char)q;
      }
      scales[slots[t] * heads + h] = s;
    }
  return 0;
}
"""

#: no FMA contraction: every product and sum rounds as in PyTorch's separate ops
_FLAGS = [["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC",
           "-lm"],
          ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-lm"]]
MAX_HEAD_DIM = 512

def _build() -> ctypes.CDLL | None:
    lib = cpu_kernels.open_library("decode_ops", SOURCE, _FLAGS)
    if lib is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, f32, ptr, i64, i64, i64]
    lib.rms_norm_bf16.argtypes = [ptr, i64, ptr, i64, ptr, f32, ptr, i64, i64, i64]
    for fn in (lib.silu_mul_f32, lib.silu_mul_bf16):
        fn.argtypes = [ptr, i64, ptr, i64, i64, i64]
    for fn in (lib.rotary_f32, lib.rotary_bf16):
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64]
    lib.argmax_logsumexp_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.scatter_rows.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64]
    lib.scatter_rows.restype = ctypes.c_int
    lib.scatter_int8_rows.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, i64, i64, ptr, i64, i64]
    lib.scatter_int8_rows.restype = ctypes.c_int
    for fn in (lib.rms_norm_f32, lib.rms_norm_bf16, lib.silu_mul_f32, lib.silu_mul_bf16,
               lib.rotary_f32, lib.rotary_bf16, lib.argmax_logsumexp_f32):
        fn.restype = None
    return lib


#: The compiled library, or None where it cannot be built (not Linux, no compiler).
load = cpu_kernels.LazyLibrary(_build)


def usable(x: torch.Tensor) -> bool:
    """Whether `x` ([rows, ...] on CPU, float32 or bfloat16, no autograd) goes through
    these kernels."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.shape[0] > 0 and not torch.is_grad_enabled() and load() is not None)


def _by_rows(rows: int, part: Callable[[int, int], int], what: str) -> None:
    """part(lo, hi) over [0, rows): at once below SPLIT_ROWS, else in a share a thread."""
    if rows < SPLIT_ROWS:  # a decode step's case, ~120 calls a step: no share bookkeeping
        part(0, rows)
        return
    shares = max(1, min(torch.get_num_threads(), rows // (SPLIT_ROWS // 2)))
    cpu_kernels.run_shares(part, (), (), [rows * i // shares for i in range(shares + 1)], what)


def _rows_ok(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [rows, d] times weight; with `delta`, first x += delta in place (the
    residual add before a norm). Callers check `usable(x)`; x must be rows of unit stride
    and writable, weight contiguous in x's dtype."""
    lib = load()
    assert lib is not None and _rows_ok(x) and weight.dtype == x.dtype
    rows, d = x.shape
    out = torch.empty(rows, d, dtype=x.dtype)
    if delta is not None and (not _rows_ok(delta) or delta.dtype != x.dtype):
        delta = delta.reshape(rows, d).to(x.dtype).contiguous()
    fn = lib.rms_norm_f32 if x.dtype == torch.float32 else lib.rms_norm_bf16
    ldx, ldd = x.stride(0), 0 if delta is None else delta.stride(0)
    xp, wp, op = x.data_ptr(), weight.data_ptr(), out.data_ptr()
    dp = None if delta is None else delta.data_ptr()
    es = x.element_size()

    def part(lo: int, hi: int) -> int:
        fn(xp + lo * ldx * es, ldx, None if dp is None else dp + lo * ldd * es, ldd, wp, eps,
           op + lo * d * es, d, hi - lo, d)
        return 0

    _by_rows(rows, part, "rms_norm")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [rows, 2n] projection (gate first) -> [rows, n]."""
    lib = load()
    assert lib is not None and _rows_ok(gate_up)
    rows, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    fn = lib.silu_mul_f32 if gate_up.dtype == torch.float32 else lib.silu_mul_bf16
    ldg, es = gate_up.stride(0), gate_up.element_size()
    gp, op = gate_up.data_ptr(), out.data_ptr()

    def part(lo: int, hi: int) -> int:
        fn(gp + lo * ldg * es, ldg, op + lo * n * es, n, hi - lo, n)
        return 0

    _by_rows(rows, part, "silu_mul")
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """In place: x [rows, heads, d] (heads contiguous within a row) becomes
    x * cos + rotate_half(x) * sin, as `layers.apply_rotary` computes it; cos and
    signed_sin [rows, d] (or [rows, 1, d]) contiguous in x's dtype. Returns x."""
    lib = load()
    rows, heads, d = x.shape
    assert lib is not None and x.stride(2) == 1 and x.stride(1) == d and d <= MAX_HEAD_DIM
    cos, signed_sin = cos.reshape(rows, d), signed_sin.reshape(rows, d)
    assert cos.is_contiguous() and signed_sin.is_contiguous() and cos.dtype == x.dtype
    fn = lib.rotary_f32 if x.dtype == torch.float32 else lib.rotary_bf16
    ldx, xp, cp, sp = x.stride(0), x.data_ptr(), cos.data_ptr(), signed_sin.data_ptr()
    es = x.element_size()

    def part(lo: int, hi: int) -> int:
        fn(xp + lo * ldx * es, ldx, heads, d, cp + lo * d * es, sp + lo * d * es, d, hi - lo)
        return 0

    _by_rows(rows, part, "rotary")
    return x


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                    torch.Tensor] | None:
    """(argmax, max, logsumexp) of each row of float32 logits [rows, vocab] in one C call
    (greedy sampling with the sampled token's logprob = max - logsumexp), or None where
    PyTorch's ops must do it: no library, not a CPU float32 matrix of unit-stride rows,
    or a row holding NaN or an infinity (their semantics are PyTorch's to keep)."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.shape[0] == 0 or logits.shape[1] == 0 or logits.stride(1) != 1
            or logits.requires_grad):
        return None
    lib = load()
    if lib is None:
        return None
    rows, n = logits.shape
    idx = torch.empty(rows, dtype=torch.int64)
    top = torch.empty(rows, dtype=torch.float32)
    lse = torch.empty(rows, dtype=torch.float32)
    bad = torch.empty(rows, dtype=torch.int32)
    lib.argmax_logsumexp_f32(logits.data_ptr(), logits.stride(0), rows, n, idx.data_ptr(),
                             top.data_ptr(), lse.data_ptr(), bad.data_ptr())
    if bool(bad.any()):
        return None
    return idx, top, lse


#: From this many rows the KV cache write goes through `scatter_rows`; below it
#: index_copy_ is as fast (its fixed cost is lower). 2 cores, SmolLM2's K rows (3 x 64),
#: float32, index_copy_ -> scatter_rows: 8 rows 3.7 -> 8.1 us, 32 rows 5.5 -> 5.6, 128
#: 17.3 -> 10.2, 512 36 -> 21; with the other core busy, 1024 rows 5.9 ms -> 0.14 (a
#: parallel index_copy_ waits for a thread that is not free).
SCATTER_MIN_ROWS = 32


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> bool:
    """dst[index[t]] = src[t] for every t, as `dst.index_copy_(0, index, src)` (the KV
    cache write of a step), in one C call of a memcpy a row, single-threaded. dst: contiguous
    [slots, ...]; src: [t, ...] of dst's dtype whose rows are contiguous (any row
    stride); index: int64 [t]. False, with nothing done, where it does not apply (no
    library, other layouts, dtypes or devices: the caller uses index_copy_); IndexError
    for an index outside dst."""
    if (dst.device.type != "cpu" or src.device.type != "cpu" or src.dtype != dst.dtype
            or not dst.is_contiguous() or index.dtype != torch.int64 or index.dim() != 1
            or src.shape[0] != index.shape[0] or src.shape[1:] != dst.shape[1:]
            or src.requires_grad or dst.requires_grad):
        return False
    if src.shape[0] == 0:
        return True
    if not src[0].is_contiguous():
        return False
    lib = load()
    if lib is None:
        return False
    index = index.contiguous()
    row_bytes = src[0].numel() * src.element_size()
    _check_slots(lib.scatter_rows(src.data_ptr(), src.stride(0) * src.element_size(),
                                  dst.data_ptr(), row_bytes, index.data_ptr(), index.shape[0],
                                  dst.shape[0]), index, dst.shape[0])
    return True


def _check_slots(bad: int, index: torch.Tensor, num_slots: int) -> None:
    """A scatter kernel's return: 0, or the (1-based) row whose slot is out of range."""
    if bad:
        raise IndexError(f"index {int(index[bad - 1])} is out of range for a cache of "
                         f"{num_slots} slots")


def scatter_int8_rows(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
                      src: torch.Tensor) -> bool:
    """The int8 KV write in one C call: codes[index[t]], scales[index[t]] = the int8 codes
    and scales of src[t] per head, exactly as `kv_quant.quantize` (then index_copy_)
    makes them. codes: contiguous int8 [slots, heads, d]; scales: contiguous float32
    [slots, heads]; src: float32 or bfloat16 [t, heads, d], heads d apart within a row;
    index: int64 [t]. False, with nothing done, where it does not apply (the caller
    quantizes with PyTorch); IndexError for an index outside the cache."""
    if (src.dim() != 3 or src.shape[1:] != codes.shape[1:] or codes.dtype != torch.int8
            or scales.dtype != torch.float32 or src.dtype not in (torch.float32, torch.bfloat16)
            or not codes.is_contiguous() or not scales.is_contiguous()
            or src.stride(2) != 1 or src.stride(1) != src.shape[2]
            or index.dtype != torch.int64 or index.dim() != 1 or index.shape[0] != src.shape[0]
            or src.device.type != "cpu" or codes.device.type != "cpu" or src.requires_grad):
        return False
    lib = load()
    if lib is None:
        return False
    index = index.contiguous()
    _check_slots(lib.scatter_int8_rows(
        src.data_ptr(), src.stride(0), int(src.dtype == torch.bfloat16), codes.data_ptr(),
        scales.data_ptr(), src.shape[1], src.shape[2], index.data_ptr(), index.shape[0],
        codes.shape[0]), index, codes.shape[0])
    return True
