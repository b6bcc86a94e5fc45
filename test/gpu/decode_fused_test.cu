/* The fused Flash-Decode operator (<perseus/decode.h>) on every
 * visible GPU, one forked rank each, push and (over NVLink) pull: three
 * steps a case, with new inputs each step (the window's halves alternate),
 * every rank's output against attention over the whole sequences in fp64.
 * Cases: group sizes 1 to 16, head dims 8 to 256, lengths off any tile and
 * shorter than the rank count (empty shards). Refused by name: a bad mode,
 * pull beyond NVLink, a shard longer than the operator was made for. A
 * step that one rank never runs ends on the others after
 * PERSEUS_DECODE_TIMEOUT_MS, or at an abort, naming that rank; a capturing
 * stream, ranks that disagree and a length past the shard are refused by
 * name (op_faults.cuh).
 * -p lsa (default): NVLink; -p gin: P2P off, the records cross perseus.
 * Exit: 0 passed, 1 failed, 77 fewer GPUs than -g asks (or none). */
#include <string.h>

#include <vector>

#include "decode_inputs.cuh"
#include "opts.h"
#include <perseus/decode.h>
#include "op_faults.cuh"
#include "tile_comm.cuh"

struct df_cfg {
  int ngpus, path, watchdog_s;
};

struct df_case {
  ps_decode_config_t c;
  int lens[4];
};

static const df_case df_cases[] = {
    {{3, 16, 2, 256, 2048}, {2048, 1, 1000}}, // group 8, the largest head dim, an empty shard
    {{2, 8, 8, 64, 4099}, {4099, 3}},         // MHA, lengths off any tile
    {{1, 32, 8, 128, 8192}, {8192}},          // GQA 4, the benchmark's shape
    {{2, 16, 1, 128, 1024}, {1024, 513}},     // group 16
    {{2, 4, 2, 8, 300}, {300, 3}},            // the smallest head dim
};

/* One case in one mode: 3 steps; returns the wrong outputs seen. */
static long long df_case_run(gc_world &w, const df_case &k, int mode, int rank, int R)
{
  const ps_decode_config_t &dc = k.c;
  const size_t B = dc.batch, Hq = dc.q_heads, Hkv = dc.kv_heads, D = dc.head_dim;
  std::vector<int> len(k.lens, k.lens + B), first(B), shard(B);
  size_t stride = 1;
  for (size_t b = 0; b < B; b++) {
    int s, e;
    ps_decode_shard(len[b], R, rank, &s, &e);
    first[b] = s, shard[b] = e - s;
    stride = std::max(stride, (size_t)(len[b] + R - 1) / R);
  }
  perseus_decode_t *f = NULL;
  const perseus_decode_config_t pc = {dc.batch, dc.q_heads, dc.kv_heads, dc.head_dim, dc.max_context};
  if (perseus_decode_create(w.comm, &pc, (int)stride, 0, mode, &f))
    gc_die(__FILE__, __LINE__, "fused create: %s", perseus_decode_last_error());
  uint16_t *q, *kk, *v, *out;
  int *n;
  GC_CUDA(cudaMalloc(&q, B * Hq * D * 2), "q");
  GC_CUDA(cudaMalloc(&kk, B * Hkv * stride * D * 2), "k");
  GC_CUDA(cudaMalloc(&v, B * Hkv * stride * D * 2), "v");
  GC_CUDA(cudaMalloc(&out, B * Hq * D * 2), "out");
  GC_CUDA(cudaMalloc(&n, B * sizeof(int)), "lengths");
  GC_CUDA(cudaMemcpyAsync(n, shard.data(), B * sizeof(int), cudaMemcpyHostToDevice, w.stream), "lengths");
  const float scale = 1.f / sqrtf((float)D);
  long long wrong = 0;
  for (int step = 0; step < 3; step++) {
    const uint64_t seed = 0x5eed + 977 * step;
    if (dp_fill_all(seed, dc, stride, first, q, kk, v, w.stream))
      gc_die(__FILE__, __LINE__, "filling the inputs: %s", cudaGetErrorString(cudaGetLastError()));
    GC_CUDA(cudaMemsetAsync(out, 0xff, B * Hq * D * 2, w.stream), "out"); /* NaN until written */
    if (perseus_decode_step(f, scale, q, kk, v, stride, n, out, w.stream))
      gc_die(__FILE__, __LINE__, "fused step: %s", perseus_decode_last_error());
    GC_CUDA(cudaStreamSynchronize(w.stream), "rank %d, step %d", rank, step);
    std::vector<uint16_t> host(B * Hq * D);
    GC_CUDA(cudaMemcpy(host.data(), out, host.size() * 2, cudaMemcpyDeviceToHost), "out");
    const long long bad = dp_wrong(dp_reference(seed, dc, len, scale), host);
    if (bad)
      fprintf(stderr, "decode_fused_test: rank %d, %s, B %zu Hq %zu Hkv %zu D %zu, step %d: %lld of %zu "
              "outputs wrong\n", rank, mode ? "pull" : "push", B, Hq, Hkv, D, step, bad, host.size());
    wrong += bad;
  }
  /* a shard longer than the operator was made for */
  if (perseus_decode_step(f, scale, q, kk, v, stride + 1, n, out, w.stream) != -1 ||
      !strstr(perseus_decode_last_error(), "max_shard")) {
    fprintf(stderr, "decode_fused_test: rank %d: stride %zu past max_shard %zu not refused by name (%s)\n",
            rank, stride + 1, stride, perseus_decode_last_error());
    wrong++;
  }
  GC_CUDA(cudaDeviceSynchronize(), "rank %d", rank);
  perseus_decode_destroy(f);
  cudaFree(q), cudaFree(kk), cudaFree(v), cudaFree(out), cudaFree(n);
  return wrong;
}

/* The fault cases' operator: one sequence of 64 tokens, 8 heads of 64. */
struct df_fault_in {
  int mode;
  uint16_t *q, *k, *v, *out;
  int *n;
};
static const perseus_decode_config_t df_fault_cfg = {1, 8, 8, 64, 64};

static void *df_fault_create(gc_world *w, void *ctx)
{
  perseus_decode_t *f = NULL;
  if (perseus_decode_create(w->comm, &df_fault_cfg, 64, 0, ((df_fault_in *)ctx)->mode, &f))
    return NULL;
  return f;
}

static int df_fault_step(void *f, void *ctx, cudaStream_t st)
{
  const df_fault_in &in = *(const df_fault_in *)ctx;
  return perseus_decode_step((perseus_decode_t *)f, 0.125f, in.q, in.k, in.v, 64, in.n, in.out, st);
}

static int df_faults(gc_world *w, int mode, int rank, int R)
{
  df_fault_in in = {mode, NULL, NULL, NULL, NULL, NULL};
  const size_t elems = 8 * 64 * 64;
  GC_CUDA(cudaMalloc(&in.q, elems * 2), "q");
  GC_CUDA(cudaMalloc(&in.k, elems * 2), "k");
  GC_CUDA(cudaMalloc(&in.v, elems * 2), "v");
  GC_CUDA(cudaMalloc(&in.out, elems * 2), "out");
  GC_CUDA(cudaMalloc(&in.n, sizeof(int)), "n");
  GC_CUDA(cudaMemset(in.q, 0, elems * 2), "q");
  GC_CUDA(cudaMemset(in.k, 0, elems * 2), "k");
  GC_CUDA(cudaMemset(in.v, 0, elems * 2), "v");
  const int shard = 64 / R;
  GC_CUDA(cudaMemcpy(in.n, &shard, sizeof(int), cudaMemcpyHostToDevice), "n");
  const op_fault_ops o = {
      "decode_fused_test", "PERSEUS_DECODE_TIMEOUT_MS", &in, df_fault_create, df_fault_step,
      [](void *f) { return perseus_decode_check((perseus_decode_t *)f); },
      [](void *f) { perseus_decode_abort((perseus_decode_t *)f); }, perseus_decode_last_error,
      [](void *f) { perseus_decode_destroy((perseus_decode_t *)f); }, NULL, 0};
  int bad = op_faults(o, w, rank, R);
  /* a length past the shard on rank 0 (n[0] = stride + 1): its step ends
   * naming it, reading nothing beyond k and v; the others' steps pass */
  void *f = df_fault_create(w, &in);
  if (!f) gc_die(__FILE__, __LINE__, "fault case: create: %s", perseus_decode_last_error());
  const int over = 65;
  if (rank == 0) GC_CUDA(cudaMemcpy(in.n, &over, sizeof(int), cudaMemcpyHostToDevice), "n");
  if (df_fault_step(f, &in, w->stream)) gc_die(__FILE__, __LINE__, "step: %s", perseus_decode_last_error());
  gc_wait_stream(w, "a step with a length past its shard", NULL, NULL);
  const int rc = perseus_decode_check((perseus_decode_t *)f);
  const int wrong = rank == 0 ? rc != -1 || !strstr(perseus_decode_last_error(), "n[0] = 65") : rc != 0;
  printf("decode_fused_test: rank %d, n[0] = %d with a stride of 64: %s (%s)\n", rank, rank ? shard : over,
         wrong ? "FAILED" : "ok", rc ? perseus_decode_last_error() : "check passed");
  bad += wrong;
  if (gp_barrier(R)) _exit(1);
  perseus_decode_destroy((perseus_decode_t *)f);
  cudaFree(in.q), cudaFree(in.k), cudaFree(in.v), cudaFree(in.out), cudaFree(in.n);
  return bad;
}

static int df_child(int rank, void *arg)
{
  const df_cfg &c = *(const df_cfg *)arg;
  const int R = c.ngpus;
  gc_world w;
  if (gc_world_init(&w, rank, R) != ncclSuccess) return GP_EXIT_REFUSED;
  long long wrong = 0;
  int checks = 0;
  for (const df_case &k : df_cases)
    for (int mode = PERSEUS_DECODE_PUSH; mode <= (c.path == TT_LSA ? PERSEUS_DECODE_PULL : PERSEUS_DECODE_PUSH); mode++) {
      gp_progress("decode_fused", -1, "B %d Hq %d Hkv %d D %d, %s", k.c.batch, k.c.q_heads, k.c.kv_heads,
                  k.c.head_dim, mode ? "pull" : "push");
      const long long bad = df_case_run(w, k, mode, rank, R);
      wrong += bad, checks++;
      if (rank == 0)
        printf("decode_fused_test: B %d Hq %2d Hkv %d D %3d ranks %d %s: %s\n", k.c.batch, k.c.q_heads,
               k.c.kv_heads, k.c.head_dim, R, mode ? "pull" : "push", bad ? "FAIL" : "ok");
    }
  /* a rank that never runs a step */
  gp_progress("decode_fused", -1, "a step one rank skips");
  const int fault_bad = df_faults(&w, PERSEUS_DECODE_PUSH, rank, R);
  wrong += fault_bad, checks++;
  if (rank == 0) printf("decode_fused_test: faults and refusals (push): %s\n", fault_bad ? "FAIL" : "ok");
  /* refusals, each naming what was wrong */
  perseus_decode_t *f = NULL;
  const perseus_decode_config_t ok = {1, 8, 8, 64, 64};
  if (perseus_decode_create(w.comm, &ok, 64, 0, 7, &f) != -1 || !strstr(perseus_decode_last_error(), "mode 7")) {
    fprintf(stderr, "decode_fused_test: mode 7 not refused by name (%s)\n", perseus_decode_last_error());
    wrong++;
  }
  if (c.path != TT_LSA &&
      (perseus_decode_create(w.comm, &ok, 64, 0, PERSEUS_DECODE_PULL, &f) != -1 ||
       !strstr(perseus_decode_last_error(), "use push"))) {
    fprintf(stderr, "decode_fused_test: pull beyond NVLink not refused by name (%s)\n", perseus_decode_last_error());
    wrong++;
  }
  if (rank == 0)
    printf("decode_fused_test: %d cases on %d ranks (%s): %s\n", checks, R, tt_path_names[c.path],
           wrong ? "FAILED" : "passed");
  gc_world_destroy(&w);
  return wrong ? 1 : 0;
}

static void df_usage(FILE *f)
{
  fprintf(f, "usage: perseus_decode_fused_test [-g GPUS] [-p lsa|gin] [-W SECS]\n"
             "  -g GPUs, one process each (0: every visible one; at least 1)\n"
             "  -p lsa: NVLink (push and pull); gin: P2P off, the records cross perseus (push)\n");
}

int main(int argc, char **argv)
{
  static df_cfg c;
  static const char *const paths[] = {"lsa", "gin"};
  static const int path_values[] = {TT_LSA, TT_GIN};
  const ps_opt_t opts[] = {
      PS_OPT_INT('g', &c.ngpus, "0", 0, GP_MAX_RANKS),
      PS_OPT_NAME('p', &c.path, "lsa", paths, path_values, 2),
      PS_OPT_INT('W', &c.watchdog_s, "120", 1, 86400),
  };
  ps_opts_parse(argc, argv, "perseus_decode_fused_test", opts, PS_OPTS_N(opts), df_usage, 1);
  if (gp_init("perseus_decode_fused_test")) return 1;
  int rc = tt_start(c.path, 0, 1, &c.ngpus, c.watchdog_s, 1);
  if (rc >= 0) return rc;
  int codes[GP_MAX_RANKS];
  return gp_run(c.ngpus, 0, df_child, &c, c.watchdog_s, "decode fused test", NULL, NULL, codes) ? 1 : 0;
}
