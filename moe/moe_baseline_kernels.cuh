/* moe_baseline_kernels.cuh: the kernels of the bulk-synchronous MoE baseline
 * (moe_baseline.cu). Rows are bf16 [hidden] (or [ffn]), hidden and ffn
 * multiples of 64, so every row is a whole number of 16-byte vectors and
 * every row start is 16-byte aligned; copies go by uint4.
 *
 * Indexing: expert e lives on rank e / L as local expert e % L, so the
 * [destination][local expert] count table is indexed by e itself. */
#ifndef PS_MOE_BASELINE_KERNELS_CUH
#define PS_MOE_BASELINE_KERNELS_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "perseus/moe_config.h"

#define PS_BL_THREADS 256 /* 8 warps: warp-per-row kernels */
#define PS_BL_WARPS (PS_BL_THREADS / 32)
#define PS_BL_SCAN_THREADS 1024

namespace {

typedef __nv_bfloat16 bl_bf16;

__device__ __forceinline__ int bl_warp_id() { return (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); }
__device__ __forceinline__ int bl_warp_count() { return (int)((gridDim.x * blockDim.x) >> 5); }

/* Softmax over the E logits of each token, top-k by logit (the softmax is
 * monotone; ties: the lower expert id), weights = the chosen probabilities,
 * divided by their sum when renorm. Lane i < k stores choice i and takes a
 * slot in its (destination, local expert) segment: slot[t][i] (the scatter
 * kernel turns it into the row's position in the send buffer). */
__global__ void __launch_bounds__(PS_BL_THREADS)
    ps_bl_route(const float *__restrict__ logits, int T, int E, int k, int renorm,
                int32_t *__restrict__ topk_idx, float *__restrict__ topk_w,
                int32_t *__restrict__ slot, int *__restrict__ cnt)
{
  const int lane = threadIdx.x & 31;
  for (int t = bl_warp_id(); t < T; t += bl_warp_count()) {
    const float *lg = logits + (size_t)t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, lg[e]);
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float den = 0.f;
    for (int e = lane; e < E; e += 32) den += expf(lg[e] - mx);
    for (int o = 16; o; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);

    int my_e = 0;     /* lane i < k: choice i */
    float my_p = 0.f; /* its probability */
    float psum = 0.f;
    int chosen[PERSEUS_MOE_MAX_TOPK];
    for (int i = 0; i < k; i++) {
      float bv = -INFINITY;
      int be = E; /* E: none yet (any real candidate beats it on ties) */
      for (int e = lane; e < E; e += 32) {
        bool taken = false;
        for (int q = 0; q < i; q++) taken |= chosen[q] == e;
        if (taken) continue;
        float v = lg[e];
        if (be == E || v > bv || (v == bv && e < be)) bv = v, be = e;
      }
      for (int o = 16; o; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (oe != E && (be == E || ov > bv || (ov == bv && oe < be))) bv = ov, be = oe;
      }
      chosen[i] = be; /* the same on every lane after the butterfly */
      float p = expf(bv - mx) / den;
      psum += p;
      if (lane == i) my_e = be, my_p = p;
    }
    if (lane < k) {
      float w = renorm ? my_p / psum : my_p;
      topk_idx[(size_t)t * k + lane] = my_e;
      topk_w[(size_t)t * k + lane] = w;
      slot[(size_t)t * k + lane] = atomicAdd(&cnt[my_e], 1);
    }
  }
}

/* off[i] = cnt[0] + ... + cnt[i-1], one block of PS_BL_SCAN_THREADS threads,
 * each summing a contiguous chunk. */
__global__ void __launch_bounds__(PS_BL_SCAN_THREADS)
    ps_bl_offsets(const int *__restrict__ cnt, int *__restrict__ off, int n)
{
  __shared__ int warp_incl[PS_BL_SCAN_THREADS / 32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int per = (n + (int)blockDim.x - 1) / (int)blockDim.x;
  const int b = (int)threadIdx.x * per, e = min(b + per, n);
  int s = 0;
  for (int i = b; i < e; i++) s += cnt[i];
  int v = s; /* inclusive scan over the warp */
  for (int o = 1; o < 32; o <<= 1) {
    int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) warp_incl[w] = v;
  __syncthreads();
  if (w == 0) {
    int x = lane < nw ? warp_incl[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      int u = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += u;
    }
    if (lane < nw) warp_incl[lane] = x;
  }
  __syncthreads();
  int base = (w ? warp_incl[w - 1] : 0) + v - s;
  for (int i = b; i < e; i++) {
    off[i] = base;
    base += cnt[i];
  }
}

/* Copies one row of h8 uint4 with a warp. */
__device__ __forceinline__ void bl_copy_row(uint4 *__restrict__ dst, const uint4 *__restrict__ src, int h8,
                                            int lane)
{
  for (int i = lane; i < h8; i += 32) dst[i] = src[i];
}

/* Warp per routed row r = t * k + i: its position in the send buffer,
 * pos = off[e] + slot (in place: slot becomes pos), and the copy of x[t]. */
__global__ void __launch_bounds__(PS_BL_THREADS)
    ps_bl_scatter(const bl_bf16 *__restrict__ x, int T, int H, int k, const int32_t *__restrict__ topk_idx,
                  const int *__restrict__ off, int32_t *__restrict__ slot_pos, bl_bf16 *__restrict__ send)
{
  const int lane = threadIdx.x & 31, h8 = H / 8;
  for (int r = bl_warp_id(); r < T * k; r += bl_warp_count()) {
    int pos = 0;
    if (lane == 0) {
      pos = off[topk_idx[r]] + slot_pos[r];
      slot_pos[r] = pos;
    }
    pos = __shfl_sync(0xffffffffu, pos, 0);
    bl_copy_row((uint4 *)(send + (size_t)pos * H), (const uint4 *)(x + (size_t)(r / k) * H), h8, lane);
  }
}

/* Warp per row r of the expert-ordered buffer: its segment q is the last one
 * with seg_exp[q] <= r (segments in expert-major order, seg_exp their
 * non-decreasing first expert-ordered row; an empty segment is never the last
 * such one for an r it does not hold), its row in the source-ordered buffer
 * seg_src[q] + (r - seg_exp[q]). to_expert: src_ord -> exp_ord, else back. */
__global__ void __launch_bounds__(PS_BL_THREADS)
    ps_bl_permute(bl_bf16 *__restrict__ exp_ord, bl_bf16 *__restrict__ src_ord, int N, int H,
                  const int *__restrict__ seg_exp, const int *__restrict__ seg_src, int nseg, int to_expert)
{
  const int lane = threadIdx.x & 31, h8 = H / 8;
  for (int r = bl_warp_id(); r < N; r += bl_warp_count()) {
    int lo = 0, hi = nseg; /* first q with seg_exp[q] > r is hi; answer hi - 1 */
    while (lo < hi) {
      int mid = (lo + hi) >> 1;
      if (seg_exp[mid] <= r) lo = mid + 1;
      else hi = mid;
    }
    int q = lo - 1; /* >= 0: seg_exp[0] == 0 <= r */
    size_t s = (size_t)(seg_src[q] + (r - seg_exp[q]));
    uint4 *e = (uint4 *)(exp_ord + (size_t)r * H), *o = (uint4 *)(src_ord + s * H);
    if (to_expert) bl_copy_row(e, o, h8, lane);
    else bl_copy_row(o, e, h8, lane);
  }
}

__device__ __forceinline__ float2 bl_load2(const float *p) { return *(const float2 *)p; }
__device__ __forceinline__ float2 bl_load2(const bl_bf16 *p)
{
  return __bfloat1622float2(*(const __nv_bfloat162 *)p);
}

/* act[r][f] = bf16(silu(h[r][f]) * h[r][F + f]) for N rows, h = [N][2F] (W1
 * half, then W3 half; bf16 from the grouped GEMM1, fp32 from the per-expert
 * one), 8 columns per thread. */
template <typename TH>
__global__ void __launch_bounds__(PS_BL_THREADS)
    ps_bl_silu_mul(const TH *__restrict__ h, bl_bf16 *__restrict__ act, int N, int F)
{
  const int f8 = F / 8;
  const size_t total = (size_t)N * f8, stride = (size_t)gridDim.x * blockDim.x;
  for (size_t v = (size_t)blockIdx.x * blockDim.x + threadIdx.x; v < total; v += stride) {
    size_t r = v / f8, c = v % f8;
    const TH *a = h + r * 2 * F + c * 8, *g = a + F;
    uint4 o;
    __nv_bfloat162 *op = (__nv_bfloat162 *)&o;
#pragma unroll
    for (int q = 0; q < 4; q++) {
      float2 av = bl_load2(a + 2 * q), gv = bl_load2(g + 2 * q);
      float y0 = av.x / (1.f + __expf(-av.x)) * gv.x, y1 = av.y / (1.f + __expf(-av.y)) * gv.y;
      op[q] = __floats2bfloat162_rn(y0, y1);
    }
    ((uint4 *)(act + r * F))[c] = o;
  }
}

/* Warp per token: out[t] = sum_i w[t][i] * back[pos[t][i]] in fp32, bf16 out. */
__global__ void __launch_bounds__(PS_BL_THREADS)
    ps_bl_combine(const bl_bf16 *__restrict__ back, const int32_t *__restrict__ pos,
                  const float *__restrict__ topk_w, int T, int H, int k, bl_bf16 *__restrict__ out)
{
  const int lane = threadIdx.x & 31, h8 = H / 8;
  for (int t = bl_warp_id(); t < T; t += bl_warp_count()) {
    for (int c = lane; c < h8; c += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int i = 0; i < k; i++) {
        float w = topk_w[(size_t)t * k + i];
        uint4 v = ((const uint4 *)(back + (size_t)pos[(size_t)t * k + i] * H))[c];
        const __nv_bfloat162 *vp = (const __nv_bfloat162 *)&v;
#pragma unroll
        for (int q = 0; q < 4; q++) {
          float2 f = __bfloat1622float2(vp[q]);
          acc[2 * q] += w * f.x;
          acc[2 * q + 1] += w * f.y;
        }
      }
      uint4 o;
      __nv_bfloat162 *op = (__nv_bfloat162 *)&o;
#pragma unroll
      for (int q = 0; q < 4; q++) op[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      ((uint4 *)(out + (size_t)t * H))[c] = o;
    }
  }
}

} // namespace

#endif
