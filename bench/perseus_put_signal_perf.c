/* perseus_put_signal_perf: tiles + completion signal through the plugin's
 * one-sided table (ncclGin/ncclRma), every ordering strategy side by side in
 * one run, ranks forked on one host, host memory (nccl-tests conventions).
 *
 * Each rank plays NCCL's GIN proxy: per batch, to every peer, t tile puts
 * then one signal (ADD t) riding on the last tile, at most -q requests
 * outstanding per peer, requests polled with test(). Each rank also receives:
 * it polls one 8-byte signal word per source (a registered host window)
 * while progressing, until every source's signal reaches its cumulative
 * count. A batch is over when all of a rank's signals arrived.
 *
 * Then, per strategy, the two-parameter model of seed 000: batch latency
 * T(n) = alpha + beta * (n - 1), n = tiles in flight per batch (tiles per
 * signal x peers), least squares over a short sweep of t at one size. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "opts.h"
#include "ps_driver_gin.h"
#include "ps_gin_abi.h"

#define NSTRAT 5
#define MAX_RANKS 32
#define MAX_SIZES 32
#define NFIT 5
#define MAX_QDEPTH 1024
static const char *const strat_name[NSTRAT] = {"ordered", "fence", "target", "deferred", "drain"};
enum { S_DRAIN = 4 };
static const int fit_tiles[NFIT] = {1, 2, 4, 8, 16};
enum { ST_SKIPPED, ST_DONE, ST_REFUSED };

typedef struct {
  size_t minb, maxb, fitb;
  double factor;
  int iters, warmup, check, tiles, qdepth, stream, nstrat, strat[NSTRAT], nsizes, bind;
  size_t sizes[MAX_SIZES];
  const char *abi, *plugin;
} opts_t;

typedef struct {
  double us, fences, blocked_us; /* per batch; fences/blocked NAN without stats */
  double call_us;                /* per batch: inside the plugin's calls */
  long wrong;
} meas_t;

/* Shared by the ranks, after the adapter's part of the scratch area. */
typedef struct {
  int status[NSTRAT];
  ncclResult_t conn_rc[NSTRAT][MAX_RANKS];
  meas_t rows[NSTRAT][MAX_SIZES][MAX_RANKS];
  meas_t fit[NSTRAT][NFIT][MAX_RANKS];
} results_t;

static size_t results_offset(int nranks) {
  return (drv_gin_shared_bytes(nranks) + 63) & ~(size_t)63;
}

/* One rank's state for one strategy (one connected comm). */
typedef struct {
  drv_rank_t *r;
  const opts_t *o;
  drv_gin_t *g;
  void *coll;
  results_t *res;
  char *src, *dst;
  uint64_t *sig; /* sig[s]: what source s has signalled, cumulative */
  void *src_mh, *dst_mh, *sig_mh;
  size_t slot;   /* bytes per tile slot */
  int tcap;      /* tile slots per source */
  uint64_t expect[MAX_RANKS];
  void **q[MAX_RANKS]; /* per-peer FIFO of outstanding requests, like NCCL's GFD ring */
  unsigned qhead[MAX_RANKS], qtail[MAX_RANKS];
  double call_s; /* the proxy loop's time outside its idle yields: its busy time */
} bench_t;

/* Prints why, prefixed by the rank; returns -1. */
static __attribute__((format(printf, 2, 3))) int fail(const bench_t *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "rank %d: ", b->r->rank);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return -1;
}

static uint64_t tile_id(int src, int iter, int tile) {
  return (uint64_t)src << 48 | (uint64_t)(unsigned)iter << 16 | (uint64_t)tile;
}

/* Tests outstanding requests of each peer in issue order (NCCL's proxy
 * consumes its ring in order), up to the first not done; how many were. */
static int reap(bench_t *b) {
  int n = 0;
  for (int p = 0; p < b->r->nranks; p++)
    while (b->qhead[p] != b->qtail[p]) {
      int done = 0;
      ncclResult_t rc;
      rc = b->g->test(b->coll, b->q[p][b->qhead[p] % (unsigned)b->o->qdepth], &done);
      if (rc != ncclSuccess) return fail(b, "test of a request to rank %d failed (%d)", p, rc);
      if (!done) break;
      b->qhead[p]++, n++;
    }
  return n;
}

/* A barrier that keeps progressing: a peer may still need this rank's
 * progress to finish its transfers. */
static int pbarrier(bench_t *b) {
  return drv_gin_barrier(b->r, b->g, b->coll, 60) ? fail(b, "barrier abandoned") : 0;
}

/* Completes every outstanding request (untimed, before barriers and stats). */
static int drain_queues(bench_t *b) {
  double end = drv_now() + 60;
  for (;;) {
    if (reap(b) < 0) return -1;
    int left = 0;
    for (int p = 0; p < b->r->nranks; p++) left += b->qhead[p] != b->qtail[p];
    if (!left) return 0;
    if (b->g->progress(b->coll) != ncclSuccess) return fail(b, "progress failed");
    if (drv_now() > end) return fail(b, "requests still outstanding after 60 s");
    sched_yield();
  }
}

/* nb batches of t tiles of `size` to every peer. The sender may run `ahead`
 * batches past the last batch whose signals this rank has all received (0:
 * batch by batch, a latency; nb: a stream bounded by the queue depth, as a
 * megakernel keeps producing). check_iter >= 0 (nb = 1): tiles carry the
 * pattern of (me, check_iter, tile) and what arrives is verified into *wrong. */
static int run_batches(bench_t *b, size_t size, int t, int nb, int ahead, int check_iter,
                       long *wrong) {
  const opts_t *o = b->o;
  int P = b->r->nranks, me = b->r->rank, ib[MAX_RANKS] = {0}, ik[MAX_RANKS] = {0}, got = 0;
  uint64_t base[MAX_RANKS] = {0};
  for (int s = 0; s < P; s++)
    if (s != me) base[s] = b->expect[s], b->expect[s] += (uint64_t)nb * (uint64_t)t;
  if (check_iter >= 0)
    for (int k = 0; k < t; k++)
      drv_fill(b->src + (size_t)k * b->slot, size, tile_id(me, check_iter, k));
  /* one clock read per busy pass: the time a pass spends outside its idle
   * yield is the proxy's busy time (b->call_s), and also the stall clock */
  double t_pass = drv_now(), end = t_pass + 60;
  for (;;) {
    int pending = 0, busy = 0, posted = 0;
    /* one new operation per peer per pass, as NCCL's proxy takes one GFD per
     * peer; peers visited from me+1 so ranks do not all start on rank 0 */
    for (int d = 1; d < P; d++) {
      int p = (me + d) % P, k = ik[p];
      if (ib[p] < nb && ib[p] <= got + ahead && b->qtail[p] - b->qhead[p] < (unsigned)o->qdepth) {
        uint64_t soff = (size_t)k * b->slot, doff = ((size_t)me * (size_t)b->tcap + k) * b->slot;
        const char *what = k < t - 1 ? "iput" : "iputSignal";
        void *req = NULL;
        ncclResult_t rc = k < t - 1
            ? b->g->iput(b->coll, soff, b->src_mh, size, doff, b->dst_mh, (uint32_t)p, &req)
            : b->g->iput_signal(b->coll, soff, b->src_mh, size, doff, b->dst_mh, (uint32_t)p,
                                (uint64_t)me * 8, b->sig_mh, (uint64_t)t, NCCL_NET_SIGNAL_OP_ADD,
                                &req);
        if (rc != ncclSuccess) return fail(b, "%s to rank %d failed (%d)", what, p, rc);
        /* NCCL's proxy never retries: a NULL request would be a lost operation */
        if (!req) return fail(b, "%s to rank %d returned no request", what, p);
        b->q[p][b->qtail[p]++ % (unsigned)o->qdepth] = req;
        if (++ik[p] == t) ik[p] = 0, ib[p]++;
        busy = posted = 1;
      }
      pending += ib[p] < nb;
    }
    int reaped = reap(b);
    if (reaped < 0) return -1;
    if (b->g->progress(b->coll) != ncclSuccess) return fail(b, "progress failed");
    /* Signals are read only in a pass that could post nothing: the
     * kernel, not the proxy, waits for them in NCCL, and a pass that posts
     * is not held back by them (-m stream runs its batches ahead). */
    int low = got; /* batches received from every source */
    if (!posted) {
      low = nb;
      for (int s = 0; s < P; s++) {
        if (s == me) continue;
        int n = (int)((__atomic_load_n(&b->sig[s], __ATOMIC_ACQUIRE) - base[s]) / (uint64_t)t);
        low = n < low ? n : low;
      }
    }
    busy |= reaped > 0 || low > got;
    got = low;
    if (got == nb && check_iter >= 0) { /* every signal in: its data must be there */
      for (int s = 0; s < P; s++)
        for (int k = 0; s != me && k < t; k++)
          *wrong += drv_count_wrong(b->dst + ((size_t)s * (size_t)b->tcap + (size_t)k) * b->slot,
                                    size, tile_id(s, check_iter, k));
      check_iter = -1; /* once, though own sends may still be issuing */
    }
    double now = drv_now();
    b->call_s += now - t_pass;
    if (!pending && got == nb) return 0;
    if (busy) end = now + 60; /* a stall detector, not a limit on the run */
    else sched_yield();       /* idle: yield, as NCCL's proxy thread does */
    if (drv_peer_failed(b->r)) return fail(b, "stopping: another rank failed");
    t_pass = busy ? now : drv_now();
    if (now > end)
      return fail(b, "%d batches of %zu B x %d tiles: no progress for 60 s", nb, size, t);
  }
}

/* fences posted and blocked ns summed over peers */
static int stats(bench_t *b, double *fences, double *blocked_ns) {
  *fences = *blocked_ns = 0;
  if (!b->g->peer_stats) return 0;
  for (int p = 0; p < b->r->nranks; p++) {
    perseus_rma_peer_stats_t st;
    if (p == b->r->rank) continue;
    if (b->g->peer_stats(b->coll, (uint32_t)p, &st, sizeof st))
      return fail(b, "peer stats of rank %d", p);
    *fences += (double)st.fences_posted, *blocked_ns += (double)st.blocked_ns;
  }
  return 0;
}

/* Check pass (untimed), warmup, then the timed batches. */
static int measure(bench_t *b, size_t size, int t, int stream, int check, meas_t *m) {
  const opts_t *o = b->o;
  int ahead = stream ? o->iters + o->warmup : 0;
  m->wrong = 0;
  for (int it = 0; check && it < 2; it++) /* two, so a stale previous batch would show */
    if (run_batches(b, size, t, 1, 0, it, &m->wrong) || drain_queues(b) || pbarrier(b)) return -1;
  if (o->warmup && run_batches(b, size, t, o->warmup, ahead, -1, NULL)) return -1;
  double f0, b0, f1, b1;
  if (drain_queues(b) || pbarrier(b) || stats(b, &f0, &b0)) return -1;
  double t0 = drv_now(), c0 = b->call_s;
  if (run_batches(b, size, t, o->iters, ahead, -1, NULL)) return -1;
  double t1 = drv_now();
  m->call_us = (b->call_s - c0) * 1e6 / o->iters;
  if (drain_queues(b) || stats(b, &f1, &b1) || pbarrier(b)) return -1;
  m->us = (t1 - t0) * 1e6 / o->iters;
  m->fences = b->g->peer_stats ? (f1 - f0) / o->iters : NAN;
  m->blocked_us = b->g->peer_stats ? (b1 - b0) / 1e3 / o->iters : NAN;
  return 0;
}

/* A tile slot's bytes and the slots per source, as run_strategy lays them out. */
static size_t slot_bytes(const opts_t *o) {
  size_t maxb = o->maxb > o->fitb ? o->maxb : o->fitb;
  return (maxb + 63) & ~(size_t)63;
}

static int tile_cap(const opts_t *o) {
  return o->tiles > fit_tiles[NFIT - 1] ? o->tiles : fit_tiles[NFIT - 1];
}

/* Every rank's windows (its sources, and a slot area per source for what
 * it receives) must fit the host's memory: past it a rank dies of SIGBUS
 * on its shared window or fails after the others connected. The product
 * stays below 2^56 within the options' bounds. */
static int check_memory(const opts_t *o, int nranks) {
  size_t total = (size_t)nranks * (size_t)(nranks + 1) * (size_t)tile_cap(o) * slot_bytes(o);
  size_t mem = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
  if (total <= mem) return 0;
  fprintf(stderr, "-e/-z/-t/-r: windows of %zu bytes in all (%d ranks x %d windows x %d tiles "
          "x %zu B), more than this host's %zu bytes of memory: lower -e, -z, -t or -r\n", total,
          nranks, nranks + 1, tile_cap(o), slot_bytes(o), mem);
  return -1;
}

static int run_strategy(bench_t *b, int s) {
  const opts_t *o = b->o;
  int P = b->r->nranks, me = b->r->rank, rc = -1;
  b->slot = slot_bytes(o);
  b->tcap = tile_cap(o);
  size_t src_bytes = (size_t)b->tcap * b->slot, dst_bytes = (size_t)P * src_bytes;
  b->src = aligned_alloc(4096, (src_bytes + 4095) & ~(size_t)4095);
  /* what peers write into: shared memory, which the model fabric writes at
   * memory speed (plain memory to any other provider) */
  b->dst = drv_shared_alloc(dst_bytes);
  b->sig = drv_shared_alloc((size_t)P * 8);
  int qok = 1;
  for (int p = 0; p < P; p++) qok &= (b->q[p] = calloc((size_t)o->qdepth, sizeof(void *))) != NULL;
  if (!b->src || !b->dst || !b->sig || !qok) {
    fail(b, "out of memory for %zu + %zu B of windows", src_bytes, dst_bytes);
    goto out;
  }
  memset(b->src, 0, src_bytes), memset(b->dst, 0, dst_bytes);
  /* registration is collective: same order on every rank */
  if (b->g->reg_sym(b->coll, b->src, src_bytes, NCCL_PTR_HOST, 0, &b->src_mh) ||
      b->g->reg_sym(b->coll, b->dst, dst_bytes, NCCL_PTR_HOST, 0, &b->dst_mh) ||
      b->g->reg_sym(b->coll, b->sig, (size_t)P * 8, NCCL_PTR_HOST, NCCL_NET_MR_FLAG_FORCE_SO,
                    &b->sig_mh)) {
    fail(b, "regMrSym failed");
    goto out;
  }
  for (int i = 0; i < o->nsizes; i++)
    if (measure(b, o->sizes[i], o->tiles, o->stream, o->check, &b->res->rows[s][i][me])) goto out;
  for (int i = 0; i < NFIT; i++)
    if (measure(b, o->fitb, fit_tiles[i], 0, 0, &b->res->fit[s][i][me])) goto out;
  rc = 0;
out:
  if (b->sig_mh) b->g->dereg_sym(b->coll, b->sig_mh);
  if (b->dst_mh) b->g->dereg_sym(b->coll, b->dst_mh);
  if (b->src_mh) b->g->dereg_sym(b->coll, b->src_mh);
  for (int p = 0; p < P; p++) free(b->q[p]);
  free(b->src);
  drv_shared_free(b->dst, dst_bytes);
  drv_shared_free(b->sig, (size_t)P * 8);
  return rc;
}

/* -A: rank r runs on the r-th of nranks equal, contiguous shares of the
 * cores it may use, as a launcher binds ranks; the threads the plugin and
 * the provider start later (engine, a NIC's) inherit it, so a rank's proxy
 * and its NIC share a core group, as a proxy near its NIC does. */
/* The cores each of nranks gets (at least 1), or 0 with the reason printed. */
static int bind_share(int nranks) {
  cpu_set_t all;
  if (sched_getaffinity(0, sizeof all, &all)) {
    fprintf(stderr, "-A: sched_getaffinity: %s\n", strerror(errno));
    return 0;
  }
  int n = CPU_COUNT(&all);
  if (n < nranks) fprintf(stderr, "-A: %d ranks but %d cores to share among them\n", nranks, n);
  return n / nranks;
}

static int bind_rank(int rank, int nranks) {
  cpu_set_t all, mine;
  int share = bind_share(nranks), first = rank * share, i = 0;
  if (share < 1 || sched_getaffinity(0, sizeof all, &all)) return -1;
  CPU_ZERO(&mine);
  for (int cpu = 0; cpu < CPU_SETSIZE && i < first + share; cpu++)
    if (CPU_ISSET(cpu, &all) && i++ >= first) CPU_SET(cpu, &mine);
  if (sched_setaffinity(0, sizeof mine, &mine)) {
    fprintf(stderr, "rank %d: sched_setaffinity: %s\n", rank, strerror(errno));
    return -1;
  }
  return 0;
}

static int run_rank(drv_rank_t *r, void *arg) {
  const opts_t *o = arg;
  results_t *res = (results_t *)((char *)r->user + results_offset(r->nranks));
  CHECK(!o->bind || !bind_rank(r->rank, r->nranks), "-A: cannot bind rank %d", r->rank);
  for (int i = 0; i < o->nstrat; i++) {
    int s = o->strat[i];
    drv_gin_t g;
    void *coll = NULL;
    setenv("PERSEUS_ORDERING", strat_name[s], 1); /* read by the engine at connect */
    CHECK(!drv_gin_load(o->plugin, o->abi, &g), "cannot load the %s table", o->abi);
    ncclResult_t crc = drv_gin_connect(r, &g, &coll);
    res->conn_rc[s][r->rank] = crc;
    CHECK(!drv_barrier(r, 120), "barrier after connect (%s)", strat_name[s]);
    int refused = 0;
    for (int p = 0; p < r->nranks; p++) {
      CHECK(res->conn_rc[s][p] == ncclSuccess || res->conn_rc[s][p] == ncclInvalidUsage,
            "connect with PERSEUS_ORDERING=%s failed on rank %d (%d)", strat_name[s], p,
            res->conn_rc[s][p]);
      refused |= res->conn_rc[s][p] == ncclInvalidUsage;
    }
    if (!refused) {
      bench_t b = {.r = r, .o = o, .g = &g, .coll = coll, .res = res};
      CHECK(!run_strategy(&b, s), "strategy %s failed", strat_name[s]);
    }
    drv_gin_close(&g, coll);
    if (r->rank == 0) res->status[s] = refused ? ST_REFUSED : ST_DONE;
    CHECK(!drv_barrier(r, 120), "barrier after %s", strat_name[s]);
  }
  return 0;
}

/* ---- parent: options, aggregation, tables ---- */

/* Over ranks: the batch is over when the slowest rank is done; engine
 * counters are averaged per rank; wrong bytes are summed. */
static meas_t reduce(const meas_t *m, int nranks) {
  meas_t a = {0};
  for (int i = 0; i < nranks; i++) {
    a.us = m[i].us > a.us ? m[i].us : a.us;
    a.fences += m[i].fences / nranks, a.blocked_us += m[i].blocked_us / nranks;
    a.call_us += m[i].call_us / nranks;
    a.wrong += m[i].wrong;
  }
  return a;
}

/* Least squares of y = alpha + beta * x; R^2 of the fit. */
static void fit_line(const double *x, const double *y, int n, double *alpha, double *beta,
                     double *r2) {
  double sx = 0, sy = 0, sxx = 0, sxy = 0, ss = 0, sr = 0;
  for (int i = 0; i < n; i++) sx += x[i], sy += y[i], sxx += x[i] * x[i], sxy += x[i] * y[i];
  double den = n * sxx - sx * sx;
  *beta = den != 0 ? (n * sxy - sx * sy) / den : 0;
  *alpha = (sy - *beta * sx) / n;
  for (int i = 0; i < n; i++) {
    double e = y[i] - (*alpha + *beta * x[i]);
    sr += e * e, ss += (y[i] - sy / n) * (y[i] - sy / n);
  }
  *r2 = ss > 0 ? 1 - sr / ss : 1;
}

static void parse_strats(opts_t *o, const char *arg) {
  char *buf = strdup(arg); /* a copy of any length: no name cut short */
  if (!buf) {
    fprintf(stderr, "-s: out of memory\n");
    exit(2);
  }
  int seen[NSTRAT] = {0};
  o->nstrat = 0;
  /* strtok_r would skip an empty name: a typo, refused like an unknown one */
  for (char *next = buf, *tok; (tok = next);) {
    next = strchr(tok, ',');
    if (next) *next++ = '\0';
    if (!*tok) {
      fprintf(stderr, "-s '%s': empty strategy name (expected a comma list of ordered, fence, "
                      "target, deferred, drain, or all)\n", arg);
      exit(2);
    }
    int s = 0;
    while (s < NSTRAT && strcmp(tok, strat_name[s])) s++;
    if (!strcmp(tok, "all")) {
      for (s = 0; s < NSTRAT; s++) seen[s] = 1;
      continue;
    }
    if (s == NSTRAT) {
      fprintf(stderr, "-s '%s': unknown strategy '%s' (expected a comma list of ordered, fence, "
                      "target, deferred, drain, or all)\n", arg, tok);
      exit(2);
    }
    seen[s] = 1;
  }
  free(buf);
  for (int s = 0; s < NSTRAT; s++) /* canonical order: drain last, the baseline */
    if (seen[s]) o->strat[o->nstrat++] = s;
}

static void usage(FILE *f, const char *argv0) {
  fprintf(f, "usage: %s [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-c 0|1]\n"
         "          [-t TILES] [-r RANKS] [-s STRATEGIES] [-m stream|batch] [-q QDEPTH]\n"
         "          [-z FITSIZE] [-a ABI] [-P PLUGIN]\n"
         "  -b/-e/-f   tile sizes, MIN to MAX by FACTOR (default 16K, 1M, 4)\n"
         "  -n/-w      timed and warmup batches per size (default 20, 5)\n"
         "  -c 0|1     verify every tile after its signal in 2 untimed batches (default 1)\n"
         "  -t TILES   tiles per signal (default 8)\n"
         "  -r RANKS   forked ranks, 2..%d; every rank sends to RANKS-1 peers (default 4)\n"
         "  -s LIST    strategies: all or a comma list of ordered,fence,target,deferred,drain\n"
         "  -m MODE    stream: a rank keeps sending batches, bounded by -q, as a megakernel\n"
         "             keeps producing (default); batch: the next batch starts once all signals\n"
         "             of this one arrived (a latency; the alpha-beta sweep always uses it)\n"
         "  -q QDEPTH  outstanding requests per peer, as NCCL's proxy ring bounds them\n"
         "             (default 256; NCCL's GIN ring is PERSEUS_PROXY_QUEUE deep, 1024 by default)\n"
         "  -z SIZE    tile size of the alpha-beta sweep over t = 1,2,4,8,16 (default 64K)\n"
         "  -a ABI     gin11 (NCCL 2.28, default), gin12, gin13, rma13, rma14\n"
         "  -P PLUGIN  plugin file (default: PERSEUS_PLUGIN_PATH, the build's, else by name)\n"
         "  -A         bind each rank (and the threads it starts) to its own equal share of\n"
         "             the cores, contiguous, as a launcher binds ranks (default: unbound)\n"
         "Provider tcp;ofi_rxm on lo unless PERSEUS_PROVIDER/PERSEUS_IFACE say otherwise.\n",
         argv0, MAX_RANKS);
}

static void print_machine(const char *tag, int nranks) {
  char host[512];
  drv_describe_host(host, sizeof host);
  printf("# %s: %d ranks on %s, provider %s, iface %s\n", tag, nranks, host,
         getenv("PERSEUS_PROVIDER"), getenv("PERSEUS_IFACE"));
}

static void fmt(char *out, size_t n, double v, const char *f) {
  if (isnan(v)) snprintf(out, n, "-");
  else snprintf(out, n, f, v);
}

int main(int argc, char **argv) {
  opts_t o = {.minb = 16u << 10, .maxb = 1u << 20, .fitb = 64u << 10, .factor = 4, .iters = 20,
              .warmup = 5, .check = 1, .tiles = 8, .qdepth = 256, .stream = 1, .abi = "gin11"};
  drv_opts_t d = {.nranks = 4, .timeout_s = 3600, .no_load = 1, .no_mesh = 1};
  parse_strats(&o, "all");
  int c;
  while ((c = getopt_long(argc, argv, "b:e:f:n:w:c:t:r:s:m:q:z:a:P:Ah", ps_help_longopts, NULL)) != -1) {
    switch (c) {
      case 'b': o.minb = drv_parse_size("-b", optarg, 1, 1ULL << 32); break;
      case 'e': o.maxb = drv_parse_size("-e", optarg, 1, 1ULL << 32); break;
      case 'z': o.fitb = drv_parse_size("-z", optarg, 1, 1ULL << 32); break;
      case 'f': o.factor = drv_parse_factor("-f", optarg, 1024); break;
      case 'n': o.iters = drv_parse_int("-n", optarg, 1, 1000000); break;
      case 'w': o.warmup = drv_parse_int("-w", optarg, 0, 1000000); break;
      case 'c': o.check = drv_parse_int("-c", optarg, 0, 1); break;
      case 't': o.tiles = drv_parse_int("-t", optarg, 1, 4096); break;
      case 'r': d.nranks = drv_parse_int("-r", optarg, 2, MAX_RANKS); break;
      case 'q': o.qdepth = drv_parse_int("-q", optarg, 1, MAX_QDEPTH); break;
      case 's': parse_strats(&o, optarg); break;
      case 'm':
        o.stream = !strcmp(optarg, "stream") ? 1 : !strcmp(optarg, "batch") ? 0 : -1;
        if (o.stream < 0) {
          fprintf(stderr, "-m '%s': expected stream or batch\n", optarg);
          return 2;
        }
        break;
      case 'a': o.abi = drv_gin_parse_abi(optarg); break;
      case 'P': o.plugin = drv_parse_plugin("-P", optarg); break;
      case 'A': o.bind = 1; break;
      case 'h': usage(stdout, argv[0]); return 0;
      default: usage(stderr, argv[0]); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  if (o.minb > o.maxb) {
    fprintf(stderr, "-b %zu is larger than -e %zu (expected -b <= -e)\n", o.minb, o.maxb);
    return 2;
  }
  for (size_t n = o.minb; n <= o.maxb; o.nsizes++) {
    if (o.nsizes == MAX_SIZES) {
      fprintf(stderr, "-b/-e/-f give more than %d sizes: raise -f or narrow -b..-e\n", MAX_SIZES);
      return 2;
    }
    o.sizes[o.nsizes] = n;
    size_t next = (size_t)((double)n * o.factor);
    n = next > n ? next : n + 1;
  }
  if (check_memory(&o, d.nranks)) return 2;
  if (o.bind && bind_share(d.nranks) < 1) return 2; /* before the ranks start, not in each */
  drv_default_fabric(); /* the embedded default: loopback TCP */
  size_t off = results_offset(d.nranks);
  d.shared_bytes = off + sizeof(results_t);
  char *area = calloc(1, d.shared_bytes);
  if (!area) return 1;
  d.collect = area;
  print_machine("perseus_put_signal_perf", d.nranks);
  printf("# ABI %s, %s mode, %d tiles per signal, peers per rank %d, queue depth %d, iters %d, "
         "warmup %d, check %d, ranks %s\n", o.abi, o.stream ? "stream" : "batch", o.tiles, d.nranks - 1,
         o.qdepth, o.iters, o.warmup, o.check, o.bind ? "bound to a share of the cores each (-A)" : "unbound");
  const char *plugin = o.plugin ? o.plugin : getenv("PERSEUS_PLUGIN_PATH");
  const char *latency = getenv("PERSEUS_TEST_LATENCY_US"); /* read by the distant-NIC test build */
  if (plugin) printf("# plugin %s%s%s\n", plugin, latency ? ", PERSEUS_TEST_LATENCY_US=" : "",
                     latency ? latency : "");
  const char *prov = getenv("PERSEUS_PROVIDER");
  int model = prov && !strcmp(prov, "model"); /* each rank also runs the model's NIC thread */
  if (model) {
    const char *lat = getenv("PERSEUS_MODEL_LATENCY_US"), *bw = getenv("PERSEUS_MODEL_GBPS");
    printf("# model fabric (docs/model.md): latency %s us, %s GB/s per link\n", lat ? lat : "2 (default)",
           bw ? bw : "12.5 (default)");
  }
  if (d.nranks * (model ? 2 : 1) > sysconf(_SC_NPROCESSORS_ONLN))
    printf("# note: more busy threads than cores: drain polls inside the plugin on a core that the\n"
           "# peer it waits for (or its NIC thread) needs, so its blocked time includes scheduler\n"
           "# time slices\n");
  fflush(stdout);
  double t0 = drv_now();
  if (drv_run(&d, run_rank, &o)) {
    fprintf(stderr, "perseus_put_signal_perf: a rank failed\n");
    return 1;
  }
  results_t *res = (results_t *)(area + off);
  int P = d.nranks;
  int nrun = 0;
  for (int i = 0; i < o.nstrat; i++) nrun += res->status[o.strat[i]] == ST_DONE;
  printf("#\n# strategies run:%s", nrun ? "" : " none");
  for (int i = 0; i < o.nstrat; i++)
    if (res->status[o.strat[i]] == ST_DONE) printf(" %s", strat_name[o.strat[i]]);
  for (int i = 0, n = 0; i < o.nstrat; i++)
    if (res->status[o.strat[i]] == ST_REFUSED) {
      if (!n++) printf("; not supported by %s (refused at connect):", getenv("PERSEUS_PROVIDER"));
      printf(" %s", strat_name[o.strat[i]]);
    }
  printf("\n");
  if (!nrun) { /* a provider that supports none of them: nothing to compare, not an error */
    print_machine("machine", P);
    free(area);
    return 0;
  }
  int have_drain = res->status[S_DRAIN] == ST_DONE;
  printf("# count: tiles a rank sends per batch (t x peers); time: per batch; algbw = size x count"
         " / time\n# (= alltoall busbw: no rank sends to itself); fences, blocked: engine counters"
         " per batch,\n# summed over peers; calls: the proxy's busy time per batch (its passes"
         " outside idle yields:\n# the plugin's calls, blocking included); vs drain: drain's time / this time\n#\n");
  printf("# %10s %6s %9s %10s %11s %7s %11s %9s %9s %7s\n", "size", "count", "strategy", "time(us)",
         "algbw(GB/s)", "fences", "blocked(us)", "calls(us)", "vs drain", "#wrong");
  double bw_sum[NSTRAT] = {0};
  long wrong_total = 0;
  for (int i = 0; i < o.nsizes; i++) {
    meas_t drain = reduce(res->rows[S_DRAIN][i], P);
    for (int k = 0; k < o.nstrat; k++) {
      int s = o.strat[k];
      if (res->status[s] != ST_DONE) continue;
      meas_t m = reduce(res->rows[s][i], P);
      size_t count = (size_t)o.tiles * (size_t)(P - 1);
      double algbw = (double)o.sizes[i] * (double)count / m.us / 1e3;
      char fen[16], blk[16], vs[16], wr[24] = "N/A";
      fmt(fen, sizeof fen, m.fences, "%.2f");
      fmt(blk, sizeof blk, m.blocked_us, "%.1f");
      fmt(vs, sizeof vs, have_drain ? drain.us / m.us : NAN, "%.2fx");
      if (o.check) snprintf(wr, sizeof wr, "%ld", m.wrong);
      printf("  %10zu %6zu %9s %10.1f %11.3f %7s %11s %9.1f %9s %7s\n", o.sizes[i], count,
             strat_name[s], m.us, algbw, fen, blk, m.call_us, vs, wr);
      bw_sum[s] += algbw;
      wrong_total += m.wrong;
    }
  }
  printf("# Out of bounds values : %ld %s\n# Avg bus bandwidth    :", wrong_total,
         wrong_total ? "FAILED" : "OK");
  for (int k = 0; k < o.nstrat; k++)
    if (res->status[o.strat[k]] == ST_DONE)
      printf(" %.3f (%s)", bw_sum[o.strat[k]] / o.nsizes, strat_name[o.strat[k]]);
  printf("\n#\n# alpha-beta model (seed 000) at %zu B tiles: T(n) = alpha + beta*(n-1), n = tiles"
         " in flight\n# per batch = t x %d peers, least squares over t = 1,2,4,8,16; T(n) in us\n",
         o.fitb, P - 1);
  printf("# %9s %10s %9s %6s", "strategy", "alpha(us)", "beta(us)", "R^2");
  for (int i = 0; i < NFIT; i++) {
    char h[16];
    snprintf(h, sizeof h, "T(%d)", fit_tiles[i] * (P - 1));
    printf(" %8s", h);
  }
  printf("\n");
  for (int k = 0; k < o.nstrat; k++) {
    int s = o.strat[k];
    if (res->status[s] != ST_DONE) continue;
    double x[NFIT], y[NFIT], alpha, beta, r2;
    for (int i = 0; i < NFIT; i++) {
      x[i] = fit_tiles[i] * (P - 1) - 1;
      y[i] = reduce(res->fit[s][i], P).us;
    }
    fit_line(x, y, NFIT, &alpha, &beta, &r2);
    printf("  %9s %10.1f %9.2f %6.3f", strat_name[s], alpha, beta, r2);
    for (int i = 0; i < NFIT; i++) printf(" %8.1f", y[i]);
    printf("\n");
  }
  printf("#\n");
  print_machine("machine", P);
  printf("# wall time %.1f s\n", drv_now() - t0);
  free(area);
  return wrong_total ? 1 : 0;
}
