// Flash-Decode's device code, shared by the standalone kernels
// (decode_kernels.cu) and the fused operator (decode_fused.cu): one block's
// split-KV partial over a chunk of tokens, written as one record, and the
// combine of one output row from the records of every rank.
//
// A record is one block's result for (sequence, KV head, chunk): the G query
// heads' normalized outputs [G][D] then their log-sum-exps [G], fp32, padded
// to 16 bytes (ps_decode_record_floats), so that a block's whole result is
// one contiguous tile to store or put.
#ifndef PS_DECODE_DEV_CUH
#define PS_DECODE_DEV_CUH

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "ps_decode_gpu.h"

namespace ps_decode_dev {

constexpr int kThreads = 128; // a partial block: four warps

// 16-byte chunks of a row of D bf16 values are spread over LPT lanes (the
// smallest power of two that holds them); a warp takes 32 / LPT tokens at a
// time, the block kThreads / LPT ("groups"), each group U tokens apart.
__host__ __device__ constexpr int lanes_per_token(int D) {
  return D <= 8 ? 1 : D <= 16 ? 2 : D <= 32 ? 4 : D <= 64 ? 8 : D <= 128 ? 16 : 32;
}
__host__ __device__ constexpr int groups(int D) { return kThreads / lanes_per_token(D); }

// Shared memory a partial block needs: the groups' m, l and outputs.
__host__ __device__ constexpr size_t partial_smem(int G, int D) {
  return ((size_t)2 * groups(D) * G + (size_t)groups(D) * G * D) * sizeof(float);
}

__device__ __forceinline__ void unpack8(uint4 w, float f[8]) {
  const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    f[2 * i] = __uint_as_float(x[i] << 16);
    f[2 * i + 1] = __uint_as_float(x[i] & 0xffff0000u);
  }
}

// The block's partial over tokens [t0, t1) of one (sequence, KV head) row:
// q the group's G query rows [G][D] (bf16), k and v the row's tokens [t][D]
// (bf16), into rec (ps_decode.h's math: normalized output and natural-log
// log-sum-exp; no tokens: zeros and -inf). Every thread of the block calls
// it; `sh` holds partial_smem(G, D) bytes. Each group keeps its own online
// softmax over its tokens, so a tile needs no block-wide step; the groups
// merge once at the end. U tokens a group loads before it computes keep
// U 16-byte loads in flight per thread, and V's follow K's one by one.
template <int G, int U>
__device__ void partial_chunk(int D, float scale, const uint16_t *q, const uint16_t *k,
                              const uint16_t *v, int t0, int t1, float *rec, float *sh) {
  const int LPT = lanes_per_token(D), NG = kThreads / LPT, C = D / 8;
  const int lane = threadIdx.x % 32, c = lane % LPT, grp = threadIdx.x / LPT;
  const bool active = c < C;
  float qf[G][8], acc[G][8], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; g++) {
    float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (active) unpack8(__ldg((const uint4 *)(q + (size_t)g * D + c * 8)), f);
#pragma unroll
    for (int i = 0; i < 8; i++) qf[g][i] = f[i] * scale, acc[g][i] = 0.f;
    m[g] = -INFINITY, l[g] = 0.f;
  }
  // warp-uniform trip count: the shuffles below need every lane
  for (int base = t0; base < t1; base += NG * U) {
    uint4 kw[U], vw[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int t = base + grp + u * NG;
      kw[u] = make_uint4(0, 0, 0, 0);
      if (active && t < t1) kw[u] = __ldg((const uint4 *)(k + (size_t)t * D + c * 8));
    }
    float s[U][G];
#pragma unroll
    for (int u = 0; u < U; u++) {
      // V rows load while the scores are computed; the K rows they replace
      // are dead by then, so K and V never hold registers together
      const int t = base + grp + u * NG;
      vw[u] = make_uint4(0, 0, 0, 0);
      if (active && t < t1) vw[u] = __ldg((const uint4 *)(v + (size_t)t * D + c * 8));
      float kf[8];
      unpack8(kw[u], kf);
      const bool live = base + grp + u * NG < t1;
#pragma unroll
      for (int g = 0; g < G; g++) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) dot = fmaf(qf[g][i], kf[i], dot);
        for (int o = LPT / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        s[u][g] = live ? dot : -INFINITY;
      }
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; u++) mx = fmaxf(mx, s[u][g]);
      if (mx == -INFINITY) continue; // nothing yet for this group
      const float corr = expf(m[g] - mx); // m = -inf: 0
      l[g] *= corr;
#pragma unroll
      for (int i = 0; i < 8; i++) acc[g][i] *= corr;
#pragma unroll
      for (int u = 0; u < U; u++) {
        const float p = expf(s[u][g] - mx); // a dead token: 0
        float vf[8];
        unpack8(vw[u], vf);
        l[g] += p;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
      }
      m[g] = mx;
    }
  }

  // merge the groups: [NG][G] m and l, then [NG][G][D] outputs
  float *sm = sh, *sl = sh + NG * G, *sacc = sh + 2 * NG * G;
#pragma unroll
  for (int g = 0; g < G; g++) {
    if (c == 0) sm[grp * G + g] = m[g], sl[grp * G + g] = l[g];
    if (active)
#pragma unroll
      for (int i = 0; i < 8; i++) sacc[((size_t)grp * G + g) * D + c * 8 + i] = acc[g][i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float M = -INFINITY;
    for (int w = 0; w < NG; w++) M = fmaxf(M, sm[w * G + g]);
    float L = 0.f, out = 0.f;
    if (M != -INFINITY)
      for (int w = 0; w < NG; w++) {
        const float cw = expf(sm[w * G + g] - M); // an idle group: 0
        L += sl[w * G + g] * cw;
        out += sacc[((size_t)w * G + g) * D + d] * cw;
      }
    rec[i] = L > 0.f ? out / L : 0.f;
    if (d == 0) rec[G * D + g] = L > 0.f ? M + logf(L) : -INFINITY;
  }
  __syncthreads(); // sh is free again
}

// The largest of every thread's x in the block (blockDim.x a multiple of
// 32); sh holds 32 floats. Every thread gets it.
__device__ inline float block_max(float x, float *sh) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads(); // sh may still be read from an earlier call
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = x;
  __syncthreads();
  x = -INFINITY;
  for (int w = 0; w < (int)blockDim.x / 32; w++) x = fmaxf(x, sh[w]);
  return x;
}

// Records of one rank's block at a time: recs(r) is where rank r's
// [B][Hkv][splits] records start (a window on this GPU, or a peer's over
// NVLink).
struct rank_stride_recs {
  const float *base;
  size_t stride; // floats from one rank's records to the next
  __device__ const float *operator()(int r) const { return base + r * stride; }
};

// Output row (sequence b, query head h = hk * G + g) from R ranks' records,
// by the whole block (kCombineThreads threads, D <= 2 * kCombineThreads):
// the largest log-sum-exp first, then the chunks' weights kCombineThreads
// at a time through shared memory (sh: kCombineThreads + 32 floats), each
// thread summing its elements of the row. out is [B][Hq][D] bf16.
constexpr int kCombineThreads = 128, kAhead = 8;
template <typename RankRecs>
__device__ void combine_row(int Hq, int Hkv, int D, int splits, int R, RankRecs recs, int b, int h,
                            uint16_t *out, float *sh) {
  const int G = Hq / Hkv, hk = h / G, g = h % G, N = R * splits, t = threadIdx.x;
  const size_t RF = ps_decode_record_floats(G, D);
  const size_t first = ((size_t)b * Hkv + hk) * splits * RF;
  float M = -INFINITY;
  for (int i = t; i < N; i += kCombineThreads)
    M = fmaxf(M, recs(i / splits)[first + (size_t)(i % splits) * RF + (size_t)G * D + g]);
  M = block_max(M, sh + kCombineThreads);
  float acc0 = 0.f, acc1 = 0.f, sum = 0.f;
  for (int base = 0; base < N; base += kCombineThreads) {
    float w = 0.f;
    if (base + t < N && M != -INFINITY) { // an empty chunk: 0
      const float lse = recs((base + t) / splits)[first + (size_t)((base + t) % splits) * RF +
                                                  (size_t)G * D + g];
      w = expf(lse - M);
    }
    __syncthreads(); // the last round's weights are read
    sh[t] = w;
    __syncthreads();
    // kAhead chunks' loads in flight at once: one at a time, the row's
    // chunks would cost a memory (or NVLink) latency each
    const int n = min(kCombineThreads, N - base);
    for (int i = 0; i < n; i += kAhead) {
      float wv[kAhead], o0[kAhead], o1[kAhead];
#pragma unroll
      for (int j = 0; j < kAhead; j++) {
        wv[j] = o0[j] = o1[j] = 0.f;
        if (i + j < n) {
          const float *o = recs((base + i + j) / splits) + first +
                           (size_t)((base + i + j) % splits) * RF + (size_t)g * D;
          wv[j] = sh[i + j];
          if (t < D) o0[j] = o[t];
          if (t + kCombineThreads < D) o1[j] = o[t + kCombineThreads];
        }
      }
#pragma unroll
      for (int j = 0; j < kAhead; j++) {
        sum += wv[j];
        acc0 = fmaf(wv[j], o0[j], acc0);
        acc1 = fmaf(wv[j], o1[j], acc1);
      }
    }
  }
  uint16_t *row = out + ((size_t)b * Hq + h) * D;
  if (t < D) row[t] = __bfloat16_as_ushort(__float2bfloat16(sum > 0.f ? acc0 / sum : 0.f));
  if (t + kCombineThreads < D)
    row[t + kCombineThreads] = __bfloat16_as_ushort(__float2bfloat16(sum > 0.f ? acc1 / sum : 0.f));
  __syncthreads(); // sh is free again
}

} // namespace ps_decode_dev

#endif
