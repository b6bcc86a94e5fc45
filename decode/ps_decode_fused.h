/* Flash-Decode as one kernel per step (issue 27): each rank computes the
 * partials of its shard of every sequence's KV cache, ships them to every
 * rank, and every rank combines them into the whole output, inside the same
 * kernel, on NCCL's device API and perseus' device library
 * (<perseus/device.cuh>). Layouts and math are ps_decode.h's.
 *
 *  - push: each block stores its record into every NVLink peer's window
 *    and counts it there (perseus_batch: one signal per batch of records);
 *    the block that writes a step's last record puts them all to each GIN
 *    peer at once (one put, its signal riding in it, per peer and step).
 *    Each rank combines from its own window.
 *  - pull: each block leaves its record in its own window and counts it for
 *    every peer; the combining blocks read the peers' records over NVLink.
 *    Every peer must be in the NVLink domain (lsaSize = ranks).
 *
 * The blocks wait for each other inside the kernel, so the grid is at most
 * what the GPU holds at once (the occupancy calculator's blocks an SM), and
 * it is launched as a plain kernel: while a step runs, no other work on the
 * GPU may hold SMs that the step's blocks need, or the resident blocks wait
 * for ever. Records go to a window of two halves used in turn, so a step
 * never overwrites records a peer may still read from the step before; that
 * needs each rank's steps to run one after another (one stream, or streams
 * ordered by events): overlapping steps read each other's counts. The
 * automatic chunk count comes from the GPU's SM count, so ranks on
 * different GPU models must pass the same `splits`. */
#ifndef PS_DECODE_FUSED_H
#define PS_DECODE_FUSED_H

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>

#include "ps_decode.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { PS_DECODE_PUSH = 0, PS_DECODE_PULL = 1 };

typedef struct ps_decode_fused ps_decode_fused_t;

/* Collective over `comm` (every rank, same arguments): the records window,
 * the device communicator and its perseus_batch resources, for shards of at
 * most `max_shard` tokens (the k, v `stride` of ps_decode_fused_step) and
 * `splits` chunks a row (0: ps_decode_splits' choice). The caller's GPU is
 * current. 0, or -1 with ps_decode_last_error() naming the bad value (a
 * shape, the mode, pull without NVLink to every peer) or the failed call. */
int ps_decode_fused_create(ncclComm_t comm, const ps_decode_config_t *cfg, int max_shard,
                           int splits, int mode, ps_decode_fused_t **out);
/* The chunks per row the operator uses. */
int ps_decode_fused_splits(const ps_decode_fused_t *f);
/* One decode step on `st`: q [B][Hq][D], this rank's shard k, v
 * [B][Hkv][stride][D] (bf16, 16-byte aligned; stride <= max_shard), n[b]
 * (device) its tokens of sequence b; out [B][Hq][D] bf16, attention over
 * the whole sequences, on every rank. Every rank calls it, in the same
 * order. 0, or -1 as above. */
int ps_decode_fused_step(ps_decode_fused_t *f, float scale, const uint16_t *q, const uint16_t *k,
                         const uint16_t *v, size_t stride, const int *n, uint16_t *out,
                         cudaStream_t st);
/* Collective: frees what create made (after the last step completed). */
void ps_decode_fused_destroy(ps_decode_fused_t *f);

#ifdef __cplusplus
}
#endif

#endif
