/* What a one-sided target does with a peer that breaks the engine's
 * promises, and with a staged put into a GPU window it deregistered. Rank 0
 * is real (the plugin through ncclGinPlugin_v11); in the signal scenarios
 * rank 1 is a fake peer (fake_rma_peer.h) that joins rank 0's comm and
 * sends crafted messages. -s:
 *   covers_ordered  a signal that waits for a write count (target's) into an
 *                   `ordered` comm, which never counts writes: the comm fails
 *                   naming both, instead of holding it forever
 *   covers_window   target: a signal covering writes PS_RMA_MAX_WINDOW past
 *                   the oldest one missing is held (it may apply); one more
 *                   fails the comm, naming the value
 *   staged_none     a signal covering staged writes, no GPU window here
 *   staged_credit   (fake-CUDA plugin) a signal covering staged writes inside
 *                   the credit is held; far beyond it fails the comm
 *   nack_put        the fake refuses a staged put of ours (a window it
 *                   deregistered): rank 0's comm fails naming the window
 *   put_dereg_gpu   (3 real ranks, fake-CUDA plugin) rank 0 puts into rank
 *                   1's part of a GPU window that rank 1 deregistered before
 *                   rank 0 heard of it: rank 1 drops the bytes and tells rank
 *                   0, whose comm fails naming the window; rank 1's stays
 *                   healthy and its staging still serves rank 2
 *   sig_rx          (fake-CUDA plugin) a signal into region 0, rank 0's
 *                   staging receive slots, which no NCCL call names: the
 *                   comm fails naming them
 *   copy_after_fail (2 real ranks, fake-CUDA plugin with slow copies) a
 *                   staged copy into a GPU window is queued, then the comm
 *                   fails: deregMrSym of that window returns only once the
 *                   copy is done (nothing writes the memory afterwards)
 *   test_after_fail (2 real ranks, fake-CUDA plugin) a registration
 *                   exchange fails and closes the endpoint: test() of an
 *                   outstanding request returns the error
 * A peer posing as another rank, where the provider names who sent what
 * (FI_SOURCE): the comm fails naming the rank claimed and the sender's.
 *   forged_signal   the fake's signal claims to come from rank 0
 *   forged_part     (3 ranks, ranks 1 and 2 fakes) each fake's part of a
 *                   registration claims to be the other's: every rank's
 *                   part arrives once, so only the senders tell
 *   forged_write    a write of the fake's into rank 0's window whose remote
 *                   CQ data claims to come from rank 0 (on a provider that
 *                   names writers: shm, the model fabric)
 * The comm's reasons are logged as WARNs, which the meson tests match.
 * Usage: perseus_hostile_rma_peer -s SCENARIO [-p PLUGIN]; exit 0 pass,
 * 1 fail, 2 usage. */
#include <dlfcn.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fake_rma_peer.h"
#include "ps_driver_gin.h"
#include "ps_driver_int.h"
#include "ps_gin_abi.h"
#include "ps_rma_int.h" /* PS_RMA_MAX_WINDOW, the tags */
#include "ps_wire.h"

#define SZ 4096
#define NRANKS_MAX 3

typedef struct {
  const char *plugin, *scenario;
} args_t;

static const ncclGin_v11_t *tbl;

/* After drv_gin_connect's handles: a step counter the ranks share. */
static int *flag_of(drv_rank_t *r) {
  return (int *)(void *)((char *)r->user + drv_gin_shared_bytes(NRANKS_MAX));
}

/* ... then rank 0's FI_OFI_RXM_ENABLE_PASSTHRU once its plugin set it up:
 * rxm's passthru mode speaks another protocol, which the fake must speak
 * too ("" where unset). */
#define PASSTHRU_MAX 16
static char *passthru_of(drv_rank_t *r) { return (char *)(flag_of(r) + 1); }

static ps_sig_msg_t sig_msg(uint64_t covers, uint64_t covers_staged) {
  return (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                        .op = NCCL_NET_SIGNAL_OP_INC, .src_rank = 1, .region_id = 0,
                        .offset = 0, .value = 1, .covers = covers,
                        .covers_staged = covers_staged};
}

/* --- rank 0, real, against the fake --- */

/* Rank 0 listens, the fakes build their handles from rank 0's, then rank 0
 * connects to all. */
static int real_connect(drv_rank_t *r, const args_t *a, drv_gin_t *g, void **cc) {
  unsigned char(*h)[NCCL_NET_HANDLE_MAXSIZE] = r->user;
  void *lc = NULL, *hp[NRANKS_MAX] = {h[0], h[1], h[2]};
  CHECK(!drv_gin_load(a->plugin, "gin11", g), "loading the gin11 table");
  void *lib = drv_open_plugin(a->plugin, NULL);
  tbl = lib ? dlsym(lib, "ncclGinPlugin_v11") : NULL;
  CHECK(tbl, "no ncclGinPlugin_v11");
  CHECK(tbl->listen(NULL, r->dev, h[0], &lc) == ncclSuccess, "listen");
  const char *pt = getenv("FI_OFI_RXM_ENABLE_PASSTHRU");
  snprintf(passthru_of(r), PASSTHRU_MAX, "%s", pt ? pt : "");
  CHECK(!drv_barrier(r, 60) && !drv_barrier(r, 60), "barriers around the fake's handle");
  ncclResult_t rc = tbl->connect(NULL, hp, r->nranks, 0, lc, cc);
  CHECK(tbl->closeListen(lc) == ncclSuccess && rc == ncclSuccess, "connect: rc %d", rc);
  CHECK(!drv_barrier(r, 60), "barrier after connect");
  return 0;
}

static int expect_healthy(drv_rank_t *r, drv_gin_t *g, void *cc, const char *what) {
  for (double end = drv_now() + 0.3; drv_now() < end;)
    CHECK(g->progress(cc) == ncclSuccess, "%s failed the comm", what);
  return 0;
}

static int expect_failure(drv_rank_t *r, drv_gin_t *g, void *cc, const char *what) {
  ncclResult_t rc = ncclSuccess;
  for (double end = drv_now() + 10; rc == ncclSuccess; rc = g->progress(cc))
    CHECK(drv_now() < end, "%s: no error after 10 s (held without a word?)", what);
  bool err = false;
  CHECK(g->last_error(cc, &err) == ncclSuccess && err, "%s: queryLastError reports no error", what);
  printf("rank 0: %s failed the comm (rc %d)\n", what, rc);
  return 0;
}

/* A collective registration, the fake echoing our parts meanwhile. */
static int real_register(drv_rank_t *r, drv_gin_t *g, void *cc, void *buf, int type, void **mh) {
  ncclResult_t rc = g->reg_sym(cc, buf, SZ, type, 0, mh);
  __atomic_store_n(flag_of(r), 1, __ATOMIC_RELEASE);
  CHECK(rc == ncclSuccess, "regMrSym with the fake peer: rc %d", rc);
  return 0;
}

static int real_side(drv_rank_t *r, const args_t *a) {
  const char *s = a->scenario;
  drv_gin_t g;
  void *cc = NULL, *mh = NULL, *buf = calloc(1, SZ);
  CHECK(buf, "out of memory");
  if (real_connect(r, a, &g, &cc)) return 1;
  int rc = 0;
  if (!strcmp(s, "sig_rx")) { /* a GPU window first: region 0 is the staging receive slots */
    rc = real_register(r, &g, cc, buf, NCCL_PTR_CUDA, &mh);
    CHECK(!rc && !drv_barrier(r, 60), "barrier after the fake's message");
    if (expect_failure(r, &g, cc, "a signal into the staging receive slots")) return 1;
    (void)g.dereg_sym(cc, mh);
    CHECK(tbl->closeColl(cc) == ncclSuccess && drv_gin_close(&g, NULL) == ncclSuccess, "close");
    return 0;
  }
  if (!strcmp(s, "forged_part")) {
    ncclResult_t xrc = g.reg_sym(cc, buf, SZ, NCCL_PTR_HOST, 0, &mh);
    __atomic_store_n(flag_of(r), 1, __ATOMIC_RELEASE);
    CHECK(xrc != ncclSuccess, "a registration whose parts came from ranks posing as each other "
          "succeeded");
    bool err = false;
    CHECK(g.last_error(cc, &err) == ncclSuccess && err, "forged parts: queryLastError reports no error");
    printf("rank 0: the registration failed (rc %d)\n", xrc);
    CHECK(!drv_barrier(r, 60), "barrier after the registration");
    CHECK(tbl->closeColl(cc) == ncclSuccess && drv_gin_close(&g, NULL) == ncclSuccess, "close");
    free(buf);
    return 0;
  }
  int host = !strcmp(s, "nack_put") || !strncmp(s, "forged_", 7);
  if (!strcmp(s, "staged_credit") || host)
    rc = real_register(r, &g, cc, buf, host ? NCCL_PTR_HOST : NCCL_PTR_CUDA, &mh);
  CHECK(!rc && !drv_barrier(r, 60), "barrier after the fake's first message");
  if (!strcmp(s, "covers_window") || !strcmp(s, "staged_credit")) {
    /* the first signal could still be covered: held, no error */
    if (expect_healthy(r, &g, cc, "a signal inside the bounds")) return 1;
    CHECK(!drv_barrier(r, 60) && !drv_barrier(r, 60), "barriers around the second message");
  }
  rc = expect_failure(r, &g, cc, s);
  if (mh) (void)g.dereg_sym(cc, mh); /* the comm failed: only the local part matters */
  CHECK(tbl->closeColl(cc) == ncclSuccess && drv_gin_close(&g, NULL) == ncclSuccess, "close");
  free(buf);
  return rc;
}

/* --- rank 1, the fake --- */

static int fake_side(drv_rank_t *r, const args_t *a) {
  unsigned char(*h)[NCCL_NET_HANDLE_MAXSIZE] = r->user;
  const char *s = a->scenario;
  CHECK(!drv_barrier(r, 60), "fake peer: barrier after rank 0 listened");
  if (*passthru_of(r)) setenv("FI_OFI_RXM_ENABLE_PASSTHRU", passthru_of(r), 1);
  fake_peer_t *f = fake_open();
  CHECK(f && !fake_handle(f, (uint32_t)r->rank, h[0], h[r->rank]), "fake peer: open");
  CHECK(!drv_barrier(r, 60) && !drv_barrier(r, 60), "fake peer: barriers around connect");
  if (!strcmp(s, "forged_part")) {
    fake_claim(f, 3 - (uint32_t)r->rank);
    /* rank 0's failed exchange closes its endpoint: an echo may fail */
    (void)fake_serve(f, flag_of(r), 60);
    CHECK(!drv_barrier(r, 60), "fake peer: barrier after the registration");
    fake_close(f);
    return 0;
  }
  ps_sig_msg_t m = sig_msg(0, 0), second = m;
  uint64_t tag = PS_TAG_RMA_SIG;
  if (!strcmp(s, "covers_ordered")) {
    m.covers = 5;
  } else if (!strcmp(s, "covers_window")) {
    m.covers = PS_RMA_MAX_WINDOW; /* arrived.below (1) + the window - 1 */
    second.covers = PS_RMA_MAX_WINDOW + 1;
  } else if (!strcmp(s, "staged_none")) {
    m.covers_staged = 1;
  } else if (!strcmp(s, "sig_rx")) {
    /* region 0, offset 0: rank 0's staging receive slots */
  } else if (!strcmp(s, "staged_credit")) {
    m.covers_staged = 1; /* staged write 1: inside any credit */
    second.covers_staged = 1u << 20;
  } else if (!strcmp(s, "forged_signal")) {
    m.src_rank = 0; /* into rank 0's window 0 as rank 0 */
  } else if (!strcmp(s, "forged_write")) {
    /* remote CQ data as rank 0's plain write 1 (target strategy) */
  } else { /* nack_put: as a target refuses a staged put into a window it deregistered */
    m = (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                       .op = NCCL_NET_SIGNAL_OP_ADD, .src_rank = 1, .region_id = 0,
                       .offset = 64, .value = SZ, .covers = PS_NACK_PUT_DEREGISTERED};
    tag = PS_TAG_RMA_NACK;
  }
  int forged_write = !strcmp(s, "forged_write");
  if (!strcmp(s, "staged_credit") || !strcmp(s, "nack_put") || !strcmp(s, "sig_rx") ||
      !strncmp(s, "forged_", 7))
    CHECK(!fake_serve(f, flag_of(r), 60), "fake peer: rank 0's registration");
  CHECK(!(forged_write ? fake_write(f, 0ULL << 32 | 1) : fake_send(f, tag, &m, sizeof m)) &&
            !drv_barrier(r, 60),
        "fake peer: first message");
  if (!strcmp(s, "covers_window") || !strcmp(s, "staged_credit"))
    CHECK(!drv_barrier(r, 60) && !fake_send(f, tag, &second, sizeof second) && !drv_barrier(r, 60),
          "fake peer: second message");
  fake_close(f);
  return 0;
}

/* --- put_dereg_gpu: three real ranks --- */

typedef struct {
  drv_gin_t g;
  void *cc;
  unsigned char *src, *dst, *dst2;
  uint64_t *sig;
  void *src_mh, *dst_mh, *dst2_mh, *sig_mh;
} gpu_win_t;

static int gpu_open(drv_rank_t *r, const args_t *a, gpu_win_t *w) {
  size_t P = (size_t)r->nranks;
  CHECK(!drv_gin_load(a->plugin, "gin11", &w->g), "loading the gin11 table");
  CHECK(drv_gin_connect(r, &w->g, &w->cc) == ncclSuccess, "connect");
  w->src = calloc(P, SZ), w->dst = calloc(P, SZ), w->dst2 = calloc(P, SZ), w->sig = calloc(P, 8);
  CHECK(w->src && w->dst && w->dst2 && w->sig, "out of memory");
  drv_gin_t *g = &w->g;
  CHECK(g->reg_sym(w->cc, w->src, P * SZ, NCCL_PTR_HOST, 0, &w->src_mh) == ncclSuccess &&
            g->reg_sym(w->cc, w->dst, P * SZ, NCCL_PTR_CUDA, 0, &w->dst_mh) == ncclSuccess &&
            g->reg_sym(w->cc, w->dst2, P * SZ, NCCL_PTR_CUDA, 0, &w->dst2_mh) == ncclSuccess &&
            g->reg_sym(w->cc, w->sig, P * 8, NCCL_PTR_HOST, NCCL_NET_MR_FLAG_FORCE_SO, &w->sig_mh) ==
                ncclSuccess,
        "regMrSym");
  CHECK(!drv_gin_barrier(r, g, w->cc, 60), "barrier after registration");
  return 0;
}

/* Rank 0: a put rank 1 can no longer take, issued before rank 0 made a
 * pass that could read rank 1's window-closed notice. */
static int put_into_closed(drv_rank_t *r, gpu_win_t *w) {
  drv_gin_t *g = &w->g;
  void *req = NULL;
  int done = 0;
  drv_fill(w->src, SZ, 0xdead);
  ncclResult_t rc = g->iput(w->cc, 0, w->src_mh, SZ, 0, w->dst_mh, 1, &req);
  CHECK(rc == ncclSuccess && req, "the put was refused at the call (rc %d): the notice came first", rc);
  for (double end = drv_now() + 10; !done && rc == ncclSuccess; rc = g->test(w->cc, req, &done))
    CHECK(drv_now() < end, "the put into rank 1's deregistered window never completed");
  if (expect_failure(r, g, w->cc, "a staged put into rank 1's deregistered GPU window")) return 1;
  __atomic_store_n(flag_of(r), 1, __ATOMIC_RELEASE);
  return 0;
}

/* Ranks 1 and 2: healthy while rank 0 fails, then a staged put+signal each
 * way into the window still registered, its bytes checked. */
static int stay_healthy(drv_rank_t *r, gpu_win_t *w) {
  drv_gin_t *g = &w->g;
  uint32_t me = (uint32_t)r->rank, peer = 3 - me;
  void *req = NULL;
  ncclResult_t rc = ncclSuccess;
  for (double end = drv_now() + 30; !__atomic_load_n(flag_of(r), __ATOMIC_ACQUIRE);) {
    CHECK(drv_now() < end && !drv_peer_failed(r), "rank 0 never saw its error");
    CHECK(g->progress(w->cc) == ncclSuccess, "progress failed: this comm must stay healthy");
  }
  drv_fill(w->src + peer * SZ, SZ, 0x100 + me);
  rc = g->iput_signal(w->cc, peer * SZ, w->src_mh, SZ, me * SZ, w->dst2_mh, peer, me * 8, w->sig_mh,
                      1, NCCL_NET_SIGNAL_OP_ADD, &req);
  CHECK(rc == ncclSuccess && !drv_gin_wait(g, w->cc, req, 30, &rc), "put+signal to rank %u: rc %d",
        peer, rc);
  for (double end = drv_now() + 30; __atomic_load_n(&w->sig[peer], __ATOMIC_ACQUIRE) < 1;) {
    CHECK(drv_now() < end, "no signal from rank %u", peer);
    CHECK(g->progress(w->cc) == ncclSuccess, "progress failed waiting for rank %u", peer);
  }
  long bad = drv_verify(w->dst2 + peer * SZ, SZ, 0x100 + peer);
  CHECK(bad < 0, "data from rank %u wrong at byte %ld", peer, bad);
  bool err = true;
  CHECK(g->last_error(w->cc, &err) == ncclSuccess && !err, "queryLastError reports an error");
  return 0;
}

static int put_dereg_gpu(drv_rank_t *r, const args_t *a) {
  gpu_win_t w = {0};
  if (gpu_open(r, a, &w)) return 1;
  /* no pass of rank 0's from here to its put: rank 1's notice stays unread */
  CHECK(!drv_barrier(r, 60), "barrier before rank 1 deregisters");
  if (r->rank == 1) {
    CHECK(w.g.dereg_sym(w.cc, w.dst_mh) == ncclSuccess, "deregMrSym");
    w.dst_mh = NULL;
  }
  CHECK(!drv_barrier(r, 60), "barrier after rank 1 deregistered");
  int rc = r->rank == 0 ? put_into_closed(r, &w) : stay_healthy(r, &w);
  CHECK(!drv_barrier(r, 60), "barrier before deregistration");
  void *mhs[] = {w.src_mh, w.dst_mh, w.dst2_mh, w.sig_mh};
  for (int i = 0; i < 4; i++) /* rank 0's comm failed: its refusals do not matter */
    CHECK(!mhs[i] || w.g.dereg_sym(w.cc, mhs[i]) == ncclSuccess || r->rank == 0, "deregMrSym");
  ncclResult_t xrc = drv_gin_close(&w.g, w.cc);
  CHECK(xrc == ncclSuccess || r->rank == 0, "close: rc %d", xrc);
  free(w.src), free(w.dst), free(w.dst2), free(w.sig);
  return rc;
}


/* --- two real ranks: a failed comm's staged copies and test() --- */

/* copy_after_fail (fake-CUDA plugin, each GPU operation delayed 3-3.5 s):
 * rank 1 stages a put into rank 0's GPU window W; rank 0 takes its arrival
 * (the copy into W is queued), then its comm fails (a signal into a window
 * rank 1 deregistered). deregMrSym(W) on the failed comm must return only
 * once that copy is done: W is overwritten afterwards and must stay so. */
/* Both scenarios' start: the comm, a host source S of 2 tiles and a GPU
 * window W of w_tiles, registered on both ranks. */
static int real_pair(drv_rank_t *r, const args_t *a, drv_gin_t *g, void **cc, size_t w_tiles,
                     unsigned char **S, void **s_mh, unsigned char **W, void **w_mh) {
  CHECK(!drv_gin_load(a->plugin, "gin11", g), "load");
  CHECK(drv_gin_connect(r, g, cc) == ncclSuccess, "connect");
  *S = calloc(2, SZ), *W = calloc(w_tiles, SZ);
  CHECK(*S && *W, "out of memory");
  CHECK(g->reg_sym(*cc, *S, 2 * SZ, NCCL_PTR_HOST, 0, s_mh) == ncclSuccess &&
        g->reg_sym(*cc, *W, w_tiles * SZ, NCCL_PTR_CUDA, 0, w_mh) == ncclSuccess, "regMrSym");
  return 0;
}

static int copy_after_fail(drv_rank_t *r, const args_t *a) {
  drv_gin_t g;
  void *cc = NULL, *s_mh = NULL, *w_mh = NULL, *d_mh = NULL, *req = NULL;
  unsigned char *S, *W, *D = calloc(2, SZ);
  CHECK(D && !real_pair(r, a, &g, &cc, 2, &S, &s_mh, &W, &w_mh), "set-up");
  CHECK(g.reg_sym(cc, D, 2 * SZ, NCCL_PTR_HOST, NCCL_NET_MR_FLAG_FORCE_SO, &d_mh) == ncclSuccess,
        "regMrSym(D)");
  CHECK(!drv_gin_barrier(r, &g, cc, 60), "barrier after registration");
  ncclResult_t rc = ncclSuccess;
  if (r->rank == 1) {
    memset(S, 0x77, SZ);
    CHECK(g.iput(cc, 0, s_mh, SZ, 0, w_mh, 0, &req) == ncclSuccess && !drv_gin_wait(&g, cc, req, 30, &rc) &&
          rc == ncclSuccess, "staged put to rank 0");
  }
  for (double end = drv_now() + 1.0; drv_now() < end;) (void)g.progress(cc); /* rank 0 takes the arrival */
  CHECK(!drv_barrier(r, 60), "barrier before rank 1 deregisters D");
  if (r->rank == 1) CHECK(g.dereg_sym(cc, d_mh) == ncclSuccess, "deregMrSym(D)");
  CHECK(!drv_barrier(r, 60), "barrier after rank 1 deregistered D");
  if (r->rank == 0) {
    (void)g.iput_signal(cc, 0, NULL, 0, 0, NULL, 1, 0, d_mh, 1, NCCL_NET_SIGNAL_OP_ADD, &req);
    if (expect_failure(r, &g, cc, "a signal into rank 1's deregistered window")) return 1;
    CHECK(W[0] != 0x77, "the copy into W landed before the comm failed: nothing was tested "
          "(PS_FAKE_CUDA_MIN_DELAY_US too short for this host?)");
    double t = drv_now();
    rc = g.dereg_sym(cc, w_mh);
    printf("rank 0: deregMrSym(W) on the failed comm: rc %d after %.2f s\n", rc, drv_now() - t);
    CHECK(rc == ncclSuccess, "deregMrSym(W) on the failed comm: rc %d", rc);
    memset(W, 0x11, 2 * SZ); /* the caller's memory again */
    for (double end = drv_now() + 4.0; drv_now() < end;) usleep(10000); /* past any delayed copy */
    for (size_t i = 0; i < 2 * SZ; i++)
      CHECK(W[i] == 0x11, "byte %zu of W is 0x%02x: a copy wrote it after deregMrSym returned", i, W[i]);
    printf("rank 0: nothing wrote W after deregMrSym returned\n");
    __atomic_store_n(flag_of(r), 1, __ATOMIC_RELEASE);
  } else { /* rank 0's signal needs rank 1's refusal */
    for (double end = drv_now() + 60;
         !__atomic_load_n(flag_of(r), __ATOMIC_ACQUIRE) && !drv_peer_failed(r) && drv_now() < end;)
      (void)g.progress(cc);
  }
  (void)drv_gin_close(&g, cc);
  return 0;
}

/* test_after_fail: rank 0 has staged puts to rank 1 that cannot finish
 * (rank 1 stops progressing), then registers a window rank 1 never
 * registers: the exchange fails and closes the comm's endpoint. test() of
 * an outstanding request, twice with no progress call between, must return
 * the error, not touch the closed endpoint. */
static int test_after_fail(drv_rank_t *r, const args_t *a) {
  drv_gin_t g;
  void *cc = NULL, *s_mh = NULL, *w_mh = NULL, *x_mh = NULL;
  unsigned char *S, *W, *X = calloc(1, SZ);
  CHECK(X && !real_pair(r, a, &g, &cc, 64, &S, &s_mh, &W, &w_mh), "set-up");
  CHECK(!drv_gin_barrier(r, &g, cc, 60), "barrier after registration");
  if (r->rank == 1) { /* no progress from here */
    CHECK(!drv_barrier(r, 120), "rank 1 waits");
    return 0;
  }
  void *reqs[40] = {0}, *last = NULL;
  int n = 0;
  while (n < 40 && g.iput(cc, 0, s_mh, SZ, (uint64_t)n * SZ, w_mh, 1, &reqs[n]) == ncclSuccess) n++;
  for (int i = 0; i < n; i++) {
    int done = 0;
    if (g.test(cc, reqs[i], &done) == ncclSuccess && !done) last = reqs[i];
  }
  CHECK(last, "all %d puts done: nothing outstanding to test", n);
  CHECK(g.reg_sym(cc, X, SZ, NCCL_PTR_HOST, 0, &x_mh) != ncclSuccess, "a registration rank 1 never joined succeeded");
  for (int i = 1; i <= 2; i++) {
    int done = 0;
    ncclResult_t rc = g.test(cc, last, &done);
    printf("rank 0: test #%d after the failed exchange: rc %d done %d\n", i, rc, done);
    CHECK(rc != ncclSuccess, "test #%d of a request on a failed comm succeeded", i);
  }
  CHECK(!drv_barrier(r, 120), "rank 0 releases rank 1");
  return 0;
}

static int rank_fn(drv_rank_t *r, void *arg) {
  const args_t *a = arg;
  if (!strcmp(a->scenario, "copy_after_fail")) return copy_after_fail(r, a);
  if (!strcmp(a->scenario, "test_after_fail")) return test_after_fail(r, a);
  if (!strcmp(a->scenario, "put_dereg_gpu")) return put_dereg_gpu(r, a);
  return r->rank == 0 ? real_side(r, a) : fake_side(r, a);
}

int main(int argc, char **argv) {
  static const char *const scen[] = {"covers_ordered", "covers_window",   "staged_none",
                                     "staged_credit",  "nack_put",        "put_dereg_gpu",
                                     "sig_rx",         "copy_after_fail", "test_after_fail",
                                     "forged_signal",  "forged_part",     "forged_write"};
  args_t a = {0};
  const char *abi = NULL;
  int c, known = 0, nr = 0;
  while ((c = getopt(argc, argv, "p:s:h")) != -1) {
    if (c != 'h' && drv_gin_opt(c, optarg, &abi, &a.plugin, &a.scenario, &nr)) continue;
    fprintf(stderr, "usage: %s -s covers_ordered|covers_window|staged_none|staged_credit|"
            "nack_put|put_dereg_gpu|sig_rx|copy_after_fail|test_after_fail|forged_signal|"
            "forged_part|forged_write [-p PLUGIN]\n", argv[0]);
    return c == 'h' ? 0 : 2;
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  for (size_t i = 0; i < sizeof scen / sizeof *scen; i++)
    known |= a.scenario && !strcmp(a.scenario, scen[i]);
  if (!known) {
    fprintf(stderr, "-s names no scenario (-h for the list)\n");
    return 2;
  }
  int gpu = !strcmp(a.scenario, "put_dereg_gpu") || !strcmp(a.scenario, "copy_after_fail") ||
            !strcmp(a.scenario, "test_after_fail");
  /* the put must be issued before any pass of rank 0's reads rank 1's
   * notice: passes only inside rank 0's own calls */
  if (gpu) setenv("PERSEUS_PROGRESS_THREAD", "0", 1);
  int three = !strcmp(a.scenario, "put_dereg_gpu") || !strcmp(a.scenario, "forged_part");
  drv_opts_t o = {.nranks = three ? 3 : 2, .timeout_s = 120, .no_load = 1,
                  .no_mesh = 1,
                  .shared_bytes = drv_gin_shared_bytes(NRANKS_MAX) + sizeof(int) + PASSTHRU_MAX};
  setvbuf(stdout, NULL, _IOLBF, 0);
  double t0 = drv_now();
  int rc = drv_run(&o, rank_fn, &a);
  printf("hostile_rma_peer %s, %d ranks: %s (%.2f s)\n", a.scenario, o.nranks, rc ? "FAIL" : "ok",
         drv_now() - t0);
  return rc ? 1 : 0;
}
