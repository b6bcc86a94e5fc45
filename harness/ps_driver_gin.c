/* dlopen + per-version adapters for the one-sided tables. The call
 * sequence is NCCL's: init, devices, getProperties; listen, allgather of
 * the handles, connect, closeListen; createContext (v13/v14); collective
 * registration on the collComm; operations on the collComm (v11/v12) or
 * the context (v13/v14); test on the collComm in every version. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_driver_gin.h"
#include "ps_driver_int.h"
#include "ps_gin_abi.h"

/* One table and one connection per process (each rank is a process). */
static const void *tbl;
static int ver;            /* 11, 12, 13 (ncclGin_v13 == ncclRma_v13), 14 */
static void *init_ctx;     /* from init */
static void *coll_comm;    /* from connect */
static void *gin_ctx;      /* from createContext (v13/v14) */
static int conn_index;     /* connectionId (v12) / context index (v13/v14) */

#define T11 ((const ncclGin_v11_t *)tbl)
#define T12 ((const ncclGin_v12_t *)tbl)
#define T13 ((const ncclGin_v13_t *)tbl)
#define T14 ((const ncclRma_v14_t *)tbl)

void drv_gin_set_index(int index) { conn_index = index; }

/* The one-sided tables a test can load, by the name -a gives. */
static const struct {
  const char *abi, *sym;
  int ver;
} abis[] = {{"gin11", "ncclGinPlugin_v11", 11}, {"gin12", "ncclGinPlugin_v12", 12},
            {"gin13", "ncclGinPlugin_v13", 13}, {"rma13", "ncclRmaPlugin_v13", 13},
            {"rma14", "ncclRmaPlugin_v14", 14}};
#define ABI_NAMES "gin11, gin12, gin13, rma13 or rma14"

static int abi_index(const char *abi) {
  for (int i = 0; i < (int)(sizeof abis / sizeof abis[0]); i++)
    if (abi && !strcmp(abi, abis[i].abi)) return i;
  return -1;
}

const char *drv_gin_parse_abi(const char *arg) {
  if (abi_index(arg) < 0) { /* before any rank starts, not in each */
    fprintf(stderr, "-a '%s': expected %s\n", arg, ABI_NAMES);
    exit(2);
  }
  return arg;
}

int drv_gin_opt(int opt, const char *arg, const char **abi, const char **plugin,
                const char **scenario, int *nranks) {
  switch (opt) {
  case 'a': *abi = drv_gin_parse_abi(arg); return 1;
  case 'p': *plugin = drv_parse_plugin("-p", arg); return 1;
  case 's': *scenario = arg; return 1;
  case 'r': *nranks = drv_parse_int("-r", arg, 1, DRV_MAX_RANKS); return 1; /* each test bounds it further */
  default: return 0;
  }
}

/* What NCCL passes where the table wants the collComm: the adapters take the
 * context for v13/v14, so map it back. */
static void *cc(void *coll) { return (gin_ctx && coll == gin_ctx) ? coll_comm : coll; }

/* NCCL's GIN proxy carries a window's ginHandle to the GPU and back in a
 * 63-bit field of its descriptors (the top bit is the descriptor's flag:
 * "63 bit VAs", gin_proxy_device_host_common.h, 2.28-2.30): a handle with
 * bit 63 set would come back to iput changed. */
static ncclResult_t fits_descriptor(ncclResult_t rc, void *const *mh) {
  if (rc == ncclSuccess && ((uint64_t)(uintptr_t)*mh >> 63)) {
    fprintf(stderr, "regMrSym: handle %p has bit 63 set: NCCL's GIN proxy descriptors carry 63 bits\n",
            *mh);
    return ncclInternalError;
  }
  return rc;
}

/* NCCL hands the ginHandle to operations and the mhandle to deregMrSym;
 * the driver hands out one, so they must be the same. */
static ncclResult_t one_handle(ncclResult_t rc, void **mh, void *const *gh) {
  if (rc == ncclSuccess && *mh != *gh) {
    fprintf(stderr, "regMrSym: mhandle %p and ginHandle %p differ\n", *mh, *gh);
    return ncclInternalError;
  }
  return fits_descriptor(rc, mh);
}

#define REG_GH(v)                                                                          \
  static ncclResult_t reg_v##v(void *c, void *d, size_t s, int t, uint64_t f, void **mh) { \
    void *gh = NULL;                                                                       \
    return one_handle(T##v->regMrSym(cc(c), d, s, t, f, mh, &gh), mh, &gh);                 \
  }                                                                                        \
  static ncclResult_t regdb_v##v(void *c, void *d, size_t s, int t, uint64_t o, int fd,    \
                                 uint64_t f, void **mh) {                                  \
    void *gh = NULL;                                                                       \
    return one_handle(T##v->regMrSymDmaBuf(cc(c), d, s, t, o, fd, f, mh, &gh), mh, &gh);    \
  }
REG_GH(11)
REG_GH(12)
REG_GH(13)
static ncclResult_t reg_v14(void *c, void *d, size_t s, int t, uint64_t f, void **mh) {
  return fits_descriptor(T14->regMrSym(cc(c), d, s, t, f, mh), mh); /* 2.30: ginHandle = mhandle */
}
static ncclResult_t regdb_v14(void *c, void *d, size_t s, int t, uint64_t o, int fd, uint64_t f,
                              void **mh) {
  return fits_descriptor(T14->regMrSymDmaBuf(cc(c), d, s, t, o, fd, f, mh), mh);
}

/* Fields whose shape every version shares (the first argument differs). */
#define SAME(v, prog)                                                                        \
  static ncclResult_t dereg_v##v(void *c, void *mh) { return T##v->deregMrSym(cc(c), mh); } \
  static ncclResult_t test_v##v(void *c, void *r, int *d) { return T##v->test(cc(c), r, d); } \
  static ncclResult_t prog_v##v(void *c) { return T##v->prog(c); }                           \
  static ncclResult_t err_v##v(void *c, bool *e) { return T##v->queryLastError(c, e); }
SAME(11, ginProgress)
SAME(12, ginProgress)
SAME(13, ginProgress)
SAME(14, rmaProgress)

static ncclResult_t put_v11(void *c, uint64_t so, void *smh, size_t n, uint64_t dof, void *dmh,
                            uint32_t rank, void **req) {
  return T11->iput(c, so, smh, n, dof, dmh, rank, req);
}
static ncclResult_t put_v12(void *c, uint64_t so, void *smh, size_t n, uint64_t dof, void *dmh,
                            uint32_t rank, void **req) {
  return T12->iput(c, so, smh, n, dof, dmh, rank, conn_index, req);
}
static ncclResult_t put_v13(void *c, uint64_t so, void *smh, size_t n, uint64_t dof, void *dmh,
                            uint32_t rank, void **req) {
  return T13->iput(c, conn_index, so, smh, n, dof, dmh, rank, req);
}
static ncclResult_t put_v14(void *c, uint64_t so, void *smh, size_t n, uint64_t dof, void *dmh,
                            uint32_t rank, void **req) {
  return T14->iput(c, conn_index, so, smh, n, dof, dmh, rank, req);
}

#define SIG_ARGS                                                                             \
  void *c, uint64_t so, void *smh, size_t n, uint64_t dof, void *dmh, uint32_t rank,         \
      uint64_t sgo, void *sgmh, uint64_t val, uint32_t op, void **req
static ncclResult_t sig_v11(SIG_ARGS) {
  return T11->iputSignal(c, so, smh, n, dof, dmh, rank, sgo, sgmh, val, op, req);
}
static ncclResult_t sig_v12(SIG_ARGS) {
  return T12->iputSignal(c, so, smh, n, dof, dmh, rank, sgo, sgmh, val, op, conn_index, req);
}
static ncclResult_t sig_v13(SIG_ARGS) {
  return T13->iputSignal(c, conn_index, so, smh, n, dof, dmh, rank, sgo, sgmh, val, op, req);
}
/* NCCL 2.30's RMA proxy asks for strong signals; the invariant needs them. */
static ncclResult_t sig_v14(SIG_ARGS) {
  return T14->iputSignal(c, conn_index, so, smh, n, dof, dmh, rank, sgo, sgmh, val, op, true, req);
}

#define GET_FLUSH(v)                                                                        \
  static ncclResult_t get_v##v(void *c, uint64_t ro, void *rmh, size_t n, uint64_t lo,      \
                               void *lmh, uint32_t rank, void **req) {                      \
    return T##v->iget(c, conn_index, ro, rmh, n, lo, lmh, rank, req);                       \
  }                                                                                         \
  static ncclResult_t flush_v##v(void *c, void *mh, uint32_t rank, void **req) {            \
    return T##v->iflush(c, conn_index, mh, rank, req);                                      \
  }
GET_FLUSH(13)
GET_FLUSH(14)

#define FILL(v)                                                                             \
  do {                                                                                      \
    out->name = T##v->name, out->reg_sym = reg_v##v, out->dereg_sym = dereg_v##v;           \
    out->reg_sym_dmabuf = regdb_v##v;                                                       \
    out->iput = put_v##v, out->iput_signal = sig_v##v, out->test = test_v##v;               \
    out->progress = prog_v##v, out->last_error = err_v##v;                                  \
  } while (0)

/* init, devices, getProperties: the fields are in the same place in every
 * table but their types differ, so each version calls its own. */
#define INIT_PROPS(v, props_t)                                                              \
  do {                                                                                      \
    props_t p;                                                                              \
    memset(&p, 0xa5, sizeof p);                                                             \
    if ((rc = T##v->init(&init_ctx, 0x1234, drv_logger)) == ncclSuccess &&                  \
        (rc = T##v->devices(&ndev)) == ncclSuccess && ndev > 0 &&                           \
        (rc = T##v->getProperties(0, &p)) == ncclSuccess)                                   \
      out->net_device_type = (int)p.netDeviceType, out->ptr_support = p.ptrSupport,         \
      out->max_recvs = p.maxRecvs;                                                          \
  } while (0)

int drv_gin_load(const char *path, const char *abi, drv_gin_t *out) {
  int k = abi_index(abi);
  if (k < 0) {
    fprintf(stderr, "no one-sided ABI '%s' (%s)\n", abi ? abi : "", ABI_NAMES);
    return -1;
  }
  void *lib = drv_open_plugin(path, &path);
  if (!lib) return -1;
  tbl = dlsym(lib, abis[k].sym);
  if (!tbl) {
    fprintf(stderr, "%s does not export %s\n", path, abis[k].sym);
    return -1;
  }
  memset(out, 0, sizeof *out);
  snprintf(out->abi, sizeof out->abi, "%s", abi);
  ver = abis[k].ver;
  out->net_device_type = -1;
  ncclResult_t rc = ncclSuccess;
  int ndev = 0;
  switch (ver) {
    case 11: FILL(11); INIT_PROPS(11, ps_props_v11_t); break;
    case 12: FILL(12); INIT_PROPS(12, ps_props_v11_t); break;
    case 13: FILL(13); INIT_PROPS(13, ps_props_v12_t); out->iget = get_v13, out->iflush = flush_v13; break;
    default: FILL(14); INIT_PROPS(14, ps_props_v12_t); out->iget = get_v14, out->iflush = flush_v14; break;
  }
  if (rc != ncclSuccess || ndev < 1) {
    fprintf(stderr, "%s: init/devices/getProperties gave %d with %d devices\n", abis[k].sym, rc,
            ndev);
    return -1;
  }
  out->peer_stats = (perseus_rma_peer_stats_fn)dlsym(lib, "perseus_rma_peer_stats");
  out->ordering = (perseus_rma_ordering_fn)dlsym(lib, "perseus_rma_ordering");
  return 0;
}

size_t drv_gin_shared_bytes(int nranks) { return (size_t)nranks * NCCL_NET_HANDLE_MAXSIZE; }

ncclResult_t drv_gin_connect(drv_rank_t *r, drv_gin_t *g, void **coll) {
  (void)g;
  unsigned char(*handles)[NCCL_NET_HANDLE_MAXSIZE] = r->user;
  void *hp[64], *lc = NULL;
  int P = r->nranks, me = r->rank;
  if (P > 64) return ncclInvalidArgument;
  *coll = coll_comm = gin_ctx = NULL;
  /* listen: same argument list in every version */
  ncclResult_t rc = T11->listen(init_ctx, r->dev, handles[me], &lc);
  if (rc != ncclSuccess) return rc;
  if (drv_barrier(r, 60)) {
    T11->closeListen(lc);
    return ncclSystemError;
  }
  for (int p = 0; p < P; p++) hp[p] = handles[p];
  if (ver == 12)
    rc = T12->connect(init_ctx, hp, P, me, DRV_GIN_NCONN, 0, lc, &coll_comm);
  else /* v11, v13 and v14 connect alike */
    rc = T11->connect(init_ctx, hp, P, me, lc, &coll_comm);
  ncclResult_t crc = T11->closeListen(lc); /* NCCL closes it right after connect */
  if (rc == ncclSuccess) rc = crc;
  if (rc == ncclSuccess && ver == 13) {
    ps_gin_config_v13_t cfg = {.nSignals = 0, .nCounters = 0, .nContexts = DRV_GIN_NCONN,
                               .queueDepth = 0, .trafficClass = -1};
    ps_nccl_dev_handle_t *dh = NULL;
    rc = T13->createContext(coll_comm, &cfg, &gin_ctx, &dh);
  } else if (rc == ncclSuccess && ver == 14) {
    ps_rma_config_v14_t cfg = {.nContexts = DRV_GIN_NCONN, .trafficClass = -1, .rankStride = 1};
    rc = T14->createContext(coll_comm, &cfg, &gin_ctx);
  }
  if (rc == ncclSuccess) *coll = ver >= 13 ? gin_ctx : coll_comm;
  return rc;
}

ncclResult_t drv_gin_close(drv_gin_t *g, void *coll) {
  (void)g;
  if (coll && coll != coll_comm && coll != gin_ctx) {
    fprintf(stderr, "drv_gin_close: %p is not what drv_gin_connect made\n", coll);
    return ncclInvalidArgument;
  }
  ncclResult_t rc = ncclSuccess, r2;
  /* destroyContext and closeColl sit at the same place in every table */
  if (gin_ctx && (r2 = T13->destroyContext(gin_ctx)) != ncclSuccess) rc = r2;
  if (coll_comm && (r2 = T13->closeColl(coll_comm)) != ncclSuccess && !rc) rc = r2;
  if (init_ctx) { /* finalize is last: its place depends on the version */
    r2 = ver == 11 ? T11->finalize(init_ctx) : ver == 12 ? T12->finalize(init_ctx)
         : ver == 13 ? T13->finalize(init_ctx) : T14->finalize(init_ctx);
    if (r2 != ncclSuccess && !rc) rc = r2;
  }
  gin_ctx = coll_comm = init_ctx = NULL;
  return rc;
}

int drv_gin_wait(drv_gin_t *g, void *coll, void *req, double timeout_s, ncclResult_t *rcp) {
  double end = drv_now() + timeout_s;
  int done = 0;
  ncclResult_t rc = ncclSuccess;
  while (!done && (rc = g->test(coll, req, &done)) == ncclSuccess && drv_now() < end) continue;
  if (rcp) *rcp = rc;
  return done && rc == ncclSuccess ? 0 : -1;
}

typedef struct {
  drv_gin_t *g;
  void *coll;
} bar_t;

static int bar_poll(void *arg) {
  bar_t *b = arg;
  return b->g->progress(b->coll) != ncclSuccess;
}

int drv_gin_barrier(drv_rank_t *r, drv_gin_t *g, void *coll, int timeout_s) {
  bar_t b = {g, coll};
  return drv_barrier_poll(r, timeout_s, bar_poll, &b);
}
