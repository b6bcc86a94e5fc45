// Flash-Decode's kernels (decode/ps_decode_gpu.h) on one GPU against the
// fp64 reference (decode/ps_decode.h): a sequence's KV cache split over R
// pretend ranks (1, 2, 3, 5; lengths below R leave shards empty), each
// shard's partials from the partial kernel in several chunks, gathered as
// an ncclAllGather would lay them out, then combined. Checked: every shard's
// partial output and log-sum-exp against the reference's for that shard,
// and the combined bf16 output against attention over the whole sequence;
// group sizes 1 to 16, head dims 8 to 256, lengths off any tile size. Also
// refused, by name: a group size the kernel lacks, zero chunks, misaligned rows. Exits 77
// without a GPU.
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "ps_decode.h"
#include "ps_decode_gpu.h"
#include "ps_moe_ref.h" // bf16 conversions
#include "unit_check.h"

#define CUDA_OK(call)                                                               \
  do {                                                                              \
    cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess) {                                                        \
      fprintf(stderr, "decode_test:%d: %s: %s\n", __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static double uniform() { // [-1, 1)
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (double)(rng >> 11) / (double)(1ULL << 52) - 1.0;
}

// Random bf16 values and the doubles they are.
static void fill(std::vector<uint16_t> &bits, std::vector<double> &vals, size_t n, double amp) {
  bits.resize(n), vals.resize(n);
  for (size_t i = 0; i < n; i++) {
    bits[i] = ps_float_to_bf16((float)(amp * uniform()));
    vals[i] = ps_bf16_to_float(bits[i]);
  }
}

template <typename T> static T *to_device(const std::vector<T> &h) {
  T *d = NULL;
  CUDA_OK(cudaMalloc(&d, h.size() * sizeof(T) + 1));
  CUDA_OK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// One configuration: B sequences of the given lengths over R pretend ranks.
static void run_case(const ps_decode_config_t &c, int R, const int *len, int sms) {
  const size_t B = c.batch, Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  const double scale = 1.0 / sqrt((double)D);
  int maxlen = 0;
  for (size_t b = 0; b < B; b++) maxlen = len[b] > maxlen ? len[b] : maxlen;
  std::vector<uint16_t> qb, kb, vb;
  std::vector<double> qd, kd, vd; // whole cache: [B][Hkv][maxlen][D]
  fill(qb, qd, B * Hq * D, 1.0);
  fill(kb, kd, B * Hkv * maxlen * D, 2.0);
  fill(vb, vd, B * Hkv * maxlen * D, 1.0);
  std::vector<double> ref(B * Hq * D), ref_lse(B * Hq);
  ps_decode_ref_partial(&c, scale, qd.data(), kd.data(), vd.data(), (size_t)maxlen, len, ref.data(),
                        ref_lse.data());

  // the shards: stride = the longest shard, each its own copy of its rows
  const size_t stride = (size_t)(maxlen + R - 1) / R;
  const int splits = ps_decode_splits(&c, (int)stride, sms);
  const size_t G = Hq / Hkv, RF = ps_decode_record_floats((int)G, (int)D);
  const size_t part = ps_decode_records_floats(&c, splits);
  float *recs_all = NULL;
  CUDA_OK(cudaMalloc(&recs_all, R * part * sizeof(float)));
  uint16_t *q_dev = to_device(qb);
  int bad_partial = 0;
  for (int r = 0; r < R; r++) {
    std::vector<uint16_t> ks(B * Hkv * stride * D + 1), vs(ks.size());
    std::vector<double> kds(ks.size()), vds(ks.size());
    std::vector<int> n(B);
    for (size_t b = 0; b < B; b++) {
      int start, end;
      ps_decode_shard(len[b], R, r, &start, &end);
      n[b] = end - start;
      for (size_t h = 0; h < Hkv; h++)
        for (int t = 0; t < n[b]; t++)
          for (size_t d = 0; d < D; d++) {
            const size_t from = ((b * Hkv + h) * maxlen + start + t) * D + d;
            const size_t to = ((b * Hkv + h) * stride + t) * D + d;
            ks[to] = kb[from], vs[to] = vb[from], kds[to] = kd[from], vds[to] = vd[from];
          }
    }
    uint16_t *k_dev = to_device(ks), *v_dev = to_device(vs);
    int *n_dev = to_device(n);
    EXPECT(ps_decode_partial_gpu(&c, (float)scale, q_dev, k_dev, v_dev, stride, n_dev, splits,
                                 recs_all + r * part, 0) == 0,
           "partial: %s", ps_decode_last_error());
    CUDA_OK(cudaDeviceSynchronize());
    // this shard against the reference: its chunks combined on the host
    std::vector<float> recs(part);
    CUDA_OK(cudaMemcpy(recs.data(), recs_all + r * part, part * sizeof(float), cudaMemcpyDeviceToHost));
    // row i = b * Hq + h's chunk s: record ((b * Hkv + h / G) * splits + s), head h % G
    auto rec = [&](size_t i, int s) { return &recs[((i / Hq * Hkv + i % Hq / G) * splits + s) * RF]; };
    auto lse = [&](size_t i, int s) { return rec(i, s)[G * D + i % Hq % G]; };
    std::vector<double> sref(B * Hq * D), sref_lse(B * Hq);
    ps_decode_ref_partial(&c, scale, qd.data(), kds.data(), vds.data(), stride, n.data(),
                          sref.data(), sref_lse.data());
    for (size_t i = 0; i < B * Hq; i++) {
      double m = -INFINITY, l = 0;
      for (int s = 0; s < splits; s++) m = fmax(m, lse(i, s));
      std::vector<double> acc(D, 0.0);
      for (int s = 0; s < splits && m != -INFINITY; s++) {
        if (lse(i, s) == -INFINITY) continue;
        const double w = exp(lse(i, s) - m);
        l += w;
        for (size_t d = 0; d < D; d++) acc[d] += w * rec(i, s)[i % Hq % G * D + d];
      }
      const double got_lse = l > 0 ? m + log(l) : -INFINITY;
      if (sref_lse[i] == -INFINITY ? got_lse != -INFINITY : fabs(got_lse - sref_lse[i]) > 1e-3)
        bad_partial++;
      for (size_t d = 0; d < D && l > 0; d++)
        if (fabs(acc[d] / l - sref[i * D + d]) > 1e-3 + 1e-3 * fabs(sref[i * D + d])) bad_partial++;
    }
    cudaFree(k_dev), cudaFree(v_dev), cudaFree(n_dev);
  }
  EXPECT(!bad_partial, "B %zu Hq %zu Hkv %zu D %zu R %d splits %d: %d partial values off", B, Hq, Hkv,
         D, R, splits, bad_partial);

  uint16_t *out_dev = NULL;
  CUDA_OK(cudaMalloc(&out_dev, B * Hq * D * sizeof(uint16_t)));
  EXPECT(ps_decode_combine_gpu(&c, R, splits, recs_all, part, out_dev, 0) == 0,
         "combine: %s", ps_decode_last_error());
  std::vector<uint16_t> out(B * Hq * D);
  CUDA_OK(cudaMemcpy(out.data(), out_dev, out.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  int wrong = 0;
  double worst = 0;
  for (size_t i = 0; i < out.size(); i++) {
    // bf16 keeps 8 bits: half an ulp of the value, plus fp32 sums' slack
    const double got = ps_bf16_to_float(out[i]), want = ref[i], err = fabs(got - want);
    worst = fmax(worst, err);
    if (!(err <= fabs(want) / 256 + 1e-3)) wrong++;
  }
  EXPECT(!wrong, "B %zu Hq %zu Hkv %zu D %zu R %d: %d of %zu outputs wrong (worst %.3g)", B, Hq, Hkv,
         D, R, wrong, out.size(), worst);
  printf("decode_test: B %zu Hq %2zu Hkv %zu D %3zu ranks %d splits %3d max len %5d: %s (worst %.2g)\n",
         B, Hq, Hkv, D, R, splits, maxlen, wrong || bad_partial ? "FAIL" : "ok", worst);
  cudaFree(recs_all), cudaFree(q_dev), cudaFree(out_dev);
}

int main() {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("decode_test: skipped: no GPU\n");
    return 77;
  }
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct {
    ps_decode_config_t c;
    int lens[4];
  } cases[] = {
      {{1, 32, 8, 128, 8192}, {4099}},            // GQA 4, a length off any tile
      {{4, 8, 8, 64, 4096}, {1, 2, 700, 4096}},   // MHA; lengths below the rank count
      {{3, 16, 2, 256, 2048}, {2048, 33, 1000}},  // group 8, the largest head dim
      {{2, 16, 1, 128, 1024}, {1024, 513}},       // group 16
      {{2, 4, 2, 8, 300}, {300, 3}},              // the smallest head dim
      {{1, 2, 1, 96, 65536}, {65536}},            // a long context, a head dim off 2^k
  };
  const int ranks[] = {1, 2, 3, 5};
  for (auto &k : cases)
    for (int R : ranks) {
      EXPECT(ps_decode_check_config(&k.c, R) == 0 && ps_decode_check_lengths(&k.c, k.lens) == 0,
             "case refused: %s", ps_decode_last_error());
      run_case(k.c, R, k.lens, sms);
    }

  // refusals name the value
  ps_decode_config_t odd = {1, 12, 4, 64, 16}; // group 3
  float dummy_f[1];
  alignas(16) uint16_t dummy_h[16];
  int dummy_n[1];
  EXPECT(ps_decode_partial_gpu(&odd, 1.f, dummy_h, dummy_h, dummy_h, 1, dummy_n, 1, dummy_f, 0) == -1 &&
             strstr(ps_decode_last_error(), "= 3 query heads"),
         "group 3 not refused by name (%s)", ps_decode_last_error());
  ps_decode_config_t ok = {1, 8, 8, 64, 16};
  EXPECT(ps_decode_partial_gpu(&ok, 1.f, dummy_h, dummy_h, dummy_h, 1, dummy_n, 0, dummy_f, 0) == -1 &&
             strstr(ps_decode_last_error(), "splits 0"),
         "zero chunks not refused by name (%s)", ps_decode_last_error());
  EXPECT(ps_decode_partial_gpu(&ok, 1.f, dummy_h + 1, dummy_h, dummy_h, 1, dummy_n, 1, dummy_f, 0) == -1 &&
             strstr(ps_decode_last_error(), "16-byte aligned"),
         "a misaligned q not refused by name (%s)", ps_decode_last_error());
  return unit_report("decode_test");
}
