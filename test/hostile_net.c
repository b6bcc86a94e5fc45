/* Hostile calls through the exported net tables (v8..v12), as a careless or
 * hostile caller would make them. Every case must end in an error code, not
 * a crash or a silent success, and the comm must still carry a valid message
 * afterwards:
 *   - getProperties with a NULL properties pointer, and of a device that
 *     does not exist; listen, connect and accept with NULL out-pointers or
 *     handle; connect to a listener that was closed (an error within
 *     PERSEUS_PEER_TIMEOUT_MS + 1 s, not a NULL comm for ever);
 *   - regMr of a NULL buffer with a size, and of one that runs past the
 *     end of the address space;
 *   - isend/irecv of a NULL buffer with a size, without a memory handle,
 *     beyond the registration, and beyond maxP2pBytes (however large the
 *     registration); a foreign pointer as memory handle;
 *   - (-s half_open, 3 ranks) a connector that dies after its CONNECT left:
 *     the listener never returns an error for it and still accepts a live
 *     connector afterwards, within PERSEUS_PEER_TIMEOUT_MS + 5 s;
 *   - (-s dead_listener, 2 ranks) a listener whose endpoint took our CONNECT
 *     and whose process then dies without accepting: connect fails, within
 *     PERSEUS_PEER_TIMEOUT_MS + PERSEUS_KEEPALIVE_MS + 5 s, instead of
 *     returning a NULL comm for ever.
 * Stale objects, each on a connection within this one process; the object
 * is freed, then (where it says so) its memory or slot is taken by a new one
 * of the same kind, so a check that relied on freed memory being
 * overwritten, or on a pointer, would take the new owner's:
 *   - (-s stale_req) test() of a send and a receive request that completed,
 *     before and after their slots serve new requests;
 *   - (-s double_close) closeSend, closeRecv and closeListen twice, the
 *     first two after a new connection was made, and a comm of the wrong kind;
 *   - (-s double_dereg) deregMr twice, after the buffer was registered anew;
 *   - (-s stale_mh) isend and irecv with a deregistered memory handle, after
 *     the buffer was registered anew;
 *   - (-s reconnect) 500 connects, each with a fresh copy of one handle, while
 *     the listener does not accept: they resume one connect, so the open fds
 *     stay flat and the listener accepts exactly one comm, which carries data.
 * In each, the new owner must still work afterwards.
 * Connection setup that needs several connections or a dead process
 * (abandon, finalize, wrong_id, shm_stale, shm_addr, shm_dead_peer) is in hostile_conn.c.
 * Usage: perseus_hostile_net -v VERSION [-s SCENARIO] (the harness's plugin
 * and loader). */
#include <dlfcn.h>
#include <getopt.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hostile_net.h"
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
  ncclResult_t rc[5] = {ncclSuccess, ncclSuccess, ncclSuccess, ncclSuccess, ncclSuccess};
  int vdev = -1;
  union {
    ps_props_v8_t v8;
    ps_props_v9_t v9;
    ps_props_v11_t v11;
    ps_props_v12_t v12;
    ps_vprops_v9_t vdev9;
    ps_vprops_v12_t vdev12;
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
    rc[3] = t->devices(NULL);                                                       \
  } while (0)
  /* makeVDevice (v9 on) without its properties, and of no devices */
#define RAW_VDEV(V, M)                                                              \
  do {                                                                              \
    const ncclNet_v##V##_t *t = tbl;                                                \
    memset(&room.M, 0, sizeof room.M);                                              \
    rc[4] = t->makeVDevice(&vdev, NULL) == ncclSuccess ||                           \
                    t->makeVDevice(&vdev, (void *)&room.M) == ncclSuccess           \
                ? ncclSuccess                                                       \
                : ncclInvalidArgument;                                              \
  } while (0)
  switch (version) {
    case 8: RAW_PROPS(8, v8); break; /* no makeVDevice: rc[4] not checked */
    case 9: RAW_PROPS(9, v9); RAW_VDEV(9, vdev9); break;
    case 10: RAW_PROPS(10, v9); RAW_VDEV(10, vdev9); break;
    case 11: RAW_PROPS(11, v11); RAW_VDEV(11, vdev9); break;
    case 12: RAW_PROPS(12, v12); RAW_VDEV(12, vdev12); break;
    default: fprintf(stderr, "no ABI version %d\n", version); return 1;
  }
#undef RAW_PROPS
#undef RAW_VDEV
  const char *what[5] = {"getProperties(0, NULL)", "getProperties of one past the last device",
                         "getProperties(-1)", "devices(NULL)", "makeVDevice of NULL or of 0 devices"};
  for (int i = 0; i < (version >= 9 ? 5 : 4); i++)
    if (rc[i] == ncclSuccess) fprintf(stderr, "v%d %s succeeded\n", version, what[i]), bad++;
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
  CHECK(r->net.reg_mr(comm, (void *)(UINTPTR_MAX - BUF / 2 + 1), BUF, NCCL_PTR_HOST, &nomh) !=
                ncclSuccess && !nomh,
        "regMr of %d B %d B below the top of the address space accepted", BUF, BUF / 2);
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

/* Rank 1 listens and, once rank 0's CONNECT had time to reach its endpoint,
 * dies without accepting; rank 0 keeps calling connect, as NCCL does. */
static int dead_listener(drv_rank_t *r, void *arg) {
  half_open_t *h = r->user;
  (void)arg;
  const char *tmo = getenv("PERSEUS_PEER_TIMEOUT_MS"), *ka = getenv("PERSEUS_KEEPALIVE_MS");
  double limit = (tmo ? atof(tmo) : 5000) / 1000 + (ka ? atof(ka) : 1000) / 1000 + 5;
  double end = drv_now() + limit + 10;
  if (r->rank == 1) {
    void *lc = NULL;
    drv_mark_killable(r, 1);
    CHECK(r->net.listen(r->dev, h->handle, &lc) == ncclSuccess, "listen");
    atomic_store(&h->listening, 1);
    while (!atomic_load(&h->doomed_sent)) CHECK(drv_now() < end, "rank 0 never connected");
    atomic_store(&h->doomed_dead, 1);
    raise(SIGKILL);
  }
  while (!atomic_load(&h->listening)) CHECK(drv_now() < end, "no listener");
  void *sc = NULL;
  ncclResult_t rc = ncclSuccess;
  for (double t = drv_now() + 0.5; rc == ncclSuccess && !sc && drv_now() < t;) /* the CONNECT lands */
    rc = r->net.connect(r->dev, h->handle, &sc);
  CHECK(rc == ncclSuccess && !sc, "connect before the listener died: rc %d, comm %p", rc, sc);
  atomic_store(&h->doomed_sent, 1);
  while (!atomic_load(&h->doomed_dead)) CHECK(drv_now() < end, "rank 1 never died");
  double t0 = drv_now();
  while (rc == ncclSuccess && !sc && drv_now() - t0 < limit + 5) {
    rc = r->net.connect(r->dev, h->handle, &sc);
    if (rc == ncclSuccess && !sc) nap_ms(1);
  }
  CHECK(rc != ncclSuccess && !sc, "connect to a listener that died: rc %d, comm %p after %.1f s",
        rc, sc, drv_now() - t0);
  CHECK(drv_now() - t0 <= limit, "the dead listener was found after %.1f s (limit %.1f s)",
        drv_now() - t0, limit);
  return 0;
}

/* --- stale objects, on one connection within this process --- */

typedef struct {
  drv_net_t *net;
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lc, *sc, *rc;
  char sbuf[BUF], rbuf[BUF];
} loop_t;

/* connect and accept until both have a comm (the connect may resume one
 * under way for the same handle contents) */
static int loop_connect(loop_t *l, const void *handle, void **sc, void **rc) {
  double end = drv_now() + 30;
  *sc = *rc = NULL;
  while (!*sc || !*rc) {
    FAIL_IF(drv_now() > end, "connect/accept did not finish in 30 s");
    if (!*sc) FAIL_IF(l->net->connect(0, (void *)handle, sc) != ncclSuccess, "connect failed");
    if (!*rc) FAIL_IF(l->net->accept(l->lc, rc) != ncclSuccess, "accept failed");
  }
  return 0;
}

static int loop_open(drv_net_t *net, loop_t *l) {
  memset(l, 0, sizeof *l);
  l->net = net;
  FAIL_IF(net->listen(0, l->handle, &l->lc) != ncclSuccess || !l->lc, "listen failed");
  return loop_connect(l, l->handle, &l->sc, &l->rc);
}

/* isend/irecv until posted (NULL is backpressure) */
static int post(loop_t *l, int send, void *comm, void *mh, void **req) {
  double end = drv_now() + 30;
  void *data = send ? l->sbuf : l->rbuf, *mhs[1] = {mh};
  size_t sizes[1] = {BUF};
  int tags[1] = {7};
  *req = NULL;
  while (!*req) {
    FAIL_IF(drv_now() > end, "%s never posted", send ? "isend" : "irecv");
    ncclResult_t rc = send ? l->net->isend(comm, data, BUF, 7, mh, req)
                           : l->net->irecv(comm, 1, &data, sizes, tags, mhs, req);
    FAIL_IF(rc != ncclSuccess, "valid %s failed: %d", send ? "isend" : "irecv", rc);
  }
  return 0;
}

static int complete(loop_t *l, void *sreq, void *rreq) {
  double end = drv_now() + 30;
  int sdone = 0, rdone = 0, size = 0;
  while (!sdone || !rdone) {
    FAIL_IF(drv_now() > end, "a valid message did not complete in 30 s");
    if (!sdone) FAIL_IF(l->net->test(sreq, &sdone, NULL) != ncclSuccess, "test(send) failed");
    if (!rdone) FAIL_IF(l->net->test(rreq, &rdone, &size) != ncclSuccess, "test(recv) failed");
  }
  FAIL_IF(size != BUF, "received %d B, sent %d B", size, BUF);
  return 0;
}

/* One message sc -> rc with these memory handles; sreq/rreq (if set) get
 * the requests, which are complete on return. */
static int xfer(loop_t *l, void *sc, void *smh, void *rc, void *rmh, uint64_t id, void **sreq,
                void **rreq) {
  void *s, *r;
  drv_fill(l->sbuf, BUF, id);
  memset(l->rbuf, 0, BUF);
  if (post(l, 0, rc, rmh, &r) || post(l, 1, sc, smh, &s) || complete(l, s, r)) return 1;
  FAIL_IF(drv_verify(l->rbuf, BUF, id) >= 0, "message %llu arrived wrong", (unsigned long long)id);
  if (sreq) *sreq = s;
  if (rreq) *rreq = r;
  return 0;
}

static int reg(loop_t *l, void *comm, void *buf, void **mh) {
  FAIL_IF(l->net->reg_mr(comm, buf, BUF, NCCL_PTR_HOST, mh) != ncclSuccess || !*mh, "regMr");
  return 0;
}

/* The stale call must fail; done must not turn 1. */
static int test_refused(loop_t *l, void *req, const char *what) {
  int done = 0;
  ncclResult_t rc = l->net->test(req, &done, NULL);
  FAIL_IF(rc == ncclSuccess || done, "test() of %s: rc %d, done %d (expected an error)", what, rc,
          done);
  return 0;
}

static int stale_req(loop_t *l) {
  void *smh, *rmh, *s1, *r1, *s2, *r2;
  if (reg(l, l->sc, l->sbuf, &smh) || reg(l, l->rc, l->rbuf, &rmh) ||
      xfer(l, l->sc, smh, l->rc, rmh, 1, &s1, &r1) ||
      test_refused(l, s1, "a completed send request") ||
      test_refused(l, r1, "a completed receive request"))
    return 1;
  /* the next requests take the slots of the first */
  drv_fill(l->sbuf, BUF, 2);
  memset(l->rbuf, 0, BUF);
  if (post(l, 0, l->rc, rmh, &r2) || post(l, 1, l->sc, smh, &s2) ||
      test_refused(l, s1, "a send request whose slot serves a new one") ||
      test_refused(l, r1, "a receive request whose slot serves a new one") || complete(l, s2, r2))
    return 1;
  FAIL_IF(drv_verify(l->rbuf, BUF, 2) >= 0, "the new owner's message arrived wrong");
  FAIL_IF(l->net->dereg_mr(l->sc, smh) || l->net->dereg_mr(l->rc, rmh), "deregMr");
  return 0;
}

static int double_close(loop_t *l) {
  void *sc = l->sc, *rc = l->rc, *lc = l->lc, *sc2, *rc2, *smh, *rmh;
  l->sc = l->rc = NULL; /* closed here, whatever happens */
  FAIL_IF(l->net->close_send(sc) != ncclSuccess, "closeSend");
  FAIL_IF(l->net->close_recv(rc) != ncclSuccess, "closeRecv");
  /* a new connection: its comms may sit where the closed ones were */
  if (loop_connect(l, l->handle, &sc2, &rc2)) return 1;
  l->sc = sc2, l->rc = rc2;
  FAIL_IF(l->net->close_send(sc) == ncclSuccess, "a second closeSend of one comm succeeded");
  FAIL_IF(l->net->close_recv(rc) == ncclSuccess, "a second closeRecv of one comm succeeded");
  FAIL_IF(l->net->close_send(rc2) == ncclSuccess, "closeSend of a recv comm succeeded");
  FAIL_IF(l->net->close_recv(sc2) == ncclSuccess, "closeRecv of a send comm succeeded");
  if (reg(l, sc2, l->sbuf, &smh) || reg(l, rc2, l->rbuf, &rmh) ||
      xfer(l, sc2, smh, rc2, rmh, 3, NULL, NULL))
    return 1;
  FAIL_IF(l->net->dereg_mr(sc2, smh) || l->net->dereg_mr(rc2, rmh), "deregMr");
  l->sc = l->rc = l->lc = NULL;
  FAIL_IF(l->net->close_send(sc2) || l->net->close_recv(rc2), "closing the new connection failed");
  FAIL_IF(l->net->close_listen(lc) != ncclSuccess, "closeListen");
  FAIL_IF(l->net->close_listen(lc) == ncclSuccess, "a second closeListen succeeded");
  return 0;
}

/* mh1 is registered and deregistered; mh2 registers the same buffer anew
 * (the handle may sit where mh1 was). */
static int reg_again(loop_t *l, void *comm, void *buf, void **mh1, void **mh2) {
  if (reg(l, comm, buf, mh1)) return 1;
  FAIL_IF(l->net->dereg_mr(comm, *mh1) != ncclSuccess, "deregMr");
  return reg(l, comm, buf, mh2);
}

static int double_dereg(loop_t *l) {
  void *old, *smh, *rmh;
  if (reg_again(l, l->sc, l->sbuf, &old, &smh) || reg(l, l->rc, l->rbuf, &rmh)) return 1;
  FAIL_IF(l->net->dereg_mr(l->sc, old) == ncclSuccess, "a second deregMr of one handle succeeded");
  if (xfer(l, l->sc, smh, l->rc, rmh, 4, NULL, NULL)) return 1;
  FAIL_IF(l->net->dereg_mr(l->sc, smh) || l->net->dereg_mr(l->rc, rmh), "deregMr");
  FAIL_IF(l->net->dereg_mr(l->rc, rmh) == ncclSuccess, "a second deregMr of one handle succeeded");
  return 0;
}

static int stale_mh(loop_t *l) {
  void *sold, *rold, *smh, *rmh, *req = (void *)1, *data[1] = {l->rbuf}, *mhs[1];
  size_t sizes[1] = {BUF};
  int tags[1] = {7};
  if (reg_again(l, l->sc, l->sbuf, &sold, &smh) || reg_again(l, l->rc, l->rbuf, &rold, &rmh))
    return 1;
  ncclResult_t rc = l->net->isend(l->sc, l->sbuf, BUF, 7, sold, &req);
  FAIL_IF(rc == ncclSuccess || req, "isend with a deregistered memory handle: rc %d, request %p",
          rc, req);
  mhs[0] = rold;
  req = (void *)1;
  rc = l->net->irecv(l->rc, 1, data, sizes, tags, mhs, &req);
  FAIL_IF(rc == ncclSuccess || req, "irecv with a deregistered memory handle: rc %d, request %p",
          rc, req);
  if (xfer(l, l->sc, smh, l->rc, rmh, 5, NULL, NULL)) return 1;
  FAIL_IF(l->net->dereg_mr(l->sc, smh) || l->net->dereg_mr(l->rc, rmh), "deregMr");
  return 0;
}

#define RECONNECTS 500

static int reconnect(drv_net_t *net) {
  loop_t l = {.net = net};
  void *sc = NULL, *rc = NULL, *smh, *rmh;
  FAIL_IF(net->listen(0, l.handle, &l.lc) != ncclSuccess, "listen failed");
  int fds0 = -1, fds = -1;
  /* a fresh copy at another address each time, as a caller that copies the
   * handle into each message would pass it */
  char(*copies)[NCCL_NET_HANDLE_MAXSIZE] = calloc(RECONNECTS, sizeof *copies);
  FAIL_IF(!copies, "out of memory");
  for (int i = 0; i < RECONNECTS; i++) {
    memcpy(copies[i], l.handle, sizeof l.handle);
    ncclResult_t res = net->connect(0, copies[i], &sc);
    FAIL_IF(res != ncclSuccess || sc, "connect %d with a copy of the handle: rc %d, comm %p", i,
            res, sc);
    if (i == 0) fds0 = hostile_open_fds();
  }
  free(copies);
  fds = hostile_open_fds();
  FAIL_IF(fds > fds0 + 4, "%d connects with copies of one handle: %d open fds after the first, "
          "%d after the last", RECONNECTS, fds0, fds);
  /* The listener got one CONNECT: one comm, and nothing more to accept. */
  char copy[NCCL_NET_HANDLE_MAXSIZE];
  memcpy(copy, l.handle, sizeof copy);
  if (loop_connect(&l, copy, &sc, &rc)) return 1;
  int extra = 0;
  for (double end = drv_now() + 0.5; drv_now() < end;) {
    void *more = NULL;
    FAIL_IF(net->accept(l.lc, &more) != ncclSuccess, "accept failed");
    if (more) extra++, net->close_recv(more);
  }
  FAIL_IF(extra, "%d connects with copies of one handle: the listener accepted %d comms",
          RECONNECTS, 1 + extra);
  if (reg(&l, sc, l.sbuf, &smh) || reg(&l, rc, l.rbuf, &rmh) ||
      xfer(&l, sc, smh, rc, rmh, 6, NULL, NULL))
    return 1;
  FAIL_IF(net->dereg_mr(sc, smh) || net->dereg_mr(rc, rmh), "deregMr");
  FAIL_IF(net->close_send(sc) || net->close_recv(rc) || net->close_listen(l.lc), "close");
  return 0;
}

static int stale_scenario(int version, const char *scenario) {
  static const struct {
    const char *name;
    int (*fn)(loop_t *);
  } on_loop[] = {{"stale_req", stale_req}, {"double_close", double_close},
                 {"double_dereg", double_dereg}, {"stale_mh", stale_mh}};
  drv_net_t net;
  if (drv_load(NULL, version, &net)) return 1;
  int rc = -1;
  if (!strcmp(scenario, "reconnect")) rc = reconnect(&net);
  for (size_t i = 0; i < sizeof on_loop / sizeof on_loop[0]; i++) {
    if (strcmp(scenario, on_loop[i].name)) continue;
    static loop_t l; /* buffers: no stack this large */
    rc = loop_open(&net, &l) || on_loop[i].fn(&l);
    if (l.sc) net.close_send(l.sc);
    if (l.rc) net.close_recv(l.rc);
    if (l.lc) net.close_listen(l.lc);
  }
  if (rc < 0) {
    fprintf(stderr, "no scenario %s\n", scenario);
    return 2;
  }
  printf("hostile_net %s v%d: %s\n", scenario, version, rc ? "FAIL" : "ok");
  return rc ? 1 : 0;
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
      fprintf(stderr,
              "usage: %s [-v 8..12] [-s calls|half_open|dead_listener|stale_req|double_close|double_dereg|"
              "stale_mh|reconnect|abandon|finalize|wrong_id|shm_stale|shm_addr|shm_dead_peer]\n",
              argv[0]);
      return 2;
    }
    version = drv_parse_int("-v", optarg, 8, 12);
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s'\n", argv[optind]); /* no -h here */
    return 2;
  }
  if (!strcmp(scenario, "half_open") || !strcmp(scenario, "dead_listener")) {
    int half = !strcmp(scenario, "half_open");
    drv_opts_t o = {.nranks = half ? 3 : 2, .version = version, .timeout_s = 120, .no_mesh = 1,
                    .shared_bytes = sizeof(half_open_t)};
    int rc = drv_run(&o, half ? half_open : dead_listener, NULL);
    printf("hostile_net %s v%d: %s\n", scenario, version, rc ? "FAIL" : "ok");
    return rc ? 1 : 0;
  }
  int conn = hostile_conn_scenario(version, scenario);
  if (conn != 2) return conn;
  if (strcmp(scenario, "calls")) return stale_scenario(version, scenario);
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
  bad += hostile_closed_listener(&net, lc, handle);
  drv_opts_t o = {.nranks = 2, .version = version, .timeout_s = 120};
  bad += drv_run(&o, rank_fn, NULL) != 0;
  printf("hostile_net v%d: %s\n", version, bad ? "FAIL" : "ok");
  return bad ? 1 : 0;
}
