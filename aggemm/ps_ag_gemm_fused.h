/* AllGather+GEMM as one kernel a step (issue 27): every rank holds its
 * shard of A's rows (ps_ag_gemm_shard) and all of B, and computes all of
 * C = A x B, on NCCL's device API and perseus' device library
 * (<perseus/device.cuh>). Shapes and the reference are ps_ag_gemm.h's;
 * B comes as [N][K] (K contiguous: a linear layer's weight layout).
 *
 *  - push: a few blocks store this rank's shard into every NVLink peer's
 *    window in pieces, counted per batch; for peers beyond NVLink the shard
 *    is copied into the own window and put to each in one put, its signal
 *    riding in it.
 *  - pull: those blocks copy the shard into the own window and count it for
 *    every peer; the GEMM loads a peer's rows from its window over NVLink.
 *    Every peer must be in the NVLink domain.
 * Meanwhile the other blocks start on the tiles of C whose rows are this
 * rank's own (read from `a` itself), then go round the ranks; a tile
 * starts once every rank its rows come from delivered its whole shard.
 * Tiles are 128 x 256 on tensor cores (wgmma, in warp groups that load
 * and compute side by side: ag_gemm_tile.cuh), fp32 accumulation, C
 * rounded to bf16; the kernel is built for sm_90a, so create refuses GPUs
 * of other compute capabilities than 9.0 (H100, H200). Where the tiles are
 * fewer than half the grid (few rows: the GEMM streams B), K is split too,
 * each split's fp32 sums go to a workspace and the last one adds them into C.
 *
 * As with the decode operator (ps_decode_fused.h): blocks wait for each
 * other inside the kernel, so the grid is what the GPU holds at once and no
 * other work may hold the SMs a step needs; the window's two halves
 * alternate, so each rank's steps must run one after another (one stream,
 * or streams ordered by events), and a step ends only once every peer
 * started it. */
#ifndef PS_AG_GEMM_FUSED_H
#define PS_AG_GEMM_FUSED_H

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>

#include "ps_ag_gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { PS_AG_GEMM_PUSH = 0, PS_AG_GEMM_PULL = 1 };

typedef struct ps_ag_gemm_fused ps_ag_gemm_fused_t;

/* Collective over `comm` (every rank, same arguments; the caller's GPU is
 * current): the gathered-A window (two halves of M x K) and the device
 * communicator. K must be a multiple of 64. 0, or -1 with
 * ps_ag_gemm_last_error() naming the bad value or the failed call. */
int ps_ag_gemm_fused_create(ncclComm_t comm, const ps_ag_gemm_shape_t *s, int mode,
                            ps_ag_gemm_fused_t **out);
/* One step on `st`: a [rows of this rank's shard][K], bt [N][K], c [M][N],
 * bf16, a and bt 16-byte aligned, c 4-byte aligned. Every rank calls it, in
 * the same order. 0, or -1 as above. */
int ps_ag_gemm_fused_step(ps_ag_gemm_fused_t *f, const uint16_t *a, const uint16_t *bt, uint16_t *c,
                          cudaStream_t st);
/* Collective: frees what create made (after the last step completed). */
void ps_ag_gemm_fused_destroy(ps_ag_gemm_fused_t *f);

#ifdef __cplusplus
}
#endif

#endif
