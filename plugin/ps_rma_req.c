/* One-sided engine: requests and the handle tables of requests and
 * windows. Requests come in registered chunks (a signal message lives in
 * its request) and go back to a free list; what NCCL holds is a handle,
 * refused once the request was reported done. NCCL's thread takes them
 * (reqs_lock) and gives back those test() lets go of last; those the engine
 * lets go of last come back through the comm's returned list. */
#include <stdlib.h>
#include <string.h>

#include "ps_log.h"
#include "ps_rma_int.h"

/* A request's handle is bound while NCCL may test it, from the call that
 * made it until test() reports it done: a later test() of that value is
 * refused, even once the request's memory serves a new request. */
ps_htab_t ps_rma_req_tab = PS_HTAB_INIT(0x72, "one-sided request",
                                        "reported done by test(), or its comm closed");
/* A window's handle is bound from regMrSym until deregMrSym (ps_rma_comm.c). */
ps_htab_t ps_rma_win_tab = PS_HTAB_INIT(0x77, "one-sided window (mhandle)",
                                        "deregistered, or its comm closed");

void ps_rma_window_refused(ps_rma_comm_t *c, const char *call, const char *role, void *mh) {
  ps_rma_region_t *r = ps_htab_get(&ps_rma_win_tab, mh);
  if (r) {
    PS_WARN("%s: %s window %p (window %u, %zu B at %p) belongs to another one-sided comm (rank %d "
            "of %d), not this one (rank %d of %d)", call, role, mh, r->id, r->size,
            (void *)r->base, r->comm->rank, r->comm->nranks, c->rank, c->nranks);
    return;
  }
  char why[200];
  ps_htab_explain(&ps_rma_win_tab, mh, why, sizeof why);
  PS_WARN("%s: %s window: %s", call, role, why);
}

/* NCCL's GIN proxy keeps up to PERSEUS_PROXY_QUEUE requests per peer in
 * flight: a comm may need that many for every rank, beyond the floor that
 * catches a caller that never tests (handle slots bound it from above). */
static uint64_t most_reqs(const ps_rma_comm_t *c) {
  uint64_t most = (uint64_t)ps_fabric_config()->proxy_queue * (uint64_t)c->nranks;
  if (most < PS_RMA_MAX_REQS) most = PS_RMA_MAX_REQS;
  return most < (1ull << PS_HTAB_IDX_BITS) ? most : (1ull << PS_HTAB_IDX_BITS);
}

static ncclResult_t grow_reqs(ps_rma_comm_t *c) {
  if (c->nreqs >= most_reqs(c)) {
    PS_WARN("one-sided comm: over %llu operations outstanding (PERSEUS_PROXY_QUEUE %lld x %d "
            "ranks, at least %u); test() completed requests first",
            (unsigned long long)most_reqs(c), (long long)ps_fabric_config()->proxy_queue, c->nranks,
            PS_RMA_MAX_REQS);
    return ncclInvalidUsage;
  }
  ps_rma_req_chunk_t *k = aligned_alloc(PS_CACHE_LINE, sizeof *k); /* its requests' lines */
  if (k) memset(k, 0, sizeof *k);
  if (!k) {
    PS_WARN("one-sided comm: out of memory for %u more requests", PS_RMA_REQ_CHUNK);
    return ncclSystemError;
  }
  ncclResult_t rc = ps_htab_reserve(&ps_rma_req_tab, PS_RMA_REQ_CHUNK, &k->first_slot);
  if (rc != ncclSuccess) {
    free(k);
    return rc;
  }
  if (ps_ep_reg_local(&c->ep, k->reqs, sizeof k->reqs, &k->mr) != ncclSuccess) {
    ps_htab_release(&ps_rma_req_tab, k->first_slot, PS_RMA_REQ_CHUNK);
    free(k);
    return ncclSystemError;
  }
  void *desc = k->mr ? fi_mr_desc(k->mr) : NULL;
  for (int i = PS_RMA_REQ_CHUNK - 1; i >= 0; i--) {
    k->reqs[i].slot = k->first_slot + (uint32_t)i;
    k->reqs[i].chunk_desc = desc;
    k->reqs[i].next = c->free_reqs;
    c->free_reqs = &k->reqs[i];
  }
  k->next = c->chunks;
  c->chunks = k;
  c->nreqs += PS_RMA_REQ_CHUNK;
  return ncclSuccess;
}

void ps_rma_free_reqs(ps_rma_comm_t *c) {
  while (c->chunks) {
    ps_rma_req_chunk_t *k = c->chunks;
    c->chunks = k->next;
    /* requests still outstanding go stale with their comm */
    ps_htab_release(&ps_rma_req_tab, k->first_slot, PS_RMA_REQ_CHUNK);
    if (k->mr) fi_close(&k->mr->fid);
    free(k);
  }
  c->free_reqs = c->returned = NULL;
}

/* Called with reqs_lock held: r joins NCCL's free list. */
static void recycle(ps_rma_comm_t *c, ps_rma_req_t *r) {
  r->next = c->free_reqs;
  c->free_reqs = r;
}

ncclResult_t ps_rma_req_get(ps_rma_comm_t *c, uint32_t peer, ps_rma_req_t **out) {
  ps_rma_lock_if_threaded(c, &c->reqs_lock);
  if (!c->free_reqs && __atomic_load_n(&c->returned, __ATOMIC_RELAXED)) {
    if (c->threaded) { /* the engine pushes onto it without c->lock */
      c->free_reqs = __atomic_exchange_n(&c->returned, NULL, __ATOMIC_ACQUIRE);
    } else {
      c->free_reqs = c->returned;
      c->returned = NULL;
    }
  }
  ncclResult_t rc = c->free_reqs ? ncclSuccess : grow_reqs(c);
  ps_rma_req_t *r = c->free_reqs;
  if (rc == ncclSuccess) c->free_reqs = r->next;
  ps_rma_unlock_if_threaded(c, &c->reqs_lock);
  PS_CHECK(rc);
  void *desc = r->chunk_desc;
  uint32_t slot = r->slot;
  memset(r, 0, offsetof(ps_rma_req_t, ts)); /* start() clears ts when stats are on */
  r->slot = slot;
  r->chunk_desc = desc;
  r->comm = c;
  r->peer = peer;
  r->handle = ps_htab_bind(&ps_rma_req_tab, slot, r);
  PS_RMA_SHARED_ADD(c, c->live_reqs, 1);
  *out = r;
  return ncclSuccess;
}

void ps_rma_req_put(ps_rma_comm_t *c, ps_rma_req_t *r) {
  ps_htab_unbind(&ps_rma_req_tab, r->slot);
  PS_RMA_SHARED_ADD(c, c->live_reqs, -1);
  ps_rma_lock_if_threaded(c, &c->reqs_lock);
  recycle(c, r);
  ps_rma_unlock_if_threaded(c, &c->reqs_lock);
}

void ps_rma_req_reported(ps_rma_comm_t *c, ps_rma_req_t *r) {
  ps_htab_unbind(&ps_rma_req_tab, r->slot);
  PS_RMA_SHARED_ADD(c, c->live_reqs, -1);
  /* last: once both bits are set r may be reused at once */
  if (ps_rma_life_mark(c, r, PS_REQ_REPORTED) & PS_REQ_SETTLED) {
    ps_rma_lock_if_threaded(c, &c->reqs_lock);
    recycle(c, r);
    ps_rma_unlock_if_threaded(c, &c->reqs_lock);
  }
}

/* Why test() refused `request`: never reads what a stale handle once named. */
void ps_rma_req_refused(ps_rma_comm_t *c, const void *request) {
  ps_rma_req_t *r = ps_htab_get(&ps_rma_req_tab, request);
  if (r) {
    PS_WARN("one-sided test: %p is a live request of another comm (rank %d of %d), not of this "
            "one (rank %d of %d)", request, r->comm->rank, r->comm->nranks, c->rank, c->nranks);
    return;
  }
  ps_htab_refused(&ps_rma_req_tab, request, "one-sided test");
}

