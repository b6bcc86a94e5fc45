/* ABI harness: loads the built plugin through one exported ncclNetPlugin_vN
 * table and drives it as NCCL's net transport does, from forked ranks.
 *
 *   perseus_abi_harness -v VERSION -r RANKS -s SCENARIO [-m MAXBYTES] [-i ITERS] [-C]
 *
 * -C: every buffer is registered as NCCL_PTR_CUDA, and getProperties must
 * report ptrSupport HOST|CUDA (without it, HOST alone). With the fake-CUDA
 * plugin on a provider that registers CUDA memory (the model fabric with
 * PERSEUS_MODEL_HMEM=1), that runs the GPU-buffer path without a GPU.
 *
 * Scenarios (each verifies every byte it receives):
 *   sizes     every peer pair exchanges messages from 0 B to MAXBYTES
 *   many      ITERS small messages per pair with many tags, grouped receives
 *             posted before and after the sends
 *   backpressure  a pool of PERSEUS_NET_REQUESTS requests: NULL when full
 *   truncate  a message larger than the posted receive is an error, no overflow
 *   props     properties are sane for this ABI version
 *   foreign_mh  a handle registered on one comm, sent from on another (3 ranks)
 * Exit: 0 pass, 1 fail, 2 bad arguments (a rank count the scenario cannot
 * use included). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_driver.h"
#include "ps_fake_dmabuf.h"

typedef struct {
  size_t max_bytes;
  int iters;
} args_t;

static uint64_t msg_id(int src, int dst, int idx) {
  return ((uint64_t)src << 48) ^ ((uint64_t)dst << 32) ^ (uint64_t)idx;
}

static int cuda_buffers; /* -C */
static int dmabuf_buffers; /* -D: CUDA buffers by (fake) dma-buf, DMABUF offered */

/* Registers buf with comm as NCCL does before every transfer: under -D as
 * a dma-buf over the page-widened range (as the CUDA driver exports it),
 * the fd closed once registered. */
static int reg(drv_rank_t *r, void *comm, void *buf, size_t n, void **mh) {
  int type = cuda_buffers ? NCCL_PTR_CUDA : NCCL_PTR_HOST;
  if (!n) n = 1;
  if (!dmabuf_buffers) return r->net.reg_mr(comm, buf, n, type, mh) == ncclSuccess ? 0 : -1;
  uint64_t off;
  int fd = ps_fake_dmabuf_export(buf, n, &off);
  if (fd < 0) return -1;
  ncclResult_t rc = r->net.reg_mr_dmabuf(comm, buf, n, type, off, fd, mh);
  close(fd);
  return rc == ncclSuccess ? 0 : -1;
}

/* Sends one message to each peer and receives one from each, all in flight
 * at once; receives are posted before the sends on even ranks, after on odd. */
static int exchange(drv_rank_t *r, size_t n, int idx, int tag) {
  int P = r->nranks;
  char *sbuf[DRV_MAX_RANKS] = {0}, *rbuf[DRV_MAX_RANKS] = {0};
  void *smh[DRV_MAX_RANKS] = {0}, *rmh[DRV_MAX_RANKS] = {0};
  void *sreq[DRV_MAX_RANKS] = {0}, *rreq[DRV_MAX_RANKS] = {0};
  for (int p = 0; p < P; p++) {
    if (p == r->rank) continue;
    sbuf[p] = malloc(n + 1), rbuf[p] = malloc(n + 64);
    CHECK(sbuf[p] && rbuf[p], "out of memory");
    drv_fill(sbuf[p], n, msg_id(r->rank, p, idx));
    memset(rbuf[p], 0xee, n + 64);
    CHECK(!reg(r, r->send[p], sbuf[p], n, &smh[p]), "regMr send");
    CHECK(!reg(r, r->recv[p], rbuf[p], n + 64, &rmh[p]), "regMr recv");
  }
  for (int phase = 0; phase < 2; phase++) {
    int recv_phase = (r->rank & 1);
    for (int p = 0; p < P; p++) {
      if (p == r->rank) continue;
      double end = drv_now() + 30;
      if (phase == recv_phase) {
        void *d = rbuf[p];
        size_t sz = n + 64; /* larger than the message: test() must report n */
        int t = tag;
        while (!rreq[p]) {
          CHECK(r->net.irecv(r->recv[p], 1, &d, &sz, &t, &rmh[p], &rreq[p]) == ncclSuccess, "irecv");
          CHECK(drv_now() < end, "irecv never accepted");
        }
      } else {
        while (!sreq[p]) {
          CHECK(r->net.isend(r->send[p], sbuf[p], n, tag, smh[p], &sreq[p]) == ncclSuccess, "isend");
          CHECK(drv_now() < end, "isend never accepted");
        }
      }
    }
  }
  /* NCCL's proxy tests every outstanding request in turn; so do we. */
  int rsize[DRV_MAX_RANKS], left = 2 * (P - 1);
  double end = drv_now() + 60;
  while (left > 0) {
    CHECK(drv_now() < end, "exchange of %zu B stalled (%d requests left)", n, left);
    for (int p = 0; p < P; p++) {
      int done = 0;
      ncclResult_t rc;
      if (sreq[p]) {
        CHECK((rc = r->net.test(sreq[p], &done, NULL)) == ncclSuccess, "send of %zu B to %d: rc %d", n, p, rc);
        if (done) sreq[p] = NULL, left--;
      }
      if (rreq[p]) {
        CHECK((rc = r->net.test(rreq[p], &done, &rsize[p])) == ncclSuccess, "recv of %zu B from %d: rc %d", n, p, rc);
        if (done) rreq[p] = NULL, left--;
      }
    }
  }
  for (int p = 0; p < P; p++) {
    if (p == r->rank) continue;
    CHECK(rsize[p] == (int)n, "recv from %d reported %d bytes, sent %zu", p, rsize[p], n);
    long bad = drv_verify(rbuf[p], n, msg_id(p, r->rank, idx));
    CHECK(bad < 0, "recv of %zu B from %d: wrong byte at offset %ld", n, p, bad);
    for (int k = 0; k < 64; k++)
      CHECK((unsigned char)rbuf[p][n + k] == 0xee, "bytes past the message were written");
    r->net.dereg_mr(r->send[p], smh[p]);
    r->net.dereg_mr(r->recv[p], rmh[p]);
    free(sbuf[p]), free(rbuf[p]);
  }
  return 0;
}

static int scenario_sizes(drv_rank_t *r, void *arg) {
  args_t *a = arg;
  int idx = 0;
  for (size_t n = 0; n <= a->max_bytes; n = n ? n * 4 : 1) {
    if (exchange(r, n, idx, idx * 7 + 3)) return 1;
    if (n > 1 && n * 4 > a->max_bytes && n != a->max_bytes && exchange(r, a->max_bytes, ++idx, 5))
      return 1;
    /* odd sizes catch off-by-one and alignment mistakes */
    if (n >= 4) {
      idx++;
      if (exchange(r, n - 3, idx, idx)) return 1;
    }
    idx++;
  }
  return 0;
}

/* Many messages per pair with rotating tags; receives grouped n at a time as
 * NCCL's proxy does, each group matched by tags. */
static int scenario_many(drv_rank_t *r, void *arg) {
  args_t *a = arg;
  drv_props_t props;
  CHECK(r->net.get_props(r->dev, &props) == ncclSuccess, "getProperties");
  int G = props.max_recvs < 4 ? props.max_recvs : 4;
  int P = r->nranks, me = r->rank;
  int to = (me + 1) % P, from = (me + P - 1) % P;
  CHECK(P >= 2, "many needs 2 or more ranks"); /* main refuses fewer */
  enum { W = 8, SZ = 4096 };
  char *sbuf = malloc((size_t)W * G * SZ), *rbuf = malloc((size_t)W * G * SZ);
  void *smh, *rmh;
  CHECK(sbuf && rbuf, "oom");
  CHECK(!reg(r, r->send[to], sbuf, (size_t)W * G * SZ, &smh), "regMr");
  CHECK(!reg(r, r->recv[from], rbuf, (size_t)W * G * SZ, &rmh), "regMr");
  int groups = a->iters / G;
  void *sreq[W * 4] = {0}, *rreq[W] = {0};
  int sent = 0, posted = 0, recvd = 0, sdone = 0;
  int rslot_grp[W];
  double end = drv_now() + 120;
  while (recvd < groups || sdone < groups * G) {
    CHECK(drv_now() < end, "stalled: sent %d posted %d recvd %d", sent, posted, recvd);
    /* receiver: keep up to W groups posted; late ranks post after the sender started */
    for (int s = 0; s < W && posted < groups; s++) {
      if (rreq[s]) continue;
      if ((me & 1) && posted > sent / G + 1) break; /* odd ranks lag behind the sender */
      void *d[8], *mh[8];
      size_t sz[8];
      int tags[8];
      for (int k = 0; k < G; k++) {
        d[k] = rbuf + ((size_t)s * G + k) * SZ, sz[k] = SZ, mh[k] = rmh;
        tags[k] = (posted * G + k) % 97 + 1;
      }
      CHECK(r->net.irecv(r->recv[from], G, d, sz, tags, mh, &rreq[s]) == ncclSuccess, "irecv");
      if (!rreq[s]) break;
      rslot_grp[s] = posted++;
    }
    /* sender: a group's messages go out in reverse order: tags match them, not order */
    while (sent < groups * G && sent < (recvd + W) * G) {
      int g = sent / G, k = G - 1 - sent % G, m = g * G + k, slot = m % (W * G);
      if (sreq[slot]) break;
      char *b = sbuf + (size_t)slot * SZ;
      size_t len = 1 + (size_t)(m * 131) % SZ;
      drv_fill(b, len, msg_id(me, to, m));
      CHECK(r->net.isend(r->send[to], b, len, m % 97 + 1, smh, &sreq[slot]) == ncclSuccess, "isend");
      if (!sreq[slot]) break;
      sent++;
    }
    for (int s = 0; s < W * G; s++) {
      int done = 0;
      if (!sreq[s]) continue;
      CHECK(r->net.test(sreq[s], &done, NULL) == ncclSuccess, "test send");
      if (done) sreq[s] = NULL, sdone++;
    }
    for (int s = 0; s < W; s++) {
      int done = 0, sizes[8];
      if (!rreq[s]) continue;
      CHECK(r->net.test(rreq[s], &done, sizes) == ncclSuccess, "test recv");
      if (!done) continue;
      for (int k = 0; k < G; k++) {
        int m = rslot_grp[s] * G + k;
        size_t len = 1 + (size_t)(m * 131) % SZ;
        CHECK(sizes[k] == (int)len, "msg %d: size %d expected %zu", m, sizes[k], len);
        long bad = drv_verify(rbuf + ((size_t)s * G + k) * SZ, len, msg_id(from, me, m));
        CHECK(bad < 0, "msg %d from %d: wrong byte at %ld", m, from, bad);
      }
      rreq[s] = NULL, recvd++;
    }
  }
  r->net.dereg_mr(r->send[to], smh);
  r->net.dereg_mr(r->recv[from], rmh);
  free(sbuf), free(rbuf);
  return drv_barrier(r, 60);
}

/* With a pool of PERSEUS_NET_REQUESTS (set small by the test), isend must
 * hand back NULL once the pool is exhausted, and recover as requests finish. */
static int scenario_backpressure(drv_rank_t *r, void *arg) {
  (void)arg;
  CHECK(r->nranks == 2, "backpressure needs 2 ranks"); /* main refuses others */
  int peer = 1 - r->rank;
  const char *v = getenv("PERSEUS_NET_REQUESTS");
  int pool = v ? atoi(v) : 64;
  enum { N = 64, SZ = 256 };
  static char buf[N][SZ];
  void *mh, *req[N] = {0};
  CHECK(pool < N, "set PERSEUS_NET_REQUESTS below %d for this scenario", N);
  if (r->rank == 0) {
    CHECK(!reg(r, r->send[peer], buf, sizeof buf, &mh), "regMr");
    int got = 0;
    for (int i = 0; i < N; i++) drv_fill(buf[i], SZ, (uint64_t)i);
    for (int i = 0; i < N; i++) {
      CHECK(r->net.isend(r->send[peer], buf[i], SZ, i, mh, &req[i]) == ncclSuccess, "isend");
      if (!req[i]) break;
      got++;
    }
    CHECK(got == pool, "pool of %d gave %d requests before backpressure", pool, got);
    int next = got;
    double end = drv_now() + 60;
    for (int done_all = 0; !done_all;) {
      CHECK(drv_now() < end, "backpressure never released");
      done_all = 1;
      for (int i = 0; i < N; i++) {
        int done = 0;
        if (!req[i]) continue;
        CHECK(r->net.test(req[i], &done, NULL) == ncclSuccess, "test");
        if (done) req[i] = NULL;
        else done_all = 0;
      }
      while (next < N) { /* refill as the pool frees up */
        CHECK(r->net.isend(r->send[peer], buf[next], SZ, next, mh, &req[next]) == ncclSuccess, "isend");
        if (!req[next]) break;
        next++, done_all = 0;
      }
      if (next < N) done_all = 0;
    }
    r->net.dereg_mr(r->send[peer], mh);
  } else {
    CHECK(!reg(r, r->recv[peer], buf, sizeof buf, &mh), "regMr");
    for (int i = 0; i < N; i++) {
      void *d = buf[i];
      size_t sz = SZ;
      int t = i, sizes[1];
      while (!req[i]) CHECK(r->net.irecv(r->recv[peer], 1, &d, &sz, &t, &mh, &req[i]) == ncclSuccess, "irecv");
      CHECK(!drv_wait(r, req[i], sizes, 60, NULL), "recv %d", i);
      CHECK(drv_verify(buf[i], SZ, (uint64_t)i) < 0, "recv %d corrupted", i);
    }
    r->net.dereg_mr(r->recv[peer], mh);
  }
  return drv_barrier(r, 60);
}

/* A message larger than the posted receive: an error on the receiver, and
 * not one byte written past the receive buffer. */
static int scenario_truncate(drv_rank_t *r, void *arg) {
  (void)arg;
  CHECK(r->nranks == 2, "truncate needs 2 ranks"); /* main refuses others */
  int peer = 1 - r->rank;
  enum { SEND = 8192, POST = 1000 };
  static char buf[SEND + 256];
  void *mh, *req = NULL;
  if (r->rank == 0) {
    drv_fill(buf, SEND, 7);
    CHECK(!reg(r, r->send[peer], buf, SEND, &mh), "regMr");
    while (!req) CHECK(r->net.isend(r->send[peer], buf, SEND, 1, mh, &req) == ncclSuccess, "isend");
    drv_wait(r, req, NULL, 10, NULL); /* may fail or succeed: the receiver decides */
  } else {
    memset(buf, 0x5a, sizeof buf);
    CHECK(!reg(r, r->recv[peer], buf, POST, &mh), "regMr");
    void *d = buf;
    size_t sz = POST;
    int t = 1;
    ncclResult_t rc = ncclSuccess;
    while (!req) CHECK(r->net.irecv(r->recv[peer], 1, &d, &sz, &t, &mh, &req) == ncclSuccess, "irecv");
    CHECK(drv_wait(r, req, NULL, 20, &rc) != 0 && rc != ncclInProgress,
          "oversized message was not reported as an error (rc %d)", rc);
    for (size_t i = POST; i < sizeof buf; i++)
      CHECK((unsigned char)buf[i] == 0x5a, "byte %zu past the receive buffer was written", i);
  }
  drv_barrier(r, 30);
  return 0;
}

/* Rank 0 registers a buffer with its comm to rank 1 and sends from it on
 * its comm to rank 2. Where registrations are bound to an endpoint
 * (regIsGlobal 0, FI_MR_ENDPOINT) isend must refuse the handle; where they
 * are global the message must arrive whole. */
static int scenario_foreign_mh(drv_rank_t *r, void *arg) {
  (void)arg;
  enum { SZ = 4096 };
  static char buf[SZ];
  drv_props_t p;
  CHECK(r->nranks == 3, "foreign_mh needs 3 ranks");
  CHECK(r->net.get_props(r->dev, &p) == ncclSuccess, "getProperties");
  void *mh = NULL, *req = NULL;
  ncclResult_t rc = ncclSuccess;
  if (r->rank == 0) {
    drv_fill(buf, SZ, 42);
    CHECK(!reg(r, r->send[1], buf, SZ, &mh), "regMr");
    rc = r->net.isend(r->send[2], buf, SZ, 7, mh, &req);
    if (!p.reg_is_global) {
      CHECK(rc == ncclInvalidArgument && !req, "isend with another comm's bound handle: rc %d, "
            "request %p, expected ncclInvalidArgument", rc, req);
      printf("foreign_mh: refused (regIsGlobal 0)\n");
    } else {
      CHECK(rc == ncclSuccess && !drv_wait(r, req, NULL, 60, &rc), "isend: rc %d", rc);
    }
    r->net.dereg_mr(r->send[1], mh);
  } else if (r->rank == 2 && p.reg_is_global) {
    CHECK(!reg(r, r->recv[0], buf, SZ, &mh), "regMr");
    void *data = buf;
    size_t size = SZ;
    int tag = 7;
    do {
      CHECK(r->net.irecv(r->recv[0], 1, &data, &size, &tag, &mh, &req) == ncclSuccess, "irecv");
    } while (!req);
    CHECK(!drv_wait(r, req, NULL, 60, &rc), "irecv: rc %d", rc);
    CHECK(drv_verify(buf, SZ, 42) < 0, "the message arrived wrong");
    r->net.dereg_mr(r->recv[0], mh);
  }
  return drv_barrier(r, 60);
}

static int scenario_props(drv_rank_t *r, void *arg) {
  (void)arg;
  int n = 0;
  drv_props_t p;
  CHECK(r->net.devices(&n) == ncclSuccess && n >= 1, "devices");
  CHECK(r->net.get_props(0, &p) == ncclSuccess, "getProperties");
  CHECK(!strcmp(r->net.name, "Perseus"), "plugin name '%s', expected 'Perseus'", r->net.name);
  int want = NCCL_PTR_HOST | (cuda_buffers ? NCCL_PTR_CUDA : 0) | (dmabuf_buffers ? NCCL_PTR_DMABUF : 0);
  CHECK(p.ptr_support == want, "ptrSupport %d, expected %d", p.ptr_support, want);
  CHECK(p.max_recvs >= 1 && p.max_recvs <= 8, "maxRecvs %d", p.max_recvs);
  CHECK(p.speed > 0 && p.max_comms > 0, "speed %d maxComms %d", p.speed, p.max_comms);
  CHECK(p.max_p2p_bytes >= (1u << 20), "maxP2pBytes %zu", p.max_p2p_bytes);
  CHECK(strchr(p.name, '/') != NULL, "device name '%s'", p.name);
  CHECK(r->net.get_props(n, &p) == ncclInvalidArgument, "device %d out of range accepted", n);
  return 0;
}

/* min_ranks..max_ranks: the -r a scenario tests something with (below 2
 * there is no peer to exchange with; the pairwise ones need exactly 2). */
static const struct {
  const char *name;
  drv_rank_fn fn;
  int min_ranks, max_ranks;
} scenarios[] = {
    {"sizes", scenario_sizes, 2, DRV_MAX_RANKS},
    {"many", scenario_many, 2, DRV_MAX_RANKS},
    {"backpressure", scenario_backpressure, 2, 2},
    {"truncate", scenario_truncate, 2, 2},
    {"props", scenario_props, 1, DRV_MAX_RANKS},
    {"foreign_mh", scenario_foreign_mh, 3, 3},
};

int main(int argc, char **argv) {
  drv_opts_t o = {.nranks = 2, .version = 12, .timeout_s = 300};
  args_t a = {.max_bytes = 64u << 20, .iters = 2000};
  const char *scen = "sizes";
  int c;
  while ((c = getopt(argc, argv, "v:r:s:m:i:p:CDh")) != -1) {
    switch (c) {
      case 'v': o.version = drv_parse_int("-v", optarg, 8, 12); break;
      case 'r': o.nranks = drv_parse_int("-r", optarg, 1, DRV_MAX_RANKS); break;
      case 's': scen = optarg; break;
      case 'm': a.max_bytes = drv_parse_size("-m", optarg, 1, (size_t)1 << 32); break;
      case 'i': a.iters = drv_parse_int("-i", optarg, 1, 1 << 24); break;
      case 'p': o.plugin = drv_parse_plugin("-p", optarg); break;
      case 'C': cuda_buffers = 1; break;
      case 'D': cuda_buffers = dmabuf_buffers = 1; break;
      default:
        fprintf(stderr, "usage: %s -v 8..12 -r RANKS -s sizes|many|backpressure|truncate|props|foreign_mh "
                        "[-m MAXBYTES] [-i ITERS] [-p PLUGIN] [-C: CUDA buffers] [-D: CUDA buffers by dma-buf]\n", argv[0]);
        return c == 'h' ? 0 : 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++) {
    if (strcmp(scen, scenarios[i].name)) continue;
    /* refused here, before forking: a scenario run at a rank count it
     * cannot use would exchange nothing and still say ok */
    int lo = scenarios[i].min_ranks, hi = scenarios[i].max_ranks;
    if (o.nranks < lo || o.nranks > hi) {
      if (lo == hi)
        fprintf(stderr, "%s needs %d ranks (-r %d), got -r %d\n", scen, lo, lo, o.nranks);
      else
        fprintf(stderr, "%s needs %d to %d ranks (-r %d..%d), got -r %d\n", scen, lo, hi, lo, hi,
                o.nranks);
      return 2;
    }
    double t0 = drv_now();
    int rc = drv_run(&o, scenarios[i].fn, &a);
    printf("%s v%d ranks=%d provider=%s: %s (%.2f s)\n", scen, o.version, o.nranks,
           getenv("PERSEUS_PROVIDER") ? getenv("PERSEUS_PROVIDER") : "auto", rc ? "FAIL" : "ok",
           drv_now() - t0);
    return rc ? 1 : 0;
  }
  fprintf(stderr, "unknown scenario '%s' (expected one of", scen);
  for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++)
    fprintf(stderr, "%s %s", i ? "," : "", scenarios[i].name);
  fprintf(stderr, ")\n");
  return 2;
}
