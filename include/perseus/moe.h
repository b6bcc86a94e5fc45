/* perseus reference fused MoE layer: gate, dispatch, expert FFN and combine
 * in one persistent kernel per forward (moe/, docs/moe.md).
 *
 * The layer, per token x (a row of `hidden` bf16):
 *   logits = Wg x                          Wg: [experts][hidden]
 *   p      = softmax(logits)               (fp32)
 *   top-k experts e_1..e_k by p (ties: the lower expert id), weights
 *   w_i    = p(e_i), divided by sum_i p(e_i) when `renormalize`
 *   y_e(x) = W2_e (silu(W1_e x) * (W3_e x))  W1_e, W3_e: [ffn][hidden],
 *                                            W2_e: [hidden][ffn]
 *   out    = sum_i w_i y_{e_i}(x)           (bf16)
 * silu(a) = a / (1 + exp(-a)). Expert e lives on rank e / (experts / nranks);
 * every rank holds the gate. GEMMs take bf16 inputs with fp32 accumulation;
 * the activation is rounded to bf16 before the second GEMM.
 *
 * Every call returns ncclSuccess or an error code; the reason is logged to
 * stderr when NCCL_DEBUG is WARN, INFO or TRACE and is always available from
 * perseus_moe_last_error() on the calling thread. */
#ifndef PERSEUS_MOE_H
#define PERSEUS_MOE_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "perseus/moe_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct perseus_moe perseus_moe_t;

/* Collective over `comm` (every rank calls it with the same config): checks
 * the config (an impossible one is refused naming the value) and that every
 * rank passed the same one (a difference is refused on every rank, naming
 * the field and its range across the ranks: ncclInvalidUsage), allocates the
 * symmetric windows and the device communicator on the current CUDA device.
 * Same-node peers are reached by NVLink stores, the others by ncclGin; then
 * it also zeroes its GIN signals (NCCL may hand it a destroyed devcomm's,
 * counts included) and passes a barrier, a one-word ncclAllReduce on comm. A
 * failure on some ranks only (e.g. too little free memory on one GPU) leaves
 * the others in NCCL's collective registration: treat it as fatal for the
 * communicator, as NCCL does its own collective errors. */
ncclResult_t perseus_moe_create(ncclComm_t comm, const perseus_moe_config_t *cfg,
                                perseus_moe_t **out);

/* Loads the weights, from host or device memory, bf16 (uint16 bit patterns):
 *   gate [experts][hidden] (the same on every rank),
 *   w1, w3 [local][ffn][hidden] and w2 [local][hidden][ffn] for this rank's
 *   local = experts / nranks experts, in expert order.
 * Synchronous: returns once the weights are in place, so a forward on any
 * stream sees them. Not collective. */
ncclResult_t perseus_moe_load_weights(perseus_moe_t *m, const uint16_t *gate, const uint16_t *w1,
                                      const uint16_t *w3, const uint16_t *w2);

/* One forward of `ntokens` (0..max_tokens) rows of x [ntokens][hidden] bf16
 * in device memory into out [ntokens][hidden] bf16, enqueued on `stream`.
 * Collective: every rank calls it, in the same order (ntokens may differ).
 * No host synchronization inside, so it may be captured into a CUDA graph
 * (stream capture): each launch of that graph is then a forward of its own
 * (x, out and ntokens as captured), in the collective order like any other,
 * and launched and replayed forwards of a layer may be mixed. The layer
 * counts its forwards on the GPU. Refused (ncclInvalidUsage) until
 * perseus_moe_load_weights succeeded once.
 *
 * Faults. The layer fails, and from then on this call and
 * perseus_moe_last_profile return ncclRemoteError with the reason, when a
 * forward
 *   - gets a header (a peer's row count per expert of ours) that does not
 *     fit that peer's region of our receive window (max_tokens x min(topk,
 *     local experts) rows): its rows are dropped, and the peer is told at
 *     once (below), so its forward fails too instead of waiting;
 *   - waits longer than PERSEUS_MOE_TIMEOUT_MS (README; default 10 minutes,
 *     0: forever) for a peer's header, rows or results;
 *   - is aborted by perseus_moe_abort;
 *   - is told by a peer that the peer failed this rank (its header or rows
 *     did not come or were refused there, or the peer timed out or was
 *     aborted): every layer tells the peers it fails at once, an NVLink
 *     peer through a poisoned mark in its window, a GIN peer through a
 *     poison added to its results signal, and every wait checks for it.
 * A failed forward's kernel still ends: waits for the failed peer give up
 * (its tokens' output is not valid), waits for healthy peers go on, so the
 * results this rank owes healthy peers stay valid and theirs succeed.
 * Forwards already enqueued or replayed behind it do not wait for the
 * failed peer. The layer must then be destroyed. Peers that did not
 * fail may still put into its window after its forward ended (results of
 * rows that arrived): destroying it before their forwards end can make the
 * communicator report that put as an error; treat the communicator as NCCL
 * does after its own errors. */
ncclResult_t perseus_moe_forward(perseus_moe_t *m, const void *x, void *out, int ntokens,
                                 cudaStream_t stream);

/* The routing of the last forward, for checks: device pointers to
 * [max_tokens][topk] expert ids (int32) and weights (fp32); valid for the
 * first ntokens rows once that forward completed. */
ncclResult_t perseus_moe_routing(perseus_moe_t *m, const int32_t **expert, const float **weight);

/* Where the last forward's time went, from the GPU's global timer (phase
 * ends are the latest CTA's, so phases may overlap their neighbours), and
 * what it moved. Waits for that forward (the last one enqueued, launched or
 * replayed from a graph) to complete; ncclRemoteError (the profile filled
 * in) once a peer's header was refused (perseus_moe_forward). */
typedef struct {
  double total_us;    /* kernel start to the last CTA's end */
  double route_us;    /* gate, top-k, slots: start to the last CTA done */
  double dispatch_us; /* until every row and header of ours was issued */
  double wait_us;     /* until every peer's header was in and every CTA's rows out
                       * (64-row tiles: the first CTA to see it, while its first
                       * task's weights load) */
  double experts_us;  /* from there until the last expert task ended */
  double combine_us;  /* from there until the last token was combined */
  long long rows_out;       /* routed rows this rank sent (itself included) */
  long long rows_in;        /* rows its experts received */
  long long active_experts; /* its experts with at least one row */
  double gemm_flops;        /* of its expert GEMMs: 2 * rows_in * 3 * hidden * ffn */
  /* idle time inside the phases, from the same timer: what the experts phase
   * did not spend on GEMMs, and what combine spent waiting for results */
  double wait_rows_us;    /* expert tasks waiting for their rows to arrive, average per CTA */
  double wait_gemm1_us;   /* GEMM2 tasks waiting for their expert's GEMM1, average per CTA */
  double wait_combine_us; /* a token waiting for its experts' results, average per token */
  /* the experts phase per CTA, averages: against experts_us, how evenly the
   * CTAs shared it; their weight bytes over these, how fast tasks stream */
  double run_gemm1_us;   /* in GEMM1 tasks, past the wait for rows */
  double run_gemm2_us;   /* in GEMM2 tasks, past the wait for GEMM1 */
  double experts_end_us; /* from the phase's start to the end of the CTA's last task */
  int grid;               /* CTAs of the persistent kernel (occupancy x SMs) */
  int tile_rows;          /* rows of its GEMM tiles: 64 or 128 (PERSEUS_MOE_TILE_ROWS) */
  int wgmma;              /* 1: the GEMMs ran on wgmma (sm_90a code), 0: on mma.sync */
} perseus_moe_profile_t;

ncclResult_t perseus_moe_last_profile(perseus_moe_t *m, perseus_moe_profile_t *out);

/* Makes the layer's running and later forwards stop waiting for peers, as
 * a timeout would (perseus_moe_forward): for a peer that died or hangs,
 * without waiting for PERSEUS_MOE_TIMEOUT_MS. Any thread, any time (it
 * sets a flag in host memory the kernel reads about every 100 us while it
 * waits); the layer is failed from then on. Not collective. */
ncclResult_t perseus_moe_abort(perseus_moe_t *m);

/* Frees everything (collective: windows are deregistered). NULL is fine. */
ncclResult_t perseus_moe_destroy(perseus_moe_t *m);

#ifdef __cplusplus
}
#endif
#endif
