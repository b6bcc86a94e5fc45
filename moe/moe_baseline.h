/* moe_baseline.h: the bulk-synchronous baseline of perseus' MoE layer
 * (internal; for benchmarks against the fused layer of include/perseus/moe.h).
 *
 * The same layer, the same math (see the top comment of perseus/moe.h), the
 * same weights, written the way a user would with NCCL and cuBLAS today:
 *   route     gate GEMM (cublasGemmEx, bf16 in, fp32 logits), a warp-per-token
 *             softmax + top-k kernel that also counts the rows per (destination,
 *             local expert), an offsets kernel, a scatter of the routed rows into
 *             a send buffer grouped by destination, then local expert;
 *   dispatch  ncclAlltoAll of the [R][L] int32 counts, a copy of them to the
 *             host and a stream synchronization (the bulk-synchronous step),
 *             then the token all-to-all-v (ncclSend/ncclRecv per peer, self
 *             included, in one group);
 *   experts   a permutation of the received rows from [source][expert] to
 *             [expert][source] order, GEMM1 (W1 and W3 stored as one
 *             [2F][H] matrix per expert; cublasGemmEx per expert, fp32
 *             output), SiLU-and-multiply into a bf16 activation, GEMM2
 *             (cublasGemmGroupedBatchedEx, one group per distinct row count,
 *             bf16 output); experts without rows skipped;
 *   back      the inverse permutation, the all-to-all-v back;
 *   combine   a warp-per-token weighted sum (fp32), bf16 out.
 *
 * GEMM1 is not grouped by default: cublasGemmGroupedBatchedEx takes bf16 A/B
 * only with a bf16 C, and rounding W1 x and W3 x to bf16 before the SiLU is
 * one rounding more than the layer's definition, enough for a few outputs
 * per forward to miss the fused layer's test tolerance (2e-2 relative +
 * 2e-2 x rms), which the fp32 output meets. The variant is chosen at create:
 *   PS_MOE_BASELINE_EXACT   GEMM1 per expert (fp32 output), GEMM2 grouped;
 *   PS_MOE_BASELINE_GROUPED GEMM1 grouped too, bf16 output, as grouped-GEMM
 *                           MoE stacks (Transformer Engine) do: one launch
 *                           for all experts instead of small serialized
 *                           GEMMs, and no host-side algorithm choice for
 *                           every new row count, but not the exact math;
 *   PS_MOE_BASELINE_LOOP    every GEMM a cublasGemmEx per expert.
 * Accumulation is fp32 throughout (reduced-precision split-K reductions are
 * disallowed).
 *
 * Every call returns ncclSuccess or an error code, the reason in
 * perseus_moe_last_error() (moe/ps_moe_ref.h). */
#ifndef PS_MOE_BASELINE_H
#define PS_MOE_BASELINE_H

#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "perseus/moe_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ps_moe_baseline ps_moe_baseline_t;

typedef enum {
  PS_MOE_BASELINE_EXACT = 0,
  PS_MOE_BASELINE_GROUPED = 1,
  PS_MOE_BASELINE_LOOP = 2
} ps_moe_baseline_variant_t;

/* Phase times of the last forward in milliseconds, from CUDA events on its
 * stream: route (gate GEMM, top-k, scatter), dispatch (counts exchange, host
 * synchronization and planning, token all-to-all-v), experts (permutation,
 * GEMM1, SiLU, GEMM2), back (inverse permutation, all-to-all-v back),
 * combine; total is from the start of route to the end of combine. */
typedef struct {
  float route_ms, dispatch_ms, experts_ms, back_ms, combine_ms, total_ms;
} ps_moe_baseline_times_t;

/* Device bytes ps_moe_baseline_create takes for cfg on nranks ranks; 0
 * (the reason set) if cfg fails perseus_moe_check_config. */
size_t ps_moe_baseline_bytes(const perseus_moe_config_t *cfg, int nranks,
                             ps_moe_baseline_variant_t variant);

/* Not collective (no NCCL call): checks cfg with perseus_moe_check_config for
 * comm's rank count, creates a cuBLAS handle and CUDA events and allocates
 * device buffers sized for max_tokens in the worst case, on the current CUDA
 * device (which must be comm's). Frees what it allocated on failure. */
ncclResult_t ps_moe_baseline_create(ncclComm_t comm, const perseus_moe_config_t *cfg,
                                    ps_moe_baseline_variant_t variant, ps_moe_baseline_t **out);

/* From host or device memory, bf16 bit patterns, the layouts of perseus_moe_load_weights:
 * gate [experts][hidden]; w1, w3 [L][ffn][hidden]; w2 [L][hidden][ffn] for
 * this rank's L = experts / nranks experts. Synchronous. */
ncclResult_t ps_moe_baseline_load_weights(ps_moe_baseline_t *b, const uint16_t *gate,
                                          const uint16_t *w1, const uint16_t *w3,
                                          const uint16_t *w2);

/* One forward of ntokens (0..max_tokens) rows: x, out device [ntokens][hidden]
 * bf16, 16-byte aligned. Collective: every rank calls it, in the same order
 * (ntokens may differ). Enqueued on `stream`, but the host waits on the
 * stream once (for the counts); on return the last phases may still run. */
ncclResult_t ps_moe_baseline_forward(ps_moe_baseline_t *b, const void *x, void *out, int ntokens,
                                     cudaStream_t stream);

/* Device pointers [max_tokens][topk] to the expert ids (int32) and weights
 * (fp32) of the last forward; valid for its first ntokens rows once it
 * completed. */
ncclResult_t ps_moe_baseline_routing(ps_moe_baseline_t *b, const int32_t **expert,
                                     const float **weight);

/* Phase times of the last forward (waits for its last event). */
ncclResult_t ps_moe_baseline_times(ps_moe_baseline_t *b, ps_moe_baseline_times_t *t);

/* Of the last forward, on this rank: the FLOPs of the expert GEMMs it ran
 * (2 * rows * 3 * hidden * ffn), the rows it received, and the local experts
 * that got at least one row. Any output pointer may be NULL. */
ncclResult_t ps_moe_baseline_expert_stats(ps_moe_baseline_t *b, double *gemm_flops,
                                          long long *rows_in, long long *active_experts);

/* Waits for the last forward, frees everything. Not collective. NULL is fine. */
ncclResult_t ps_moe_baseline_destroy(ps_moe_baseline_t *b);

#ifdef __cplusplus
}
#endif
#endif
