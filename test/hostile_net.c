/* Hostile calls through the exported net tables (v8..v12), as a careless or
 * hostile caller would make them. Every case must end in an error code, not
 * a crash or a silent success, and the comm must still carry a valid message
 * afterwards:
 *   - getProperties with a NULL properties pointer, and of a device that
 *     does not exist; listen, connect and accept with NULL out-pointers or
 *     handle; connect to a listener that was closed (an error within
 *     PERSEUS_PEER_TIMEOUT_MS + 1 s, not a NULL comm for ever);
 *   - regMr of a NULL buffer with a size;
 *   - isend/irecv of a NULL buffer with a size, without a memory handle,
 *     beyond the registration, and beyond maxP2pBytes (however large the
 *     registration); a foreign pointer as memory handle;
 *   - (-s half_open, 3 ranks) a connector that dies after its CONNECT left:
 *     the listener never returns an error for it and still accepts a live
 *     connector afterwards, within PERSEUS_PEER_TIMEOUT_MS + 5 s.
 * Usage: perseus_hostile_net -v VERSION [-s half_open] (the harness's plugin
 * and loader). */
#include <dlfcn.h>
#include <getopt.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ps_driver.h"
#include "ps_driver_int.h"

#define BUF 4096

static void nap_ms(int ms) {
  struct timespec ts = {.tv_sec = 0, .tv_nsec = ms * 1000000L};
  nanosleep(&ts, NULL);
}

/* getProperties(dev, NULL) and of a device past the last, on the raw table:
 * the harness's call list would hand it a struct of its own. */
static int raw_props(int version) {
  void *lib = drv_open_plugin(NULL, NULL);
  if (!lib) return 1;
  char sym[32];
  snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", version);
  void *tbl = dlsym(lib, sym);
  if (!tbl) {
    fprintf(stderr, "no %s\n", sym);
    return 1;
  }
  int ndev = 0, bad = 0;
  ncclResult_t rc[3] = {ncclSuccess, ncclSuccess, ncclSuccess};
  union {
    ps_props_v8_t v8;
    ps_props_v9_t v9;
    ps_props_v11_t v11;
    ps_props_v12_t v12;
  } room;
  /* each version's own table type: devices, then getProperties with NULL,
   * one past the last device, and -1 */
#define RAW_PROPS(V, M)                                                             \
  do {                                                                              \
    const ncclNet_v##V##_t *t = tbl;                                                \
    if (t->devices(&ndev) != ncclSuccess || ndev < 1) {                             \
      fprintf(stderr, "v%d devices: %d\n", version, ndev);                          \
      return 1;                                                                     \
    }                                                                               \
    rc[0] = t->getProperties(0, NULL);                                              \
    rc[1] = t->getProperties(ndev, &room.M);                                        \
    rc[2] = t->getProperties(-1, &room.M);                                          \
  } while (0)
  switch (version) {
    case 8: RAW_PROPS(8, v8); break;
    case 9: RAW_PROPS(9, v9); break;
    case 10: RAW_PROPS(10, v9); break;
    case 11: RAW_PROPS(11, v11); break;
    case 12: RAW_PROPS(12, v12); break;
    default: fprintf(stderr, "no ABI version %d\n", version); return 1;
  }
#undef RAW_PROPS
  const char *what[3] = {"(0, NULL)", "of one past the last device", "(-1)"};
  for (int i = 0; i < 3; i++)
    if (rc[i] == ncclSuccess) fprintf(stderr, "v%d getProperties %s succeeded\n", version, what[i]), bad++;
  return bad;
}

/* One hostile isend: must fail now, never hand back a request. */
static int send_refused(drv_rank_t *r, void *data, size_t size, void *mh, const char *what) {
  void *req = (void *)1;
  ncclResult_t rc = r->net.isend(r->send[1], data, size, 7, mh, &req);
  CHECK(rc != ncclSuccess && rc != ncclInProgress, "isend %s: rc %d (expected an error)", what, rc);
  CHECK(req == NULL, "isend %s failed but left a request %p", what, req);
  return 0;
}

static int recv_refused(drv_rank_t *r, void *data, size_t size, void *mh, const char *what) {
  void *req = (void *)1, *datas[1] = {data}, *mhs[1] = {mh};
  size_t sizes[1] = {size};
  int tags[1] = {7};
  ncclResult_t rc = r->net.irecv(r->recv[0], 1, datas, sizes, tags, mhs, &req);
  CHECK(rc != ncclSuccess && rc != ncclInProgress, "irecv %s: rc %d (expected an error)", what, rc);
  CHECK(req == NULL, "irecv %s failed but left a request %p", what, req);
  return 0;
}

static int rank_fn(drv_rank_t *r, void *arg) {
  (void)arg;
  char *buf = calloc(1, BUF);
  void *comm = r->rank == 0 ? r->send[1] : r->recv[0], *mh = NULL, *nomh = NULL;
  drv_props_t p;
  CHECK(buf, "out of memory");
  CHECK(r->net.get_props(r->dev, &p) == ncclSuccess, "getProperties");
  CHECK(r->net.reg_mr(comm, NULL, BUF, NCCL_PTR_HOST, &nomh) != ncclSuccess && !nomh,
        "regMr of a NULL buffer of %d B accepted", BUF);
  CHECK(r->net.reg_mr(comm, buf, BUF, NCCL_PTR_HOST, &mh) == ncclSuccess, "regMr");
  char stranger[64] = {0}; /* not a memory handle */
  size_t over = p.max_p2p_bytes + 1;
  if (r->rank == 0) {
    if (send_refused(r, NULL, BUF, mh, "of a NULL buffer") ||
        send_refused(r, buf, BUF, NULL, "without a memory handle") ||
        send_refused(r, buf, 1 << 20, mh, "of 1 MiB from a 4 KiB registration") ||
        send_refused(r, buf + BUF - 8, 16, mh, "running past the registration's end") ||
        send_refused(r, buf, over, mh, "beyond maxP2pBytes") ||
        send_refused(r, buf, 64, stranger, "with a foreign memory handle"))
      return 1;
  } else {
    if (recv_refused(r, NULL, BUF, mh, "into a NULL buffer") ||
        recv_refused(r, buf, BUF, NULL, "without a memory handle") ||
        recv_refused(r, buf, 1 << 20, mh, "of 1 MiB into a 4 KiB registration") ||
        recv_refused(r, buf, over, mh, "beyond maxP2pBytes") ||
        recv_refused(r, buf, 64, stranger, "with a foreign memory handle"))
      return 1;
  }
  /* The comm still carries a valid message. */
  void *req = NULL;
  double end = drv_now() + 30;
  if (r->rank == 0) {
    drv_fill(buf, BUF, 42);
    while (!req && drv_now() < end)
      CHECK(r->net.isend(r->send[1], buf, BUF, 7, mh, &req) == ncclSuccess, "valid isend");
  } else {
    void *datas[1] = {buf}, *mhs[1] = {mh};
    size_t sizes[1] = {BUF};
    int tags[1] = {7};
    while (!req && drv_now() < end)
      CHECK(r->net.irecv(r->recv[0], 1, datas, sizes, tags, mhs, &req) == ncclSuccess, "valid irecv");
  }
  CHECK(req && !drv_wait(r, req, NULL, 30, NULL), "the valid message did not go through");
  CHECK(r->rank == 0 || drv_verify(buf, BUF, 42) < 0, "the valid message arrived wrong");
  CHECK(r->net.dereg_mr(comm, mh) == ncclSuccess, "deregMr");
  free(buf);
  return 0;
}

/* Shared by the half_open ranks. */
typedef struct {
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  atomic_int listening, doomed_sent, doomed_dead, live_done;
} half_open_t;

/* Rank 1 listens; rank 0 connects (its CONNECT reaches the listener's
 * endpoint without the listener's progress) and dies; only then does rank 1
 * start accepting, so its ACCEPT goes to a dead peer. Rank 2 connects once
 * rank 0 is dead and must be accepted. */
static int half_open(drv_rank_t *r, void *arg) {
  half_open_t *h = r->user;
  (void)arg;
  const char *tmo = getenv("PERSEUS_PEER_TIMEOUT_MS");
  double limit = (tmo ? atof(tmo) : 5000) / 1000 + 5, end = drv_now() + limit + 10;
  if (r->rank == 1) {
    void *lc = NULL, *rc = NULL;
    CHECK(r->net.listen(r->dev, h->handle, &lc) == ncclSuccess, "listen");
    atomic_store(&h->listening, 1);
    while (!atomic_load(&h->doomed_dead)) CHECK(drv_now() < end, "rank 0 never died");
    double t_dead = drv_now();
    /* Each accepted comm is closed: rank 0's may be among them where its
     * ACCEPT was taken by the kernel before the provider saw the death. The
     * live connector's must come, and accept must never fail. */
    int accepted = 0;
    while (!atomic_load(&h->live_done) || !accepted) {
      CHECK(drv_now() < end, "the live connector was never accepted");
      ncclResult_t res = r->net.accept(lc, &rc);
      CHECK(res == ncclSuccess, "accept returned %d after a connector died: the listener broke", res);
      if (rc) {
        accepted++;
        CHECK(r->net.close_recv(rc) == ncclSuccess, "closeRecv");
        rc = NULL;
      }
    }
    CHECK(drv_now() - t_dead < limit, "the live connector waited %.1f s", drv_now() - t_dead);
    CHECK(r->net.close_listen(lc) == ncclSuccess, "closeListen");
    return 0;
  }
  while (!atomic_load(&h->listening)) CHECK(drv_now() < end, "no listener");
  if (r->rank == 0) {
    void *sc = NULL;
    drv_mark_killable(r, 0);
    for (double t = drv_now() + 0.2; drv_now() < t;) /* the CONNECT leaves */
      CHECK(r->net.connect(r->dev, h->handle, &sc) == ncclSuccess, "connect");
    atomic_store(&h->doomed_dead, 1);
    raise(SIGKILL);
  }
  while (!atomic_load(&h->doomed_dead)) CHECK(drv_now() < end, "rank 0 never died");
  void *sc = NULL;
  while (!sc) {
    CHECK(drv_now() < end, "never connected");
    CHECK(r->net.connect(r->dev, h->handle, &sc) == ncclSuccess, "connect failed");
  }
  atomic_store(&h->live_done, 1);
  CHECK(r->net.close_send(sc) == ncclSuccess, "closeSend");
  return 0;
}

int main(int argc, char **argv) {
  int version = 12, c;
  const char *scenario = "calls";
  while ((c = getopt(argc, argv, "v:s:")) != -1) {
    if (c == 's') {
      scenario = optarg;
      continue;
    }
    if (c != 'v') {
      fprintf(stderr, "usage: %s [-v 8..12] [-s calls|half_open]\n", argv[0]);
      return 2;
    }
    version = atoi(optarg);
  }
  if (!strcmp(scenario, "half_open")) {
    drv_opts_t o = {.nranks = 3, .version = version, .timeout_s = 120, .no_mesh = 1,
                    .shared_bytes = sizeof(half_open_t)};
    int rc = drv_run(&o, half_open, NULL);
    printf("hostile_net half_open v%d: %s\n", version, rc ? "FAIL" : "ok");
    return rc ? 1 : 0;
  }
  drv_net_t net;
  if (drv_load(NULL, version, &net)) return 1;
  int bad = raw_props(version);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = NULL, *out = NULL;
  if (net.listen(0, handle, NULL) == ncclSuccess) fprintf(stderr, "listen with no comm pointer\n"), bad++;
  if (net.listen(0, NULL, &lc) == ncclSuccess) fprintf(stderr, "listen with no handle\n"), bad++;
  if (net.listen(0, handle, &lc) != ncclSuccess || !lc) {
    fprintf(stderr, "listen failed\n");
    return 1;
  }
  if (net.connect(0, handle, NULL) == ncclSuccess) fprintf(stderr, "connect with no comm pointer\n"), bad++;
  if (net.accept(lc, NULL) == ncclSuccess) fprintf(stderr, "accept with no comm pointer\n"), bad++;
  if (net.accept(NULL, &out) == ncclSuccess || out) fprintf(stderr, "accept on a NULL listen comm\n"), bad++;
  if (net.close_listen(lc) != ncclSuccess) fprintf(stderr, "closeListen failed\n"), bad++;
  /* the listener is gone: connect must fail, in time, and keep failing */
  const char *tmo = getenv("PERSEUS_PEER_TIMEOUT_MS");
  double limit = (tmo ? atof(tmo) : 5000) / 1000 + 1, t0 = drv_now();
  ncclResult_t rc = ncclSuccess;
  while (rc == ncclSuccess && !out && drv_now() - t0 < limit + 5) {
    rc = net.connect(0, handle, &out);
    if (rc == ncclSuccess && !out) nap_ms(1);
  }
  double took = drv_now() - t0;
  if (rc == ncclSuccess || out || took > limit)
    fprintf(stderr, "connect to a closed listener: rc %d, comm %p after %.2f s (limit %.2f s)\n", rc,
            out, took, limit), bad++;
  drv_opts_t o = {.nranks = 2, .version = version, .timeout_s = 120};
  bad += drv_run(&o, rank_fn, NULL) != 0;
  printf("hostile_net v%d: %s\n", version, bad ? "FAIL" : "ok");
  return bad ? 1 : 0;
}
