/* perseus_decode_perf: split-KV decode attention (Flash-Decode) with the
 * KV cache of every sequence split by tokens over the GPUs. The baseline is
 * the bulk-synchronous way a user writes it today: each rank's partial over
 * its shard (decode/ps_decode_gpu.h), ncclAllGather of every rank's partial
 * records, and the combine on every rank. Against it, the fused operator
 * (<perseus/decode.h>), one kernel a step, pushing records into the
 * peers' windows or (NVLink) leaving them for the peers to pull. Columns,
 * per shape: the local work alone (partial + combine of one rank's chunks),
 * the baseline, push, pull, baseline over the faster fused, and #wrong of
 * each (the output against the fp64 reference where the host can afford
 * it, else "-"). Times are per step, -n steps back to back after a host
 * barrier, rank 0's median over -r reps. One forked process per GPU; -p lsa: NCCL over
 * NVLink; -p gin: P2P off, so the all-gather and the pushes cross perseus
 * (with PERSEUS_TEST_HOSTS for pretend hosts). Exit: 0 ran, 1 failure, 77
 * no GPU. */
#include <algorithm>
#include <math.h>
#include <vector>

#include <cuda_bf16.h>

#include "opts.h"
#include "ps_decode.h"
#include <perseus/decode.h>
#include "ps_decode_gpu.h"
#include "decode_inputs.cuh"
#include "tile_comm.cuh"

#define DP_MAX 8

struct dp_cfg {
  int ngpus, iters, warmup, reps, path, q_heads, kv_heads, head_dim, watchdog_s, splits;
  int nbatch, batch[DP_MAX], nctx, ctx[DP_MAX];
  double check_flops;
  uint64_t seed;
};

static double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/* The variants of a step, timed in turn: 0 local work alone, 1 the
 * baseline, 2 fused push, 3 fused pull (NVLink only). */
enum { DP_LOCAL, DP_BASE, DP_PUSH, DP_PULL, DP_N };

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
  const bool pull = c.path == TT_LSA; /* pull reads peers over NVLink */
  for (int bi = 0; bi < c.nbatch; bi++)
    for (int ci = 0; ci < c.nctx; ci++) {
      ps_decode_config_t dc = {c.batch[bi], c.q_heads, c.kv_heads, c.head_dim, c.ctx[ci]};
      const perseus_decode_config_t pc = {dc.batch, dc.q_heads, dc.kv_heads, dc.head_dim, dc.max_context};
      const size_t B = dc.batch, Hq = dc.q_heads, Hkv = dc.kv_heads, D = dc.head_dim;
      int start, end;
      ps_decode_shard(dc.max_context, R, rank, &start, &end);
      const size_t stride = (size_t)(dc.max_context + R - 1) / R;
      gp_progress("decode", -1, "B %zu context %d: the fused operators", B, dc.max_context);
      perseus_decode_t *fused[2] = {NULL, NULL};
      for (int m = 0; m < (pull ? 2 : 1); m++)
        if (perseus_decode_create(w.comm, &pc, (int)stride, c.splits, m, &fused[m]))
          gc_die(__FILE__, __LINE__, "fused %s: %s", m ? "pull" : "push", perseus_decode_last_error());
      const int splits = perseus_decode_splits(fused[0]); /* the baseline cuts chunks alike */
      const size_t part = ps_decode_records_floats(&dc, splits);
      gp_progress("decode", -1, "B %zu context %d: allocating", B, dc.max_context);
      uint16_t *q, *k, *v, *out[DP_N];
      float *mine, *all;
      int *n;
      GC_CUDA(cudaMalloc(&q, B * Hq * D * 2), "q");
      GC_CUDA(cudaMalloc(&k, B * Hkv * stride * D * 2), "k, %zu tokens", stride);
      GC_CUDA(cudaMalloc(&v, B * Hkv * stride * D * 2), "v, %zu tokens", stride);
      for (int x = 0; x < DP_N; x++) GC_CUDA(cudaMalloc(&out[x], B * Hq * D * 2), "out");
      GC_CUDA(cudaMalloc(&mine, part * 4), "partials");
      GC_CUDA(cudaMalloc(&all, R * part * 4), "gathered partials");
      GC_CUDA(cudaMalloc(&n, B * sizeof(int)), "lengths");
      std::vector<int> shard_len(B, end - start), len(B, dc.max_context), first(B, start);
      GC_CUDA(cudaMemcpyAsync(n, shard_len.data(), B * sizeof(int), cudaMemcpyHostToDevice, w.stream), "lengths");
      if (dp_fill_all(c.seed, dc, stride, first, q, k, v, w.stream))
        gc_die(__FILE__, __LINE__, "filling the inputs: %s", cudaGetErrorString(cudaGetLastError()));
      const float scale = 1.f / sqrtf((float)D);
      std::vector<double> us[DP_N];
      /* one step of variant x, enqueued on the stream */
      auto step = [&](int x) {
        if (x == DP_PUSH || x == DP_PULL) {
          if (perseus_decode_step(fused[x - DP_PUSH], scale, q, k, v, stride, n, out[x], w.stream))
            gc_die(__FILE__, __LINE__, "fused step: %s", perseus_decode_last_error());
          return;
        }
        if (ps_decode_partial_gpu(&dc, scale, q, k, v, stride, n, splits, mine, w.stream))
          gc_die(__FILE__, __LINE__, "partial: %s", perseus_decode_last_error());
        if (x == DP_BASE)
          GC_NCCL(ncclAllGather(mine, all, part, ncclFloat32, w.comm, w.stream), "%zu floats", part);
        if (ps_decode_combine_gpu(&dc, x == DP_BASE ? R : 1, splits, x == DP_BASE ? all : mine, part,
                                  out[x], w.stream))
          gc_die(__FILE__, __LINE__, "combine: %s", perseus_decode_last_error());
      };
      /* Steps back to back, as a decoder runs them: the ranks' start skew
       * and the launch gaps are spread over -n steps. A rep's time over -n
       * is the step time; the median of -r reps is reported. */
      for (int x = 0; x < (pull ? DP_N : DP_PULL); x++)
        for (int rep = -1; rep < c.reps; rep++) { /* rep -1: the warmup steps */
          gp_progress("decode", rep, "B %zu context %d, variant %d", B, dc.max_context, x);
          GC_CUDA(cudaStreamSynchronize(w.stream), "rank %d", rank);
          if (gp_barrier(R)) return 1;
          GC_CUDA(cudaEventRecord(e0, w.stream), "rank %d", rank);
          for (int i = 0; i < (rep < 0 ? c.warmup : c.iters); i++) step(x);
          GC_CUDA(cudaEventRecord(e1, w.stream), "rank %d", rank);
          GC_CUDA(cudaEventSynchronize(e1), "rank %d", rank);
          float ms = 0;
          GC_CUDA(cudaEventElapsedTime(&ms, e0, e1), "rank %d", rank);
          if (rep >= 0) us[x].push_back(ms * 1e3 / c.iters);
        }
      const double flops = 4.0 * B * Hq * (double)dc.max_context * D;
      char wrong[48] = "-";
      if (rank == 0 && flops <= c.check_flops) {
        long long bad[DP_N] = {0, 0, 0, 0};
        gp_progress("decode", -1, "B %zu context %d: checking against fp64", B, dc.max_context);
        const std::vector<double> ref = dp_reference(c.seed, dc, len, scale);
        for (int x = DP_BASE; x < (pull ? DP_N : DP_PULL); x++) {
          std::vector<uint16_t> host(B * Hq * D);
          GC_CUDA(cudaMemcpy(host.data(), out[x], host.size() * 2, cudaMemcpyDeviceToHost), "out");
          bad[x] = dp_wrong(ref, host);
        }
        if (pull) snprintf(wrong, sizeof(wrong), "%lld/%lld/%lld", bad[DP_BASE], bad[DP_PUSH], bad[DP_PULL]);
        else snprintf(wrong, sizeof(wrong), "%lld/%lld/-", bad[DP_BASE], bad[DP_PUSH]);
      }
      if (rank == 0) {
        const double base = median(us[DP_BASE]), push = median(us[DP_PUSH]);
        const double pl = pull ? median(us[DP_PULL]) : 0, best = pull && pl < push ? pl : push;
        char pull_col[16] = "-";
        if (pull) snprintf(pull_col, sizeof(pull_col), "%.1f", pl);
        printf("%6zu %8d %4zu %4zu %4zu %6d %6d %9.1f %9.1f %9.1f %9s %7.2f %12s\n", B, dc.max_context, Hq,
               Hkv, D, R, splits, median(us[DP_LOCAL]), base, push, pull_col, base / best, wrong);
      }
      for (int m = 0; m < 2; m++) perseus_decode_destroy(fused[m]);
      cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(mine), cudaFree(all), cudaFree(n);
      for (int x = 0; x < DP_N; x++) cudaFree(out[x]);
    }
  gc_world_destroy(&w);
  return 0;
}

static void dp_usage(FILE *f)
{
  fprintf(f,
          "usage: perseus_decode_perf [-g GPUS] [-p lsa|gin] [-b BATCHES] [-c CONTEXTS] [-H Q_HEADS]\n"
          "         [-K KV_HEADS] [-D HEAD_DIM] [-S SPLITS] [-n STEPS] [-w WARMUP] [-r REPS] [-x CHECK_FLOPS]\n"
          "         [-s SEED] [-W SECS]\n"
          "  -g GPUs, one process each (0: every visible one; at least 1)\n"
          "  -p lsa: NCCL over NVLink; gin: P2P off, NCCL's collectives through perseus\n"
          "  -b comma-separated batch sizes (1..4096), -c context lengths in tokens (1..2^22)\n"
          "  -H, -K, -D: query heads, KV heads (a divisor of -H, 1..16 query heads each), head dim\n"
          "     (a multiple of 8, 8..256)\n"
          "  -S chunks per (sequence, KV head) row of a shard, the same for every variant (0: automatic)\n"
          "  -n steps back to back per timed rep (default 20), -w warmup steps, -r timed reps (median)\n"
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
      PS_OPT_INT('S', &c.splits, "0", 0, 65535),
      PS_OPT_INT('n', &c.iters, "20", 1, 1 << 20),
      PS_OPT_INT('w', &c.warmup, "3", 0, 1 << 20),
      PS_OPT_INT('r', &c.reps, "5", 1, 1000),
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
    return 2;
  }
  for (int bi = 0; bi < c.nbatch; bi++)
    for (int ci = 0; ci < c.nctx; ci++) {
      ps_decode_config_t dc = {c.batch[bi], c.q_heads, c.kv_heads, c.head_dim, c.ctx[ci]};
      const int group = dc.kv_heads > 0 ? dc.q_heads / dc.kv_heads : 0;
      if (ps_decode_check_config(&dc, c.ngpus ? c.ngpus : 1) || /* shapes first, GPU or not */
          (group & (group - 1)) || group > PS_DECODE_MAX_GROUP) {
        fprintf(stderr, "perseus_decode_perf: B %d, context %d, Hq %d, Hkv %d, D %d: %s\n",
                dc.batch, dc.max_context, dc.q_heads, dc.kv_heads, dc.head_dim,
                *perseus_decode_last_error() ? perseus_decode_last_error()
                                        : "query heads per KV head must be 1, 2, 4, 8 or 16");
        return 2;
      }
    }
  if (gp_init("perseus_decode_perf")) return 1;
  int rc = tt_start(c.path, 0, 1, &c.ngpus, c.watchdog_s, 1);
  if (rc >= 0) return rc;
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  printf("# machine: host %s, %d GPUs:", host, c.ngpus);
  gc_print_rank_gpus(c.ngpus);
  printf("\n# path %s, %d reps of %d steps back to back (+%d warmup steps), seed %llu; us per step,\n"
         "# rank 0's median rep\n", tt_path_names[c.path], c.reps, c.iters, c.warmup,
         (unsigned long long)c.seed);
  printf("# local: partial + combine of this rank's chunks alone; baseline: partial, ncclAllGather, combine;\n"
         "# push/pull: the fused operator; speedup: baseline / the faster fused; #wrong: baseline/push/pull\n");
  printf("# %6s %8s %4s %4s %4s %6s %6s %9s %9s %9s %9s %7s %12s\n", "batch", "context", "Hq", "Hkv", "D",
         "ranks", "splits", "local", "baseline", "push", "pull", "speedup", "#wrong");
  int codes[GP_MAX_RANKS];
  return gp_run(c.ngpus, 0, dp_child, &c, c.watchdog_s, "decode perf", NULL, NULL, codes) ? 1 : 0;
}
