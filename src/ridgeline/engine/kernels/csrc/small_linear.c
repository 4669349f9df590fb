/* y = x W^T (+ b) for a handful of rows of x (AVX-512 and AVX2 variants), with its own
   thread pool: built and called by ridgeline.engine.linear_kernel. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* task(ctx, s) for s < shares on the calling thread: 0 or the first nonzero return */
static int run_serially(int (*task)(void*, int64_t), void* ctx, int64_t shares) {
  int rc = 0;
  for (int64_t s = 0; s < shares; ++s) {
    const int r = task(ctx, s);
    if (r && !rc) rc = r;
  }
  return rc;
}

/* dtype codes shared with Python */
enum { F32 = 0, BF16 = 1, I8 = 2 };

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__)
/* 32 zmm registers: up to 8 rows of x by 4 weight rows (6 rows and less) or 3 (7, 8):
   at most 24 accumulators + the weight vectors + one x vector */
#define VW 16
#define MT_MAX 8
#define NB_MAX 4
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vload_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vec vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline int nb_for(int mt) { return mt > 6 ? 3 : 4; }
#else
/* 16 ymm registers: MT x NB accumulators + NB weight vectors + one x vector <= 16 */
#define VW 8
#define MT_MAX 4
#define NB_MAX 6
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vload_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vec vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline float vsum(vec v) {  /* one fixed order: halves, pairs, neighbours */
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline int nb_for(int mt) { return mt == 1 ? 6 : mt == 2 ? 4 : 3; }
#endif
#define CHUNK_UNIT 12 /* chunks are whole multiples of every tile width */

/* a share of other work run on the pool (`linear_parallel`): 0 or an error code */
typedef int (*task_fn)(void* ctx, int64_t share);

typedef struct {
  task_fn task; void* task_ctx;  /* set: chunk c is task(task_ctx, c), no columns */
  const float* x; int64_t ldx;
  const uint16_t* xh;  /* bf16 x for the dot-product tiles (tile_dot), else NULL */
  const void* w; int64_t ldw; int wt;
  const void* scale; int scale_t;  /* int8 weights: per output channel */
  const void* bias; int bias_t;
  void* y; int64_t ldy; int yt;
  int64_t m, n, k, chunk, nchunks;
} job_t;

static inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float elem(int t, const void* p, int64_t i) {
  return t == F32 ? ((const float*)p)[i]
       : t == BF16 ? bf16_to_f32(((const uint16_t*)p)[i]) : (float)((const int8_t*)p)[i];
}

static inline __attribute__((always_inline)) vec wload(const int WT, const void* w,
                                                       int64_t i) {
  if (WT == F32) return vload((const float*)w + i);
  if (WT == BF16) return vload_bf16((const uint16_t*)w + i);
  return vload_i8((const int8_t*)w + i);
}

/* the sums s[a][b] of outputs (m0 + a, n0 + b), scaled, biased and stored (a call per
   tile, not inlined: the same rounding steps for every tile shape) */
static __attribute__((noinline)) void put(const job_t* j, int64_t m0, int64_t n0, int mt,
                                          int nb, const float s[MT_MAX][NB_MAX]) {
  float scale[NB_MAX], bias[NB_MAX];
  for (int b = 0; b < nb; ++b) {
    scale[b] = j->scale ? elem(j->scale_t, j->scale, n0 + b) : 1.f;
    bias[b] = j->bias ? elem(j->bias_t, j->bias, n0 + b) : 0.f;
  }
  for (int a = 0; a < mt; ++a)
    for (int b = 0; b < nb; ++b) {
      float v = s[a][b];
      if (j->scale) v = v * scale[b];
      if (j->bias) v = v + bias[b];
      const int64_t i = (m0 + a) * j->ldy + n0 + b;
      if (j->yt == BF16) ((uint16_t*)j->y)[i] = f32_to_bf16(v);
      else ((float*)j->y)[i] = v;
    }
}

/* y[m0 .. m0+MT, n0 .. n0+NB] = x rows . w rows: MT, NB and WT are compile-time constants
   after inlining, so acc lives in registers. Every output is VW lane-wise sums over k in
   order (the last partial vector zero-padded), then one fixed reduction, whatever tile
   it is in. */
static inline __attribute__((always_inline)) void tile(const int MT, const int NB,
                                                       const int WT, const job_t* j,
                                                       int64_t m0, int64_t n0) {
  vec acc[MT_MAX][NB_MAX];
  UNROLL for (int a = 0; a < MT; ++a)
    UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = vzero();
  const float* x = j->x + m0 * j->ldx;
  const int64_t K = j->k, ldw = j->ldw, ldx = j->ldx, w0 = n0 * ldw;
  /* the first row tile fetches the next tile's weight rows a line at a time: rows of a
     few KB are too short streams for the hardware prefetchers to ramp up (measured on
     Zen 3, int8 weights, 1 row: 1.6x faster; fetching 2 or 4 tiles ahead is no better) */
  const int ES = WT == F32 ? 4 : WT == BF16 ? 2 : 1, LINE = 64 / ES;
  const char* pf = m0 == 0 && n0 + 2 * NB <= j->n
                       ? (const char*)j->w + (w0 + NB * ldw) * ES : NULL;
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    if (pf && (k & (LINE - 1)) == 0)
      UNROLL for (int b = 0; b < NB; ++b) _mm_prefetch(pf + (b * ldw + k) * ES, _MM_HINT_T0);
    vec wv[NB_MAX];
    UNROLL for (int b = 0; b < NB; ++b) wv[b] = wload(WT, j->w, w0 + b * ldw + k);
    UNROLL for (int a = 0; a < MT; ++a) {
      const vec xv = vload(x + a * ldx + k);
      UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = vfma(xv, wv[b], acc[a][b]);
    }
  }
  if (k < K) {  /* zeros past K add nothing */
    float buf[VW];
    vec wv[NB_MAX];
    UNROLL for (int b = 0; b < NB; ++b) {
      for (int i = 0; i < VW; ++i) buf[i] = k + i < K ? elem(WT, j->w, w0 + b * ldw + k + i) : 0.f;
      wv[b] = vload(buf);
    }
    UNROLL for (int a = 0; a < MT; ++a) {
      for (int i = 0; i < VW; ++i) buf[i] = k + i < K ? x[a * ldx + k + i] : 0.f;
      const vec xv = vload(buf);
      UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = vfma(xv, wv[b], acc[a][b]);
    }
  }
  float sums[MT_MAX][NB_MAX];
  UNROLL for (int a = 0; a < MT; ++a)
    UNROLL for (int b = 0; b < NB; ++b) sums[a][b] = vsum(acc[a][b]);
  put(j, m0, n0, MT, NB, sums);
}

#if defined(__AVX512BF16__)
/* 32 int8 weights as bfloat16: exact, and the top halves of their float32 values (an
   integer of 7 bits leaves the low 16 bits of its float32 zero), so one word shuffle
   instead of a rounding conversion */
static inline __m512bh i8_to_bf16(const int8_t* p) {
  const __m512i lo = _mm512_castps_si512(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))));
  const __m512i hi = _mm512_castps_si512(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))));
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                       35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9,
                                       7, 5, 3, 1);
  return (__m512bh)_mm512_permutex2var_epi16(lo, odd, hi);
}

/* bf16 x times bf16 w where the CPU has AVX512_BF16: vdpbf16ps multiplies pairs of bf16
   exactly and adds both products to a float32 lane, 32 elements of k an instruction:
   twice the products of widening to float32 and fma, which bounds `tile` from ~4 rows.
   Every output is still summed in one order (lane-wise pairs over k, then the same
   reduction) whatever the tile, so a row's result does not depend on the rows with it.
   WT: BF16 weights as they lie, or I8 ones converted to bf16 (their scale is applied to
   the finished sums by put, as in `tile`). */
static inline __attribute__((always_inline)) void tile_dot(const int MT, const int NB,
                                                           const int WT, const job_t* j,
                                                           int64_t m0, int64_t n0) {
  __m512 acc[MT_MAX][NB_MAX];
  UNROLL for (int a = 0; a < MT; ++a)
    UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_setzero_ps();
  const uint16_t* x = j->xh + m0 * j->ldx;
  const uint16_t* w = (const uint16_t*)j->w;
  const int8_t* wq = (const int8_t*)j->w;
  const int ES = WT == I8 ? 1 : 2;
  const int64_t K = j->k, ldw = j->ldw, ldx = j->ldx, w0 = n0 * ldw;
  const char* pf = m0 == 0 && n0 + 2 * NB <= j->n
                       ? (const char*)j->w + (w0 + NB * ldw) * ES : NULL;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  /* 32 bf16 = one line: fetch the next tile's each time */
    if (pf && (WT != I8 || (k & 63) == 0))
      UNROLL for (int b = 0; b < NB; ++b) _mm_prefetch(pf + (b * ldw + k) * ES, _MM_HINT_T0);
    __m512bh wv[NB_MAX];
    UNROLL for (int b = 0; b < NB; ++b)
      wv[b] = WT == I8 ? i8_to_bf16(wq + w0 + b * ldw + k)
                       : (__m512bh)_mm512_loadu_si512((const void*)(w + w0 + b * ldw + k));
    UNROLL for (int a = 0; a < MT; ++a) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + a * ldx + k));
      UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], xv, wv[b]);
    }
  }
  if (k < K) {  /* zeros past K add nothing */
    uint16_t buf[32];
    __m512bh wv[NB_MAX];
    UNROLL for (int b = 0; b < NB; ++b) {
      for (int i = 0; i < 32; ++i)
        buf[i] = k + i >= K ? 0
               : WT == I8 ? f32_to_bf16((float)wq[w0 + b * ldw + k + i]) : w[w0 + b * ldw + k + i];
      wv[b] = (__m512bh)_mm512_loadu_si512((const void*)buf);
    }
    UNROLL for (int a = 0; a < MT; ++a) {
      for (int i = 0; i < 32; ++i) buf[i] = k + i < K ? x[a * ldx + k + i] : 0;
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)buf);
      UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], xv, wv[b]);
    }
  }
  float sums[MT_MAX][NB_MAX];
  UNROLL for (int a = 0; a < MT; ++a)
    UNROLL for (int b = 0; b < NB; ++b) sums[a][b] = _mm512_reduce_add_ps(acc[a][b]);
  put(j, m0, n0, MT, NB, sums);
}
#define TILE_DOT(MT, NB, WT) if (j->xh) { tile_dot(MT, NB, WT, j, m0, n0); break; }
#else
#define TILE_DOT(MT, NB, WT)
#endif

#define TILE_WT(MT, NB)                               \
  switch (j->wt) {                                    \
    case F32: tile(MT, NB, F32, j, m0, n0); break;    \
    case BF16:                                        \
      TILE_DOT(MT, NB, BF16)                          \
      tile(MT, NB, BF16, j, m0, n0); break;           \
    default:                                          \
      TILE_DOT(MT, NB, I8)                            \
      tile(MT, NB, I8, j, m0, n0); break;             \
  }

/* nb: nb_for(the call's tallest tile), or 1 for the columns left over */
#if VW == 16
#define CASE(MT)                                 \
  case MT:                                       \
    if (nb == 4) { TILE_WT(MT, 4) }              \
    else if (nb == 3) { TILE_WT(MT, 3) }         \
    else { TILE_WT(MT, 1) }                      \
    break;
static void tile_any(int mt, int nb, const job_t* j, int64_t m0, int64_t n0) {
  switch (mt) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
}
#else
static void tile_any(int mt, int nb, const job_t* j, int64_t m0, int64_t n0) {
  if (nb == 1) {
    switch (mt) {
      case 1: TILE_WT(1, 1) break;
      case 2: TILE_WT(2, 1) break;
      case 3: TILE_WT(3, 1) break;
      default: TILE_WT(4, 1) break;
    }
  } else if (nb == 6) {  /* only 1-row calls */
    TILE_WT(1, 6)
  } else if (nb == 4) {  /* 2-row tiles and the 1-row rest of 2k+1 rows */
    if (mt == 1) { TILE_WT(1, 4) } else { TILE_WT(2, 4) }
  } else {
    switch (mt) {
      case 1: TILE_WT(1, 3) break;
      case 2: TILE_WT(2, 3) break;
      case 3: TILE_WT(3, 3) break;
      default: TILE_WT(4, 3) break;
    }
  }
}
#endif

/* output columns [n0, n1) for every row of x: tiles of at most MT_MAX rows, balanced;
   each row tile walks the chunk's weight rows while its rows of x stay in L1 (the first
   one streams the weights from memory, the others read them from L2). Walking all row
   tiles over each weight tile instead re-read x from L2 for every 3-4 weight rows: 64 bf16
   rows took 34 ms a SmolLM2 step, now 26-29 (oneDNN: 26-27). */
static void columns(const job_t* j, int64_t n0, int64_t n1) {
  const int64_t tiles = (j->m + MT_MAX - 1) / MT_MAX;
  const int mt0 = (int)((j->m + tiles - 1) / tiles);
  const int nb = nb_for(mt0);
  const int64_t whole = n0 + (n1 - n0) / nb * nb;
  for (int64_t m0 = 0; m0 < j->m; m0 += mt0) {
    const int mt = (int)(j->m - m0 < mt0 ? j->m - m0 : mt0);
    for (int64_t n = n0; n < whole; n += nb) tile_any(mt, nb, j, m0, n);
    for (int64_t n = whole; n < n1; ++n) tile_any(mt, 1, j, m0, n);
  }
}

/* ---- the helper threads ---------------------------------------------------------- */

#define MAX_HELPERS 63
enum { IDLE = 0, PENDING = 1, RUNNING = 2 };
typedef struct {
  _Atomic uint32_t state;  /* also the futex word */
  _Atomic int sleeping;
  pthread_t thread;
  char pad[64];
} helper_t;

static helper_t helpers[MAX_HELPERS];
static int started = 0;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static job_t cur;
static _Atomic int64_t next_chunk;
static _Atomic int task_rc;  /* the first nonzero return of a task's shares */
static _Atomic int64_t spin_ns = 200000;
static int atfork_set = 0;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void claim_chunks(const job_t* j) {
  for (;;) {
    const int64_t c = atomic_fetch_add_explicit(&next_chunk, 1, memory_order_relaxed);
    if (c >= j->nchunks) return;
    if (j->task) {
      const int rc = j->task(j->task_ctx, c);
      int none = 0;
      if (rc) atomic_compare_exchange_strong(&task_rc, &none, rc);
      continue;
    }
    const int64_t n0 = c * j->chunk;
    columns(j, n0, n0 + j->chunk < j->n ? n0 + j->chunk : j->n);
  }
}

/* A helper waits for PENDING (spinning for spin_ns, then on the futex), claims the job
   by PENDING -> RUNNING and works until the chunks run out. The caller withdraws a job
   that no helper has claimed yet by PENDING -> IDLE, so it never waits for a helper
   that is still waking up. */
static void* helper_main(void* arg) {
  helper_t* h = (helper_t*)arg;
  for (;;) {
    int64_t t0 = now_ns();
    int spins = 0;
    while (atomic_load_explicit(&h->state, memory_order_acquire) != PENDING) {
      _mm_pause();
      if (++spins < 64) continue;
      spins = 0;
      if (now_ns() - t0 < atomic_load_explicit(&spin_ns, memory_order_relaxed)) continue;
      atomic_store(&h->sleeping, 1);
      syscall(SYS_futex, &h->state, FUTEX_WAIT_PRIVATE, IDLE, NULL, NULL, 0);
      atomic_store(&h->sleeping, 0);
      t0 = now_ns();
    }
    uint32_t expect = PENDING;
    if (atomic_compare_exchange_strong(&h->state, &expect, RUNNING)) {
      claim_chunks(&cur);
      atomic_store_explicit(&h->state, IDLE, memory_order_release);
    }
  }
  return NULL;
}

static void after_fork_child(void) {  /* the helpers did not survive the fork */
  started = 0;
  pthread_mutex_init(&pool_mu, NULL);
  for (int i = 0; i < MAX_HELPERS; ++i) {
    atomic_store(&helpers[i].state, IDLE);
    atomic_store(&helpers[i].sleeping, 0);
  }
}

static int ensure_helpers(int want) {
  if (!atfork_set) {
    pthread_atfork(NULL, NULL, after_fork_child);
    atfork_set = 1;
  }
  while (started < want) {
    if (pthread_create(&helpers[started].thread, NULL, helper_main, &helpers[started]) != 0)
      break;
    pthread_detach(helpers[started].thread);
    ++started;
  }
  return started < want ? started : want;
}

static void dispatch(const job_t* j, int nh);

static void run(job_t* j, int threads) {
  if (threads > MAX_HELPERS + 1) threads = MAX_HELPERS + 1;
  /* below ~64K multiply-adds a hand-off costs more than it saves */
  if (threads <= 1 || j->m * j->n * j->k < 65536 || pthread_mutex_trylock(&pool_mu) != 0) {
    columns(j, 0, j->n);
    return;
  }
  const int nh = ensure_helpers(threads - 1);
  /* ~8 chunks a thread, so that a helper that starts late takes fewer; a multiple of
     every tile width; not so large that the last one leaves a thread idle for long */
  int64_t chunk = (j->n + 8 * (nh + 1) - 1) / (8 * (nh + 1));
  chunk = (chunk + CHUNK_UNIT - 1) / CHUNK_UNIT * CHUNK_UNIT;
  if (chunk > 16 * CHUNK_UNIT) chunk = 16 * CHUNK_UNIT;
  j->chunk = chunk;
  j->nchunks = (j->n + chunk - 1) / chunk;
  dispatch(j, nh);
}

/* task(ctx, s) for every share s < shares, on the calling thread and up to threads - 1
   of the pool's helpers (already awake after a matmul), each share claimed once from the
   counter; on the calling thread alone while another call holds the pool. Returns 0 or
   the first nonzero return of a share. Lets other C code (decode_stack's attention) share
   this one pool instead of starting threads that would fight its spinning helpers. */
int linear_parallel(task_fn task, void* ctx, int64_t shares, int threads) {
  if (threads > MAX_HELPERS + 1) threads = MAX_HELPERS + 1;
  if (threads > shares) threads = (int)shares;
  if (threads <= 1 || pthread_mutex_trylock(&pool_mu) != 0)
    return run_serially(task, ctx, shares);
  const int nh = ensure_helpers(threads - 1);
  job_t j;
  memset(&j, 0, sizeof j);
  j.task = task;
  j.task_ctx = ctx;
  j.nchunks = shares;
  atomic_store(&task_rc, 0);
  dispatch(&j, nh);
  return atomic_load(&task_rc);
}

/* cur = *j on the calling thread and nh helpers, until its chunks are claimed and done;
   releases pool_mu */
static void dispatch(const job_t* j, int nh) {
  cur = *j;
  atomic_store(&next_chunk, 0);
  for (int i = 0; i < nh; ++i) {
    atomic_store(&helpers[i].state, PENDING);
    if (atomic_load(&helpers[i].sleeping))
      syscall(SYS_futex, &helpers[i].state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
  }
  claim_chunks(&cur);
  for (int i = 0; i < nh; ++i) {
    uint32_t expect = PENDING;
    if (atomic_compare_exchange_strong(&helpers[i].state, &expect, IDLE)) continue;
    while (atomic_load_explicit(&helpers[i].state, memory_order_acquire) != IDLE) _mm_pause();
  }
  pthread_mutex_unlock(&pool_mu);
}

/* y[m, n] = (sum_k x[m, k] w[n, k]) (* scale[n]) (+ bias[n]) for rows of x, w, y at
   strides ldx, ldw, ldy (elements, unit stride within a row). Dtypes: x F32 or BF16
   (widened once), w F32, BF16 or I8 (then scale, F32 or BF16, is required), bias F32 or
   BF16 or NULL, y F32 or BF16 (rounded to nearest even). Up to `threads` threads (the
   caller and threads - 1 helpers); a call made while another is using the helpers runs
   on the calling thread alone. Returns 0, -1 for bad arguments, -3 without memory. */
int linear_run(const void* x, int64_t ldx, int xt, const void* w, int64_t ldw, int wt,
               const void* scale, int scale_t, const void* bias, int bias_t, void* y,
               int64_t ldy, int yt, int64_t m, int64_t n, int64_t k, int threads) {
  if (m < 1 || n < 1 || k < 1 || ldx < k || ldw < k || ldy < n || (xt != F32 && xt != BF16)
      || (wt != F32 && wt != BF16 && wt != I8) || ((wt == I8) != (scale != NULL))
      || (scale && scale_t != F32 && scale_t != BF16) || (yt != F32 && yt != BF16)
      || (bias && bias_t != F32 && bias_t != BF16))
    return -1;
#if defined(__AVX512BF16__)
  const int dot = xt == BF16 && wt != F32;  /* tile_dot reads x as it is */
#else
  const int dot = 0;
#endif
  float* wide = NULL;
  if (xt == BF16 && !dot) {
    wide = (float*)malloc((size_t)(m * k) * sizeof(float));
    if (!wide) return -3;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i)
        wide[r * k + i] = bf16_to_f32(((const uint16_t*)x)[r * ldx + i]);
  }
  job_t j = {NULL, NULL, wide ? wide : (const float*)x, wide ? k : ldx,
             dot ? (const uint16_t*)x : NULL,
             w, ldw, wt, scale, scale_t, bias, bias_t, y, ldy, yt, m, n, k, 0, 0};
  run(&j, threads);
  free(wide);
  return 0;
}

void linear_set_spin_us(int us) { atomic_store(&spin_ns, (int64_t)us * 1000); }
int linear_vector_width(void) { return VW; }
#if defined(__AVX512BF16__)
int linear_bf16_dot(void) { return 1; }
#else
int linear_bf16_dot(void) { return 0; }
#endif

#else
int linear_run(const void* x, long ldx, int xt, const void* w, long ldw, int wt,
               const void* scale, int scale_t, const void* bias, int bias_t, void* y,
               long ldy, int yt, long m, long n, long k, int threads) { return -2; }
void linear_set_spin_us(int us) {}
int linear_parallel(int (*task)(void*, int64_t), void* ctx, int64_t shares, int threads) {
  return run_serially(task, ctx, shares);
}
int linear_vector_width(void) { return 0; }
int linear_bf16_dot(void) { return 0; }
#endif
