/* perseus_moe_perf: perseus' fused MoE layer (one persistent kernel per
 * forward, include/perseus/moe.h) against the bulk-synchronous layer a user
 * writes today (moe/moe_baseline*.cu: cuBLAS gate, NCCL all-to-all with a
 * host sync for the counts, cuBLAS expert GEMMs, all-to-all back, combine),
 * same shapes, same GPUs, same weights and inputs, in one run. Two baseline
 * variants run: "exact" (GEMM1 per expert with an fp32 output, GEMM2
 * grouped: the layer's exact math) and "grouped" (both GEMMs through
 * cublasGemmGroupedBatchedEx, which needs a bf16 GEMM1 output, as grouped-GEMM
 * MoE stacks do); the speedup is against the faster of the two.
 *
 * Per model preset (-m) and regime (-t: decode = 128 tokens per rank,
 * prefill = 4096, or a number): median over -n forwards of the slowest
 * rank's time, for each layer, and their ratio; where the fused kernel's
 * time goes (its phase marks); the expert GEMMs' achieved TFLOP/s in both
 * (fused: its expert phase; baseline: cuBLAS's GEMM phase); the weight-read
 * floor (bytes of the experts that got rows, which any implementation must
 * read, over the HBM bandwidth measured here) and the fused time over it;
 * and the bytes the dispatch moved against a padded all-to-all (every
 * (source, expert) pair padded to the largest one). With -c 1 the two
 * layers' outputs are compared. One forked process per GPU (gin_proc.c).
 * Exit: 0 ran, 1 failure, 77 no GPU. */
#include <inttypes.h>
#include <math.h>

#include "opts.h"
#include "size_parse.h"
#include "tile_comm.cuh"
#include "perseus/moe.h"

extern "C" {
#include "moe_baseline.h"
#include "ps_moe_ref.h"
}

#define MP_MAX 8

struct mp_cfg {
  int ngpus, iters, warmup, path, batch, gin_per_expert, check, watchdog_s;
  int graph; /* -G: the fused forward replayed from a CUDA graph */
  int experts; /* -E: overrides the presets' expert count (0: theirs) */
  int npresets, presets[MP_MAX], nregimes, tokens[MP_MAX];
  uint64_t seed;
};

/* The preset's shape for regime ti, with -E's expert count if given. */
static perseus_moe_config_t mp_config(const mp_cfg *c, int pi, int ti)
{
  perseus_moe_config_t mc =
      ps_moe_preset_config(&ps_moe_presets(NULL)[c->presets[pi]], c->tokens[ti], c->batch);
  if (c->experts) mc.experts = c->experts;
  mc.gin_per_expert = c->gin_per_expert;
  return mc;
}

/* Uniform bf16 in [-scale, scale) from a counter hash: weights of any size
 * without a host copy. */
__global__ void mp_fill(uint16_t *p, size_t n, uint64_t seed, float scale)
{
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    __nv_bfloat16 b = __float2bfloat16(ps_place_value((i + 1) * 0x9e3779b97f4a7c15ull ^ seed) * scale);
    p[i] = *(uint16_t *)&b;
  }
}

static uint16_t *mp_random(size_t n, uint64_t seed, float scale, cudaStream_t s)
{
  uint16_t *p;
  GC_CUDA(cudaMalloc(&p, n * 2), "%zu bf16 values", n);
  mp_fill<<<1024, 256, 0, s>>>(p, n, seed, scale);
  GC_CUDA(cudaGetLastError(), "mp_fill");
  return p;
}

/* Device-to-device copy bandwidth (read + write bytes over time), GB/s. */
static double mp_hbm_gbps(cudaStream_t s)
{
  size_t bytes = (size_t)2 << 30;
  void *a, *b;
  cudaEvent_t e0, e1;
  GC_CUDA(cudaMalloc(&a, bytes), "hbm probe");
  GC_CUDA(cudaMalloc(&b, bytes), "hbm probe");
  GC_CUDA(cudaEventCreate(&e0), "event");
  GC_CUDA(cudaEventCreate(&e1), "event");
  float best = 1e30f;
  for (int i = 0; i < 5; i++) {
    GC_CUDA(cudaEventRecord(e0, s), "event");
    GC_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s), "copy");
    GC_CUDA(cudaEventRecord(e1, s), "event");
    GC_CUDA(cudaEventSynchronize(e1), "event");
    float ms;
    GC_CUDA(cudaEventElapsedTime(&ms, e0, e1), "event");
    if (ms < best) best = ms;
  }
  cudaFree(a), cudaFree(b), cudaEventDestroy(e0), cudaEventDestroy(e1);
  return 2.0 * (double)bytes / (best * 1e-3) / 1e9;
}

static int mp_cmp(const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Elementwise reduction over ranks (ncclMax, ncclSum) of n doubles in
 * place, through NCCL; a device buffer of its own (n is the forwards count
 * at most three times over: any size). */
static void mp_reduce(gc_world *w, double *v, int n, ncclRedOp_t op)
{
  double *d;
  GC_CUDA(cudaMalloc(&d, n * sizeof(double)), "%d values", n);
  GC_CUDA(cudaMemcpyAsync(d, v, n * sizeof(double), cudaMemcpyHostToDevice, w->stream), "reduce");
  GC_NCCL(ncclAllReduce(d, d, n, ncclDouble, op, w->comm, w->stream), "%d values", n);
  gc_wait_stream(w, "allreduce", NULL, NULL);
  GC_CUDA(cudaMemcpy(v, d, n * sizeof(double), cudaMemcpyDeviceToHost), "reduce");
  GC_CUDA(cudaFree(d), "reduce");
}

/* What one (preset, regime) row reports; every field a max over ranks. */
enum { R_FUSED, R_BASE, R_BASEG, R_ROUTE, R_DISP, R_WAIT, R_EXP, R_COMB, R_WROWS, R_WG1, R_WCOMB,
       R_RG1, R_RG2, R_XEND, R_BEXP, R_FLOOR, R_CAP, R_FTF, R_BTF, R_ERR, R_N };

/* Whether every rank's GPU has room for a row: the random weights (freed
 * once loaded), the fused layer and the two baselines, 2% spare for what
 * the layouts leave out. If not, rank 0 prints the row as skipped, why and
 * what to change, and no rank creates anything (creation is collective). */
static int mp_fits(gc_world *w, const perseus_moe_config_t *mc, const char *name, int T)
{
  ps_moe_layout_t lay;
  double need = 0; /* 0 for a config the creates will refuse, naming the reason */
  if (ps_moe_layout(mc, w->nranks, &lay) == 0)
    need = 1.02 * ((double)lay.weight_bytes + (double)lay.total_bytes +
                   (double)ps_moe_baseline_bytes(mc, w->nranks, PS_MOE_BASELINE_EXACT) +
                   (double)ps_moe_baseline_bytes(mc, w->nranks, PS_MOE_BASELINE_GROUPED) +
                   3.0 * T * mc->hidden * 2);
  size_t free_b = 0, total_b = 0;
  GC_CUDA(cudaMemGetInfo(&free_b, &total_b), "memory");
  double v[2] = {need - (double)free_b, need};
  mp_reduce(w, v, 2, ncclMax);
  if (v[0] <= 0) return 1;
  if (w->rank == 0)
    printf("  %-14s %6d | skipped: needs about %.1f GB of device memory a GPU (random weights, the "
           "fused layer, two baselines), %.1f GB more than one GPU has free: use more GPUs (-g), "
           "fewer experts (-E) or fewer tokens (-t)\n", name, T, v[1] / 1e9, v[0] / 1e9);
  return 0;
}

static void mp_row(gc_world *w, const mp_cfg *c, int pi, int ti, double gbps)
{
  const ps_moe_preset_t *pr = &ps_moe_presets(NULL)[c->presets[pi]];
  int T = c->tokens[ti], n = c->ngpus, me = w->rank;
  perseus_moe_config_t mc = mp_config(c, pi, ti);
  if (!mp_fits(w, &mc, pr->name, T)) return;
  size_t H = mc.hidden, F = mc.ffn, E = mc.experts, L = E / n;
  gp_progress(pr->name, -1, "%d tokens: weights", T);
  /* the same gate everywhere, each rank's own experts, the same for both layers */
  uint16_t *gate = mp_random(E * H, c->seed ^ 1, 1.0f / sqrtf((float)H), w->stream);
  uint16_t *w1 = mp_random(L * F * H, c->seed ^ (2 + 16 * (uint64_t)me), 1.0f / sqrtf((float)H), w->stream);
  uint16_t *w3 = mp_random(L * F * H, c->seed ^ (3 + 16 * (uint64_t)me), 1.0f / sqrtf((float)H), w->stream);
  uint16_t *w2 = mp_random(L * H * F, c->seed ^ (4 + 16 * (uint64_t)me), 1.0f / sqrtf((float)F), w->stream);
  uint16_t *x = mp_random((size_t)T * H, c->seed ^ (5 + 16 * (uint64_t)me), 1.0f, w->stream);
  uint16_t *yf, *yb;
  GC_CUDA(cudaMalloc(&yf, (size_t)T * H * 2), "out");
  GC_CUDA(cudaMalloc(&yb, (size_t)T * H * 2), "out");
  GC_CUDA(cudaStreamSynchronize(w->stream), "fill");
  perseus_moe_t *m;
  ps_moe_baseline_t *bv[2]; /* exact, grouped */
  gp_progress(NULL, -1, "%d tokens: create", T);
  if (perseus_moe_create(w->comm, &mc, &m) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "perseus_moe_create(%s, %d tokens): %s", pr->name, T,
           perseus_moe_last_error());
  for (int i = 0; i < 2; i++) {
    ps_moe_baseline_variant_t var = i ? PS_MOE_BASELINE_GROUPED : PS_MOE_BASELINE_EXACT;
    if (ps_moe_baseline_create(w->comm, &mc, var, &bv[i]) != ncclSuccess)
      gc_die(__FILE__, __LINE__, "ps_moe_baseline_create(%s, %d tokens, %s): %s", pr->name, T,
             i ? "grouped" : "exact", perseus_moe_last_error());
    if (ps_moe_baseline_load_weights(bv[i], gate, w1, w3, w2) != ncclSuccess)
      gc_die(__FILE__, __LINE__, "loading weights: %s", perseus_moe_last_error());
  }
  if (perseus_moe_load_weights(m, gate, w1, w3, w2) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "loading weights: %s", perseus_moe_last_error());
  cudaFree(gate), cudaFree(w1), cudaFree(w3), cudaFree(w2);

  int total = c->warmup + c->iters;
  double *tf = (double *)calloc(3 * (size_t)total, sizeof(double)), *tbv[2] = {tf + total, tf + 2 * total};
  cudaEvent_t e0, e1;
  GC_CUDA(cudaEventCreate(&e0), "event");
  GC_CUDA(cudaEventCreate(&e1), "event");
  cudaGraphExec_t gx = NULL; /* -G: the fused forward, captured once */
  if (c->graph)
    gx = gc_capture(w, "perseus_moe_forward",
                    [&]() { return perseus_moe_forward(m, x, yf, T, w->stream); },
                    perseus_moe_last_error);
  for (int it = 0; it < total; it++) {
    gp_progress(NULL, it, "%d tokens: fused", T);
    if (gp_barrier(n)) _exit(1);
    GC_CUDA(cudaEventRecord(e0, w->stream), "event");
    if (gx) GC_CUDA(cudaGraphLaunch(gx, w->stream), "replaying the forward");
    else if (perseus_moe_forward(m, x, yf, T, w->stream) != ncclSuccess)
      gc_die(__FILE__, __LINE__, "perseus_moe_forward: %s", perseus_moe_last_error());
    GC_CUDA(cudaEventRecord(e1, w->stream), "event");
    gc_wait_stream(w, "fused forward", NULL, NULL);
    float ms;
    GC_CUDA(cudaEventElapsedTime(&ms, e0, e1), "event");
    tf[it] = ms * 1e3;
    for (int q = 0; q < 2; q++) {
      int i = 1 - q; /* the exact one last: its output is what -c compares */
      gp_progress(NULL, it, "%d tokens: baseline %s", T, i ? "grouped" : "exact");
      if (gp_barrier(n)) _exit(1);
      GC_CUDA(cudaEventRecord(e0, w->stream), "event");
      if (ps_moe_baseline_forward(bv[i], x, yb, T, w->stream) != ncclSuccess)
        gc_die(__FILE__, __LINE__, "baseline forward: %s", perseus_moe_last_error());
      GC_CUDA(cudaEventRecord(e1, w->stream), "event");
      gc_wait_stream(w, "baseline forward", NULL, NULL);
      GC_CUDA(cudaEventElapsedTime(&ms, e0, e1), "event");
      tbv[i][it] = ms * 1e3;
    }
  }
  /* the slowest rank per forward, then the median over the timed ones */
  mp_reduce(w, tf, 3 * total, ncclMax);
  for (int i = 0; i < 3; i++) qsort(tf + i * total + c->warmup, c->iters, sizeof(double), mp_cmp);

  double v[R_N] = {0};
  v[R_FUSED] = tf[c->warmup + c->iters / 2];
  v[R_BASE] = tbv[0][c->warmup + c->iters / 2], v[R_BASEG] = tbv[1][c->warmup + c->iters / 2];
  ps_moe_baseline_t *b = bv[0]; /* the exact one: its GEMM phase is cuBLAS at the layer's math */
  perseus_moe_profile_t pf;
  if (perseus_moe_last_profile(m, &pf) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "perseus_moe_last_profile: %s", perseus_moe_last_error());
  ps_moe_baseline_times_t bt;
  double bflops = 0;
  long long brows = 0, bactive = 0;
  if (ps_moe_baseline_times(b, &bt) != ncclSuccess ||
      ps_moe_baseline_expert_stats(b, &bflops, &brows, &bactive) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "baseline stats: %s", perseus_moe_last_error());
  v[R_ROUTE] = pf.route_us, v[R_DISP] = pf.dispatch_us, v[R_WAIT] = pf.wait_us;
  v[R_EXP] = pf.experts_us, v[R_COMB] = pf.combine_us, v[R_BEXP] = bt.experts_ms * 1e3;
  v[R_WROWS] = pf.wait_rows_us, v[R_WG1] = pf.wait_gemm1_us, v[R_WCOMB] = pf.wait_combine_us;
  v[R_RG1] = pf.run_gemm1_us, v[R_RG2] = pf.run_gemm2_us, v[R_XEND] = pf.experts_end_us;
  /* weights of the experts that got rows, read once at the measured bandwidth */
  v[R_FLOOR] = (double)pf.active_experts * 3.0 * H * F * 2.0 / (gbps * 1e3);
  v[R_FTF] = -(pf.experts_us > 0 ? pf.gemm_flops / (pf.experts_us * 1e6) : 0); /* min via max */
  v[R_BTF] = -(bt.experts_ms > 0 ? bflops / (bt.experts_ms * 1e9) : 0);
  /* bytes: rows we sent, and the padded all-to-all's (every (source, expert)
   * pair as large as the largest) */
  const int32_t *d_idx;
  const float *d_w;
  perseus_moe_routing(m, &d_idx, &d_w);
  int32_t *idx = (int32_t *)malloc((size_t)T * mc.topk * sizeof(int32_t));
  long long *load = (long long *)calloc(E, sizeof(long long));
  GC_CUDA(cudaMemcpy(idx, d_idx, (size_t)T * mc.topk * 4, cudaMemcpyDeviceToHost), "routing");
  double mx = 0;
  for (int i = 0; i < T * mc.topk; i++) load[idx[i]]++;
  for (size_t e = 0; e < E; e++) mx = load[e] > mx ? (double)load[e] : mx;
  v[R_CAP] = mx;
  if (c->check) { /* the two layers against each other */
    uint16_t *hf = (uint16_t *)malloc((size_t)T * H * 2), *hb = (uint16_t *)malloc((size_t)T * H * 2);
    GC_CUDA(cudaMemcpy(hf, yf, (size_t)T * H * 2, cudaMemcpyDeviceToHost), "out");
    GC_CUDA(cudaMemcpy(hb, yb, (size_t)T * H * 2, cudaMemcpyDeviceToHost), "out");
    double ss = 0, err = 0;
    for (size_t i = 0; i < (size_t)T * H; i++) {
      double a = ps_bf16_to_float(hb[i]), d = ps_bf16_to_float(hf[i]) - a;
      ss += a * a;
      err = fabs(d) > err || d != d ? fabs(d) : err;
    }
    v[R_ERR] = T ? err / sqrt(ss / ((double)T * H)) : 0;
    free(hf), free(hb);
  }
  mp_reduce(w, v, R_N, ncclMax);
  double bytes_all = (double)pf.rows_out * H * 2; /* the ranks' dispatch bytes, summed */
  mp_reduce(w, &bytes_all, 1, ncclSum);
  if (me == 0)
    printf("# fused kernel: %d CTAs, %d-row GEMM tiles on %s\n", pf.grid, pf.tile_rows,
           pf.wgmma ? "wgmma" : "mma.sync");
  if (me == 0) {
    double padded = v[R_CAP] * (double)E * n * H * 2; /* n sources x E experts x cap rows */
    double best = v[R_BASE] < v[R_BASEG] ? v[R_BASE] : v[R_BASEG];
    printf("  %-14s %6d | %9.1f %9.1f %9.1f %6.2fx | %7.1f %7.1f %7.1f %8.1f %7.1f | %6.1f %6.1f %6.1f | "
           "%7.1f %7.1f %7.1f | %6.1f %6.1f | %8.1f %5.2fx | %9.2f %9.2f %5.2fx",
           pr->name, T, v[R_FUSED], v[R_BASE], v[R_BASEG], best / v[R_FUSED], v[R_ROUTE], v[R_DISP],
           v[R_WAIT], v[R_EXP], v[R_COMB], v[R_WROWS], v[R_WG1], v[R_WCOMB], v[R_RG1], v[R_RG2],
           v[R_XEND], -v[R_FTF], -v[R_BTF], v[R_FLOOR],
           v[R_FUSED] / v[R_FLOOR], bytes_all / 1e6, padded / 1e6, padded / bytes_all);
    if (c->check) printf(" | %.3g", v[R_ERR]);
    printf("\n");
  }
  free(idx), free(load), free(tf);
  cudaFree(x), cudaFree(yf), cudaFree(yb), cudaEventDestroy(e0), cudaEventDestroy(e1);
  if (gx) GC_CUDA(cudaGraphExecDestroy(gx), "graph");
  if (perseus_moe_destroy(m) != ncclSuccess || ps_moe_baseline_destroy(bv[0]) != ncclSuccess ||
      ps_moe_baseline_destroy(bv[1]) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "destroy: %s", perseus_moe_last_error());
}

static int mp_child(int rank, void *arg)
{
  const mp_cfg *c = (const mp_cfg *)arg;
  gc_world w;
  gp_progress("init", -1, "starting");
  if (gc_world_init(&w, rank, c->ngpus) != ncclSuccess) return GP_EXIT_REFUSED;
  double gbps = mp_hbm_gbps(w.stream);
  double g = -gbps; /* the slowest rank's bandwidth */
  mp_reduce(&w, &g, 1, ncclMax);
  gbps = -g;
  if (rank == 0) {
    printf("# HBM: %.0f GB/s (device-to-device copy, read + write, slowest rank)\n", gbps);
    printf("# %-14s %6s | %9s %9s %9s %7s | %7s %7s %7s %8s %7s | %6s %6s %6s | %7s %7s %7s | %6s %6s | "
           "%8s %6s | %9s %9s %6s%s\n",
           "preset", "tokens", "fused(us)", "exact(us)", "group(us)", "speedup", "route", "disp", "wait",
           "experts", "combine", "w:rows", "w:g1", "w:comb", "r:g1", "r:g2", "end", "TF/s", "cuBLAS",
           "floor", "xfloor",
           "sent(MB)", "padded", "ratio",
           c->check ? " | err/rms" : "");
  }
  for (int pi = 0; pi < c->npresets; pi++)
    for (int ti = 0; ti < c->nregimes; ti++) mp_row(&w, c, pi, ti, gbps);
  gc_world_destroy(&w);
  return 0;
}

static void usage(FILE *f)
{
  fprintf(f,
    "usage: perseus_moe_perf [options]\n"
    "perseus' fused MoE layer against the bulk-synchronous one (NCCL all-to-all + cuBLAS),\n"
    "same shapes, weights and inputs, one forked process per GPU.\n"
    "  -m LIST  presets: qwen3-30b-a3b, gpt-oss-120b, deepseek-v3 (default all)\n"
    "  -t LIST  tokens per rank: decode (128), prefill (4096) or numbers (default decode,prefill)\n"
    "  -g N     GPUs (default: all visible)     -p PATH  lsa or gin (default lsa)\n"
    "  -n N     timed forwards (default 10)     -w N     warmup forwards (default 3)\n"
    "  -B N     NVLink dispatch rows per signal (default 0: one per destination and expert)\n"
    "  -S 0|1   GIN rows: 0 one put per destination each way (default), 1 one per\n"
    "           destination and expert (in chunks of -B rows)\n"
    "  -E N     experts instead of the presets' (e.g. -g 1 -E 32: one rank's share of a\n"
    "           128-expert layer on 4 GPUs, with the rows per expert of that run)\n"
    "  -c 0|1   compare the two layers' outputs (default 1)\n"
    "  -G 0|1   1: the fused forward replayed from a CUDA graph captured once per row, as\n"
    "           decode loops run it (default 0: launched; the baselines are always launched,\n"
    "           their all-to-all sizes need a host sync)\n"
    "  -s SEED  seed (default 1)                -W SEC   watchdog (default 300)\n"
    "A row that does not fit on a GPU (random weights, the fused layer and both baselines at\n"
    "once) prints as skipped, with the memory it needs; the other rows still run.\n"
    "Columns: median of the slowest rank per forward (fused; baselines exact: GEMM1 fp32 out,\n"
    "and grouped: both GEMMs grouped, GEMM1 bf16 out; speedup against the faster); the fused\n"
    "kernel's phases (latest CTA, us); idle time inside them (us): expert tasks waiting for\n"
    "rows (w:rows) and GEMM2 waiting for GEMM1 (w:g1), average per CTA, and a token's combine\n"
    "waiting for results (w:comb); per CTA, time in GEMM1 and GEMM2 tasks past those waits\n"
    "(r:g1, r:g2) and from the experts phase's start to its last task's end (end: against\n"
    "experts, the imbalance); expert-GEMM TFLOP/s per rank (slowest), fused and\n"
    "cuBLAS (exact); the weight-read floor\n"
    "(experts with rows x their bytes / HBM bandwidth) and fused / floor; dispatch bytes of\n"
    "all ranks against a padded all-to-all; err/rms: max |fused - baseline| over the rms.\n");
}

int main(int argc, char **argv)
{
  static mp_cfg c;
  const char *mlist = NULL, *tlist;
  static const char *const paths[] = {"lsa", "gin"};
  static const int path_values[] = {TT_LSA, TT_GIN};
  const ps_opt_t opts[] = {
    PS_OPT_STR('m', &mlist, NULL), /* NULL: every preset */
    PS_OPT_STR('t', &tlist, "decode,prefill"),
    PS_OPT_INT('g', &c.ngpus, NULL, 1, GP_MAX_RANKS), /* 0: all visible */
    PS_OPT_NAME('p', &c.path, "lsa", paths, path_values, 2),
    PS_OPT_INT('n', &c.iters, "10", 1, 100000),
    PS_OPT_INT('w', &c.warmup, "3", 0, 100000),
    PS_OPT_INT('B', &c.batch, "0", 0, 1 << 20),
    PS_OPT_INT('S', &c.gin_per_expert, "0", 0, 1),
    PS_OPT_INT('E', &c.experts, NULL, 1, 1 << 20), /* 0: the presets' */
    PS_OPT_INT('c', &c.check, "1", 0, 1),
    PS_OPT_INT('G', &c.graph, "0", 0, 1),
    PS_OPT_SEED('s', &c.seed, "1"),
    PS_OPT_INT('W', &c.watchdog_s, "300", 1, 24 * 3600),
  };
  ps_opts_parse(argc, argv, "perseus_moe_perf", opts, PS_OPTS_N(opts), usage, 1);
  int np = 0;
  const ps_moe_preset_t *all = ps_moe_presets(&np);
  char t[64];
  const char *cur = mlist;
  int r = 0;
  if (!mlist)
    for (int i = 0; i < np && i < MP_MAX; i++) c.presets[c.npresets++] = i;
  while (mlist && (r = sp_list_next(&cur, t, sizeof(t))) > 0) {
    const ps_moe_preset_t *p = ps_moe_preset_find(t);
    if (c.npresets == MP_MAX) {
      fprintf(stderr, "perseus_moe_perf: -m '%s': at most %d presets\n", mlist, MP_MAX);
      return 2;
    }
    if (!p) {
      fprintf(stderr, "perseus_moe_perf: unknown preset '%s' (-m): expected one of", t);
      for (int i = 0; i < np; i++) fprintf(stderr, " %s", all[i].name);
      fprintf(stderr, "\n");
      return 2;
    }
    c.presets[c.npresets++] = (int)(p - all);
  }
  if (r < 0) {
    fprintf(stderr, "perseus_moe_perf: -m '%s': an empty or overlong entry\n", mlist);
    return 2;
  }
  for (cur = tlist; (r = sp_list_next(&cur, t, sizeof(t))) > 0;) {
    int v = !strcmp(t, "decode") ? PS_MOE_DECODE_TOKENS : !strcmp(t, "prefill") ? PS_MOE_PREFILL_TOKENS : 0;
    if (c.nregimes == MP_MAX) {
      fprintf(stderr, "perseus_moe_perf: -t '%s': at most %d regimes\n", tlist, MP_MAX);
      return 2;
    }
    if (!v && gp_parse_int(t, 1, 1 << 20, &v)) {
      fprintf(stderr, "perseus_moe_perf: bad -t entry '%s': decode, prefill or a token count\n", t);
      return 2;
    }
    c.tokens[c.nregimes++] = v;
  }
  if (r < 0) {
    fprintf(stderr, "perseus_moe_perf: -t '%s': an empty or overlong entry (expected decode, "
            "prefill or token counts)\n", tlist);
    return 2;
  }
  if (gp_init("perseus_moe_perf")) return 1;
  int rc = tt_start(c.path, 0, 1, &c.ngpus, c.watchdog_s, 1);
  if (rc >= 0) return rc;
  for (int pi = 0; pi < c.npresets; pi++)
    for (int ti = 0; ti < c.nregimes; ti++) {
      perseus_moe_config_t mc = mp_config(&c, pi, ti);
      if (perseus_moe_check_config(&mc, c.ngpus)) {
        fprintf(stderr, "perseus_moe_perf: %s on %d GPUs: %s\n", all[c.presets[pi]].name,
                c.ngpus, perseus_moe_last_error());
        return 1;
      }
    }
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  printf("# machine: host %s, %d GPUs:", host, c.ngpus);
  gc_print_rank_gpus(c.ngpus);
  printf("\n# path %s, batch %d, GIN puts per %s, %d forwards (+%d warmup), fused %s, seed %" PRIu64
         "\n", tt_path_names[c.path], c.batch,
         c.gin_per_expert ? "destination and expert" : "destination", c.iters, c.warmup,
         c.graph ? "replayed from a CUDA graph" : "launched", c.seed);
  if (c.experts) printf("# experts: %d (-E), not the presets'\n", c.experts);
  int codes[GP_MAX_RANKS];
  int failed = gp_run(c.ngpus, 0, mp_child, &c, c.watchdog_s, "moe perf", NULL, NULL, codes);
  return failed ? 1 : 0;
}
