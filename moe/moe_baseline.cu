/* moe_baseline.cu: the bulk-synchronous baseline of perseus' MoE layer
 * (moe_baseline.h), NCCL collectives and cuBLAS GEMMs around a few small
 * kernels (moe_baseline_kernels.cuh).
 *
 * Buffers (rows of hidden bf16 unless said; T = max_tokens, k = topk,
 * P = T * min(k, L) the most rows one source sends one destination):
 *   send   [T * k] routed rows by (destination, local expert), row pos[t][i];
 *          reused as the receive buffer of the way back (stream order: the
 *          dispatch has read it by then), so token t's i-th result comes
 *          back to row pos[t][i]
 *   recv   [R * P] received rows by (source, local expert); reused for the
 *          results in the same order before they go back
 *   xe     [R * P] the same rows by (local expert, source); reused for the
 *          GEMM2 output (GEMM1 has read it by then)
 *   h13    [R * P][2F] GEMM1 output, W1 half then W3 half, fp32 (bf16 in
 *          the grouped variant); act [R * P][F] bf16
 * GEMMs (moe_baseline.h says why): GEMM1 cublasGemmEx per expert, fp32 out;
 * GEMM2 cublasGemmGroupedBatchedEx. Grouped variant: GEMM1 grouped too,
 * bf16 out. Loop variant: every GEMM per expert.
 * The host learns the counts once per forward (the synchronization) and
 * plans: per-peer send/receive rows and offsets, per-expert rows, the
 * permutation's segment table and the GEMMs' pointer arrays, which go to the
 * device in one copy. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <new>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "moe_baseline.h"
#include "moe_baseline_kernels.cuh"
#include "ps_moe_ref.h"

#define PS_BL_WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLAS workspace (Hopper: 32 MiB) */
#define PS_BL_NEV 6

struct ps_moe_baseline {
  ncclComm_t comm;
  perseus_moe_config_t cfg;
  int rank, R, L, H, F, E, k, T, dev;
  size_t P; /* rows per (source, destination), worst case */
  int grouped; /* 1: cublasGemmGroupedBatchedEx where it can; 0: cublasGemmEx per expert */
  int h_bf16;  /* 1: GEMM1 output in bf16 (grouped); 0: fp32 (cublasGemmEx per expert) */
  cublasHandle_t blas;
  cudaEvent_t ev[PS_BL_NEV];
  int have_fwd;
  /* device: one allocation */
  void *dev_mem;
  bl_bf16 *gate, *w13, *w2;   /* [E][H]; [L][2F][H]; [L][H][F] */
  float *logits;              /* [T][E] */
  int32_t *topk_idx, *pos;    /* [T][k] */
  float *topk_w;              /* [T][k] */
  int *cnt;                   /* [2][R][L]: sent to (dst, j), received from (src, j) */
  int *soff;                  /* [R][L] send offsets */
  bl_bf16 *send, *recv, *xe, *act;
  void *h13;                  /* [R * P][2F], fp32 or bf16 (h_bf16) */
  void *ws;                   /* cuBLAS workspace */
  void *d_plan;               /* ptrs [6][L], seg_exp [R*L], seg_src [R*L] */
  /* host */
  int *h_cnt;                 /* pinned [2][R][L] */
  void *h_plan;               /* pinned, the layout of d_plan */
  size_t plan_bytes;
  std::vector<size_t> s_rows, s_off, r_rows, r_off; /* [R] per peer */
  std::vector<int> m, eoff, order;                  /* [L] rows per expert, offsets, by rows */
  std::vector<int> g_m, g_n, g_k, g_lda, g_ldb, g_ldc, g_size; /* [L] per group */
  std::vector<cublasOperation_t> g_ta, g_tb;
  std::vector<float> g_alpha, g_beta;
  int ngroups, nactive;
  long long rows_in;
};

/* The reason into perseus_moe_last_error(): the call, its error, the context. */
#define BL_FAIL(rc, call, err, ...)                                                               \
  do {                                                                                            \
    char ctx_[256];                                                                               \
    snprintf(ctx_, sizeof(ctx_), __VA_ARGS__);                                                    \
    ps_moe_set_error("moe baseline: %s failed: %s (%s)", call, err, ctx_);                        \
    return rc;                                                                                    \
  } while (0)

#define BL_CUDA(call, ...)                                                                        \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) BL_FAIL(ncclUnhandledCudaError, #call, cudaGetErrorString(e_), __VA_ARGS__); \
  } while (0)

#define BL_BLAS(call, ...)                                                                        \
  do {                                                                                            \
    cublasStatus_t s_ = (call);                                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                              \
      BL_FAIL(ncclUnhandledCudaError, #call, cublasGetStatusString(s_), __VA_ARGS__);             \
  } while (0)

#define BL_NCCL(b, call, ...)                                                                     \
  do {                                                                                            \
    ncclResult_t r_ = (call);                                                                     \
    if (r_ != ncclSuccess) {                                                                      \
      char err_[320];                                                                             \
      snprintf(err_, sizeof(err_), "%s [%s]", ncclGetErrorString(r_), ncclGetLastError((b)->comm)); \
      BL_FAIL(r_, #call, err_, __VA_ARGS__);                                                      \
    }                                                                                             \
  } while (0)

/* Launch check: a launch error (configuration, no kernel image) shows now. */
#define BL_LAUNCH(name, grid, threads, fmt, ...)                                                  \
  BL_CUDA(cudaGetLastError(), "kernel %s, grid %d x %d threads, " fmt, #name, (int)(grid), (int)(threads), \
          __VA_ARGS__)

static size_t bl_align(size_t v) { return (v + 255) & ~(size_t)255; }
static size_t bl_take(size_t *at, size_t bytes)
{
  size_t o = *at;
  *at = bl_align(o + bytes);
  return o;
}

/* Where each device buffer of a baseline sits in its one allocation, for a
 * config that passed perseus_moe_check_config (which bounds every size: no
 * overflow); `h_bf16`: GEMM1's output in bf16 (grouped) or fp32. */
typedef struct {
  size_t gate, w13, w2, logits, idx, pos, w, cnt, soff, send, recv, xe, h13, act, ws, plan;
  size_t plan_bytes, total;
} bl_offsets;

static void bl_layout(int R, const perseus_moe_config_t *cfg, bool h_bf16, bl_offsets *o)
{
  const size_t E = cfg->experts, L = E / R, H = cfg->hidden, F = cfg->ffn, k = cfg->topk;
  const size_t T = cfg->max_tokens, bf = sizeof(bl_bf16);
  const size_t rows = R * T * std::min(k, L); /* received rows, worst case */
  size_t at = 0;
  o->gate = bl_take(&at, E * H * bf);
  o->w13 = bl_take(&at, L * 2 * F * H * bf), o->w2 = bl_take(&at, L * H * F * bf);
  o->logits = bl_take(&at, T * E * sizeof(float));
  o->idx = bl_take(&at, T * k * sizeof(int32_t)), o->pos = bl_take(&at, T * k * sizeof(int32_t));
  o->w = bl_take(&at, T * k * sizeof(float));
  o->cnt = bl_take(&at, 2 * R * L * sizeof(int)), o->soff = bl_take(&at, R * L * sizeof(int));
  o->send = bl_take(&at, T * k * H * bf);
  o->recv = bl_take(&at, rows * H * bf), o->xe = bl_take(&at, rows * H * bf);
  o->h13 = bl_take(&at, rows * 2 * F * (h_bf16 ? bf : sizeof(float)));
  o->act = bl_take(&at, rows * F * bf);
  o->ws = bl_take(&at, PS_BL_WORKSPACE_BYTES);
  o->plan_bytes = 6 * L * sizeof(void *) + 2 * R * L * sizeof(int);
  o->plan = bl_take(&at, o->plan_bytes);
  o->total = at;
}

extern "C" size_t ps_moe_baseline_bytes(const perseus_moe_config_t *cfg, int nranks,
                                        ps_moe_baseline_variant_t variant)
{
  if (!cfg || perseus_moe_check_config(cfg, nranks)) return 0; /* reason set */
  bl_offsets o;
  bl_layout(nranks, cfg, variant == PS_MOE_BASELINE_GROUPED, &o);
  return o.total;
}

/* Grid for a warp-per-item kernel: enough blocks for n items, capped (the
 * kernels loop). */
static int bl_grid_warps(long long n)
{
  long long g = (n + PS_BL_WARPS - 1) / PS_BL_WARPS;
  return (int)std::max(1LL, std::min(g, 65535LL * 16));
}

static ncclResult_t bl_setup(ps_moe_baseline *b, ps_moe_baseline_variant_t variant)
{
  BL_NCCL(b, ncclCommCount(b->comm, &b->R), "comm %p", (void *)b->comm);
  BL_NCCL(b, ncclCommUserRank(b->comm, &b->rank), "comm %p", (void *)b->comm);
  if (perseus_moe_check_config(&b->cfg, b->R)) return ncclInvalidArgument; /* reason set */
  int cdev = -1;
  BL_NCCL(b, ncclCommCuDevice(b->comm, &cdev), "comm %p", (void *)b->comm);
  BL_CUDA(cudaGetDevice(&b->dev), "rank %d", b->rank);
  if (cdev != b->dev) {
    ps_moe_set_error("moe baseline: the current CUDA device is %d but rank %d's communicator is on "
                     "device %d: make it current before ps_moe_baseline_create", b->dev, b->rank, cdev);
    return ncclInvalidUsage;
  }
  const int R = b->R, E = b->cfg.experts, L = E / R, H = b->cfg.hidden, F = b->cfg.ffn;
  const int k = b->cfg.topk, T = b->cfg.max_tokens;
  b->L = L, b->H = H, b->F = F, b->E = E, b->k = k, b->T = T;
  b->P = (size_t)T * (size_t)std::min(k, L);
  const size_t rows = (size_t)R * b->P; /* received rows, worst case */
  if (rows > (size_t)INT32_MAX) {
    ps_moe_set_error("moe baseline: %d ranks x %zu rows (max_tokens %d x min(topk %d, %d local experts)) "
                     "= %zu received rows in the worst case, more than %d (int row indices)",
                     R, b->P, T, k, L, rows, INT32_MAX);
    return ncclInvalidArgument;
  }
  b->grouped = variant != PS_MOE_BASELINE_LOOP;
  b->h_bf16 = variant == PS_MOE_BASELINE_GROUPED;

  bl_offsets o;
  bl_layout(R, &b->cfg, b->h_bf16, &o);
  const size_t at = o.total;
  b->plan_bytes = o.plan_bytes;
  size_t free_b = 0, total_b = 0;
  BL_CUDA(cudaMemGetInfo(&free_b, &total_b), "rank %d", b->rank);
  if (at > free_b) {
    ps_moe_set_error("moe baseline: needs %zu bytes of device memory (received rows %zu x %d hidden, "
                     "%d ffn, worst case), only %zu of %zu are free: lower max_tokens (%d) or use more ranks",
                     at, rows, H, F, free_b, total_b, T);
    return ncclInvalidArgument;
  }
  BL_CUDA(cudaMalloc(&b->dev_mem, at), "%zu bytes", at);
  BL_CUDA(cudaMemset(b->dev_mem, 0, at), "%zu bytes", at);
  char *d = (char *)b->dev_mem;
  b->gate = (bl_bf16 *)(d + o.gate), b->w13 = (bl_bf16 *)(d + o.w13), b->w2 = (bl_bf16 *)(d + o.w2);
  b->logits = (float *)(d + o.logits);
  b->topk_idx = (int32_t *)(d + o.idx), b->pos = (int32_t *)(d + o.pos), b->topk_w = (float *)(d + o.w);
  b->cnt = (int *)(d + o.cnt), b->soff = (int *)(d + o.soff);
  b->send = (bl_bf16 *)(d + o.send), b->recv = (bl_bf16 *)(d + o.recv), b->xe = (bl_bf16 *)(d + o.xe);
  b->h13 = d + o.h13, b->act = (bl_bf16 *)(d + o.act);
  b->ws = d + o.ws, b->d_plan = d + o.plan;
  BL_CUDA(cudaMallocHost((void **)&b->h_cnt, (size_t)2 * R * L * sizeof(int)), "%d x %d counts", R, L);
  BL_CUDA(cudaMallocHost(&b->h_plan, b->plan_bytes), "%zu bytes", b->plan_bytes);
  for (int i = 0; i < PS_BL_NEV; i++) BL_CUDA(cudaEventCreate(&b->ev[i]), "event %d", i);

  BL_BLAS(cublasCreate(&b->blas), "device %d", b->dev);
  /* fp32 accumulation also across split-K partial sums (bf16 outputs) */
  BL_BLAS(cublasSetMathMode(b->blas, (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                                    CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
          "device %d", b->dev);

  try {
    b->s_rows.resize(R), b->s_off.resize(R), b->r_rows.resize(R), b->r_off.resize(R);
    b->m.resize(L), b->eoff.resize(L), b->order.resize(L);
    for (auto *v : {&b->g_m, &b->g_n, &b->g_k, &b->g_lda, &b->g_ldb, &b->g_ldc, &b->g_size}) v->resize(L);
    b->g_ta.assign(L, CUBLAS_OP_T), b->g_tb.assign(L, CUBLAS_OP_N);
    b->g_alpha.assign(L, 1.f), b->g_beta.assign(L, 0.f);
  } catch (const std::bad_alloc &) {
    ps_moe_set_error("moe baseline: out of host memory for %d ranks x %d local experts", R, L);
    return ncclSystemError;
  }
  return ncclSuccess;
}

extern "C" ncclResult_t ps_moe_baseline_create(ncclComm_t comm, const perseus_moe_config_t *cfg,
                                               ps_moe_baseline_variant_t variant,
                                               ps_moe_baseline_t **out)
{
  ps_moe_clear_error();
  if (!comm || !cfg || !out) {
    ps_moe_set_error("ps_moe_baseline_create: comm %p, cfg %p, out %p: none may be NULL", (void *)comm,
                     (const void *)cfg, (void *)out);
    return ncclInvalidArgument;
  }
  if (variant != PS_MOE_BASELINE_EXACT && variant != PS_MOE_BASELINE_GROUPED &&
      variant != PS_MOE_BASELINE_LOOP) {
    ps_moe_set_error("ps_moe_baseline_create: variant %d, expected %d (exact), %d (grouped) or "
                     "%d (loop)", (int)variant, PS_MOE_BASELINE_EXACT, PS_MOE_BASELINE_GROUPED,
                     PS_MOE_BASELINE_LOOP);
    return ncclInvalidArgument;
  }
  *out = NULL;
  ps_moe_baseline *b = new (std::nothrow) ps_moe_baseline();
  if (!b) {
    ps_moe_set_error("ps_moe_baseline_create: out of host memory");
    return ncclSystemError;
  }
  b->comm = comm, b->cfg = *cfg;
  ncclResult_t rc = bl_setup(b, variant);
  if (rc != ncclSuccess) {
    char why[512];
    snprintf(why, sizeof(why), "%s", perseus_moe_last_error());
    ps_moe_baseline_destroy(b);
    ps_moe_set_error("%s", why); /* the first reason, not a cleanup's */
    return rc;
  }
  *out = b;
  return ncclSuccess;
}

extern "C" ncclResult_t ps_moe_baseline_load_weights(ps_moe_baseline_t *b, const uint16_t *gate,
                                                     const uint16_t *w1, const uint16_t *w3,
                                                     const uint16_t *w2)
{
  ps_moe_clear_error();
  if (!b || !gate || !w1 || !w3 || !w2) {
    ps_moe_set_error("ps_moe_baseline_load_weights: a NULL argument (b %p, gate %p, w1 %p, w3 %p, w2 %p)",
                     (void *)b, (const void *)gate, (const void *)w1, (const void *)w3, (const void *)w2);
    return ncclInvalidArgument;
  }
  const size_t H = (size_t)b->H, F = (size_t)b->F, bf = sizeof(uint16_t);
  BL_CUDA(cudaMemcpy(b->gate, gate, (size_t)b->E * H * bf, cudaMemcpyDefault), "gate [%d][%zu]", b->E, H);
  for (int j = 0; j < b->L; j++) { /* W1 and W3 of expert j: rows 0..F-1 and F..2F-1 of w13[j] */
    bl_bf16 *d = b->w13 + (size_t)j * 2 * F * H;
    BL_CUDA(cudaMemcpy(d, w1 + (size_t)j * F * H, F * H * bf, cudaMemcpyDefault), "w1[%d] [%zu][%zu]", j, F, H);
    BL_CUDA(cudaMemcpy(d + F * H, w3 + (size_t)j * F * H, F * H * bf, cudaMemcpyDefault), "w3[%d] [%zu][%zu]",
            j, F, H);
  }
  BL_CUDA(cudaMemcpy(b->w2, w2, (size_t)b->L * H * F * bf, cudaMemcpyDefault), "w2 [%d][%zu][%zu]", b->L, H, F);
  BL_CUDA(cudaStreamSynchronize(0), "the weight copies"); /* see perseus_moe_load_weights */
  return ncclSuccess;
}

/* The host plan from the counts (h_cnt): per-peer rows and offsets, rows per
 * expert, the segment table and the GEMM pointer arrays into h_plan. */
static ncclResult_t bl_plan(ps_moe_baseline *b, int ntokens)
{
  const int R = b->R, L = b->L;
  const int *scnt = b->h_cnt, *rcnt = b->h_cnt + (size_t)R * L;
  size_t s_tot = 0, r_tot = 0;
  for (int p = 0; p < R; p++) {
    size_t s = 0, r = 0;
    for (int j = 0; j < L; j++) {
      int sc = scnt[p * L + j], rc = rcnt[p * L + j];
      if (sc < 0 || rc < 0 || rc > b->T) {
        ps_moe_set_error("moe baseline: rank %d: bad count for rank %d, local expert %d: sent %d, received "
                         "%d (at most max_tokens %d; do all ranks use the same config?)",
                         b->rank, p, j, sc, rc, b->T);
        return ncclInvalidUsage;
      }
      s += (size_t)sc, r += (size_t)rc;
    }
    if (r > b->P) {
      ps_moe_set_error("moe baseline: rank %d receives %zu rows from rank %d, more than %zu (max_tokens x "
                       "min(topk, local experts)): do all ranks use the same config?", b->rank, r, p, b->P);
      return ncclInvalidUsage;
    }
    b->s_rows[p] = s, b->s_off[p] = s_tot, s_tot += s;
    b->r_rows[p] = r, b->r_off[p] = r_tot, r_tot += r;
  }
  if (s_tot != (size_t)ntokens * b->k) {
    ps_moe_set_error("moe baseline: rank %d routed %zu rows for %d tokens x topk %d", b->rank, s_tot, ntokens,
                     b->k);
    return ncclInternalError;
  }
  void **ptr = (void **)b->h_plan; /* [6][L] in `order` */
  int *seg_exp = (int *)(ptr + 6 * (size_t)L), *seg_src = seg_exp + (size_t)R * L;
  int acc = 0;
  for (int j = 0; j < L; j++) { /* segments (j, s) in expert-major order */
    b->eoff[j] = acc;
    for (int s = 0; s < R; s++) {
      seg_exp[j * R + s] = acc;
      acc += rcnt[s * L + j];
    }
    b->m[j] = acc - b->eoff[j];
  }
  for (int s = 0; s < R; s++) {
    int o = (int)b->r_off[s];
    for (int j = 0; j < L; j++) {
      seg_src[j * R + s] = o;
      o += rcnt[s * L + j];
    }
  }
  b->rows_in = (long long)r_tot;
  /* active experts by row count; a group per distinct count */
  int na = 0;
  for (int j = 0; j < L; j++)
    if (b->m[j] > 0) b->order[na++] = j;
  std::sort(b->order.begin(), b->order.begin() + na,
            [b](int x, int y) { return b->m[x] != b->m[y] ? b->m[x] < b->m[y] : x < y; });
  b->nactive = na, b->ngroups = 0;
  const size_t H = (size_t)b->H, F = (size_t)b->F;
  for (int i = 0; i < na; i++) {
    int j = b->order[i];
    size_t e0 = (size_t)b->eoff[j];
    ptr[0 * L + i] = b->w13 + (size_t)j * 2 * F * H; /* GEMM1: A, B, C */
    ptr[1 * L + i] = b->xe + e0 * H;
    ptr[2 * L + i] = (char *)b->h13 + e0 * 2 * F * (b->h_bf16 ? sizeof(bl_bf16) : sizeof(float));
    ptr[3 * L + i] = b->w2 + (size_t)j * H * F; /* GEMM2 */
    ptr[4 * L + i] = b->act + e0 * F;
    ptr[5 * L + i] = b->xe + e0 * H; /* the GEMM2 output reuses xe */
    if (i == 0 || b->m[j] != b->m[b->order[i - 1]]) b->g_n[b->ngroups] = b->m[j], b->g_size[b->ngroups++] = 0;
    b->g_size[b->ngroups - 1]++;
  }
  return ncclSuccess;
}

/* One expert GEMM for every active expert: row-major C[m][n] = X[m][kd] W[n][kd]^T,
 * X the expert's m rows, W its weight. cuBLAS is column-major: the row-major
 * C is the column-major n x m matrix C' = W' X' with W' = (kd x n, ld kd)^T
 * and X' = kd x m (ld kd), hence (OP_T, OP_N, n, m, kd, W, kd, X, kd, C, n).
 * which: 0 GEMM1 (W = W1|W3 [2F][H], n = 2F, kd = H, C = h13, bf16, or fp32
 * and never grouped without h_bf16), 1 GEMM2 (W = W2 [H][F], n = H, kd = F,
 * C = xe). Pointer arrays (A = W, B = X, C) at slots 3 * which .. 3 * which
 * + 2 of h_plan (host) and d_plan (device). */
static ncclResult_t bl_expert_gemm(ps_moe_baseline *b, int which)
{
  const int n = which ? b->H : 2 * b->F, kd = which ? b->F : b->H, L = b->L;
  if (b->nactive == 0) return ncclSuccess;
  const float one = 1.f, zero = 0.f;
  const cudaDataType_t ct = which == 0 && !b->h_bf16 ? CUDA_R_32F : CUDA_R_16BF;
  if (b->grouped && ct == CUDA_R_16BF) {
    const void *const *dA = (const void *const *)b->d_plan + (size_t)(3 * which) * L;
    for (int g = 0; g < b->ngroups; g++)
      b->g_m[g] = n, b->g_k[g] = kd, b->g_lda[g] = kd, b->g_ldb[g] = kd, b->g_ldc[g] = n;
    cublasStatus_t s = cublasGemmGroupedBatchedEx(
        b->blas, b->g_ta.data(), b->g_tb.data(), b->g_m.data(), b->g_n.data(), b->g_k.data(), b->g_alpha.data(),
        dA, CUDA_R_16BF, b->g_lda.data(), dA + L, CUDA_R_16BF, b->g_ldb.data(), b->g_beta.data(),
        (void *const *)(dA + 2 * L), CUDA_R_16BF, b->g_ldc.data(), b->ngroups, b->g_size.data(),
        CUBLAS_COMPUTE_32F);
    if (s == CUBLAS_STATUS_SUCCESS) return ncclSuccess;
    if (s != CUBLAS_STATUS_NOT_SUPPORTED)
      BL_FAIL(ncclUnhandledCudaError, "cublasGemmGroupedBatchedEx", cublasGetStatusString(s),
              "GEMM%d, %d groups, %d experts, n %d, k %d, bf16 in/out, fp32 compute", which + 1, b->ngroups,
              b->nactive, n, kd);
    fprintf(stderr, "perseus moe baseline: cublasGemmGroupedBatchedEx: %s for bf16 with fp32 compute; "
                    "using cublasGemmEx per expert from now on\n", cublasGetStatusString(s));
    b->grouped = 0;
  }
  void *const *hp = (void *const *)b->h_plan + (size_t)(3 * which) * L;
  for (int i = 0; i < b->nactive; i++) {
    int rows = b->m[b->order[i]];
    BL_BLAS(cublasGemmEx(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, kd, &one, hp[i], CUDA_R_16BF, kd,
                         hp[L + i], CUDA_R_16BF, kd, &zero, hp[2 * L + i], ct, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            "GEMM%d, local expert %d, %d rows, n %d, k %d", which + 1, b->order[i], rows, n, kd);
  }
  return ncclSuccess;
}

/* rows of hidden bf16 to / from every peer, one group: send[s_off[p]..] to p
 * (s_rows[p] rows), recv[r_off[p]..] from p (r_rows[p]); `flip` swaps the
 * roles of the tables (the way back). */
static ncclResult_t bl_alltoallv(ps_moe_baseline *b, const bl_bf16 *sbuf, bl_bf16 *rbuf, int flip,
                                 cudaStream_t stream)
{
  const std::vector<size_t> &so = flip ? b->r_off : b->s_off, &sr = flip ? b->r_rows : b->s_rows;
  const std::vector<size_t> &ro = flip ? b->s_off : b->r_off, &rr = flip ? b->s_rows : b->r_rows;
  const size_t H = (size_t)b->H;
  BL_NCCL(b, ncclGroupStart(), "rank %d", b->rank);
  ncclResult_t rc = ncclSuccess;
  for (int p = 0; p < b->R && rc == ncclSuccess; p++) {
    if (sr[p] && (rc = ncclSend(sbuf + so[p] * H, sr[p] * H, ncclBfloat16, p, b->comm, stream)) != ncclSuccess) {
      ps_moe_set_error("moe baseline: ncclSend failed: %s [%s] (rank %d to %d, %zu rows)", ncclGetErrorString(rc),
                       ncclGetLastError(b->comm), b->rank, p, sr[p]);
    } else if (rr[p] &&
               (rc = ncclRecv(rbuf + ro[p] * H, rr[p] * H, ncclBfloat16, p, b->comm, stream)) != ncclSuccess) {
      ps_moe_set_error("moe baseline: ncclRecv failed: %s [%s] (rank %d from %d, %zu rows)", ncclGetErrorString(rc),
                       ncclGetLastError(b->comm), b->rank, p, rr[p]);
    }
  }
  ncclResult_t re = ncclGroupEnd(); /* also after a failed call: the group must close */
  if (rc != ncclSuccess) return rc;
  BL_NCCL(b, re, "rank %d, all-to-all-v %s", b->rank, flip ? "back" : "dispatch");
  return ncclSuccess;
}

extern "C" ncclResult_t ps_moe_baseline_forward(ps_moe_baseline_t *b, const void *x, void *out, int ntokens,
                                                cudaStream_t stream)
{
  ps_moe_clear_error();
  if (!b || (ntokens > 0 && (!x || !out))) {
    ps_moe_set_error("ps_moe_baseline_forward: b %p, x %p, out %p with %d tokens", (void *)b, x, out, ntokens);
    return ncclInvalidArgument;
  }
  if (ntokens < 0 || ntokens > b->T) {
    ps_moe_set_error("ps_moe_baseline_forward: ntokens %d is outside 0..%d (max_tokens)", ntokens, b->T);
    return ncclInvalidArgument;
  }
  if (((uintptr_t)x | (uintptr_t)out) % 16) {
    ps_moe_set_error("ps_moe_baseline_forward: x %p and out %p must be 16-byte aligned", x, out);
    return ncclInvalidArgument;
  }
  const int R = b->R, L = b->L, E = b->E, H = b->H, F = b->F, k = b->k, T = ntokens;
  ncclResult_t rc;
  /* buffers and the pinned plan are reused: after the last forward, whichever stream it ran on */
  if (b->have_fwd) BL_CUDA(cudaStreamWaitEvent(stream, b->ev[PS_BL_NEV - 1], 0), "rank %d", b->rank);
  b->have_fwd = 0;
  BL_BLAS(cublasSetStream(b->blas, stream), "stream %p", (void *)stream);
  BL_BLAS(cublasSetWorkspace(b->blas, b->ws, PS_BL_WORKSPACE_BYTES), "%zu bytes", PS_BL_WORKSPACE_BYTES);

  /* route */
  BL_CUDA(cudaEventRecord(b->ev[0], stream), "rank %d", b->rank);
  BL_CUDA(cudaMemsetAsync(b->cnt, 0, (size_t)R * L * sizeof(int), stream), "%d x %d counts", R, L);
  if (T > 0) {
    const float one = 1.f, zero = 0.f;
    /* logits[T][E] = x[T][H] gate[E][H]^T: the column-major E x T matrix
     * op_T(gate, H x E) x (x, H x T) */
    BL_BLAS(cublasGemmEx(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, E, T, H, &one, b->gate, CUDA_R_16BF, H, x, CUDA_R_16BF,
                         H, &zero, b->logits, CUDA_R_32F, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "gate GEMM, %d tokens, %d experts, hidden %d", T, E, H);
    int g = bl_grid_warps(T);
    ps_bl_route<<<g, PS_BL_THREADS, 0, stream>>>(b->logits, T, E, k, b->cfg.renormalize, b->topk_idx, b->topk_w,
                                                 b->pos, b->cnt);
    BL_LAUNCH(ps_bl_route, g, PS_BL_THREADS, "%d tokens", T);
    ps_bl_offsets<<<1, PS_BL_SCAN_THREADS, 0, stream>>>(b->cnt, b->soff, E);
    BL_LAUNCH(ps_bl_offsets, 1, PS_BL_SCAN_THREADS, "%d counts", E);
    g = bl_grid_warps((long long)T * k);
    ps_bl_scatter<<<g, PS_BL_THREADS, 0, stream>>>((const bl_bf16 *)x, T, H, k, b->topk_idx, b->soff, b->pos,
                                                   b->send);
    BL_LAUNCH(ps_bl_scatter, g, PS_BL_THREADS, "%d rows", T * k);
  }
  BL_CUDA(cudaEventRecord(b->ev[1], stream), "rank %d", b->rank);

  /* dispatch: counts, the host synchronization, the plan, the rows */
  BL_NCCL(b, ncclAlltoAll(b->cnt, b->cnt + (size_t)R * L, (size_t)L, ncclInt32, b->comm, stream),
          "rank %d, %d x %d counts", b->rank, R, L);
  BL_CUDA(cudaMemcpyAsync(b->h_cnt, b->cnt, (size_t)2 * R * L * sizeof(int), cudaMemcpyDeviceToHost, stream),
          "%d x %d x 2 counts", R, L);
  BL_CUDA(cudaStreamSynchronize(stream), "rank %d, after the counts exchange", b->rank);
  if ((rc = bl_plan(b, T)) != ncclSuccess) return rc;
  BL_CUDA(cudaMemcpyAsync(b->d_plan, b->h_plan, b->plan_bytes, cudaMemcpyHostToDevice, stream), "%zu bytes",
          b->plan_bytes);
  if ((rc = bl_alltoallv(b, b->send, b->recv, 0, stream)) != ncclSuccess) return rc;
  BL_CUDA(cudaEventRecord(b->ev[2], stream), "rank %d", b->rank);

  /* experts */
  const int N = (int)b->rows_in;
  const int *seg_exp = (const int *)((void **)b->d_plan + 6 * (size_t)L), *seg_src = seg_exp + (size_t)R * L;
  if (N > 0) {
    int g = bl_grid_warps(N);
    ps_bl_permute<<<g, PS_BL_THREADS, 0, stream>>>(b->xe, b->recv, N, H, seg_exp, seg_src, R * L, 1);
    BL_LAUNCH(ps_bl_permute, g, PS_BL_THREADS, "%d rows to expert order", N);
    if ((rc = bl_expert_gemm(b, 0)) != ncclSuccess) return rc;
    long long v = (long long)N * (F / 8);
    int gs = (int)std::max(1LL, std::min((v + PS_BL_THREADS - 1) / PS_BL_THREADS, 65535LL * 16));
    if (b->h_bf16) ps_bl_silu_mul<<<gs, PS_BL_THREADS, 0, stream>>>((const bl_bf16 *)b->h13, b->act, N, F);
    else ps_bl_silu_mul<<<gs, PS_BL_THREADS, 0, stream>>>((const float *)b->h13, b->act, N, F);
    BL_LAUNCH(ps_bl_silu_mul, gs, PS_BL_THREADS, "%d rows x %d", N, F);
    if ((rc = bl_expert_gemm(b, 1)) != ncclSuccess) return rc;
  }
  BL_CUDA(cudaEventRecord(b->ev[3], stream), "rank %d", b->rank);

  /* back: results to source order (into recv), then to their owners (into send) */
  if (N > 0) {
    int g = bl_grid_warps(N);
    ps_bl_permute<<<g, PS_BL_THREADS, 0, stream>>>(b->xe, b->recv, N, H, seg_exp, seg_src, R * L, 0);
    BL_LAUNCH(ps_bl_permute, g, PS_BL_THREADS, "%d rows to source order", N);
  }
  if ((rc = bl_alltoallv(b, b->recv, b->send, 1, stream)) != ncclSuccess) return rc;
  BL_CUDA(cudaEventRecord(b->ev[4], stream), "rank %d", b->rank);

  /* combine */
  if (T > 0) {
    int g = bl_grid_warps(T);
    ps_bl_combine<<<g, PS_BL_THREADS, 0, stream>>>(b->send, b->pos, b->topk_w, T, H, k, (bl_bf16 *)out);
    BL_LAUNCH(ps_bl_combine, g, PS_BL_THREADS, "%d tokens", T);
  }
  BL_CUDA(cudaEventRecord(b->ev[5], stream), "rank %d", b->rank);
  b->have_fwd = 1;
  return ncclSuccess;
}

extern "C" ncclResult_t ps_moe_baseline_routing(ps_moe_baseline_t *b, const int32_t **expert, const float **weight)
{
  ps_moe_clear_error();
  if (!b || !expert || !weight) {
    ps_moe_set_error("ps_moe_baseline_routing: a NULL argument (b %p, expert %p, weight %p)", (void *)b,
                     (void *)expert, (void *)weight);
    return ncclInvalidArgument;
  }
  *expert = b->topk_idx, *weight = b->topk_w;
  return ncclSuccess;
}

extern "C" ncclResult_t ps_moe_baseline_times(ps_moe_baseline_t *b, ps_moe_baseline_times_t *t)
{
  ps_moe_clear_error();
  if (!b || !t) {
    ps_moe_set_error("ps_moe_baseline_times: a NULL argument (b %p, t %p)", (void *)b, (void *)t);
    return ncclInvalidArgument;
  }
  if (!b->have_fwd) {
    ps_moe_set_error("ps_moe_baseline_times: no completed forward call yet");
    return ncclInvalidUsage;
  }
  BL_CUDA(cudaEventSynchronize(b->ev[PS_BL_NEV - 1]), "rank %d", b->rank);
  float ms[PS_BL_NEV - 1], total;
  for (int i = 0; i < PS_BL_NEV - 1; i++)
    BL_CUDA(cudaEventElapsedTime(&ms[i], b->ev[i], b->ev[i + 1]), "phase %d", i);
  BL_CUDA(cudaEventElapsedTime(&total, b->ev[0], b->ev[PS_BL_NEV - 1]), "total");
  t->route_ms = ms[0], t->dispatch_ms = ms[1], t->experts_ms = ms[2], t->back_ms = ms[3], t->combine_ms = ms[4];
  t->total_ms = total;
  return ncclSuccess;
}

extern "C" ncclResult_t ps_moe_baseline_expert_stats(ps_moe_baseline_t *b, double *gemm_flops, long long *rows_in,
                                                     long long *active_experts)
{
  ps_moe_clear_error();
  if (!b) {
    ps_moe_set_error("ps_moe_baseline_expert_stats: b is NULL");
    return ncclInvalidArgument;
  }
  if (!b->have_fwd) {
    ps_moe_set_error("ps_moe_baseline_expert_stats: no completed forward call yet");
    return ncclInvalidUsage;
  }
  if (gemm_flops) *gemm_flops = 2.0 * (double)b->rows_in * 3.0 * (double)b->H * (double)b->F;
  if (rows_in) *rows_in = b->rows_in;
  if (active_experts) *active_experts = b->nactive;
  return ncclSuccess;
}

extern "C" ncclResult_t ps_moe_baseline_destroy(ps_moe_baseline_t *b)
{
  if (!b) return ncclSuccess;
  ncclResult_t rc = ncclSuccess;
  cudaError_t e;
  if (b->have_fwd && (e = cudaEventSynchronize(b->ev[PS_BL_NEV - 1])) != cudaSuccess) {
    ps_moe_set_error("moe baseline: cudaEventSynchronize (the last forward) failed: %s", cudaGetErrorString(e));
    rc = ncclUnhandledCudaError;
  }
  cublasStatus_t s;
  if (b->blas && (s = cublasDestroy(b->blas)) != CUBLAS_STATUS_SUCCESS) {
    ps_moe_set_error("moe baseline: cublasDestroy failed: %s", cublasGetStatusString(s));
    rc = ncclUnhandledCudaError;
  }
  for (int i = 0; i < PS_BL_NEV; i++)
    if (b->ev[i] && (e = cudaEventDestroy(b->ev[i])) != cudaSuccess) {
      ps_moe_set_error("moe baseline: cudaEventDestroy failed: %s", cudaGetErrorString(e));
      rc = ncclUnhandledCudaError;
    }
  void *host[2] = {b->h_cnt, b->h_plan};
  for (void *h : host)
    if (h && (e = cudaFreeHost(h)) != cudaSuccess) {
      ps_moe_set_error("moe baseline: cudaFreeHost failed: %s", cudaGetErrorString(e));
      rc = ncclUnhandledCudaError;
    }
  if (b->dev_mem && (e = cudaFree(b->dev_mem)) != cudaSuccess) {
    ps_moe_set_error("moe baseline: cudaFree failed: %s", cudaGetErrorString(e));
    rc = ncclUnhandledCudaError;
  }
  delete b;
  return rc;
}
