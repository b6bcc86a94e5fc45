/* moe_baseline_forward.cu: the forward of perseus' bulk-synchronous MoE
 * baseline (moe_baseline.h): NCCL collectives and cuBLAS GEMMs around a few
 * small kernels (moe_baseline_kernels.cuh), on the buffers of its object
 * (ps_moe_baseline.h).
 *
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
#include <vector>

#include "moe_baseline_kernels.cuh"
#include "ps_moe_baseline.h"

/* Grid for a warp-per-item kernel: enough blocks for n items, capped (the
 * kernels loop). */
static int bl_grid_warps(long long n)
{
  long long g = (n + PS_BL_WARPS - 1) / PS_BL_WARPS;
  return (int)std::max(1LL, std::min(g, 65535LL * 16));
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
