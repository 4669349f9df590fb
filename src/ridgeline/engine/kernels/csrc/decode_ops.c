/* The small per-layer ops of a decode step (RMSNorm, SwiGLU, rotary, the KV writes,
   argmax + logsumexp): built and called by ridgeline.engine.decode_ops. */
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
