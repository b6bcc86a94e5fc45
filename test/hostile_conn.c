/* Hostile connection setup, the scenarios of hostile_net.c that need more
 * than one connection or a dead process (its main hands them here):
 *   - (-s abandon, 2 ranks) rank 1 listens 1000 times; rank 0 starts one
 *     connect to each and never calls connect for it again. One connect()
 *     after PERSEUS_PEER_TIMEOUT_MS reaps them: rank 0's open fds are back
 *     within a few of where they were after the first connect, and its RSS
 *     within ABANDON_RSS_MB. The listener still accepts a live connector.
 *   - (-s finalize, v11/v12, 2 ranks) rank 0 starts a connect to each of
 *     rank 1's 24 listeners and never calls connect again, then finalizes its
 *     context: its open fds are back at once (no timeout to wait), and a
 *     second finalize is refused.
 *   - (-s wrong_id) connect with a listener's handle whose listen id was
 *     changed, while the listener accepts: an error within
 *     PERSEUS_PEER_TIMEOUT_MS + 1 s (the listener refuses it), never a
 *     NULL comm for ever; the listener goes on and accepts the right handle.
 *   - (-s accept_fails, 2 ranks) the listener cannot open the recv comm's
 *     endpoint for a CONNECT it took (no files left): the connector's
 *     connect fails within PERSEUS_PEER_TIMEOUT_MS + 1 s, refused through
 *     the listener, and the listener accepts the next connect.
 *   - (-s shm_stale, shm) a rank SIGKILLed while it listened leaves its
 *     endpoint segments in /dev/shm; a later process's init removes them,
 *     and keeps those of a live process and files that are not ours.
 *   - (-s shm_addr, shm) connect with the handle of a closed listener, of a
 *     SIGKILLed one, with address bytes that are not a NUL-terminated name,
 *     and with a name holding '/': each an error at once, not a crash or a
 *     NULL comm for ever.
 *   - (-s shm_dead_peer, shm, 2 ranks) a peer SIGKILLed while a receive and a
 *     16 MiB send to it are in flight: both fail within PERSEUS_KEEPALIVE_MS
 *     + PERSEUS_PEER_TIMEOUT_MS + 1 s (shm completes sends to a dead process,
 *     so no probe could tell; its pid does). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hostile_net.h"
#include "ps_driver.h"
#include "ps_wire.h"

static double peer_timeout_s(void) {
  const char *t = getenv("PERSEUS_PEER_TIMEOUT_MS");
  return (t ? atof(t) : 5000) / 1000;
}

static void nap_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Entries of /proc/self/fd (the directory's own fd and . and .. included):
 * compared before and after, so the constant part cancels. */
int hostile_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  if (!d) return -1;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

static long rss_mb(void) {
  long pages = 0, rss = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return -1;
  int ok = fscanf(f, "%ld %ld", &pages, &rss) == 2;
  fclose(f);
  return ok ? rss * sysconf(_SC_PAGESIZE) / (1 << 20) : -1;
}

/* Calls connect with `handle` (and accept on lc, if set) until connect
 * fails, returns a comm (*sc), or `limit_s` passes; *took gets the time.
 * Returns connect's result; *bad_listener is set when accept failed or
 * accepted a comm (nothing may be accepted). */
static ncclResult_t connect_until_error(drv_net_t *net, void *handle, void *lc, double limit_s,
                                        void **sc, double *took, int *bad_listener) {
  double t0 = drv_now();
  ncclResult_t rc = ncclSuccess;
  *sc = NULL;
  *bad_listener = 0;
  while (rc == ncclSuccess && !*sc && !*bad_listener && drv_now() - t0 < limit_s) {
    rc = net->connect(0, handle, sc);
    void *acc = NULL;
    *bad_listener = lc && net->accept(lc, &acc) != ncclSuccess;
    if (acc) {
      fprintf(stderr, "the listener accepted a comm for a connect that must fail\n");
      net->close_recv(acc);
      *bad_listener = 1;
    }
  }
  *took = drv_now() - t0;
  return rc;
}

/* --- a closed listener (tcp) --- */

/* Binds (without listening) the IP port a closed listener's handle names,
 * so that no other endpoint, of this process or of a test running beside
 * it, takes the port while connects to it are checked: a connect would then
 * reach that endpoint and wait for an ACCEPT that never comes. Returns the
 * socket, -1 where the address is not IP (nothing to hold), -2 where
 * another socket took the port already (the check would be void). */
static int hold_port(const void *handle) {
  const ps_handle_t *h = handle;
  struct sockaddr_storage ss;
  if (h->addrlen > sizeof ss) return -1;
  memset(&ss, 0, sizeof ss);
  memcpy(&ss, h->addr, h->addrlen);
  if (ss.ss_family != AF_INET && ss.ss_family != AF_INET6) return -1;
  int fd = socket(ss.ss_family, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (bind(fd, (struct sockaddr *)&ss, h->addrlen) == 0) return fd;
  int in_use = errno == EADDRINUSE;
  close(fd);
  return in_use ? -2 : -1;
}

#define CLOSED_LISTENER_TRIES 5

/* Closes lc; then connect with its handle must fail within
 * PERSEUS_PEER_TIMEOUT_MS + 1 s (the CONNECT is never delivered). Where
 * another socket took the port first, a new listener is tried. Returns the
 * number of failed checks. */
int hostile_closed_listener(drv_net_t *net, void *lc, void *handle) {
  double limit = peer_timeout_s() + 1;
  for (int tries = 1;; tries++) {
    if (net->close_listen(lc) != ncclSuccess) {
      fprintf(stderr, "closeListen failed\n");
      return 1;
    }
    int fd = hold_port(handle);
    if (fd == -2 && tries < CLOSED_LISTENER_TRIES) {
      printf("closed listener: its port was taken at once by another socket; a new listener\n");
      if (net->listen(0, handle, &lc) != ncclSuccess) {
        fprintf(stderr, "listen failed\n");
        return 1;
      }
      continue;
    }
    void *sc = NULL;
    double took = 0;
    int bad_listener = 0;
    ncclResult_t rc = connect_until_error(net, handle, NULL, limit + 5, &sc, &took, &bad_listener);
    if (fd >= 0) close(fd);
    if (rc != ncclSuccess && !sc && took <= limit) return 0;
    fprintf(stderr, "connect to a closed listener: rc %d, comm %p after %.2f s (limit %.2f s%s)\n",
            rc, sc, took, limit, fd == -2 ? "; another socket holds its port" : "");
    if (sc) net->close_send(sc);
    return 1;
  }
}

/* connect and accept until both have a comm */
static int connect_accept(drv_net_t *net, void *handle, void *lc, void **sc, void **rc) {
  double end = drv_now() + peer_timeout_s() + 30;
  *sc = *rc = NULL;
  while (!*sc || !*rc) {
    FAIL_IF(drv_now() > end, "connect/accept did not finish");
    if (!*sc) FAIL_IF(net->connect(0, handle, sc) != ncclSuccess, "connect failed");
    if (!*rc) FAIL_IF(net->accept(lc, rc) != ncclSuccess, "accept failed");
  }
  return 0;
}

/* --- abandon --- */

#define ABANDONED 1000
#define ABANDON_FD_SLACK 8
#define ABANDON_RSS_MB 64
/* AddressSanitizer holds freed memory in its quarantine: RSS says nothing there. */
#if defined(__SANITIZE_ADDRESS__)
#define ABANDON_RSS_CHECKED 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ABANDON_RSS_CHECKED 0
#endif
#endif
#ifndef ABANDON_RSS_CHECKED
#define ABANDON_RSS_CHECKED 1
#endif

typedef struct {
  char handles[ABANDONED][NCCL_NET_HANDLE_MAXSIZE];
  volatile int listening, connected, done;
} abandon_t;

/* Rank 1 of abandon and finalize: n listeners, their handles in a; kept
 * until rank 0 is done. With `accept` (abandon) listener 0 takes what
 * arrives meanwhile: the CONNECTs of reaped connects (their ACCEPTs find
 * nobody and are dropped) and then the live one. */
static int serve_listeners(drv_rank_t *r, abandon_t *a, int n, int accept, double end) {
  static void *lc[ABANDONED];
  for (int i = 0; i < n; i++)
    CHECK(r->net.listen(r->dev, a->handles[i], &lc[i]) == ncclSuccess, "listen %d", i);
  __atomic_store_n(&a->listening, 1, __ATOMIC_RELEASE);
  while (accept && !__atomic_load_n(&a->connected, __ATOMIC_ACQUIRE)) {
    void *rc = NULL;
    CHECK(drv_now() < end, "the live connector was never accepted");
    CHECK(r->net.accept(lc[0], &rc) == ncclSuccess, "accept failed");
    if (rc) CHECK(r->net.close_recv(rc) == ncclSuccess, "closeRecv");
  }
  while (!__atomic_load_n(&a->done, __ATOMIC_ACQUIRE)) CHECK(drv_now() < end, "rank 0 hung");
  for (int i = 0; i < n; i++)
    CHECK(r->net.close_listen(lc[i]) == ncclSuccess, "closeListen %d", i);
  return 0;
}

/* Rank 0: one connect started to each of rank 1's first n listeners, never
 * called again. *fds0 and *rss0: after the first; *peak: open fds after the
 * last. */
static int start_abandoned(drv_rank_t *r, abandon_t *a, int n, double end, int *fds0,
                           long *rss0, int *peak) {
  void *sc = NULL;
  while (!__atomic_load_n(&a->listening, __ATOMIC_ACQUIRE)) CHECK(drv_now() < end, "no listeners");
  for (int i = 0; i < n; i++) {
    CHECK(r->net.connect(r->dev, a->handles[i], &sc) == ncclSuccess && !sc, "connect %d", i);
    if (i == 0) *fds0 = hostile_open_fds(), *rss0 = rss_mb();
  }
  *peak = hostile_open_fds();
  return 0;
}

static int abandon_rank(drv_rank_t *r, void *arg) {
  abandon_t *a = r->user;
  double tmo = peer_timeout_s(), end = drv_now() + 100;
  (void)arg;
  if (r->rank == 1) return serve_listeners(r, a, ABANDONED, 1, end);
  void *sc = NULL;
  int fds0 = -1, fds_peak = -1;
  long rss0 = -1;
  while (!__atomic_load_n(&a->listening, __ATOMIC_ACQUIRE)) CHECK(drv_now() < end, "no listeners");
  double t0 = drv_now(); /* the connects alone */
  if (start_abandoned(r, a, ABANDONED, end, &fds0, &rss0, &fds_peak)) return 1;
  double started = drv_now() - t0;
  nap_ms((int)(tmo * 1000 * 1.5));
  /* The next connect reaps every connect left alone for PERSEUS_PEER_TIMEOUT_MS. */
  CHECK(r->net.connect(r->dev, a->handles[0], &sc) == ncclSuccess, "connect after the timeout");
  int fds = hostile_open_fds();
  long rss = rss_mb();
  printf("abandon: %d connects started in %.2f s; fds %d after the first, %d after the last, %d "
         "after one more connect past the timeout; RSS %ld -> %ld MB\n",
         ABANDONED, started, fds0, fds_peak, fds, rss0, rss);
  CHECK(fds <= fds0 + ABANDON_FD_SLACK, "%d abandoned connects: %d open fds after the first, %d "
        "after one more connect past PERSEUS_PEER_TIMEOUT_MS", ABANDONED, fds0, fds);
  CHECK(!ABANDON_RSS_CHECKED || rss <= rss0 + ABANDON_RSS_MB, "%d abandoned connects: RSS %ld MB after the first, %ld MB "
        "after one more connect past PERSEUS_PEER_TIMEOUT_MS", ABANDONED, rss0, rss);
  /* That last connect is live: it completes while rank 1 accepts. */
  while (!sc) {
    CHECK(drv_now() < end, "the live connect never completed");
    CHECK(r->net.connect(r->dev, a->handles[0], &sc) == ncclSuccess, "the live connect failed");
  }
  __atomic_store_n(&a->connected, 1, __ATOMIC_RELEASE);
  CHECK(r->net.close_send(sc) == ncclSuccess, "closeSend");
  __atomic_store_n(&a->done, 1, __ATOMIC_RELEASE);
  return 0;
}

/* --- finalize --- */

#define FIN_CONNECTS 24

static int finalize_rank(drv_rank_t *r, void *arg) {
  abandon_t *a = r->user;
  double end = drv_now() + 60;
  (void)arg;
  if (r->rank == 1) return serve_listeners(r, a, FIN_CONNECTS, 0, end);
  int fds0 = -1, peak = -1;
  long rss0;
  if (start_abandoned(r, a, FIN_CONNECTS, end, &fds0, &rss0, &peak)) return 1;
  double t0 = drv_now();
  CHECK(r->net.finalize() == ncclSuccess, "finalize");
  int fds = hostile_open_fds();
  printf("finalize: %d connects started; fds %d after the first, %d after the last, %d after "
         "finalize (%.3f s)\n", FIN_CONNECTS, fds0, peak, fds, drv_now() - t0);
  CHECK(peak > fds0 + ABANDON_FD_SLACK, "%d connects opened only %d fds: nothing to check",
        FIN_CONNECTS, peak - fds0);
  CHECK(fds <= fds0 + ABANDON_FD_SLACK, "finalize left %d of the %d fds of %d connects its "
        "context started and never completed", fds - fds0, peak - fds0, FIN_CONNECTS);
  /* a second finalize of the context is refused, not a second free */
  CHECK(r->net.finalize() == ncclInvalidArgument, "a second finalize was not refused");
  __atomic_store_n(&a->done, 1, __ATOMIC_RELEASE);
  return 0;
}

/* --- wrong_id --- */

static int wrong_id(drv_net_t *net) {
  char handle[NCCL_NET_HANDLE_MAXSIZE], bad[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = NULL, *sc = NULL, *rc = NULL;
  FAIL_IF(net->listen(0, handle, &lc) != ncclSuccess, "listen failed");
  memcpy(bad, handle, sizeof bad);
  ((ps_handle_t *)bad)->listen_id ^= 0x5a5a; /* a listener id that is not there */
  double limit = peer_timeout_s() + 1, took = 0;
  int bad_listener = 0;
  for (int round = 0; round < 2; round++) { /* and again: the listener still refuses */
    ncclResult_t res = connect_until_error(net, bad, lc, limit + 5, &sc, &took, &bad_listener);
    FAIL_IF(bad_listener, "accept failed or accepted after a CONNECT with a wrong listen id");
    FAIL_IF(res == ncclSuccess || sc || took > limit,
            "connect with a wrong listen id: rc %d, comm %p after %.2f s (limit %.2f s)", res, sc,
            took, limit);
  }
  if (connect_accept(net, handle, lc, &sc, &rc)) return 1;
  FAIL_IF(net->close_send(sc) || net->close_recv(rc) || net->close_listen(lc), "close");
  return 0;
}

/* --- shm --- */

/* A child process that loads the plugin and listens; its handle comes back
 * through handle. It then waits on the pipe *ctl: a byte there makes it
 * raise SIGKILL (shm_kill), the pipe's end makes it close and exit. Returns
 * its pid, or -1. */
static pid_t shm_listener(int version, char *handle, int *ctl) {
  int up[2], down[2];
  if (pipe(up) || pipe(down)) return -1;
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    drv_net_t net;
    void *lc = NULL;
    char h[NCCL_NET_HANDLE_MAXSIZE] = {0}, c;
    close(up[0]), close(down[1]);
    if (drv_load(NULL, version, &net) || net.listen(0, h, &lc) != ncclSuccess) _exit(1);
    if (write(up[1], h, sizeof h) != (ssize_t)sizeof h) _exit(1);
    if (read(down[0], &c, 1) == 1) raise(SIGKILL);
    net.close_listen(lc);
    _exit(0);
  }
  close(up[1]), close(down[0]);
  ssize_t n = read(up[0], handle, NCCL_NET_HANDLE_MAXSIZE);
  close(up[0]);
  *ctl = down[1];
  return n == NCCL_NET_HANDLE_MAXSIZE ? pid : -1;
}

static void shm_kill(pid_t pid, int ctl) {
  if (write(ctl, "k", 1) != 1) kill(pid, SIGKILL);
  close(ctl);
  waitpid(pid, NULL, 0);
}

static void shm_end(pid_t pid, int ctl) {
  close(ctl);
  waitpid(pid, NULL, 0);
}

/* The /dev/shm names of pid's endpoints (perseus_..._<pid>_...): how many. */
static int shm_segments(pid_t pid) {
  char mid[32];
  snprintf(mid, sizeof mid, "_%d_", (int)pid);
  DIR *d = opendir("/dev/shm");
  int n = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    n += !strncmp(e->d_name, "perseus_", 8) && strstr(e->d_name, mid);
  if (d) closedir(d);
  return n;
}

static int shm_stale(int version) {
  char hdead[NCCL_NET_HANDLE_MAXSIZE], hlive[NCCL_NET_HANDLE_MAXSIZE], stranger[64];
  int kdead = -1, klive = -1;
  pid_t dead = shm_listener(version, hdead, &kdead);
  pid_t live = shm_listener(version, hlive, &klive);
  FAIL_IF(dead < 0 || live < 0, "shm listener children failed");
  shm_kill(dead, kdead);
  int ndead = shm_segments(dead), nlive = shm_segments(live);
  FAIL_IF(ndead < 1 || nlive < 1, "no /dev/shm segment of the children's endpoints (%d, %d)",
          ndead, nlive);
  /* not ours: the dead pid in a name of another program's */
  snprintf(stranger, sizeof stranger, "/dev/shm/other_%d_0", (int)dead);
  FILE *f = fopen(stranger, "w");
  FAIL_IF(!f, "cannot create %s", stranger);
  fclose(f);
  drv_net_t net; /* this process's init */
  FAIL_IF(drv_load(NULL, version, &net), "load");
  int left = shm_segments(dead), kept = shm_segments(live);
  struct stat st;
  int stranger_kept = stat(stranger, &st) == 0;
  unlink(stranger);
  shm_end(live, klive);
  printf("shm_stale: the SIGKILLed rank's segments %d -> %d, the live rank's %d -> %d\n", ndead,
         left, nlive, kept);
  FAIL_IF(left, "%d of %d /dev/shm segments of SIGKILLed pid %d left after init", left, ndead,
          (int)dead);
  FAIL_IF(kept != nlive, "init removed %d segments of live pid %d", nlive - kept, (int)live);
  FAIL_IF(!stranger_kept, "init removed %s, which is not ours", stranger);
  return 0;
}

/* connect with handle h must fail within 1 s; accept on lc takes nothing */
static int shm_refused(drv_net_t *net, void *h, void *lc, const char *what) {
  void *sc = NULL;
  double took = 0;
  int bad_listener = 0;
  ncclResult_t rc = connect_until_error(net, h, lc, 3, &sc, &took, &bad_listener);
  FAIL_IF(bad_listener, "connect with %s: the listener failed or accepted", what);
  FAIL_IF(rc == ncclSuccess || sc || took > 1, "connect with %s: rc %d, comm %p after %.2f s", what,
          rc, sc, took);
  return 0;
}

static int shm_addr(int version) {
  char h[NCCL_NET_HANDLE_MAXSIZE], hdead[NCCL_NET_HANDLE_MAXSIZE];
  int kdead = -1;
  pid_t dead = shm_listener(version, hdead, &kdead);
  FAIL_IF(dead < 0, "shm listener child failed");
  drv_net_t net;
  FAIL_IF(drv_load(NULL, version, &net), "load");
  shm_kill(dead, kdead); /* after our init: its segments are still there */
  void *lc = NULL, *lc2 = NULL, *sc = NULL, *rc = NULL;
  FAIL_IF(net.listen(0, h, &lc) != ncclSuccess || net.close_listen(lc) != ncclSuccess, "listen");
  if (shm_refused(&net, h, NULL, "a closed listener's handle")) return 1;
  FAIL_IF(net.listen(0, h, &lc2) != ncclSuccess, "listen");
  if (shm_refused(&net, hdead, lc2, "the handle of a SIGKILLed listener")) return 1;
  ps_handle_t *p = (ps_handle_t *)h;
  ps_handle_t keep = *p;
  memset(p->addr, 'x', sizeof p->addr); /* no NUL in the address bytes */
  p->addrlen = sizeof p->addr;
  if (shm_refused(&net, h, lc2, "address bytes that hold no NUL")) return 1;
  *p = keep;
  snprintf((char *)p->addr, sizeof p->addr, "../../tmp/perseus_x");
  p->addrlen = (uint16_t)strlen((char *)p->addr) + 1;
  if (shm_refused(&net, h, lc2, "an address with '/'")) return 1;
  *p = keep;
  if (connect_accept(&net, h, lc2, &sc, &rc)) return 1; /* the right handle still works */
  FAIL_IF(net.close_send(sc) || net.close_recv(rc) || net.close_listen(lc2), "close");
  return 0;
}

/* Rank 1 dies by SIGKILL once both ranks have registered; rank 0 has a
 * receive and a 16 MiB send in flight to it, which both must fail. */
#define DEAD_PEER_SEND (16 << 20)

static int shm_dead_peer(drv_rank_t *r, void *arg) {
  (void)arg;
  const char *k = getenv("PERSEUS_KEEPALIVE_MS");
  double limit = (k ? atof(k) : 1000) / 1000 + peer_timeout_s() + 1;
  char *buf = calloc(1, DEAD_PEER_SEND), *rbuf = calloc(1, 4096);
  void *peer_s = r->send[1 - r->rank], *peer_r = r->recv[1 - r->rank], *smh = NULL, *rmh = NULL;
  CHECK(buf && rbuf, "out of memory");
  CHECK(r->net.reg_mr(peer_s, buf, DEAD_PEER_SEND, NCCL_PTR_HOST, &smh) == ncclSuccess &&
        r->net.reg_mr(peer_r, rbuf, 4096, NCCL_PTR_HOST, &rmh) == ncclSuccess, "regMr");
  drv_mark_killable(r, 1);
  CHECK(drv_barrier(r, 30) == 0, "barrier");
  if (r->rank == 1) raise(SIGKILL);
  void *sreq = NULL, *rreq = NULL, *data[1] = {rbuf}, *mhs[1] = {rmh};
  size_t sizes[1] = {4096};
  int tags[1] = {1}, sdone = 0, rdone = 0;
  double t0 = drv_now();
  ncclResult_t src = ncclSuccess, rrc = ncclSuccess;
  while (!sreq && src == ncclSuccess && drv_now() - t0 < limit)
    src = r->net.isend(peer_s, buf, DEAD_PEER_SEND, 1, smh, &sreq);
  while (!rreq && rrc == ncclSuccess && drv_now() - t0 < limit)
    rrc = r->net.irecv(peer_r, 1, data, sizes, tags, mhs, &rreq);
  while ((src == ncclSuccess && !sdone) || (rrc == ncclSuccess && !rdone)) {
    if (drv_now() - t0 > limit) break;
    if (src == ncclSuccess && !sdone) src = r->net.test(sreq, &sdone, NULL);
    if (rrc == ncclSuccess && !rdone) rrc = r->net.test(rreq, &rdone, NULL);
  }
  double took = drv_now() - t0;
  printf("shm_dead_peer: send %s, receive %s after %.2f s\n", src ? "failed" : "did not fail",
         rrc ? "failed" : "did not fail", took);
  CHECK(src != ncclSuccess && rrc != ncclSuccess && took <= limit,
        "a SIGKILLed shm peer: send rc %d done %d, receive rc %d done %d after %.2f s (limit %.2f s)",
        src, sdone, rrc, rdone, took, limit);
  return 0;
}

/* --- accept_fails --- */

typedef struct {
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  atomic_int listening, connect_sent, starved, refused, restored, done;
} accept_fails_t;

#define STARVE_FDS 1024

/* Rank 1 listens; rank 0's CONNECT lands; then rank 1 can open no more
 * files (every descriptor below its lowered limit taken), so its accept
 * cannot open the recv comm's endpoint. Rank 0's connect must then fail
 * within PERSEUS_PEER_TIMEOUT_MS + 1 s (refused through the listener), not
 * return a NULL comm for ever, and rank 1's accept goes on listening: with
 * the files back, rank 0's next connect is accepted. */
static int accept_fails(drv_rank_t *r, void *arg) {
  accept_fails_t *a = r->user;
  double limit = peer_timeout_s() + 1, end = drv_now() + 4 * limit + 30;
  (void)arg;
  if (r->rank == 1) {
    void *lc = NULL, *rc = NULL;
    static int filler[STARVE_FDS];
    int nfill = 0;
    struct rlimit keep, tight;
    CHECK(r->net.listen(r->dev, a->handle, &lc) == ncclSuccess, "listen");
    atomic_store(&a->listening, 1);
    while (!atomic_load(&a->connect_sent)) CHECK(drv_now() < end, "rank 0 never connected");
    CHECK(!getrlimit(RLIMIT_NOFILE, &keep), "getrlimit");
    tight = keep;
    if (tight.rlim_cur > STARVE_FDS) tight.rlim_cur = STARVE_FDS;
    CHECK(!setrlimit(RLIMIT_NOFILE, &tight), "setrlimit");
    while (nfill < STARVE_FDS && (filler[nfill] = open("/dev/null", O_RDONLY)) >= 0) nfill++;
    atomic_store(&a->starved, 1);
    while (!atomic_load(&a->refused)) {
      CHECK(drv_now() < end, "rank 0's connect never ended");
      CHECK(r->net.accept(lc, &rc) == ncclSuccess && !rc,
            "accept without files: it must keep listening and accept nothing");
    }
    while (nfill) close(filler[--nfill]);
    CHECK(!setrlimit(RLIMIT_NOFILE, &keep), "setrlimit back");
    atomic_store(&a->restored, 1);
    while (!rc) {
      CHECK(drv_now() < end, "the connect after the refusal was never accepted");
      CHECK(r->net.accept(lc, &rc) == ncclSuccess, "accept after the refusal failed");
    }
    while (!atomic_load(&a->done)) CHECK(drv_now() < end, "rank 0 never finished");
    CHECK(r->net.close_recv(rc) == ncclSuccess && r->net.close_listen(lc) == ncclSuccess, "close");
    return 0;
  }
  while (!atomic_load(&a->listening)) CHECK(drv_now() < end, "no listener");
  void *sc = NULL;
  for (double t = drv_now() + 0.3; drv_now() < t;) /* the CONNECT lands */
    CHECK(r->net.connect(r->dev, a->handle, &sc) == ncclSuccess && !sc,
          "connect before the listener accepted: it must wait");
  atomic_store(&a->connect_sent, 1);
  while (!atomic_load(&a->starved)) CHECK(drv_now() < end, "rank 1 never ran out of files");
  double t0 = drv_now(), took;
  ncclResult_t res = ncclSuccess;
  while (res == ncclSuccess && !sc && drv_now() - t0 < limit + 5)
    res = r->net.connect(r->dev, a->handle, &sc);
  took = drv_now() - t0;
  atomic_store(&a->refused, 1);
  CHECK(res != ncclSuccess && !sc && took <= limit,
        "connect to a listener that could not accept it: rc %d, comm %p after %.2f s (limit %.2f s)",
        res, sc, took, limit);
  while (!atomic_load(&a->restored)) CHECK(drv_now() < end, "rank 1 never got its files back");
  while (!sc) {
    CHECK(drv_now() < end, "the connect after the refusal never finished");
    CHECK(r->net.connect(r->dev, a->handle, &sc) == ncclSuccess, "connect after the refusal failed");
  }
  CHECK(r->net.close_send(sc) == ncclSuccess, "closeSend");
  atomic_store(&a->done, 1);
  return 0;
}

/* 2: no such scenario */
int hostile_conn_scenario(int version, const char *scenario) {
  int rc = 2;
  if (!strcmp(scenario, "abandon")) {
    /* rank 1's listeners take about 8 fds each on tcp;ofi_rxm */
    struct rlimit rl;
    if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      setrlimit(RLIMIT_NOFILE, &rl);
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) || rl.rlim_cur < 10 * ABANDONED) {
      printf("hostile_net abandon: skipped, %llu fds allowed, %d needed\n",
             (unsigned long long)rl.rlim_cur, 10 * ABANDONED);
      return 77;
    }
    drv_opts_t o = {.nranks = 2, .version = version, .timeout_s = 150, .no_mesh = 1,
                    .shared_bytes = sizeof(abandon_t)};
    rc = drv_run(&o, abandon_rank, NULL) != 0;
  } else if (!strcmp(scenario, "finalize")) {
    if (version < 11) {
      printf("hostile_net finalize v%d: skipped, the table has no finalize\n", version);
      return 77;
    }
    drv_opts_t o = {.nranks = 2, .version = version, .timeout_s = 90, .no_mesh = 1,
                    .shared_bytes = sizeof(abandon_t)};
    rc = drv_run(&o, finalize_rank, NULL) != 0;
  } else if (!strcmp(scenario, "accept_fails")) {
    drv_opts_t o = {.nranks = 2, .version = version, .timeout_s = 120, .no_mesh = 1,
                    .shared_bytes = sizeof(accept_fails_t)};
    rc = drv_run(&o, accept_fails, NULL) != 0;
  } else if (!strcmp(scenario, "shm_dead_peer")) {
    drv_opts_t o = {.nranks = 2, .version = version, .timeout_s = 60};
    rc = drv_run(&o, shm_dead_peer, NULL) != 0;
  } else if (!strcmp(scenario, "wrong_id") || !strcmp(scenario, "shm_stale") ||
             !strcmp(scenario, "shm_addr")) {
    drv_net_t net;
    if (scenario[0] == 'w') rc = drv_load(NULL, version, &net) || wrong_id(&net);
    else rc = scenario[4] == 's' ? shm_stale(version) : shm_addr(version);
  }
  if (rc == 2) return 2;
  printf("hostile_net %s v%d: %s\n", scenario, version, rc ? "FAIL" : "ok");
  return rc;
}
