/* One-sided engine, origin side: puts, gets and put+signal under the
 * ordering strategy, and progress.
 *
 * Every call is accepted at once (NCCL's GIN proxy never retries): its put
 * goes to the peer's data queue, its signal to the peer's signal queue, and
 * pump() posts from the heads, in call order, as far as the provider takes
 * them. A signal leaves only after every put it covers was posted, and
 * when and as its strategy allows (ps_rma_order.c). Callbacks only record
 * completions; posting happens in pump(), never inside a completion, so
 * nothing re-enters the queues. */
#include <stdlib.h>
#include <string.h>

#include "ps_clock.h"
#include "ps_log.h"
#include "ps_rma_int.h"

static ps_rma_comm_t *rma_comm(void *coll) { return ps_rma_live(coll); }

/* --- requests: allocated in registered chunks, recycled through a free list --- */

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

static ncclResult_t grow_reqs(ps_rma_comm_t *c) {
  if (c->nreqs >= PS_RMA_MAX_REQS) {
    PS_WARN("one-sided comm: over %u operations outstanding; test() completed requests first",
            PS_RMA_MAX_REQS);
    return ncclInvalidUsage;
  }
  ps_rma_req_chunk_t *k = calloc(1, sizeof *k);
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
  c->free_reqs = NULL;
}

static ncclResult_t req_get(ps_rma_comm_t *c, uint32_t peer, ps_rma_req_t **out) {
  if (!c->free_reqs) PS_CHECK(grow_reqs(c));
  ps_rma_req_t *r = c->free_reqs;
  c->free_reqs = r->next;
  void *desc = r->chunk_desc;
  uint32_t slot = r->slot;
  memset(r, 0, offsetof(ps_rma_req_t, ts)); /* start() clears ts when stats are on */
  r->slot = slot;
  r->chunk_desc = desc;
  r->comm = c;
  r->peer = peer;
  r->handle = ps_htab_bind(&ps_rma_req_tab, slot, r);
  if (c->calls) c->calls->live++;
  *out = r;
  return ncclSuccess;
}

static void req_put(ps_rma_comm_t *c, ps_rma_req_t *r) {
  ps_htab_unbind(&ps_rma_req_tab, r->slot);
  if (c->calls) c->calls->live--;
  r->next = c->free_reqs;
  c->free_reqs = r;
}

/* --- completions (record only; a signal's in ps_rma_order.c) --- */

static void data_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_rma_req_t *r = op->owner;
  (void)e;
  ps_rma_put_done(r, r->seq, err, errstr);
}

/* --- posting from the queues --- */

static ncclResult_t post_data(ps_rma_comm_t *c, ps_rma_req_t *r, int *posted) {
  r->data_op = (ps_op_t){.cb = data_done, .owner = r};
  struct fi_msg_rma m = {.msg_iov = &r->iov, .desc = &r->desc, .iov_count = 1,
                         .addr = c->addr[r->peer], .rma_iov = &r->rma, .rma_iov_count = 1,
                         .context = &r->data_op};
  if (r->is_get) return ps_rma_post_read(c, &m, posted);
  return ps_rma_post_put(c, r->peer, &m, r->seq, posted);
}

/* Posts this peer's signals whose puts allow it, in order. Returns 0 when
 * none is left that could go, 1 when the provider or PERSEUS_RMA_INFLIGHT
 * held one back, -1 when the comm failed. */
static int post_ready_sigs(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  int posted;
  while (p->sq_head && !c->error && ps_order_sig_ready(c, p, p->sq_head)) {
    ps_rma_req_t *r = p->sq_head;
    if (ps_rma_peer_full(c, p)) {
      ps_rma_note_held(p, PS_HELD_INFLIGHT);
      return 1;
    }
    /* every staged write sent so far, which holds every put it covers
     * (those were posted before it, and a staged write's sequence is given
     * when it is posted) */
    r->sig.covers_staged = p->stage_sent - 1;
    uint64_t t0 = ps_rma_post_begins(p);
    ncclResult_t rc = ps_order_post_sig(c, r, &posted);
    if (rc != ncclSuccess) {
      r->status = rc;
      ps_rma_fail(c, rc, "signal to rank %u could not be posted", r->peer);
      return -1;
    }
    if (p->ops) ps_rma_note_post(p, t0, posted, &r->ts.sig_posted);
    if (!posted) return 1;
    r->sig_stage = PS_STAGE_POSTED;
    ps_rma_op_started(c, p);
    p->st.signals++;
    p->sq_head = r->next_sig;
    if (!p->sq_head) p->sq_tail = NULL;
  }
  return c->error ? -1 : 0;
}

/* Posts what the provider takes from this peer's queues, in call order: a
 * signal goes as soon as the puts it covers are posted, before later puts,
 * so that a bound on posted operations never holds it behind them. */
static void pump(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  int posted, sigs;
  c->now_ns = ps_now_ns(); /* completions read while posting are stamped with it */
  if (c->stage && p->prep_req) ps_stage_prepare(c, p);
  while (p->dq_head && !c->error) {
    if ((sigs = post_ready_sigs(c, p)) < 0) return;
    if (sigs) goto refused;
    ps_rma_req_t *r = p->dq_head;
    if (r->staged) { /* chunk by chunk, as their copies finish and credits allow */
      int all = 0, refused = 0;
      ncclResult_t rc = ps_stage_post(c, p, r, &all, &refused);
      if (rc != ncclSuccess) {
        r->status = rc;
        ps_rma_fail(c, rc, "staged put to rank %u failed", r->peer);
        return;
      }
      if (refused) goto refused;
      if (!all) {
        c->backlog = 1; /* waits for a copy, a slot, a credit or a completion */
        break;
      }
    } else {
      if (ps_rma_peer_full(c, p)) {
        ps_rma_note_held(p, PS_HELD_INFLIGHT);
        goto refused;
      }
      uint64_t t0 = ps_rma_post_begins(p);
      ncclResult_t rc = post_data(c, r, &posted);
      if (rc != ncclSuccess) {
        r->status = rc;
        ps_rma_fail(c, rc, "%s to rank %u could not be posted", r->is_get ? "get" : "put", r->peer);
        return;
      }
      if (p->ops) ps_rma_note_post(p, t0, posted, &r->ts.posted);
      if (!posted) goto refused;
      ps_rma_op_started(c, p);
      if (!r->is_get) p->posted_below = r->seq + 1;
    }
    if (r->nchunks) { /* not a signal riding alone (no data) */
      if (r->data_stage != PS_STAGE_DONE) r->data_stage = PS_STAGE_POSTED;
      if (!r->is_get) p->st.puts++;
    }
    if (p->prep_req == r) p->prep_req = r->next;
    p->dq_head = r->next;
    if (!p->dq_head) p->dq_tail = NULL;
  }
  if (post_ready_sigs(c, p) <= 0) return;
refused:
  c->backlog = 1; /* the provider's queues or PERSEUS_RMA_INFLIGHT are full: progress retries */
}

/* r joins the peer's data queue (and the staging prepare list) at the tail. */
static void dq_append(ps_rma_peer_t *p, ps_rma_req_t *r) {
  r->next = NULL;
  if (!p->prep_req) p->prep_req = r;
  if (p->dq_tail) p->dq_tail->next = r;
  else p->dq_head = r;
  p->dq_tail = r;
}

/* Checks the regions and queues the put (or get) part of a request: the
 * local part against our registration, the remote one against the size the
 * peer advertised for its part of the window. */
static ncclResult_t queue_data(ps_rma_comm_t *c, ps_rma_req_t *r, int is_get, uint64_t local_off,
                               void *local_mh, size_t size, uint64_t remote_off, void *remote_mh) {
  ps_rma_region_t *loc = ps_rma_window(c, local_mh), *rem = ps_rma_window(c, remote_mh);
  uint32_t peer = r->peer;
  if (!loc || !rem) {
    const char *call = is_get ? "iget" : "iput";
    if (!loc) ps_rma_window_refused(c, call, is_get ? "local destination" : "source", local_mh);
    if (!rem) ps_rma_window_refused(c, call, is_get ? "remote source" : "destination", remote_mh);
    return ncclInvalidArgument;
  }
  if (local_off > loc->size || loc->size - local_off < size || remote_off > rem->rsize[peer] ||
      rem->rsize[peer] - remote_off < size) {
    PS_WARN("%s of %zu B at local offset %llu, rank %u offset %llu falls outside its windows "
            "(local window %u: %zu B, rank %u's part of window %u: %llu B)",
            is_get ? "get" : "put", size, (unsigned long long)local_off, peer,
            (unsigned long long)remote_off, loc->id, loc->size, peer, rem->id,
            (unsigned long long)rem->rsize[peer]);
    return ncclInvalidArgument;
  }
  if (is_get && (loc->staged || rem->staged)) {
    PS_WARN("get from rank %u with GPU memory on either side: staging covers puts only; reading "
            "GPU windows needs a provider with FI_HMEM", peer);
    return ncclInvalidUsage;
  }
  ps_rma_peer_t *p = &c->peers[peer];
  r->is_get = (uint8_t)is_get;
  r->iov = (struct iovec){.iov_base = loc->base + local_off, .iov_len = size};
  r->rma = (struct fi_rma_iov){.addr = rem->raddr[peer] + remote_off, .len = size,
                               .key = rem->rkey[peer]};
  r->desc = loc->desc;
  r->nchunks = 1;
  if (loc->staged || rem->staged) {
    r->staged = 1, r->src_gpu = (uint8_t)loc->staged, r->dst_staged = (uint8_t)rem->staged;
    r->src = loc->base + local_off;
    r->dst_region = rem->id, r->dst_off = remote_off;
    if (size > c->stage->chunk) r->nchunks = (uint32_t)((size + c->stage->chunk - 1) / c->stage->chunk);
  }
  if (!is_get) r->seq = p->next_seq, p->next_seq += r->nchunks;
  ps_rma_use_window(r, loc);
  ps_rma_use_window(r, rem);
  r->data_stage = PS_STAGE_QUEUED;
  ps_rma_wake(p);
  dq_append(p, r);
  return ncclSuccess;
}

static ncclResult_t start(ps_rma_comm_t *c, uint32_t rank, ps_rma_req_t **out) {
  *out = NULL;
  if (c->error) return c->error;
  if (rank >= (uint32_t)c->nranks) {
    PS_WARN("one-sided operation to rank %u, but the comm has %d ranks", rank, c->nranks);
    return ncclInvalidArgument;
  }
  PS_CHECK(req_get(c, rank, out));
  if (c->opstats) ps_rma_note_call(*out);
  return ncclSuccess;
}

/* A put (local -> rank) or a get (rank -> local) with no signal. */
static ncclResult_t data_body(void *coll, int is_get, uint64_t local_off, void *local_mh,
                              size_t size, uint64_t remote_off, void *remote_mh, uint32_t rank,
                              void **req) {
  ps_rma_comm_t *c = rma_comm(coll);
  ps_rma_req_t *r;
  if (!c || !req) return ncclInvalidArgument;
  *req = NULL;
  PS_CHECK(start(c, rank, &r));
  ncclResult_t rc = queue_data(c, r, is_get, local_off, local_mh, size, remote_off, remote_mh);
  if (rc != ncclSuccess) {
    req_put(c, r);
    return rc;
  }
  pump(c, &c->peers[rank]);
  *req = r->handle;
  return c->error;
}

/* Host memory needs no flush: a completed get is visible to the CPU and to
 * a GPU reading host memory. NCCL takes a NULL request as already done. */
static ncclResult_t iflush_body(void *coll, void *mh, uint32_t rank, void **req) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !req) return ncclInvalidArgument;
  if (!ps_rma_window(c, mh)) {
    ps_rma_window_refused(c, "iflush", "flushed", mh);
    return ncclInvalidArgument;
  }
  if (rank >= (uint32_t)c->nranks) {
    PS_WARN("iflush: rank %u, but the comm has %d ranks", rank, c->nranks);
    return ncclInvalidArgument;
  }
  *req = NULL;
  return c->error;
}

/* drain, the baseline: block until the puts the signal covers completed. */
static ncclResult_t drain(ps_rma_comm_t *c, ps_rma_peer_t *p, uint64_t need) {
  uint64_t t0 = ps_now_ns();
  while (p->done.below < need && ps_rma_progress(c) == ncclSuccess) continue;
  p->st.blocked_ns += ps_now_ns() - t0;
  return c->error;
}

static ncclResult_t iput_signal_body(void *coll, uint64_t src_off, void *src_mh, size_t size,
                                uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t sig_off,
                                void *sig_mh, uint64_t value, uint32_t op, void **req) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !req) return ncclInvalidArgument;
  *req = NULL;
  ps_rma_region_t *sig = ps_rma_window(c, sig_mh);
  if (!sig) {
    ps_rma_window_refused(c, "iputSignal", "signal", sig_mh);
    return ncclInvalidArgument;
  }
  if ((op != NCCL_NET_SIGNAL_OP_INC && op != NCCL_NET_SIGNAL_OP_ADD) ||
      rank >= (uint32_t)c->nranks || sig_off % 8 || sig_off > sig->rsize[rank] ||
      sig->rsize[rank] - sig_off < 8) {
    PS_WARN("putSignal: signal at offset %llu (op %u, expected 1 INC or 2 ADD) is not an aligned "
            "8-byte word of rank %u's part of window %u (%llu B; the comm has %d ranks)",
            (unsigned long long)sig_off, op, rank, sig->id,
            rank < (uint32_t)c->nranks ? (unsigned long long)sig->rsize[rank] : 0ULL, c->nranks);
    return ncclInvalidArgument;
  }
  /* A signal alone moves no data, and NCCL passes NULL data windows with
   * it; anything else must still be a live window of this comm. */
  for (int i = 0; i < 2 && !size; i++) {
    void *mh = i ? dst_mh : src_mh;
    if (mh && !ps_rma_window(c, mh)) {
      ps_rma_window_refused(c, "iputSignal without data", i ? "destination" : "source", mh);
      return ncclInvalidArgument;
    }
  }
  ps_rma_req_t *r;
  PS_CHECK(start(c, rank, &r));
  ps_rma_peer_t *p = &c->peers[rank];
  if (size) {
    ncclResult_t rc = queue_data(c, r, 0, src_off, src_mh, size, dst_off, dst_mh);
    if (rc != ncclSuccess) {
      req_put(c, r);
      return rc;
    }
  }
  r->need = p->next_seq; /* its own put and every earlier one to the peer */
  r->sig = (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .op = (uint16_t)op,
                          .src_rank = (uint32_t)c->rank, .region_id = sig->id, .offset = sig_off,
                          .value = value,
                          .covers = c->ordering == PS_ORD_TARGET ? r->need - 1 : 0};
  r->sig_rma = (struct fi_rma_ioc){.addr = sig->raddr[rank] + sig_off, .count = 1,
                                   .key = sig->rkey[rank]};
  r->sig_stage = PS_STAGE_QUEUED;
  ps_rma_use_window(r, sig);
  r->next_sig = NULL;
  ps_rma_wake(p);
  /* Behind a staged put, where the strategy allows, the signal is one more
   * record of the put's last staged write: no message of its own, and the
   * target applies it once that write's copies are in. A signal without
   * data rides too where the peer has a staged write still open to more
   * records: it goes in the data queue as a request of no chunks. */
  int may_ride = c->stage && ps_order_sig_may_ride(c);
  r->sig_rides = may_ride && size && r->dst_staged;
  if (may_ride && !size && ps_stage_open_to(c, p)) {
    r->sig_rides = 1, r->staged = 1, r->dst_staged = 1, r->nchunks = 0;
    dq_append(p, r);
  }
  if (!r->sig_rides) {
    if (p->sq_tail) p->sq_tail->next_sig = r;
    else p->sq_head = r;
    p->sq_tail = r;
  }
  pump(c, p);
  if (ps_order_count_fence(c, p, r)) PS_CHECK(drain(c, p, r->need));
  *req = r->handle;
  return c->error;
}

/* A peer that completes nothing of ours for PERSEUS_PEER_TIMEOUT_MS, or
 * whose queued operations the provider refuses that long, is gone (or
 * wedged): an error instead of a hang. */
static void check_liveness(ps_rma_comm_t *c) {
  if (c->now_ns < c->next_check_ns) return;
  c->next_check_ns = c->now_ns + 1000000;
  for (int i = 0; i < c->nranks; i++) {
    ps_rma_peer_t *p = &c->peers[i];
    if ((p->outstanding || p->dq_head || p->sq_head) && c->now_ns - p->active_ns > c->timeout_ns) {
      ps_rma_fail(c, ncclRemoteError, "rank %d completed none of %llu operations in %llu ms "
                  "(PERSEUS_PEER_TIMEOUT_MS): peer dead or unreachable%s", i,
                  (unsigned long long)p->outstanding, (unsigned long long)(c->timeout_ns / 1000000),
                  p->dq_head && p->dq_head->staged ? " (a staged put waits for the peer's staging slots)" : "");
      if (c->stage) ps_stage_dump(c);
      return;
    }
  }
}

static ncclResult_t progress_body(void *coll) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c) return ncclInvalidArgument;
  if (c->error) return c->error;
  /* NCCL's GIN proxy calls progress once per context and peer in a round
   * (2.28, 2.29), or once per round besides a test() of every outstanding
   * request. A pass reads the completion queue (a syscall on tcp) and hands
   * the pass's copies to the driver: passes back to back would spend the
   * round there and find nothing new, while one every interval reads
   * several completions, packs the chunks queued meanwhile into one write
   * and hands their copies over in one batch. */
  uint64_t now = ps_now_ns();
  c->progress_calls++;
  if (now - c->last_pass_ns < c->pass_interval_ns) return ncclSuccess;
  c->last_pass_ns = c->now_ns = now;
  c->passes++;
  /* PERSEUS_STATS: the steps of passes that found work outstanding */
  uint64_t *step = c->calls && c->calls->live ? c->calls->pass_ns : NULL, t = now;
  if (step) c->calls->passes++;
  ps_rma_release_held(c);
  if (ps_ep_progress(&c->ep, 256, NULL) != ncclSuccess) ps_rma_fail(c, ncclRemoteError, "%s", c->ep.fatal);
  if (step) ps_rma_note_step(step, PS_PASS_CQ, &t);
  if (c->stage && !c->error) ps_rma_target_progress(c);
  if (c->nack_pending && !c->error) ps_rma_send_nacks(c);
  if (step) ps_rma_note_step(step, PS_PASS_TARGET, &t);
  if (c->backlog && !c->error) {
    c->backlog = 0;
    if (c->stage) ps_stage_fill(c);
    for (int p = 0; p < c->nranks && !c->error; p++)
      if (c->peers[p].dq_head || c->peers[p].sq_head) pump(c, &c->peers[p]);
  }
  if (step) ps_rma_note_step(step, PS_PASS_POST, &t);
  /* the copies and signal writes this pass and the calls since the last one
   * enqueued go to the GPU together */
  ps_stage_flush(c);
  if (step) ps_rma_note_step(step, PS_PASS_COPIES, &t);
  if (!c->error) check_liveness(c);
  return c->error;
}

static int req_done(const ps_rma_req_t *r) {
  return (!r->data_stage || r->data_stage == PS_STAGE_DONE) &&
         (!r->sig_stage || r->sig_stage == PS_STAGE_DONE);
}

/* Why test() refused `request`: never reads what a stale handle once named. */
static void PS_COLD req_refused(ps_rma_comm_t *c, const void *request) {
  ps_rma_req_t *r = ps_htab_get(&ps_rma_req_tab, request);
  if (r) {
    PS_WARN("one-sided test: %p is a live request of another comm (rank %d of %d), not of this "
            "one (rank %d of %d)", request, r->comm->rank, r->comm->nranks, c->rank, c->nranks);
    return;
  }
  char why[200];
  ps_htab_explain(&ps_rma_req_tab, request, why, sizeof why);
  PS_WARN("one-sided test: %s", why);
}

static ncclResult_t test_body(void *coll, void *request, int *done) {
  ps_rma_comm_t *c = rma_comm(coll);
  ps_rma_req_t *r = ps_htab_get(&ps_rma_req_tab, request);
  if (!c || !done) return ncclInvalidArgument; /* gin_abi.c logged it */
  if (!r || r->comm != c) {
    req_refused(c, request);
    return ncclInvalidArgument;
  }
  *done = 0;
  if (r->status) return r->status;
  if (!req_done(r)) {
    /* NCCL tests every outstanding request each round besides calling
     * progress (progress_body): a test makes a progress pass only when this request was
     * already seen not done since the last one, so a round costs one pass
     * however many requests are outstanding, and a caller that only tests
     * still drives progress. */
    if (r->tested_pass != c->passes) {
      r->tested_pass = c->passes;
      return c->error;
    }
    ncclResult_t rc = progress_body(c);
    if (r->status) return r->status;
    if (rc != ncclSuccess) return rc;
    if (!req_done(r)) return ncclSuccess;
  }
  *done = 1;
  if (c->opstats) ps_rma_note_reported(c, r);
  req_put(c, r);
  return ncclSuccess;
}

static ncclResult_t last_error_body(void *coll, bool *has_error) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !has_error) return ncclInvalidArgument;
  *has_error = c->error != ncclSuccess;
  return ncclSuccess;
}

static ncclResult_t peer_stats_body(void *coll, uint32_t rank, ps_rma_peer_stats_t *out) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !out || rank >= (uint32_t)c->nranks) return ncclInvalidArgument;
  *out = c->peers[rank].st;
  return ncclSuccess;
}

/* --- entry points (PS_RMA_LOCKED) --- */

ncclResult_t ps_rma_iput(void *coll, uint64_t src_off, void *src_mh, size_t size,
                         uint64_t dst_off, void *dst_mh, uint32_t rank, void **req) {
  PS_RMA_LOCKED_CALL(coll, PS_CALL_DATA,
                     data_body(coll, 0, src_off, src_mh, size, dst_off, dst_mh, rank, req));
}
ncclResult_t ps_rma_iget(void *coll, uint64_t remote_off, void *remote_mh, size_t size,
                         uint64_t local_off, void *local_mh, uint32_t rank, void **req) {
  PS_RMA_LOCKED_CALL(coll, PS_CALL_DATA,
                     data_body(coll, 1, local_off, local_mh, size, remote_off, remote_mh, rank, req));
}
ncclResult_t ps_rma_iflush(void *coll, void *mh, uint32_t rank, void **req) {
  PS_RMA_LOCKED(coll, iflush_body(coll, mh, rank, req));
}
ncclResult_t ps_rma_iput_signal(void *coll, uint64_t src_off, void *src_mh, size_t size,
                                uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t sig_off,
                                void *sig_mh, uint64_t value, uint32_t op, void **req) {
  PS_RMA_LOCKED_CALL(coll, PS_CALL_DATA,
                     iput_signal_body(coll, src_off, src_mh, size, dst_off, dst_mh, rank, sig_off,
                                      sig_mh, value, op, req));
}
ncclResult_t ps_rma_progress(void *coll) {
  PS_RMA_LOCKED_CALL(coll, PS_CALL_PROGRESS, progress_body(coll));
}
ncclResult_t ps_rma_test(void *coll, void *request, int *done) {
  PS_RMA_LOCKED_CALL(coll, PS_CALL_TEST, test_body(coll, request, done));
}
ncclResult_t ps_rma_last_error(void *coll, bool *has_error) {
  PS_RMA_LOCKED(coll, last_error_body(coll, has_error));
}
ncclResult_t ps_rma_peer_stats(void *coll, uint32_t rank, ps_rma_peer_stats_t *out) {
  PS_RMA_LOCKED(coll, peer_stats_body(coll, rank, out));
}
