// Flash-Decode's kernels (ps_decode_gpu.h): the split-KV partial over one
// shard and the combine of partials.
//
// Partial: one block per (chunk, KV head, sequence), four warps. Each warp
// takes every fourth token of the chunk: its lanes hold D/32 elements of the
// group's query rows (scaled) and of the running output, one warp-wide dot
// product per query head and token, and an online softmax (running max m,
// sum l) per head, so K and V rows are read once for all G heads of the
// group. The warps' states merge through shared memory at the end.
#include <cuda_bf16.h>
#include <math.h>

#include "ps_decode_gpu.h"

namespace {

constexpr int kWarps = 4;

__device__ __forceinline__ float bf16_at(const uint16_t *p, size_t i) {
  return __bfloat162float(__ushort_as_bfloat16(p[i]));
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <int G, int NJ>
__global__ void __launch_bounds__(kWarps * 32)
    partial_kernel(int Hq, int Hkv, int D, float scale, const uint16_t *q, const uint16_t *k,
                   const uint16_t *v, size_t stride, const int *n, int splits, float *o,
                   float *lse) {
  const int s = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int len = n[b], per = (len + splits - 1) / splits;
  const int t0 = min(len, s * per), t1 = min(len, t0 + per);

  float qr[G][NJ], acc[G][NJ], m[G], l[G];
  for (int g = 0; g < G; g++) {
    const size_t qrow = ((size_t)b * Hq + (size_t)hk * G + g) * D;
    for (int j = 0; j < NJ; j++) {
      const int d = lane + 32 * j;
      qr[g][j] = d < D ? bf16_at(q, qrow + d) * scale : 0.f;
      acc[g][j] = 0.f;
    }
    m[g] = -INFINITY, l[g] = 0.f;
  }
  const size_t row = ((size_t)b * Hkv + hk) * stride * D;
  for (int t = t0 + warp; t < t1; t += kWarps) {
    float kv[NJ], vv[NJ];
    for (int j = 0; j < NJ; j++) {
      const int d = lane + 32 * j;
      kv[j] = d < D ? bf16_at(k, row + (size_t)t * D + d) : 0.f;
      vv[j] = d < D ? bf16_at(v, row + (size_t)t * D + d) : 0.f;
    }
    for (int g = 0; g < G; g++) {
      float dot = 0.f;
      for (int j = 0; j < NJ; j++) dot += qr[g][j] * kv[j];
      const float sc = warp_sum(dot), mn = fmaxf(m[g], sc);
      const float grow = expf(m[g] - mn), p = expf(sc - mn); // m = -inf: grow 0
      l[g] = l[g] * grow + p;
      for (int j = 0; j < NJ; j++) acc[g][j] = acc[g][j] * grow + p * vv[j];
      m[g] = mn;
    }
  }

  // merge the warps: [warp][g] m and l, then [warp][g][D] acc
  extern __shared__ float sh[];
  float *sm = sh, *sl = sh + kWarps * G, *sacc = sh + 2 * kWarps * G;
  if (lane == 0)
    for (int g = 0; g < G; g++) sm[warp * G + g] = m[g], sl[warp * G + g] = l[g];
  for (int g = 0; g < G; g++)
    for (int j = 0; j < NJ; j++) {
      const int d = lane + 32 * j;
      if (d < D) sacc[((size_t)warp * G + g) * D + d] = acc[g][j];
    }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float M = -INFINITY;
    for (int w = 0; w < kWarps; w++) M = fmaxf(M, sm[w * G + g]);
    float L = 0.f, out = 0.f;
    if (M != -INFINITY)
      for (int w = 0; w < kWarps; w++) {
        const float c = expf(sm[w * G + g] - M); // an idle warp: 0
        L += sl[w * G + g] * c;
        out += sacc[((size_t)w * G + g) * D + d] * c;
      }
    const size_t part = ((size_t)b * Hq + (size_t)hk * G + g) * splits + s;
    o[part * D + d] = L > 0.f ? out / L : 0.f;
    if (d == 0) lse[part] = L > 0.f ? M + logf(L) : -INFINITY;
  }
}

// One block per (query head, sequence); a thread per element of the row.
__global__ void combine_kernel(int Hq, int D, int nranks, int splits, const float *o,
                               size_t o_stride, const float *lse, size_t lse_stride,
                               uint16_t *out) {
  const size_t row = (size_t)blockIdx.y * Hq + blockIdx.x;
  float M = -INFINITY;
  for (int r = 0; r < nranks; r++)
    for (int s = 0; s < splits; s++) M = fmaxf(M, lse[r * lse_stride + row * splits + s]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.f, acc = 0.f;
    if (M != -INFINITY)
      for (int r = 0; r < nranks; r++)
        for (int s = 0; s < splits; s++) {
          const size_t part = row * splits + s;
          const float w = expf(lse[r * lse_stride + part] - M); // an empty chunk: 0
          sum += w;
          acc += w * o[r * o_stride + part * D + d];
        }
    out[row * D + d] = __bfloat16_as_ushort(__float2bfloat16(sum > 0.f ? acc / sum : 0.f));
  }
}

template <int G, int NJ>
cudaError_t launch_partial(const ps_decode_config_t *c, float scale, const uint16_t *q,
                           const uint16_t *k, const uint16_t *v, size_t stride, const int *n,
                           int splits, float *o, float *lse, cudaStream_t st) {
  const size_t shared = (2 * kWarps * G + (size_t)kWarps * G * c->head_dim) * sizeof(float);
  if (shared > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(partial_kernel<G, NJ>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared);
    if (e != cudaSuccess) return e;
  }
  dim3 grid((unsigned)splits, (unsigned)c->kv_heads, (unsigned)c->batch);
  partial_kernel<G, NJ><<<grid, kWarps * 32, shared, st>>>(c->q_heads, c->kv_heads, c->head_dim,
                                                          scale, q, k, v, stride, n, splits, o, lse);
  return cudaGetLastError();
}

template <int G>
cudaError_t launch_group(const ps_decode_config_t *c, float scale, const uint16_t *q,
                         const uint16_t *k, const uint16_t *v, size_t stride, const int *n,
                         int splits, float *o, float *lse, cudaStream_t st) {
  const int D = c->head_dim;
  if (D <= 32) return launch_partial<G, 1>(c, scale, q, k, v, stride, n, splits, o, lse, st);
  if (D <= 64) return launch_partial<G, 2>(c, scale, q, k, v, stride, n, splits, o, lse, st);
  if (D <= 128) return launch_partial<G, 4>(c, scale, q, k, v, stride, n, splits, o, lse, st);
  return launch_partial<G, 8>(c, scale, q, k, v, stride, n, splits, o, lse, st);
}

} // namespace

int ps_decode_splits(const ps_decode_config_t *cfg, int max_tokens, int sms) {
  const long long rows = (long long)cfg->batch * cfg->kv_heads, want = 2LL * (sms > 0 ? sms : 1);
  long long splits = (want + rows - 1) / rows, most = (max_tokens + 63) / 64;
  if (splits > most) splits = most;
  return splits < 1 ? 1 : (int)splits;
}

int ps_decode_partial_gpu(const ps_decode_config_t *cfg, float scale, const uint16_t *q,
                          const uint16_t *k, const uint16_t *v, size_t stride, const int *n,
                          int splits, float *o, float *lse, cudaStream_t st) {
  if (ps_decode_check_config(cfg, 1)) return -1;
  if (splits < 1 || splits > 65535)
    return ps_decode_fail("splits %d: expected 1 to 65535 chunks per row", splits);
  if (!q || !k || !v || !n || !o || !lse) return ps_decode_fail("a NULL device pointer");
  const int group = cfg->q_heads / cfg->kv_heads;
  cudaError_t e;
  switch (group) {
    case 1: e = launch_group<1>(cfg, scale, q, k, v, stride, n, splits, o, lse, st); break;
    case 2: e = launch_group<2>(cfg, scale, q, k, v, stride, n, splits, o, lse, st); break;
    case 4: e = launch_group<4>(cfg, scale, q, k, v, stride, n, splits, o, lse, st); break;
    case 8: e = launch_group<8>(cfg, scale, q, k, v, stride, n, splits, o, lse, st); break;
    case 16: e = launch_group<16>(cfg, scale, q, k, v, stride, n, splits, o, lse, st); break;
    default:
      return ps_decode_fail("q_heads / kv_heads = %d query heads per KV head: the kernel takes 1, "
                            "2, 4, 8 or 16", group);
  }
  return e == cudaSuccess ? 0 : ps_decode_fail("partial kernel launch: %s", cudaGetErrorString(e));
}

int ps_decode_combine_gpu(const ps_decode_config_t *cfg, int nranks, int splits, const float *o,
                          size_t o_stride, const float *lse, size_t lse_stride, uint16_t *out,
                          cudaStream_t st) {
  if (ps_decode_check_config(cfg, nranks)) return -1;
  if (splits < 1) return ps_decode_fail("splits %d: expected at least 1", splits);
  if (!o || !lse || !out) return ps_decode_fail("a NULL device pointer");
  dim3 grid((unsigned)cfg->q_heads, (unsigned)cfg->batch);
  combine_kernel<<<grid, cfg->head_dim, 0, st>>>(cfg->q_heads, cfg->head_dim, nranks, splits, o,
                                                 o_stride, lse, lse_stride, out);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : ps_decode_fail("combine kernel launch: %s", cudaGetErrorString(e));
}
