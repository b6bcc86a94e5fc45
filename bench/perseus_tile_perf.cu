/* perseus_tile_perf: perseus' device library (perseus/device.cuh) measured,
 * nccl-tests style: per tile size x batch (tiles per signal), per-tile
 * signaling (batch 1) against batched, LSA (stores or TMA) against GIN side
 * by side.
 *
 * For each path (-p) the parent sets that path's NCCL environment (LSA and
 * TMA: P2P on, every peer of the node by NVLink, tiles moved by the coop's
 * stores or by TMA bulk copies; GIN: P2P off, ncclGin through the perseus
 * plugin) and forks a fresh set of rank processes; the ranks
 * send one record per row through a pipe and the parent prints one table.
 * A round: every rank puts -t tiles of SIZE to every other rank from -c CTAs
 * (perseus_batch::put, one signal per B tiles), flushes every peer, and waits
 * (perseus_recv::wait) until every source's tiles of the round arrived.
 * Rounds run back to back, counts never reset (no barrier between rounds).
 *   tiles/s   all ranks' tiles / the slowest rank's time, rounds of -t tiles;
 *   round     time per such round (us);
 *   lat       time per round of exactly one batch (B tiles) per peer: the
 *             latency of a batch from first put to its signal seen;
 *   sig/t     GIN: plugin signals per tile (perseus_rma_process_stats, all
 *             ranks): ceil(t/B)/t, so it must drop by the batch factor;
 *   fen/t     GIN: of those, signals that fenced behind earlier puts.
 * Exit: 0 every path ran, 1 a failure, 77 no GPU or fewer than 2. */
#include <errno.h>
#include <unistd.h>

#include "opts.h"
#include "size_parse.h"
#include "tile_comm.cuh"

#define MAX_SIZES 32
#define MAX_LIST 8

struct perf_cfg {
  int ngpus, iters, warmup, ntiles, ctas, coop, stall_s;
  size_t sizes[MAX_SIZES];
  int nsizes, batch[MAX_LIST], nbatch, paths[TT_PATH_N], npaths;
  int cur_path, pipe_fd; /* per forked set */
};

/* one per row and rank (set: the path's index in -p); gp_results_t merges them */
struct perf_rec : gp_rec_t {
  double lat_us;
  uint64_t tiles, signals, fences, want_signals;
};

struct cell : gp_cell_t {
  double lat_us;
  uint64_t tiles, signals, fences, want_signals;
};

static cell results[TT_PATH_N][MAX_SIZES * MAX_LIST];

struct tt_totals { uint64_t v[GP_MAX_RANKS]; };

/* One block per source; its first thread waits for the cumulative count. */
__global__ void wait_kernel(ncclDevComm dc, perseus_batch_handle h, tt_totals t)
{
  int s = (dc.rank + 1 + blockIdx.x) % dc.nRanks;
  if (threadIdx.x == 0) perseus_recv(dc, h).wait(s, t.v[s]);
}

struct rounds {
  gc_world *w;
  gc_window *win;
  perseus_batch_handle h;
  const perf_cfg *c;
  tt_totals tot;
};

/* `k` rounds of p.fixed_tiles tiles per peer with batch b, enqueued. */
static void enqueue(rounds *r, tt_plan &p, uint32_t b, int k)
{
  int n = r->c->ngpus;
  for (int i = 0; i < k; i++) {
    p.iter++;
    for (int s = 0; s < n; s++)
      if (s != p.me) r->tot.v[s] += (uint64_t)p.fixed_tiles;
    tt_produce_kernel<<<r->c->ctas, TT_THREADS, 0, r->w->stream>>>(
        r->w->dev, r->h, r->win->win, p, b, r->c->coop, r->c->paths[r->c->cur_path] == TT_TMA, 0,
        NULL);
    GC_CUDA(cudaGetLastError(), "tt_produce_kernel<<<%d, %d>>>", r->c->ctas, TT_THREADS);
    tt_flush_kernel<<<1, 32, 0, r->w->stream>>>(r->w->dev, r->h, b, NULL);
    GC_CUDA(cudaGetLastError(), "tt_flush_kernel");
    wait_kernel<<<n - 1, 32, 0, r->w->stream>>>(r->w->dev, r->h, r->tot);
    GC_CUDA(cudaGetLastError(), "wait_kernel<<<%d, 32>>>", n - 1);
  }
}

/* Microseconds per round over c->iters timed rounds, after c->warmup. */
static double timed(rounds *r, tt_plan &p, uint32_t b, cudaEvent_t e0, cudaEvent_t e1)
{
  enqueue(r, p, b, r->c->warmup);
  gc_wait_stream(r->w, "warmup", NULL, NULL);
  if (gp_barrier(r->c->ngpus)) _exit(1);
  GC_CUDA(cudaEventRecord(e0, r->w->stream), "start");
  enqueue(r, p, b, r->c->iters);
  GC_CUDA(cudaEventRecord(e1, r->w->stream), "stop");
  gc_wait_stream(r->w, "timed rounds", NULL, NULL);
  float ms = 0.0f;
  GC_CUDA(cudaEventElapsedTime(&ms, e0, e1), "%d rounds", r->c->iters);
  return (double)ms * 1e3 / r->c->iters;
}

static int perf_child(int rank, void *arg)
{
  const perf_cfg *c = (const perf_cfg *)arg;
  int n = c->ngpus, path = c->paths[c->cur_path], gin = path == TT_GIN;
  gp_progress(tt_path_names[path], -1, "init");
  gc_world w;
  if (gc_world_init(&w, rank, n) != ncclSuccess) return GP_EXIT_REFUSED;
  tt_plan p;
  memset(&p, 0, sizeof(p));
  p.me = rank, p.nranks = n, p.emax = (uint32_t)c->sizes[c->nsizes - 1], p.tmax = c->ntiles;
  for (int i = 0; i < c->nbatch; i++)
    if (c->batch[i] > p.tmax) p.tmax = c->batch[i]; /* latency rounds put B tiles */
  size_t wbytes;
  tt_layout(&p, &wbytes);
  gc_window win;
  gc_window_create(&w, wbytes, &win, "tiles");
  rounds r;
  memset(&r, 0, sizeof(r));
  r.w = &w, r.win = &win, r.c = c;
  if (tt_devcomm_create(&w, path, &r.h) != ncclSuccess) return GP_EXIT_REFUSED;
  cudaEvent_t e0, e1;
  GC_CUDA(cudaEventCreate(&e0), "event");
  GC_CUDA(cudaEventCreate(&e1), "event");
  for (int si = 0; si < c->nsizes; si++) {
    for (int bi = 0; bi < c->nbatch; bi++) {
      uint32_t b = (uint32_t)c->batch[bi];
      perf_rec rec;
      memset(&rec, 0, sizeof(rec));
      rec.set = c->cur_path, rec.row = si * c->nbatch + bi, rec.rank = rank;
      p.fixed_size = (uint32_t)c->sizes[si];
      gp_progress(NULL, rec.row, "size %u, batch %u: tiles/s", p.fixed_size, b);
      p.fixed_tiles = c->ntiles;
      perseus_rma_peer_stats_t s0, s1;
      rec.stats_ok = gin && gp_rma_stats(&s0) == 0;
      rec.us = timed(&r, p, b, e0, e1);
      /* every rank waited for this rank's signals: they are all posted */
      if (gp_barrier(n)) return 1;
      rec.tiles = (uint64_t)(c->warmup + c->iters) * c->ntiles * (n - 1);
      rec.want_signals = (uint64_t)(c->warmup + c->iters) * tt_round_signals(p, b);
      if (rec.stats_ok) {
        rec.stats_ok = tt_stats_settle(&s0, rec.want_signals, &s1) == 0;
        rec.signals = s1.signals - s0.signals, rec.fences = s1.fences_posted - s0.fences_posted;
      }
      gp_progress(NULL, rec.row, "size %u, batch %u: latency", p.fixed_size, b);
      p.fixed_tiles = (int)b;
      rec.lat_us = timed(&r, p, b, e0, e1);
      if (gp_barrier(n)) return 1;
      if (write(c->pipe_fd, &rec, sizeof(rec)) != (ssize_t)sizeof(rec))
        gc_die(__FILE__, __LINE__, "write(result pipe): %s", strerror(errno));
    }
  }
  gp_progress("teardown", -1, "final barrier");
  if (gin) {
    gc_barrier_kernel<<<1, 32, 0, w.stream>>>(w.dev, w.world_bar);
    GC_CUDA(cudaGetLastError(), "gc_barrier_kernel");
    gc_wait_stream(&w, "final barrier", NULL, NULL);
  }
  if (gp_barrier(n)) return 1;
  gc_world_close(&w, &win, NULL);
  return 0;
}

/* The rest of one rank's record of a row into the row's cell. */
static void fold_rec(const void *r, void *c)
{
  const perf_rec *rec = (const perf_rec *)r;
  cell *x = (cell *)c;
  if (rec->lat_us > x->lat_us) x->lat_us = rec->lat_us;
  x->tiles += rec->tiles, x->signals += rec->signals, x->fences += rec->fences;
  x->want_signals += rec->want_signals;
}

static void usage(FILE *f)
{
  fprintf(f,
    "usage: perseus_tile_perf [options]\n"
    "perseus' device library: tile puts with one signal per batch, LSA and GIN side by side.\n"
    "  -b SIZE  smallest tile (default 4K)    -e SIZE  largest tile (default 1M)\n"
    "  -f N     size factor (default 4)       -g N     GPUs (default: all visible, >= 2)\n"
    "  -n N     timed rounds (default 50)     -w N     warmup rounds (default 5)\n"
    "  -B LIST  tiles per signal (default 1,8,64)\n"
    "  -p LIST  paths: lsa (NVLink stores), tma (NVLink, TMA bulk copies), gin (the plugin)\n"
    "           (default lsa,tma,gin)\n"
    "  -t N     tiles per peer per round (default 64)   -c N  producer CTAs (default 8)\n"
    "  -C KIND  coop per tile: cta or warp (default cta)\n"
    "  -W SEC   watchdog (default 120)\n");
}

int main(int argc, char **argv)
{
  static perf_cfg c;
  size_t bmin, bmax;
  int factor;
  const char *blist, *plist;
  static const char *const coops[] = {"cta", "warp"};
  static const int coop_values[] = {TT_COOP_CTA, TT_COOP_WARP};
  const ps_opt_t opts[] = {
    PS_OPT_SIZE('b', &bmin, "4K", 1, 0),
    PS_OPT_SIZE('e', &bmax, "1M", 1, 64u << 20),
    PS_OPT_INT('f', &factor, "4", 2, 1024),
    PS_OPT_INT('g', &c.ngpus, NULL, 2, GP_MAX_RANKS), /* 0: all visible */
    PS_OPT_INT('n', &c.iters, "50", 1, 1 << 24),
    PS_OPT_INT('w', &c.warmup, "5", 0, 1 << 20),
    PS_OPT_STR('B', &blist, "1,8,64"),
    PS_OPT_STR('p', &plist, "lsa,tma,gin"),
    PS_OPT_INT('t', &c.ntiles, "64", 1, 4096),
    PS_OPT_INT('c', &c.ctas, "8", 1, 1024),
    PS_OPT_NAME('C', &c.coop, "cta", coops, coop_values, 2),
    PS_OPT_INT('W', &c.stall_s, "120", 1, 24 * 3600),
  };
  ps_opts_parse(argc, argv, "perseus_tile_perf", opts, PS_OPTS_N(opts), usage, 1);
  if (bmin > bmax) {
    fprintf(stderr, "perseus_tile_perf: -b %zu is larger than -e %zu (expected -b <= -e)\n", bmin,
            bmax);
    return 2;
  }
  for (size_t s = bmin; s <= bmax && c.nsizes < MAX_SIZES; s *= (size_t)factor)
    c.sizes[c.nsizes++] = s;
  if ((c.nbatch = gp_parse_int_list(blist, 1, 4096, c.batch, MAX_LIST)) < 0) {
    fprintf(stderr, "perseus_tile_perf: bad -B list '%s' (expected up to %d comma-separated "
            "numbers from 1 to 4096)\n", blist, MAX_LIST);
    return 2;
  }
  const char *cur = plist;
  char t[8];
  int r;
  while ((r = sp_list_next(&cur, t, sizeof(t))) > 0) {
    int pth = -1;
    for (int i = 0; i < TT_PATH_N; i++)
      if (!strcmp(t, tt_path_names[i])) pth = i;
    if (pth < 0 || c.npaths == TT_PATH_N) {
      r = -1;
      break;
    }
    c.paths[c.npaths++] = pth;
  }
  if (r < 0) {
    fprintf(stderr, "perseus_tile_perf: bad -p list '%s' (expected at most %d of lsa, tma, gin)\n",
            plist, TT_PATH_N);
    return 2;
  }
  if (gp_init("perseus_tile_perf")) return 1;
  /* the probe needs EAGER too (GIN's environment); each set sets its own */
  int rc0 = tt_start(TT_GIN, 0, 2, &c.ngpus, c.stall_s, 0);
  if (rc0 >= 0) return rc0;
  for (int pi = 0; pi < c.npaths; pi++)
    if ((rc0 = tt_check_hosts(c.paths[pi], 0)) >= 0) return rc0;
  int codes[GP_MAX_RANKS];
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  int nv = gp_sh->nccl_version;
  const char *prov = getenv("PERSEUS_PROVIDER"), *ord = getenv("PERSEUS_ORDERING");
  printf("# machine: host %s, NCCL %d.%d.%d, provider %s, ordering %s, %d GPUs:", host,
         nv / 10000, nv / 100 % 100, nv % 100, prov ? prov : "(plugin default)",
         ord ? ord : "(plugin default)", c.ngpus);
  gc_print_rank_gpus(c.ngpus);
  printf("\n# %d tiles per peer per round, %d producer CTAs of %s coops, %d rounds (+%d warmup)\n",
         c.ntiles, c.ctas, c.coop == TT_COOP_CTA ? "CTA" : "warp", c.iters, c.warmup);

  int ran[TT_PATH_N] = {0}, failed = 0;
  for (int pi = 0; pi < c.npaths; pi++) {
    gp_results_t res;
    if (gp_results_open(&res, sizeof(perf_rec), results, sizeof(cell), TT_PATH_N,
                        MAX_SIZES * MAX_LIST, fold_rec))
      return 1;
    tt_set_env(c.paths[pi], stdout); /* the parent's environment is what the set inherits */
    c.cur_path = pi, c.pipe_fd = res.fd[1];
    int rc = gp_run(c.ngpus, 0, perf_child, &c, c.stall_s, tt_path_names[c.paths[pi]],
                    gp_results_drain, &res, codes);
    gp_results_close(&res);
    ran[pi] = rc == 0;
    if (rc) {
      failed = 1;
      fprintf(stderr, "# path %s: failed (see above)\n", tt_path_names[c.paths[pi]]);
    }
  }

  printf("\n# %10s %5s", "size(B)", "B");
  for (int pi = 0; pi < c.npaths; pi++)
    printf(" | %-4s %9s %9s %8s%s", tt_path_names[c.paths[pi]], "Mtiles/s", "round(us)",
           "lat(us)", c.paths[pi] == TT_GIN ? "    sig/t    exp/t    fen/t" : "");
  printf("\n");
  for (int si = 0; si < c.nsizes; si++) {
    for (int bi = 0; bi < c.nbatch; bi++) {
      int row = si * c.nbatch + bi;
      printf("  %10zu %5d", c.sizes[si], c.batch[bi]);
      for (int pi = 0; pi < c.npaths; pi++) {
        const cell *x = &results[pi][row];
        int gin = c.paths[pi] == TT_GIN;
        if (!ran[pi] || x->ranks != c.ngpus || x->us <= 0) {
          printf(" | %-4s %9s %9s %8s%s", "", "-", "-", "-", gin ? "        -        -        -" : "");
          continue;
        }
        /* the tiles of the timed rounds only, over the slowest rank's time */
        double tiles = (double)c.ntiles * (c.ngpus - 1) * c.ngpus * c.iters;
        printf(" | %-4s %9.3f %9.1f %8.1f", "", tiles / (x->us * c.iters), x->us, x->lat_us);
        if (!gin) continue;
        if (x->stats_ok && x->tiles) {
          printf(" %8.4f %8.4f %8.4f%s", (double)x->signals / x->tiles,
                 (double)x->want_signals / x->tiles, (double)x->fences / x->tiles,
                 x->signals == x->want_signals ? "" : " !");
          if (x->signals != x->want_signals) failed = 1;
        } else {
          printf(" %8s %8s %8s", "n/a", "n/a", "n/a");
        }
      }
      printf("\n");
    }
  }
  for (int pi = 0; pi < c.npaths; pi++)
    if (c.paths[pi] == TT_GIN) {
      printf("# sig/t: plugin signals per tile over warmup + timed rounds, all ranks; exp/t: "
             "ceil(t/B)/t; '!' marks a mismatch; fen/t: signals that waited for or fenced "
             "behind earlier puts (deferred, drain, fence)\n");
      break;
    }
  return failed ? 1 : 0;
}
