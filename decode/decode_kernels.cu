// Flash-Decode's standalone kernels (ps_decode_gpu.h): the split-KV partial
// over one shard, one block per (chunk, KV head, sequence), and the combine,
// one block per output row. The math is ps_decode_dev.cuh's, which the fused
// operator shares.
#include <cuda_bf16.h>
#include <math.h>

#include "ps_decode_dev.cuh"
#include "ps_decode_gpu.h"

namespace {

using ps_decode_dev::kThreads;

template <int G, int U>
__global__ void __launch_bounds__(kThreads)
    partial_kernel(int Hq, int Hkv, int D, float scale, const uint16_t *q, const uint16_t *k,
                   const uint16_t *v, size_t stride, const int *n, int splits, float *recs) {
  extern __shared__ float sh[];
  const int s = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int len = n[b], per = (len + splits - 1) / splits;
  const int t0 = min(len, s * per), t1 = min(len, t0 + per);
  const size_t row = ((size_t)b * Hkv + hk) * stride * D;
  float *rec = recs + (((size_t)b * Hkv + hk) * splits + s) * ps_decode_record_floats(G, D);
  ps_decode_dev::partial_chunk<G, U>(D, scale, q + ((size_t)b * Hq + (size_t)hk * G) * D, k + row,
                                     v + row, t0, t1, rec, sh);
}

using ps_decode_dev::kCombineThreads;

__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(int Hq, int Hkv, int D, int splits, int R, const float *recs,
                   size_t rank_stride, uint16_t *out) {
  __shared__ float sh[kCombineThreads + 32];
  ps_decode_dev::combine_row(Hq, Hkv, D, splits, R, ps_decode_dev::rank_stride_recs{recs, rank_stride},
                             blockIdx.y, blockIdx.x, out, sh);
}

// Tokens a group loads ahead: fewer for large groups, whose queries and
// outputs already hold 16 * G registers.
template <int G> constexpr int ahead() { return G <= 4 ? 8 : G == 8 ? 4 : 2; }

template <int G>
cudaError_t launch_partial(const ps_decode_config_t *c, float scale, const uint16_t *q,
                           const uint16_t *k, const uint16_t *v, size_t stride, const int *n,
                           int splits, float *recs, cudaStream_t st) {
  const size_t shared = ps_decode_dev::partial_smem(G, c->head_dim);
  if (shared > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(partial_kernel<G, ahead<G>()>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared);
    if (e != cudaSuccess) return e;
  }
  dim3 grid((unsigned)splits, (unsigned)c->kv_heads, (unsigned)c->batch);
  partial_kernel<G, ahead<G>()><<<grid, kThreads, shared, st>>>(
      c->q_heads, c->kv_heads, c->head_dim, scale, q, k, v, stride, n, splits, recs);
  return cudaGetLastError();
}

} // namespace

int ps_decode_splits(const ps_decode_config_t *cfg, int max_tokens, int sms) {
  /* at least twice the SMs in blocks; a large batch gets 3 chunks a row,
   * so that the last wave of equal blocks leaves few SMs idle */
  const long long rows = (long long)cfg->batch * cfg->kv_heads, twice = 2LL * (sms > 0 ? sms : 1);
  const long long want = twice > 3 * rows ? twice : 3 * rows;
  long long splits = (want + rows - 1) / rows, most = (max_tokens + 63) / 64;
  if (splits > most) splits = most;
  return splits < 1 ? 1 : (int)splits;
}

int ps_decode_partial_gpu(const ps_decode_config_t *cfg, float scale, const uint16_t *q,
                          const uint16_t *k, const uint16_t *v, size_t stride, const int *n,
                          int splits, float *recs, cudaStream_t st) {
  if (ps_decode_check_config(cfg, 1)) return -1;
  if (splits < 1 || splits > 65535)
    return ps_decode_fail("splits %d: expected 1 to 65535 chunks per row", splits);
  if (!q || !k || !v || !n || !recs) return ps_decode_fail("a NULL device pointer");
  if (((uintptr_t)q | (uintptr_t)k | (uintptr_t)v) % 16)
    return ps_decode_fail("q %p, k %p, v %p: expected 16-byte aligned rows", (const void *)q,
                          (const void *)k, (const void *)v);
  const int group = cfg->q_heads / cfg->kv_heads;
  cudaError_t e;
  switch (group) {
    case 1: e = launch_partial<1>(cfg, scale, q, k, v, stride, n, splits, recs, st); break;
    case 2: e = launch_partial<2>(cfg, scale, q, k, v, stride, n, splits, recs, st); break;
    case 4: e = launch_partial<4>(cfg, scale, q, k, v, stride, n, splits, recs, st); break;
    case 8: e = launch_partial<8>(cfg, scale, q, k, v, stride, n, splits, recs, st); break;
    case 16: e = launch_partial<16>(cfg, scale, q, k, v, stride, n, splits, recs, st); break;
    default:
      return ps_decode_fail("q_heads / kv_heads = %d query heads per KV head: the kernel takes 1, "
                            "2, 4, 8 or 16", group);
  }
  return e == cudaSuccess ? 0 : ps_decode_fail("partial kernel launch: %s", cudaGetErrorString(e));
}

int ps_decode_combine_gpu(const ps_decode_config_t *cfg, int nranks, int splits, const float *recs,
                          size_t rank_stride, uint16_t *out, cudaStream_t st) {
  if (ps_decode_check_config(cfg, nranks)) return -1;
  if (splits < 1) return ps_decode_fail("splits %d: expected at least 1", splits);
  if (!recs || !out) return ps_decode_fail("a NULL device pointer");
  dim3 grid((unsigned)cfg->q_heads, (unsigned)cfg->batch);
  combine_kernel<<<grid, kCombineThreads, 0, st>>>(cfg->q_heads, cfg->kv_heads, cfg->head_dim,
                                                   splits, nranks, recs, rank_stride, out);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : ps_decode_fail("combine kernel launch: %s", cudaGetErrorString(e));
}
