/* One-sided engine, data path: puts (RMA writes with delivery completion),
 * put+signal under the ordering strategy, signals applied at the target, and
 * progress. Every offset and size, local or from a peer, is checked against
 * the region it names before anything is read or written. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_comm.h"
#include "ps_log.h"
#include "ps_rma_int.h"

#ifdef PS_REORDER_TEST
/* Test builds only (perseus_rma_test_reorder): an unordered NIC. Writes are
 * held and sent later in random order, so a signal that does not wait for
 * its data overtakes it. Never compiled into the plugin. */
struct ps_held_write {
  struct iovec iov;
  struct fi_rma_iov rma;
  void *desc, *context;
  fi_addr_t addr;
  uint64_t release_ns; /* held for a random 0-2 ms: long enough to be overtaken */
};

static uint64_t next_rand(ps_rma_comm_t *c) {
  c->rng = c->rng * 6364136223846793005ULL + 1442695040888963407ULL;
  return c->rng >> 17;
}

static ncclResult_t post_write(ps_rma_comm_t *c, const struct fi_msg_rma *m, uint64_t flags,
                               int *posted) {
  (void)flags;
  *posted = 0;
  if (c->nheld == c->cap_held) {
    int cap = c->cap_held ? 2 * c->cap_held : 256;
    struct ps_held_write *n = realloc(c->held, (size_t)cap * sizeof *n);
    if (!n) return ncclSystemError;
    c->held = n, c->cap_held = cap;
  }
  *posted = 1;
  c->held[c->nheld++] = (struct ps_held_write){.iov = m->msg_iov[0], .rma = m->rma_iov[0],
                                               .desc = m->desc[0], .context = m->context,
                                               .addr = m->addr,
                                               .release_ns = ps_now_ns() + next_rand(c) % 2000000};
  return ncclSuccess;
}

/* Sends the held writes whose time has come, in random order. */
static void release_held(ps_rma_comm_t *c) {
  uint64_t now = ps_now_ns();
  for (int tries = c->nheld; tries > 0 && c->nheld > 0; tries--) {
    int i = (int)(next_rand(c) % (uint64_t)c->nheld);
    struct ps_held_write *h = &c->held[i];
    if (h->release_ns > now) continue;
    struct fi_msg_rma m = {.msg_iov = &h->iov, .desc = &h->desc, .iov_count = 1, .addr = h->addr,
                           .rma_iov = &h->rma, .rma_iov_count = 1, .context = h->context};
    ssize_t rc = fi_writemsg(c->ep.ep, &m, FI_COMPLETION | FI_DELIVERY_COMPLETE);
    if (rc == -FI_EAGAIN) return;
    if (rc) {
      ps_rma_fail(c, ncclSystemError, "held write: %s", fi_strerror((int)-rc));
      return;
    }
    c->held[i] = c->held[--c->nheld];
  }
}
#else
static ncclResult_t post_write(ps_rma_comm_t *c, const struct fi_msg_rma *m, uint64_t flags,
                               int *posted) {
  return ps_ep_writemsg(&c->ep, m, flags, posted);
}
static void release_held(ps_rma_comm_t *c) { (void)c; }
#endif

/* One progress step of the engine's endpoint. */
static ncclResult_t step(ps_rma_comm_t *c) {
  release_held(c);
  return ps_ep_progress(&c->ep, 256, NULL);
}

static ps_rma_comm_t *rma_comm(void *coll) {
  ps_rma_comm_t *c = coll;
  return (c && c->magic == PS_RMA_MAGIC) ? c : NULL;
}

/* --- target side: signals arrive as messages and are applied here --- */

static void apply_signal(ps_rma_comm_t *c, const ps_rma_sig_slot_t *s, size_t len) {
  ps_sig_msg_t m;
  if (ps_sig_decode(&s->msg, len, (uint32_t)c->nranks, &m) != ncclSuccess) {
    ps_rma_fail(c, ncclRemoteError, "malformed signal message dropped");
    return;
  }
  ps_rma_region_t *r = m.region_id < c->nregions ? c->regions[m.region_id] : NULL;
  if (!r || m.offset % 8 || m.offset > r->size || r->size - m.offset < 8) {
    ps_rma_fail(c, ncclRemoteError,
                "signal from rank %u rejected: region %u offset %llu outside its %zu bytes",
                m.src_rank, m.region_id, (unsigned long long)m.offset, r ? r->size : (size_t)0);
    return;
  }
  uint64_t add = m.op == NCCL_NET_SIGNAL_OP_INC ? 1 : m.value;
  /* The data this signal covers was delivered before the signal was sent;
   * release ordering publishes the new value after anything this thread wrote. */
  __atomic_fetch_add((uint64_t *)(r->base + m.offset), add, __ATOMIC_RELEASE);
}

static ncclResult_t post_sig_slot(ps_rma_comm_t *c, ps_rma_sig_slot_t *s);

static void sig_rx_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err,
                        const char *errstr) {
  ps_rma_sig_slot_t *s = op->owner;
  ps_rma_comm_t *c = s->comm;
  if (err) {
    if (err != -FI_ECANCELED) ps_rma_fail(c, ncclRemoteError, "signal receive failed: %s", errstr);
    return;
  }
  apply_signal(c, s, e->len);
  if (post_sig_slot(c, s) != ncclSuccess) ps_rma_fail(c, ncclSystemError, "cannot re-post a signal receive");
}

static ncclResult_t post_sig_slot(ps_rma_comm_t *c, ps_rma_sig_slot_t *s) {
  int ok = 0;
  PS_CHECK(ps_ep_trecv(&c->ep, &s->msg, sizeof s->msg, NULL, PS_TAG_RMA_SIG, &s->op, &ok));
  return ok ? ncclSuccess : ncclSystemError;
}

ncclResult_t ps_rma_post_sig_slots(ps_rma_comm_t *c) {
  for (int i = 0; i < PS_RMA_SIG_SLOTS; i++) {
    c->sig_slots[i].op = (ps_op_t){.cb = sig_rx_done, .owner = &c->sig_slots[i], .idx = i};
    c->sig_slots[i].comm = c;
    PS_CHECK(post_sig_slot(c, &c->sig_slots[i]));
  }
  return ncclSuccess;
}

/* --- origin side --- */

static ps_rma_req_t *req_get(ps_rma_comm_t *c, uint32_t peer) {
  ps_rma_req_t *r = c->free_reqs;
  if (!r) return NULL;
  c->free_reqs = r->next;
  memset(r, 0, sizeof *r);
  r->magic = PS_RMA_REQ_MAGIC;
  r->comm = c;
  r->peer = peer;
  return r;
}

static void req_put(ps_rma_comm_t *c, ps_rma_req_t *r) {
  r->magic = 0;
  r->next = c->free_reqs;
  c->free_reqs = r;
}

static void sig_tx_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err,
                        const char *errstr) {
  ps_rma_req_t *r = op->owner;
  (void)e;
  r->sig_pending = 0;
  if (err && err != -FI_ECANCELED) {
    r->status = ncclRemoteError;
    ps_rma_fail(r->comm, ncclRemoteError, "signal to rank %u failed: %s", r->peer, errstr);
  }
}

/* Posts the signal message; *posted = 0 when the provider is still refusing
 * (-FI_EAGAIN: its queues are full), in which case the signal stays parked. */
static ncclResult_t post_signal(ps_rma_comm_t *c, ps_rma_req_t *r, int *posted) {
  r->sig_op = (ps_op_t){.cb = sig_tx_done, .owner = r};
  r->sig_pending = 1;
  ncclResult_t rc = ps_ep_tsend(&c->ep, &r->sig, sizeof r->sig, NULL, c->addr[r->peer],
                                PS_TAG_RMA_SIG, &r->sig_op, posted);
  if (rc != ncclSuccess || !*posted) {
    r->sig_pending = 0;
    return rc;
  }
  c->peers[r->peer].st.signals++;
  return ncclSuccess;
}

static void park(ps_rma_peer_t *p, ps_rma_req_t *r) {
  r->parked = 1;
  r->next = NULL;
  if (p->park_tail) p->park_tail->next = r;
  else p->park_head = r;
  p->park_tail = r;
}

/* Signals parked behind puts leave, in order, once those puts delivered. */
static void release_parked(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  while (p->park_head && p->done_below >= p->park_head->need_done) {
    ps_rma_req_t *r = p->park_head;
    int posted = 0;
    ncclResult_t rc = post_signal(c, r, &posted);
    if (rc != ncclSuccess) {
      r->status = rc;
      ps_rma_fail(c, rc, "signal to rank %u could not be posted", r->peer);
    } else if (!posted) {
      c->sig_backlog = 1; /* retried by progress */
      return;
    }
    p->park_head = r->next;
    if (!p->park_head) p->park_tail = NULL;
    r->next = NULL;
    r->parked = 0;
  }
}

static void put_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_rma_req_t *r = op->owner;
  ps_rma_comm_t *c = r->comm;
  ps_rma_peer_t *p = &c->peers[r->peer];
  (void)e;
  r->put_pending = 0;
  if (err) {
    if (err == -FI_ECANCELED) return;
    r->status = ncclRemoteError;
    ps_rma_fail(c, ncclRemoteError, "put to rank %u failed: %s", r->peer, errstr);
    return;
  }
  /* Completions come in any order: done_below only moves over a gap-free run. */
  p->done[r->put_seq % PS_RMA_SEQ_RING] = 1;
  while (p->done_below < p->next_seq && p->done[p->done_below % PS_RMA_SEQ_RING]) {
    p->done[p->done_below % PS_RMA_SEQ_RING] = 0;
    p->done_below++;
  }
  release_parked(c, p);
}

/* Validates and posts the RMA write of a put; assigns its sequence number. */
static ncclResult_t post_put(ps_rma_comm_t *c, ps_rma_req_t *r, uint64_t src_off, void *src_mh,
                             size_t size, uint64_t dst_off, void *dst_mh) {
  ps_rma_region_t *src = ps_rma_region(c, src_mh), *dst = ps_rma_region(c, dst_mh);
  uint32_t peer = r->peer;
  if (!src || !dst || src_off > src->size || src->size - src_off < size ||
      dst_off > dst->rsize[peer] || dst->rsize[peer] - dst_off < size) {
    PS_WARN("put of %zu B from offset %llu to rank %u offset %llu falls outside its regions", size,
            (unsigned long long)src_off, peer, (unsigned long long)dst_off);
    return ncclInvalidArgument;
  }
  ps_rma_peer_t *p = &c->peers[peer];
  struct iovec iov = {.iov_base = src->base + src_off, .iov_len = size};
  struct fi_rma_iov rma = {.addr = dst->raddr[peer] + dst_off, .len = size, .key = dst->rkey[peer]};
  void *desc = src->desc;
  r->put_op = (ps_op_t){.cb = put_done, .owner = r};
  struct fi_msg_rma msg = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = c->addr[peer],
                           .rma_iov = &rma, .rma_iov_count = 1, .context = &r->put_op};
  /* Delivery completion: a completed put is in the target's memory, which is
   * what lets deferred and drain release a signal behind it. */
  int posted = 0;
  ncclResult_t rc = post_write(c, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE, &posted);
  if (rc != ncclSuccess) {
    ps_rma_fail(c, rc, "put to rank %u could not be posted", peer);
    return rc;
  }
  if (!posted) return ncclInProgress; /* still refused: the caller backs off */
  r->put_pending = 1;
  r->put_seq = p->next_seq++;
  p->st.puts++;
  uint64_t inflight = p->next_seq - p->done_below;
  if (inflight > p->st.inflight_max) p->st.inflight_max = inflight;
  return ncclSuccess;
}

static ncclResult_t start(ps_rma_comm_t *c, uint32_t rank, uint64_t src_off, void *src_mh,
                          size_t size, uint64_t dst_off, void *dst_mh, ps_rma_req_t **out) {
  *out = NULL;
  if (c->error) return c->error;
  if (rank >= (uint32_t)c->nranks) {
    PS_WARN("rank %u out of range (%d ranks)", rank, c->nranks);
    return ncclInvalidArgument;
  }
  ps_rma_peer_t *p = &c->peers[rank];
  if (p->next_seq - p->done_below >= PS_RMA_SEQ_RING) return ncclSuccess; /* backpressure */
  ps_rma_req_t *r = req_get(c, rank);
  if (!r) return ncclSuccess;
  if (size) {
    ncclResult_t rc = post_put(c, r, src_off, src_mh, size, dst_off, dst_mh);
    if (rc != ncclSuccess) {
      req_put(c, r);
      return rc == ncclInProgress ? ncclSuccess : rc;
    }
  }
  *out = r;
  return ncclSuccess;
}

ncclResult_t ps_rma_iput(void *coll, uint64_t src_off, void *src_mh, size_t size,
                         uint64_t dst_off, void *dst_mh, uint32_t rank, void **req) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !req) return ncclInvalidArgument;
  return start(c, rank, src_off, src_mh, size, dst_off, dst_mh, (ps_rma_req_t **)req);
}

ncclResult_t ps_rma_iput_signal(void *coll, uint64_t src_off, void *src_mh, size_t size,
                                uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t sig_off,
                                void *sig_mh, uint64_t value, uint32_t op, void **req) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !req) return ncclInvalidArgument;
  ps_rma_region_t *sig = ps_rma_region(c, sig_mh);
  if (!sig || (op != NCCL_NET_SIGNAL_OP_INC && op != NCCL_NET_SIGNAL_OP_ADD) ||
      rank >= (uint32_t)c->nranks || sig_off % 8 || sig_off > sig->rsize[rank] ||
      sig->rsize[rank] - sig_off < 8) {
    PS_WARN("putSignal: signal at offset %llu (op %u) is not an aligned 8-byte word of a region "
            "of rank %u", (unsigned long long)sig_off, op, rank);
    return ncclInvalidArgument;
  }
  ps_rma_req_t *r;
  PS_CHECK(start(c, rank, src_off, src_mh, size, dst_off, dst_mh, &r));
  *req = r;
  if (!r) return ncclSuccess;
  ps_rma_peer_t *p = &c->peers[rank];
  r->sig = (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .op = (uint16_t)op,
                          .src_rank = (uint32_t)c->rank, .region_id = sig->id, .offset = sig_off,
                          .value = value};
  r->need_done = p->next_seq; /* this put and every earlier one to the peer */
  if (c->ordering == PS_ORD_UNSAFE) r->need_done = 0; /* the broken baseline: no wait at all */
  if (p->done_below < r->need_done) {
    if (c->ordering == PS_ORD_DRAIN) { /* the baseline: wait here for the NIC to drain */
      uint64_t t0 = ps_now_ns();
      p->st.fences_posted++;
      /* ps_rma_progress records an endpoint failure in c->error: no endless wait */
      while (p->done_below < r->need_done && ps_rma_progress(c) == ncclSuccess) continue;
      p->st.blocked_ns += ps_now_ns() - t0;
      if (c->error) return c->error;
    } else {
      p->st.fences_avoided++; /* deferred: parked, the proxy moves on */
    }
  } else {
    p->st.fences_avoided++; /* nothing in flight ahead of it */
  }
  park(p, r); /* behind any signal still waiting, then released in order */
  release_parked(c, p);
  return c->error;
}

ncclResult_t ps_rma_progress(void *coll) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c) return ncclInvalidArgument;
  if (c->error) return c->error;
  ncclResult_t rc = step(c);
  if (rc != ncclSuccess) ps_rma_fail(c, rc, "%s", c->ep.fatal);
  if (c->sig_backlog && !c->error) { /* signals the provider refused earlier */
    c->sig_backlog = 0;
    for (int p = 0; p < c->nranks; p++) release_parked(c, &c->peers[p]);
  }
  return c->error;
}

ncclResult_t ps_rma_test(void *coll, void *request, int *done) {
  ps_rma_comm_t *c = rma_comm(coll);
  ps_rma_req_t *r = request;
  if (!c || !done || !r || r->magic != PS_RMA_REQ_MAGIC || r->comm != c) {
    PS_WARN("one-sided test: %p is not a live request of this comm", request);
    return ncclInvalidArgument;
  }
  *done = 0;
  ncclResult_t rc = ps_rma_progress(c);
  if (r->status) return r->status;
  if (rc != ncclSuccess) return rc;
  if (r->put_pending || r->sig_pending || r->parked) return ncclSuccess;
  *done = 1;
  req_put(c, r);
  return ncclSuccess;
}

ncclResult_t ps_rma_last_error(void *coll, bool *has_error) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !has_error) return ncclInvalidArgument;
  *has_error = c->error != ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ps_rma_peer_stats(void *coll, uint32_t rank, ps_rma_peer_stats_t *out) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !out || rank >= (uint32_t)c->nranks) return ncclInvalidArgument;
  *out = c->peers[rank].st;
  return ncclSuccess;
}
