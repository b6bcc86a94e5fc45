/* Fault tests: a peer killed mid-transfer or while idle, comms closed with
 * requests in flight, and malformed handles / garbage pointers handed to the
 * plugin. Loads the plugin through one ncclNetPlugin_vN table (the plugin
 * driver, harness/ps_driver.h).
 * This file holds the scenarios and main; fault_rank.c the rank helpers.
 *
 *   perseus_fault_test -s SCENARIO [-v 8..12] [-p PLUGIN]
 *
 * Scenarios:
 *   kill_recv       rank 1 streams 8 MiB messages to rank 0; rank 0 kills it
 *                   mid-stream: rank 0's receive test() must fail within 10 s
 *   kill_send       rank 0 streams to rank 1 and kills it mid-stream: rank 0's
 *                   send test() must fail within 10 s
 *   stop_send       the same, but rank 1 is stopped (SIGSTOP), not killed: its
 *                   kernel takes no more of our bytes, and rank 0's send test()
 *                   must fail within 10 s (twice PERSEUS_PEER_TIMEOUT_MS plus a
 *                   keepalive, at the test's 1500 ms), not wait for ever
 *   kill_idle_recv  rank 0 has a receive posted that nothing matches; rank 1
 *                   (idle, making no plugin call) must not be declared dead
 *                   while it lives, and test() must fail within 10 s of its kill
 *                   (the liveness probe: PERSEUS_KEEPALIVE_MS/PERSEUS_PEER_TIMEOUT_MS)
 *   close_inflight  both ranks close every comm with sends and receives in
 *                   flight, then build a fresh mesh and exchange a verified message
 *   bad_handle      one rank: connect() with malformed handles and accept()/
 *                   test()/close*() with garbage pointers: ncclInvalidArgument
 * -s all runs every scenario.
 * Prints one line per scenario (ok/FAIL); exit 0 pass, 1 fail. */
#include <getopt.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fault_rank.h"
#include "proc.h"
#include "ps_driver.h"
#include "ps_wire.h"

/* kill_recv (is_send 0): survivor 0 receives from victim 1; kill_send
 * (is_send 1): survivor 0 streams to victim 1. The kill comes once traffic
 * flows: a message arrived (kill_send: the victim received one and ours are
 * in flight), and every slot has a request posted. */
static int kill_stream(drv_rank_t *r, fault_shared_t *fs, int is_send, int stop) {
  CHECK(r->nranks == 2, "needs 2 ranks");
  if (r->rank == 1) return fault_victim_stream(r, fs, is_send ? r->recv[0] : r->send[0], !is_send);
  const char *post = is_send ? "isend before the kill" : "irecv before the kill";
  fault_pipe_t p;
  if (fault_pipe_open(r, &p, is_send ? r->send[1] : r->recv[1], is_send)) return 1;
  int bad = 0;
  double end = drv_now() + 20;
  while ((is_send && atomic_load(&fs->progress) < 1) || p.completed < 1) {
    CHECK(drv_now() < end, "%s", is_send ? "victim received nothing in 20 s"
                                         : "no message arrived in 20 s");
    CHECK(fault_pipe_post(r, &p) == ncclSuccess, "%s", post);
    CHECK(fault_pipe_test(r, &p, !is_send, &bad) == ncclSuccess, "test before the kill");
    CHECK(!bad, "corrupted message before the kill");
  }
  CHECK(fault_pipe_post(r, &p) == ncclSuccess, "%s", post);
  fs->after_msgs = (int)p.completed;
  if (stop ? fault_stop_peer(r, 1) : fault_kill_peer(r, 1)) return 1;
  int rc = fault_survivor_detect(r, fs, &p, drv_now());
  fault_pipe_close(r, &p);
  if (stop) fault_kill_peer(r, 1); /* the stopped victim ends with the scenario */
  return rc;
}

static int scenario_kill_recv(drv_rank_t *r, void *arg) { return kill_stream(r, arg, 0, 0); }
static int scenario_kill_send(drv_rank_t *r, void *arg) { return kill_stream(r, arg, 1, 0); }
static int scenario_stop_send(drv_rank_t *r, void *arg) { return kill_stream(r, arg, 1, 1); }

/* kill_idle_recv: a receive nothing was ever sent for; the peer idles (no
 * plugin call at all, like an NCCL proxy with nothing to do), then dies. */
static int scenario_kill_idle_recv(drv_rank_t *r, void *arg) {
  fault_shared_t *fs = arg;
  const double alive_s = 3.0; /* > 2 keepalive periods at the default 1000 ms */
  CHECK(r->nranks == 2, "needs 2 ranks");
  if (r->rank == 1) {
    CHECK(drv_barrier(r, 20) == 0, "barrier");
    double end = drv_now() + VICTIM_LIFE_S;
    while (drv_now() < end) fault_nap_us(10000);
    fprintf(stderr, "rank 1: victim was never killed\n");
    return 1;
  }
  static char buf[4096];
  void *mh = NULL, *req = NULL;
  CHECK(!fault_reg(r, r->recv[1], buf, sizeof buf, &mh), "regMr");
  void *d = buf;
  size_t sz = sizeof buf;
  int tag = 77, done = 0;
  for (double end = drv_now() + 10; !req;) {
    CHECK(r->net.irecv(r->recv[1], 1, &d, &sz, &tag, &mh, &req) == ncclSuccess, "irecv");
    CHECK(drv_now() < end, "irecv never accepted");
  }
  CHECK(drv_barrier(r, 20) == 0, "barrier");
  /* A live but idle peer is not dead. */
  for (double end = drv_now() + alive_s; drv_now() < end;) {
    ncclResult_t rc = r->net.test(req, &done, NULL);
    CHECK(rc == ncclSuccess, "test() failed (rc %d) while the idle peer was alive", rc);
    CHECK(!done, "a receive nothing was sent for completed");
    fault_nap_us(200);
  }
  if (fault_kill_peer(r, 1)) return 1;
  double t_kill = drv_now();
  for (;;) {
    ncclResult_t rc = r->net.test(req, &done, NULL);
    if (rc != ncclSuccess) {
      fs->detect_s = drv_now() - t_kill;
      fs->detect_rc = rc;
      break;
    }
    CHECK(!done, "a receive nothing was sent for completed");
    if (drv_now() - t_kill > GIVE_UP_S) {
      fs->detect_s = -1;
      snprintf(fs->note, sizeof fs->note, "test() still succeeding %.0f s after the kill", GIVE_UP_S);
      CHECK(0, "%s", fs->note);
    }
    fault_nap_us(200);
  }
  r->net.dereg_mr(r->recv[1], mh);
  CHECK(fs->detect_s <= DETECT_LIMIT_S, "dead peer detected after %.2f s (limit %.0f s)",
        fs->detect_s, DETECT_LIMIT_S);
  return 0;
}

/* close_inflight: sends and receives in flight, some matched, some not, then
 * everything is closed; the process must go on and connect afresh. */
static int scenario_close_inflight(drv_rank_t *r, void *arg) {
  (void)arg;
  enum { NS = 6 };
  static const size_t sizes[NS] = {64, 4096, 1 << 20, 8 << 20, 8 << 20, 16 << 20};
  int peer = 1 - r->rank;
  CHECK(r->nranks == 2, "needs 2 ranks");
  for (int round = 0; round < 2; round++) {
    char *sb[NS], *rb[NS];
    void *smh[NS], *rmh[NS], *sreq[NS] = {0}, *rreq[NS] = {0};
    for (int i = 0; i < NS; i++) {
      sb[i] = malloc(sizes[i]), rb[i] = malloc(sizes[i]);
      CHECK(sb[i] && rb[i], "out of memory");
      drv_fill(sb[i], sizes[i], (uint64_t)i);
      CHECK(!fault_reg(r, r->send[peer], sb[i], sizes[i], &smh[i]), "regMr send");
      CHECK(!fault_reg(r, r->recv[peer], rb[i], sizes[i], &rmh[i]), "regMr recv");
    }
    /* Receives for tags 100..105; the peer sends tags 100..102 (matched) and
     * 200..202 (never matched: unexpected messages at the receiver). */
    for (int i = 0; i < NS; i++) {
      void *d = rb[i];
      size_t sz = sizes[i];
      int tag = 100 + i;
      for (double end = drv_now() + 10; !rreq[i];) {
        CHECK(r->net.irecv(r->recv[peer], 1, &d, &sz, &tag, &rmh[i], &rreq[i]) == ncclSuccess, "irecv");
        CHECK(drv_now() < end, "irecv never accepted");
      }
    }
    for (int i = 0; i < NS; i++) {
      int tag = i < NS / 2 ? 100 + i : 200 + i;
      for (double end = drv_now() + 10; !sreq[i];) {
        CHECK(r->net.isend(r->send[peer], sb[i], sizes[i], tag, smh[i], &sreq[i]) == ncclSuccess, "isend");
        CHECK(drv_now() < end, "isend never accepted");
      }
    }
    /* A little progress so that transfers are really under way. */
    for (int k = 0; k < 20; k++)
      for (int i = 0; i < NS; i++) {
        int done = 0;
        if (sreq[i] && r->net.test(sreq[i], &done, NULL) == ncclSuccess && done) sreq[i] = NULL;
        if (rreq[i] && r->net.test(rreq[i], &done, NULL) == ncclSuccess && done) rreq[i] = NULL;
      }
    int inflight = 0;
    for (int i = 0; i < NS; i++) inflight += (sreq[i] != NULL) + (rreq[i] != NULL);
    CHECK(inflight > 0, "nothing left in flight to close over");
    /* Both ranks have posted everything before either closes: a receive
     * posted after the peer closed may match an unexpected message of the
     * dead connection, which crashes rxm (a libfabric 1.17 bug, docs/limitations.md). */
    CHECK(drv_barrier(r, 20) == 0, "barrier before closing");
    /* As NCCL tears down: deregister, then close, requests still posted.
     * Round 0: both ranks at once. Round 1: rank 0 first, rank 1 later while
     * rank 0 is already gone. */
    if (round == 1 && r->rank == 1) fault_nap_us(300000);
    for (int i = 0; i < NS; i++) {
      CHECK(r->net.dereg_mr(r->send[peer], smh[i]) == ncclSuccess, "deregMr send");
      CHECK(r->net.dereg_mr(r->recv[peer], rmh[i]) == ncclSuccess, "deregMr recv");
    }
    CHECK(r->net.close_send(r->send[peer]) == ncclSuccess, "closeSend with requests in flight");
    CHECK(r->net.close_recv(r->recv[peer]) == ncclSuccess, "closeRecv with requests in flight");
    CHECK(r->net.close_listen(r->listen[peer]) == ncclSuccess, "closeListen");
    r->send[peer] = r->recv[peer] = r->listen[peer] = NULL;
    for (int i = 0; i < NS; i++) free(sb[i]), free(rb[i]);
    fprintf(stderr, "rank %d: round %d closed with %d request(s) in flight\n", r->rank, round,
            inflight);
    /* A fresh mesh, one verified message each way. */
    CHECK(drv_mesh(r, 20) == 0, "re-mesh after closing with requests in flight");
    size_t n = (size_t)3 << 20;
    char *s = malloc(n), *d = malloc(n);
    void *sm, *dm, *sq = NULL, *dq = NULL;
    CHECK(s && d, "out of memory");
    drv_fill(s, n, 1000 + (uint64_t)r->rank);
    memset(d, 0, n);
    CHECK(!fault_reg(r, r->send[peer], s, n, &sm) && !fault_reg(r, r->recv[peer], d, n, &dm), "regMr");
    size_t sz = n;
    int tag = 100, got = -1; /* tag 100 was used by the closed comms: nothing stale may match */
    void *dp = d;
    for (double end = drv_now() + 10; !dq;) {
      CHECK(r->net.irecv(r->recv[peer], 1, &dp, &sz, &tag, &dm, &dq) == ncclSuccess, "irecv");
      CHECK(drv_now() < end, "irecv never accepted");
    }
    for (double end = drv_now() + 10; !sq;) {
      CHECK(r->net.isend(r->send[peer], s, n, tag, sm, &sq) == ncclSuccess, "isend");
      CHECK(drv_now() < end, "isend never accepted");
    }
    /* Test both: each comm has its own endpoint, and with manual progress a
     * large send completes only while the peer drives its receive. */
    for (double end = drv_now() + 20; sq || dq;) {
      int done = 0;
      ncclResult_t rc;
      CHECK(drv_now() < end, "fresh mesh: exchange stalled (send %s, recv %s)", sq ? "pending" : "done",
            dq ? "pending" : "done");
      if (sq) {
        CHECK((rc = r->net.test(sq, &done, NULL)) == ncclSuccess, "send on the fresh mesh: rc %d", rc);
        if (done) sq = NULL;
      }
      if (dq) {
        CHECK((rc = r->net.test(dq, &done, &got)) == ncclSuccess, "recv on the fresh mesh: rc %d", rc);
        if (done) dq = NULL;
      }
    }
    CHECK(got == (int)n, "fresh mesh: received %d bytes, sent %zu", got, n);
    long bad = drv_verify(d, n, 1000 + (uint64_t)peer);
    CHECK(bad < 0, "fresh mesh: wrong byte at offset %ld", bad);
    r->net.dereg_mr(r->send[peer], sm);
    r->net.dereg_mr(r->recv[peer], dm);
    free(s), free(d);
    CHECK(drv_barrier(r, 20) == 0, "barrier");
  }
  return 0;
}

/* bad_handle: one rank, no mesh. */
static int expect_connect_rejected(drv_rank_t *r, const char *what, const unsigned char *h) {
  /* Exactly NCCL's handle size on the heap, so a sanitizer sees an over-read. */
  unsigned char *copy = malloc(NCCL_NET_HANDLE_MAXSIZE);
  CHECK(copy, "out of memory");
  memcpy(copy, h, NCCL_NET_HANDLE_MAXSIZE);
  void *sc = (void *)0x1; /* must be overwritten */
  ncclResult_t rc = r->net.connect(r->dev, copy, &sc);
  /* NCCL calls connect again with the same handle until it has a comm. */
  void *sc2 = (void *)0x1;
  ncclResult_t rc2 = r->net.connect(r->dev, copy, &sc2);
  free(copy);
  CHECK(rc == ncclInvalidArgument, "connect with %s: rc %d, expected ncclInvalidArgument (4)", what, rc);
  CHECK(rc2 == ncclInvalidArgument, "second connect with %s: rc %d, expected 4", what, rc2);
  CHECK(sc == NULL && sc2 == NULL, "connect with %s left a comm behind (%p)", what, sc);
  return 0;
}

static int scenario_bad_handle(drv_rank_t *r, void *arg) {
  (void)arg;
  unsigned char valid[NCCL_NET_HANDLE_MAXSIZE] = {0}, h[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = NULL;
  CHECK(r->net.listen(r->dev, valid, &lc) == ncclSuccess && lc, "listen");

  memset(h, 0, sizeof h);
  if (expect_connect_rejected(r, "an all-zero handle", h)) return 1;
  srand(12345);
  for (int k = 0; k < 16; k++) {
    for (size_t i = 0; i < sizeof h; i++) h[i] = (unsigned char)rand();
    if (expect_connect_rejected(r, "random bytes", h)) return 1;
  }
  memcpy(h, valid, sizeof h);
  h[offsetof(ps_handle_t, magic)] ^= 0x01;
  if (expect_connect_rejected(r, "a corrupted magic", h)) return 1;
  const uint16_t versions[] = {0, PS_WIRE_VERSION + 1, 0xffff};
  for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
    memcpy(h, valid, sizeof h);
    memcpy(h + offsetof(ps_handle_t, version), &versions[i], 2);
    if (expect_connect_rejected(r, "another wire version", h)) return 1;
  }
  const uint16_t lens[] = {0, 200, PS_HANDLE_ADDR_MAX + 1, 0xffff};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    char what[64];
    snprintf(what, sizeof what, "addrlen %u", lens[i]);
    memcpy(h, valid, sizeof h);
    memcpy(h + offsetof(ps_handle_t, addrlen), &lens[i], 2);
    if (expect_connect_rejected(r, what, h)) return 1;
  }
  memcpy(h, valid, sizeof h);
  h[offsetof(ps_handle_t, wire_hash)] ^= 0x80;
  if (expect_connect_rejected(r, "another wire hash", h)) return 1;

  /* Garbage pointers: a small zeroed heap object is no comm/request/handle. */
  enum { SMALL = 64 };
  void *junk = calloc(1, SMALL), *out = (void *)0x1;
  CHECK(junk, "out of memory");
  int done = -1, sizes[8];
  ncclResult_t rc;
  CHECK((rc = r->net.accept(junk, &out)) == ncclInvalidArgument, "accept(junk): rc %d", rc);
  CHECK(out == NULL, "accept(junk) returned a comm");
  CHECK((rc = r->net.accept(NULL, &out)) == ncclInvalidArgument, "accept(NULL): rc %d", rc);
  CHECK((rc = r->net.close_send(junk)) == ncclInvalidArgument, "closeSend(junk): rc %d", rc);
  CHECK((rc = r->net.close_send(NULL)) == ncclInvalidArgument, "closeSend(NULL): rc %d", rc);
  CHECK((rc = r->net.close_recv(junk)) == ncclInvalidArgument, "closeRecv(junk): rc %d", rc);
  CHECK((rc = r->net.close_listen(junk)) == ncclInvalidArgument, "closeListen(junk): rc %d", rc);
  CHECK((rc = r->net.close_send(lc)) == ncclInvalidArgument, "closeSend(listen comm): rc %d", rc);
  CHECK((rc = r->net.close_recv(lc)) == ncclInvalidArgument, "closeRecv(listen comm): rc %d", rc);
  void *mh = (void *)0x1, *req = (void *)0x1, *d = junk;
  size_t sz = 8;
  int tag = 1;
  CHECK((rc = r->net.reg_mr(junk, junk, SMALL, NCCL_PTR_HOST, &mh)) == ncclInvalidArgument,
        "regMr(junk comm): rc %d", rc);
  CHECK((rc = r->net.dereg_mr(junk, junk)) == ncclInvalidArgument, "deregMr(junk): rc %d", rc);
  CHECK((rc = r->net.isend(junk, junk, 8, 1, NULL, &req)) == ncclInvalidArgument, "isend(junk): rc %d", rc);
  CHECK((rc = r->net.irecv(junk, 1, &d, &sz, &tag, NULL, &req)) == ncclInvalidArgument,
        "irecv(junk): rc %d", rc);
  CHECK((rc = r->net.test(NULL, &done, sizes)) == ncclInvalidArgument, "test(NULL): rc %d", rc);
  free(junk);
  /* test() on a zeroed object: one as large as any request, then a small one.
   * The small one runs in a child so that a crash is reported, not fatal to
   * the remaining checks. */
  void *big = calloc(1, 4096);
  CHECK(big, "out of memory");
  CHECK((rc = r->net.test(big, &done, sizes)) == ncclInvalidArgument, "test(zeroed 4 KiB): rc %d", rc);
  CHECK(done != 1, "test(zeroed 4 KiB) reported completion");
  free(big);
  int small_ok = 0;
  fflush(NULL);
  pid_t child = fork();
  if (child == 0) {
    void *j = calloc(1, SMALL);
    int d = -1, sz[8];
    ncclResult_t trc = r->net.test(j, &d, sz);
    if (trc != ncclInvalidArgument) fprintf(stderr, "rank 0: test(zeroed %d B): rc %d\n", SMALL, trc);
    _exit(trc == ncclInvalidArgument && d != 1 ? 0 : 1);
  }
  int st = 0;
  CHECK(child > 0 && waitpid(child, &st, 0) == child, "fork/waitpid");
  if (WIFSIGNALED(st))
    fprintf(stderr, "rank 0: test() on a zeroed %d-byte heap object crashed (signal %d): "
            "it reads the request's comm pointer past the object\n", SMALL, WTERMSIG(st));
  else if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
    small_ok = 1;
  else
    fprintf(stderr, "rank 0: test() on a zeroed %d-byte heap object: exit %d (wrong rc, or a sanitizer report above)\n",
            SMALL, WIFEXITED(st) ? WEXITSTATUS(st) : -1);

  /* The rejections left the listener usable: connect to it for real. */
  void *sc = NULL, *rc_comm = NULL;
  for (double end = drv_now() + 10; !sc || !rc_comm;) {
    CHECK(drv_now() < end, "loopback connect after the rejections did not complete");
    if (!sc) CHECK(r->net.connect(r->dev, valid, &sc) == ncclSuccess, "connect(valid)");
    if (!rc_comm) CHECK(r->net.accept(lc, &rc_comm) == ncclSuccess, "accept");
  }
  CHECK((rc = r->net.close_listen(sc)) == ncclInvalidArgument, "closeListen(send comm): rc %d", rc);
  CHECK((rc = r->net.accept(rc_comm, &out)) == ncclInvalidArgument, "accept(recv comm): rc %d", rc);
  CHECK(r->net.close_send(sc) == ncclSuccess, "closeSend");
  CHECK(r->net.close_recv(rc_comm) == ncclSuccess, "closeRecv");
  CHECK(r->net.close_listen(lc) == ncclSuccess, "closeListen");
  CHECK(small_ok, "test() with a small zeroed heap object did not return ncclInvalidArgument");
  return 0;
}

typedef struct {
  const char *name;
  drv_rank_fn fn;
  int nranks, no_mesh, kills;
} scenario_t;

static const scenario_t scenarios[] = {
    {"kill_recv", scenario_kill_recv, 2, 0, 1},
    {"kill_send", scenario_kill_send, 2, 0, 1},
    {"stop_send", scenario_stop_send, 2, 0, 1},
    {"kill_idle_recv", scenario_kill_idle_recv, 2, 0, 1},
    {"close_inflight", scenario_close_inflight, 2, 0, 0},
    {"bad_handle", scenario_bad_handle, 1, 1, 0},
};
#define NSCEN (sizeof scenarios / sizeof scenarios[0])

static int run_one(const scenario_t *s, int version, const char *plugin, fault_shared_t *fs) {
  drv_opts_t o = {.nranks = s->nranks, .version = version, .plugin = plugin, .timeout_s = 30,
                  .no_mesh = s->no_mesh};
  memset(fs, 0, sizeof *fs);
  fs->detect_s = -1;
  double t0 = drv_now();
  int rc = drv_run(&o, s->fn, fs);
  double wall = drv_now() - t0;
  const char *prov = getenv("PERSEUS_PROVIDER");
  char detail[256] = "";
  if (s->kills > 0 && fs->detect_s >= 0)
    snprintf(detail, sizeof detail, " detection %.3f s (test rc %d)", fs->detect_s, fs->detect_rc);
  else if (s->kills > 0)
    snprintf(detail, sizeof detail, " detection: none");
  if (s->kills > 0 && fs->after_msgs)
    snprintf(detail + strlen(detail), sizeof detail - strlen(detail), ", %d msg(s) before the kill",
             fs->after_msgs);
  if (fs->note[0])
    snprintf(detail + strlen(detail), sizeof detail - strlen(detail), ", %s", fs->note);
  printf("%-15s v%-2d provider=%-12s %s (%.2f s)%s\n", s->name, version, prov ? prov : "auto",
         rc ? "FAIL" : "ok", wall, detail);
  return rc ? 1 : 0;
}

int main(int argc, char **argv) {
  int version = 12, c;
  const char *scen = NULL, *plugin = NULL;
  while ((c = getopt(argc, argv, "v:s:p:h")) != -1) {
    switch (c) {
      case 'v': version = drv_parse_int("-v", optarg, 8, 12); break;
      case 's': scen = optarg; break;
      case 'p': plugin = drv_parse_plugin("-p", optarg); break;
      default:
        fprintf(stderr, "usage: %s -s kill_recv|kill_send|stop_send|kill_idle_recv|close_inflight|bad_handle|all "
                        "[-v 8..12] [-p PLUGIN]\n", argv[0]);
        return c == 'h' ? 0 : 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  if (version < 8 || version > 12) {
    fprintf(stderr, "ABI version must be in 8..12, got %d\n", version);
    return 2;
  }
  if (!scen) scen = "all";
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* libpsm2 (loaded by libfabric's psm2 provider while probing) turns SIGSEGV
   * into a backtrace and exit(1); keep a crash a crash, seen as a signal. */
  setenv("HFI_NO_BACKTRACE", "1", 0);
  setenv("IPATH_NO_BACKTRACE", "1", 0);
  fault_shared_t *fs = ps_proc_shared_map(sizeof *fs);
  if (!fs) {
    perror("mmap");
    return 2;
  }
  int fails = 0, found = 0;
  for (size_t i = 0; i < NSCEN; i++) {
    if (strcmp(scen, "all") ? strcmp(scen, scenarios[i].name) != 0 : scenarios[i].kills < 0) continue;
    found = 1;
    fails += run_one(&scenarios[i], version, plugin, fs);
  }
  if (!found) {
    fprintf(stderr, "unknown scenario '%s' (expected all or one of", scen);
    for (size_t i = 0; i < NSCEN; i++) fprintf(stderr, "%s %s", i ? "," : "", scenarios[i].name);
    fprintf(stderr, ")\n");
    return 2;
  }
  return fails ? 1 : 0;
}
