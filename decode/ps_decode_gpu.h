/* Flash-Decode's GPU kernels (issue 27): split-KV decode attention over one
 * rank's shard of the KV cache, and the combine of partials. The baseline
 * (partials, ncclAllGather, combine) is built from these; the fused
 * operator (<perseus/decode.h>) shares their device code (ps_decode_dev.cuh).
 * Layouts and the math are ps_decode.h's; bf16 values are uint16_t bit
 * patterns. Host code in a .cu file, callable from C++ and CUDA. */
#ifndef PS_DECODE_GPU_H
#define PS_DECODE_GPU_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "ps_decode.h"

/* The group sizes (query heads per KV head, Hq / Hkv) the partial kernel
 * is built for: 1, 2, 4, 8 and 16. */
#define PS_DECODE_MAX_GROUP 16

/* How many chunks to cut each (sequence, KV head) row of a shard of up to
 * max_tokens tokens into: enough for B * Hkv * splits blocks to fill `sms`
 * multiprocessors twice, and at least 3 a row, but no more than
 * ceil(max_tokens / 64) (chunks of about 64 tokens or more); at least 1. */
int ps_decode_splits(const ps_decode_config_t *cfg, int max_tokens, int sms);

/* A record: one block's partials for (sequence, KV head, chunk), the
 * group's G = Hq / Hkv query heads' normalized outputs [G][D] then their
 * log-sum-exps [G] (natural log; an empty chunk: outputs 0, lse -inf), fp32,
 * padded to 16 bytes. A rank's partials are B * Hkv * splits records,
 * [B][Hkv][splits]: each block's result is one contiguous tile. */
static inline __host__ __device__ size_t ps_decode_record_floats(int G, int D) {
  return ((size_t)G * (size_t)(D + 1) + 3) & ~(size_t)3;
}
/* The floats of one rank's records. */
static inline size_t ps_decode_records_floats(const ps_decode_config_t *cfg, int splits) {
  return (size_t)cfg->batch * cfg->kv_heads * splits *
         ps_decode_record_floats(cfg->q_heads / cfg->kv_heads, cfg->head_dim);
}
/* Partial attention over a shard: q [B][Hq][D], k and v [B][Hkv][stride][D]
 * (bf16, device, 16-byte aligned), n[b] (device) the shard's tokens of
 * sequence b (0..stride); each (b, KV head) row cut into `splits` contiguous
 * chunks, each giving one record of recs (above). Scores are q.k * scale.
 * 0, or -1 with ps_decode_last_error() naming the shape the kernel cannot
 * take or the launch error. */
int ps_decode_partial_gpu(const ps_decode_config_t *cfg, float scale, const uint16_t *q,
                          const uint16_t *k, const uint16_t *v, size_t stride, const int *n,
                          int splits, float *recs, cudaStream_t st);
/* The combine of `nranks` ranks' records, rank r's at recs + r * rank_stride
 * (floats), each with `splits` chunks a row: out [B][Hq][D] bf16. 0, or -1
 * as above. */
int ps_decode_combine_gpu(const ps_decode_config_t *cfg, int nranks, int splits, const float *recs,
                          size_t rank_stride, uint16_t *out, cudaStream_t st);
#endif
