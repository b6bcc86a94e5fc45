/* Hostile calls through the one-sided tables (GIN v11-v13, RMA v13/v14),
 * made as NCCL's GIN proxy makes calls (harness/ps_driver_gin.h), from
 * forked ranks. Every bad call must return an error and log a warning saying
 * what was wrong (each rank's stderr is read back after the call); then the
 * comm must still move a valid put+signal around a ring of ranks. -s:
 *   stale_req     test() of a done request after its slot serves a new one,
 *                 which must still complete through its own handle
 *   double_dereg  deregMrSym twice, after the buffer was registered anew; of a
 *                 window a put+signal in flight names (refused until it is done)
 *   stale_window  iput/iputSignal/iget/iflush naming a deregistered window
 *                 (source, destination, signal; a signal alone naming data
 *                 windows too) after it was registered anew
 *   double_close  closeListen, destroyContext, closeColl, finalize twice, also
 *                 once a new comm may hold their memory; calls on a closed
 *                 comm; wrong kinds; another comm's request and window
 *   signal_dereg  (3 ranks) rank 0 signals into a window rank 1 deregistered:
 *                 rank 0's comm fails within PERSEUS_PEER_TIMEOUT_MS naming
 *                 the window; rank 1's stays healthy and serves rank 2
 *   signal_misaligned  (3 ranks) the same, the window registered misaligned
 *   put_dereg     (3 ranks) rank 1 alone deregisters its part of a window:
 *                 rank 0's calls into that part are refused once its notice
 *                 arrived, naming rank 1; its put to rank 2's part still goes
 *   (signal_dereg accepts the same refusal at the call, when the notice
 *   came first)
 *   bounds        offsets and sizes against both sides' windows, signal
 *                 offsets, ranks, indices, NULL out-pointers, wrong kinds,
 *                 devices, a FORCE_SO window at a misaligned address
 * The meson tests turn glibc's per-thread cache off: freed memory goes to the
 * next allocation of its size, so a check that trusted it meets the new owner.
 * Usage: perseus_hostile_rma -s SCENARIO [-a ABI] [-p PLUGIN] [-k: go on
 * after a refusal that went wrong]; exit 0 pass, 1 fail, 2 usage. */
#include <dlfcn.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hostile_rma.h"
#include "ps_driver_int.h"

static const char *const abis[] = {"gin11", "gin12", "gin13", "rma13", "rma14"};
static const char *const syms[] = {"ncclGinPlugin_v11", "ncclGinPlugin_v12", "ncclGinPlugin_v13",
                                   "ncclRmaPlugin_v13", "ncclRmaPlugin_v14"};

/* --- each rank's stderr, read back after every bad call --- */

static int real_stderr = -1;
static FILE *cap;
static long cap_off;
static char cap_buf[65536];

static int capture_open(void) {
  fflush(stderr);
  cap = tmpfile();
  real_stderr = dup(STDERR_FILENO);
  return cap && real_stderr >= 0 && dup2(fileno(cap), STDERR_FILENO) >= 0 ? 0 : -1;
}

/* What was logged since the last read; echoed to the real stderr. */
const char *capture_read(void) {
  fflush(stderr);
  ssize_t n = cap ? pread(fileno(cap), cap_buf, sizeof cap_buf - 1, cap_off) : 0;
  cap_buf[n > 0 ? n : 0] = 0;
  cap_off += n > 0 ? n : 0;
  if (n > 0 && real_stderr >= 0) (void)!write(real_stderr, cap_buf, (size_t)n);
  return cap_buf;
}

int has_warn(const char *log, const char *sub) {
  for (const char *l = log; l && *l;) {
    const char *e = strchr(l, '\n'), *end = e ? e : l + strlen(l), *w = strstr(l, "WARN"),
               *s = strstr(l, sub);
    if (w && s && w < end && s < end) return 1;
    l = e ? e + 1 : NULL;
  }
  return 0;
}

static int keep_going, nfailed; /* -k: report every refusal that went wrong, not the first */

int refused(drv_rank_t *r, ncclResult_t rc, const char *sub, const char *what) {
  int warned = has_warn(capture_read(), sub);
  if (rc != ncclSuccess && warned) return 0;
  if (rc == ncclSuccess)
    fprintf(stderr, "rank %d: %s: accepted (rc 0), expected an error\n", r->rank, what);
  else
    fprintf(stderr, "rank %d: %s: rc %d, but no warning containing \"%s\"\n", r->rank, what, rc,
            sub);
  nfailed++;
  return !keep_going;
}

/* --- windows, and one valid put+signal round --- */

static int win_open(drv_rank_t *r, drv_gin_t *g, void *reg, void *ops, win_t *w) {
  size_t P = (size_t)r->nranks;
  *w = (win_t){.g = g, .reg = reg, .ops = ops};
  w->src = calloc(P, SZ), w->dst = calloc(P, SZ), w->sig = calloc(P, 8);
  CHECK(w->src && w->dst && w->sig, "out of memory");
  CHECK(g->reg_sym(reg, w->src, P * SZ, HOST, 0, &w->src_mh) == ncclSuccess, "reg src");
  CHECK(g->reg_sym(reg, w->dst, P * SZ, HOST, 0, &w->dst_mh) == ncclSuccess, "reg dst");
  CHECK(g->reg_sym(reg, w->sig, P * 8, HOST, NCCL_NET_MR_FLAG_FORCE_SO, &w->sig_mh) == ncclSuccess,
        "reg sig");
  CHECK(!drv_gin_barrier(r, g, ops, 60), "barrier after registration");
  return 0;
}

/* No barrier with progress: a comm that failed on purpose cannot progress. */
static int win_close(drv_rank_t *r, win_t *w) {
  CHECK(!drv_barrier(r, 60), "barrier before deregistration");
  CHECK(w->g->dereg_sym(w->reg, w->src_mh) == ncclSuccess &&
            (!w->dst_mh || w->g->dereg_sym(w->reg, w->dst_mh) == ncclSuccess) &&
            (!w->sig_mh || w->g->dereg_sym(w->reg, w->sig_mh) == ncclSuccess),
        "deregMrSym");
  free(w->src), free(w->dst), free(w->sig);
  return 0;
}

/* Ranks lo.. in a ring: each puts SZ bytes to the next one's slot and adds 1
 * to its signal word there. Ranks below lo only keep the barrier. */
#define RING_PEERS(lo)                            \
  int m_ = r->nranks - (lo), i_ = r->rank - (lo); \
  int next = (lo) + (i_ + 1) % m_, prev = (lo) + (i_ + m_ - 1) % m_

static int ring_issue(drv_rank_t *r, win_t *w, int lo, void **req) {
  int me = r->rank;
  RING_PEERS(lo);
  (void)prev;
  uint64_t n = ++w->rounds;
  *req = NULL;
  drv_fill(w->src + (size_t)next * SZ, SZ, n << 16 | (uint64_t)me);
  ncclResult_t rc =
      w->g->iput_signal(w->ops, (size_t)next * SZ, w->src_mh, SZ, (size_t)me * SZ, w->dst_mh,
                        (uint32_t)next, (uint64_t)me * 8, w->sig_mh, 1, ADD, req);
  CHECK(rc == ncclSuccess && *req, "valid put+signal %llu to rank %d refused (rc %d)",
        (unsigned long long)n, next, rc);
  return 0;
}

static int ring_check(drv_rank_t *r, win_t *w, int lo) {
  RING_PEERS(lo);
  (void)next;
  uint64_t n = w->rounds;
  for (double end = drv_now() + 30; __atomic_load_n(&w->sig[prev], __ATOMIC_ACQUIRE) < n;) {
    CHECK(drv_now() < end && !drv_peer_failed(r), "no signal %llu from rank %d",
          (unsigned long long)n, prev);
    CHECK(w->g->progress(w->ops) == ncclSuccess, "progress failed waiting for rank %d", prev);
  }
  CHECK(w->sig[prev] == n, "signal word of rank %d is %llu after %llu rounds", prev,
        (unsigned long long)w->sig[prev], (unsigned long long)n);
  long bad = drv_verify(w->dst + (size_t)prev * SZ, SZ, n << 16 | (uint64_t)prev);
  CHECK(bad < 0, "round %llu: data from rank %d wrong at byte %ld", (unsigned long long)n, prev,
        bad);
  /* nobody writes a slot again before its reader checked it */
  CHECK(!drv_gin_barrier(r, w->g, w->ops, 60), "barrier after round %llu", (unsigned long long)n);
  return 0;
}

int ring(drv_rank_t *r, win_t *w, int lo) {
  if (r->rank < lo) {
    CHECK(!drv_barrier(r, 60), "barrier (outside the ring)");
    return 0;
  }
  void *req;
  ncclResult_t rc = ncclSuccess;
  if (ring_issue(r, w, lo, &req)) return 1;
  CHECK(!drv_gin_wait(w->g, w->ops, req, 30, &rc), "valid put+signal did not complete (rc %d)", rc);
  return ring_check(r, w, lo);
}

/* --- the raw table, for what the driver does not call --- */

const void *tbl;

ncclResult_t raw_ctx(int ver, void *cc, int n, void **ctx) {
  ps_nccl_dev_handle_t *dh = NULL;
  ps_gin_config_v13_t c13 = {.nContexts = n, .trafficClass = -1};
  ps_rma_config_v14_t c14 = {.nContexts = n, .trafficClass = -1, .rankStride = 1};
  switch (ver) {
  case 11:
    return T11->createContext(cc, 0, 0, ctx, &dh);
  case 12:
    return T12->createContext(cc, 0, 0, n, ctx, &dh);
  case 13:
    return T13->createContext(cc, &c13, ctx, &dh);
  default:
    return T14->createContext(cc, &c14, ctx);
  }
}

static ncclResult_t raw_finalize(int ver, void *ctx) {
  return ver == 11   ? T11->finalize(ctx)
         : ver == 12 ? T12->finalize(ctx)
         : ver == 13 ? T13->finalize(ctx)
                     : T14->finalize(ctx);
}

ncclResult_t raw_connect(int ver, void **hp, int P, int me, void *lc, void **cc) {
  return ver == 12 ? T12->connect(NULL, hp, P, me, DRV_GIN_NCONN, 0, lc, cc)
                   : T11->connect(NULL, hp, P, me, lc, cc);
}

/* Handle area k of the shared scratch (after drv_gin_connect's). */
static unsigned char (*raw_handles(drv_rank_t *r, int k))[NCCL_NET_HANDLE_MAXSIZE] {
  return (void *)((char *)r->user + drv_gin_shared_bytes(r->nranks) +
                  (size_t)k * (size_t)r->nranks * NCCL_NET_HANDLE_MAXSIZE);
}

int raw_open(drv_rank_t *r, const args_t *a, int k, raw_t *x, void **hp) {
  unsigned char(*h)[NCCL_NET_HANDLE_MAXSIZE] = raw_handles(r, k);
  *x = (raw_t){0};
  CHECK(T11->listen(NULL, r->dev, h[r->rank], &x->lc) == ncclSuccess && x->lc, "raw listen");
  CHECK(!drv_barrier(r, 60), "barrier after listen");
  for (int p = 0; p < r->nranks; p++) hp[p] = h[p];
  /* a refused connect leaves the listenComm to the corrected one */
  unsigned char corrupt[NCCL_NET_HANDLE_MAXSIZE];
  memcpy(corrupt, h[r->rank], sizeof corrupt);
  corrupt[0] ^= 0xff; /* its magic */
  hp[r->rank] = corrupt;
  REFUSED(raw_connect(a->ver, hp, r->nranks, r->rank, x->lc, &x->cc), "not a perseus handle",
          "one-sided connect with a corrupt handle");
  hp[r->rank] = h[r->rank];
  ncclResult_t rc = raw_connect(a->ver, hp, r->nranks, r->rank, x->lc, &x->cc);
  CHECK(rc == ncclSuccess && x->cc, "raw connect: rc %d", rc);
  rc = raw_ctx(a->ver, x->cc, DRV_GIN_NCONN, &x->ctx);
  CHECK(rc == ncclSuccess && x->ctx, "raw createContext: rc %d", rc);
  return 0;
}

/* --- scenarios --- */

static int stale_req(drv_rank_t *r, win_t *w) {
  drv_gin_t *g = w->g;
  void *old, *req;
  int done = 0;
  ncclResult_t rc = ncclSuccess;
  if (ring_issue(r, w, 0, &old)) return 1;
  CHECK(!drv_gin_wait(g, w->ops, old, 30, &rc), "put+signal did not complete (rc %d)", rc);
  if (ring_check(r, w, 0)) return 1;
  if (ring_issue(r, w, 0, &req)) return 1; /* takes the slot of the first */
  REFUSED(g->test(w->ops, old, &done), "stale one-sided request",
          "test() of a done request whose slot serves a new one");
  CHECK(!done, "a refused test() set done");
  CHECK(!drv_gin_wait(g, w->ops, req, 30, &rc), "the new owner's request did not complete (rc %d)",
        rc);
  if (ring_check(r, w, 0)) return 1;
  REFUSED(g->test(w->ops, old, &done), "stale one-sided request", "test() of the first, again");
  REFUSED(g->test(w->ops, req, &done), "stale one-sided request",
          "test() of the new one once done");
  REFUSED(g->test(w->ops, w->src_mh, &done), "is not a perseus one-sided request",
          "test() of a window handle");
  REFUSED(g->test(w->ops, NULL, &done), "NULL is not", "test(NULL)");
  return ring(r, w, 0);
}

/* A buffer registered, deregistered and registered again: *old is stale,
 * *fresh may sit where it was. */
static int reg_again(drv_rank_t *r, win_t *w, unsigned char *buf, void **old, void **fresh) {
  size_t bytes = (size_t)r->nranks * SZ;
  CHECK(w->g->reg_sym(w->reg, buf, bytes, HOST, 0, old) == ncclSuccess, "regMrSym");
  CHECK(w->g->dereg_sym(w->reg, *old) == ncclSuccess, "deregMrSym");
  CHECK(w->g->reg_sym(w->reg, buf, bytes, HOST, 0, fresh) == ncclSuccess, "regMrSym again");
  return 0;
}

/* A round with `mh` (over buf) as the destination window. */
static int ring_into(drv_rank_t *r, win_t *w, void *mh, unsigned char *buf) {
  void *keep_mh = w->dst_mh;
  unsigned char *keep = w->dst;
  w->dst_mh = mh, w->dst = buf;
  int rc = ring(r, w, 0);
  w->dst_mh = keep_mh, w->dst = keep;
  return rc;
}

static int double_dereg(drv_rank_t *r, win_t *w) {
  drv_gin_t *g = w->g;
  unsigned char *buf = calloc((size_t)r->nranks, SZ);
  void *old, *fresh, *req;
  ncclResult_t rc = ncclSuccess;
  CHECK(buf, "out of memory");
  /* windows an operation in flight names stay until it completed */
  if (ring_issue(r, w, 0, &req)) return 1;
  REFUSED(g->dereg_sym(w->reg, w->src_mh), "not yet completed",
          "deregMrSym of the source window of a put+signal in flight");
  REFUSED(g->dereg_sym(w->reg, w->sig_mh), "not yet completed",
          "deregMrSym of the signal window of a put+signal in flight");
  CHECK(!drv_gin_wait(g, w->ops, req, 30, &rc), "put+signal did not complete (rc %d)", rc);
  if (ring_check(r, w, 0)) return 1;
  if (reg_again(r, w, buf, &old, &fresh)) return 1;
  REFUSED(g->dereg_sym(w->reg, old), "stale one-sided window", "a second deregMrSym");
  if (ring_into(r, w, fresh, buf)) return 1;
  CHECK(g->dereg_sym(w->reg, fresh) == ncclSuccess, "deregMrSym");
  REFUSED(g->dereg_sym(w->reg, fresh), "stale one-sided window", "deregMrSym of the new one twice");
  REFUSED(g->dereg_sym(w->reg, NULL), "NULL is not", "deregMrSym(NULL)");
  REFUSED(g->dereg_sym(w->reg, w->ops), "is not a perseus one-sided window",
          "deregMrSym of a comm");
  free(buf);
  return ring(r, w, 0);
}

static int stale_window(drv_rank_t *r, win_t *w) {
  drv_gin_t *g = w->g;
  uint32_t next = (uint32_t)((r->rank + 1) % r->nranks);
  unsigned char *buf = calloc((size_t)r->nranks, SZ);
  void *old, *fresh, *req = NULL;
  const char *st = "stale one-sided window";
  CHECK(buf, "out of memory");
  if (reg_again(r, w, buf, &old, &fresh)) return 1;
  REFUSED(g->iput(w->ops, 0, w->src_mh, 8, 0, old, next, &req), st,
          "iput into a deregistered window");
  REFUSED(g->iput(w->ops, 0, old, 8, 0, w->dst_mh, next, &req), st,
          "iput from a deregistered window");
  REFUSED(g->iput_signal(w->ops, 0, w->src_mh, 8, 0, w->dst_mh, next, 0, old, 1, INC, &req), st,
          "put+signal into a deregistered signal window");
  REFUSED(g->iput_signal(w->ops, 0, w->src_mh, 8, 0, old, next, 0, w->sig_mh, 1, INC, &req), st,
          "put+signal into a deregistered destination window");
  REFUSED(g->iput_signal(w->ops, 0, NULL, 0, 0, NULL, next, 0, old, 1, INC, &req), st,
          "signal-only into a deregistered signal window");
  REFUSED(g->iput_signal(w->ops, 0, old, 0, 0, NULL, next, 0, w->sig_mh, 1, INC, &req), st,
          "signal-only naming a deregistered source window");
  REFUSED(g->iput_signal(w->ops, 0, NULL, 0, 0, old, next, 0, w->sig_mh, 1, INC, &req), st,
          "signal-only naming a deregistered destination window");
  REFUSED(g->iput_signal(w->ops, 0, w->ops, 0, 0, NULL, next, 0, w->sig_mh, 1, INC, &req),
          "is not a perseus one-sided window", "signal-only naming a comm as its source window");
  if (g->iget) {
    REFUSED(g->iget(w->ops, 0, old, 8, 0, w->dst_mh, next, &req), st,
            "iget from a deregistered window");
    REFUSED(g->iget(w->ops, 0, w->src_mh, 8, 0, old, next, &req), st,
            "iget into a deregistered window");
    REFUSED(g->iflush(w->ops, old, next, &req), st, "iflush of a deregistered window");
  }
  bool err = true;
  CHECK(g->last_error(w->ops, &err) == ncclSuccess && !err, "a refused call failed the comm");
  if (ring_into(r, w, fresh, buf)) return 1;
  CHECK(g->dereg_sym(w->reg, fresh) == ncclSuccess, "deregMrSym");
  free(buf);
  return ring(r, w, 0);
}

static int double_close(drv_rank_t *r, const args_t *a, win_t *w) {
  drv_gin_t *g = w->g;
  raw_t x, y;
  void *hp[16], *cc = NULL, *ic = NULL, *req = NULL;
  int done = 0;
  bool err;
  ncclResult_t rc;
  if (raw_open(r, a, 0, &x, hp)) return 1;
  CHECK(T11->closeListen(x.lc) == ncclSuccess, "closeListen");
  REFUSED(T11->closeListen(x.lc), "stale one-sided listenComm", "a second closeListen");
  REFUSED(raw_connect(a->ver, hp, r->nranks, r->rank, x.lc, &cc), "stale one-sided listenComm",
          "connect with a closed listenComm");
  CHECK(T11->destroyContext(x.ctx) == ncclSuccess, "destroyContext");
  REFUSED(T11->destroyContext(x.ctx), "stale one-sided context", "a second destroyContext");
  CHECK(T11->closeColl(x.cc) == ncclSuccess, "closeColl");
  REFUSED(T11->closeColl(x.cc), "stale one-sided collComm", "a second closeColl");
  REFUSED(g->progress(x.cc), "stale one-sided collComm", "progress of a closed collComm");
  REFUSED(g->last_error(x.cc, &err), "stale one-sided collComm",
          "queryLastError of a closed collComm");
  perseus_rma_peer_stats_t st;
  capture_read();
  CHECK(g->peer_stats(x.cc, 0, &st, sizeof st) == -1 && has_warn(capture_read(), "stale"),
        "perseus_rma_peer_stats of a closed collComm: not refused with a warning");
  /* a new comm, which may hold the memory of the closed one */
  if (raw_open(r, a, 1, &y, hp)) return 1;
  CHECK(T11->closeListen(y.lc) == ncclSuccess, "closeListen");
  REFUSED(T11->closeListen(x.lc), "stale one-sided listenComm", "closeListen of the first, again");
  REFUSED(T11->destroyContext(x.ctx), "stale one-sided context",
          "destroyContext of the first, again");
  REFUSED(T11->closeColl(x.cc), "stale one-sided collComm", "closeColl of the first, again");
  REFUSED(T11->closeColl(y.ctx), "is a context", "closeColl of a context");
  REFUSED(T11->destroyContext(y.cc), "is a collComm", "destroyContext of a collComm");
  CHECK(T11->init(&ic, 0x5eed, drv_logger) == ncclSuccess && ic, "init");
  CHECK(raw_finalize(a->ver, ic) == ncclSuccess, "finalize");
  REFUSED(raw_finalize(a->ver, ic), "stale one-sided init context", "a second finalize");
  /* the new comm works; its request and window are not the first comm's */
  win_t w2;
  void *ops = a->ver >= 13 ? y.ctx : y.cc;
  uint32_t me = (uint32_t)r->rank, next = (me + 1) % (uint32_t)r->nranks;
  if (win_open(r, g, y.cc, ops, &w2) || ring(r, &w2, 0)) return 1;
  CHECK(g->iput(ops, 0, w2.src_mh, 8, 0, w2.dst_mh, me, &req) == ncclSuccess && req, "put to self");
  REFUSED(g->test(w->ops, req, &done), "another comm", "test() of another comm's request");
  CHECK(!drv_gin_wait(g, ops, req, 30, &rc), "put to self did not complete (rc %d)", rc);
  REFUSED(g->iput(w->ops, 0, w2.src_mh, 8, 0, w->dst_mh, next, &req), "another one-sided comm",
          "iput from another comm's window");
  if (win_close(r, &w2)) return 1;
  CHECK(T11->destroyContext(y.ctx) == ncclSuccess && T11->closeColl(y.cc) == ncclSuccess, "close");
  return ring(r, w, 0);
}

/* Rank 0 signals rank 1 into a window rank 1 deregistered (or registered
 * misaligned): rank 0's comm must fail in time, naming the window; ranks 1
 * and 2 go on. */
static int signal_refused(drv_rank_t *r, win_t *w, int misaligned) {
  drv_gin_t *g = w->g;
  size_t P = (size_t)r->nranks;
  int me = r->rank;
  int *flag = (int *)(void *)raw_handles(r, RAW_OPENS); /* rank 0 saw its error */
  uint64_t *sig2 = calloc(P, 8), *raw = calloc(P + 1, 8), *bad = w->sig;
  void *sig2_mh, *bad_mh = w->sig_mh;
  CHECK(sig2 && raw, "out of memory");
  CHECK(g->reg_sym(w->reg, sig2, P * 8, HOST, NCCL_NET_MR_FLAG_FORCE_SO, &sig2_mh) == ncclSuccess,
        "reg second signal window");
  if (misaligned) {
    bad = (uint64_t *)(void *)((char *)raw + 4);
    CHECK(g->reg_sym(w->reg, bad, P * 8, HOST, 0, &bad_mh) == ncclSuccess, "reg misaligned window");
  }
  CHECK(!drv_gin_barrier(r, g, w->ops, 60), "barrier after registration");
  if (!misaligned && me == 1) {
    CHECK(g->dereg_sym(w->reg, w->sig_mh) == ncclSuccess, "deregMrSym");
    w->sig_mh = NULL;
  }
  CHECK(!drv_gin_barrier(r, g, w->ops, 60), "barrier after rank 1 deregistered");
  const char *tmo = getenv("PERSEUS_PEER_TIMEOUT_MS");
  double limit = (tmo ? atof(tmo) : 5000) / 1000;
  if (me == 0) {
    char want[48];
    void *req = NULL;
    int done = 0;
    ncclResult_t rc = ncclSuccess;
    snprintf(want, sizeof want, "here at %p", (void *)bad), capture_read();
    double t0 = drv_now();
    rc = g->iput_signal(w->ops, 0, NULL, 0, 0, NULL, 1, 0, bad_mh, 1, INC, &req);
    if (!misaligned && rc != ncclSuccess) { /* rank 1's window-closed notice came first */
      CHECK(rc == ncclInvalidUsage && has_warn(capture_read(), "which rank 1 deregistered"),
            "the signal was refused at the call (rc %d) without naming rank 1's notice", rc);
      bool err = true;
      CHECK(g->last_error(w->ops, &err) == ncclSuccess && !err,
            "a call refused at once failed the comm");
      printf("rank 0: the signal into rank 1's deregistered window was refused at the call\n");
      __atomic_store_n(flag, 2, __ATOMIC_RELEASE);
      goto rest;
    }
    CHECK(rc == ncclSuccess && req, "the signal into a misaligned word was refused at the call, "
          "where nothing can know (rc %d)", rc);
    while (rc == ncclSuccess && drv_now() - t0 < limit + 1) {
      rc = req ? g->test(w->ops, req, &done) : g->progress(w->ops);
      if (done) req = NULL, done = 0;
    }
    double took = drv_now() - t0;
    CHECK(rc != ncclSuccess,
          "no error %.1f s after a signal into rank 1's %s window: the origin "
          "reports success",
          took, misaligned ? "misaligned" : "deregistered");
    CHECK(took <= limit, "the error came after %.2f s, over PERSEUS_PEER_TIMEOUT_MS", took);
    const char *log = capture_read();
    CHECK(has_warn(log, "refused our signal") && has_warn(log, want),
          "no warning that rank 1 refused our signal into the window %s", want);
    bool err = false;
    CHECK(g->last_error(w->ops, &err) == ncclSuccess && err, "queryLastError reports no error");
    printf("rank 0: the signal into rank 1's %s window failed the comm after %.3f s (rc %d)\n",
           misaligned ? "misaligned" : "deregistered", took, rc);
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  } else {
    for (double end = drv_now() + 30; !__atomic_load_n(flag, __ATOMIC_ACQUIRE);) {
      CHECK(drv_now() < end && !drv_peer_failed(r), "rank 0 never saw its error");
      CHECK(g->progress(w->ops) == ncclSuccess, "progress failed: this comm must stay healthy");
    }
    if (me == 1 && __atomic_load_n(flag, __ATOMIC_ACQUIRE) == 1)
      CHECK(has_warn(capture_read(), misaligned ? "not 8-byte aligned here" : "deregistered here"),
            "rank 1 logged no refusal of rank 0's signal");
    bool err = true;
    CHECK(g->last_error(w->ops, &err) == ncclSuccess && !err, "queryLastError reports an error");
  }
rest:;
  /* ranks 1 and 2 still move put+signal (on a live signal window) */
  void *keep_mh = w->sig_mh;
  uint64_t *keep = w->sig;
  w->sig_mh = sig2_mh, w->sig = sig2;
  if (ring(r, w, 1)) return 1;
  w->sig_mh = keep_mh, w->sig = keep;
  CHECK(!drv_barrier(r, 60) && g->dereg_sym(w->reg, sig2_mh) == ncclSuccess &&
            (!misaligned || g->dereg_sym(w->reg, bad_mh) == ncclSuccess),
        "deregMrSym");
  free(sig2), free(raw);
  return 0;
}

/* Rank 1 alone deregisters its part of the destination window. Its
 * window-closed notice reaches rank 0, whose calls into that part are then
 * refused at the call, naming rank 1 (before the notice, providers such as
 * tcp drop such a put without an error on either side); rank 0's put into
 * rank 2's part of the same window still goes, and no comm fails. */
static int put_dereg(drv_rank_t *r, win_t *w) {
  drv_gin_t *g = w->g;
  int me = r->rank;
  const char *why = "which rank 1 deregistered";
  CHECK(!drv_gin_barrier(r, g, w->ops, 60), "barrier before rank 1 deregisters");
  if (me == 1) {
    CHECK(g->dereg_sym(w->reg, w->dst_mh) == ncclSuccess, "deregMrSym");
    w->dst_mh = NULL;
  }
  CHECK(!drv_gin_barrier(r, g, w->ops, 60), "barrier after rank 1 deregistered");
  if (me == 0) {
    void *req = NULL;
    int done = 0;
    for (double end = drv_now() + 0.5; drv_now() < end;) /* the notice is on its way */
      CHECK(g->progress(w->ops) == ncclSuccess, "progress failed");
    REFUSED(g->iput(w->ops, 0, w->src_mh, 8, 0, w->dst_mh, 1, &req), why,
            "iput into rank 1's deregistered part of a window");
    REFUSED(g->iput_signal(w->ops, 0, w->src_mh, 8, 0, w->dst_mh, 1, 0, w->sig_mh, 1, INC, &req),
            why, "put+signal into rank 1's deregistered part of a window");
    if (g->iget)
      REFUSED(g->iget(w->ops, 0, w->dst_mh, 8, 0, w->src_mh, 1, &req), why, /* remote first */
              "iget from rank 1's deregistered part of a window");
    CHECK(g->iput(w->ops, 0, w->src_mh, 8, 0, w->dst_mh, 2, &req) == ncclSuccess && req,
          "iput into rank 2's part of the same window was refused");
    for (double end = drv_now() + 30; !done;) {
      CHECK(drv_now() < end, "the put to rank 2 never completed");
      CHECK(g->test(w->ops, req, &done) == ncclSuccess, "the put to rank 2 failed");
    }
  }
  for (double end = drv_now() + 1; drv_now() < end;) /* rank 0's put lands meanwhile */
    CHECK(g->progress(w->ops) == ncclSuccess, "progress failed: this comm must stay healthy");
  bool err = true;
  CHECK(g->last_error(w->ops, &err) == ncclSuccess && !err, "queryLastError reports an error");
  return 0;
}

static int rank_body(drv_rank_t *r, const args_t *a) {
  const char *s = a->scenario;
  drv_gin_t g;
  void *cc = NULL, *lib;
  win_t w;
  int rc = drv_gin_load(a->plugin, a->abi, &g);
  lib = rc ? NULL : drv_open_plugin(a->plugin, NULL);
  tbl = lib ? dlsym(lib, syms[a->idx]) : NULL;
  CHECK(tbl, "loading %s", a->abi);
  ncclResult_t crc = drv_gin_connect(r, &g, &cc);
  CHECK(crc == ncclSuccess, "connect: rc %d", crc);
  if (win_open(r, &g, cc, cc, &w)) return 1;
  rc = !strcmp(s, "stale_req")           ? stale_req(r, &w)
       : !strcmp(s, "double_dereg")      ? double_dereg(r, &w)
       : !strcmp(s, "stale_window")      ? stale_window(r, &w)
       : !strcmp(s, "double_close")      ? double_close(r, a, &w)
       : !strcmp(s, "signal_dereg")      ? signal_refused(r, &w, 0)
       : !strcmp(s, "signal_misaligned") ? signal_refused(r, &w, 1)
       : !strcmp(s, "put_dereg")         ? put_dereg(r, &w)
                                         : bounds(r, a, &w);
  if (!rc) rc = win_close(r, &w);
  ncclResult_t xrc = drv_gin_close(&g, cc); /* closed even after a failure (shm names) */
  if (!rc && xrc != ncclSuccess) fprintf(stderr, "rank %d: close: rc %d\n", r->rank, xrc), rc = 1;
  return rc;
}

static int rank_fn(drv_rank_t *r, void *arg) {
  CHECK(!capture_open(), "cannot capture stderr");
  int rc = rank_body(r, arg);
  capture_read(); /* the rest of what was logged, failures included */
  return rc || nfailed;
}

int main(int argc, char **argv) {
  static const char *const scen[] = {"stale_req",    "double_dereg", "stale_window",
                                     "double_close", "signal_dereg", "signal_misaligned",
                                     "put_dereg",    "bounds"};
  args_t a = {.abi = "gin11"};
  drv_opts_t o = {.timeout_s = 120, .no_load = 1, .no_mesh = 1};
  int c, known = 0;
  while ((c = getopt(argc, argv, "a:p:s:kh")) != -1) {
    int nr = 0;
    if (drv_gin_opt(c, optarg, &a.abi, &a.plugin, &a.scenario, &nr)) continue;
    if ((keep_going |= c == 'k')) continue;
    fprintf(stderr,
            "usage: %s -s stale_req|double_dereg|stale_window|double_close|signal_dereg|"
            "signal_misaligned|put_dereg|bounds [-a gin11|gin12|gin13|rma13|rma14] [-p PLUGIN] [-k]\n",
            argv[0]);
    return c == 'h' ? 0 : 2;
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  for (size_t i = 0; i < sizeof scen / sizeof *scen; i++) known |= a.scenario && !strcmp(a.scenario, scen[i]);
  for (int i = 0; i < 5; i++)
    if (!strcmp(a.abi, abis[i])) a.ver = i < 3 ? 11 + i : 10 + i, a.idx = i;
  if (!known || !a.ver) {
    fprintf(stderr, "-s names no scenario, or -a no ABI (-h for the lists)\n");
    return 2;
  }
  /* double_dereg deregisters a window while a put+signal that names it is
   * in flight: only without an engine thread does nothing complete before
   * the call (with one, the put may be done already, and the call right) */
  if (!strcmp(a.scenario, "double_dereg")) setenv("PERSEUS_PROGRESS_THREAD", "0", 1);
  o.nranks = strncmp(a.scenario, "signal_", 7) && strcmp(a.scenario, "put_dereg") ? 2 : 3;
  o.shared_bytes = drv_gin_shared_bytes(o.nranks) + 64 + /* the flag of signal_refused */
                   RAW_OPENS * (size_t)o.nranks * NCCL_NET_HANDLE_MAXSIZE;
  setvbuf(stdout, NULL, _IOLBF, 0);
  double t0 = drv_now();
  int rc = drv_run(&o, rank_fn, &a);
  printf("hostile_rma %s over %s, %d ranks: %s (%.2f s)\n", a.scenario, a.abi, o.nranks,
         rc ? "FAIL" : "ok", drv_now() - t0);
  return rc ? 1 : 0;
}
