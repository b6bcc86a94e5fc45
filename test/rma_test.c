/* The one-sided tables of the plugin, driven as NCCL's GIN proxy drives
 * them (harness/ps_driver_gin.h), from forked ranks:
 *
 *   perseus_rma_test [-a ABI] [-p PLUGIN] [-s SCENARIO] [-r RANKS] [-b BATCHES] [-R] [-u]
 *
 * ABI: gin11 (default), gin12, gin13, rma13, rma14. PERSEUS_ORDERING picks
 * the strategy. Scenarios:
 *   invariant  (default) every rank puts a random number of random-size tiles
 *              to every peer, then one put+signal (ADD of the batch's tile
 *              count, sometimes with a tile of its own, sometimes signal-only).
 *              Receivers poll their signal words while progressing; the moment
 *              a value is observed, every tile of every batch it covers must
 *              already be in memory, byte for byte. -R: the plugin must refuse
 *              the strategy at connect (ncclInvalidUsage) instead. -u: every
 *              batch to a peer reuses one source slot, refilled as soon as
 *              test() reported the batch before it done (as a kernel reuses a
 *              buffer once its counter says so): a request reported before
 *              its bytes left the source delivers the next batch's bytes.
 *   props      the table loads and inits, reports devices and netDeviceType
 *              GIN_PROXY (2), and the perseus extensions resolve.
 *   api        a put to oneself (NCCL 2.30 flushes that way), a second
 *              connection/context index, iget and iflush where the table has
 *              them, the stats export, and bad arguments refused.
 *   cycles     register a window and a signal word, put+signal to the next
 *              rank, verify, deregister; 50 x BATCHES times: registration
 *              leaks nothing (resident memory checked) and ids stay in step.
 *   close      rank 0 puts BATCHES tiles and a signal to rank 1, and the
 *              moment test() reported them all it deregisters and closes
 *              (a staged put is reported before its write completes): rank
 *              1 must still receive every byte and the signal.
 *   gone       the same puts, but rank 1 takes none of them (no progress)
 *              and exits without closing once rank 0 had some reported:
 *              rank 0's close, with staged puts waiting for rank 1's slots,
 *              must find it gone in seconds (PERSEUS_PEER_TIMEOUT_MS is 60 s
 *              here) and return.
 *   regfail    both ranks register a GPU window, then rank 0 registers a
 *              host window where the others register a GPU one: every rank's
 *              call must fail (ncclInvalidUsage), and so must a later one
 *              (the comm failed). The failed window must be gone: the test
 *              checks the close's report of windows still registered
 *              (NCCL_DEBUG=INFO), which must name the first window alone.
 *              Needs a plugin with CUDA (the fake-CUDA one).
 * -G [dsg]: register the destination window (d), the source (s) and the
 * signal words (g) as NCCL_PTR_CUDA; with the fake-CUDA test plugin that
 * exercises staging on hosts without a GPU. m: every odd tile goes to a
 * second destination window registered as GPU memory, the rest to the host
 * one, so a batch mixes direct writes with staged ones (and a signal that
 * rides in a staged write must still wait for the direct writes it covers).
 * -D y|n: the GPU windows register through regMrSymDmaBuf, each exported as
 * a (fake) dma-buf as NCCL exports its buffers; y: ptrSupport must name
 * DMABUF (the provider takes them), n: it must not (the call still works,
 * by address). */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_driver_gin.h"
#include "ps_fake_dmabuf.h"
#include "ps_gin_abi.h"
#include "size_parse.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
#ifdef UNDER_ASAN
/* ASan holds freed memory in quarantine, which grows resident memory with
 * every free: the cycles scenario's leak bound would measure ASan. Without
 * quarantine it measures us again (an ASAN_OPTIONS in the environment still
 * overrides this). */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "quarantine_size_mb=0"; }
#endif

#define SLOT 65536           /* bytes per (source, batch) in the data window */
#define MAX_TILES 8
#define TILE_MAX (SLOT / MAX_TILES)
#define MAX_BATCHES 64
#define MAX_OUT 256          /* outstanding requests per peer at most (NCCL's queue allows 32 x maxRecvs) */

typedef struct {
  const char *abi, *plugin, *scenario;
  const char *gpu; /* -G: which windows are registered as GPU memory */
  int dmabuf;      /* -D: 'y' or 'n' (GPU windows by dma-buf; DMABUF expected or not), else 0 */
  int batches;
  int expect_refusal; /* -R */
  int reuse;          /* -u */
  int tests_only;     /* -T: no progress call while requests are outstanding, test() only */
  int nenv;           /* -e RANK:NAME=VALUE: that rank's own setting (ranks that disagree) */
  int env_rank[8];
  const char *env[8];
} args_t;

/* Batch layout, computable on both sides: tile count and sizes. */
static uint64_t mix(uint64_t x) {
  x ^= x >> 33, x *= 0xff51afd7ed558ccdULL, x ^= x >> 33;
  return x;
}
static int ntiles(int src, int dst, int b) { return 1 + (int)(mix((uint64_t)src << 40 | (uint64_t)dst << 20 | (uint64_t)b) % MAX_TILES); }
static size_t tile_size(int src, int dst, int b, int t) {
  return 1 + mix(((uint64_t)src << 48) ^ ((uint64_t)dst << 32) ^ ((uint64_t)b << 8) ^ (uint64_t)t) % TILE_MAX;
}
static uint64_t tile_id(int src, int dst, int b, int t) { return ((uint64_t)src << 48) | ((uint64_t)dst << 32) | ((uint64_t)b << 8) | (uint64_t)t; }

/* Registration type of a window: GPU when -G names its letter. */
static int ptr_type(const args_t *a, char which) {
  return a->gpu && strchr(a->gpu, which) ? NCCL_PTR_CUDA : NCCL_PTR_HOST;
}

/* A window as NCCL registers it: GPU ones by dma-buf under -D (the fd
 * covers the page-widened range, as the CUDA driver's does, and is closed
 * once registered, as NCCL closes its). */
static ncclResult_t reg_win(drv_gin_t *g, void *cc, const args_t *a, void *data, size_t size,
                            int type, uint64_t flags, void **mh) {
  if (!a->dmabuf || type != NCCL_PTR_CUDA) return g->reg_sym(cc, data, size, type, flags, mh);
  uint64_t off;
  int fd = ps_fake_dmabuf_export(data, size, &off);
  if (fd < 0) {
    perror("memfd_create");
    return ncclSystemError;
  }
  ncclResult_t rc = g->reg_sym_dmabuf(cc, data, size, type, off, fd, flags, mh);
  close(fd);
  return rc;
}

static int invariant(drv_rank_t *r, drv_gin_t *g, void *cc, const args_t *a) {
  int P = r->nranks, me = r->rank, B = a->batches;
  const char *want = getenv("PERSEUS_ORDERING"), *got = g->ordering ? g->ordering(cc) : NULL;
  CHECK(got != NULL, "perseus_rma_ordering gave no strategy");
  CHECK(!want || !strcmp(want, "auto") || !strcmp(want, got), "ordering is %s, PERSEUS_ORDERING=%s", got, want);
  size_t data_bytes = (size_t)P * B * SLOT, src_bytes = (size_t)P * B * SLOT;
  unsigned char *data = calloc(1, data_bytes), *src = malloc(src_bytes);
  int mixed = a->gpu && strchr(a->gpu, 'm');
  unsigned char *data2 = mixed ? calloc(1, data_bytes) : data; /* odd tiles, GPU */
  uint64_t *sig = calloc((size_t)P, 8);
  void *data_mh, *data2_mh = NULL, *src_mh, *sig_mh;
  CHECK(data && data2 && src && sig, "oom");
  if (a->dmabuf == 'y' && ptr_type(a, 'd') == NCCL_PTR_CUDA) { /* refused by name, comm unharmed */
    int pfd[2];
    CHECK(!pipe(pfd), "pipe");
    CHECK(g->reg_sym_dmabuf(cc, data, data_bytes, NCCL_PTR_CUDA, 0, -1, 0, &data_mh) == ncclInvalidArgument,
          "regMrSymDmaBuf with fd -1 was not refused");
    CHECK(g->reg_sym_dmabuf(cc, data, data_bytes, NCCL_PTR_CUDA, 0, pfd[0], 0, &data_mh) == ncclInvalidArgument,
          "regMrSymDmaBuf with a pipe for a dma-buf was not refused");
    close(pfd[0]), close(pfd[1]);
  }
  CHECK(reg_win(g, cc, a, data, data_bytes, ptr_type(a, 'd'), 0, &data_mh) == ncclSuccess, "reg data");
  if (mixed)
    CHECK(reg_win(g, cc, a, data2, data_bytes, NCCL_PTR_CUDA, 0, &data2_mh) == ncclSuccess, "reg data (GPU)");
  CHECK(reg_win(g, cc, a, src, src_bytes, ptr_type(a, 's'), 0, &src_mh) == ncclSuccess, "reg src");
  CHECK(reg_win(g, cc, a, sig, (size_t)P * 8, ptr_type(a, 'g'), NCCL_NET_MR_FLAG_FORCE_SO, &sig_mh) == ncclSuccess, "reg sig");
  /* what each source has been seen to cover so far */
  int verified[16] = {0};
  uint64_t cum[16][MAX_BATCHES + 1];
  for (int s = 0; s < P; s++) {
    cum[s][0] = 0;
    for (int b = 0; b < B; b++) cum[s][b + 1] = cum[s][b] + (uint64_t)ntiles(s, me, b);
  }
  /* requests in flight, and per peer how many (NCCL's queue bounds them) */
  void **reqs = calloc((size_t)P * MAX_OUT, sizeof *reqs);
  int *req_peer = calloc((size_t)P * MAX_OUT, sizeof *req_peer), out[16] = {0}, nreq = 0;
  CHECK(reqs && req_peer, "oom");
#define ISSUE(call, what)                                                       \
  do {                                                                          \
    void *req_ = NULL;                                                          \
    CHECK((call) == ncclSuccess && req_ != NULL, what " to %d: no request", q); \
    reqs[nreq] = req_, req_peer[nreq++] = q, out[q]++;                          \
  } while (0)
  int b = 0, q = 0, done_sending = 0;
  double end = drv_now() + 120;
  for (;;) {
    CHECK(!drv_peer_failed(r), "stopping: another rank failed");
    CHECK(drv_now() < end, "stalled: batch %d, verified from rank 0..: %d %d", b, verified[0], verified[1 % P]);
    /* send: one (batch, peer) step per loop turn, interleaved with checking */
    if (!done_sending) {
      if (q == me) q++;
      if (q >= P) q = 0, b++;
      if (b >= B) done_sending = 1;
      else if (q != me && (a->reuse ? !out[q] : out[q] + MAX_TILES + 1 <= MAX_OUT)) { /* else: next turn */
        int n = ntiles(me, q, b), own = (b % 3 == 0) ? 0 : 1; /* last tile rides with the signal */
        for (int t = 0; t < n; t++) {
          size_t off = ((size_t)(q * B + (a->reuse ? 0 : b))) * SLOT + (size_t)t * TILE_MAX;
          size_t dst = ((size_t)(me * B + b)) * SLOT + (size_t)t * TILE_MAX;
          size_t sz = tile_size(me, q, b, t);
          void *dmh = mixed && t % 2 ? data2_mh : data_mh;
          drv_fill(src + off, sz, tile_id(me, q, b, t));
          if (t == n - 1 && own)
            ISSUE(g->iput_signal(cc, off, src_mh, sz, dst, dmh, (uint32_t)q, (uint64_t)me * 8, sig_mh, (uint64_t)n, NCCL_NET_SIGNAL_OP_ADD, &req_), "iputSignal");
          else
            ISSUE(g->iput(cc, off, src_mh, sz, dst, dmh, (uint32_t)q, &req_), "iput");
        }
        if (!own) /* signal-only, after the batch's puts */
          ISSUE(g->iput_signal(cc, 0, NULL, 0, 0, NULL, (uint32_t)q, (uint64_t)me * 8, sig_mh, (uint64_t)n, NCCL_NET_SIGNAL_OP_ADD, &req_), "signal");
        q++;
      }
    }
    /* -T: while requests are outstanding, a caller that only tests must
     * still see them finish (with none, progress serves the peers' writes) */
    if (!a->tests_only || !nreq) CHECK(g->progress(cc) == ncclSuccess, "progress");
    for (int i = 0; i < nreq;) {
      int done = 0;
      CHECK(g->test(cc, reqs[i], &done) == ncclSuccess, "test");
      if (done) out[req_peer[i]]--, reqs[i] = reqs[--nreq], req_peer[i] = req_peer[nreq];
      else i++;
    }
    /* receive: what a signal value promises must be there now */
    int all = 1;
    for (int s = 0; s < P; s++) {
      if (s == me) continue;
      uint64_t v = __atomic_load_n(&sig[s], __ATOMIC_ACQUIRE);
      CHECK(v <= cum[s][B], "signal from %d is %llu, more than the %llu ever sent", s, (unsigned long long)v, (unsigned long long)cum[s][B]);
      while (verified[s] < B && cum[s][verified[s] + 1] <= v) {
        int vb = verified[s];
        for (int t = 0; t < ntiles(s, me, vb); t++) {
          size_t dst = ((size_t)(s * B + vb)) * SLOT + (size_t)t * TILE_MAX;
          long bad = drv_verify((t % 2 ? data2 : data) + dst, tile_size(s, me, vb, t), tile_id(s, me, vb, t));
          CHECK(bad < 0, "signal %llu from rank %d covers batch %d, but tile %d is wrong at byte %ld: %s", (unsigned long long)v, s, vb, t, bad,
                a->reuse ? "the signal overtook its data, or a put was reported done before its bytes left the source"
                         : "the signal overtook its data");
        }
        verified[s]++;
      }
      all &= verified[s] == B;
    }
    if (all && done_sending && nreq == 0) break;
  }
  bool err = true;
  CHECK(g->last_error(cc, &err) == ncclSuccess && !err, "queryLastError reports an error");
  /* the stats export: every tile is one put, every batch one signal */
  int to = (me + 1) % P;
  uint64_t tiles = 0;
  for (int bb = 0; bb < B; bb++) tiles += (uint64_t)ntiles(me, to, bb);
  perseus_rma_peer_stats_t st;
  /* a staged put is reported done once copied out of the source: its write
   * and signal may still wait to be posted, which progress does */
  double until = drv_now() + 30;
  do {
    CHECK(g->peer_stats && g->peer_stats(cc, (uint32_t)to, &st, sizeof st) == 0, "perseus_rma_peer_stats");
    CHECK(g->progress(cc) == ncclSuccess, "progress");
  } while ((st.puts < tiles || st.signals < (uint64_t)B) && drv_now() < until);
  if (me == 0)
    printf("%s, rank 0 -> %d: %llu puts, %llu signals, %llu fences posted, %llu avoided, blocked %.3f ms, max in flight %llu\n",
           got, to, (unsigned long long)st.puts, (unsigned long long)st.signals, (unsigned long long)st.fences_posted,
           (unsigned long long)st.fences_avoided, st.blocked_ns / 1e6, (unsigned long long)st.inflight_max);
  CHECK(st.puts == tiles && st.signals == (uint64_t)B, "stats to %d: %llu puts, %llu signals; sent %llu tiles in %d batches",
        to, (unsigned long long)st.puts, (unsigned long long)st.signals, (unsigned long long)tiles, B);
  /* PERSEUS_RMA_INFLIGHT bounds the operations posted and not completed per peer */
  const char *bound = getenv("PERSEUS_RMA_INFLIGHT");
  if (bound && atoi(bound) > 0)
    CHECK(st.inflight_max <= (uint64_t)atoi(bound), "%llu operations in flight to rank %d, PERSEUS_RMA_INFLIGHT=%s",
          (unsigned long long)st.inflight_max, to, bound);
  CHECK(!drv_gin_barrier(r, g, cc, 60), "final barrier"); /* nobody closes while peers still read */
  CHECK(g->dereg_sym(cc, data_mh) == ncclSuccess && g->dereg_sym(cc, src_mh) == ncclSuccess &&
        g->dereg_sym(cc, sig_mh) == ncclSuccess, "deregMrSym");
  if (mixed) CHECK(g->dereg_sym(cc, data2_mh) == ncclSuccess, "deregMrSym (GPU data)");
  if (mixed) free(data2);
  free(data), free(src), free(sig), free(reqs), free(req_peer);
  return 0;
}

/* One operation to completion; the request must exist. */
#define RUN(call, what)                                                                         \
  do {                                                                                          \
    void *req_ = NULL;                                                                          \
    ncclResult_t rc_;                                                                           \
    CHECK((call) == ncclSuccess && req_ != NULL, "%s: no request", what);                       \
    CHECK(!drv_gin_wait(g, cc, req_, 30, &rc_), "%s did not complete (result %d)", what, rc_); \
  } while (0)
#define REFUSED(call, what) \
  CHECK((call) == ncclInvalidArgument, "%s was not refused with ncclInvalidArgument", what)

static int api(drv_rank_t *r, drv_gin_t *g, void *cc) {
  enum { SZ = 4096 };
  int P = r->nranks, me = r->rank, next = (me + 1) % P, prev = (me + P - 1) % P;
  unsigned char *src = malloc((size_t)P * SZ), *dst = calloc((size_t)P, SZ), *got = calloc((size_t)P, SZ);
  uint64_t *sig = calloc((size_t)P, 8);
  void *src_mh, *dst_mh, *got_mh, *sig_mh, *req = NULL;
  CHECK(src && dst && got && sig, "oom");
  CHECK(g->reg_sym(cc, src, (size_t)P * SZ, NCCL_PTR_HOST, 0, &src_mh) == ncclSuccess, "reg src");
  CHECK(g->reg_sym(cc, dst, (size_t)P * SZ, NCCL_PTR_HOST, 0, &dst_mh) == ncclSuccess, "reg dst");
  CHECK(g->reg_sym(cc, got, (size_t)P * SZ, NCCL_PTR_HOST, 0, &got_mh) == ncclSuccess, "reg got");
  CHECK(g->reg_sym(cc, sig, (size_t)P * 8, NCCL_PTR_HOST, NCCL_NET_MR_FLAG_FORCE_SO, &sig_mh) == ncclSuccess, "reg sig");
  for (int p = 0; p < P; p++) drv_fill(src + (size_t)p * SZ, SZ, tile_id(me, p, 0, 0));
  CHECK(!drv_gin_barrier(r, g, cc, 60), "barrier after registration");

  /* a put to oneself */
  RUN(g->iput(cc, (size_t)me * SZ, src_mh, SZ, (size_t)me * SZ, dst_mh, (uint32_t)me, &req_), "put to self");
  CHECK(drv_verify(dst + (size_t)me * SZ, SZ, tile_id(me, me, 0, 0)) < 0, "put to self: wrong data");

  /* bad input, refused by name; nothing reaches a peer */
  unsigned char junk[64] = {0};
  REFUSED(g->iput_signal(cc, 0, src_mh, 8, 0, dst_mh, (uint32_t)next, 0, sig_mh, 1, 7, &req), "signal op 7");
  REFUSED(g->iput_signal(cc, 0, src_mh, 8, 0, dst_mh, (uint32_t)next, 0, NULL, 1, NCCL_NET_SIGNAL_OP_INC, &req), "NULL signal handle");
  REFUSED(g->iput(cc, 0, src_mh, 8, 0, dst_mh, (uint32_t)next, NULL), "NULL request pointer");
  REFUSED(g->iput(cc, 0, src_mh, 8, 0, dst_mh, (uint32_t)P, &req), "rank out of range");
  REFUSED(g->iput(cc, (size_t)P * SZ, src_mh, 8, 0, dst_mh, (uint32_t)next, &req), "source beyond its region");
  REFUSED(g->iput(cc, 0, src_mh, 8, 0, junk, (uint32_t)next, &req), "foreign memory handle");
  REFUSED(g->iput(junk, 0, src_mh, 8, 0, dst_mh, (uint32_t)next, &req), "foreign comm");
  REFUSED(g->test(cc, junk, &(int){0}), "test of a foreign request");
  REFUSED(g->dereg_sym(cc, junk), "deregistering a foreign handle");
  if (strcmp(g->abi, "gin11")) { /* v11 has no connection/context index */
    drv_gin_set_index(DRV_GIN_NCONN);
    REFUSED(g->iput(cc, 0, src_mh, 8, 0, dst_mh, (uint32_t)next, &req), "index past the connections/contexts");
    drv_gin_set_index(-1);
    REFUSED(g->iput(cc, 0, src_mh, 8, 0, dst_mh, (uint32_t)next, &req), "negative index");
  }
  perseus_rma_peer_stats_t st;
  CHECK(g->peer_stats && g->ordering, "perseus extensions not exported");
  CHECK(g->peer_stats(junk, 0, &st, sizeof st) == -1 && g->peer_stats(cc, (uint32_t)P, &st, sizeof st) == -1 &&
        g->peer_stats(cc, 0, &st, 0) == -1 && g->peer_stats(cc, 0, &st, 4) == -1 && g->ordering(junk) == NULL,
        "perseus extensions took bad input");

  /* put + signal to the next rank on the last connection/context */
  drv_gin_set_index(DRV_GIN_NCONN - 1);
  RUN(g->iput_signal(cc, (size_t)next * SZ, src_mh, SZ, (size_t)me * SZ, dst_mh, (uint32_t)next, (uint64_t)me * 8, sig_mh, 0, NCCL_NET_SIGNAL_OP_INC, &req_), "put+signal");
  double end = drv_now() + 30;
  while (__atomic_load_n(&sig[prev], __ATOMIC_ACQUIRE) != 1) {
    CHECK(drv_now() < end && !drv_peer_failed(r), "no signal from rank %d", prev);
    CHECK(g->progress(cc) == ncclSuccess, "progress");
  }
  CHECK(drv_verify(dst + (size_t)prev * SZ, SZ, tile_id(prev, me, 0, 0)) < 0, "put from %d: wrong data", prev);
  CHECK(g->peer_stats(cc, (uint32_t)next, &st, sizeof st) == 0 && st.puts == 1 && st.signals == 1,
        "stats to %d: %llu puts, %llu signals", next, (unsigned long long)st.puts, (unsigned long long)st.signals);
  uint64_t first = 0;
  CHECK(g->peer_stats(cc, (uint32_t)next, (perseus_rma_peer_stats_t *)&first, 8) == 0 && first == st.puts,
        "stats with an older, shorter struct");

  /* v13/v14: read the next rank's slot for us, then flush */
  if (g->iget) {
    RUN(g->iget(cc, (size_t)me * SZ, src_mh, SZ, (size_t)next * SZ, got_mh, (uint32_t)next, &req_), "iget");
    CHECK(drv_verify(got + (size_t)next * SZ, SZ, tile_id(next, me, 0, 0)) < 0, "iget from %d: wrong data", next);
    req = NULL;
    CHECK(g->iflush(cc, dst_mh, (uint32_t)next, &req) == ncclSuccess, "iflush");
    ncclResult_t rc;
    CHECK(!req || !drv_gin_wait(g, cc, req, 30, &rc), "iflush did not complete");
  }
  drv_gin_set_index(0);
  bool err = true;
  CHECK(g->last_error(cc, &err) == ncclSuccess && !err, "queryLastError reports an error");
  CHECK(!drv_gin_barrier(r, g, cc, 60), "final barrier"); /* peers' igets may need our progress */
  CHECK(g->dereg_sym(cc, src_mh) == ncclSuccess && g->dereg_sym(cc, dst_mh) == ncclSuccess &&
        g->dereg_sym(cc, got_mh) == ncclSuccess && g->dereg_sym(cc, sig_mh) == ncclSuccess, "deregMrSym");
  free(src), free(dst), free(got), free(sig);
  return 0;
}

static long rss_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "VmRSS:", 6)) kib = atol(line + 6);
  if (f) fclose(f);
  return kib;
}

static int cycles(drv_rank_t *r, drv_gin_t *g, void *cc, const args_t *a) {
  enum { MAXSZ = 65536 };
  int P = r->nranks, me = r->rank, next = (me + 1) % P, prev = (me + P - 1) % P, N = 50 * a->batches;
  unsigned char *src = malloc(MAXSZ), *win = malloc((size_t)P * MAXSZ);
  uint64_t *sig = calloc((size_t)P, 8);
  void *src_mh, *win_mh, *sig_mh;
  CHECK(src && win && sig, "oom");
  CHECK(g->reg_sym(cc, src, MAXSZ, ptr_type(a, 's'), 0, &src_mh) == ncclSuccess, "reg src");
  long rss0 = 0;
  for (int i = 0; i < N; i++) {
    if (i == N / 10) rss0 = rss_kib(); /* after warm-up: pools and pages are in place */
    size_t sz = 1 + mix((uint64_t)i) % MAXSZ; /* the same on every rank */
    memset(sig, 0, (size_t)P * 8);
    CHECK(g->reg_sym(cc, win, (size_t)P * sz, ptr_type(a, 'd'), 0, &win_mh) == ncclSuccess, "cycle %d: reg window", i);
    CHECK(g->reg_sym(cc, sig, (size_t)P * 8, ptr_type(a, 'g'), NCCL_NET_MR_FLAG_FORCE_SO, &sig_mh) == ncclSuccess, "cycle %d: reg signals", i);
    drv_fill(src, sz, tile_id(me, next, i, 0));
    RUN(g->iput_signal(cc, 0, src_mh, sz, (size_t)me * sz, win_mh, (uint32_t)next, (uint64_t)me * 8, sig_mh, 0, NCCL_NET_SIGNAL_OP_INC, &req_), "put+signal");
    double end = drv_now() + 30;
    while (__atomic_load_n(&sig[prev], __ATOMIC_ACQUIRE) != 1) {
      CHECK(drv_now() < end && !drv_peer_failed(r), "cycle %d: no signal from rank %d", i, prev);
      CHECK(g->progress(cc) == ncclSuccess, "progress");
    }
    CHECK(drv_verify(win + (size_t)prev * sz, sz, tile_id(prev, me, i, 0)) < 0, "cycle %d: wrong data from %d", i, prev);
    CHECK(!drv_gin_barrier(r, g, cc, 60), "cycle %d: barrier", i); /* nobody deregisters while peers write */
    CHECK(g->dereg_sym(cc, win_mh) == ncclSuccess && g->dereg_sym(cc, sig_mh) == ncclSuccess, "cycle %d: dereg", i);
  }
  long grew = rss_kib() - rss0;
  if (me == 0) printf("%d register/put/deregister cycles: resident memory grew %ld KiB after warm-up\n", N, grew);
  CHECK(grew < 4096, "resident memory grew %ld KiB over %d cycles: registrations leak", grew, N);
  CHECK(g->dereg_sym(cc, src_mh) == ncclSuccess, "dereg src");
  free(src), free(win), free(sig);
  return 0;
}

static int closing(drv_rank_t *r, drv_gin_t *g, void **ccp, const args_t *a) {
  enum { TILE = 16384 };
  void *cc = *ccp;
  int me = r->rank, n = a->batches, gone = !strcmp(a->scenario, "gone");
  size_t bytes = (size_t)n * TILE;
  unsigned char *src = malloc(bytes), *dst = calloc(1, bytes);
  uint64_t *sig = calloc(1, 8);
  void *src_mh, *dst_mh, *sig_mh, *reqs[MAX_BATCHES + 1];
  CHECK(src && dst && sig, "oom");
  CHECK(g->reg_sym(cc, src, bytes, ptr_type(a, 's'), 0, &src_mh) == ncclSuccess, "reg src");
  CHECK(g->reg_sym(cc, dst, bytes, ptr_type(a, 'd'), 0, &dst_mh) == ncclSuccess, "reg dst");
  CHECK(g->reg_sym(cc, sig, 8, ptr_type(a, 'g'), NCCL_NET_MR_FLAG_FORCE_SO, &sig_mh) == ncclSuccess, "reg sig");
  CHECK(!drv_gin_barrier(r, g, cc, 60), "barrier after registration");
  if (gone && me == 1) { /* takes nothing; leaves once rank 0 had reports, without closing */
    CHECK(!drv_barrier(r, 60), "barrier before leaving");
    fflush(NULL);
    _exit(0);
  }
  if (me == 0) {
    for (int t = 0; t < n; t++) {
      size_t off = (size_t)t * TILE;
      drv_fill(src + off, TILE, tile_id(0, 1, 0, t));
      CHECK(g->iput(cc, off, src_mh, TILE, off, dst_mh, 1, &reqs[t]) == ncclSuccess && reqs[t], "iput %d", t);
    }
    CHECK(g->iput_signal(cc, 0, NULL, 0, 0, NULL, 1, 0, sig_mh, (uint64_t)n, NCCL_NET_SIGNAL_OP_ADD, &reqs[n]) ==
              ncclSuccess && reqs[n], "signal");
    double end = drv_now() + 60;
    /* gone: until the reports stop (rank 1's receive slots are full), so
     * that reported puts wait for slots it will never free */
    double still = drv_now();
    for (int left = n + 1, was = left; left && !(gone && left < n + 1 && drv_now() - still > 0.3);) {
      CHECK(drv_now() < end, "%d of %d requests not reported in 60 s", left, n + 1);
      CHECK(g->progress(cc) == ncclSuccess, "progress");
      if (left != was) was = left, still = drv_now();
      left = 0;
      for (int i = 0; i <= n; i++) {
        int done = 0;
        if (!reqs[i]) continue;
        CHECK(g->test(cc, reqs[i], &done) == ncclSuccess, "test");
        if (done) reqs[i] = NULL;
        else left++;
      }
    }
  } else if (me == 1) {
    double end = drv_now() + 60;
    while (__atomic_load_n(sig, __ATOMIC_ACQUIRE) < (uint64_t)n) {
      CHECK(drv_now() < end && !drv_peer_failed(r), "signal %llu of %d after 60 s: rank 0's reported "
            "puts were lost when it closed", (unsigned long long)__atomic_load_n(sig, __ATOMIC_ACQUIRE), n);
      CHECK(g->progress(cc) == ncclSuccess, "progress");
    }
    for (int t = 0; t < n; t++)
      CHECK(drv_verify(dst + (size_t)t * TILE, TILE, tile_id(0, 1, 0, t)) < 0, "tile %d wrong after the signal", t);
  }
  if (gone) { /* rank 1 leaves now; rank 0 closes once its process is gone */
    CHECK(!drv_barrier(r, 60), "barrier before rank 1 leaves");
    for (double t = drv_now() + 10; kill(drv_pid(r, 1), 0) == 0 || errno != ESRCH;) {
      CHECK(drv_now() < t, "rank 1 did not exit");
      usleep(1000);
    }
  }
  /* as NCCL tears down: deregister, close; rank 0 at once, without waiting for rank 1
   * (gone: as an abort, without deregistering windows operations still name) */
  double t_close = drv_now();
  CHECK(gone || (g->dereg_sym(cc, src_mh) == ncclSuccess && g->dereg_sym(cc, dst_mh) == ncclSuccess &&
                 g->dereg_sym(cc, sig_mh) == ncclSuccess), "dereg");
  CHECK(drv_gin_close(g, cc) == ncclSuccess, "close");
  *ccp = NULL;
  if (gone) {
    double took = drv_now() - t_close;
    fprintf(stderr, "rank 0: closed in %.2f s with rank 1 gone\n", took);
    CHECK(took < 10, "closing took %.1f s with rank 1 gone: its staged puts were waited for", took);
  } else {
    CHECK(!drv_barrier(r, 60), "final barrier"); /* outside the plugin: rank 1 verified */
  }
  free(src), free(dst), free(sig);
  return 0;
}

static int regfail(drv_rank_t *r, drv_gin_t *g, void *cc) {
  enum { SZ = 4096 };
  static unsigned char gpu_win[SZ], second[SZ], later[SZ];
  void *gpu_mh = NULL, *mh = NULL;
  CHECK(g->reg_sym(cc, gpu_win, SZ, NCCL_PTR_CUDA, 0, &gpu_mh) == ncclSuccess, "reg GPU window");
  int type = r->rank == 0 ? NCCL_PTR_HOST : NCCL_PTR_CUDA;
  ncclResult_t rc = g->reg_sym(cc, second, SZ, type, 0, &mh);
  CHECK(rc == ncclInvalidUsage && !mh, "a %s window where another rank registered %s memory: "
        "regMrSym returned %d, expected ncclInvalidUsage (5)", type == NCCL_PTR_HOST ? "host" : "GPU",
        type == NCCL_PTR_HOST ? "GPU" : "host", rc);
  rc = g->reg_sym(cc, later, SZ, NCCL_PTR_HOST, 0, &mh);
  CHECK(rc != ncclSuccess && !mh, "regMrSym after a failed exchange returned %d, expected the "
        "comm's failure", rc);
  /* the GPU window stays registered: the close names it, and nothing else */
  return 0;
}

static int rank_fn(drv_rank_t *r, void *arg) {
  const args_t *a = arg;
  drv_gin_t g;
  void *cc = NULL;
  for (int i = 0; i < a->nenv; i++) /* before the plugin reads its settings */
    if (a->env_rank[i] == r->rank) CHECK(!putenv((char *)a->env[i]), "putenv %s", a->env[i]);
  CHECK(!drv_gin_load(a->plugin, a->abi, &g), "loading %s", a->abi);
  ncclResult_t crc = drv_gin_connect(r, &g, &cc);
  if (a->expect_refusal && a->gpu) { /* the strategy works, but not for staged GPU windows */
    CHECK(crc == ncclSuccess, "connect returned %d", crc);
    static char win[4096];
    void *mh = NULL;
    ncclResult_t rrc = g.reg_sym(cc, win, sizeof win, NCCL_PTR_CUDA, 0, &mh);
    CHECK(rrc == ncclInvalidUsage, "registering a GPU window returned %d, expected the refusal ncclInvalidUsage (5)", rrc);
    CHECK(drv_gin_close(&g, cc) == ncclSuccess, "close");
    return 0;
  }
  if (a->expect_refusal) {
    CHECK(crc == ncclInvalidUsage, "connect returned %d, expected the refusal ncclInvalidUsage (5)", crc);
    CHECK(drv_gin_close(&g, NULL) == ncclSuccess, "finalize");
    return 0;
  }
  CHECK(crc == ncclSuccess, "connect returned %d", crc);
  CHECK(!a->dmabuf || !(g.ptr_support & NCCL_PTR_DMABUF) == (a->dmabuf == 'n'),
        "ptrSupport %d %s DMABUF (-D %c)", g.ptr_support,
        g.ptr_support & NCCL_PTR_DMABUF ? "names" : "lacks", a->dmabuf);
  int rc = !strcmp(a->scenario, "api")      ? api(r, &g, cc)
           : !strcmp(a->scenario, "cycles") ? cycles(r, &g, cc, a)
           : !strcmp(a->scenario, "regfail") ? regfail(r, &g, cc)
           : !strcmp(a->scenario, "close") || !strcmp(a->scenario, "gone") ? closing(r, &g, &cc, a)
                                            : invariant(r, &g, cc, a);
  /* closed even after a failure: shm leaves a dead endpoint's name behind,
   * and a later process given the same pid cannot open one (NULL: the
   * scenario closed it, and this only finalizes) */
  ncclResult_t xrc = drv_gin_close(&g, cc);
  if (rc) return rc;
  CHECK(xrc == ncclSuccess, "close");
  return 0;
}

/* In the parent process: no ranks needed. */
static int props(const args_t *a) {
  drv_gin_t g;
  if (drv_gin_load(a->plugin, a->abi, &g)) return 1;
  /* GPU windows are taken wherever CUDA runs (staged or direct): -G says
   * this plugin has it (the fake-CUDA one), so ptrSupport must name CUDA */
  int ptrs_ok = (g.ptr_support & NCCL_PTR_HOST) &&
                !(g.ptr_support & ~(NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF)) &&
                (!a->gpu || (g.ptr_support & NCCL_PTR_CUDA)) &&
                (!a->dmabuf || !(g.ptr_support & NCCL_PTR_DMABUF) == (a->dmabuf == 'n'));
  /* NCCL sizes its proxy queue per peer as NCCL_NET_MAX_REQUESTS x maxRecvs:
   * PERSEUS_PROXY_QUEUE, else its documented default, 1024 */
  const char *queue_env = getenv("PERSEUS_PROXY_QUEUE");
  long queue = queue_env ? strtol(queue_env, NULL, 10) : 1024;
  int ok = g.net_device_type == NCCL_NET_DEVICE_GIN_PROXY && g.name && !strcmp(g.name, "Perseus") &&
           g.peer_stats && g.ordering && (g.iget != NULL) == (strcmp(a->abi, "gin11") && strcmp(a->abi, "gin12")) &&
           ptrs_ok && (long)NCCL_NET_MAX_REQUESTS * g.max_recvs == queue;
  printf("%s: name %s, netDeviceType %d, ptrSupport %d, maxRecvs %d (expected %ld), extensions %s\n",
         a->abi, g.name ? g.name : "?", g.net_device_type, g.ptr_support, g.max_recvs,
         queue / NCCL_NET_MAX_REQUESTS, g.peer_stats && g.ordering ? "resolved" : "missing");
  if (drv_gin_close(&g, NULL) != ncclSuccess) ok = 0;
  return ok ? 0 : 1;
}

int main(int argc, char **argv) {
  args_t a = {.abi = "gin11", .scenario = "invariant", .batches = 24};
  drv_opts_t o = {.nranks = 2, .timeout_s = 180, .no_load = 1, .no_mesh = 1};
  const char *env_opt[8]; /* each -e as given, for its messages */
  int c;
  /* Every peer in these scenarios is alive: a timeout here could only call a
   * rank starved by a loaded machine (an ASan pass on 2 cores) dead. Liveness
   * has its own tests (rma_fault_test, hostile_rma); a value set outside wins. */
  setenv("PERSEUS_PEER_TIMEOUT_MS", "60000", 0);
  while ((c = getopt(argc, argv, "a:p:s:r:b:G:D:e:RuTh")) != -1) {
    /* -r before drv_gin_opt: invariant keeps 16 ranks' counters at most */
    if (c == 'r') o.nranks = drv_parse_int("-r", optarg, 2, 16);
    else if (drv_gin_opt(c, optarg, &a.abi, &a.plugin, &a.scenario, &o.nranks)) continue;
    else if (c == 'e') {
      /* RANK:NAME=VALUE; the rank is checked against -r once all options are read */
      const char *colon = strchr(optarg, ':'), *eq = colon ? strchr(colon, '=') : NULL;
      char rank[16];
      if (!colon || !eq) {
        fprintf(stderr, "-e '%s': expected RANK:NAME=VALUE\n", optarg);
        return 2;
      }
      if (a.nenv == 8) {
        fprintf(stderr, "-e '%s': at most 8 -e settings\n", optarg);
        return 2;
      }
      snprintf(rank, sizeof rank, "%.*s", (int)(colon - optarg), optarg);
      if ((size_t)(colon - optarg) >= sizeof rank || sp_parse_int(rank, 0, 15, &a.env_rank[a.nenv])) {
        fprintf(stderr, "-e '%s': rank '%.*s': expected an integer from 0 to 15\n", optarg,
                (int)(colon - optarg), optarg);
        return 2;
      }
      if (eq == colon + 1) {
        fprintf(stderr, "-e '%s': empty variable name\n", optarg);
        return 2;
      }
      env_opt[a.nenv] = optarg;
      a.env[a.nenv++] = colon + 1;
    } else if (c == 'R') a.expect_refusal = 1;
    else if (c == 'u') a.reuse = 1;
    else if (c == 'T') a.tests_only = 1;
    else if (c == 'b') a.batches = drv_parse_int("-b", optarg, 1, MAX_BATCHES);
    else if (c == 'G' && *optarg && strspn(optarg, "dsgm") == strlen(optarg)) a.gpu = optarg;
    else if (c == 'G') {
      fprintf(stderr, "-G '%s': expected one or more of the letters d, s, g, m\n", optarg);
      return 2;
    } else if (c == 'D' && (!strcmp(optarg, "y") || !strcmp(optarg, "n"))) a.dmabuf = optarg[0];
    else if (c == 'D') {
      fprintf(stderr, "-D '%s': expected y or n\n", optarg);
      return 2;
    } else {
      fprintf(stderr, "usage: %s [-a gin11|gin12|gin13|rma13|rma14] [-p PLUGIN] [-s invariant|props|api|cycles|close|gone|regfail] "
              "[-r RANKS 2..16] [-b BATCHES 1..%d] [-G dsgm: GPU windows] [-D y|n: GPU windows by dma-buf, DMABUF offered or not] [-e RANK:NAME=VALUE: one rank's "
              "setting] [-R: expect the ordering to be refused] [-u: reuse the source once reported] [-T: invariant: no progress "
              "call while requests are outstanding, test() only]\n",
              argv[0], MAX_BATCHES);
      return c == 'h' ? 0 : 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  static const char *const scenarios[] = {"invariant", "props", "api", "cycles", "close", "gone", "regfail"};
  int known = 0;
  for (size_t i = 0; i < sizeof scenarios / sizeof *scenarios; i++) known |= !strcmp(a.scenario, scenarios[i]);
  if (!known) {
    fprintf(stderr, "-s '%s': expected invariant, props, api, cycles, close, gone or regfail\n", a.scenario);
    return 2;
  }
  if (a.tests_only && strcmp(a.scenario, "invariant")) {
    fprintf(stderr, "-T: only the invariant scenario has a test-only mode, not -s %s\n", a.scenario);
    return 2;
  }
  for (int i = 0; i < a.nenv; i++)
    if (a.env_rank[i] >= o.nranks) { /* no rank would apply it */
      fprintf(stderr, "-e '%s': rank %d is not below -r %d\n", env_opt[i], a.env_rank[i], o.nranks);
      return 2;
    }
  if (!strcmp(a.scenario, "props")) return props(&a);
  o.shared_bytes = drv_gin_shared_bytes(o.nranks);
  double t0 = drv_now();
  int rc = drv_run(&o, rank_fn, &a);
  printf("rma %s over %s, %d ranks, %d batches%s, GPU windows %s, provider %s, ordering %s%s: %s (%.2f s)\n",
         a.scenario, a.abi, o.nranks, a.batches, a.reuse ? " (source reused)" : "", a.gpu ? a.gpu : "none", getenv("PERSEUS_PROVIDER") ? getenv("PERSEUS_PROVIDER") : "auto",
         getenv("PERSEUS_ORDERING") ? getenv("PERSEUS_ORDERING") : "auto",
         a.expect_refusal ? " (must be refused)" : "", rc ? "FAIL" : "ok", drv_now() - t0);
  return rc ? 1 : 0;
}
