/* Every decoder layer of a decode pass in one call, through the other kernels' function
   pointers: built and called by ridgeline.engine.decode_stack. */
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
