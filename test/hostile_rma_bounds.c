/* hostile_rma -s bounds (see hostile_rma.c): every offset and size against
 * the windows on both sides, signal offsets, ranks, connection and context
 * indices, NULL out-pointers, wrong kinds and devices, on every entry point
 * that takes them. */
#include <stdio.h>
#include <stdlib.h>

#include "hostile_rma.h"
#include "ps_driver_int.h"

/* The raw table's setup calls with bad arguments. */
static int bad_setup(drv_rank_t *r, const args_t *a, win_t *w) {
  raw_t x;
  void *hp[16], *lc = NULL, *cc = NULL, *ctx = NULL, *mh = NULL;
  ps_nccl_dev_handle_t *dh = NULL;
  ps_props_v12_t props; /* large enough for either version */
  unsigned char h[NCCL_NET_HANDLE_MAXSIZE];
  REFUSED(T11->init(NULL, 1, drv_logger), "NULL context pointer", "init(NULL)");
  REFUSED(T11->devices(NULL), "NULL count pointer", "devices(NULL)");
  REFUSED(a->ver < 13 ? T11->getProperties(0, NULL) : T13->getProperties(0, NULL),
          "NULL properties pointer", "getProperties(0, NULL)");
  REFUSED(a->ver < 13 ? T11->getProperties(-1, (void *)&props) : T13->getProperties(-1, &props),
          "device -1 does not exist", "getProperties of device -1");
  REFUSED(T11->listen(NULL, 0, NULL, &lc), "NULL handle", "listen with a NULL handle");
  REFUSED(T11->listen(NULL, 0, h, NULL), "listenComm pointer",
          "listen with a NULL listenComm pointer");
  REFUSED(T11->listen(NULL, -1, h, &lc), "device -1", "listen on device -1");
  REFUSED(T11->listen(NULL, 1 << 20, h, &lc), "device 1048576", "listen on device 2^20");
  if (raw_open(r, a, 0, &x, hp)) return 1;
  REFUSED(raw_connect(a->ver, hp, r->nranks, r->rank, x.lc, NULL), "bad arguments",
          "connect with a NULL collComm pointer");
  REFUSED(raw_connect(a->ver, hp, r->nranks, r->nranks, x.lc, &cc), "bad arguments",
          "connect as rank nranks");
  REFUSED(raw_connect(a->ver, hp, 0, 0, x.lc, &cc), "bad arguments", "connect of 0 ranks");
  CHECK(T11->closeListen(x.lc) == ncclSuccess, "closeListen");
  if (a->ver == 11)
    REFUSED(T11->createContext(x.cc, 0, 0, NULL, &dh), "context pointer", "createContext(NULL)");
  if (a->ver == 13)
    REFUSED(T13->createContext(x.cc, NULL, &ctx, &dh), "NULL config",
            "createContext without config");
  if (a->ver == 14)
    REFUSED(T14->createContext(x.cc, NULL, &ctx), "NULL config", "createContext without config");
  if (a->ver > 11)
    REFUSED(raw_ctx(a->ver, x.cc, 0, &ctx), "0 contexts", "createContext of 0 contexts");
  REFUSED(raw_ctx(a->ver, x.ctx, 1, &ctx), "is a context", "createContext on a context");
  REFUSED(w->g->reg_sym(x.ctx, w->src, SZ, HOST, 0, &mh), "is a context", "regMrSym on a context");
  if (a->ver >= 13)
    REFUSED(w->g->iput(x.cc, 0, w->src_mh, 8, 0, w->dst_mh, 0, &mh), "is a collComm",
            "iput on a collComm where a context is expected");
  CHECK(T11->destroyContext(x.ctx) == ncclSuccess && T11->closeColl(x.cc) == ncclSuccess, "close");
  return 0;
}

/* Shorthands for bounds(): a put, and a signal-only or put+signal of n bytes. */
#define PUT(so, n, doff, dmh, rk) g->iput(w->ops, so, w->src_mh, n, doff, dmh, rk, &req)
#define SIG(n, soff, smh, rk, op, rq)                                                            \
  g->iput_signal(w->ops, 0, (n) ? w->src_mh : NULL, n, 0, (n) ? w->dst_mh : NULL, rk, soff, smh, \
                 1, op, rq)

int bounds(drv_rank_t *r, const args_t *a, win_t *w) {
  drv_gin_t *g = w->g;
  uint32_t P = (uint32_t)r->nranks, me = (uint32_t)r->rank, nx = (me + 1) % P;
  uint64_t W = (uint64_t)P * SZ, half = SZ / 2;
  static uint64_t words[32];
  void *req = NULL, *mh = NULL, *um = NULL, *dm = w->dst_mh, *sm = w->sig_mh;
  const char *out = "falls outside", *word = "not an aligned", *has = "the comm has";
  /* registration (every rank makes the same refused call: nothing collective starts) */
  REFUSED(g->reg_sym(w->reg, (char *)words + 4, P * 8, HOST, NCCL_NET_MR_FLAG_FORCE_SO, &mh),
          "not 8-byte aligned", "a FORCE_SO signal window at a misaligned address");
  if (bad_setup(r, a, w)) return 1;
  REFUSED(g->reg_sym(w->reg, NULL, SZ, HOST, 0, &mh), "NULL buffer", "regMrSym of NULL, 4 KiB");
  REFUSED(g->reg_sym(w->reg, (void *)(UINTPTR_MAX - SZ / 2 + 1), SZ, HOST, 0, &mh),
          "past the end of the address space", "regMrSym of 4 KiB that wraps the address space");
  REFUSED(g->reg_sym(w->reg, words, 8, 7, 0, &mh), "pointer type 7", "regMrSym of pointer type 7");
  REFUSED(g->reg_sym(w->reg, words, 8, HOST, 0, NULL), "NULL mhandle", "regMrSym(mhandle NULL)");
  /* a window whose part on rank 1 is half the others' */
  unsigned char *uneven = calloc(1, SZ);
  CHECK(uneven && g->reg_sym(w->reg, uneven, me == 1 ? half : SZ, HOST, 0, &um) == ncclSuccess,
        "reg uneven window");
  if (me == 0) {
    REFUSED(PUT(0, half + 1, 0, um, 1), out, "put past rank 1's part");
    REFUSED(PUT(0, 8, half, um, 1), out, "put at the end of rank 1's part");
    REFUSED(SIG(0, half, um, 1, INC, &req), word, "signal past rank 1's part");
    if (g->iget)
      REFUSED(g->iget(w->ops, half, um, 8, 0, dm, 1, &req), out, "iget past rank 1's part");
  }
  /* offsets and sizes against both sides */
  REFUSED(PUT(W, 8, 0, dm, nx), out, "source at the window's end");
  REFUSED(PUT(W - 4, 8, 0, dm, nx), out, "source crossing the window's end");
  REFUSED(PUT(0, SIZE_MAX, 0, dm, nx), out, "size SIZE_MAX");
  REFUSED(PUT(UINT64_MAX - 3, 8, 0, dm, nx), out, "source offset wrapping around");
  REFUSED(PUT(0, 8, W - 4, dm, nx), out, "destination crossing the window's end");
  REFUSED(PUT(0, 8, UINT64_MAX, dm, nx), out, "destination offset UINT64_MAX");
  REFUSED(SIG(W + 1, 0, sm, nx, INC, &req), out, "put+signal larger than its window");
  const uint64_t sig_offs[] = {4, 8 * (uint64_t)P, 8 * (uint64_t)P - 4, UINT64_MAX - 7};
  for (int i = 0; i < 4; i++)
    REFUSED(SIG(8, sig_offs[i], sm, nx, INC, &req), word, "signal offset %llu",
            (unsigned long long)sig_offs[i]);
  REFUSED(SIG(8, 0, sm, nx, 7, &req), "is neither", "signal op 7");
  /* ranks */
  const uint32_t ranks[] = {P, UINT32_MAX};
  for (int i = 0; i < 2; i++) {
    REFUSED(PUT(0, 8, 0, dm, ranks[i]), has, "iput to rank %u", ranks[i]);
    REFUSED(SIG(0, 0, sm, ranks[i], INC, &req), has, "signal to rank %u", ranks[i]);
    if (g->iget)
      REFUSED(g->iget(w->ops, 0, w->src_mh, 8, 0, dm, ranks[i], &req), has, "iget, rank %u",
              ranks[i]);
    if (g->iflush)
      REFUSED(g->iflush(w->ops, dm, ranks[i], &req), has, "iflush of rank %u", ranks[i]);
  }
  /* connection (v12) or context (v13/v14) indices */
  for (int idx = -1; a->ver > 11 && idx <= DRV_GIN_NCONN; idx += DRV_GIN_NCONN + 1) {
    drv_gin_set_index(idx);
    REFUSED(PUT(0, 8, 0, dm, nx), "outside the", "iput, index %d", idx);
    REFUSED(SIG(0, 0, sm, nx, INC, &req), "outside the", "signal, index %d", idx);
    if (g->iget)
      REFUSED(g->iget(w->ops, 0, w->src_mh, 8, 0, dm, nx, &req), "outside the", "iget, index %d",
              idx);
    drv_gin_set_index(0);
  }
  /* NULL out-pointers */
  REFUSED(g->iput(w->ops, 0, w->src_mh, 8, 0, dm, nx, NULL), "NULL request", "iput(request NULL)");
  REFUSED(SIG(0, 0, sm, nx, INC, NULL), "NULL request", "iputSignal(request NULL)");
  if (g->iget)
    REFUSED(g->iget(w->ops, 0, w->src_mh, 8, 0, dm, nx, NULL), "NULL request", "iget(NULL)");
  if (g->iflush) REFUSED(g->iflush(w->ops, dm, nx, NULL), "NULL request", "iflush(request NULL)");
  REFUSED(g->last_error(w->ops, NULL), "NULL result", "queryLastError(NULL)");
  ncclResult_t rc = ncclSuccess;
  CHECK(PUT(0, 8, (uint64_t)me * SZ, dm, me) == ncclSuccess && req, "put to self");
  REFUSED(g->test(w->ops, req, NULL), "NULL done", "test(done NULL)");
  CHECK(!drv_gin_wait(g, w->ops, req, 30, &rc), "put to self did not complete (rc %d)", rc);
  bool err = true;
  CHECK(g->last_error(w->ops, &err) == ncclSuccess && !err, "a refused call failed the comm");
  CHECK(!drv_barrier(r, 60) && g->dereg_sym(w->reg, um) == ncclSuccess, "deregMrSym");
  free(uneven);
  return ring(r, w, 0);
}
