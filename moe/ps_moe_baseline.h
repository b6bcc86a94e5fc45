/* ps_moe_baseline.h: the object of perseus' bulk-synchronous MoE baseline
 * (moe_baseline.h) and what its two files share: moe_baseline.cu (create,
 * weights, queries, destroy) and moe_baseline_forward.cu (the forward).
 *
 * Buffers (rows of hidden bf16 unless said; T = max_tokens, k = topk,
 * P = T * min(k, L) the most rows one source sends one destination), all in
 * one device allocation:
 *   send   [T * k] routed rows by (destination, local expert), row pos[t][i];
 *          reused as the receive buffer of the way back (stream order: the
 *          dispatch has read it by then), so token t's i-th result comes
 *          back to row pos[t][i]
 *   recv   [R * P] received rows by (source, local expert); reused for the
 *          results in the same order before they go back
 *   xe     [R * P] the same rows by (local expert, source); reused for the
 *          GEMM2 output (GEMM1 has read it by then)
 *   h13    [R * P][2F] GEMM1 output, W1 half then W3 half, fp32 (bf16 in
 *          the grouped variant); act [R * P][F] bf16 */
#ifndef PS_MOE_BASELINE_OBJ_H
#define PS_MOE_BASELINE_OBJ_H

#include <stdint.h>
#include <stdio.h>

#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "moe_baseline.h"
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
  __nv_bfloat16 *gate, *w13, *w2; /* [E][H]; [L][2F][H]; [L][H][F] */
  float *logits;              /* [T][E] */
  int32_t *topk_idx, *pos;    /* [T][k] */
  float *topk_w;              /* [T][k] */
  int *cnt;                   /* [2][R][L]: sent to (dst, j), received from (src, j) */
  int *soff;                  /* [R][L] send offsets */
  __nv_bfloat16 *send, *recv, *xe, *act;
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

#endif
