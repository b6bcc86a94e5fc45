/* moe_baseline.cu: the bulk-synchronous baseline of perseus' MoE layer
 * (moe_baseline.h), its object (ps_moe_baseline.h): the buffer layout,
 * create, weights, the queries after a forward, destroy. The forward is in
 * moe_baseline_forward.cu. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <new>
#include <vector>

#include "ps_moe_baseline.h"
#include "ps_moe_entry.h"

typedef __nv_bfloat16 bl_bf16;

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
  return ps_moe_create_end(bl_setup(b, variant), b, ps_moe_baseline_destroy, out);
}

extern "C" ncclResult_t ps_moe_baseline_load_weights(ps_moe_baseline_t *b, const uint16_t *gate,
                                                     const uint16_t *w1, const uint16_t *w3,
                                                     const uint16_t *w2)
{
  ps_moe_clear_error();
  if (!ps_moe_weights_args_ok("ps_moe_baseline_load_weights", "b", b, gate, w1, w3, w2))
    return ncclInvalidArgument;
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
