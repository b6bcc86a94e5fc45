/* moe_faults.cuh: perseus_moe_test -f, what the layer must refuse, on every
 * rank, without hanging (included by moe_test.cu after its helpers):
 *   config   the last rank asks for 64 more max_tokens: every rank's create
 *            must refuse, naming the field (2 ranks or more); and a
 *            forward before perseus_moe_load_weights must be refused;
 *   header   rank 0's header to every destination is corrupt, three ways
 *            (a count past the region, a negative count, counts whose sum
 *            is past it), with no timeout on any rank: rank 0's forward
 *            ends only if every peer tells it (poisoned done marks over
 *            NVLink, the poison signal over GIN), else the watchdog fires;
 *   timeout  rank 0 withholds its header from the last rank, which gives up
 *            on it after PERSEUS_MOE_TIMEOUT_MS (1 s) and must report it;
 *            rank 0 must then report that rank (its results from there are
 *            not valid), told by it before its own 4 s timeout, and every
 *            other rank must succeed; the same with
 *            rank 0's rows withheld instead (2 ranks or more: a rank's own
 *            rows are not sent);
 *   abort    rank 0 withholds its header from every rank, without a
 *            timeout: every forward is ended by perseus_moe_abort from
 *            another thread after 300 ms (or, first, by a peer's abort,
 *            which fails this rank and tells it).
 * Every rank's forward must end (the watchdog catches a hang), a failed
 * layer must report its fault from the profile (ncclRemoteError, the reason
 * named) and refuse the next forward. */
#ifndef MT_MOE_FAULTS_CUH
#define MT_MOE_FAULTS_CUH

#include <pthread.h>
#include <unistd.h>

/* The test hook of moe_status.cu: the header this rank sends announces
 * `count` rows for local expert j (j >= 0), or is not sent (send 0). */
extern "C" void ps_moe_test_header(perseus_moe_t *m, int j, int count, int skip);
/* and: rank 0's rows for rank `skip` are not sent */
extern "C" void ps_moe_test_rows(perseus_moe_t *m, int skip);

static int mt_fault_config(const mt_cfg *c, gc_world *w, int rank)
{
  if (c->ngpus < 2) {
    if (rank == 0) printf("fault config: skipped (one rank has no one to disagree with)\n");
    return 0;
  }
  perseus_moe_config_t mc = c->mc;
  if (rank == c->ngpus - 1) mc.max_tokens += 64;
  perseus_moe_t *m = NULL;
  gp_progress(NULL, -1, "fault config: perseus_moe_create with max_tokens %d", mc.max_tokens);
  const ncclResult_t r = perseus_moe_create(w->comm, &mc, &m);
  const char *why = perseus_moe_last_error();
  const int bad = r != ncclInvalidUsage || m || !strstr(why, "max_tokens");
  printf("rank %d: fault config: %s (%s: %s)\n", rank, bad ? "FAILED" : "ok", ncclGetErrorString(r), why);
  if (m) perseus_moe_destroy(m);
  return bad;
}

/* A forward before any weights: refused on every rank (none waits). */
static int mt_fault_no_weights(const mt_cfg *c, gc_world *w, int rank, void *d_x, void *d_out)
{
  perseus_moe_t *m = NULL;
  if (perseus_moe_create(w->comm, &c->mc, &m) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "perseus_moe_create: %s", perseus_moe_last_error());
  const ncclResult_t r = perseus_moe_forward(m, d_x, d_out, 1, w->stream);
  const char *why = perseus_moe_last_error();
  const int bad = r != ncclInvalidUsage || !strstr(why, "perseus_moe_load_weights");
  printf("rank %d: fault no weights: %s (%s: %s)\n", rank, bad ? "FAILED" : "ok", ncclGetErrorString(r), why);
  if (perseus_moe_destroy(m) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "perseus_moe_destroy: %s", perseus_moe_last_error());
  return bad;
}

struct mt_fault_case {
  const char *what;
  int j, count, skip; /* rank 0's header (ps_moe_test_header) */
  int rows_skip;      /* rank 0's rows withheld from this rank (ps_moe_test_rows; -1: none) */
  /* PERSEUS_MOE_TIMEOUT_MS of the ranks the header is withheld from and of
   * the others (NULL: the default) */
  const char *timeout_victim, *timeout_other;
  int abort_ms; /* > 0: perseus_moe_abort from another thread after it */
  char want[64]; /* in the reason of a rank that gets rank 0's bad header or none */
};

struct mt_aborter {
  perseus_moe_t *m;
  int ms;
};

static void *mt_abort_later(void *arg)
{
  const mt_aborter *a = (const mt_aborter *)arg;
  usleep((useconds_t)a->ms * 1000);
  if (perseus_moe_abort(a->m) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "perseus_moe_abort: %s", perseus_moe_last_error());
  return NULL;
}

/* One case on a fresh layer: every rank's forward must end; a rank that
 * got rank 0's bad header, or none, must report it (want), rank 0 must
 * report the peer that failed it (its results from there are not valid),
 * and the others must succeed: a failed peer does not spoil the results
 * healthy ranks owe each other. */
static int mt_fault_forward(const mt_cfg *c, gc_world *w, const mt_host *h, int rank,
                            const mt_fault_case *fc, void *d_x, void *d_out)
{
  const int T = c->mc.max_tokens;
  const int skip = fc->rows_skip >= 0 ? fc->rows_skip : fc->skip; /* the rank rank 0 fails */
  const int victim = skip == -2 || skip == rank || skip == -1;
  const char *tmo = victim ? fc->timeout_victim : fc->timeout_other;
  const char *was = getenv("PERSEUS_MOE_TIMEOUT_MS");
  char keep[64];
  snprintf(keep, sizeof(keep), "%s", was ? was : "");
  if (tmo) setenv("PERSEUS_MOE_TIMEOUT_MS", tmo, 1);
  perseus_moe_t *m = mt_layer(c, w, h, rank);
  if (was) setenv("PERSEUS_MOE_TIMEOUT_MS", keep, 1); /* the user's, for the layers after */
  else unsetenv("PERSEUS_MOE_TIMEOUT_MS");
  if (!m) gc_die(__FILE__, __LINE__, "fault %s: perseus_moe_create refused", fc->what);
  if (rank == 0) ps_moe_test_header(m, fc->j, fc->count, fc->skip), ps_moe_test_rows(m, fc->rows_skip);
  gp_progress(NULL, -1, "fault: %s", fc->what);
  const double t0 = gp_now();
  if (perseus_moe_forward(m, d_x, d_out, T, w->stream) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "fault %s: perseus_moe_forward: %s", fc->what, perseus_moe_last_error());
  pthread_t th;
  mt_aborter ab = {m, fc->abort_ms};
  if (fc->abort_ms > 0 && pthread_create(&th, NULL, mt_abort_later, &ab))
    gc_die(__FILE__, __LINE__, "pthread_create failed");
  gc_wait_stream(w, "fault forward", NULL, NULL);
  if (fc->abort_ms > 0) pthread_join(th, NULL);
  const double took = gp_now() - t0;
  perseus_moe_profile_t pf;
  char why[512], peer[32];
  const ncclResult_t r = perseus_moe_last_profile(m, &pf);
  snprintf(why, sizeof(why), "%s", perseus_moe_last_error());
  snprintf(peer, sizeof(peer), "from rank %d", skip);
  const int fails = victim || rank == 0; /* rank 0: its tokens' results from the victim */
  const char *want = victim ? fc->want : peer;
  /* the next forward: refused where the layer failed (a healthy rank's would
   * wait for the failed ones) */
  const ncclResult_t r2 = fails ? perseus_moe_forward(m, d_x, d_out, T, w->stream) : ncclRemoteError;
  /* a failed rank cannot have failed before the victim gave up: a wait
   * that ended early (a bad clock or unit) fails the case; and rank 0,
   * failed by the victim, must learn it from the victim (poisoned marks or
   * the GIN poison), not by its own, later timeout */
  const double early = fc->abort_ms > 0 ? fc->abort_ms / 1e3
                       : fc->timeout_victim ? atof(fc->timeout_victim) / 1e3 : 0;
  const double own = !victim && fc->timeout_other ? atof(fc->timeout_other) / 1e3 : 0;
  const int fail = fails ? r != ncclRemoteError || !strstr(why, want) || r2 != ncclRemoteError ||
                               took < 0.9 * early || (own > 0 && took > 0.75 * own)
                         : r != ncclSuccess;
  printf("rank %d: fault %s: %s after %.2f s (%s; profile: %s: %s; next forward: %s)\n", rank,
         fc->what, fail ? "FAILED" : "ok", took, fails ? "must fail" : "must succeed",
         ncclGetErrorString(r), fails ? why : "-", fails ? ncclGetErrorString(r2) : "-");
  /* A rank that gave up ends its forward while a peer may still put into
   * its window (rank 0 returns results once its own wait gave up): the
   * windows go only once every rank's forward ended and those puts landed,
   * or the communicator reports the put into a deregistered window (moe.h) */
  if (gp_barrier(c->ngpus)) _exit(1);
  usleep(200 * 1000);
  if (perseus_moe_destroy(m) != ncclSuccess)
    gc_die(__FILE__, __LINE__, "perseus_moe_destroy: %s", perseus_moe_last_error());
  return fail;
}

static int mt_faults(const mt_cfg *c, gc_world *w, const mt_host *h, int rank)
{
  const int f = c->faults, all = f == MT_FAULT_ALL;
  int bad = 0;
  const perseus_moe_config_t *mc = &c->mc;
  const int R = c->ngpus, T = mc->max_tokens, L = mc->experts / R, P = T * (mc->topk < L ? mc->topk : L);
  const size_t H = mc->hidden;
  uint16_t *x = mt_alloc((size_t)T * H);
  mt_tokens(c, h, rank, 0, T, x);
  void *d_x, *d_out;
  GC_CUDA(cudaMalloc(&d_x, (size_t)T * H * 2), "x");
  GC_CUDA(cudaMalloc(&d_out, (size_t)T * H * 2), "out");
  GC_CUDA(cudaMemcpy(d_x, x, (size_t)T * H * 2, cudaMemcpyHostToDevice), "x");
  if (f == MT_FAULT_CONFIG || all)
    bad += mt_fault_config(c, w, rank) + mt_fault_no_weights(c, w, rank, d_x, d_out);
  mt_fault_case cs[6];
  int n = 0;
  if (f == MT_FAULT_HEADER || all) {
    /* no timeout on any rank: only its peers telling it end rank 0's waits */
    cs[n++] = {"header: one count past the region", 0, P + 1, -1, -1, "0", "0", 0, ""};
    cs[n++] = {"header: a negative count", 0, -1, -1, -1, "0", "0", 0, ""};
    /* the hot expert 0 has rows, so the sum up to the last expert is past P */
    cs[n++] = {"header: counts whose sum is past the region", L - 1, P, -1, -1, "0", "0", 0, ""};
    for (int i = n - 3; i < n; i++)
      snprintf(cs[i].want, sizeof(cs[i].want), "expert %d has %d rows", cs[i].j, cs[i].count);
  }
  /* the last rank gives up on rank 0's header after 1 s and tells rank 0,
   * which must fail then, not by its own 4 s timeout on the results that
   * rank owes it; the healthy ranks get theirs from it once its experts
   * ran, at about 1 s */
  if (f == MT_FAULT_TIMEOUT || all)
    cs[n++] = {"timeout: rank 0 withholds its header from the last rank", -1, 0, R - 1, -1, "1000",
               "4000", 0, "waited 1000 ms"};
  /* the same for rows (our own are not sent: one rank has none to withhold) */
  if ((f == MT_FAULT_TIMEOUT || all) && R > 1)
    cs[n++] = {"timeout: rank 0 withholds its rows from the last rank", -1, 0, -1, R - 1, "1000",
               "4000", 0, "for its rows from rank 0"};
  /* a rank may learn first that a peer aborted (and so failed it) than of
   * its own abort: either reason names the wait */
  if (f == MT_FAULT_ABORT || all)
    cs[n++] = {"abort: rank 0 withholds its header", -1, 0, -2, -1, "0", "0", 300,
               "waited for its header from rank 0"};
  for (int i = 0; i < n; i++) bad += mt_fault_forward(c, w, h, rank, &cs[i], d_x, d_out);
  GC_CUDA(cudaFree(d_x), "x");
  GC_CUDA(cudaFree(d_out), "out");
  free(x);
  return bad;
}

#endif
