/* perseus_decode_perf: split-KV decode attention (Flash-Decode) with the
 * KV cache of every sequence split by tokens over the GPUs, the
 * bulk-synchronous way a user writes it today: each rank's partial over its
 * shard (decode/ps_decode_gpu.h), ncclAllGather of every rank's partial
 * outputs and log-sum-exps, and the combine on every rank. Columns, per
 * shape: the local work alone (partial + combine of one rank's chunks: the
 * floor the collective adds to), the baseline, their ratio, and #wrong (the
 * combined output against the fp64 reference where the host can afford it,
 * else "-"). The fused operators (push, pull) come next to these columns.
 * Times are rank 0's medians over -n steps, each started after a host
 * barrier (rank 0 waits for the others inside the all-gather). One forked
 * process per GPU; -p lsa: NCCL over NVLink; -p gin: P2P off, so the
 * all-gather crosses perseus (with PERSEUS_TEST_HOSTS for pretend hosts).
 * Exit: 0 ran, 1 failure, 77 no GPU. */
#include <algorithm>
#include <math.h>
#include <vector>

#include <cuda_bf16.h>

#include "opts.h"
#include "ps_decode.h"
#include "ps_decode_gpu.h"
#include "tile_comm.cuh"

#define DP_MAX 8

struct dp_cfg {
  int ngpus, iters, warmup, path, q_heads, kv_heads, head_dim, watchdog_s;
  int nbatch, batch[DP_MAX], nctx, ctx[DP_MAX];
  double check_flops;
  uint64_t seed;
};

/* Input values from a hash of their place, on host and device alike, so the
 * reference needs no copy from any rank. what: 0 q, 1 k, 2 v; t the token's
 * place in the whole sequence. */
__host__ __device__ inline float dp_value(uint64_t seed, int what, size_t b, size_t h, size_t t,
                                          size_t d)
{
  uint64_t x = seed ^ ((uint64_t)what << 60) ^ (b << 44) ^ (h << 36) ^ (t << 12) ^ d;
  x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27, x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  const float u = (float)(x >> 40) / (float)(1 << 24) * 2.f - 1.f;
  return what == 1 ? 2.f * u : u;
}

/* Rows [B][heads][stride][D]; row t of the shard is token first + t. */
__global__ void dp_fill(uint16_t *p, uint64_t seed, int what, int B, int heads, size_t stride,
                        int first, int D)
{
  const size_t n = (size_t)B * heads * stride * D;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t d = i % D, t = i / D % stride, h = i / D / stride % heads, b = i / D / stride / heads;
    p[i] = __bfloat16_as_ushort(__float2bfloat16(dp_value(seed, what, b, h, first + t, d)));
  }
}

static double bf16_value(float f) { return (double)__bfloat162float(__float2bfloat16(f)); }

/* The combined output against attention over the whole sequences, in fp64
 * from the same values; returns how many elements are off. */
static long long dp_check(const dp_cfg &c, const ps_decode_config_t &dc, const std::vector<int> &len,
                          const std::vector<uint16_t> &out, double scale)
{
  const size_t B = dc.batch, Hq = dc.q_heads, Hkv = dc.kv_heads, D = dc.head_dim, T = dc.max_context;
  std::vector<double> q(B * Hq * D), k(B * Hkv * T * D), v(k.size()), ref(B * Hq * D), lse(B * Hq);
  for (size_t b = 0; b < B; b++)
    for (size_t h = 0; h < Hq; h++)
      for (size_t d = 0; d < D; d++) q[(b * Hq + h) * D + d] = bf16_value(dp_value(c.seed, 0, b, h, 0, d));
  for (size_t b = 0; b < B; b++)
    for (size_t h = 0; h < Hkv; h++)
      for (size_t t = 0; t < T; t++)
        for (size_t d = 0; d < D; d++) {
          const size_t i = ((b * Hkv + h) * T + t) * D + d;
          k[i] = bf16_value(dp_value(c.seed, 1, b, h, t, d));
          v[i] = bf16_value(dp_value(c.seed, 2, b, h, t, d));
        }
  ps_decode_ref_partial(&dc, scale, q.data(), k.data(), v.data(), T, len.data(), ref.data(), lse.data());
  long long wrong = 0;
  for (size_t i = 0; i < out.size(); i++) {
    const double got = (double)__bfloat162float(__ushort_as_bfloat16(out[i]));
    if (!(fabs(got - ref[i]) <= fabs(ref[i]) / 256 + 1e-3)) wrong++;
  }
  return wrong;
}

static double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

static int dp_child(int rank, void *arg)
{
  const dp_cfg &c = *(const dp_cfg *)arg;
  const int R = c.ngpus;
  gc_world w;
  if (gc_world_init(&w, rank, R) != ncclSuccess) return GP_EXIT_REFUSED;
  int sms = 0;
  GC_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, gc_rank_gpu(rank)), "rank %d", rank);
  cudaEvent_t e0, e1;
  GC_CUDA(cudaEventCreate(&e0), "rank %d", rank);
  GC_CUDA(cudaEventCreate(&e1), "rank %d", rank);
  for (int bi = 0; bi < c.nbatch; bi++)
    for (int ci = 0; ci < c.nctx; ci++) {
      ps_decode_config_t dc = {c.batch[bi], c.q_heads, c.kv_heads, c.head_dim, c.ctx[ci]};
      const size_t B = dc.batch, Hq = dc.q_heads, Hkv = dc.kv_heads, D = dc.head_dim;
      int start, end;
      ps_decode_shard(dc.max_context, R, rank, &start, &end);
      const size_t stride = (size_t)(dc.max_context + R - 1) / R;
      const int splits = ps_decode_splits(&dc, (int)stride, sms);
      const size_t part_o = B * Hq * splits * D, part = part_o + B * Hq * splits; /* [o | lse] */
      gp_progress("decode", -1, "B %zu context %d: allocating", B, dc.max_context);
      uint16_t *q, *k, *v, *out;
      float *mine, *all;
      int *n;
      GC_CUDA(cudaMalloc(&q, B * Hq * D * 2), "q");
      GC_CUDA(cudaMalloc(&k, B * Hkv * stride * D * 2), "k, %zu tokens", stride);
      GC_CUDA(cudaMalloc(&v, B * Hkv * stride * D * 2), "v, %zu tokens", stride);
      GC_CUDA(cudaMalloc(&out, B * Hq * D * 2), "out");
      GC_CUDA(cudaMalloc(&mine, part * 4), "partials");
      GC_CUDA(cudaMalloc(&all, R * part * 4), "gathered partials");
      GC_CUDA(cudaMalloc(&n, B * sizeof(int)), "lengths");
      std::vector<int> shard_len(B, end - start), len(B, dc.max_context);
      GC_CUDA(cudaMemcpy(n, shard_len.data(), B * sizeof(int), cudaMemcpyHostToDevice), "lengths");
      dp_fill<<<1024, 256, 0, w.stream>>>(q, c.seed, 0, dc.batch, dc.q_heads, 1, 0, dc.head_dim);
      dp_fill<<<1024, 256, 0, w.stream>>>(k, c.seed, 1, dc.batch, dc.kv_heads, stride, start, dc.head_dim);
      dp_fill<<<1024, 256, 0, w.stream>>>(v, c.seed, 2, dc.batch, dc.kv_heads, stride, start, dc.head_dim);
      const float scale = 1.f / sqrtf((float)D);
      std::vector<double> local_us, base_us;
      for (int it = 0; it < c.warmup + c.iters; it++) {
        gp_progress("decode", it, "B %zu context %d", B, dc.max_context);
        for (int pass = 0; pass < 2; pass++) { /* 0: local work alone, 1: the baseline */
          GC_CUDA(cudaStreamSynchronize(w.stream), "rank %d", rank);
          if (gp_barrier(R)) return 1;
          GC_CUDA(cudaEventRecord(e0, w.stream), "rank %d", rank);
          if (ps_decode_partial_gpu(&dc, scale, q, k, v, stride, n, splits, mine, mine + part_o, w.stream))
            gc_die(__FILE__, __LINE__, "partial: %s", ps_decode_last_error());
          if (pass)
            GC_NCCL(ncclAllGather(mine, all, part, ncclFloat32, w.comm, w.stream), "%zu floats", part);
          const float *o = pass ? all : mine;
          if (ps_decode_combine_gpu(&dc, pass ? R : 1, splits, o, part, o + part_o, part, out, w.stream))
            gc_die(__FILE__, __LINE__, "combine: %s", ps_decode_last_error());
          GC_CUDA(cudaEventRecord(e1, w.stream), "rank %d", rank);
          GC_CUDA(cudaEventSynchronize(e1), "rank %d", rank);
          float ms = 0;
          GC_CUDA(cudaEventElapsedTime(&ms, e0, e1), "rank %d", rank);
          if (it >= c.warmup) (pass ? base_us : local_us).push_back(ms * 1e3);
        }
      }
      const double flops = 4.0 * B * Hq * (double)dc.max_context * D;
      char wrong[32] = "-";
      if (rank == 0 && flops <= c.check_flops) {
        std::vector<uint16_t> host(B * Hq * D);
        GC_CUDA(cudaMemcpy(host.data(), out, host.size() * 2, cudaMemcpyDeviceToHost), "out");
        gp_progress("decode", -1, "B %zu context %d: checking against fp64", B, dc.max_context);
        snprintf(wrong, sizeof(wrong), "%lld", dp_check(c, dc, len, host, scale));
      }
      if (rank == 0)
        printf("%6zu %8d %4zu %4zu %4zu %6d %6d %10.1f %10.1f %7.2f %8s\n", B, dc.max_context, Hq, Hkv, D,
               R, splits, median(local_us), median(base_us), median(base_us) / median(local_us), wrong);
      cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(out), cudaFree(mine), cudaFree(all), cudaFree(n);
    }
  gc_world_destroy(&w);
  return 0;
}

static void dp_usage(FILE *f)
{
  fprintf(f,
          "usage: perseus_decode_perf [-g GPUS] [-p lsa|gin] [-b BATCHES] [-c CONTEXTS] [-H Q_HEADS]\n"
          "         [-K KV_HEADS] [-D HEAD_DIM] [-n ITERS] [-w WARMUP] [-x CHECK_FLOPS] [-s SEED] [-W SECS]\n"
          "  -g GPUs, one process each (0: every visible one; at least 1)\n"
          "  -p lsa: NCCL over NVLink; gin: P2P off, NCCL's collectives through perseus\n"
          "  -b comma-separated batch sizes (1..4096), -c context lengths in tokens (1..2^22)\n"
          "  -H, -K, -D: query heads, KV heads (a divisor of -H, 1..16 query heads each), head dim\n"
          "     (a multiple of 8, 8..256)\n"
          "  -x: check against the fp64 reference where 4*B*Hq*context*D is at most this many GFLOP (0: never)\n");
}

int main(int argc, char **argv)
{
  static dp_cfg c;
  const char *blist = NULL, *clist = NULL;
  static const char *const paths[] = {"lsa", "gin"};
  static const int path_values[] = {TT_LSA, TT_GIN};
  int check_gflops = 0;
  const ps_opt_t opts[] = {
      PS_OPT_INT('g', &c.ngpus, "0", 0, GP_MAX_RANKS),
      PS_OPT_NAME('p', &c.path, "lsa", paths, path_values, 2),
      PS_OPT_STR('b', &blist, "1,8,64"),
      PS_OPT_STR('c', &clist, "8192,32768,131072"),
      PS_OPT_INT('H', &c.q_heads, "32", 1, 1024),
      PS_OPT_INT('K', &c.kv_heads, "8", 1, 1024),
      PS_OPT_INT('D', &c.head_dim, "128", 8, PS_DECODE_MAX_HEAD_DIM),
      PS_OPT_INT('n', &c.iters, "20", 1, 1 << 20),
      PS_OPT_INT('w', &c.warmup, "3", 0, 1 << 20),
      PS_OPT_INT('x', &check_gflops, "1", 0, 1 << 20),
      PS_OPT_SEED('s', &c.seed, "1"),
      PS_OPT_INT('W', &c.watchdog_s, "120", 1, 86400),
  };
  ps_opts_parse(argc, argv, "perseus_decode_perf", opts, PS_OPTS_N(opts), dp_usage, 1);
  c.check_flops = check_gflops * 1e9;
  c.nbatch = gp_parse_int_list(blist, 1, 4096, c.batch, DP_MAX);
  c.nctx = gp_parse_int_list(clist, 1, 1 << 22, c.ctx, DP_MAX);
  if (c.nbatch < 1 || c.nctx < 1) {
    fprintf(stderr, "perseus_decode_perf: bad -%c '%s': expected up to %d comma-separated numbers in "
            "%s\n", c.nbatch < 1 ? 'b' : 'c', c.nbatch < 1 ? blist : clist, DP_MAX,
            c.nbatch < 1 ? "1..4096" : "1..4194304");
    return 1;
  }
  for (int bi = 0; bi < c.nbatch; bi++)
    for (int ci = 0; ci < c.nctx; ci++) {
      ps_decode_config_t dc = {c.batch[bi], c.q_heads, c.kv_heads, c.head_dim, c.ctx[ci]};
      const int group = dc.kv_heads > 0 ? dc.q_heads / dc.kv_heads : 0;
      if (ps_decode_check_config(&dc, c.ngpus ? c.ngpus : 1) || /* shapes first, GPU or not */
          (group & (group - 1)) || group > PS_DECODE_MAX_GROUP) {
        fprintf(stderr, "perseus_decode_perf: B %d, context %d, Hq %d, Hkv %d, D %d: %s\n",
                dc.batch, dc.max_context, dc.q_heads, dc.kv_heads, dc.head_dim,
                *ps_decode_last_error() ? ps_decode_last_error()
                                        : "query heads per KV head must be 1, 2, 4, 8 or 16");
        return 1;
      }
    }
  if (gp_init("perseus_decode_perf")) return 1;
  int rc = tt_start(c.path, 0, 1, &c.ngpus, c.watchdog_s, 1);
  if (rc >= 0) return rc;
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  printf("# machine: host %s, %d GPUs:", host, c.ngpus);
  gc_print_rank_gpus(c.ngpus);
  printf("\n# path %s, %d steps (+%d warmup), seed %llu; times in us, rank 0's medians\n",
         tt_path_names[c.path], c.iters, c.warmup, (unsigned long long)c.seed);
  printf("# %6s %8s %4s %4s %4s %6s %6s %10s %10s %7s %8s\n", "batch", "context", "Hq", "Hkv", "D",
         "ranks", "splits", "local", "baseline", "ratio", "#wrong");
  int codes[GP_MAX_RANKS];
  return gp_run(c.ngpus, 0, dp_child, &c, c.watchdog_s, "decode perf", NULL, NULL, codes) ? 1 : 0;
}
