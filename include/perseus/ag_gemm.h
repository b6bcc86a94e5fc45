/* perseus fused AllGather+GEMM (aggemm/, libperseus_ag_gemm.so): one kernel
 * a step gathers A's rows from every rank while the GEMM that needs them
 * runs (docs/device.md, third worked example).
 *
 * R ranks each hold a contiguous block of A's M rows (perseus_ag_gemm_shard:
 * sizes within one of each other, in rank order; a block is empty where M <
 * R) and all of B; every rank computes all of C = A x B (M x N). Values are
 * bf16 (uint16_t bit patterns, row-major), accumulated in fp32, C rounded to
 * bf16. B comes as [N][K] (K contiguous: a linear layer's weight layout).
 *
 *  - PERSEUS_AG_GEMM_PUSH: a few blocks store this rank's rows into every
 *    NVLink peer's window; for peers beyond NVLink the rows are copied into
 *    the own window and put to each in one ncclGin put, its signal riding in
 *    it.
 *  - PERSEUS_AG_GEMM_PULL: the rows are copied into the own window; the
 *    peers' GEMM reads them over NVLink. Every peer must be in the NVLink
 *    domain.
 * Meanwhile every other block computes tiles of C, this rank's own rows
 * first, each starting once the ranks its rows come from delivered them.
 * The kernel is built for sm_90a: create refuses GPUs of other compute
 * capabilities than 9.0 (H100, H200).
 *
 * Blocks wait for each other inside the kernel: the grid is what the GPU
 * holds at once, launched cooperatively (it starts once every block can be
 * resident). A step waits at most PERSEUS_AG_GEMM_TIMEOUT_MS for a rank's
 * rows (perseus_ag_gemm_check). The window's two halves alternate, so each rank's steps must run one
 * after another (one stream, or streams ordered by events).
 *
 * create is collective and compares the shape and mode across the ranks:
 * where they differ, or one rank refuses them, every rank fails (naming the
 * field), none waits for the others.
 *
 * Calls return 0, or -1 with the reason (naming the bad value and what was
 * expected, or the failed call) in perseus_ag_gemm_last_error(). */
#ifndef PERSEUS_AG_GEMM_H
#define PERSEUS_AG_GEMM_H

#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int m; /* rows of A and C over all ranks, >= 1 */
  int n; /* columns of B and C: a multiple of 8 */
  int k; /* columns of A, rows of B: a multiple of 64 */
} perseus_ag_gemm_shape_t;

enum { PERSEUS_AG_GEMM_PUSH = 0, PERSEUS_AG_GEMM_PULL = 1 };

typedef struct perseus_ag_gemm perseus_ag_gemm_t;

/* Rank `rank`'s rows of A (and of C's gathered rows) over `nranks`: [*start, *end). */
void perseus_ag_gemm_shard(int m, int nranks, int rank, int *start, int *end);

/* Collective over `comm` (every rank, same arguments; the caller's GPU is
 * current): the gathered-A window (two halves of M x K bf16), the device
 * communicator and the workspace of split K. */
int perseus_ag_gemm_create(ncclComm_t comm, const perseus_ag_gemm_shape_t *shape, int mode,
                           perseus_ag_gemm_t **out);

/* One step on `stream`: a [rows of this rank's shard][K] (NULL allowed
 * where the shard is empty), bt [N][K], c [M][N] (device memory), a and bt
 * 16-byte aligned, c 4-byte aligned. Every rank calls it, in the same order,
 * on a stream that is not capturing a CUDA graph (refused: a step's counts
 * are fixed when it is called). */
int perseus_ag_gemm_step(perseus_ag_gemm_t *op, const uint16_t *a, const uint16_t *bt, uint16_t *c,
                         cudaStream_t stream);

/* Whether every step so far ended well: 0, or -1 once a step gave up
 * waiting for a rank's rows (longer than PERSEUS_AG_GEMM_TIMEOUT_MS: the
 * rank died, skipped the step or failed in it) or was aborted; the reason
 * names the step and the rank. That step's C, and every later one's, is
 * not valid, and step refuses from then on: destroy the operator. Read
 * after the stream's steps completed (a step still running may yet fail). */
int perseus_ag_gemm_check(const perseus_ag_gemm_t *op);

/* Ends the waits of every running and later step at once (any thread, also
 * while a step runs); check then reports the abort. For a caller that
 * knows a peer is gone sooner than the timeout would tell. */
void perseus_ag_gemm_abort(perseus_ag_gemm_t *op);

/* Collective: frees what create made, after the last step completed. */
void perseus_ag_gemm_destroy(perseus_ag_gemm_t *op);

/* The reason the calling thread's last failed call gave. */
const char *perseus_ag_gemm_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
