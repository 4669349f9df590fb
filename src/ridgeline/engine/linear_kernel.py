"""A C kernel for y = x W^T (+ b) in float32 on CPU when x has a handful of rows.

A decode step of one sequence multiplies 1 row by each weight; a speculative verify
multiplies 2..8 rows. MKL's GEMM is built for the first (gemv) and for large
batches: at 8 rows all of SmolLM2-135M's matmuls take ~3x as long as at 1 row, though
memory bounds both (each weight is read once either way; 8 rows are only ~15 ms of
arithmetic). This kernel streams each weight row once, in PyTorch's [out, in] layout
as it is stored (no repacking, so in-place weight updates need nothing), and computes
the dot products of up to 8 rows of x with 3 or 4 weight rows from registers, 16 lanes
at a time (AVX-512 F). More than 8 rows go in tiles of at most 8 while the weight rows
are still in L1.

Every output is summed in the same order whatever the number of rows and the tile it
lands in (16 lane-wise partial sums over k, then one fixed reduction), so a row's result
does not depend on how many rows are multiplied with it.

Threads: the output columns are cut into chunks that threads claim from a shared
counter, so a helper that starts late takes less. The helpers are pthreads of the
library itself, started once; after a call they spin for a short while (`spin_us`)
before sleeping on a futex, so the 120 calls of a SmolLM2 forward pass reach a helper
that is already awake, and an idle engine does not hold the cores. A Python thread pool was not
an option: its hand-off (~30-60 us) is as long as a whole call here.

Built on first use like the attention kernel (`cpu_kernels.compile_library`: native flags,
cached by CPU, no -ffast-math); without AVX-512, Linux or a compiler `available()` is
False and callers keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

import torch

from ridgeline.engine import cpu_kernels

log = logging.getLogger(__name__)

#: How long (microseconds) the helper threads wait awake for the next call before they
#: sleep. The gaps between the matmuls of a forward pass are a few to tens of us.
SPIN_US = 200

SOURCE = r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX512F__)
#define UNROLL _Pragma("GCC unroll 16")
#define MT_MAX 8      /* rows of x per tile */
#define NB_WIDE 4     /* weight rows per tile for tiles of up to 6 rows of x */
#define NB_TALL 3     /* for 7 and 8 rows: 24 accumulators + 3 weight vectors + x */
#define CHUNK_UNIT 12 /* chunks are whole multiples of both tile widths */

typedef struct {
  const float* x; int64_t ldx;
  const float* w; int64_t ldw;
  const float* bias;
  float* y; int64_t ldy;
  int64_t m, n, k, chunk, nchunks;
} job_t;

/* y[m0 .. m0+MT, n0 .. n0+NB] = x rows . w rows (+ bias); MT and NB are compile-time
   constants after inlining, so acc lives in registers */
static inline __attribute__((always_inline)) void tile(const int MT, const int NB,
                                                       const job_t* j, int64_t m0,
                                                       int64_t n0) {
  __m512 acc[MT_MAX][NB_WIDE];
  UNROLL for (int a = 0; a < MT; ++a)
    UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_setzero_ps();
  const float* w = j->w + n0 * j->ldw;
  const float* x = j->x + m0 * j->ldx;
  const int64_t K = j->k, ldw = j->ldw, ldx = j->ldx;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NB_WIDE];
    UNROLL for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_ps(w + b * ldw + k);
    UNROLL for (int a = 0; a < MT; ++a) {
      const __m512 xv = _mm512_loadu_ps(x + a * ldx + k);
      UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  if (k < K) {  /* masked lanes read nothing and add 0 */
    const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[NB_WIDE];
    UNROLL for (int b = 0; b < NB; ++b) wv[b] = _mm512_maskz_loadu_ps(mask, w + b * ldw + k);
    UNROLL for (int a = 0; a < MT; ++a) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + a * ldx + k);
      UNROLL for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  UNROLL for (int a = 0; a < MT; ++a) {
    float* y = j->y + (m0 + a) * j->ldy + n0;
    UNROLL for (int b = 0; b < NB; ++b) {
      const float s = _mm512_reduce_add_ps(acc[a][b]);
      y[b] = j->bias ? s + j->bias[n0 + b] : s;
    }
  }
}

/* nb is the tile width the caller picked for its largest tile (3 or 4), or 1 */
#define CASE(MT)                                           \
  case MT:                                                 \
    if (nb == NB_WIDE) tile(MT, NB_WIDE, j, m0, n0);       \
    else if (nb == NB_TALL) tile(MT, NB_TALL, j, m0, n0);  \
    else tile(MT, 1, j, m0, n0);                           \
    break;

static void tile_any(int mt, int nb, const job_t* j, int64_t m0, int64_t n0) {
  switch (mt) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
}

/* output columns [n0, n1) for every row of x: tiles of at most MT_MAX rows, balanced,
   each over the same weight rows while they are in L1 */
static void columns(const job_t* j, int64_t n0, int64_t n1) {
  const int64_t tiles = (j->m + MT_MAX - 1) / MT_MAX;
  const int mt0 = (int)((j->m + tiles - 1) / tiles);
  const int nb = mt0 > 6 ? NB_TALL : NB_WIDE;
  int64_t n = n0;
  for (; n + nb <= n1; n += nb)
    for (int64_t m0 = 0; m0 < j->m; m0 += mt0) {
      const int mt = (int)(j->m - m0 < mt0 ? j->m - m0 : mt0);
      tile_any(mt, nb, j, m0, n);
    }
  for (; n < n1; ++n)
    for (int64_t m0 = 0; m0 < j->m; m0 += mt0)
      tile_any((int)(j->m - m0 < mt0 ? j->m - m0 : mt0), 1, j, m0, n);
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

/* y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]); rows of x, w, y at strides ldx, ldw,
   ldy (elements, unit stride within a row); up to `threads` threads (the caller and
   threads - 1 helpers). A call made while another is using the helpers runs on the
   calling thread alone. Returns 0, or -1 for bad sizes. */
int linear_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias,
               float* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int threads) {
  if (m < 1 || n < 1 || k < 1) return -1;
  job_t j = {x, ldx, w, ldw, bias, y, ldy, m, n, k, 0, 0};
  if (threads > MAX_HELPERS + 1) threads = MAX_HELPERS + 1;
  /* below ~64K multiply-adds a hand-off costs more than it saves */
  if (threads <= 1 || m * n * k < 65536 || pthread_mutex_trylock(&pool_mu) != 0) {
    columns(&j, 0, n);
    return 0;
  }
  const int nh = ensure_helpers(threads - 1);
  /* ~8 chunks a thread, so that a helper that starts late takes fewer; a multiple of
     both tile widths; not so large that the last one leaves a thread idle for long */
  int64_t chunk = (n + 8 * (nh + 1) - 1) / (8 * (nh + 1));
  chunk = (chunk + CHUNK_UNIT - 1) / CHUNK_UNIT * CHUNK_UNIT;
  if (chunk > 16 * CHUNK_UNIT) chunk = 16 * CHUNK_UNIT;
  j.chunk = chunk;
  j.nchunks = (n + chunk - 1) / chunk;
  cur = j;
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
  return 0;
}

void linear_set_spin_us(int us) { atomic_store(&spin_ns, (int64_t)us * 1000); }
int linear_kernel_supported(void) { return 1; }

#else
int linear_f32(const float* x, long ldx, const float* w, long ldw, const float* bias,
               float* y, long ldy, long m, long n, long k, int threads) { return -2; }
void linear_set_spin_us(int us) {}
int linear_kernel_supported(void) { return 0; }
#endif
"""

_FLAGS = [["-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-lpthread"]]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or "avx512f" not in cpu_kernels.cpu_flags():
        return None  # the helpers wait on futexes; the tiles need AVX-512
    target = cpu_kernels.compile_library("small_linear", SOURCE, _FLAGS)
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.linear_f32.restype = ctypes.c_int
    lib.linear_set_spin_us.argtypes = [ctypes.c_int]
    lib.linear_set_spin_us.restype = None
    lib.linear_kernel_supported.argtypes = []
    lib.linear_kernel_supported.restype = ctypes.c_int
    if not lib.linear_kernel_supported():
        return None
    lib.linear_set_spin_us(SPIN_US)
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built or run (no AVX-512, not
    Linux, no C compiler)."""
    global _lib, _tried
    if _tried:  # read without the lock: this runs on every small matmul
        return _lib
    with _lock:
        if not _tried:
            _tried = True
            _lib = _build()
    return _lib


def available() -> bool:
    return load() is not None


def set_spin_us(us: int) -> None:
    """How long the helper threads stay awake after a call (0: sleep at once)."""
    lib = load()
    if lib is not None:
        lib.linear_set_spin_us(int(us))


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 threads: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> new contiguous [M, N], float32 on CPU.

    x may have any row stride (unit stride within rows; other layouts are copied);
    weight and bias must be contiguous. threads: default torch.get_num_threads().
    Raises ValueError for shapes or dtypes it does not take (callers check first) and
    RuntimeError when the kernel is not available."""
    lib = load()
    if lib is None:
        raise RuntimeError("the small-batch linear kernel is not available here")
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]
            or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or weight.device.type != "cpu"
            or not weight.is_contiguous() or x.shape[0] < 1 or x.shape[1] < 1
            or (bias is not None and (bias.dtype != torch.float32 or bias.dim() != 1
                                      or bias.shape[0] != weight.shape[0]
                                      or not bias.is_contiguous()))):
        raise ValueError(f"small_linear takes float32 CPU x [M, K], contiguous weight [N, K] "
                         f"and bias [N]; got x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.linear_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), k,
                        bias.data_ptr() if bias is not None else None, out.data_ptr(), n,
                        m, n, k, torch.get_num_threads() if threads is None else threads)
    if rc:
        raise RuntimeError(f"small_linear kernel failed ({rc})")
    return out
