/* perseus fused Flash-Decode (decode/, libperseus_decode.so): split-KV
 * decode attention as one kernel per step (docs/device.md, second worked
 * example).
 *
 * Decode attention for B sequences, one new query token each: query head h
 * (of Hq) attends over its sequence's KV cache through KV head h / (Hq /
 * Hkv) (grouped-query attention), head dim D, scores scaled by `scale`. The
 * cache of a sequence is cut into R contiguous shards, one per rank
 * (perseus_decode_shard; a shard is empty where the sequence has fewer than
 * R tokens). Each rank computes its shard's partial outputs and log-sum-exp,
 * ships them to every rank, and every rank combines them into the whole
 * output, inside the same kernel.
 *
 *  - PERSEUS_DECODE_PUSH: each block stores its record into every NVLink
 *    peer's window and counts it there (one signal per batch of records);
 *    the records go to each peer beyond NVLink in one ncclGin put a step,
 *    its signal riding in it.
 *  - PERSEUS_DECODE_PULL: each block leaves its record in its own window;
 *    the peers' combining blocks read it over NVLink. Every peer must be in
 *    the NVLink domain.
 *
 * Blocks wait for each other inside the kernel: the grid is what the GPU
 * holds at once, launched cooperatively (it starts once every block can be
 * resident). A step waits at most PERSEUS_DECODE_TIMEOUT_MS for a rank's
 * records (perseus_decode_check). Records go to a window of two halves used in turn, so each rank's
 * steps must run one after another (one stream, or streams ordered by
 * events). The automatic chunk count comes from the GPU's SM count: ranks on
 * different GPU models must pass the same `splits`.
 *
 * create is collective and compares its arguments across the ranks: where
 * they differ, or one rank refuses them, every rank fails (naming the
 * field), none waits for the others.
 *
 * Calls return 0, or -1 with the reason (naming the bad value and what was
 * expected, or the failed call) in perseus_decode_last_error(). */
#ifndef PERSEUS_DECODE_H
#define PERSEUS_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int batch;       /* B: sequences per step, >= 1 */
  int q_heads;     /* Hq, a multiple of kv_heads */
  int kv_heads;    /* Hkv, >= 1 */
  int head_dim;    /* D: a multiple of 8, at most 256 */
  int max_context; /* most tokens one sequence's cache holds over all ranks, >= 1 */
} perseus_decode_config_t;

enum { PERSEUS_DECODE_PUSH = 0, PERSEUS_DECODE_PULL = 1 };

typedef struct perseus_decode perseus_decode_t;

/* Rank `rank`'s shard of a sequence of `len` tokens over `nranks`: [*start, *end). */
void perseus_decode_shard(int len, int nranks, int rank, int *start, int *end);

/* Collective over `comm` (every rank, same arguments; the caller's GPU is
 * current): the records window, the device communicator and its resources,
 * for shards of at most `max_shard` tokens (the k, v `stride` of
 * perseus_decode_step) and `splits` chunks a row (0: chosen from the GPU). */
int perseus_decode_create(ncclComm_t comm, const perseus_decode_config_t *cfg, int max_shard, int splits,
                          int mode, perseus_decode_t **out);

/* The chunks per row the operator uses. */
int perseus_decode_splits(const perseus_decode_t *op);

/* One decode step on `stream`: q [B][Hq][D], this rank's shard k, v
 * [B][Hkv][stride][D] (bf16, 16-byte aligned; stride <= max_shard), n[b]
 * (device memory) its tokens of sequence b, 0 <= n[b] <= stride (a length
 * outside that fails the step: perseus_decode_check names it); out
 * [B][Hq][D] bf16, attention over the whole sequences, on every rank. Every
 * rank calls it, in the same order, on a stream that is not capturing a
 * CUDA graph (refused: a step's counts are fixed when it is called). */
int perseus_decode_step(perseus_decode_t *op, float scale, const uint16_t *q, const uint16_t *k,
                        const uint16_t *v, size_t stride, const int *n, uint16_t *out, cudaStream_t stream);

/* Whether every step so far ended well: 0, or -1 once a step gave up
 * waiting for a rank's records (longer than PERSEUS_DECODE_TIMEOUT_MS: the
 * rank died, skipped the step or failed in it) or was aborted; the reason
 * names the step and the rank. That step's output, and every later one's,
 * is not valid, and step refuses from then on: destroy the operator. Read
 * after the stream's steps completed (a step still running may yet fail). */
int perseus_decode_check(const perseus_decode_t *op);

/* Ends the waits of every running and later step at once (any thread, also
 * while a step runs); check then reports the abort. For a caller that
 * knows a peer is gone sooner than the timeout would tell. */
void perseus_decode_abort(perseus_decode_t *op);

/* Collective: frees what create made, after the last step completed. */
void perseus_decode_destroy(perseus_decode_t *op);

/* The reason the calling thread's last failed call gave. */
const char *perseus_decode_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
