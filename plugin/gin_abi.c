/* The exported one-sided tables: ncclGinPlugin_v11 (NCCL 2.28), _v12
 * (2.29), _v13 and ncclRmaPlugin_v13/_v14 (2.30). One engine (ps_rma.h)
 * serves them all; each entry validates and translates its version's
 * arguments, nothing more.
 *
 * What NCCL holds of ours is a handle of a table (ps_handle.h), never a
 * pointer, looked up on every call: a stale (closed, destroyed, finalized),
 * foreign or wrong-kind one is refused by name without touching the memory
 * it once named. Here: the init context (wrapping the net layer's), the
 * collComm (a gin_coll_t wrapping the engine's comm) and the ctx of
 * createContext (a gin_ctx_t naming its collComm and how many `context`
 * indexes NCCL may use). The engine's: listenComm, requests, and mhandle ==
 * ginHandle (NCCL puts the ginHandle into its descriptors and hands it back
 * to iput/iputSignal, so both are one). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "perseus/perseus_rma.h"
#include "ps_abi.h"
#include "ps_cuda.h"
#include "ps_fabric.h"
#include "ps_gin_abi.h"
#include "ps_gpumem.h"
#include "ps_handle.h"
#include "ps_log.h"
#include "ps_net.h"
#include "ps_rma.h"

/* Tags (ps_handle.h): distinct from the net tables' and the engine's. */
static ps_htab_t coll_tab = PS_HTAB_INIT(0x63, "one-sided collComm", "closed");
static ps_htab_t ctx_tab = PS_HTAB_INIT(0x78, "one-sided context", "destroyed");
static ps_htab_t init_tab = PS_HTAB_INIT(0x69, "one-sided init context", "finalized");

typedef struct gin_ctx gin_ctx_t;

typedef struct {
  uint32_t slot;   /* in coll_tab */
  int nconn;       /* v12: connections NCCL may name; 1 on other versions */
  void *eng;       /* the engine's collective comm */
  gin_ctx_t *ctxs; /* live contexts, cut loose when this comm closes */
} gin_coll_t;

struct gin_ctx {
  uint32_t slot;    /* in ctx_tab */
  int ncontexts;    /* valid `context` arguments: [0, ncontexts) */
  gin_coll_t *coll; /* NULL once its comm closed: operations are refused */
  gin_ctx_t *next;
};

typedef struct {
  uint32_t slot; /* in init_tab */
  void *net_ctx; /* ps_abi_init_ctx's */
} gin_init_t;

static gin_coll_t *as_coll(void *p, const char *fn) {
  gin_coll_t *c = ps_htab_get(&coll_tab, p);
  if (c) return c;
  if (ps_htab_get(&ctx_tab, p))
    PS_WARN("%s: %p is a context, where a collComm is expected", fn, p);
  else
    ps_htab_refused(&coll_tab, p, fn);
  return NULL;
}

/* test/progress/queryLastError: NCCL passes a collComm or a context
 * depending on the version (and 2.30 passes the collComm to test), so
 * either is taken. */
static gin_coll_t *any_coll(void *p, const char *fn) {
  gin_coll_t *c = ps_htab_get(&coll_tab, p);
  if (c) return c;
  gin_ctx_t *x = ps_htab_get(&ctx_tab, p);
  if (x && x->coll) return x->coll;
  if (x)
    PS_WARN("%s: context %p belongs to a collComm that was closed", fn, p);
  else if (((uint64_t)(uintptr_t)p >> 56) == ctx_tab.tag)
    ps_htab_refused(&ctx_tab, p, fn);
  else
    ps_htab_refused(&coll_tab, p, fn);
  return NULL;
}

/* v13/v14 operations: a live context and a context index inside it. */
static void *ctx_eng(void *p, int context, const char *fn) {
  gin_ctx_t *x = ps_htab_get(&ctx_tab, p);
  if (!x || !x->coll) {
    if (x)
      PS_WARN("%s: context %p belongs to a collComm that was closed", fn, p);
    else if (ps_htab_get(&coll_tab, p))
      PS_WARN("%s: %p is a collComm, where a context from createContext is expected", fn, p);
    else
      ps_htab_refused(&ctx_tab, p, fn);
    return NULL;
  }
  if (context < 0 || context >= x->ncontexts) {
    PS_WARN("%s: context index %d outside the %d the context was created with", fn, context,
            x->ncontexts);
    return NULL;
  }
  return x->coll->eng;
}

/* v12: every connection of a comm shares one per-peer order, which is
 * stronger than NCCL's per-connection order, so connectionId only has to
 * be one NCCL announced at connect. */
static void *conn_eng(void *coll, int conn, const char *fn) {
  gin_coll_t *c = as_coll(coll, fn);
  if (c && (conn < 0 || conn >= c->nconn)) {
    PS_WARN("%s: connectionId %d outside the %d connections of this comm", fn, conn, c->nconn);
    return NULL;
  }
  return c ? c->eng : NULL;
}

static void *coll_eng(void *coll, const char *fn) {
  gin_coll_t *c = as_coll(coll, fn);
  return c ? c->eng : NULL;
}

/* --- setup --- */

static ncclResult_t gin_init(void **ctx, uint64_t comm_id, ncclDebugLogger_t log) {
  if (!ctx) {
    ps_log_set(log);
    PS_WARN("one-sided init: NULL context pointer");
    return ncclInvalidArgument;
  }
  *ctx = NULL;
  gin_init_t *g = calloc(1, sizeof *g);
  if (!g) {
    ps_log_set(log);
    PS_WARN("one-sided init: out of memory");
    return ncclSystemError;
  }
  ncclResult_t rc = ps_abi_init_ctx(&g->net_ctx, comm_id, NULL, log, NULL);
  if (rc == ncclSuccess) rc = ps_htab_reserve(&init_tab, 1, &g->slot);
  if (rc != ncclSuccess) {
    if (g->net_ctx) ps_abi_finalize_ctx(g->net_ctx);
    free(g);
    return rc;
  }
  *ctx = ps_htab_bind(&init_tab, g->slot, g);
  return ncclSuccess;
}

static ncclResult_t gin_finalize(void *ctx) {
  gin_init_t *g = ps_htab_get(&init_tab, ctx);
  if (!g) {
    ps_htab_refused(&init_tab, ctx, "one-sided finalize");
    return ncclInvalidArgument;
  }
  ps_htab_release(&init_tab, g->slot, 1);
  ncclResult_t rc = ps_abi_finalize_ctx(g->net_ctx);
  free(g);
  return rc;
}

static ncclResult_t gin_devices(int *ndev) {
  if (!ndev) {
    PS_WARN("one-sided devices: NULL count pointer");
    return ncclInvalidArgument;
  }
  return ps_net_devices(ndev);
}

/* GPU windows are staged or registered directly, so CUDA memory is taken
 * wherever the driver loads; by dma-buf where the one-sided device's
 * provider takes one. */
static void gin_ptr_support(int dev, int *ptr_support) {
  if (!ps_cuda_available()) return;
  *ptr_support |= NCCL_PTR_CUDA;
  ps_device_t *d = ps_fabric_rma_dev(dev);
  if (d && ps_gpumem_dmabuf(d)) *ptr_support |= NCCL_PTR_DMABUF;
}

/* NCCL sizes its GIN/RMA proxy queue per peer as NCCL_NET_MAX_REQUESTS x the
 * one-sided table's maxRecvs (which means nothing else there). A kernel that
 * finds the queue full spins on a word in host memory, one thread per CTA:
 * with many CTAs the staging copies and the proxy slow down together, so the
 * queue is made deep enough for a burst of puts (PERSEUS_PROXY_QUEUE). */
static int gin_max_recvs(void) {
  return (int)(ps_fabric_config()->proxy_queue / NCCL_NET_MAX_REQUESTS);
}

/* The net properties, as a device NCCL drives through its GIN proxy. */
static ncclResult_t gin_props_v11(int dev, ps_props_v11_t *props) {
  if (!props) {
    PS_WARN("one-sided getProperties: NULL properties pointer");
    return ncclInvalidArgument;
  }
  PS_CHECK(ps_abi_props_v11(dev, props));
  props->netDeviceType = NCCL_NET_DEVICE_GIN_PROXY;
  props->maxRecvs = gin_max_recvs();
  gin_ptr_support(dev, &props->ptrSupport);
  return ncclSuccess;
}

static ncclResult_t gin_props_v12(int dev, ps_props_v12_t *props) {
  if (!props) {
    PS_WARN("one-sided getProperties: NULL properties pointer");
    return ncclInvalidArgument;
  }
  PS_CHECK(ps_abi_props_v12(dev, props));
  props->netDeviceType = NCCL_NET_DEVICE_GIN_PROXY;
  props->maxRecvs = gin_max_recvs();
  gin_ptr_support(dev, &props->ptrSupport);
  return ncclSuccess;
}

/* ctx is not ours to check: NCCL 2.30 passes its RMA instance here and the
 * net plugin's context to connect. */
static ncclResult_t gin_listen(void *ctx, int dev, void *handle, void **listen_comm) {
  (void)ctx;
  if (!handle || !listen_comm) {
    PS_WARN("one-sided listen: NULL handle (%p) or listenComm pointer (%p)", handle,
            (void *)listen_comm);
    return ncclInvalidArgument;
  }
  return ps_rma_listen(dev, handle, listen_comm);
}

static ncclResult_t connect_any(void *handles[], int nranks, int rank, int nconn, void *lc,
                                void **coll) {
  if (!handles || !lc || !coll || nranks < 1 || rank < 0 || rank >= nranks) {
    PS_WARN("one-sided connect: bad arguments (rank %d of %d, handles %p, listenComm %p)", rank,
            nranks, (void *)handles, lc);
    return ncclInvalidArgument;
  }
  for (int i = 0; i < nranks; i++)
    if (!handles[i]) {
      PS_WARN("one-sided connect: no handle for rank %d", i);
      return ncclInvalidArgument;
    }
  *coll = NULL;
  gin_coll_t *c = calloc(1, sizeof *c);
  if (!c) PS_WARN("one-sided connect: out of memory");
  ncclResult_t rc = c ? ps_htab_reserve(&coll_tab, 1, &c->slot) : ncclSystemError;
  if (rc == ncclSuccess) {
    rc = ps_rma_connect(handles, nranks, rank, lc, &c->eng);
    if (rc != ncclSuccess) ps_htab_release(&coll_tab, c->slot, 1);
  }
  if (rc != ncclSuccess) {
    free(c);
    return rc;
  }
  c->nconn = nconn;
  *coll = ps_htab_bind(&coll_tab, c->slot, c);
  return ncclSuccess;
}

static ncclResult_t connect_v11(void *ctx, void *handles[], int nranks, int rank, void *lc,
                                void **coll) {
  (void)ctx;
  return connect_any(handles, nranks, rank, 1, lc, coll);
}

/* queueDepth is NCCL's request (0: its default). The engine queues in order
 * whatever is posted, so nothing needs sizing to it. */
static ncclResult_t connect_v12(void *ctx, void *handles[], int nranks, int rank, int nconn,
                                int queue_depth, void *lc, void **coll) {
  (void)ctx;
  if (nconn < 1 || queue_depth < 0) {
    PS_WARN("one-sided connect: %d connections with queue depth %d (need >= 1 and >= 0)", nconn,
            queue_depth);
    return ncclInvalidArgument;
  }
  return connect_any(handles, nranks, rank, nconn, lc, coll);
}

static ncclResult_t ctx_create(void *coll, int ncontexts, void **out) {
  gin_coll_t *c = as_coll(coll, "createContext");
  if (!c) return ncclInvalidArgument;
  if (!out || ncontexts < 1) {
    PS_WARN("createContext: %d contexts, context pointer %p", ncontexts, (void *)out);
    return ncclInvalidArgument;
  }
  gin_ctx_t *x = calloc(1, sizeof *x);
  if (!x) PS_WARN("createContext: out of memory");
  ncclResult_t rc = x ? ps_htab_reserve(&ctx_tab, 1, &x->slot) : ncclSystemError;
  if (rc != ncclSuccess) {
    free(x);
    return rc;
  }
  x->ncontexts = ncontexts, x->coll = c, x->next = c->ctxs;
  c->ctxs = x;
  *out = ps_htab_bind(&ctx_tab, x->slot, x);
  return ncclSuccess;
}

/* v11-v13 ask for a device handle: in proxy mode NCCL builds its own (2.28
 * and 2.29 do not even call createContext then; 2.30's v13 shim drops it). */
static ncclResult_t ctx_create_dev(void *coll, int ncontexts, void **out,
                                   ps_nccl_dev_handle_t **dev) {
  if (dev) *dev = NULL;
  return ctx_create(coll, ncontexts, out);
}

static ncclResult_t ctx_v11(void *coll, int nsig, int ncnt, void **out, ps_nccl_dev_handle_t **dev) {
  (void)nsig, (void)ncnt; /* the signal and counter arrays are NCCL's in proxy mode */
  return ctx_create_dev(coll, 1, out, dev);
}

static ncclResult_t ctx_v12(void *coll, int nsig, int ncnt, int nctx, void **out,
                            ps_nccl_dev_handle_t **dev) {
  (void)nsig, (void)ncnt;
  return ctx_create_dev(coll, nctx, out, dev);
}

static ncclResult_t ctx_v13(void *coll, ps_gin_config_v13_t *cfg, void **out,
                            ps_nccl_dev_handle_t **dev) {
  if (!cfg) {
    PS_WARN("createContext: NULL config");
    return ncclInvalidArgument;
  }
  return ctx_create_dev(coll, cfg->nContexts, out, dev);
}

/* rankStride and trafficClass need nothing from a flat full mesh. */
static ncclResult_t ctx_v14(void *coll, ps_rma_config_v14_t *cfg, void **out) {
  if (!cfg) {
    PS_WARN("createContext: NULL config");
    return ncclInvalidArgument;
  }
  return ctx_create(coll, cfg->nContexts, out);
}

static ncclResult_t ctx_destroy(void *ctx) {
  gin_ctx_t *x = ps_htab_get(&ctx_tab, ctx);
  if (!x) {
    if (ps_htab_get(&coll_tab, ctx))
      PS_WARN("destroyContext: %p is a collComm, not a context", ctx);
    else
      ps_htab_refused(&ctx_tab, ctx, "destroyContext");
    return ncclInvalidArgument;
  }
  if (x->coll) /* unlink; a closed comm already let go of it */
    for (gin_ctx_t **pp = &x->coll->ctxs; *pp; pp = &(*pp)->next)
      if (*pp == x) {
        *pp = x->next;
        break;
      }
  ps_htab_release(&ctx_tab, x->slot, 1);
  free(x);
  return ncclSuccess;
}

static ncclResult_t gin_close_coll(void *coll) {
  gin_coll_t *c = as_coll(coll, "closeColl");
  if (!c) return ncclInvalidArgument;
  ps_htab_release(&coll_tab, c->slot, 1); /* stale first: a second close is refused */
  for (gin_ctx_t *x = c->ctxs; x; x = x->next) x->coll = NULL;
  ncclResult_t rc = ps_rma_close_coll(c->eng);
  free(c);
  return rc;
}

/* --- registration: collective, on the collComm in every version --- */

static ncclResult_t reg_any(void *coll, void *data, size_t size, int type, uint64_t flags,
                            const ps_dmabuf_t *dmabuf, void **mh, void **gin_handle,
                            const char *fn) {
  void *eng = coll_eng(coll, fn);
  if (!eng) return ncclInvalidArgument;
  if (!mh || !gin_handle) {
    PS_WARN("%s: NULL mhandle (%p) or ginHandle (%p) pointer", fn, (void *)mh, (void *)gin_handle);
    return ncclInvalidArgument;
  }
  PS_CHECK(ps_rma_reg_sym(eng, data, size, type, flags, dmabuf, mh));
  *gin_handle = *mh;
  return ncclSuccess;
}

static ncclResult_t reg_sym(void *coll, void *data, size_t size, int type, uint64_t flags,
                            void **mh, void **gin_handle) {
  return reg_any(coll, data, size, type, flags, NULL, mh, gin_handle, "regMrSym");
}

/* A GPU window registers by its dma-buf where the provider takes one
 * (ptrSupport DMABUF); host memory, and GPU memory elsewhere, by address. */
static ncclResult_t reg_sym_dmabuf(void *coll, void *data, size_t size, int type, uint64_t offset,
                                   int fd, uint64_t flags, void **mh, void **gin_handle) {
  ps_dmabuf_t db = {.fd = fd, .offset = offset};
  return reg_any(coll, data, size, type, flags, &db, mh, gin_handle, "regMrSymDmaBuf");
}

static ncclResult_t reg_sym_v14(void *coll, void *data, size_t size, int type, uint64_t flags,
                                void **mh) {
  void *unused;
  return reg_any(coll, data, size, type, flags, NULL, mh, &unused, "regMrSym");
}

static ncclResult_t reg_sym_dmabuf_v14(void *coll, void *data, size_t size, int type,
                                       uint64_t offset, int fd, uint64_t flags, void **mh) {
  void *unused;
  ps_dmabuf_t db = {.fd = fd, .offset = offset};
  return reg_any(coll, data, size, type, flags, &db, mh, &unused, "regMrSymDmaBuf");
}

static ncclResult_t dereg_sym(void *coll, void *mh) {
  void *eng = coll_eng(coll, "deregMrSym");
  return eng ? ps_rma_dereg_sym(eng, mh) : ncclInvalidArgument;
}

/* --- operations (the version-neutral core, then per-version shims) --- */

/* The engine promises a request whenever it succeeds: NCCL 2.28/2.29 test
 * whatever comes back without retrying, and 2.30 calls NULL an error. */
static ncclResult_t got_req(ncclResult_t rc, void **req, const char *fn) {
  if (rc == ncclSuccess && !*req) {
    PS_WARN("%s: the engine succeeded without a request", fn);
    return ncclInternalError;
  }
  return rc;
}

static ncclResult_t put_any(void *eng, uint64_t src_off, void *src_mh, size_t size,
                            uint64_t dst_off, void *dst_mh, uint32_t rank, void **req) {
  if (!eng) return ncclInvalidArgument;
  if (!req) {
    PS_WARN("iput: NULL request pointer");
    return ncclInvalidArgument;
  }
  *req = NULL;
  return got_req(ps_rma_iput(eng, src_off, src_mh, size, dst_off, dst_mh, rank, req), req, "iput");
}

/* Signal-only (size 0, no src/dst handles) is how NCCL 2.29+ sends a VA
 * signal: the engine takes it as is. */
static ncclResult_t signal_any(void *eng, uint64_t src_off, void *src_mh, size_t size,
                               uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t sig_off,
                               void *sig_mh, uint64_t value, uint32_t op, void **req) {
  if (!eng) return ncclInvalidArgument;
  if (!req || !sig_mh) {
    PS_WARN("iputSignal: NULL %s", req ? "signal handle" : "request pointer");
    return ncclInvalidArgument;
  }
  if (op != NCCL_NET_SIGNAL_OP_INC && op != NCCL_NET_SIGNAL_OP_ADD) {
    PS_WARN("iputSignal: signal op %u is neither INC (%d) nor ADD (%d)", op,
            NCCL_NET_SIGNAL_OP_INC, NCCL_NET_SIGNAL_OP_ADD);
    return ncclInvalidArgument;
  }
  *req = NULL;
  return got_req(ps_rma_iput_signal(eng, src_off, src_mh, size, dst_off, dst_mh, rank, sig_off,
                                    sig_mh, value, op, req),
                 req, "iputSignal");
}

static ncclResult_t iput_v11(void *coll, uint64_t so, void *smh, size_t size, uint64_t doff,
                             void *dmh, uint32_t rank, void **req) {
  return put_any(coll_eng(coll, "iput"), so, smh, size, doff, dmh, rank, req);
}

static ncclResult_t iput_v12(void *coll, uint64_t so, void *smh, size_t size, uint64_t doff,
                             void *dmh, uint32_t rank, int conn, void **req) {
  return put_any(conn_eng(coll, conn, "iput"), so, smh, size, doff, dmh, rank, req);
}

static ncclResult_t iput_v13(void *ctx, int context, uint64_t so, void *smh, size_t size,
                             uint64_t doff, void *dmh, uint32_t rank, void **req) {
  return put_any(ctx_eng(ctx, context, "iput"), so, smh, size, doff, dmh, rank, req);
}

static ncclResult_t sig_v11(void *coll, uint64_t so, void *smh, size_t size, uint64_t doff,
                            void *dmh, uint32_t rank, uint64_t sig_off, void *sig_mh,
                            uint64_t value, uint32_t op, void **req) {
  return signal_any(coll_eng(coll, "iputSignal"), so, smh, size, doff, dmh, rank, sig_off, sig_mh,
                    value, op, req);
}

static ncclResult_t sig_v12(void *coll, uint64_t so, void *smh, size_t size, uint64_t doff,
                            void *dmh, uint32_t rank, uint64_t sig_off, void *sig_mh,
                            uint64_t value, uint32_t op, int conn, void **req) {
  return signal_any(conn_eng(coll, conn, "iputSignal"), so, smh, size, doff, dmh, rank, sig_off,
                    sig_mh, value, op, req);
}

static ncclResult_t sig_v13(void *ctx, int context, uint64_t so, void *smh, size_t size,
                            uint64_t doff, void *dmh, uint32_t rank, uint64_t sig_off,
                            void *sig_mh, uint64_t value, uint32_t op, void **req) {
  return signal_any(ctx_eng(ctx, context, "iputSignal"), so, smh, size, doff, dmh, rank, sig_off,
                    sig_mh, value, op, req);
}

/* Every signal of ours is strongly ordered behind its data and all earlier
 * puts to the peer, which is what a weak signal may have too. */
static ncclResult_t sig_v14(void *ctx, int context, uint64_t so, void *smh, size_t size,
                            uint64_t doff, void *dmh, uint32_t rank, uint64_t sig_off,
                            void *sig_mh, uint64_t value, uint32_t op, bool strong, void **req) {
  (void)strong;
  return sig_v13(ctx, context, so, smh, size, doff, dmh, rank, sig_off, sig_mh, value, op, req);
}

static ncclResult_t iget_v13(void *ctx, int context, uint64_t roff, void *rmh, size_t size,
                             uint64_t loff, void *lmh, uint32_t rank, void **req) {
  void *eng = ctx_eng(ctx, context, "iget");
  if (!eng) return ncclInvalidArgument;
  if (!req) {
    PS_WARN("iget: NULL request pointer");
    return ncclInvalidArgument;
  }
  *req = NULL;
  return got_req(ps_rma_iget(eng, roff, rmh, size, loff, lmh, rank, req), req, "iget");
}

/* NCCL 2.30 takes a NULL request from iflush as "already done". */
static ncclResult_t iflush_v13(void *ctx, int context, void *mh, uint32_t rank, void **req) {
  void *eng = ctx_eng(ctx, context, "iflush");
  if (!eng) return ncclInvalidArgument;
  if (!req) {
    PS_WARN("iflush: NULL request pointer");
    return ncclInvalidArgument;
  }
  *req = NULL;
  return ps_rma_iflush(eng, mh, rank, req);
}

static ncclResult_t gin_test(void *coll, void *req, int *done) {
  gin_coll_t *c = any_coll(coll, "test");
  if (!c) return ncclInvalidArgument;
  if (!done) {
    PS_WARN("test: NULL done pointer");
    return ncclInvalidArgument;
  }
  return ps_rma_test(c->eng, req, done);
}

static ncclResult_t gin_progress(void *coll_or_ctx) {
  gin_coll_t *c = any_coll(coll_or_ctx, "progress");
  return c ? ps_rma_progress(c->eng) : ncclInvalidArgument;
}

/* v11/v12 name a context here, but in proxy mode there is none (NCCL 2.28
 * and 2.29 never create one), so a collComm is taken as well. */
static ncclResult_t gin_last_error(void *ctx, bool *has_error) {
  gin_coll_t *c = any_coll(ctx, "queryLastError");
  if (!c) return ncclInvalidArgument;
  if (!has_error) {
    PS_WARN("queryLastError: NULL result pointer");
    return ncclInvalidArgument;
  }
  return ps_rma_last_error(c->eng, has_error);
}

/* --- the tables --- */

#define GIN_COMMON                                                                        \
  .name = PS_PLUGIN_NAME, .init = gin_init, .devices = gin_devices, .listen = gin_listen, \
  .deregMrSym = dereg_sym, .destroyContext = ctx_destroy, .closeColl = gin_close_coll,    \
  .closeListen = ps_rma_close_listen, .test = gin_test, .queryLastError = gin_last_error, \
  .finalize = gin_finalize

PS_EXPORT const ncclGin_v11_t ncclGinPlugin_v11 = {
    GIN_COMMON, .getProperties = gin_props_v11, .connect = connect_v11, .createContext = ctx_v11,
    .regMrSym = reg_sym, .regMrSymDmaBuf = reg_sym_dmabuf, .iput = iput_v11, .iputSignal = sig_v11,
    .ginProgress = gin_progress};

PS_EXPORT const ncclGin_v12_t ncclGinPlugin_v12 = {
    GIN_COMMON, .getProperties = gin_props_v11, .connect = connect_v12, .createContext = ctx_v12,
    .regMrSym = reg_sym, .regMrSymDmaBuf = reg_sym_dmabuf, .iput = iput_v12, .iputSignal = sig_v12,
    .ginProgress = gin_progress};

#define GIN_V13_BODY                                                                            \
  GIN_COMMON, .getProperties = gin_props_v12, .connect = connect_v11, .createContext = ctx_v13, \
  .regMrSym = reg_sym, .regMrSymDmaBuf = reg_sym_dmabuf, .iput = iput_v13,                      \
  .iputSignal = sig_v13, .iget = iget_v13, .iflush = iflush_v13, .ginProgress = gin_progress

PS_EXPORT const ncclGin_v13_t ncclGinPlugin_v13 = {GIN_V13_BODY};
PS_EXPORT const ncclRma_v13_t ncclRmaPlugin_v13 = {GIN_V13_BODY};

PS_EXPORT const ncclRma_v14_t ncclRmaPlugin_v14 = {
    GIN_COMMON, .getProperties = gin_props_v12, .connect = connect_v11, .createContext = ctx_v14,
    .regMrSym = reg_sym_v14, .regMrSymDmaBuf = reg_sym_dmabuf_v14, .iput = iput_v13,
    .iputSignal = sig_v14, .iget = iget_v13, .iflush = iflush_v13, .rmaProgress = gin_progress};

/* --- perseus extensions (include/perseus/perseus_rma.h) --- */

/* An older caller's struct gets the fields it knows, a newer one zeros. */
static int give_stats(const char *fn, const perseus_rma_peer_stats_t *st, perseus_rma_peer_stats_t *out,
                      size_t size) {
  if (!out || size < sizeof(uint64_t) || size % sizeof(uint64_t)) {
    PS_WARN("%s: output %p of %zu bytes", fn, (void *)out, size);
    return -1;
  }
  size_t n = size < sizeof *st ? size : sizeof *st;
  memcpy(out, st, n);
  memset((char *)out + n, 0, size - n);
  return 0;
}

PS_EXPORT int perseus_rma_peer_stats(void *comm, uint32_t rank, perseus_rma_peer_stats_t *out,
                                     size_t size) {
  gin_coll_t *c = any_coll(comm, "perseus_rma_peer_stats");
  if (!c) return -1;
  perseus_rma_peer_stats_t st;
  if (ps_rma_peer_stats(c->eng, rank, &st) != ncclSuccess) {
    PS_WARN("perseus_rma_peer_stats: no rank %u in this comm", rank);
    return -1;
  }
  return give_stats("perseus_rma_peer_stats", &st, out, size);
}

PS_EXPORT int perseus_rma_process_stats(perseus_rma_peer_stats_t *out, size_t size) {
  perseus_rma_peer_stats_t st;
  ps_rma_process_stats(&st);
  return give_stats("perseus_rma_process_stats", &st, out, size);
}

PS_EXPORT const char *perseus_rma_ordering(void *comm) {
  gin_coll_t *c = any_coll(comm, "perseus_rma_ordering");
  if (!c) return NULL;
  ps_ordering_t o = ps_rma_ordering(c->eng);
  for (int i = 0; ps_ordering_names[i]; i++)
    if (i == (int)o) return ps_ordering_names[i];
  return NULL;
}
