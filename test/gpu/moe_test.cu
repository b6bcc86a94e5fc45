/* perseus_moe_test: perseus' fused MoE layer (include/perseus/moe.h) against
 * an fp64 CPU reference of the same layer (moe/moe_ref.c), one forked
 * process per GPU (1 GPU works too), over one path per run: -p lsa (P2P on,
 * peers by NVLink stores) or -p gin (P2P off, peers through the perseus
 * plugin's GIN proxy).
 *
 * Every rank derives the same global weights from the seed, loads its
 * experts, and runs -n forwards of a random token count (0..-T, so empty
 * ranks happen) with random inputs. The gate is skewed on purpose: the first
 * local expert of every rank is "hot" (a large share of tokens pick it: an
 * overloaded expert, many GEMM row blocks) and the second "cold" (no token
 * picks it: an empty expert). Each forward's routing must be a valid top-k of
 * the fp64 logits (near-ties may go either way) with matching weights; its
 * output must match the reference, computed with the GPU's routing, within
 * bf16 tolerance. With -G 1 every other pair of forwards replays a CUDA graph
 * of the layer's forward (captured at its first use, max tokens), so that
 * each layer mixes launched and replayed forwards; the profile of every
 * forward must then describe that forward. Exit: 0 pass, 1 failure, 77 no
 * GPU or fewer than asked. */
#include <inttypes.h>
#include <math.h>

#include "opts.h"
#include "tile_comm.cuh"
#include "perseus/moe.h"

extern "C" {
#include "ps_moe_ref.h"
}

#define MT_MAX_ALIVE 8

enum { MT_FAULT_NONE, MT_FAULT_CONFIG, MT_FAULT_HEADER, MT_FAULT_TIMEOUT, MT_FAULT_ABORT, MT_FAULT_ALL };
static const char *const mt_fault_names[] = {"none", "config", "header", "timeout", "abort", "all"};

struct mt_cfg {
  int path, ngpus, iters, layers, alive, watchdog_s, graph, faults;
  perseus_moe_config_t mc;
  uint64_t seed;
};

struct mt_host { /* the global layer, the same on every rank */
  uint16_t *gate, *w1, *w3, *w2;
  float *v, *u; /* skew directions: hot experts lean to v, cold ones to u */
};

/* A random direction of about unit length. */
static float *mt_direction(size_t H, uint64_t st)
{
  float *d = (float *)malloc(H * sizeof(float));
  if (!d) gc_die(__FILE__, __LINE__, "out of host memory");
  for (size_t i = 0; i < H; i++)
    d[i] = (float)((double)(ps_moe_rand(&st) >> 11) / 9007199254740992.0 * 2.0 - 1.0) /
           sqrtf((float)H / 3.0f);
  return d;
}

static uint16_t *mt_alloc(size_t n)
{
  uint16_t *p = (uint16_t *)malloc(n * sizeof(uint16_t));
  if (!p) gc_die(__FILE__, __LINE__, "out of host memory (%zu bf16 values)", n);
  return p;
}

/* Random weights scaled by fan-in; hot experts' gate rows lean towards v,
 * cold ones towards u (every token leans away from u). */
static void mt_weights(const mt_cfg *c, int nranks, mt_host *h)
{
  const perseus_moe_config_t *m = &c->mc;
  size_t H = m->hidden, F = m->ffn, E = m->experts, L = E / nranks;
  h->gate = mt_alloc(E * H), h->w1 = mt_alloc(E * F * H), h->w3 = mt_alloc(E * F * H);
  h->w2 = mt_alloc(E * H * F);
  ps_moe_fill_bf16(h->gate, E * H, c->seed ^ 0x1111, 1.0f / sqrtf((float)H));
  ps_moe_fill_bf16(h->w1, E * F * H, c->seed ^ 0x2222, 1.0f / sqrtf((float)H));
  ps_moe_fill_bf16(h->w3, E * F * H, c->seed ^ 0x3333, 1.0f / sqrtf((float)H));
  ps_moe_fill_bf16(h->w2, E * H * F, c->seed ^ 0x4444, 1.0f / sqrtf((float)F));
  h->v = mt_direction(H, c->seed ^ 0x5555), h->u = mt_direction(H, c->seed ^ 0x6666);
  for (size_t e = 0; e < E; e++) {
    const float *d = e % L == 0 ? h->v : (L > 1 && e % L == 1) ? h->u : NULL;
    float lean = e % L == 0 ? 0.8f : 2.0f;
    for (size_t i = 0; d && i < H; i++) {
      uint16_t *g = &h->gate[e * H + i];
      *g = ps_float_to_bf16(ps_bf16_to_float(*g) + lean * d[i]);
    }
  }
}

/* Tokens of iteration `it` on `rank`: random, all pushed away from u, half
 * of them along v. */
static void mt_tokens(const mt_cfg *c, const mt_host *h, int rank, int it, int ntok, uint16_t *x)
{
  size_t H = c->mc.hidden;
  ps_moe_fill_bf16(x, (size_t)ntok * H, c->seed ^ ((uint64_t)rank << 40) ^ ((uint64_t)it << 20),
                   1.0f);
  for (int t = 0; t < ntok; t++)
    for (size_t i = 0; i < H; i++) {
      uint16_t *p = &x[t * H + i];
      *p = ps_float_to_bf16(ps_bf16_to_float(*p) + (t % 2 ? 0.0f : 2.0f * h->v[i]) -
                            3.0f * h->u[i]);
    }
}

/* A layer on w's communicator with this rank's experts loaded. NULL when
 * create refuses (said on stderr); load failures die. */
static perseus_moe_t *mt_layer(const mt_cfg *c, gc_world *w, const mt_host *h, int rank)
{
  const perseus_moe_config_t *mc = &c->mc;
  size_t H = mc->hidden, F = mc->ffn, L = mc->experts / c->ngpus;
  perseus_moe_t *m = NULL;
  gp_progress(NULL, -1, "perseus_moe_create");
  ncclResult_t r = perseus_moe_create(w->comm, mc, &m);
  if (r != ncclSuccess) {
    fprintf(stderr, "%s: rank %d: perseus_moe_create: %s: %s\n", gp_prog, rank,
            ncclGetErrorString(r), perseus_moe_last_error());
    return NULL;
  }
  r = perseus_moe_load_weights(m, h->gate, h->w1 + rank * L * F * H, h->w3 + rank * L * F * H,
                               h->w2 + rank * L * H * F);
  if (r != ncclSuccess)
    gc_die(__FILE__, __LINE__, "perseus_moe_load_weights: %s", perseus_moe_last_error());
  return m;
}

#include "moe_faults.cuh" /* -f */

static int mt_child(int rank, void *arg)
{
  const mt_cfg *c = (const mt_cfg *)arg;
  const perseus_moe_config_t *mc = &c->mc;
  int n = c->ngpus;
  gp_progress(tt_path_names[c->path], -1, "starting");
  gc_world w;
  if (gc_world_init(&w, rank, n) != ncclSuccess) return GP_EXIT_REFUSED;
  mt_host h;
  gp_progress(NULL, -1, "generating the weights");
  mt_weights(c, n, &h);
  if (c->faults != MT_FAULT_NONE) { /* then the forwards below, on fresh layers */
    const int bad = mt_faults(c, &w, &h, rank);
    if (bad) {
      gp_sh->slot[rank].mismatches += bad;
      return 1;
    }
  }
  perseus_moe_t *ms[MT_MAX_ALIVE];
  cudaGraphExec_t gx[MT_MAX_ALIVE] = {}; /* -G: each layer's captured forward */
  for (int i = 0; i < c->alive; i++)
    if (!(ms[i] = mt_layer(c, &w, &h, rank))) return GP_EXIT_REFUSED;
  perseus_moe_t *m = ms[0];
  size_t H = mc->hidden, k = mc->topk, T = mc->max_tokens;
  uint16_t *x = mt_alloc(T * H), *out = mt_alloc(T * H);
  int32_t *idx = (int32_t *)malloc(T * k * sizeof(int32_t));
  float *wt = (float *)malloc(T * k * sizeof(float));
  double *logits = (double *)malloc(T * mc->experts * sizeof(double));
  double *want = (double *)malloc(T * H * sizeof(double));
  if (!idx || !wt || !logits || !want) gc_die(__FILE__, __LINE__, "out of host memory");
  void *d_x, *d_out;
  GC_CUDA(cudaMalloc(&d_x, T * H * 2), "x");
  GC_CUDA(cudaMalloc(&d_out, T * H * 2), "out");
  const int32_t *d_idx;
  const float *d_w;
  unsigned long long bad = 0, tokens = 0, routes = 0;
  unsigned long long *load = (unsigned long long *)calloc(mc->experts, sizeof(*load));
  if (!load) gc_die(__FILE__, __LINE__, "out of host memory");
  double max_err = 0;
  for (int it = 0; it < c->iters && !bad; it++) {
    uint64_t hs = c->seed ^ ((uint64_t)it * 0x9e3779b97f4a7c15ull) ^ (uint64_t)rank;
    int ntok = (int)(ps_moe_rand(&hs) % (T + 1));
    /* the forwards are split over c->layers generations of c->alive layers
     * on the same communicator, the layers of a generation taking turns; a
     * generation is created once the one before is destroyed, and must not
     * see the old one's signal counts */
    const int gen = (int)((long long)it * c->layers / c->iters);
    if (it > 0 && gen != (int)((long long)(it - 1) * c->layers / c->iters)) {
      gp_progress(NULL, it, "perseus_moe_destroy, then generation %d", gen);
      for (int i = 0; i < c->alive; i++) {
        if (gx[i]) GC_CUDA(cudaGraphExecDestroy(gx[i]), "graph");
        gx[i] = NULL;
        if (perseus_moe_destroy(ms[i]) != ncclSuccess)
          gc_die(__FILE__, __LINE__, "perseus_moe_destroy: %s", perseus_moe_last_error());
      }
      for (int i = 0; i < c->alive; i++)
        if (!(ms[i] = mt_layer(c, &w, &h, rank)))
          gc_die(__FILE__, __LINE__, "generation %d: perseus_moe_create refused", gen);
      ntok = (int)T;
    }
    if (it == 0) ntok = (int)T; /* every generation's first forward is full */
    /* -G: forwards 2a..2a+1 of every layer launched, 2a+2..2a+3 replayed */
    const int graph = c->graph && it / c->alive % 2 == 1;
    if (graph) ntok = (int)T; /* the graph was captured at max tokens */
    m = ms[it % c->alive];
    perseus_moe_routing(m, &d_idx, &d_w);
    /* the last forward gives token 0 a NaN input: its picks must still be
     * distinct expert ids, the other tokens (one at least where T allows) unharmed */
    const int poison = it == c->iters - 1;
    if (poison && ntok < 2) ntok = T < 2 ? 1 : 2;
    gp_progress(NULL, it, "%s of %d tokens%s", graph ? "graph replay" : "forward", ntok,
                poison ? ", token 0 NaN" : "");
    mt_tokens(c, &h, rank, it, ntok, x);
    for (size_t i = 0; poison && i < H; i++) x[i] = 0x7fc0; /* bf16 quiet NaN */
    /* on the forward's stream: a non-blocking stream does not wait for the
     * legacy one, where cudaMemset and a pageable cudaMemcpy may still run */
    GC_CUDA(cudaMemcpyAsync(d_x, x, ntok * H * 2, cudaMemcpyHostToDevice, w.stream), "x");
    GC_CUDA(cudaMemsetAsync(d_out, 0xff, T * H * 2, w.stream), "out"); /* NaN: not written */
    if (graph) {
      cudaGraphExec_t *g = &gx[it % c->alive];
      if (!*g)
        *g = gc_capture(&w, "perseus_moe_forward",
                        [&]() { return perseus_moe_forward(m, d_x, d_out, ntok, w.stream); },
                        perseus_moe_last_error);
      GC_CUDA(cudaGraphLaunch(*g, w.stream), "replaying the forward");
    } else if (perseus_moe_forward(m, d_x, d_out, ntok, w.stream) != ncclSuccess) {
      gc_die(__FILE__, __LINE__, "perseus_moe_forward: %s", perseus_moe_last_error());
    }
    gc_wait_stream(&w, "forward", NULL, NULL);
    perseus_moe_profile_t pf; /* this forward's, whichever way it ran */
    if (perseus_moe_last_profile(m, &pf) != ncclSuccess)
      gc_die(__FILE__, __LINE__, "perseus_moe_last_profile: %s", perseus_moe_last_error());
    if (pf.rows_out != (long long)ntok * (long long)k || pf.total_us <= 0 || pf.grid <= 0 ||
        (pf.tile_rows != 64 && pf.tile_rows != 128)) {
      fprintf(stderr, "%s: rank %d: forward %d (%s, %d tokens): profile off: %lld rows out "
              "(want %lld), %.1f us, grid %d, %d-row tiles\n", gp_prog, rank, it,
              graph ? "replayed" : "launched", ntok, pf.rows_out, (long long)ntok * (long long)k,
              pf.total_us, pf.grid, pf.tile_rows);
      bad++;
      break;
    }
    GC_CUDA(cudaMemcpy(out, d_out, ntok * H * 2, cudaMemcpyDeviceToHost), "out");
    GC_CUDA(cudaMemcpy(idx, d_idx, ntok * k * sizeof(int32_t), cudaMemcpyDeviceToHost), "idx");
    GC_CUDA(cudaMemcpy(wt, d_w, ntok * k * sizeof(float), cudaMemcpyDeviceToHost), "w");
    gp_progress(NULL, it, "checking %d tokens", ntok);
    ps_moe_ref_logits(mc, x, ntok, h.gate, logits);
    for (int t = 0; t < ntok && !bad; t++) {
      char why[256];
      if (t < poison) {
        for (size_t i = 0; i < k; i++) {
          int repeat = 0;
          for (size_t q = 0; q < i; q++) repeat |= idx[q] == idx[i];
          if (idx[i] < 0 || idx[i] >= mc->experts || repeat) {
            fprintf(stderr, "%s: rank %d: forward %d, NaN token: pick %zu is expert %d (of %d)%s\n",
                    gp_prog, rank, it, i, idx[i], mc->experts, repeat ? ", a repeat" : "");
            bad++;
          }
        }
        continue; /* its output is not compared */
      }
      if (ps_moe_ref_check_routing(mc, logits + (size_t)t * mc->experts, idx + t * k, wt + t * k,
                                   1e-3, why, sizeof(why))) {
        fprintf(stderr, "%s: rank %d: forward %d, token %d: routing: %s\n", gp_prog, rank, it, t,
                why);
        bad++;
      }
      ps_moe_ref_token(mc, x + t * H, idx + t * k, wt + t * k, h.w1, h.w3, h.w2, want + t * H);
      routes += k;
      for (size_t i = 0; i < k; i++) load[idx[t * k + i]]++;
    }
    if (bad) break;
    double rms = 0;
    const size_t from = (size_t)poison * H, n_out = (size_t)ntok * H - from; /* past a NaN token */
    for (size_t i = from; i < (size_t)ntok * H; i++) rms += want[i] * want[i];
    rms = n_out ? sqrt(rms / (double)n_out) : 0;
    size_t nbad = 0, first = 0;
    double err = 0;
    if (ps_moe_ref_compare(out + from, want + from, n_out, 2e-2, 2e-2 * rms, &nbad, &err, &first)) {
      first += from;
      fprintf(stderr, "%s: rank %d: forward %d (%d tokens): %zu of %zu outputs off (max error "
              "%.4g, rms %.4g); first: token %zu, column %zu: got %.6g, expected %.6g\n", gp_prog,
              rank, it, ntok, nbad, (size_t)ntok * H, err, rms, first / H, first % H,
              ps_bf16_to_float(out[first]), want[first]);
      bad += nbad;
    }
    if (rms > 0 && err / rms > max_err) max_err = err / rms;
    tokens += ntok;
  }
  gp_sh->slot[rank].mismatches += (long long)bad;
  int unused = 0, busiest = 0;
  for (int e = 0; e < mc->experts; e++) {
    unused += load[e] == 0;
    if (load[e] > load[busiest]) busiest = e;
  }
  printf("rank %d: %d forwards, %llu tokens, %llu routed rows (experts never picked: %d; busiest: "
         "%d with %llu rows), max error %.3g x rms, %s\n", rank, c->iters, tokens, routes, unused,
         busiest, load[busiest], max_err, bad ? "FAILED" : "ok");
  fflush(stdout);
  gp_progress(NULL, -1, "teardown");
  for (int i = 0; i < c->alive; i++)
    if (gx[i]) GC_CUDA(cudaGraphExecDestroy(gx[i]), "graph");
  for (int i = 0; i < c->alive; i++)
    if (perseus_moe_destroy(ms[i]) != ncclSuccess)
      gc_die(__FILE__, __LINE__, "perseus_moe_destroy: %s", perseus_moe_last_error());
  gc_world_destroy(&w);
  return bad ? 1 : 0;
}

static void usage(FILE *f)
{
  fprintf(f,
    "usage: perseus_moe_test [options]\n"
    "perseus' fused MoE layer against an fp64 CPU reference, one forked process per GPU.\n"
    "  -p PATH  lsa (P2P on, NVLink peers) or gin (P2P off, the plugin's GIN proxy); default lsa\n"
    "  -g N     GPUs/ranks, at least 1 (default: all visible)\n"
    "  -n N     forwards (default 10)\n"
    "  -l N     generations of layers the forwards are split over, each created on the same\n"
    "           communicator once the one before is destroyed (default 2; at most the forwards)\n"
    "  -a N     layers alive at once in a generation, taking turns (default 2, at most %d)\n"
    "  -H N     hidden (default 256)    -F N  expert FFN width (default 128)\n"
    "  -E N     experts (default 16)    -k N  top-k (default 4)\n"
    "  -T N     max tokens per rank (default 64)\n"
    "  -B N     NVLink dispatch rows per signal (default 0: one per destination and expert)\n"
    "  -S 0|1   GIN rows: 0 one put per destination each way (default), 1 one per\n"
    "           destination and expert (in chunks of -B rows)\n"
    "  -r 0|1   renormalize the top-k weights (default 1)\n"
    "  -G 0|1   every other pair of a layer's forwards replays a CUDA graph of it (default 0)\n"
    "  -s SEED  seed (default: from the clock; printed)\n"
    "  -w SEC   watchdog (default 120)\n"
    "  -f NAME  first, what the layer must refuse without hanging (moe_faults.cuh):\n"
    "           config (ranks that disagree on max_tokens; 2 ranks or more), header (a\n"
    "           corrupt header from rank 0; NVLink peers only), timeout or abort (rank 0\n"
    "           withholds its header), all, or none (default)\n"
    "Exit status: 0 pass, 1 failure (also bad options), 77 no GPU or fewer than asked.\n",
    MT_MAX_ALIVE);
}

int main(int argc, char **argv)
{
  static mt_cfg c;
  static const char *const paths[] = {"lsa", "gin"};
  static const int path_values[] = {TT_LSA, TT_GIN};
  const ps_opt_t opts[] = {
    PS_OPT_NAME('p', &c.path, "lsa", paths, path_values, 2),
    PS_OPT_INT('g', &c.ngpus, NULL, 1, GP_MAX_RANKS), /* 0: all visible */
    PS_OPT_INT('n', &c.iters, "10", 1, 1 << 20),
    PS_OPT_INT('l', &c.layers, "2", 1, 1 << 20),
    PS_OPT_INT('a', &c.alive, "2", 1, MT_MAX_ALIVE),
    PS_OPT_INT('H', &c.mc.hidden, "256", 1, 1 << 16),
    PS_OPT_INT('F', &c.mc.ffn, "128", 1, 1 << 16),
    PS_OPT_INT('E', &c.mc.experts, "16", 1, 4096),
    PS_OPT_INT('k', &c.mc.topk, "4", 1, 64),
    PS_OPT_INT('T', &c.mc.max_tokens, "64", 1, 1 << 20),
    PS_OPT_INT('B', &c.mc.batch, "0", 0, 1 << 20),
    PS_OPT_INT('S', &c.mc.gin_per_expert, "0", 0, 1),
    PS_OPT_INT('r', &c.mc.renormalize, "1", 0, 1),
    PS_OPT_INT('G', &c.graph, "0", 0, 1),
    PS_OPT_SEED('s', &c.seed, NULL), /* from the clock */
    PS_OPT_INT('w', &c.watchdog_s, "120", 1, 24 * 3600),
    PS_OPT_NAME('f', &c.faults, "none", mt_fault_names, NULL, MT_FAULT_ALL + 1),
  };
  ps_opts_parse(argc, argv, "perseus_moe_test", opts, PS_OPTS_N(opts), usage, 1);
  if (c.layers > c.iters) c.layers = c.iters; /* a layer runs a forward at least */
  if (gp_init("perseus_moe_test")) return 1;
  int rc = tt_start(c.path, 1, 1, &c.ngpus, c.watchdog_s, 1);
  if (rc >= 0) return rc;
  /* the config is refused here, before any rank starts, naming the value */
  if (perseus_moe_check_config(&c.mc, c.ngpus)) {
    fprintf(stderr, "perseus_moe_test: %s\n", perseus_moe_last_error());
    return 1;
  }
  printf("# perseus_moe_test: path %s, %d GPUs, seed %#" PRIx64 ", %d forwards on %d x %d layers, hidden "
         "%d, ffn %d, experts %d, top-%d, up to %d tokens per rank, batch %d, GIN puts per %s, renormalize %d, graphs %d, faults %s\n",
         tt_path_names[c.path], c.ngpus, c.seed, c.iters, c.layers, c.alive, c.mc.hidden, c.mc.ffn, c.mc.experts,
         c.mc.topk, c.mc.max_tokens, c.mc.batch,
         c.mc.gin_per_expert ? "destination and expert" : "destination", c.mc.renormalize, c.graph,
         mt_fault_names[c.faults]);
  long long mism;
  double secs;
  int failed = gp_run_test(c.ngpus, mt_child, &c, c.watchdog_s, "moe test", &mism, &secs);
  printf("# %s: path %s, %d ranks, %lld mismatches, %.1f s (seed %#" PRIx64 ")\n",
         failed ? "FAILED" : "PASSED", tt_path_names[c.path], c.ngpus, mism, secs, c.seed);
  return failed ? 1 : 0;
}
