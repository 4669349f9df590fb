/* Paged attention over the KV pool, decode and prefill (AVX-512, AVX2 and portable paths):
   built and called by ridgeline.engine.cpu_kernels, whose docstring describes it. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAXQV 64
#define MAXD 256
#define MAXBS 256

static inline float bf16_load(const unsigned short* p) {
  const uint32_t u = (uint32_t)*p << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline unsigned short bf16_round(float f) {  /* PyTorch's: nearest even, NaN quiet */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

/* The factor that normalises a query vector's output, acc * it, from its online softmax's
   sum l = sum exp(s - m) over the keys (m: its running max; acc = sum exp(s - m) v). With
   attention sinks (gpt-oss: a learned logit per query head that joins the softmax's
   denominator and has no value) the sum gains exp(sink - m), taken against m' = max(m,
   sink) so that neither term overflows. */
static inline float norm_factor(float l, float m, const float* sinks, int64_t head) {
  if (!sinks) return 1.f / l;
  const float s = sinks[head], mm = m > s ? m : s, f = expf(m - mm);
  return f / (l * f + expf(s - mm));
}

/* q element x of a query vector stored as float32 or bfloat16 (QB) */
#define QLOAD(QB, src, x) \
  ((QB) ? bf16_load((const unsigned short*)(src) + (x)) : ((const float*)(src))[x])

/* The path this build compiles: 2 AVX-512, 1 AVX2 + FMA, 0 portable (GCC vector
   extensions; also wherever RIDGELINE_PORTABLE is defined) */
#if !defined(RIDGELINE_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define KERNEL_PATH 2
#elif !defined(RIDGELINE_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define KERNEL_PATH 1
#else
#define KERNEL_PATH 0
#endif

#if KERNEL_PATH > 0
/* What the AVX-512 and AVX2 decode paths below share */
#include <immintrin.h>
#define UNROLL _Pragma("GCC unroll 16")
/* A chunk only rescales the running sums when a score passes the running max by more
   than this (or on the first chunk), so most chunks skip the max reduction: weights stay
   below e^8, far from float overflow, and the final division cancels the scale. */
#define RESCALE_SLACK 8.f

/* the bytes [0, n) of rows a and b into the cache (one loop: it runs in the hot loops) */
static inline __attribute__((always_inline)) void prefetch2(const char* a, const char* b,
                                                            int64_t n) {
  for (int64_t x = 0; x < n; x += 64) {
    __builtin_prefetch(a + x);
    __builtin_prefetch(b + x);
  }
}

/* The first rows (up to max_rows) of the group after the ng items from `item` on (its
   heads up to the sequence's last or item_end), so that it does not start on cold misses */
static inline __attribute__((always_inline)) void prefetch_group_start(
    const void* k_cache, const void* v_cache, const int64_t* block_table,
    int64_t table_stride, const int64_t* ctx_len, int64_t item, int ng, int64_t item_end,
    int kvh, int bs, int row_read, int64_t row_bytes, int64_t max_rows) {
  const int64_t i2 = (item + ng) / kvh, j2 = (item + ng) % kvh;
  const int64_t heads2 = kvh - j2 < item_end - item - ng ? kvh - j2 : item_end - item - ng;
  const int64_t* table2 = block_table + i2 * table_stride;
  const int64_t rows = ctx_len[i2] < max_rows ? ctx_len[i2] : max_rows;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t at = (table2[t / bs] * bs + t % bs) * row_bytes + j2 * row_read;
    prefetch2((const char*)k_cache + at, (const char*)v_cache + at, heads2 * row_read);
  }
}

/* The block walk both decode paths share: list chunk `c` (rows c * RB_ on) of a sequence's
   context, each row's K and V address for the group's first head (`kc`, `vc`) and, int8,
   the group's heads' scales (`ks`, `vs`: [MAXQV][RB_] of the chunk's ring entry),
   prefetching each row's span as it is listed; rows past the context repeat the last one
   (scored, then masked), and so do rows before `first` (a sliding window's first key: the
   blocks before it may be gone, their table entries the null block) repeat the row at
   `first`. (*blk, *off) is where the next row lies (block index, offset).
   SCALE_AHEAD > 0: the scales of the block that many blocks on are prefetched as a block
   starts (AVX2 reads them from memory; AVX-512 takes them as listed). */
static inline __attribute__((always_inline)) void list_chunk(
    const int QUANT, const int RB_, const int64_t SCALE_AHEAD, int64_t c, int64_t ctx,
    int64_t first, const int64_t* table, int bs, const char* kc, const char* vc, int64_t row_bytes, int span,
    const float* k_scale, const float* v_scale, int kvh, int64_t j0, int ng, int64_t nblocks,
    const char** kr, const char** vr, float* ks, float* vs, int64_t* blk, int* off) {
  const int n = (int)(ctx - c * RB_ < RB_ ? ctx - c * RB_ : RB_);
  for (int t = 0; t < n; ++t) {
    const int64_t slot = table[*blk] * bs + *off;
    kr[t] = kc + slot * row_bytes;
    vr[t] = vc + slot * row_bytes;
    if (QUANT) {
      if (SCALE_AHEAD > 0 && *off == 0 && *blk + SCALE_AHEAD < nblocks) {
        const int64_t at = table[*blk + SCALE_AHEAD] * bs * kvh + j0;
        prefetch2((const char*)(k_scale + at), (const char*)(v_scale + at),
                  (int64_t)((bs - 1) * kvh + ng) * 4);
      }
      for (int jj = 0; jj < ng; ++jj) {
        ks[jj * RB_ + t] = k_scale[slot * kvh + j0 + jj];
        vs[jj * RB_ + t] = v_scale[slot * kvh + j0 + jj];
      }
    }
    prefetch2(kr[t], vr[t], span);
    if (++*off == bs) { *off = 0; ++*blk; }
  }
  for (int t = n; t < RB_; ++t) {
    kr[t] = kr[n - 1];
    vr[t] = vr[n - 1];
    for (int jj = 0; jj < ng; ++jj) ks[jj * RB_ + t] = vs[jj * RB_ + t] = 0.f;
  }
  const int lead = first > c * RB_ ? (int)(first - c * RB_) : 0;  /* < n: first < ctx */
  for (int t = 0; t < lead; ++t) {
    kr[t] = kr[lead];
    vr[t] = vr[lead];
    for (int jj = 0; jj < ng; ++jj) ks[jj * RB_ + t] = vs[jj * RB_ + t] = 0.f;
  }
}

/* call with NH = nh as a compile-time constant, so each tile size gets its own code */
#define TILE_SWITCH(nh, call)                  \
  switch (nh) {                                \
    case 1: { const int NH = 1; call; } break; \
    case 2: { const int NH = 2; call; } break; \
    case 3: { const int NH = 3; call; } break; \
    default: { const int NH = 4; call; } break; \
  }
#endif

#if KERNEL_PATH == 2
/* AVX-512: 16 floats per register. A work item walks its context in chunks of RB = 16
   rows. Per chunk: each K row is loaded once for a tile of up to HT query vectors (the
   grouped-query heads of one KV head, times the new tokens); each query vector's 16 dot
   products are folded into one vector of 16 scores; the online-softmax update runs on
   that vector (one vectorised exp for 16 rows); then each V row is loaded once for the
   tile and accumulated in registers. Channels go CT vectors (64) at a time; vectors past
   head_dim (a multiple of 8) are masked loads that read nothing.
   Memory bounds this loop for float32 and mostly for bfloat16 KV (a layer's KV is far
   larger than the caches and its blocks lie anywhere in the pool), so rows are listed
   AHEAD chunks in advance and prefetched when listed, then prefetched again, spread over
   the loads of the chunk before them (measured on an AMD EPYC Zen 5: the repeat makes
   float32 KV 1.5x faster than the burst alone, which suggests that prefetches issued
   while the fill buffers are full get dropped). */
#define VECTOR_WIDTH 16
#define RB 16
#define HT 4
#define CT 4
#define AHEAD 2
#define RING 4  /* chunks listed: the current one and AHEAD more (a power of 2) */

/* 16 channels of a K/V row as floats; lanes outside m are not read and are 0 */
static inline __attribute__((always_inline)) __m512 load16(const int MODE, const char* p,
                                                           __mmask16 m) {
  if (MODE == 0) return _mm512_maskz_loadu_ps(m, p);
  if (MODE == 2)  /* bfloat16 is the top half of a float32 */
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

/* e^x for x <= RESCALE_SLACK (a score minus the running max), within ~2 ulp: x = n ln2 +
   r with |r| <= ln2/2 (ln2 in two parts, so r is exact), e^r by its degree-6 minimax
   polynomial, 2^n applied by scalef. Below -87.3 it returns ~1e-38, not 0: callers zero
   masked lanes themselves. */
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

/* 16 row vectors P_0..P_15 -> one vector, lane t = the sum of P_t's lanes, in four rounds:
   each folds two vectors into one that holds half of each one's partial sums (blend +
   two-source permute + add; 15 of each in all, where horizontal sums take 4 shuffles and
   4 adds per row), and the lanes come out in row order. fold1 is the first round (rows t
   and t + 8: linear, so channel tiles can be added after it), reduce8 the other three
   over its 8 results. */
static inline __m512 fold1(__m512 x, __m512 y) {  /* lanes 0-7: row t, 8-15: row t + 8 */
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15,
                                       16, 17, 18, 19, 20, 21, 22, 23);
  return _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, x, y), _mm512_permutex2var_ps(x, i1, y));
}
static inline __m512 reduce8(const float (*F)[16]) {
  const __m512i i2 = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19,
                                       12, 13, 14, 15, 24, 25, 26, 27);
  const __m512i i3 = _mm512_setr_epi32(2, 3, 16, 17, 6, 7, 20, 21,
                                       10, 11, 24, 25, 14, 15, 28, 29);
  const __m512i i4 = _mm512_setr_epi32(1, 16, 3, 18, 5, 20, 7, 22,
                                       9, 24, 11, 26, 13, 28, 15, 30);
  __m512 b[4], c[2];
  UNROLL for (int r = 0; r < 4; ++r) {  /* 4 lanes each of rows r, r + 4, r + 8, r + 12 */
    const __m512 x = _mm512_load_ps(F[r]), y = _mm512_load_ps(F[r + 4]);
    b[r] = _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, x, y), _mm512_permutex2var_ps(x, i2, y));
  }
  UNROLL for (int r = 0; r < 2; ++r)  /* lanes 2k, 2k + 1: row r + 2k */
    c[r] = _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, b[r], b[r + 2]),
                         _mm512_permutex2var_ps(b[r], i3, b[r + 2]));
  return _mm512_add_ps(_mm512_mask_blend_ps(0xAAAA, c[0], c[1]),
                       _mm512_permutex2var_ps(c[0], i4, c[1]));
}

/* KV heads of one sequence walked together (see attention_body): 1, since on a Zen 4
   walking SmolLM2's 3 heads together made float32 KV 1.2x and int8 1.1x slower and
   bfloat16 no faster (attention_bench, 64 sequences), though the AVX2 path gains on Zen 3 */
#define GROUP_HEADS 1
#define QROW (MAXD + 16 * CT)  /* floats per query vector / accumulator, tile padding */

/* S[h] = q[h] . K row t, lane t < RB, for h < NH (a compile-time constant); row t starts
   at kr[t] + off. Prefetches rows pf[] + off (pf_bytes each) on the way when pf is given */
static inline __attribute__((always_inline)) void scores_tile(
    const int MODE, const int NH, const char* const* kr, int64_t off, const float (*q)[QROW],
    int nvec, const __mmask16* vmask, float (*F)[RB / 2][16], __m512* S,
    const char* const* pf, int pf_bytes) {
  const int64_t esize = MODE == 1 ? 1 : MODE == 2 ? 2 : 4;
  for (int c0 = 0; c0 < nvec; c0 += CT) {
    __m512 qv[HT][CT];
    UNROLL for (int h = 0; h < NH; ++h)
      UNROLL for (int c = 0; c < CT; ++c) qv[h][c] = _mm512_load_ps(q[h] + 16 * (c0 + c));
    for (int t = 0; t < RB / 2; ++t) {
      if (pf && c0 == 0) prefetch2(pf[t] + off, pf[t + RB / 2] + off, pf_bytes);
      const char* k0p = kr[t] + off;
      const char* k1p = kr[t + RB / 2] + off;
      __m512 s0[HT], s1[HT];
      UNROLL for (int h = 0; h < NH; ++h) s0[h] = s1[h] = _mm512_setzero_ps();
      UNROLL for (int c = 0; c < CT; ++c) {
        const __m512 k0 = load16(MODE, k0p + 16 * (c0 + c) * esize, vmask[c0 + c]);
        const __m512 k1 = load16(MODE, k1p + 16 * (c0 + c) * esize, vmask[c0 + c]);
        UNROLL for (int h = 0; h < NH; ++h) {
          s0[h] = _mm512_fmadd_ps(qv[h][c], k0, s0[h]);
          s1[h] = _mm512_fmadd_ps(qv[h][c], k1, s1[h]);
        }
      }
      UNROLL for (int h = 0; h < NH; ++h) {
        const __m512 f = fold1(s0[h], s1[h]);
        _mm512_store_ps(F[h][t], c0 ? _mm512_add_ps(_mm512_load_ps(F[h][t]), f) : f);
      }
    }
  }
  UNROLL for (int h = 0; h < NH; ++h) S[h] = reduce8((const float (*)[16])F[h]);
}

#if defined(__AVX512BF16__)
/* scores_tile for bfloat16 q and K by vdpbf16ps: q[h] holds channel pairs as 32 bits
   (unscaled), K rows are read as pairs straight from the cache, 32 channels a vector,
   CTD vectors a tile (pmask: the pairs of each vector that exist). Each product of two
   bfloat16 is exact in float32 and the sums are float32; half the multiply-adds of the
   float path and no widening. */
#define CTD 2
static inline __attribute__((always_inline)) void scores_tile_dot(
    const int NH, const char* const* kr, int64_t off, const float (*q)[QROW], int npv,
    const __mmask16* pmask, float (*F)[RB / 2][16], __m512* S, const char* const* pf,
    int pf_bytes) {
  for (int c0 = 0; c0 < npv; c0 += CTD) {
    __m512bh qv[HT][CTD];
    UNROLL for (int h = 0; h < NH; ++h)
      UNROLL for (int c = 0; c < CTD; ++c)
        qv[h][c] = (__m512bh)_mm512_load_si512((const void*)(q[h] + 16 * (c0 + c)));
    for (int t = 0; t < RB / 2; ++t) {
      if (pf && c0 == 0) prefetch2(pf[t] + off, pf[t + RB / 2] + off, pf_bytes);
      const char* k0p = kr[t] + off;
      const char* k1p = kr[t + RB / 2] + off;
      __m512 s0[HT], s1[HT];
      UNROLL for (int h = 0; h < NH; ++h) s0[h] = s1[h] = _mm512_setzero_ps();
      UNROLL for (int c = 0; c < CTD; ++c) {
        const __m512bh k0 = (__m512bh)_mm512_maskz_loadu_epi32(pmask[c0 + c], k0p + 64 * (c0 + c));
        const __m512bh k1 = (__m512bh)_mm512_maskz_loadu_epi32(pmask[c0 + c], k1p + 64 * (c0 + c));
        UNROLL for (int h = 0; h < NH; ++h) {
          s0[h] = _mm512_dpbf16_ps(s0[h], qv[h][c], k0);
          s1[h] = _mm512_dpbf16_ps(s1[h], qv[h][c], k1);
        }
      }
      UNROLL for (int h = 0; h < NH; ++h) {
        const __m512 f = fold1(s0[h], s1[h]);
        _mm512_store_ps(F[h][t], c0 ? _mm512_add_ps(_mm512_load_ps(F[h][t]), f) : f);
      }
    }
  }
  UNROLL for (int h = 0; h < NH; ++h) S[h] = reduce8((const float (*)[16])F[h]);
}
#endif

/* acc[h] = acc[h] * corr[h] + sum over rows t < nr of p[h][t] * V row t (at vr[t] + off),
   for h < NH; prefetches rows pf[] + off on the way when pf is given */
static inline __attribute__((always_inline)) void values_tile(
    const int MODE, const int NH, const char* const* vr, int64_t off, int nr,
    const float (*p)[RB], const float* corr, float (*acc)[QROW], int nvec,
    const __mmask16* vmask, const char* const* pf, int pf_bytes) {
  const int64_t esize = MODE == 1 ? 1 : MODE == 2 ? 2 : 4;
  for (int c0 = 0; c0 < nvec; c0 += CT) {
    __m512 ac[HT][CT];
    UNROLL for (int h = 0; h < NH; ++h)
      UNROLL for (int c = 0; c < CT; ++c)
        ac[h][c] = _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * (c0 + c)),
                                 _mm512_set1_ps(corr[h]));
    for (int t = 0; t < nr; ++t) {
      if (pf && c0 == 0)
        for (int x = 0; x < pf_bytes; x += 64) __builtin_prefetch(pf[t] + off + x);
      const char* v = vr[t] + off;
      UNROLL for (int c = 0; c < CT; ++c) {
        const __m512 vv = load16(MODE, v + 16 * (c0 + c) * esize, vmask[c0 + c]);
        UNROLL for (int h = 0; h < NH; ++h)
          ac[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][t]), vv, ac[h][c]);
      }
    }
    UNROLL for (int h = 0; h < NH; ++h)
      UNROLL for (int c = 0; c < CT; ++c) _mm512_store_ps(acc[h] + 16 * (c0 + c), ac[h][c]);
  }
}

#if defined(__AVX512BF16__)
/* values_tile for bfloat16 V with DOT: rows taken in pairs (t, t + 1), their channels
   interleaved by unpacklo/hi_epi16 into pairs, and the pair's two weights rounded to
   bfloat16 (as FlashAttention does before its P V product), so one vdpbf16ps adds both
   rows' products for 16 channels: a quarter of the instructions of widening and fma. The
   unpack works within 128-bit lanes, so acc holds each 32 channels as [0-3, 8-11, 16-19,
   24-27 | 4-7, 12-15, 20-23, 28-31] (`unpermute_pairs` puts them back at the end). A row
   past nr has weight 0 and reads the chunk's padding row (a real cache row). */
#define CTV 2  /* groups of 32 channels a tile */
/* the channels of group c (32 bf16 each) that a head of d channels has */
static inline __mmask32 group_mask(int d, int c) {
  return 32 * c >= d ? 0 : d - 32 * c >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (d - 32 * c)) - 1);
}
static inline __attribute__((always_inline)) void values_tile_dot(
    const int NH, const char* const* vr, int64_t off, int nr, const float (*p)[RB],
    const float* corr, float (*acc)[QROW], int ngrp, const __mmask32* gmask,
    const char* const* pf, int pf_bytes) {
  uint32_t pp[HT][RB / 2] __attribute__((aligned(64)));  /* (p[t], p[t + 1]) as bf16 */
  UNROLL for (int h = 0; h < NH; ++h)
    _mm256_store_si256((__m256i*)pp[h], (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p[h])));
  for (int g0 = 0; g0 < ngrp; g0 += CTV) {
    __m512 ac[HT][2 * CTV];
    UNROLL for (int h = 0; h < NH; ++h)
      UNROLL for (int c = 0; c < 2 * CTV; ++c)
        ac[h][c] = _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * (2 * g0 + c)),
                                 _mm512_set1_ps(corr[h]));
    for (int t = 0; t < nr; t += 2) {
      if (pf && g0 == 0) prefetch2(pf[t] + off, pf[t + 1] + off, pf_bytes);
      const char* v0 = vr[t] + off;
      const char* v1 = vr[t + 1] + off;
      __m512bh w[HT];
      UNROLL for (int h = 0; h < NH; ++h) w[h] = (__m512bh)_mm512_set1_epi32((int)pp[h][t / 2]);
      UNROLL for (int c = 0; c < CTV; ++c) {
        const __m512i a = _mm512_maskz_loadu_epi16(gmask[g0 + c], v0 + 64 * (g0 + c));
        const __m512i b = _mm512_maskz_loadu_epi16(gmask[g0 + c], v1 + 64 * (g0 + c));
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        UNROLL for (int h = 0; h < NH; ++h) {
          ac[h][2 * c] = _mm512_dpbf16_ps(ac[h][2 * c], w[h], lo);
          ac[h][2 * c + 1] = _mm512_dpbf16_ps(ac[h][2 * c + 1], w[h], hi);
        }
      }
    }
    UNROLL for (int h = 0; h < NH; ++h)
      UNROLL for (int c = 0; c < 2 * CTV; ++c)
        _mm512_store_ps(acc[h] + 16 * (2 * g0 + c), ac[h][c]);
  }
}

/* channels 16 c .. 16 c + 15 of an accumulator that values_tile_dot filled */
static inline __m512 unpermute_pairs(const float* acc, int c) {
  const __m512i even = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19,
                                         4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i odd = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27,
                                        12, 13, 14, 15, 28, 29, 30, 31);
  const float* grp = acc + 32 * (c / 2);
  return _mm512_permutex2var_ps(_mm512_load_ps(grp), c % 2 ? odd : even,
                                _mm512_load_ps(grp + 16));
}
#endif

/* Items [item_begin, item_end): item = sequence * kvh + kv head. For each of the g query
   heads of that KV head and each new query row r of the sequence (row r sees positions
   < ctx - (q_len - 1 - r)), softmax(q k^T * scale) v over the context, with an online
   softmax, RB rows at a time (see above). MODE (a compile-time constant after inlining)
   is how K/V are stored: 0 float32; 1 int8 codes with a float scale per (slot, head),
   dequantized as they are loaded (scale folded into score and weight); 2 bfloat16,
   widened as loaded. QB: q and out are bfloat16 (read and written as such, out rounded to
   nearest even), else float32; DOT (MODE 2, QB, AVX512_BF16): scores by vdpbf16ps.
   The loop can walk up to GROUP_HEADS consecutive items of one sequence (its KV heads)
   together, chunk by chunk, head after head, as the AVX2 path does (contiguous reads);
   it is 1 here (see GROUP_HEADS). A query vector's result does not depend on which other
   vectors share its tile or group: each one's sums run in the same order whatever the
   tile, so a speculative verify row equals the plain decode of the same token. */
static inline __attribute__((always_inline)) int attention_body(
    const int MODE, const int QB, const int DOT,
    const void* q, int64_t q_row_stride, int64_t q_head_stride,
    const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    void* out, int64_t out_row_stride,
    int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale, int64_t window, const float* sinks) {
  const int QUANT = MODE == 1;
  const int64_t esize = MODE == 1 ? 1 : MODE == 2 ? 2 : 4;
  if (d > MAXD || bs > MAXBS || d % 8 != 0) return -1;
  const int nvec = (d + 15) / 16;
  __mmask16 vmask[MAXD / 16 + CT];
  for (int c = 0; c < MAXD / 16 + CT; ++c)
    vmask[c] = c >= nvec ? 0 : d - 16 * c >= 16 ? 0xFFFF : (__mmask16)((1u << (d - 16 * c)) - 1);
#if defined(__AVX512BF16__)
  const int pairs = d / 2, npv = (pairs + 15) / 16;  /* DOT: channel pairs, vectors */
  __mmask16 pmask[MAXD / 32 + CT];
  for (int c = 0; c < MAXD / 32 + CT; ++c)
    pmask[c] = c >= npv ? 0 : pairs - 16 * c >= 16 ? 0xFFFF
                                                    : (__mmask16)((1u << (pairs - 16 * c)) - 1);
  const int ngrp = (d + 31) / 32;  /* DOT: V's groups of 32 channels */
  __mmask32 gmask[MAXD / 32 + 2 * CT];
  for (int c = 0; c < MAXD / 32 + 2 * CT; ++c) gmask[c] = group_mask(d, c);
#endif
  const int dpad = 16 * CT * ((nvec + CT - 1) / CT);  /* channels the tiles cover */
  const int row_read = (int)(d * esize);  /* bytes of one head's K (or V) row */
  const int64_t row_bytes = (int64_t)kvh * row_read;  /* between rows of one head */
  float qs[MAXQV][QROW] __attribute__((aligned(64)));  /* DOT: bfloat16 pairs as 32 bits */
  float acc[MAXQV][QROW] __attribute__((aligned(64)));
  float p[MAXQV][RB] __attribute__((aligned(64)));
  float F[HT][RB / 2][16] __attribute__((aligned(64)));
  __m512 lsum[MAXQV];
  float m[MAXQV], corr[MAXQV];
  int64_t lim[MAXQV], lo[MAXQV];
  /* the listed chunks' rows: K/V addresses of the group's first head, int8 scales */
  const char* kr[RING][RB];
  const char* vr[RING][RB];
  float ks[RING][MAXQV][RB] __attribute__((aligned(64)));
  float vs[RING][MAXQV][RB] __attribute__((aligned(64)));
  for (int64_t item = item_begin; item < item_end;) {
    const int64_t i = item / kvh, j0 = item % kvh;
    const int ql = (int)q_len[i];
    const int nq = g * ql;  /* query vectors per head */
    if (nq > MAXQV) return -2;
    int ng = kvh - (int)j0;  /* heads in this group */
    if (ng > item_end - item) ng = (int)(item_end - item);
    if (ng > MAXQV / nq) ng = MAXQV / nq;
    if (ng > GROUP_HEADS) ng = GROUP_HEADS;
    const int64_t ctx = ctx_len[i];
    for (int a = 0; a < ng * nq; ++a) {  /* a = head in group * nq + query head * ql + row */
      const int jj = a / nq, gi = a % nq / ql, r = a % ql;
      const int64_t at = (q_start[i] + r) * q_row_stride + ((j0 + jj) * g + gi) * q_head_stride;
      const char* src = (const char*)q + at * (QB ? 2 : 4);
#if defined(__AVX512BF16__)
      if (DOT) {
        uint32_t* dst = (uint32_t*)qs[a];
        memcpy(dst, src, (size_t)d * 2);
        for (int x = pairs; x < 16 * CTD * ((npv + CTD - 1) / CTD); ++x) dst[x] = 0u;
      } else
#endif
      {
        for (int x = 0; x < d; ++x) qs[a][x] = QLOAD(QB, src, x) * scale;
        for (int x = d; x < dpad; ++x) qs[a][x] = 0.f;
      }
      for (int x = 0; x < dpad; ++x) acc[a][x] = 0.f;
      lsum[a] = _mm512_setzero_ps();
      lim[a] = ctx - (ql - 1 - r);
      lo[a] = window > 0 ? lim[a] - window : 0;  /* sliding window: first key seen */
      m[a] = -FLT_MAX; /* finite: the kernel may be built with finite-math-only */
    }
    const int span = ng * row_read;  /* bytes of the group's heads in one slot */
    const char* kc = (const char*)k_cache + j0 * row_read;
    const char* vc = (const char*)v_cache + j0 * row_read;
    const int64_t* table = block_table + i * table_stride;
    const int64_t nchunks = (ctx + RB - 1) / RB;
    /* a sliding window: the chunks before the first row's window are not walked (their
       blocks may be gone: the scheduler releases them) */
    const int64_t first = window > 0 && ctx - ql + 1 - window > 0 ? ctx - ql + 1 - window : 0;
    const int64_t ch0 = first / RB;
    int64_t listed = ch0;  /* chunks listed so far */
    int64_t blk = ch0 * RB / bs;  /* where the next row to list lies: block index, offset */
    int off = (int)(ch0 * RB % bs);
    for (int64_t ch = ch0; ch < nchunks; ++ch) {
      for (; listed < nchunks && listed <= ch + AHEAD; ++listed) {
        const int e = (int)(listed & (RING - 1));
        list_chunk(QUANT, RB, 0, listed, ctx, first, table, bs, kc, vc, row_bytes, span, k_scale,
                   v_scale, kvh, j0, ng, 0, kr[e], vr[e], &ks[e][0][0], &vs[e][0][0], &blk,
                   &off);
      }
      if (ch == (nchunks - 2 > ch0 ? nchunks - 2 : ch0) && item + ng < item_end)
        prefetch_group_start(k_cache, v_cache, block_table, table_stride, ctx_len, item, ng,
                             item_end, kvh, bs, row_read, row_bytes, 2 * RB);
      const int cur = (int)(ch & (RING - 1));
      const int nxt = ch + 1 < nchunks ? (int)((ch + 1) & (RING - 1)) : -1;
      const int64_t t0 = ch * RB;
      const int nr = (int)(ctx - t0 < RB ? ctx - t0 : RB);
      for (int jj = 0; jj < ng; ++jj) {
        const int64_t hoff = (int64_t)jj * row_read;
        const int ab = jj * nq, ae = ab + nq;  /* this head's query vectors */
        for (int a0 = ab; a0 < ae; a0 += HT) {
          const int nh = ae - a0 < HT ? ae - a0 : HT;
          const char* const* pf = a0 == ab && nxt >= 0 ? kr[nxt] : 0;
          __m512 S[HT];
#if defined(__AVX512BF16__)
          if (DOT)
            TILE_SWITCH(nh, scores_tile_dot(NH, kr[cur], hoff, (const float (*)[QROW])qs + a0,
                                            npv, pmask, F, S, pf, row_read))
          else
#endif
            TILE_SWITCH(nh, scores_tile(MODE, NH, kr[cur], hoff, (const float (*)[QROW])qs + a0,
                                        nvec, vmask, F, S, pf, row_read))
          for (int h = 0; h < nh; ++h) {
            const int a = a0 + h;
            const int64_t lv = lim[a] - t0;
            const int valid = (int)(lv > nr ? nr : lv);
            const int64_t skip = lo[a] - t0;  /* leading rows before this row's window */
            if (valid <= 0 || skip >= valid) {  /* this query row sees none of the chunk */
              corr[a] = 1.f;
              _mm512_store_ps(p[a], _mm512_setzero_ps());
              continue;
            }
            __mmask16 vm = valid >= RB ? 0xFFFF : (__mmask16)((1u << valid) - 1);
            if (skip > 0) vm &= (__mmask16)(0xFFFFu << skip);
            __m512 s = S[h];
            if (DOT) s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
            if (QUANT) s = _mm512_mul_ps(s, _mm512_load_ps(ks[cur][jj]));
            float cr = 1.f;
            if (_mm512_mask_cmp_ps_mask(vm, s, _mm512_set1_ps(m[a] + RESCALE_SLACK),
                                        _CMP_GT_OQ)) {
              const float bm = _mm512_mask_reduce_max_ps(vm, s);
              cr = _mm512_cvtss_f32(exp16(_mm512_set1_ps(m[a] - bm)));  /* ~0 the 1st time */
              m[a] = bm;
            }
            __m512 e = _mm512_maskz_mov_ps(vm, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m[a]))));
            lsum[a] = _mm512_fmadd_ps(lsum[a], _mm512_set1_ps(cr), e);
            if (QUANT) e = _mm512_mul_ps(e, _mm512_load_ps(vs[cur][jj]));  /* V row scales */
            _mm512_store_ps(p[a], e);
            corr[a] = cr;
          }
        }
        for (int a0 = ab; a0 < ae; a0 += HT) {
          const int nh = ae - a0 < HT ? ae - a0 : HT;
          const char* const* pf = a0 == ab && nxt >= 0 ? vr[nxt] : 0;
#if defined(__AVX512BF16__)
          if (DOT)
            TILE_SWITCH(nh, values_tile_dot(NH, vr[cur], hoff, nr, (const float (*)[RB])p + a0,
                                            corr + a0, acc + a0, ngrp, gmask, pf, row_read))
          else
#endif
            TILE_SWITCH(nh, values_tile(MODE, NH, vr[cur], hoff, nr,
                                        (const float (*)[RB])p + a0, corr + a0, acc + a0, nvec,
                                        vmask, pf, row_read))
        }
      }
    }
    for (int a = 0; a < ng * nq; ++a) {
      const int jj = a / nq, gi = a % nq / ql, r = a % ql;
      const int64_t at = (q_start[i] + r) * out_row_stride + ((j0 + jj) * g + gi) * d;
      const __m512 inv = _mm512_set1_ps(norm_factor(_mm512_reduce_add_ps(lsum[a]), m[a],
                                                    sinks, (j0 + jj) * g + gi));
      for (int c = 0; c < nvec; ++c) {
#if defined(__AVX512BF16__)
        const __m512 o = _mm512_mul_ps(DOT ? unpermute_pairs(acc[a], c)
                                           : _mm512_load_ps(acc[a] + 16 * c), inv);
#else
        const __m512 o = _mm512_mul_ps(_mm512_load_ps(acc[a] + 16 * c), inv);
#endif
        if (QB) {  /* bf16_round, 16 lanes */
          const __m512i u = _mm512_castps_si512(o);
          const __m512i hi = _mm512_srli_epi32(u, 16);
          __m512i rnd = _mm512_srli_epi32(
              _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                   _mm512_and_si512(hi, _mm512_set1_epi32(1)))),
              16);
          const __mmask16 nan = _mm512_cmpgt_epu32_mask(
              _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
          rnd = _mm512_mask_or_epi32(rnd, nan, hi, _mm512_set1_epi32(0x40));
          _mm512_mask_cvtepi32_storeu_epi16((unsigned short*)out + at + 16 * c, vmask[c], rnd);
        } else {
          _mm512_mask_storeu_ps((float*)out + at + 16 * c, vmask[c], o);
        }
      }
    }
    item += ng;
  }
  return 0;
}

#elif KERNEL_PATH == 1
/* AVX2 + FMA: the AVX-512 path's plan with 8 floats per register and 16 registers. A work
   item walks its context in chunks of RB = 8 rows. Scores: two rows at a time (t, t + 4),
   each K vector loaded once for a tile of up to HT query vectors (q read from L1: 16
   registers do not hold a q tile and its sums), the two rows' sums folded into one vector
   when their channels are done, the 4 folds of a chunk into one vector of 8 scores; one
   vectorised exp per chunk and query vector; V accumulated in registers, VCT(NH) vectors
   of channels at a time. head_dim is a multiple of 8, so every vector is whole: no masks,
   channel tiles end where head_dim does (the count is a compile-time constant per tile).
   Unlike the AVX-512 path, the consecutive work items of one sequence (its KV heads) walk
   the context together, chunk by chunk, head after head: a slot's rows of those heads lie
   side by side, so the reads are contiguous runs, not one head's rows at a stride of
   kv_heads rows (on a Zen 3 core a pure read of SmolLM2-shaped float32 KV ran at 13.7
   GB/s against 8.7; the kernel got 5-15% faster per call).
   Rows are listed and prefetched AHEAD chunks in advance, then prefetched again, head by
   head, over the loads of the chunk before them, as in the AVX-512 path (on the Zen 3:
   without the second prefetch float32 and bfloat16 KV were 1.4x slower; listing 2-8
   chunks ahead instead of 1 was no faster). */
#define VECTOR_WIDTH 8
#define RB 8
#define HT 4
#define VCT(nh) ((nh) == 1 ? 8 : (nh) <= 3 ? 4 : 2)  /* V channel vectors per tile */
#define AHEAD 1
#define RING 2  /* chunks listed: the current one and AHEAD more (a power of 2) */

/* 8 channels of a K/V row as floats */
static inline __attribute__((always_inline)) __m256 load8(const int MODE, const char* p) {
  if (MODE == 0) return _mm256_loadu_ps((const float*)p);
  if (MODE == 2)  /* bfloat16 is the top half of a float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* e^x for x <= RESCALE_SLACK, as exp16 in the AVX-512 path (same reduction and
   polynomial); 2^n is built in the exponent bits (n >= -126 after the clamp: normal). */
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* 8 row vectors -> one vector, lane t = the sum of row t's lanes, in three rounds that
   each fold two vectors into one holding half of each one's partial sums: fold1 (rows t
   and t + 4, lanes 0-3 and 4-7), then reduce4 over its 4 results (blend + shuffle + add
   into lane pairs, then one horizontal add puts the rows in order). */
static inline __m256 fold1(__m256 x, __m256 y) {
  return _mm256_add_ps(_mm256_blend_ps(x, y, 0xF0), _mm256_permute2f128_ps(x, y, 0x21));
}
static inline __m256 reduce4(const float (*F)[8]) {
  const __m256 b0 = _mm256_load_ps(F[0]), b1 = _mm256_load_ps(F[1]);
  const __m256 b2 = _mm256_load_ps(F[2]), b3 = _mm256_load_ps(F[3]);
  /* lanes 0-1: row r, 2-3: row r + 1 (4-7: rows r + 4, r + 5) */
  const __m256 c0 = _mm256_add_ps(_mm256_blend_ps(b0, b1, 0xCC),
                                  _mm256_shuffle_ps(b0, b1, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m256 c1 = _mm256_add_ps(_mm256_blend_ps(b2, b3, 0xCC),
                                  _mm256_shuffle_ps(b2, b3, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm256_hadd_ps(c0, c1);
}

#define QROW MAXD  /* floats per query vector / accumulator */

/* S[h] = q[h] . K row t, lane t < RB, for h < NH (a compile-time constant); row t starts
   at kr[t] + off. Prefetches rows pf[] + off (pf_bytes each) on the way when pf is given */
static inline __attribute__((always_inline)) void scores_tile(
    const int MODE, const int NH, const char* const* kr, int64_t off, const float (*q)[QROW],
    int nvec, __m256* S, const char* const* pf, int pf_bytes) {
  const int64_t esize = MODE == 1 ? 1 : MODE == 2 ? 2 : 4;
  float F[HT][RB / 2][8] __attribute__((aligned(32)));
  for (int t = 0; t < RB / 2; ++t) {
    if (pf) prefetch2(pf[t] + off, pf[t + RB / 2] + off, pf_bytes);
    const char* k0p = kr[t] + off;
    const char* k1p = kr[t + RB / 2] + off;
    __m256 s0[HT], s1[HT];
    UNROLL for (int h = 0; h < NH; ++h) s0[h] = s1[h] = _mm256_setzero_ps();
    _Pragma("GCC unroll 2") for (int c = 0; c < nvec; ++c) {
      const __m256 k0 = load8(MODE, k0p + 8 * c * esize);
      const __m256 k1 = load8(MODE, k1p + 8 * c * esize);
      UNROLL for (int h = 0; h < NH; ++h) {
        const __m256 qv = _mm256_load_ps(q[h] + 8 * c);
        s0[h] = _mm256_fmadd_ps(qv, k0, s0[h]);
        s1[h] = _mm256_fmadd_ps(qv, k1, s1[h]);
      }
    }
    UNROLL for (int h = 0; h < NH; ++h) _mm256_store_ps(F[h][t], fold1(s0[h], s1[h]));
  }
  UNROLL for (int h = 0; h < NH; ++h) S[h] = reduce4((const float (*)[8])F[h]);
}

/* acc[h][c0, c0 + NC vectors) = acc[h] * corr[h] + sum over rows t < nr of p[h][t] * V row
   t (at vr[t] + off), for h < NH; prefetches rows pf[] + off on the way when pf is given */
static inline __attribute__((always_inline)) void values_tile(
    const int MODE, const int NH, const int NC, const char* const* vr, int64_t off, int nr,
    const float (*p)[RB], const float* corr, float (*acc)[QROW], int c0,
    const char* const* pf, int pf_bytes) {
  const int64_t esize = MODE == 1 ? 1 : MODE == 2 ? 2 : 4;
  __m256 ac[HT][8];
  UNROLL for (int h = 0; h < NH; ++h)
    UNROLL for (int c = 0; c < NC; ++c)
      ac[h][c] = _mm256_mul_ps(_mm256_load_ps(acc[h] + 8 * (c0 + c)),
                               _mm256_set1_ps(corr[h]));
  for (int t = 0; t < nr; ++t) {
    if (pf)
      for (int x = 0; x < pf_bytes; x += 64) __builtin_prefetch(pf[t] + off + x);
    const char* v = vr[t] + off + 8 * c0 * esize;
    __m256 w[HT];
    UNROLL for (int h = 0; h < NH; ++h) w[h] = _mm256_broadcast_ss(&p[h][t]);
    UNROLL for (int c = 0; c < NC; ++c) {
      const __m256 vv = load8(MODE, v + 8 * c * esize);
      UNROLL for (int h = 0; h < NH; ++h) ac[h][c] = _mm256_fmadd_ps(w[h], vv, ac[h][c]);
    }
  }
  UNROLL for (int h = 0; h < NH; ++h)
    UNROLL for (int c = 0; c < NC; ++c) _mm256_store_ps(acc[h] + 8 * (c0 + c), ac[h][c]);
}

/* every V channel tile of the chunk for query vectors [a0, a0 + NH): full tiles of
   VCT(NH) vectors, then one of the vectors left, each count a compile-time constant */
static inline __attribute__((always_inline)) void values_all(
    const int MODE, const int NH, const char* const* vr, int64_t off, int nr,
    const float (*p)[RB], const float* corr, float (*acc)[QROW], int nvec,
    const char* const* pf, int pf_bytes) {
  const int ct = VCT(NH);
  int c0 = 0;
  for (; c0 + ct <= nvec; c0 += ct)
    values_tile(MODE, NH, VCT(NH), vr, off, nr, p, corr, acc, c0, c0 ? 0 : pf, pf_bytes);
  switch (nvec - c0) {
#define VTAIL(n) \
    case n: if (n < ct) values_tile(MODE, NH, n < ct ? n : 1, vr, off, nr, p, corr, acc, c0, \
                                    c0 ? 0 : pf, pf_bytes); break;
    VTAIL(1) VTAIL(2) VTAIL(3) VTAIL(4) VTAIL(5) VTAIL(6) VTAIL(7)
#undef VTAIL
    default: break;
  }
}

/* Items [item_begin, item_end): as in the AVX-512 path (same arguments, same MODE), taken
   a sequence's heads at a time: a group is the items of one sequence in the range, as many
   heads as MAXQV query vectors hold. */
static inline __attribute__((always_inline)) int attention_body(
    const int MODE, const int QB, const int DOT,
    const void* q, int64_t q_row_stride, int64_t q_head_stride,
    const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    void* out, int64_t out_row_stride,
    int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale, int64_t window, const float* sinks) {
  (void)DOT;  /* vdpbf16ps scores are the AVX-512 path's */
  const int QUANT = MODE == 1;
  const int64_t esize = MODE == 1 ? 1 : MODE == 2 ? 2 : 4;
  if (d > MAXD || bs > MAXBS || d % 8 != 0) return -1;
  const int nvec = d / 8;
  const int row_read = (int)(d * esize);  /* bytes of one head's K (or V) row */
  const int64_t row_bytes = (int64_t)kvh * row_read;  /* between rows of one head */
  float qs[MAXQV][QROW] __attribute__((aligned(32)));
  float acc[MAXQV][QROW] __attribute__((aligned(32)));
  float p[MAXQV][RB] __attribute__((aligned(32)));
  __m256 lsum[MAXQV];
  float m[MAXQV], corr[MAXQV];
  int64_t lim[MAXQV], lo[MAXQV];
  /* the listed chunks' rows: K/V addresses of the group's first head, int8 scales */
  const char* kr[RING][RB];
  const char* vr[RING][RB];
  float ks[RING][MAXQV][RB] __attribute__((aligned(32)));
  float vs[RING][MAXQV][RB] __attribute__((aligned(32)));
  const __m256 iota = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  for (int64_t item = item_begin; item < item_end;) {
    const int64_t i = item / kvh, j0 = item % kvh;
    const int ql = (int)q_len[i];
    const int nq = g * ql;  /* query vectors per head */
    if (nq > MAXQV) return -2;
    int ng = kvh - (int)j0;  /* heads in this group */
    if (ng > item_end - item) ng = (int)(item_end - item);
    if (ng > MAXQV / nq) ng = MAXQV / nq;
    const int64_t ctx = ctx_len[i];
    for (int a = 0; a < ng * nq; ++a) {  /* a = head in group * nq + query head * ql + row */
      const int jj = a / nq, gi = a % nq / ql, r = a % ql;
      const char* src = (const char*)q + ((q_start[i] + r) * q_row_stride
                         + ((j0 + jj) * g + gi) * q_head_stride) * (QB ? 2 : 4);
      for (int x = 0; x < d; ++x) { qs[a][x] = QLOAD(QB, src, x) * scale; acc[a][x] = 0.f; }
      lsum[a] = _mm256_setzero_ps();
      lim[a] = ctx - (ql - 1 - r);
      lo[a] = window > 0 ? lim[a] - window : 0;  /* sliding window: first key seen */
      m[a] = -FLT_MAX; /* finite: the kernel may be built with finite-math-only */
    }
    const int span = ng * row_read;  /* bytes of the group's heads in one slot */
    const char* kc = (const char*)k_cache + j0 * row_read;
    const char* vc = (const char*)v_cache + j0 * row_read;
    const int64_t* table = block_table + i * table_stride;
    const int64_t nchunks = (ctx + RB - 1) / RB;
    const int64_t nblocks = (ctx + bs - 1) / bs;
    const int64_t sahead = (2 * RB + bs - 1) / bs;  /* blocks whose scales are prefetched */
    /* a sliding window: the chunks before the first row's window are not walked (their
       blocks may be gone: the scheduler releases them) */
    const int64_t first = window > 0 && ctx - ql + 1 - window > 0 ? ctx - ql + 1 - window : 0;
    const int64_t ch0 = first / RB;
    int64_t listed = ch0;  /* chunks listed so far */
    int64_t blk = ch0 * RB / bs;  /* where the next row to list lies: block index, offset */
    int off = (int)(ch0 * RB % bs);
    for (int64_t ch = ch0; ch < nchunks; ++ch) {
      for (; listed < nchunks && listed <= ch + AHEAD; ++listed) {
        const int e = (int)(listed & (RING - 1));
        list_chunk(QUANT, RB, sahead, listed, ctx, first, table, bs, kc, vc, row_bytes, span,
                   k_scale, v_scale, kvh, j0, ng, nblocks, kr[e], vr[e], &ks[e][0][0],
                   &vs[e][0][0], &blk, &off);
      }
      if (ch == (nchunks - 2 > ch0 ? nchunks - 2 : ch0) && item + ng < item_end)
        prefetch_group_start(k_cache, v_cache, block_table, table_stride, ctx_len, item, ng,
                             item_end, kvh, bs, row_read, row_bytes, 2 * RB);
      const int cur = (int)(ch & (RING - 1));
      const int nxt = ch + 1 < nchunks ? (int)((ch + 1) & (RING - 1)) : -1;
      const int64_t t0 = ch * RB;
      const int nr = (int)(ctx - t0 < RB ? ctx - t0 : RB);
      for (int jj = 0; jj < ng; ++jj) {
        const int64_t hoff = (int64_t)jj * row_read;
        const int ab = jj * nq, ae = ab + nq;  /* this head's query vectors */
        for (int a0 = ab; a0 < ae; a0 += HT) {
          const int nh = ae - a0 < HT ? ae - a0 : HT;
          __m256 S[HT];
          TILE_SWITCH(nh, scores_tile(MODE, NH, kr[cur], hoff,
                                      (const float (*)[QROW])qs + a0, nvec, S,
                                      a0 == ab && nxt >= 0 ? kr[nxt] : 0, row_read))
          for (int h = 0; h < nh; ++h) {
            const int a = a0 + h;
            const int64_t lv = lim[a] - t0;
            const int valid = (int)(lv > nr ? nr : lv);
            const int64_t skip = lo[a] - t0;  /* leading rows before this row's window */
            if (valid <= 0 || skip >= valid) {  /* this query row sees none of the chunk */
              corr[a] = 1.f;
              _mm256_store_ps(p[a], _mm256_setzero_ps());
              continue;
            }
            __m256 vm = _mm256_cmp_ps(iota, _mm256_set1_ps((float)valid), _CMP_LT_OQ);
            if (skip > 0)
              vm = _mm256_and_ps(vm, _mm256_cmp_ps(iota, _mm256_set1_ps((float)skip), _CMP_GE_OQ));
            __m256 s = S[h];
            if (QUANT) s = _mm256_mul_ps(s, _mm256_load_ps(ks[cur][jj]));
            float cr = 1.f;
            const __m256 over = _mm256_and_ps(
                vm, _mm256_cmp_ps(s, _mm256_set1_ps(m[a] + RESCALE_SLACK), _CMP_GT_OQ));
            if (!_mm256_testz_ps(over, over)) {
              const float bm = hmax8(_mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), s, vm));
              cr = _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[a] - bm)));  /* ~0 the 1st time */
              m[a] = bm;
            }
            __m256 e = _mm256_and_ps(vm, exp8(_mm256_sub_ps(s, _mm256_set1_ps(m[a]))));
            lsum[a] = _mm256_fmadd_ps(lsum[a], _mm256_set1_ps(cr), e);
            if (QUANT) e = _mm256_mul_ps(e, _mm256_load_ps(vs[cur][jj]));  /* V row scales */
            _mm256_store_ps(p[a], e);
            corr[a] = cr;
          }
        }
        for (int a0 = ab; a0 < ae; a0 += HT) {
          const int nh = ae - a0 < HT ? ae - a0 : HT;
          TILE_SWITCH(nh, values_all(MODE, NH, vr[cur], hoff, nr,
                                     (const float (*)[RB])p + a0, corr + a0, acc + a0, nvec,
                                     a0 == ab && nxt >= 0 ? vr[nxt] : 0, row_read))
        }
      }
    }
    for (int a = 0; a < ng * nq; ++a) {
      const int jj = a / nq, gi = a % nq / ql, r = a % ql;
      const int64_t at = (q_start[i] + r) * out_row_stride + ((j0 + jj) * g + gi) * d;
      const __m256 inv = _mm256_set1_ps(norm_factor(hsum8(lsum[a]), m[a], sinks,
                                                    (j0 + jj) * g + gi));
      for (int c = 0; c < nvec; ++c) {
        const __m256 o = _mm256_mul_ps(_mm256_load_ps(acc[a] + 8 * c), inv);
        if (QB) {
          float tmp[8];
          _mm256_storeu_ps(tmp, o);
          for (int x = 0; x < 8; ++x) ((unsigned short*)out)[at + 8 * c + x] = bf16_round(tmp[x]);
        } else {
          _mm256_storeu_ps((float*)out + at + 8 * c, o);
        }
      }
    }
    item += ng;
  }
  return 0;
}

#else

/* Without AVX-512: 8 floats in one register on AVX (two on SSE/NEON): GCC and Clang vector
   extensions, so the loops below are vectorised on any target without intrinsics.
   memcpy = unaligned. */
/* v8 passes by value between static functions only, never across the library's
   interface, so GCC's note that its ABI differs without AVX does not apply */
#pragma GCC diagnostic ignored "-Wpsabi"
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
#define VECTOR_WIDTH 8
#define LOADK(ptr, x) \
  (MODE == 1 ? ldq8((const signed char*)(ptr) + (x)) \
   : MODE == 2 ? ldb8((const unsigned short*)(ptr) + (x)) : ld8((const float*)(ptr) + (x)))
static inline __attribute__((always_inline)) int attention_body(
    const int MODE, const int QB, const int DOT,
    const void* q, int64_t q_row_stride, int64_t q_head_stride,
    const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    void* out, int64_t out_row_stride,
    int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale, int64_t window, const float* sinks) {
  (void)DOT;  /* vdpbf16ps scores are the AVX-512 path's */
  const int QUANT = MODE == 1;
  const int64_t esize = MODE == 1 ? 1 : MODE == 2 ? 2 : 4;
  if (d > MAXD || bs > MAXBS || d % 8 != 0) return -1;
  float m[MAXQV], l[MAXQV];
  float s[MAXQV][MAXBS];
  float qs[MAXQV][MAXD];
  float acc[MAXQV][MAXD];
  int64_t lim[MAXQV], lo[MAXQV];
  const int64_t tok_stride = (int64_t)kvh * d;
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t i = item / kvh, j = item % kvh;
    const int ql = (int)q_len[i];
    const int nq = g * ql;
    if (nq > MAXQV) return -2;
    const int64_t ctx = ctx_len[i];
    for (int a = 0; a < nq; ++a) {
      const int gi = a / ql, r = a % ql;
      const char* src = (const char*)q + ((q_start[i] + r) * q_row_stride
                         + (j * g + gi) * q_head_stride) * (QB ? 2 : 4);
      for (int x = 0; x < d; ++x) { qs[a][x] = QLOAD(QB, src, x) * scale; acc[a][x] = 0.f; }
      lim[a] = ctx - (ql - 1 - r);
      lo[a] = window > 0 ? lim[a] - window : 0;  /* sliding window: first key seen */
      m[a] = -FLT_MAX; /* finite: the kernel may be built with finite-math-only */
      l[a] = 0.f;
    }
    const int64_t nblocks = (ctx + bs - 1) / bs;
    /* a sliding window: the blocks before the first row's window are not read (they may
       be gone: the scheduler releases them) */
    const int64_t first = window > 0 && ctx - ql + 1 - window > 0 ? ctx - ql + 1 - window : 0;
    for (int64_t b = first / bs; b < nblocks; ++b) {
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
        /* query vectors in pairs; an odd last one pairs with itself, so every vector's
           score is summed the same way whichever vectors share the call (a verify row
           equals decoding that row alone) */
        for (int a = 0; a < nq; a += 2) {
          const int b = a + 1 < nq ? a + 1 : a;
          v8 s0 = {0}, s1 = {0};
          for (int x = 0; x < d; x += 8) {
            const v8 kv = LOADK(kr, x);
            s0 += ld8(qs[a] + x) * kv;
            s1 += ld8(qs[b] + x) * kv;
          }
          s[a][t] = hsum8(s0) * ksc;
          s[b][t] = hsum8(s1) * ksc;
        }
      }
      for (int a = 0; a < nq; ++a) {
        const int64_t lv = lim[a] - t0;
        const int valid = (int)(lv > nt ? nt : lv);
        const int t1 = lo[a] > t0 ? (int)(lo[a] - t0) : 0;  /* first row in the window */
        if (valid <= t1) continue;
        float* sa = s[a];
        float bm = m[a];
        for (int t = t1; t < valid; ++t) bm = sa[t] > bm ? sa[t] : bm;
        const float corr = expf(m[a] - bm); /* 0 on the first block */
        for (int t = t1; t < valid; ++t) sa[t] -= bm;
        exp_inplace(sa + t1, valid - t1);
        float psum = 0.f;
        for (int t = t1; t < valid; ++t) psum += sa[t];
        l[a] = l[a] * corr + psum;
        m[a] = bm;
        if (QUANT)  /* fold each value row's scale into its weight */
          for (int t = t1; t < valid; ++t) sa[t] *= vsb[t * kvh];
        float* ac = acc[a];
        int x = 0;
        for (; x + 32 <= d; x += 32) {
          v8 c0 = ld8(ac + x) * corr, c1 = ld8(ac + x + 8) * corr;
          v8 c2 = ld8(ac + x + 16) * corr, c3 = ld8(ac + x + 24) * corr;
          for (int t = t1; t < valid; ++t) {
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
          for (int t = t1; t < valid; ++t) c0 += sa[t] * LOADK(vb + t * tok_stride * esize, x);
          st8(ac + x, c0);
        }
      }
    }
    for (int a = 0; a < nq; ++a) {
      const int gi = a / ql, r = a % ql;
      const int64_t at = (q_start[i] + r) * out_row_stride + (j * g + gi) * d;
      const float inv = norm_factor(l[a], m[a], sinks, j * g + gi);
      for (int x = 0; x < d; ++x) {
        if (QB) ((unsigned short*)out)[at + x] = bf16_round(acc[a][x] * inv);
        else ((float*)out)[at + x] = acc[a][x] * inv;
      }
    }
  }
  return 0;
}

#endif

/* ---------------------------------------------------------------------------------------
   Causal prefill attention over the paged cache. A work item is (sequence, KV head, first
   query row of a tile): up to PLANES query vectors, the tile's rows times the g query
   heads of that KV head (lane a = row a / g, head a % g), attend to cache positions
   [0, position of their row]. The work list gives the tiles. Keys are taken PKC at a time, with an online softmax per
   lane in float32. q and out are float32 or bfloat16 (read and written as such), K/V
   float32 or bfloat16. */
#define PLANES 64  /* query vectors per tile */
#define PKC 32     /* keys per chunk */

#if KERNEL_PATH == 2
/* AVX-512: the tile's query vectors lie across the lanes (16 per register, up to PNA
   registers), so both products are rank-1 updates with a broadcast operand and nothing is
   transposed on the hot path: scores S^T[key][lane] += K[key][x] * Q^T[x][lane] (PKR keys
   x NA registers of accumulators, K broadcast from its row), then, after the softmax,
   O^T[x][lane] += V[key][x] * P^T[key][lane] (PXR channels x NA registers). The softmax
   itself runs down the key axis, one register per 16 lanes: no horizontal reductions.
   With bfloat16 q and K (and AVX512_BF16) the scores come from vdpbf16ps, two channels
   per instruction, K pairs broadcast straight from the cache (exact: a product of two
   bfloat16 is exact in float32, and the sums are float32). */
#define PNA (PLANES / 16)
#define PKR 4  /* keys per score micro-tile */
#define PXR 4  /* channels per value micro-tile */

#define NA_SWITCH(na, call)                    \
  switch (na) {                                \
    case 1: { const int NA = 1; call; } break; \
    case 2: { const int NA = 2; call; } break; \
    case 3: { const int NA = 3; call; } break; \
    default: { const int NA = 4; call; } break; \
  }

/* ST[r][lanes] = Q^T . K row r, r < PKR. DOT = 0: K rows float32, QT float32 [x][lane];
   DOT = 1: K rows bfloat16, QT holds channel pairs [x / 2][lane] as 32 bits */
static inline __attribute__((always_inline)) void prefill_scores(
    const int DOT, const int NA, const char* const* kr, const float (*QT)[PLANES], int d,
    float (*ST)[PLANES]) {
  __m512 acc[PKR][PNA];
  UNROLL for (int r = 0; r < PKR; ++r)
    UNROLL for (int v = 0; v < NA; ++v) acc[r][v] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if (DOT) {
    for (int x = 0; x < d; x += 2) {
      __m512i qv[PNA];
      UNROLL for (int v = 0; v < NA; ++v)
        qv[v] = _mm512_load_si512((const void*)(QT[x / 2] + 16 * v));
      UNROLL for (int r = 0; r < PKR; ++r) {
        int32_t pair;
        memcpy(&pair, kr[r] + 2 * x, 4);
        const __m512i kb = _mm512_set1_epi32(pair);
        UNROLL for (int v = 0; v < NA; ++v)
          acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)qv[v], (__m512bh)kb);
      }
    }
  } else
#endif
  {
    (void)DOT;
    for (int x = 0; x < d; ++x) {
      __m512 qv[PNA];
      UNROLL for (int v = 0; v < NA; ++v) qv[v] = _mm512_load_ps(QT[x] + 16 * v);
      UNROLL for (int r = 0; r < PKR; ++r) {
        const __m512 kb = _mm512_set1_ps(((const float*)kr[r])[x]);
        UNROLL for (int v = 0; v < NA; ++v) acc[r][v] = _mm512_fmadd_ps(kb, qv[v], acc[r][v]);
      }
    }
  }
  UNROLL for (int r = 0; r < PKR; ++r)
    UNROLL for (int v = 0; v < NA; ++v) _mm512_store_ps(ST[r] + 16 * v, acc[r][v]);
}

/* OT[x0 + c][lanes] = OT * corr + sum over keys t < nk of V row t [x0 + c] * PT[t][lanes],
   c < PXR; V rows float32 */
static inline __attribute__((always_inline)) void prefill_values(
    const int NA, const float* const* vr, int nk, const float (*PT)[PLANES],
    const __m512* corr, float (*OT)[PLANES], int x0) {
  __m512 acc[PXR][PNA];
  UNROLL for (int c = 0; c < PXR; ++c)
    UNROLL for (int v = 0; v < NA; ++v)
      acc[c][v] = _mm512_mul_ps(_mm512_load_ps(OT[x0 + c] + 16 * v), corr[v]);
  for (int t = 0; t < nk; ++t) {
    __m512 pv[PNA];
    UNROLL for (int v = 0; v < NA; ++v) pv[v] = _mm512_load_ps(PT[t] + 16 * v);
    const float* row = vr[t] + x0;
    UNROLL for (int c = 0; c < PXR; ++c) {
      const __m512 vb = _mm512_set1_ps(row[c]);
      UNROLL for (int v = 0; v < NA; ++v) acc[c][v] = _mm512_fmadd_ps(vb, pv[v], acc[c][v]);
    }
  }
  UNROLL for (int c = 0; c < PXR; ++c)
    UNROLL for (int v = 0; v < NA; ++v) _mm512_store_ps(OT[x0 + c] + 16 * v, acc[c][v]);
}

#if defined(__AVX512BF16__)
/* prefill_values for bfloat16 V with DOT: keys in pairs, as the decode path's
   values_tile_dot: VP[t / 2] holds V rows t and t + 1 channel-interleaved by
   unpacklo/hi_epi16 (so its positions are channels in pair_position's order), PP[t / 2]
   the pair's softmax weights rounded to bfloat16 per lane, and one vdpbf16ps adds both
   keys' products. OT rows are positions, not channels, until the output. */
static inline __attribute__((always_inline)) void prefill_values_dot(
    const int NA, const uint32_t (*VP)[MAXD], int npairs, const __m512i (*PP)[PNA],
    const __m512* corr, float (*OT)[PLANES], int x0) {
  __m512 acc[PXR][PNA];
  UNROLL for (int c = 0; c < PXR; ++c)
    UNROLL for (int v = 0; v < NA; ++v)
      acc[c][v] = _mm512_mul_ps(_mm512_load_ps(OT[x0 + c] + 16 * v), corr[v]);
  for (int tp = 0; tp < npairs; ++tp) {
    __m512i pv[PNA];
    UNROLL for (int v = 0; v < NA; ++v) pv[v] = PP[tp][v];
    UNROLL for (int c = 0; c < PXR; ++c) {
      const __m512i vb = _mm512_set1_epi32((int)VP[tp][x0 + c]);
      UNROLL for (int v = 0; v < NA; ++v)
        acc[c][v] = _mm512_dpbf16_ps(acc[c][v], (__m512bh)pv[v], (__m512bh)vb);
    }
  }
  UNROLL for (int c = 0; c < PXR; ++c)
    UNROLL for (int v = 0; v < NA; ++v) _mm512_store_ps(OT[x0 + c] + 16 * v, acc[c][v]);
}
#endif

/* where channel x of a head lies after unpacklo/hi_epi16 of 32-channel groups: [0-3, 8-11,
   16-19, 24-27 | 4-7, 12-15, 20-23, 28-31] */
static inline int pair_position(int x) {
  const int c = x & 31, lane = c >> 3, k = c & 7;
  return (x & ~31) + (k < 4 ? 4 * lane + k : 16 + 4 * lane + k - 4);
}

/* The lanes (rows at positions pos) that see key `key`: key <= pos and, with a sliding
   window, key > pos - window */
static inline __mmask16 visible16(__m512i pos, int64_t key, int64_t window) {
  const __mmask16 causal = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32((int)key));
  if (window <= 0) return causal;
  return causal & _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int)(key + window)), pos);
}

/* MODE: K/V storage (0 float32, 2 bfloat16); DOT: scores by vdpbf16ps (bfloat16 q and
   K/V, AVX512_BF16 compiled in), and P V too (P rounded to bfloat16) */
static inline __attribute__((always_inline)) int prefill_body(
    const int MODE, const int DOT,
    const void* q, int64_t q_row_stride, int64_t q_head_stride, int q_bf16,
    const void* k_cache, const void* v_cache,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    void* out, int64_t out_row_stride, int out_bf16,
    const int64_t* work, int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale, int64_t window, const float* sinks) {
  const int64_t esize = MODE == 2 ? 2 : 4;
  if (d > MAXD || bs > MAXBS || d % 8 != 0) return -1;
  const int row_read = (int)(d * esize);
  const int64_t row_bytes = (int64_t)kvh * row_read;
  float QT[MAXD][PLANES] __attribute__((aligned(64)));
  float OT[MAXD][PLANES] __attribute__((aligned(64)));
  float ST[PKC][PLANES] __attribute__((aligned(64)));
  /* bfloat16 K/V rows of a chunk widened to float32 (K only without DOT) */
  float kbuf[PKC][MAXD] __attribute__((aligned(64)));
  float vbuf[PKC][MAXD] __attribute__((aligned(64)));
  const char* kr[PKC];
  const float* vr[PKC];
  const __mmask16 dmask_last = (__mmask16)((1u << (d % 16 ? d % 16 : 16)) - 1);
  /* DOT: V as channel-interleaved key pairs, P as bfloat16 key pairs per lane */
  const int ngrp = (d + 31) / 32, npos = DOT ? 32 * ngrp : d;  /* OT rows in use */
#if defined(__AVX512BF16__)
  uint32_t VP[PKC / 2][MAXD] __attribute__((aligned(64)));
  __m512i PP[PKC / 2][PNA];
  const __m512i interleave = _mm512_setr_epi32(  /* 16-bit lanes 0, 16, 1, 17, ... */
      0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005, 0x00160006,
      0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D,
      0x001E000E, 0x001F000F);
#endif
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t* w = work + 4 * item;
    const int64_t i = w[0], j = w[1], r0 = w[2];
    const int rows = (int)w[3];
    const int64_t ql = q_len[i], ctx = ctx_len[i];
    if (rows < 1 || rows * g > PLANES || r0 + rows > ql || ctx < ql) return -3;
    const int nq = rows * g, na = (nq + 15) / 16;
    const int64_t base = ctx - ql + r0;  /* position of the tile's first row */
    const int64_t kend = base + rows;    /* keys [kstart, kend) */
    /* a sliding window: a row at position p sees keys > p - window; the first row's
       first key is where the walk starts (earlier blocks may be gone) */
    const int64_t kstart = window > 0 && base + 1 - window > 0 ? base + 1 - window : 0;
    /* Q^T (scaled, except with DOT: scaled scores instead), padding lanes 0 */
    for (int a = 0; a < 16 * na; ++a) {
      const int64_t r = a / g, h = a % g;
      const int64_t at = (q_start[i] + r0 + r) * q_row_stride + (j * g + h) * q_head_stride;
      if (DOT) {
        const unsigned short* src = (const unsigned short*)q + at;
        for (int x = 0; x < d; x += 2) {
          const uint32_t pair = a < nq ? (uint32_t)src[x] | (uint32_t)src[x + 1] << 16 : 0u;
          memcpy(&QT[x / 2][a], &pair, 4);
        }
      } else if (q_bf16) {
        const unsigned short* src = (const unsigned short*)q + at;
        for (int x = 0; x < d; ++x) QT[x][a] = a < nq ? bf16_load(src + x) * scale : 0.f;
      } else {
        const float* src = (const float*)q + at;
        for (int x = 0; x < d; ++x) QT[x][a] = a < nq ? src[x] * scale : 0.f;
      }
    }
    __m512i pos[PNA];  /* position of each lane's row; padding lanes see what the last does */
    __m512 m[PNA], l[PNA], corr[PNA];
    for (int v = 0; v < PNA; ++v) {
      int32_t pl[16];
      for (int e = 0; e < 16; ++e) {
        const int a = 16 * v + e;
        pl[e] = (int32_t)(a < nq ? base + a / g : kend - 1);
      }
      pos[v] = _mm512_loadu_si512(pl);
      m[v] = _mm512_set1_ps(-FLT_MAX);  /* finite: the kernel may be built finite-math */
      l[v] = _mm512_setzero_ps();
    }
    for (int x = 0; x < npos; ++x)
      for (int v = 0; v < na; ++v) _mm512_store_ps(OT[x] + 16 * v, _mm512_setzero_ps());
    const char* kc = (const char*)k_cache + j * row_read;
    const char* vc = (const char*)v_cache + j * row_read;
    const int64_t* table = block_table + i * table_stride;
    for (int64_t t0 = kstart; t0 < kend; t0 += PKC) {
      const int nk = (int)(kend - t0 < PKC ? kend - t0 : PKC);
      const int nkr = (nk + PKR - 1) / PKR * PKR;  /* padding keys repeat the last, masked */
#if defined(__AVX512BF16__)
      const char* vprev = 0;  /* the V row of key t - 1 */
#endif
      for (int t = 0; t < nkr; ++t) {
        const int64_t p = t0 + (t < nk ? t : nk - 1);
        const int64_t slot = table[p / bs] * bs + p % bs;
        const char* ks = kc + slot * row_bytes;
        const char* vs = vc + slot * row_bytes;
        if (MODE == 2) {
#if defined(__AVX512BF16__)
          if (DOT && (t & 1)) {  /* rows t - 1 and t as pairs */
            const char* v0 = vprev;
            for (int c = 0; c < ngrp; ++c) {
              const __mmask32 mk = group_mask(d, c);
              const __m512i a = _mm512_maskz_loadu_epi16(mk, v0 + 64 * c);
              const __m512i b = _mm512_maskz_loadu_epi16(mk, vs + 64 * c);
              _mm512_store_si512((void*)(VP[t / 2] + 32 * c), _mm512_unpacklo_epi16(a, b));
              _mm512_store_si512((void*)(VP[t / 2] + 32 * c + 16), _mm512_unpackhi_epi16(a, b));
            }
          }
#endif
          if (t < nk) {
            for (int c = 0; c < (d + 15) / 16; ++c) {
              const __mmask16 mk = 16 * c + 16 <= d ? 0xFFFF : dmask_last;
              if (!DOT)
                _mm512_mask_storeu_ps(kbuf[t] + 16 * c, mk, load16(2, ks + 32 * c, mk));
              if (!DOT)
                _mm512_mask_storeu_ps(vbuf[t] + 16 * c, mk, load16(2, vs + 32 * c, mk));
            }
          }
          kr[t] = DOT ? ks : (const char*)kbuf[t < nk ? t : nk - 1];
          vr[t] = vbuf[t < nk ? t : nk - 1];
#if defined(__AVX512BF16__)
          vprev = vs;
#endif
        } else {
          kr[t] = ks;
          vr[t] = (const float*)vs;
        }
      }
      const int na_ = na;
      for (int t = 0; t < nkr; t += PKR)
        NA_SWITCH(na_, prefill_scores(DOT, NA, kr + t, (const float (*)[PLANES])QT, d,
                                      ST + t))
      /* the chunk reaches past some lane's row, or (window) before some lane's window */
      const int masked = t0 + nkr - 1 > base || (window > 0 && t0 < kend - window);
      for (int v = 0; v < na; ++v) {
        __m512 mx = m[v];
        for (int t = 0; t < nkr; ++t) {
          __m512 s = _mm512_load_ps(ST[t] + 16 * v);
          if (DOT) s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
          if (masked) {
            const __mmask16 vis = visible16(pos[v], t0 + t, window);
            s = _mm512_mask_blend_ps(vis, _mm512_set1_ps(-1e30f), s);
          }
          _mm512_store_ps(ST[t] + 16 * v, s);
          mx = _mm512_max_ps(mx, s);
        }
        corr[v] = exp16(_mm512_sub_ps(m[v], mx));  /* ~0 the first time */
        m[v] = mx;
        __m512 sum = _mm512_mul_ps(l[v], corr[v]);
        for (int t = 0; t < nkr; ++t) {
          __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(ST[t] + 16 * v), mx));
          if (masked) e = _mm512_maskz_mov_ps(visible16(pos[v], t0 + t, window), e);
          sum = _mm512_add_ps(sum, e);
          _mm512_store_ps(ST[t] + 16 * v, e);
        }
        l[v] = sum;
      }
#if defined(__AVX512BF16__)
      if (DOT) {
        for (int tp = 0; tp < nkr / 2; ++tp)
          for (int v = 0; v < na; ++v)
            PP[tp][v] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_load_ps(ST[2 * tp + 1] + 16 * v), _mm512_load_ps(ST[2 * tp] + 16 * v)));
        for (int x0 = 0; x0 < npos; x0 += PXR)
          NA_SWITCH(na_, prefill_values_dot(NA, (const uint32_t (*)[MAXD])VP, nkr / 2,
                                            (const __m512i (*)[PNA])PP, corr, OT, x0))
      } else
#endif
        for (int x0 = 0; x0 < d; x0 += PXR)
          NA_SWITCH(na_, prefill_values(NA, vr, nkr, (const float (*)[PLANES])ST, corr, OT,
                                        x0))
    }
    float inv[PLANES] __attribute__((aligned(64)));
    for (int v = 0; v < na; ++v)
      _mm512_store_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.f), l[v]));
    if (sinks) {
      float ml[PLANES] __attribute__((aligned(64))), ll[PLANES] __attribute__((aligned(64)));
      for (int v = 0; v < na; ++v) {
        _mm512_store_ps(ml + 16 * v, m[v]);
        _mm512_store_ps(ll + 16 * v, l[v]);
      }
      for (int a = 0; a < nq; ++a) inv[a] = norm_factor(ll[a], ml[a], sinks, j * g + a % g);
    }
    for (int a = 0; a < nq; ++a) {
      const int64_t r = a / g, h = a % g;
      const int64_t at = (q_start[i] + r0 + r) * out_row_stride + (j * g + h) * d;
      if (out_bf16) {
        unsigned short* o = (unsigned short*)out + at;
        for (int x = 0; x < d; ++x) o[x] = bf16_round(OT[DOT ? pair_position(x) : x][a] * inv[a]);
      } else {
        float* o = (float*)out + at;
        for (int x = 0; x < d; ++x) o[x] = OT[DOT ? pair_position(x) : x][a] * inv[a];
      }
    }
  }
  return 0;
}

static int prefill_dispatch(
    const void* q, int64_t q_row_stride, int64_t q_head_stride, int q_bf16,
    const void* k_cache, const void* v_cache, int cache_bf16,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    void* out, int64_t out_row_stride, int out_bf16,
    const int64_t* work, int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale, int64_t window, const float* sinks) {
#define PREFILL_ARGS q, q_row_stride, q_head_stride, q_bf16, k_cache, v_cache, block_table, \
    table_stride, q_start, q_len, ctx_len, out, out_row_stride, out_bf16, work, item_begin, \
    item_end, kvh, g, d, bs, scale, window, sinks
  if (!cache_bf16) return prefill_body(0, 0, PREFILL_ARGS);
#if defined(__AVX512BF16__)
  if (q_bf16) return prefill_body(2, 1, PREFILL_ARGS);
#endif
  return prefill_body(2, 0, PREFILL_ARGS);
#undef PREFILL_ARGS
}

#else
/* Without AVX-512: one query vector at a time against each chunk of keys, in plain loops
   the compiler vectorises (simple; the AVX-512 path is the fast one). */
static int prefill_dispatch(
    const void* q, int64_t q_row_stride, int64_t q_head_stride, int q_bf16,
    const void* k_cache, const void* v_cache, int cache_bf16,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    void* out, int64_t out_row_stride, int out_bf16,
    const int64_t* work, int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale, int64_t window, const float* sinks) {
  if (d > MAXD || bs > MAXBS || d % 8 != 0) return -1;
  const int64_t esize = cache_bf16 ? 2 : 4;
  const int64_t row_bytes = (int64_t)kvh * d * esize;
  float qs[PLANES][MAXD], acc[PLANES][MAXD];
  float kbuf[PKC][MAXD], vbuf[PKC][MAXD], s[PKC];
  float m[PLANES], l[PLANES];
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t* w = work + 4 * item;
    const int64_t i = w[0], j = w[1], r0 = w[2];
    const int rows = (int)w[3];
    const int64_t ql = q_len[i], ctx = ctx_len[i];
    if (rows < 1 || rows * g > PLANES || r0 + rows > ql || ctx < ql) return -3;
    const int nq = rows * g;
    const int64_t base = ctx - ql + r0, kend = base + rows;
    /* a sliding window: a row at position p sees keys > p - window */
    const int64_t kstart = window > 0 && base + 1 - window > 0 ? base + 1 - window : 0;
    for (int a = 0; a < nq; ++a) {
      const int64_t at = (q_start[i] + r0 + a / g) * q_row_stride
                         + (j * g + a % g) * q_head_stride;
      for (int x = 0; x < d; ++x) {
        qs[a][x] = (q_bf16 ? bf16_load((const unsigned short*)q + at + x)
                           : ((const float*)q)[at + x]) * scale;
        acc[a][x] = 0.f;
      }
      m[a] = -FLT_MAX;
      l[a] = 0.f;
    }
    const int64_t* table = block_table + i * table_stride;
    for (int64_t t0 = kstart; t0 < kend; t0 += PKC) {
      const int nk = (int)(kend - t0 < PKC ? kend - t0 : PKC);
      for (int t = 0; t < nk; ++t) {
        const int64_t p = t0 + t, slot = table[p / bs] * bs + p % bs;
        const int64_t at = slot * row_bytes + j * d * esize;
        const char* ks = (const char*)k_cache + at;
        const char* vs = (const char*)v_cache + at;
        for (int x = 0; x < d; ++x) {
          kbuf[t][x] = cache_bf16 ? bf16_load((const unsigned short*)ks + x)
                                  : ((const float*)ks)[x];
          vbuf[t][x] = cache_bf16 ? bf16_load((const unsigned short*)vs + x)
                                  : ((const float*)vs)[x];
        }
      }
      for (int a = 0; a < nq; ++a) {
        const int64_t seen = base + a / g - t0 + 1;  /* keys of the chunk this row sees */
        const int nv = (int)(seen < nk ? seen : nk);
        const int64_t skip = window > 0 ? base + a / g - window + 1 - t0 : 0;
        const int t1 = skip > 0 ? (int)skip : 0;  /* first key in this row's window */
        if (nv <= t1) continue;
        float mx = m[a];
        for (int t = t1; t < nv; ++t) {
          float dot = 0.f;
          for (int x = 0; x < d; ++x) dot += qs[a][x] * kbuf[t][x];
          s[t] = dot;
          mx = dot > mx ? dot : mx;
        }
        const float corr = expf(m[a] - mx);
        float sum = l[a] * corr;
        for (int t = t1; t < nv; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
        m[a] = mx;
        l[a] = sum;
        for (int x = 0; x < d; ++x) {
          float o = acc[a][x] * corr;
          for (int t = t1; t < nv; ++t) o += s[t] * vbuf[t][x];
          acc[a][x] = o;
        }
      }
    }
    for (int a = 0; a < nq; ++a) {
      const int64_t at = (q_start[i] + r0 + a / g) * out_row_stride + (j * g + a % g) * d;
      const float inv = norm_factor(l[a], m[a], sinks, j * g + a % g);
      for (int x = 0; x < d; ++x) {
        if (out_bf16) ((unsigned short*)out)[at + x] = bf16_round(acc[a][x] * inv);
        else ((float*)out)[at + x] = acc[a][x] * inv;
      }
    }
  }
  return 0;
}
#endif

/* Work items [item_begin, item_end) of `work` ([items, 4]: sequence, KV head, first query
   row of the tile, rows in the tile, rows * g <= PLANES). Sequence n's q_len
   new rows (flat rows q_start[n]...) sit at positions [ctx_len - q_len, ctx_len) and each
   attends to cache positions [0, its own], or with window > 0 to (its own - window, its
   own] (transformers' sliding window); `sinks`: NULL, or float32 [heads], each query
   head's attention sink (see norm_factor). q/out: [T, heads, d] float32 or bfloat16 (the
   flags), unit stride on d, out's heads d apart; K/V [blocks, bs, kvh, d], float32 or
   bfloat16. Returns 0, or < 0 for arguments out of range. */
int paged_prefill_attention(
    const void* q, int64_t q_row_stride, int64_t q_head_stride, int q_bf16,
    const void* k_cache, const void* v_cache, int cache_bf16,
    const int64_t* block_table, int64_t table_stride,
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len,
    void* out, int64_t out_row_stride, int out_bf16,
    const int64_t* work, int64_t item_begin, int64_t item_end,
    int kvh, int g, int d, int bs, float scale, int64_t window, const float* sinks) {
  return prefill_dispatch(q, q_row_stride, q_head_stride, q_bf16, k_cache, v_cache,
                          cache_bf16, block_table, table_stride, q_start, q_len, ctx_len, out,
                          out_row_stride, out_bf16, work, item_begin, item_end, kvh, g, d,
                          bs, scale, window, sinks);
}

int paged_prefill_lanes(void) { return PLANES; }

/* The decode kernel's entry points, one a K/V storage: q/out float32, or bfloat16 with
   q_bf16 (read and written as such). Returns 0, or < 0 for arguments out of range. */
#define DECODE_ARGS(...) q, q_row_stride, q_head_stride, k_cache, v_cache, __VA_ARGS__, \
    block_table, table_stride, q_start, q_len, ctx_len, out, out_row_stride, item_begin, \
    item_end, kvh, g, d, bs, scale, window, sinks
#define DECODE_NAMES q, q_row_stride, q_head_stride, q_bf16, k_cache, v_cache
#define DECODE_TAIL_NAMES block_table, table_stride, q_start, q_len, ctx_len, out, \
    out_row_stride, item_begin, item_end, kvh, g, d, bs, scale
#define DECODE_PARAMS(type) \
    const void* q, int64_t q_row_stride, int64_t q_head_stride, int q_bf16, \
    const type* k_cache, const type* v_cache
#define DECODE_TAIL \
    const int64_t* block_table, int64_t table_stride, \
    const int64_t* q_start, const int64_t* q_len, const int64_t* ctx_len, \
    void* out, int64_t out_row_stride, \
    int64_t item_begin, int64_t item_end, \
    int kvh, int g, int d, int bs, float scale

/* With window > 0 (transformers' sliding window) a row at position p sees the keys at
   positions (p - window, p]; the blocks before the first row's window are not read.
   sinks: NULL, or float32 [heads], each query head's attention sink (norm_factor). */
int paged_attention_window_f32(DECODE_PARAMS(float), DECODE_TAIL, int64_t window,
    const float* sinks) {
  if (q_bf16) return attention_body(0, 1, 0, DECODE_ARGS(0, 0));
  return attention_body(0, 0, 0, DECODE_ARGS(0, 0));
}

int paged_attention_window_bf16(DECODE_PARAMS(unsigned short), DECODE_TAIL, int64_t window,
                                const float* sinks) {
#if KERNEL_PATH == 2 && defined(__AVX512BF16__)
  if (q_bf16) return attention_body(2, 1, 1, DECODE_ARGS(0, 0));
#endif
  if (q_bf16) return attention_body(2, 1, 0, DECODE_ARGS(0, 0));
  return attention_body(2, 0, 0, DECODE_ARGS(0, 0));
}

int paged_attention_window_i8(DECODE_PARAMS(signed char), const float* k_scale,
                              const float* v_scale, DECODE_TAIL, int64_t window,
                              const float* sinks) {
  if (q_bf16) return attention_body(1, 1, 0, DECODE_ARGS(k_scale, v_scale));
  return attention_body(1, 0, 0, DECODE_ARGS(k_scale, v_scale));
}

/* The whole context (the decode stack calls these by pointer, with this signature) */
int paged_attention_f32(DECODE_PARAMS(float), DECODE_TAIL) {
  return paged_attention_window_f32(DECODE_NAMES, DECODE_TAIL_NAMES, 0, 0);
}

int paged_attention_bf16(DECODE_PARAMS(unsigned short), DECODE_TAIL) {
  return paged_attention_window_bf16(DECODE_NAMES, DECODE_TAIL_NAMES, 0, 0);
}

int paged_attention_i8(DECODE_PARAMS(signed char), const float* k_scale,
                       const float* v_scale, DECODE_TAIL) {
  return paged_attention_window_i8(DECODE_NAMES, k_scale, v_scale, DECODE_TAIL_NAMES, 0,
                                   0);
}

/* 1 when bfloat16 q with a bfloat16 cache scores by vdpbf16ps (AVX512_BF16 compiled in) */
int paged_attention_bf16_dot(void) {
#if KERNEL_PATH == 2 && defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

int paged_attention_vector_width(void) { return VECTOR_WIDTH; }
int paged_attention_path(void) { return KERNEL_PATH; }  /* 0 portable, 1 AVX2, 2 AVX-512 */
