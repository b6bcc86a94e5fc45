/* Flash-Decode's GPU kernels (issue 27): split-KV decode attention over one
 * rank's shard of the KV cache, and the combine of partials. The baseline
 * (partials, ncclAllGather, combine) is built from these; the fused
 * operator will reuse the partial kernel's math. Layouts and the math are
 * ps_decode.h's; bf16 values are uint16_t bit patterns. Host code in a .cu
 * file, callable from C++ and CUDA. */
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
 * max_tokens tokens into, so that B * Hkv * splits blocks fill `sms`
 * multiprocessors about twice, each chunk at least 64 tokens; at least 1. */
int ps_decode_splits(const ps_decode_config_t *cfg, int max_tokens, int sms);

/* Partial attention over a shard: q [B][Hq][D], k and v [B][Hkv][stride][D]
 * (bf16, device), n[b] (device) the shard's tokens of sequence b (0..stride);
 * each (b, KV head) row cut into `splits` contiguous chunks, each giving
 * o [B][Hq][splits][D] (fp32, normalized over its chunk) and lse
 * [B][Hq][splits] (fp32, natural log; an empty chunk: o = 0, lse = -inf).
 * Scores are q.k * scale. 0, or -1 with ps_decode_last_error() naming the
 * shape the kernel cannot take or the launch error. */
int ps_decode_partial_gpu(const ps_decode_config_t *cfg, float scale, const uint16_t *q,
                          const uint16_t *k, const uint16_t *v, size_t stride, const int *n,
                          int splits, float *o, float *lse, cudaStream_t st);

/* The combine of the partials of `nranks` blocks, block r's at
 * o + r * o_stride and lse + r * lse_stride (elements), each laid out as
 * ps_decode_partial_gpu writes with `splits` chunks: out [B][Hq][D] bf16.
 * 0, or -1 as above. */
int ps_decode_combine_gpu(const ps_decode_config_t *cfg, int nranks, int splits, const float *o,
                          size_t o_stride, const float *lse, size_t lse_stride, uint16_t *out,
                          cudaStream_t st);

#endif
