/* The fused AllGather+GEMM operator (<perseus/ag_gemm.h>) on every
 * visible GPU, one forked rank each, push and (over NVLink) pull: three
 * steps a case with new A and B each step (the window's halves alternate,
 * B moves between two buffers), every rank's whole C against the fp64
 * product (ps_ag_gemm_count_wrong). Cases: M off the 128-row tile, N off
 * the 128-column tile, M smaller than the rank count (empty shards),
 * shards that split a tile's rows, and few rows over a long K (split-K). Refused by name: K not a multiple of 64,
 * a bad mode, pull beyond NVLink, misaligned pointers. A step that one
 * rank never runs ends on the others after PERSEUS_AG_GEMM_TIMEOUT_MS, or at
 * an abort, naming that rank; a capturing stream and ranks that disagree
 * are refused by name (op_faults.cuh).
 * -p lsa (default): NVLink; -p gin: P2P off, the rows cross perseus.
 * Exit: 0 passed, 1 failed, 77 fewer GPUs than -g asks (or none). */
#include <string.h>

#include <vector>

#include "opts.h"
#include "place_hash.cuh"
#include <perseus/ag_gemm.h>

#include "ps_ag_gemm.h"
#include "ps_moe_ref.h"
#include "op_faults.cuh"
#include "tile_comm.cuh"

struct ag_cfg {
  int ngpus, path, watchdog_s, repeat, only;
};

static const ps_ag_gemm_shape_t ag_cases[] = {
    {300, 200, 128}, // M and N off the tile
    {1, 64, 64},     // one row: every rank but one has an empty shard
    {256, 384, 512}, // whole tiles, a longer K
    {130, 136, 192}, // two rows past a tile; shards split tiles
    {20, 256, 1088}, // few rows: K split, 17 k-steps over 3 splits
};

/* A value in [-1, 1) from a hash of its place, alike on every rank. */
static uint16_t ag_value(uint64_t seed, int what, size_t i, size_t j)
{
  return ps_float_to_bf16(ps_place_value(seed ^ ((uint64_t)what << 62) ^ (i << 24) ^ j));
}

/* One case in one mode: 3 steps; returns the wrong elements seen. */
static long long ag_case_run(gc_world &w, const ps_ag_gemm_shape_t &s, int mode, int rank, int R)
{
  const size_t M = s.m, N = s.n, K = s.k;
  int r0, r1;
  ps_ag_gemm_shard(s.m, R, rank, &r0, &r1);
  perseus_ag_gemm_t *f = NULL;
  const perseus_ag_gemm_shape_t ps = {s.m, s.n, s.k};
  if (perseus_ag_gemm_create(w.comm, &ps, mode, &f))
    gc_die(__FILE__, __LINE__, "fused create: %s", perseus_ag_gemm_last_error());
  uint16_t *a, *bt[2], *c;
  GC_CUDA(cudaMalloc(&a, (r1 > r0 ? r1 - r0 : 1) * K * 2), "a");
  for (int i = 0; i < 2; i++) GC_CUDA(cudaMalloc(&bt[i], N * K * 2), "bt");
  GC_CUDA(cudaMalloc(&c, M * N * 2), "c");
  std::vector<uint16_t> ha(M * K), hb(K * N), hbt(N * K), hc(M * N);
  long long wrong = 0;
  for (int step = 0; step < 3; step++) {
    const uint64_t seed = 0xa9 + 7919 * step;
    for (size_t i = 0; i < M; i++)
      for (size_t k = 0; k < K; k++) ha[i * K + k] = ag_value(seed, 0, i, k);
    for (size_t n = 0; n < N; n++)
      for (size_t k = 0; k < K; k++) hb[k * N + n] = hbt[n * K + k] = ag_value(seed, 1, n, k);
    /* on the step's stream, which does not wait for the legacy one (and a
     * synchronous copy from pageable memory may return before its DMA ends) */
    if (r1 > r0)
      GC_CUDA(cudaMemcpyAsync(a, ha.data() + r0 * K, (r1 - r0) * K * 2, cudaMemcpyHostToDevice, w.stream), "a");
    GC_CUDA(cudaMemcpyAsync(bt[step % 2], hbt.data(), N * K * 2, cudaMemcpyHostToDevice, w.stream), "bt");
    GC_CUDA(cudaMemsetAsync(c, 0xff, M * N * 2, w.stream), "c"); /* NaN until written */
    if (perseus_ag_gemm_step(f, a, bt[step % 2], c, w.stream))
      gc_die(__FILE__, __LINE__, "fused step: %s", perseus_ag_gemm_last_error());
    GC_CUDA(cudaStreamSynchronize(w.stream), "rank %d, step %d", rank, step);
    GC_CUDA(cudaMemcpy(hc.data(), c, M * N * 2, cudaMemcpyDeviceToHost), "c");
    double worst = 0;
    const long bad = ps_ag_gemm_count_wrong(&s, ha.data(), hb.data(), hc.data(), &worst);
    if (bad) {
      double want = 0; /* element [0][0], to tell a missing row (0 or NaN) from a wrong one */
      for (size_t k = 0; k < K; k++) want += (double)ps_bf16_to_float(ha[k]) * ps_bf16_to_float(hb[k * N]);
      fprintf(stderr, "ag_gemm_test: rank %d, %s, M %zu N %zu K %zu, step %d: %ld of %zu elements wrong "
              "(worst %.3g past the bound; C[0][0] %g, want %g)\n", rank, mode ? "pull" : "push", M, N, K, step,
              bad, hc.size(), worst, ps_bf16_to_float(hc[0]), want);
    }
    wrong += bad;
  }
  if (perseus_ag_gemm_step(f, a, bt[0] + 1, c, w.stream) != -1 || !strstr(perseus_ag_gemm_last_error(), "aligned")) {
    fprintf(stderr, "ag_gemm_test: rank %d: a misaligned B not refused by name (%s)\n", rank,
            perseus_ag_gemm_last_error());
    wrong++;
  }
  GC_CUDA(cudaDeviceSynchronize(), "rank %d", rank);
  perseus_ag_gemm_destroy(f);
  cudaFree(a), cudaFree(bt[0]), cudaFree(bt[1]), cudaFree(c);
  return wrong;
}

/* create must refuse `s` in `mode` with `want` in its reason. */
static int ag_refused(gc_world &w, const ps_ag_gemm_shape_t &s, int mode, const char *want)
{
  perseus_ag_gemm_t *f = NULL;
  const perseus_ag_gemm_shape_t ps = {s.m, s.n, s.k};
  if (perseus_ag_gemm_create(w.comm, &ps, mode, &f) == -1 && strstr(perseus_ag_gemm_last_error(), want)) return 0;
  fprintf(stderr, "ag_gemm_test: M %d N %d K %d mode %d not refused with '%s' (%s)\n", s.m, s.n, s.k, mode, want,
          perseus_ag_gemm_last_error());
  perseus_ag_gemm_destroy(f);
  return 1;
}

/* The fault cases' operator: M 256, N 256, K 128 (a tile of rows per rank
 * on 2 ranks), inputs zero. */
struct ag_fault_in {
  uint16_t *a, *b, *c;
};
static const perseus_ag_gemm_shape_t ag_fault_shape = {256, 256, 128};

/* An operator whose gathered-A window takes 256 MiB (2 halves of M x K bf16). */
static const perseus_ag_gemm_shape_t ag_big_shape = {8192, 256, 8192};
static const size_t ag_big_window = (size_t)2 * ag_big_shape.m * ag_big_shape.k * 2;

static void *ag_create(gc_world *w, const perseus_ag_gemm_shape_t &s)
{
  perseus_ag_gemm_t *f = NULL;
  if (perseus_ag_gemm_create(w->comm, &s, PERSEUS_AG_GEMM_PUSH, &f))
    return NULL;
  return f;
}

static int ag_fault_step(void *f, void *ctx, cudaStream_t st)
{
  const ag_fault_in &in = *(const ag_fault_in *)ctx;
  return perseus_ag_gemm_step((perseus_ag_gemm_t *)f, in.a, in.b, in.c, st);
}

static int ag_faults(gc_world *w, int rank, int R)
{
  const perseus_ag_gemm_shape_t &s = ag_fault_shape;
  ag_fault_in in = {NULL, NULL, NULL};
  GC_CUDA(cudaMalloc(&in.a, (size_t)s.m * s.k * 2), "a");
  GC_CUDA(cudaMalloc(&in.b, (size_t)s.n * s.k * 2), "b");
  GC_CUDA(cudaMalloc(&in.c, (size_t)s.m * s.n * 2), "c");
  GC_CUDA(cudaMemset(in.a, 0, (size_t)s.m * s.k * 2), "a");
  GC_CUDA(cudaMemset(in.b, 0, (size_t)s.n * s.k * 2), "b");
  const op_fault_ops o = {
      "ag_gemm_test", "PERSEUS_AG_GEMM_TIMEOUT_MS", &in,
      [](gc_world *w, void *) { return ag_create(w, ag_fault_shape); }, ag_fault_step,
      [](void *f) { return perseus_ag_gemm_check((perseus_ag_gemm_t *)f); },
      [](void *f) { perseus_ag_gemm_abort((perseus_ag_gemm_t *)f); }, perseus_ag_gemm_last_error,
      [](void *f) { perseus_ag_gemm_destroy((perseus_ag_gemm_t *)f); },
      [](gc_world *w, void *) { return ag_create(w, ag_big_shape); }, ag_big_window};
  const int bad = op_faults(o, w, rank, R);
  cudaFree(in.a), cudaFree(in.b), cudaFree(in.c);
  return bad;
}

static int ag_child(int rank, void *arg)
{
  const ag_cfg &c = *(const ag_cfg *)arg;
  const int R = c.ngpus;
  gc_world w;
  if (gc_world_init(&w, rank, R) != ncclSuccess) return GP_EXIT_REFUSED;
  long long wrong = 0;
  int checks = 0;
  for (int rep = 0; rep < c.repeat; rep++)
    for (int ci = 0; ci < (int)(sizeof ag_cases / sizeof ag_cases[0]); ci++)
      for (int mode = PERSEUS_AG_GEMM_PUSH; mode <= (c.path == TT_LSA ? PERSEUS_AG_GEMM_PULL : PERSEUS_AG_GEMM_PUSH); mode++) {
        const ps_ag_gemm_shape_t &s = ag_cases[ci];
        if (c.only >= 0 && ci != c.only) continue;
        gp_progress("ag_gemm", rep, "M %d N %d K %d, %s", s.m, s.n, s.k, mode ? "pull" : "push");
        const long long bad = ag_case_run(w, s, mode, rank, R);
        wrong += bad, checks++;
        if (rank == 0)
          printf("ag_gemm_test: M %4d N %4d K %4d ranks %d %s: %s\n", s.m, s.n, s.k, R, mode ? "pull" : "push",
                 bad ? "FAIL" : "ok");
      }
  gp_progress("ag_gemm", -1, "a step one rank skips");
  const int fault_bad = ag_faults(&w, rank, R);
  wrong += fault_bad, checks++;
  if (rank == 0) printf("ag_gemm_test: faults and refusals (push): %s\n", fault_bad ? "FAIL" : "ok");
  wrong += ag_refused(w, {64, 64, 72}, PERSEUS_AG_GEMM_PUSH, "k 72");
  wrong += ag_refused(w, {64, 64, 64}, 7, "mode 7");
  wrong += ag_refused(w, {64, 60, 64}, PERSEUS_AG_GEMM_PUSH, "n 60");
  if (c.path != TT_LSA) wrong += ag_refused(w, {64, 64, 64}, PERSEUS_AG_GEMM_PULL, "use push");
  if (rank == 0)
    printf("ag_gemm_test: %d cases on %d ranks (%s): %s\n", checks, R, tt_path_names[c.path],
           wrong ? "FAILED" : "passed");
  gc_world_destroy(&w);
  return wrong ? 1 : 0;
}

static void ag_usage(FILE *f)
{
  fprintf(f, "usage: perseus_ag_gemm_test [-g GPUS] [-p lsa|gin] [-r REPEAT] [-c INDEX] [-W SECS]\n"
             "  -g GPUs, one process each (0: every visible one; at least 1)\n"
             "  -r runs of the whole case list (default 1); -c only case INDEX (from 0; default all)\n"
             "  -p lsa: NVLink (push and pull); gin: P2P off, the rows cross perseus (push)\n");
}

int main(int argc, char **argv)
{
  static ag_cfg c;
  static const char *const paths[] = {"lsa", "gin"};
  static const int path_values[] = {TT_LSA, TT_GIN};
  const ps_opt_t opts[] = {
      PS_OPT_INT('g', &c.ngpus, "0", 0, GP_MAX_RANKS),
      PS_OPT_NAME('p', &c.path, "lsa", paths, path_values, 2),
      PS_OPT_INT('W', &c.watchdog_s, "120", 1, 86400),
      PS_OPT_INT('r', &c.repeat, "1", 1, 10000),
      PS_OPT_INT('c', &c.only, "-1", -1, (int)(sizeof ag_cases / sizeof ag_cases[0]) - 1),
  };
  ps_opts_parse(argc, argv, "perseus_ag_gemm_test", opts, PS_OPTS_N(opts), ag_usage, 1);
  if (gp_init("perseus_ag_gemm_test")) return 1;
  int rc = tt_start(c.path, 0, 1, &c.ngpus, c.watchdog_s, 1);
  if (rc >= 0) return rc;
  int codes[GP_MAX_RANKS];
  return gp_run(c.ngpus, 0, ag_child, &c, c.watchdog_s, "ag_gemm test", NULL, NULL, codes) ? 1 : 0;
}
