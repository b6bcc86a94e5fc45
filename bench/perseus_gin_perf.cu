/* perseus_gin_perf: device-initiated put + signal (NCCL's ncclGin over the GIN
 * proxy) through the perseus plugin, nccl-tests style, every ordering strategy
 * side by side in one run.
 *
 * For each strategy (-S) the parent forks a fresh set of rank processes (one
 * per GPU, PERSEUS_ORDERING set before NCCL starts, read by the plugin when
 * its one-sided comm connects); the ranks send one record per measured row
 * and rank through a pipe, and the parent prints one table with a column per
 * strategy. A strategy whose communicator or device communicator cannot be
 * created (the provider refuses it) is shown as "refused".
 *
 * Table 1, per tile size x tiles per signal x peers: one kernel per batch,
 * in which each rank puts N tiles (-k) to each of its P peers, a SignalInc
 * after every T tiles (one lane per signal group posts the group in order, so
 * each signal covers its group), flushes, and waits until every one of its P
 * sources has signalled its whole batch. Signals are never reset inside a
 * row (the wait compares with the running total), so batches run back to
 * back as a megakernel's would. Time per batch is the max over ranks; fences
 * and blocked time come from perseus_rma_process_stats() (delta over the
 * timed loop, summed over ranks, per batch).
 * Table 2, per size: a GIN all-to-all (one put + SignalInc per peer, one
 * kernel) against NCCL's host ncclAlltoAll over the same plugin (net
 * transport), measured in the first strategy's set that ran.
 * Exit: 0 every strategy ran or was refused (and one ran), 1 a failure,
 * 77 no GPU or fewer than 2. */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "gin_comm.cuh"
#include "opts.h"
#include "size_parse.h"

#define MAX_SIZES 32
#define MAX_LIST 8
#define MAX_ROWS (MAX_SIZES * MAX_LIST * MAX_LIST + MAX_SIZES)
#define BATCH_WARPS 8

struct perf_cfg {
  int ngpus, iters, warmup, ntiles, stall_s;
  size_t sizes[MAX_SIZES];
  int nsizes, tps[MAX_LIST], ntps, peers[MAX_LIST], npeers;
  char strat[MAX_LIST][32];
  int nstrat;
  /* per forked set */
  int cur_strat, host_a2a, pipe_fd;
};

struct row { int a2a, size_i, tps, peers; };
static row rows[MAX_ROWS];
static int nrows;

/* one per row and rank (set: the strategy); gp_results_t merges them */
struct perf_rec : gp_rec_t {
  double host_us;
  uint64_t fences_posted, fences_avoided, blocked_ns;
};

struct cell : gp_cell_t {
  double host_us;
  uint64_t fences_posted, fences_avoided, blocked_ns;
};
static cell results[MAX_LIST][MAX_ROWS];

/* ---- the kernel ------------------------------------------------------------- */

__global__ void __launch_bounds__(32 * BATCH_WARPS)
batch_kernel(ncclDevComm dc, ncclWindow_t send, ncclWindow_t recv, size_t size, int ntiles,
             int tps, int npeers, size_t region, uint64_t batch)
{
  int n = dc.nRanks, me = dc.rank;
  ncclGin gin{dc, 0};
  ncclTeam world = ncclTeamWorld(dc);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  int ngroups = (ntiles + tps - 1) / tps;
  for (int j = warp; j < npeers; j += nwarps) {
    int peer = (me + 1 + j) % n;
    for (int g = lane; g < ngroups; g += 32) {
      int t0 = g * tps, t1 = min(t0 + tps, ntiles);
      for (int t = t0; t < t1 - 1; t++)
        gin.put(world, peer, recv, me * region + t * size, send, t * size, size);
      gin.put(world, peer, recv, me * region + (t1 - 1) * size, send, (t1 - 1) * size, size,
              ncclGin_SignalInc{(ncclGinSignal_t)(GC_SIG_FIRST + me)});
    }
  }
  uint64_t want = (batch + 1) * (uint64_t)ngroups; /* running total since the row's reset */
  for (int j = threadIdx.x; j < npeers; j += blockDim.x)
    gin.waitSignal(ncclCoopThread(), (ncclGinSignal_t)(GC_SIG_FIRST + (me - 1 - j + n) % n), want);
  gin.flush(ncclCoopCta());
}

/* ---- a rank ----------------------------------------------------------------- */

static void stats_delta(const perseus_rma_peer_stats_t *a, const perseus_rma_peer_stats_t *b,
                        perf_rec *rec)
{
  rec->fences_posted = b->fences_posted - a->fences_posted;
  rec->fences_avoided = b->fences_avoided - a->fences_avoided;
  rec->blocked_ns = b->blocked_ns - a->blocked_ns;
}

static double time_loop(cudaEvent_t ev0, cudaEvent_t ev1, int iters)
{
  float ms = 0.0f;
  GC_CUDA(cudaEventElapsedTime(&ms, ev0, ev1), "%d iterations", iters);
  return (double)ms * 1e3 / iters;
}

static int perf_child(int rank, void *arg)
{
  perf_cfg *c = (perf_cfg *)arg;
  int n = c->ngpus;
  setenv("PERSEUS_ORDERING", c->strat[c->cur_strat], 1);
  gp_progress("init", -1, "PERSEUS_ORDERING=%s", c->strat[c->cur_strat]);
  gc_world w;
  if (gc_world_init(&w, rank, n) != ncclSuccess) return GP_EXIT_REFUSED;
  size_t bmax = c->sizes[c->nsizes - 1], region = (size_t)c->ntiles * bmax;
  gc_window send, recv;
  gc_window_create(&w, region, &send, "send");
  gc_window_create(&w, (size_t)n * region, &recv, "recv");
  if (gc_devcomm_create(&w, GC_SIG_FIRST + n, 0) != ncclSuccess) return GP_EXIT_REFUSED;
  void *a2a_send = NULL, *a2a_recv = NULL;
  if (c->host_a2a) {
    GC_CUDA(cudaMalloc(&a2a_send, (size_t)n * bmax), "%zu bytes", (size_t)n * bmax);
    GC_CUDA(cudaMalloc(&a2a_recv, (size_t)n * bmax), "%zu bytes", (size_t)n * bmax);
  }
  cudaEvent_t ev0, ev1;
  GC_CUDA(cudaEventCreate(&ev0), "rank %d", rank);
  GC_CUDA(cudaEventCreate(&ev1), "rank %d", rank);
  cudaStream_t st = w.stream;

  for (int ri = 0; ri < nrows; ri++) {
    const row *r = &rows[ri];
    size_t size = c->sizes[r->size_i];
    int ntiles = r->a2a ? 1 : c->ntiles, tps = r->a2a ? 1 : r->tps;
    int peers = r->a2a ? n - 1 : r->peers, threads = 32 * (peers < BATCH_WARPS ? peers : BATCH_WARPS);
    gp_progress("perf", ri, "row %d of %d: %s %zu B x %d tiles, %d per signal, %d peers", ri,
                nrows, r->a2a ? "alltoall" : "batch", size, ntiles, tps, peers);
    /* every add to these signals was waited for in the previous row */
    gc_reset_kernel<<<1, 256, 0, st>>>(w.dev, GC_SIG_FIRST + n, 0);
    GC_CUDA(cudaGetLastError(), "gc_reset_kernel<<<1, 256>>>(%d signals)", n);
    gc_wait_stream(&w, "signal reset", NULL, NULL);
    if (gp_barrier(n)) return 1; /* nobody adds before everybody reset */
    uint64_t batch = 0;
    for (int i = 0; i < c->warmup; i++, batch++)
      batch_kernel<<<1, threads, 0, st>>>(w.dev, send.win, recv.win, size, ntiles, tps, peers,
                                          region, batch);
    GC_CUDA(cudaGetLastError(), "batch_kernel<<<1, %d>>>(%zu B, %d tiles, %d/signal, %d peers)",
            threads, size, ntiles, tps, peers);
    gc_wait_stream(&w, "warmup", NULL, NULL);
    if (gp_barrier(n)) return 1;
    perf_rec rec;
    memset(&rec, 0, sizeof(rec));
    perseus_rma_peer_stats_t s0, s1;
    rec.stats_ok = gp_rma_stats(&s0) == 0;
    GC_CUDA(cudaEventRecord(ev0, st), "row %d", ri);
    for (int i = 0; i < c->iters; i++, batch++)
      batch_kernel<<<1, threads, 0, st>>>(w.dev, send.win, recv.win, size, ntiles, tps, peers,
                                          region, batch);
    GC_CUDA(cudaGetLastError(), "batch_kernel<<<1, %d>>>(%zu B, %d tiles, %d/signal, %d peers)",
            threads, size, ntiles, tps, peers);
    GC_CUDA(cudaEventRecord(ev1, st), "row %d", ri);
    gc_wait_stream(&w, "timed loop", NULL, NULL);
    rec.stats_ok = rec.stats_ok && gp_rma_stats(&s1) == 0;
    if (rec.stats_ok) stats_delta(&s0, &s1, &rec);
    rec.us = time_loop(ev0, ev1, c->iters);
    if (r->a2a && c->host_a2a) { /* NCCL's host all-to-all over the same plugin */
      for (int i = 0; i < c->warmup; i++)
        GC_NCCL(ncclAlltoAll(a2a_send, a2a_recv, size, ncclInt8, w.comm, st), "%zu B", size);
      gc_wait_stream(&w, "ncclAlltoAll warmup", NULL, NULL);
      if (gp_barrier(n)) return 1;
      GC_CUDA(cudaEventRecord(ev0, st), "row %d", ri);
      for (int i = 0; i < c->iters; i++)
        GC_NCCL(ncclAlltoAll(a2a_send, a2a_recv, size, ncclInt8, w.comm, st), "%zu B", size);
      GC_CUDA(cudaEventRecord(ev1, st), "row %d", ri);
      gc_wait_stream(&w, "ncclAlltoAll", NULL, NULL);
      rec.host_us = time_loop(ev0, ev1, c->iters);
    }
    rec.set = c->cur_strat, rec.row = ri, rec.rank = rank;
    if (write(c->pipe_fd, &rec, sizeof(rec)) != (ssize_t)sizeof(rec))
      gc_die(__FILE__, __LINE__, "write(result pipe, %zu bytes): %s", sizeof(rec), strerror(errno));
  }

  gp_progress("teardown", -1, "ncclDevCommDestroy, window deregistration, ncclCommDestroy");
  if (gp_barrier(n)) return 1; /* no peer still puts into the windows */
  GC_CUDA(cudaEventDestroy(ev0), "rank %d", rank);
  GC_CUDA(cudaEventDestroy(ev1), "rank %d", rank);
  if (a2a_send) GC_CUDA(cudaFree(a2a_send), "%p", a2a_send);
  if (a2a_recv) GC_CUDA(cudaFree(a2a_recv), "%p", a2a_recv);
  gc_world_close(&w, &send, &recv);
  return 0;
}

/* ---- the parent ------------------------------------------------------------- */

/* The rest of one rank's record of a row into the row's cell. */
static void fold_rec(const void *r, void *c)
{
  const perf_rec *rec = (const perf_rec *)r;
  cell *x = (cell *)c;
  if (rec->host_us > x->host_us) x->host_us = rec->host_us;
  x->fences_posted += rec->fences_posted;
  x->fences_avoided += rec->fences_avoided;
  x->blocked_ns += rec->blocked_ns;
}

static void usage(FILE *f)
{
  fprintf(f,
    "usage: perseus_gin_perf [options]\n"
    "Device-initiated put + signal (ncclGin, GIN proxy) through the perseus plugin, every\n"
    "ordering strategy in one run (a fresh set of rank processes per strategy).\n"
    "  -b SIZE   smallest tile (default 1K)    -e SIZE  largest tile (default 1M)\n"
    "  -f N      size factor (default 4)       -k N     tiles per peer per batch (default 64)\n"
    "  -n N      timed batches per row (default 20)   -w N  warmup batches (default 5)\n"
    "  -g N      GPUs/ranks, at least 2 (default: all visible)\n"
    "  -t LIST   tiles per signal (default 1,8,64)\n"
    "  -P LIST   peer counts (default 1 and all others)\n"
    "  -S LIST   PERSEUS_ORDERING values (default ordered,target,deferred,drain)\n"
    "  -T SEC    watchdog: a rank without progress for SEC s is a hang (default 300)\n"
    "Environment as for perseus_gin_test (NCCL_NET_PLUGIN, PERSEUS_PROVIDER, ...).\n"
    "Exit status: 0 ok, 1 failure or bad options, 77 no GPU or fewer than 2.\n");
}

static int parse_args(perf_cfg *c, int argc, char **argv)
{
  size_t bmin, bmax;
  int factor;
  const char *tps, *peers = NULL, *strat;
  const ps_opt_t opts[] = {
    /* at most 1 GiB a tile: -k tiles from each of 32 ranks stay far from size_t's range */
    PS_OPT_SIZE('b', &bmin, "1K", 1, 1 << 30),
    PS_OPT_SIZE('e', &bmax, "1M", 1, 1 << 30),
    PS_OPT_INT('f', &factor, "4", 2, 1 << 20),
    PS_OPT_INT('k', &c->ntiles, "64", 1, 1 << 16),
    PS_OPT_INT('n', &c->iters, "20", 1, 1 << 24),
    PS_OPT_INT('w', &c->warmup, "5", 0, 1 << 24),
    PS_OPT_INT('g', &c->ngpus, NULL, 2, GP_MAX_RANKS), /* 0: all visible */
    PS_OPT_STR('t', &tps, "1,8,64"),
    PS_OPT_STR('P', &peers, NULL), /* NULL: 1 and all others */
    PS_OPT_STR('S', &strat, "ordered,target,deferred,drain"),
    PS_OPT_INT('T', &c->stall_s, "300", 1, 7 * 24 * 3600),
  };
  ps_opts_parse(argc, argv, "perseus_gin_perf", opts, PS_OPTS_N(opts), usage, 1);
  if (bmin > bmax) {
    fprintf(stderr, "perseus_gin_perf: -b %zu is larger than -e %zu (expected -b <= -e)\n", bmin, bmax);
    return -1;
  }
  for (size_t s = bmin; s <= bmax; s *= (size_t)factor) {
    if (c->nsizes == MAX_SIZES) {
      fprintf(stderr, "perseus_gin_perf: -b %zu -e %zu -f %d give more than %d sizes: raise -f or "
              "narrow -b..-e\n", bmin, bmax, factor, MAX_SIZES);
      return -1;
    }
    c->sizes[c->nsizes++] = s;
    if (s > SIZE_MAX / (size_t)factor) break;
  }
  if ((c->ntps = gp_parse_int_list(tps, 1, 1 << 16, c->tps, MAX_LIST)) < 0) {
    fprintf(stderr, "perseus_gin_perf: bad -t list '%s' (expected up to %d comma-separated "
            "numbers from 1 to 65536)\n", tps, MAX_LIST);
    return -1;
  }
  if (peers && (c->npeers = gp_parse_int_list(peers, 1, GP_MAX_RANKS - 1, c->peers, MAX_LIST)) < 0) {
    fprintf(stderr, "perseus_gin_perf: bad -P list '%s' (expected up to %d comma-separated "
            "numbers from 1 to %d)\n", peers, MAX_LIST, GP_MAX_RANKS - 1);
    return -1;
  }
  /* a name the plugin would refuse is a typo, not a strategy the provider lacks */
  static const char *const known[] = {"auto", "ordered", "fence", "target", "deferred", "drain"};
  const char *cur = strat;
  char t[sizeof(c->strat[0])];
  int r;
  while ((r = sp_list_next(&cur, t, sizeof(t))) > 0) {
    int ok = 0;
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) ok |= !strcmp(t, known[i]);
    if (!ok || c->nstrat == MAX_LIST) {
      fprintf(stderr, "perseus_gin_perf: -S '%s': %s '%s' (expected at most %d of auto, ordered, "
              "fence, target, deferred, drain)\n", strat, ok ? "too many entries at" : "unknown strategy",
              t, MAX_LIST);
      return -1;
    }
    memcpy(c->strat[c->nstrat++], t, sizeof(t));
  }
  if (r < 0) {
    fprintf(stderr, "perseus_gin_perf: -S '%s': an empty or overlong entry (expected a comma list "
            "of auto, ordered, fence, target, deferred, drain)\n", strat);
    return -1;
  }
  return 0;
}

static void print_tables(const perf_cfg *c, const int *refused, const int *failed, int host_set)
{
  int drain = -1;
  for (int s = 0; s < c->nstrat; s++)
    if (!strcmp(c->strat[s], "drain")) drain = s;
  printf("\n# put + signal: each rank puts -k %d tiles to each of P peers, one SignalInc per T "
         "tiles, one kernel per batch (puts, flush, wait for every source); time per batch, max "
         "over ranks, %d batches after %d warmup\n", c->ntiles, c->iters, c->warmup);
  printf("# per strategy: time(us), fences posted and blocked time per batch (sums over ranks, "
         "perseus_rma_process_stats), speedup vs drain\n");
  printf("# %10s %5s %5s", "size(B)", "T", "P");
  for (int s = 0; s < c->nstrat; s++) printf(" | %-37.37s", c->strat[s]);
  printf(" | %8s\n# %10s %5s %5s", "best", "", "", "");
  for (int s = 0; s < c->nstrat; s++)
    printf(" | %10s %8s %10s %6s", "time(us)", "fence/b", "blk(us)/b", "xdrain");
  printf(" | %8s\n", "GB/s");
  for (int ri = 0; ri < nrows; ri++) {
    const row *r = &rows[ri];
    if (r->a2a) continue;
    size_t size = c->sizes[r->size_i];
    double best = 0;
    printf("  %10zu %5d %5d", size, r->tps, r->peers);
    for (int s = 0; s < c->nstrat; s++) {
      const cell *x = &results[s][ri];
      if (refused[s] || x->ranks < c->ngpus) {
        printf(" | %37s", refused[s] ? "refused" : failed[s] ? "failed" : "-");
        continue;
      }
      char fen[16] = "n/a", blk[16] = "n/a", spd[16] = "-";
      if (x->stats_ok) {
        snprintf(fen, sizeof(fen), "%.1f", (double)x->fences_posted / c->iters);
        snprintf(blk, sizeof(blk), "%.1f", (double)x->blocked_ns / c->iters / 1e3);
      }
      const cell *d = drain >= 0 ? &results[drain][ri] : NULL;
      if (d && d->ranks == c->ngpus && x->us > 0) snprintf(spd, sizeof(spd), "%.2f", d->us / x->us);
      printf(" | %10.1f %8s %10s %6s", x->us, fen, blk, spd);
      double gbs = (double)r->peers * c->ntiles * size / (x->us * 1e3);
      if (gbs > best) best = gbs;
    }
    printf(" | %8.3f\n", best);
  }
  printf("\n# all-to-all: every rank sends SIZE to every other rank; GIN: one put + SignalInc "
         "per peer in one kernel; NCCL: ncclAlltoAll (host API, net transport over the same "
         "plugin%s%s%s); time per all-to-all in us, max over ranks; GIN speedup: NCCL time / "
         "fastest GIN time\n",
         host_set >= 0 ? ", measured in the " : "; not measured",
         host_set >= 0 ? c->strat[host_set] : "", host_set >= 0 ? " set" : "");
  printf("# %10s", "size(B)");
  for (int s = 0; s < c->nstrat; s++) printf(" %12.12s", c->strat[s]);
  printf(" %12s %12s\n", "NCCL a2a", "GIN speedup");
  for (int ri = 0; ri < nrows; ri++) {
    const row *r = &rows[ri];
    if (!r->a2a) continue;
    double best = 0;
    printf("  %10zu", c->sizes[r->size_i]);
    for (int s = 0; s < c->nstrat; s++) {
      const cell *x = &results[s][ri];
      if (refused[s] || x->ranks < c->ngpus) {
        printf(" %12s", refused[s] ? "refused" : failed[s] ? "failed" : "-");
        continue;
      }
      printf(" %12.1f", x->us);
      if (best == 0 || x->us < best) best = x->us;
    }
    double host = host_set >= 0 ? results[host_set][ri].host_us : 0;
    if (host > 0) printf(" %12.1f %12.2f\n", host, best > 0 ? host / best : 0.0);
    else printf(" %12s %12s\n", "-", "-");
  }
}

int main(int argc, char **argv)
{
  static perf_cfg c;
  if (parse_args(&c, argc, argv)) return 2; /* a refused option, as ps_opts_parse exits */
  if (gp_init("perseus_gin_perf")) return 1;
  gp_default_env(stdout);
  int rc0 = gc_probe_gpus(0, &c.ngpus, c.stall_s);
  if (rc0 >= 0) return rc0;
  int codes[GP_MAX_RANKS];
  if (c.npeers == 0) {
    c.peers[c.npeers++] = 1;
    if (c.ngpus > 2) c.peers[c.npeers++] = c.ngpus - 1;
  }
  for (int p = 0; p < c.npeers; p++)
    if (c.peers[p] > c.ngpus - 1) {
      fprintf(stderr, "perseus_gin_perf: -P %d but only %d peers\n", c.peers[p], c.ngpus - 1);
      return 1;
    }
  for (int si = 0; si < c.nsizes; si++)
    for (int t = 0; t < c.ntps; t++)
      for (int p = 0; p < c.npeers; p++) rows[nrows++] = row{0, si, c.tps[t], c.peers[p]};
  for (int si = 0; si < c.nsizes; si++) rows[nrows++] = row{1, si, 1, c.ngpus - 1};

  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  int nv = gp_sh->nccl_version;
  const char *prov = getenv("PERSEUS_PROVIDER");
  printf("# machine: host %s, NCCL %d.%d.%d, provider %s, %d GPUs:", host, nv / 10000,
         nv / 100 % 100, nv % 100, prov ? prov : "(plugin default)", c.ngpus);
  gc_print_rank_gpus(c.ngpus);
  printf("\n");

  int refused[MAX_LIST] = {0}, failed[MAX_LIST] = {0}, host_set = -1, ran = 0;
  for (int s = 0; s < c.nstrat; s++) {
    gp_results_t res;
    if (gp_results_open(&res, sizeof(perf_rec), results, sizeof(cell), MAX_LIST, MAX_ROWS,
                        fold_rec))
      return 1;
    c.cur_strat = s, c.pipe_fd = res.fd[1], c.host_a2a = host_set < 0;
    fprintf(stderr, "# strategy %s: %d ranks, %d rows\n", c.strat[s], c.ngpus, nrows);
    int rc = gp_run(c.ngpus, 0, perf_child, &c, c.stall_s, c.strat[s], gp_results_drain, &res,
                    codes);
    gp_results_close(&res);
    for (int r = 0; r < c.ngpus; r++)
      if (codes[r] == GP_EXIT_REFUSED) refused[s] = 1;
    if (rc && !refused[s]) failed[s] = 1;
    if (refused[s])
      fprintf(stderr, "# strategy %s: refused (NCCL init or ncclDevCommCreate failed; see above)\n",
              c.strat[s]);
    if (!rc) ran++;
    if (!rc && c.host_a2a) host_set = s;
  }
  print_tables(&c, refused, failed, host_set);
  int nfailed = 0;
  for (int s = 0; s < c.nstrat; s++) nfailed += failed[s];
  printf("# %d strateg%s ran, %d refused, %d failed\n", ran, ran == 1 ? "y" : "ies",
         c.nstrat - ran - nfailed, nfailed);
  return nfailed || !ran ? 1 : 0;
}
