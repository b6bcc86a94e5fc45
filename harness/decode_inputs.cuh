/* Flash-Decode's inputs for perseus_decode_perf and decode_fused_test:
 * values from a hash of their place, made alike on every rank's GPU and on
 * the host, so the fp64 reference needs no copy from any rank; and the
 * check of an output against it. */
#ifndef PERSEUS_DECODE_INPUTS_CUH
#define PERSEUS_DECODE_INPUTS_CUH

#include <math.h>
#include <stdint.h>

#include <vector>

#include <cuda_bf16.h>

#include "place_hash.cuh"
#include "ps_decode.h"

/* what: 0 q, 1 k, 2 v; t the token's place in the whole sequence. */
__host__ __device__ inline float dp_value(uint64_t seed, int what, size_t b, size_t h, size_t t,
                                          size_t d)
{
  const float u = ps_place_value(seed ^ ((uint64_t)what << 60) ^ (b << 44) ^ (h << 36) ^ (t << 12) ^ d);
  return what == 1 ? 2.f * u : u;
}

/* Rows [B][heads][stride][D]; row t of sequence b's shard is token
 * first[b] + t (first: device; NULL: every shard starts at token 0). */
__global__ void dp_fill(uint16_t *p, uint64_t seed, int what, int B, int heads, size_t stride,
                        const int *first, int D)
{
  const size_t n = (size_t)B * heads * stride * D;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t d = i % D, t = i / D % stride, h = i / D / stride % heads, b = i / D / stride / heads;
    const size_t from = first ? (size_t)first[b] : 0;
    p[i] = __bfloat16_as_ushort(__float2bfloat16(dp_value(seed, what, b, h, from + t, d)));
  }
}

/* q [B][Hq][D] and this rank's shard of k and v, [B][Hkv][stride][D],
 * sequence b's starting at token first[b]. 0, or -1 (a CUDA error). */
static inline int dp_fill_all(uint64_t seed, const ps_decode_config_t &dc, size_t stride,
                              const std::vector<int> &first, uint16_t *q, uint16_t *k, uint16_t *v,
                              cudaStream_t st)
{
  int *dev_first = NULL;
  const size_t bytes = first.size() * sizeof(int);
  if (cudaMalloc(&dev_first, bytes) != cudaSuccess) return -1;
  /* on `st`: it need not wait for the legacy stream's copies */
  if (cudaMemcpyAsync(dev_first, first.data(), bytes, cudaMemcpyHostToDevice, st) != cudaSuccess) {
    cudaFree(dev_first);
    return -1;
  }
  dp_fill<<<1024, 256, 0, st>>>(q, seed, 0, dc.batch, dc.q_heads, 1, NULL, dc.head_dim);
  dp_fill<<<1024, 256, 0, st>>>(k, seed, 1, dc.batch, dc.kv_heads, stride, dev_first, dc.head_dim);
  dp_fill<<<1024, 256, 0, st>>>(v, seed, 2, dc.batch, dc.kv_heads, stride, dev_first, dc.head_dim);
  const int rc = cudaStreamSynchronize(st) == cudaSuccess ? 0 : -1;
  cudaFree(dev_first);
  return rc;
}

static inline double dp_bf16_value(float f) { return (double)__bfloat162float(__float2bfloat16(f)); }

/* Attention over the whole sequences of lengths len[b], in fp64 from the
 * same values: the reference outputs [B][Hq][D]. */
static inline std::vector<double> dp_reference(uint64_t seed, const ps_decode_config_t &dc,
                                               const std::vector<int> &len, double scale)
{
  const size_t B = dc.batch, Hq = dc.q_heads, Hkv = dc.kv_heads, D = dc.head_dim, T = dc.max_context;
  std::vector<double> q(B * Hq * D), k(B * Hkv * T * D), v(k.size()), ref(B * Hq * D), lse(B * Hq);
  for (size_t b = 0; b < B; b++)
    for (size_t h = 0; h < Hq; h++)
      for (size_t d = 0; d < D; d++) q[(b * Hq + h) * D + d] = dp_bf16_value(dp_value(seed, 0, b, h, 0, d));
  for (size_t b = 0; b < B; b++)
    for (size_t h = 0; h < Hkv; h++)
      for (size_t t = 0; t < (size_t)len[b]; t++)
        for (size_t d = 0; d < D; d++) {
          const size_t i = ((b * Hkv + h) * T + t) * D + d;
          k[i] = dp_bf16_value(dp_value(seed, 1, b, h, t, d));
          v[i] = dp_bf16_value(dp_value(seed, 2, b, h, t, d));
        }
  ps_decode_ref_partial(&dc, scale, q.data(), k.data(), v.data(), T, len.data(), ref.data(), lse.data());
  return ref;
}

/* out [B][Hq][D] (bf16, host) against dp_reference's: how many elements are
 * off by more than bf16's rounding and fp32 sums' slack. */
static inline long long dp_wrong(const std::vector<double> &ref, const std::vector<uint16_t> &out)
{
  long long wrong = 0;
  for (size_t i = 0; i < out.size(); i++) {
    const double got = (double)__bfloat162float(__ushort_as_bfloat16(out[i]));
    if (i >= ref.size() || !(fabs(got - ref[i]) <= fabs(ref[i]) / 256 + 1e-3)) wrong++;
  }
  return wrong;
}

#endif
