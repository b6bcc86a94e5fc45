/* One-sided engine, setup: the collective communicator (one endpoint per
 * rank, every peer's address in its AV) and symmetric registration (each
 * rank registers its part; address, size and key are allgathered). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ps_comm.h"
#include "ps_log.h"
#include "ps_rma_int.h"

const char *const ps_ordering_names[] = {"auto", "ordered", "fence", "target",
                                         "deferred", "drain",
#ifdef PS_REORDER_TEST
                                         "unsafe",
#endif
                                         NULL};

/* The strategies this build implements; the others are refused by name. */
static ncclResult_t choose_ordering(const ps_device_t *d, ps_ordering_t *out) {
  int v;
  PS_CHECK(ps_env_enum("PERSEUS_ORDERING", ps_ordering_names, PS_ORD_AUTO, &v));
  if (v == PS_ORD_AUTO) v = PS_ORD_DEFERRED; /* correct on any provider, never blocks */
  if (v != PS_ORD_DEFERRED && v != PS_ORD_DRAIN && v != PS_ORD_UNSAFE) {
    PS_WARN("PERSEUS_ORDERING=%s is not available yet on %s (this build implements deferred and "
            "drain)", ps_ordering_names[v], d->name);
    return ncclInvalidUsage;
  }
  /* deferred and drain release a signal once its puts report delivery. */
  if ((v == PS_ORD_DEFERRED || v == PS_ORD_DRAIN) && d->rma_delivery_broken) {
    PS_WARN("PERSEUS_ORDERING=%s needs RMA writes whose delivery completion holds, and on %s it "
            "does not (%s); use another provider (the target strategy, to come, will serve it)",
            ps_ordering_names[v], d->name, d->rma_delivery_broken);
    return ncclInvalidUsage;
  }
  *out = (ps_ordering_t)v;
  return ncclSuccess;
}

ncclResult_t ps_rma_listen(int dev, void *handle, void **listen_comm) {
  if (!handle || !listen_comm) return ncclInvalidArgument;
  *listen_comm = NULL;
  ps_device_t *d = ps_fabric_rma_dev(dev);
  if (!d) {
    PS_WARN("one-sided listen: device %d has no RMA-capable endpoint", dev);
    return ncclInvalidArgument;
  }
  ps_ep_t *ep = calloc(1, sizeof *ep);
  if (!ep) return ncclSystemError;
  ncclResult_t rc = ps_ep_open(d, (int)ps_fabric_config()->eagain_retries, ep);
  if (rc == ncclSuccess)
    rc = ps_handle_encode(handle, ps_fabric_wire_hash(), (uint32_t)dev, ps_random64(), ep->addr,
                          ep->addrlen);
  if (rc != ncclSuccess) {
    ps_ep_close(ep);
    free(ep);
    return rc;
  }
  *listen_comm = ep;
  return ncclSuccess;
}

ncclResult_t ps_rma_close_listen(void *listen_comm) {
  ps_ep_t *ep = listen_comm;
  if (!ep) return ncclInvalidArgument;
  ps_ep_close(ep); /* a no-op once connect took the endpoint over */
  free(ep);
  return ncclSuccess;
}

ncclResult_t ps_rma_connect(void *handles[], int nranks, int rank, void *listen_comm,
                            void **coll_comm) {
  ps_ep_t *lep = listen_comm;
  if (!handles || !coll_comm || !lep || !lep->ep || nranks < 1 || rank < 0 || rank >= nranks) {
    PS_WARN("one-sided connect: bad arguments (rank %d of %d)", rank, nranks);
    return ncclInvalidArgument;
  }
  *coll_comm = NULL;
  ps_rma_comm_t *c = calloc(1, sizeof *c);
  if (!c) return ncclSystemError;
  c->magic = PS_RMA_MAGIC;
  c->rank = rank, c->nranks = nranks;
#ifdef PS_REORDER_TEST
  c->rng = 0x9e3779b97f4a7c15ULL ^ (uint64_t)rank;
#endif
  c->ep = *lep;            /* the endpoint listen opened becomes the comm's */
  memset(lep, 0, sizeof *lep);
  c->addr = calloc((size_t)nranks, sizeof *c->addr);
  c->peers = calloc((size_t)nranks, sizeof *c->peers);
  c->reqs = calloc(PS_RMA_REQUESTS, sizeof *c->reqs);
  ncclResult_t rc = (c->addr && c->peers && c->reqs) ? ncclSuccess : ncclSystemError;
  if (rc == ncclSuccess) rc = choose_ordering(c->ep.dev, &c->ordering);
  for (int i = PS_RMA_REQUESTS - 1; rc == ncclSuccess && i >= 0; i--) {
    c->reqs[i].next = c->free_reqs;
    c->free_reqs = &c->reqs[i];
  }
  for (int p = 0; rc == ncclSuccess && p < nranks; p++) {
    ps_handle_t h;
    rc = ps_handle_decode(handles[p], NCCL_NET_HANDLE_MAXSIZE, ps_fabric_wire_hash(), &h);
    if (rc == ncclSuccess) rc = ps_ep_insert(&c->ep, h.addr, &c->addr[p]);
    c->peers[p].next_seq = c->peers[p].done_below = 1;
    c->peers[p].done = calloc(PS_RMA_SEQ_RING, 1);
    if (rc == ncclSuccess && !c->peers[p].done) rc = ncclSystemError;
  }
  if (rc == ncclSuccess) rc = ps_rma_post_sig_slots(c);
  if (rc != ncclSuccess) {
    ps_rma_close_coll(c);
    return rc;
  }
  PS_INFO(NCCL_INIT | NCCL_NET, "one-sided comm: rank %d of %d on %s, ordering %s", rank, nranks,
          c->ep.dev->name, ps_ordering_names[c->ordering]);
  *coll_comm = c;
  return ncclSuccess;
}

ncclResult_t ps_rma_close_coll(void *coll) {
  ps_rma_comm_t *c = coll;
  if (!c || c->magic != PS_RMA_MAGIC) return ncclInvalidArgument;
  ps_ep_close(&c->ep); /* first: nothing completes into freed memory */
  for (uint32_t i = 0; i < c->nregions; i++)
    if (c->regions[i]) ps_rma_dereg_sym(c, c->regions[i]);
  for (int p = 0; c->peers && p < c->nranks; p++) free(c->peers[p].done);
#ifdef PS_REORDER_TEST
  free(c->held);
#endif
  free(c->regions), free(c->addr), free(c->peers), free(c->reqs);
  c->magic = 0;
  free(c);
  return ncclSuccess;
}

void ps_rma_fail(ps_rma_comm_t *c, ncclResult_t rc, const char *fmt, ...) {
  if (c->error) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->error_msg, sizeof c->error_msg, fmt, ap);
  va_end(ap);
  c->error = rc;
  PS_WARN("one-sided comm rank %d: %s", c->rank, c->error_msg);
}

/* Blocking allgather of one region's {addr, size, key}: each rank sends its
 * part to every peer and receives theirs, progressing until done. */
typedef struct {
  ps_reg_msg_t msg;
  ps_op_t op;
  int done;
  size_t len;
} ag_slot_t;

static void ag_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ag_slot_t *s = op->owner;
  if (err) PS_WARN("registration exchange failed: %s", errstr);
  s->done = err ? -1 : 1;
  s->len = e ? e->len : 0;
}

static ncclResult_t allgather_region(ps_rma_comm_t *c, ps_rma_region_t *r) {
  int P = c->nranks;
  ag_slot_t *rx = calloc((size_t)P, sizeof *rx), *tx = calloc((size_t)P, sizeof *tx);
  ncclResult_t rc = (rx && tx) ? ncclSuccess : ncclSystemError;
  ps_reg_msg_t mine = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .rank = (uint32_t)c->rank,
                       .region_id = r->id, .size = r->size, .key = fi_mr_key(r->mr),
                       .addr = c->ep.dev->mr_virt_addr ? (uint64_t)(uintptr_t)r->base : 0};
  for (int p = 0; rc == ncclSuccess && p < P; p++) {
    if (p == c->rank) continue;
    int ok = 0;
    rx[p].op = (ps_op_t){.cb = ag_done, .owner = &rx[p]};
    tx[p].op = (ps_op_t){.cb = ag_done, .owner = &tx[p]};
    tx[p].msg = mine;
    rc = ps_ep_trecv(&c->ep, &rx[p].msg, sizeof rx[p].msg, NULL, PS_TAG_RMA_REG(r->id), &rx[p].op, &ok);
    if (rc == ncclSuccess && !ok) rc = ncclSystemError;
    tx[p].done = 2; /* not posted yet: the loop below posts it */
  }
  r->raddr[c->rank] = mine.addr, r->rsize[c->rank] = mine.size, r->rkey[c->rank] = mine.key;
  uint64_t deadline = ps_now_ns() + 60ULL * 1000000000ULL;
  for (int left = 1; rc == ncclSuccess && left;) {
    rc = ps_rma_progress(c);
    left = 0;
    for (int p = 0; rc == ncclSuccess && p < P; p++) {
      if (p == c->rank) continue;
      if (tx[p].done == 2) { /* -FI_EAGAIN while the provider connects: retry here */
        int ok = 0;
        rc = ps_ep_tsend(&c->ep, &tx[p].msg, sizeof tx[p].msg, NULL, c->addr[p],
                         PS_TAG_RMA_REG(r->id), &tx[p].op, &ok);
        if (ok) tx[p].done = 0;
      }
      if (rx[p].done < 0 || tx[p].done < 0) rc = ncclRemoteError;
      left += !rx[p].done + (tx[p].done != 1);
    }
    if (left && ps_now_ns() > deadline) {
      PS_WARN("symmetric registration %u: peers did not answer within 60 s", r->id);
      rc = ncclRemoteError;
    }
  }
  /* Parts arrive from any peer: each must name a distinct rank. */
  for (int p = 0; rc == ncclSuccess && p < P; p++) {
    if (p == c->rank) continue;
    ps_reg_msg_t m;
    rc = ps_reg_decode(&rx[p].msg, rx[p].len, (uint32_t)P, r->id, &m);
    if (rc == ncclSuccess && (m.rank == (uint32_t)c->rank || r->rkey[m.rank] || r->rsize[m.rank])) {
      PS_WARN("symmetric registration %u: duplicate part for rank %u", r->id, m.rank);
      rc = ncclRemoteError;
    }
    if (rc == ncclSuccess) r->raddr[m.rank] = m.addr, r->rsize[m.rank] = m.size, r->rkey[m.rank] = m.key;
  }
  if (rc != ncclSuccess) {
    ps_rma_fail(c, rc, "symmetric registration %u failed", r->id);
    ps_ep_close(&c->ep); /* operations still posted into rx/tx die with it */
  }
  free(rx), free(tx);
  return rc;
}

ncclResult_t ps_rma_reg_sym(void *coll, void *data, size_t size, int type, uint64_t mr_flags,
                            void **mh) {
  ps_rma_comm_t *c = coll;
  if (!c || c->magic != PS_RMA_MAGIC || !mh || (!data && size)) return ncclInvalidArgument;
  (void)mr_flags; /* FORCE_SO matters for GPU signal windows (issue 4), not host memory */
  if (type != NCCL_PTR_HOST) {
    PS_WARN("regMrSym: pointer type %d not supported yet (host memory only)", type);
    return ncclInvalidArgument;
  }
  if (c->nregions == c->cap_regions) {
    uint32_t cap = c->cap_regions ? 2 * c->cap_regions : 16;
    ps_rma_region_t **n = realloc(c->regions, cap * sizeof *n);
    if (!n) return ncclSystemError;
    c->regions = n, c->cap_regions = cap;
  }
  ps_rma_region_t *r = calloc(1, sizeof *r);
  size_t P = (size_t)c->nranks;
  if (!r || !(r->raddr = calloc(P, 8)) || !(r->rkey = calloc(P, 8)) || !(r->rsize = calloc(P, 8))) {
    if (r) free(r->raddr), free(r->rkey), free(r->rsize);
    free(r);
    return ncclSystemError;
  }
  *r = (ps_rma_region_t){.magic = PS_RMA_REG_MAGIC, .id = c->nregions, .comm = c, .base = data,
                         .size = size, .raddr = r->raddr, .rkey = r->rkey,
                         .rsize = r->rsize};
  uint64_t access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
  if (ps_ep_reg(&c->ep, data, size ? size : 1, access, &r->mr) != ncclSuccess) {
    ps_rma_dereg_sym(c, r);
    return ncclSystemError;
  }
  r->desc = fi_mr_desc(r->mr);
  c->regions[c->nregions++] = r;
  PS_CHECK(allgather_region(c, r));
  *mh = r;
  return ncclSuccess;
}

ncclResult_t ps_rma_dereg_sym(void *coll, void *mh) {
  ps_rma_comm_t *c = coll;
  ps_rma_region_t *r = mh;
  if (!c || c->magic != PS_RMA_MAGIC || !r || r->magic != PS_RMA_REG_MAGIC || r->comm != c) {
    PS_WARN("deregMrSym: %p is not a region of this comm", mh);
    return ncclInvalidArgument;
  }
  if (r->id < c->nregions && c->regions[r->id] == r) c->regions[r->id] = NULL;
  if (r->mr) fi_close(&r->mr->fid);
  free(r->raddr), free(r->rkey), free(r->rsize);
  r->magic = 0;
  free(r);
  return ncclSuccess;
}

ps_rma_region_t *ps_rma_region(ps_rma_comm_t *c, void *mh) {
  ps_rma_region_t *r = mh;
  return (r && r->magic == PS_RMA_REG_MAGIC && r->comm == c) ? r : NULL;
}

ps_ordering_t ps_rma_ordering(void *coll) { return ((ps_rma_comm_t *)coll)->ordering; }
