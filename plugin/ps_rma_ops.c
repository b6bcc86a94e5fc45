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
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "ps_clock.h"
#include "ps_log.h"
#include "ps_rma_int.h"

static ps_rma_comm_t *rma_comm(void *coll) { return ps_rma_live(coll); }
static ncclResult_t submit(ps_rma_comm_t *c, ps_rma_req_t *r, void **req);

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
    ps_rma_staged_check(c, r); /* a staged put's data may be out of its source already */
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
  /* staging's write coalescing times its slots with this clock; without
   * staging the pass's clock will do (liveness counts in milliseconds), and
   * a clock read per operation is a measurable share of a small put */
  if (c->stage) c->now_ns = ps_now_ns();
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

/* Whether `peer` told us it deregistered its part of window w (its
 * window-closed notice, ps_rma_target.c): a call into it is refused, naming
 * both, instead of a write the provider may drop unseen. */
static int closed_there(const ps_rma_region_t *w, uint32_t peer, const char *what) {
  if (!__atomic_load_n(&w->rclosed[peer], __ATOMIC_ACQUIRE)) return 0;
  PS_WARN("%s rank %u's part of window %u, which rank %u deregistered: every rank must stop using "
          "a window before any rank deregisters it", what, peer, w->id, peer);
  return 1;
}

/* NCCL's side of the put (or get) part of a request, its windows read-locked: the
 * local part checked against our registration, the remote one against the
 * size the peer advertised for its part of the window, and r filled from
 * them. */
static ncclResult_t fill_data(ps_rma_comm_t *c, ps_rma_req_t *r, int is_get, uint64_t local_off,
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
  if (closed_there(rem, peer, is_get ? "get from" : "put into")) return ncclInvalidUsage;
  if (is_get && (loc->staged || rem->staged)) {
    PS_WARN("get from rank %u with GPU memory on either side: staging covers puts only; reading "
            "GPU windows needs a provider with FI_HMEM", peer);
    return ncclInvalidUsage;
  }
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
    if (size > c->stage_chunk) r->nchunks = (uint32_t)((size + c->stage_chunk - 1) / c->stage_chunk);
  }
  ps_rma_use_window(r, loc);
  ps_rma_use_window(r, rem);
  r->has_data = 1;
  return ncclSuccess;
}

/* The engine's side: the put's sequence numbers and its place in the
 * peer's data queue. */
static void take_data(ps_rma_peer_t *p, ps_rma_req_t *r) {
  if (!r->is_get) r->seq = p->next_seq, p->next_seq += r->nchunks;
  r->data_stage = PS_STAGE_QUEUED;
  ps_rma_wake(p);
  dq_append(p, r);
}

/* A call refused after start(): the windows it was counted in forget it
 * (they are live: the caller holds them read-locked), and r goes back. */
static void refuse(ps_rma_comm_t *c, ps_rma_req_t *r) {
  ps_rma_unuse_refused(c, r);
  ps_rma_req_put(c, r);
}

static ncclResult_t start(ps_rma_comm_t *c, uint32_t rank, ps_rma_req_t **out) {
  *out = NULL;
  ncclResult_t err = ps_rma_error(c);
  if (err) return err;
  if (rank >= (uint32_t)c->nranks) {
    PS_WARN("one-sided operation to rank %u, but the comm has %d ranks", rank, c->nranks);
    return ncclInvalidArgument;
  }
  PS_CHECK(ps_rma_req_get(c, rank, out));
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
  ps_rma_windows_read(c);
  ncclResult_t rc = start(c, rank, &r);
  if (rc == ncclSuccess) {
    rc = fill_data(c, r, is_get, local_off, local_mh, size, remote_off, remote_mh);
    if (rc != ncclSuccess) refuse(c, r);
  }
  ps_rma_windows_done(c);
  PS_CHECK(rc);
  return submit(c, r, req);
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
  while (p->done.below < need && !c->error) {
    ps_rma_progress_pass(c);
    c->own_waits++; /* a wait of ours counts as a call */
  }
  p->st.blocked_ns += ps_now_ns() - t0;
  return c->error;
}

/* NCCL's side of the signal part, its windows read-locked: the signal window and
 * word checked, r's signal filled but for what the engine decides (what it
 * covers, whether it rides). */
static ncclResult_t fill_sig(ps_rma_comm_t *c, ps_rma_req_t *r, size_t size, void *src_mh,
                             void *dst_mh, uint64_t sig_off, void *sig_mh, uint64_t value,
                             uint32_t op) {
  uint32_t rank = r->peer;
  ps_rma_region_t *sig = ps_rma_window(c, sig_mh);
  if (!sig) {
    ps_rma_window_refused(c, "iputSignal", "signal", sig_mh);
    return ncclInvalidArgument;
  }
  if ((op != NCCL_NET_SIGNAL_OP_INC && op != NCCL_NET_SIGNAL_OP_ADD) || sig_off % 8 ||
      sig_off > sig->rsize[rank] || sig->rsize[rank] - sig_off < 8) {
    PS_WARN("putSignal: signal at offset %llu (op %u, expected 1 INC or 2 ADD) is not an aligned "
            "8-byte word of rank %u's part of window %u (%llu B)",
            (unsigned long long)sig_off, op, rank, sig->id, (unsigned long long)sig->rsize[rank]);
    return ncclInvalidArgument;
  }
  if (closed_there(sig, rank, "signal into")) return ncclInvalidUsage;
  /* A signal alone moves no data, and NCCL passes NULL data windows with
   * it; anything else must still be a live window of this comm. */
  for (int i = 0; i < 2 && !size; i++) {
    void *mh = i ? dst_mh : src_mh;
    if (mh && !ps_rma_window(c, mh)) {
      ps_rma_window_refused(c, "iputSignal without data", i ? "destination" : "source", mh);
      return ncclInvalidArgument;
    }
  }
  r->sig = (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .op = (uint16_t)op,
                          .src_rank = (uint32_t)c->rank, .region_id = sig->id, .offset = sig_off,
                          .value = value};
  r->sig_rma = (struct fi_rma_ioc){.addr = sig->raddr[rank] + sig_off, .count = 1,
                                   .key = sig->rkey[rank]};
  ps_rma_use_window(r, sig);
  r->has_sig = 1;
  return ncclSuccess;
}

/* The engine's side: what the signal covers, and its place in the peer's
 * queues. */
static void take_sig(ps_rma_comm_t *c, ps_rma_peer_t *p, ps_rma_req_t *r) {
  r->need = p->next_seq; /* its own put and every earlier one to the peer */
  r->sig.covers = c->ordering == PS_ORD_TARGET ? r->need - 1 : 0;
  r->sig_stage = PS_STAGE_QUEUED;
  r->next_sig = NULL;
  ps_rma_wake(p);
  /* Behind a staged put, where the strategy allows, the signal is one more
   * record of the put's last staged write: no message of its own, and the
   * target applies it once that write's copies are in. A signal without
   * data rides too where the peer has a staged write still open to more
   * records: it goes in the data queue as a request of no chunks. */
  int may_ride = c->stage && ps_order_sig_may_ride(c);
  r->sig_rides = may_ride && r->has_data && r->dst_staged;
  if (may_ride && !r->has_data && ps_stage_open_to(c, p)) {
    r->sig_rides = 1, r->staged = 1, r->dst_staged = 1, r->nchunks = 0;
    dq_append(p, r);
  }
  if (!r->sig_rides) {
    if (p->sq_tail) p->sq_tail->next_sig = r;
    else p->sq_head = r;
    p->sq_tail = r;
  }
}

/* The calling thread, which posts and reads completions, gets the GPU of
 * our windows if it has no context: a provider may copy GPU memory through
 * the CUDA runtime on it (ps_cuda_bind_thread). */
static void bind_gpu(ps_rma_comm_t *c) {
  if (c->stage && c->stage->cu) (void)ps_cuda_bind_thread(c->stage->cu);
}

/* The engine takes r, in call order: its put and signal join the peer's
 * queues, and what the provider takes is posted. */
static void take(ps_rma_comm_t *c, ps_rma_req_t *r) {
  ps_rma_peer_t *p = &c->peers[r->peer];
  bind_gpu(c);
  int has_sig = r->has_sig, waits = has_sig && c->ordering == PS_ORD_DRAIN;
  if (r->has_data) take_data(p, r);
  if (has_sig) take_sig(c, p, r);
  uint64_t need = r->need;
  /* from here r may complete, and unless its caller waits in submit(),
   * be reported done and reused: read before, not after */
  pump(c, p);
  if (has_sig && ps_order_count_fence(c, p, need)) drain(c, p, need);
  if (waits) __atomic_store_n(&r->taken, 1, __ATOMIC_RELEASE);
}

/* r, checked and filled, goes to the engine: at once under NCCL's call, or
 * through the engine thread's inbox. drain blocks the caller until its
 * signal could go, as it does without a thread. */
static ncclResult_t submit(ps_rma_comm_t *c, ps_rma_req_t *r, void **req) {
  *req = r->handle;
  if (!c->threaded) {
    take(c, r);
    return c->error;
  }
  int wait = r->has_sig && c->ordering == PS_ORD_DRAIN; /* as take() */
  ps_rma_inbox_push(c, r);
  while (wait && !__atomic_load_n(&r->taken, __ATOMIC_ACQUIRE) && !ps_rma_error(c)) sched_yield();
  return ps_rma_error(c);
}

static ncclResult_t iput_signal_body(void *coll, uint64_t src_off, void *src_mh, size_t size,
                                     uint64_t dst_off, void *dst_mh, uint32_t rank,
                                     uint64_t sig_off, void *sig_mh, uint64_t value, uint32_t op,
                                     void **req) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c || !req) return ncclInvalidArgument;
  *req = NULL;
  ps_rma_req_t *r;
  ps_rma_windows_read(c);
  ncclResult_t rc = start(c, rank, &r);
  if (rc == ncclSuccess) {
    if (size) rc = fill_data(c, r, 0, src_off, src_mh, size, dst_off, dst_mh);
    if (rc == ncclSuccess) rc = fill_sig(c, r, size, src_mh, dst_mh, sig_off, sig_mh, value, op);
    if (rc != ncclSuccess) refuse(c, r);
  }
  ps_rma_windows_done(c);
  PS_CHECK(rc);
  return submit(c, r, req);
}

/* A peer that completes nothing of ours for PERSEUS_PEER_TIMEOUT_MS, or
 * whose queued operations the provider refuses that long, is gone (or
 * wedged): an error instead of a hang. */
static void check_liveness(ps_rma_comm_t *c) {
  if (c->now_ns < c->next_check_ns) return;
  c->next_check_ns = c->now_ns + 1000000;
  for (int i = 0; i < c->nranks; i++) {
    ps_rma_peer_t *p = &c->peers[i];
    if (ps_rma_peer_busy(p) && c->now_ns - p->active_ns > c->timeout_ns) {
      ps_rma_fail(c, ncclRemoteError, "rank %d completed none of %llu operations in %llu ms "
                  "(PERSEUS_PEER_TIMEOUT_MS): peer dead or unreachable%s", i,
                  (unsigned long long)p->outstanding, (unsigned long long)(c->timeout_ns / 1000000),
                  p->dq_head && p->dq_head->staged ? " (a staged put waits for the peer's staging slots)" : "");
      if (c->stage) ps_stage_dump(c);
      return;
    }
  }
}

int ps_rma_progress_pass(ps_rma_comm_t *c) {
  uint64_t now = ps_now_ns();
  int handled = 0;
  c->last_pass_ns = c->now_ns = now;
  c->passes++;
  /* PERSEUS_STATS: the steps of passes that found work outstanding */
  uint64_t *step = c->calls && __atomic_load_n(&c->live_reqs, __ATOMIC_RELAXED)
                       ? c->calls->pass_ns : NULL;
  uint64_t t = now;
  if (step) c->calls->passes++;
  bind_gpu(c);
  ps_rma_release_held(c);
  if (ps_ep_progress(&c->ep, 256, &handled) != ncclSuccess)
    ps_rma_fail(c, ncclRemoteError, "%s", c->ep.fatal);
  if (c->streams && !c->error) handled += ps_rma_streams_poll(c);
  if (step) ps_rma_note_step(step, PS_PASS_CQ, &t);
  if (c->stage && !c->error) ps_rma_target_progress(c);
  if (c->nack_pending && !c->error) ps_rma_send_nacks(c);
  if (c->note_pending && !c->error) ps_rma_send_notices(c);
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
  return handled;
}

/* A pass, unless the last one began less than PERSEUS_PROGRESS_INTERVAL_US
 * ago. NCCL's GIN proxy calls progress once per context and peer in a round
 * (2.28, 2.29), or once per round besides a test() of every outstanding
 * request. A pass reads the completion queue (a syscall on tcp) and hands
 * the pass's copies to the driver: passes back to back would spend the
 * round there and find nothing new, while one every interval reads several
 * completions, packs the chunks queued meanwhile into one write and hands
 * their copies over in one batch. */
static ncclResult_t pass_if_due(ps_rma_comm_t *c) {
  /* a failed comm makes no pass: its endpoint may be closed already */
  if (c->error) return c->error;
  if (ps_now_ns() - c->last_pass_ns < c->pass_interval_ns) return ncclSuccess;
  ps_rma_progress_pass(c);
  return c->error;
}

static ncclResult_t progress_body(void *coll) {
  ps_rma_comm_t *c = rma_comm(coll);
  if (!c) return ncclInvalidArgument;
  /* a count for PERSEUS_STATS and test(): NCCL's calls make it, no locked add needed */
  __atomic_store_n(&c->progress_calls, __atomic_load_n(&c->progress_calls, __ATOMIC_RELAXED) + 1,
                   __ATOMIC_RELAXED);
  /* the engine thread makes the passes: NCCL's call only asks for news */
  if (c->threaded || ps_rma_error(c)) return ps_rma_error(c);
  return pass_if_due(c);
}

int ps_rma_engine_pass(ps_rma_comm_t *c) {
  ps_rma_req_t *top = __atomic_load_n(&c->inbox_top, __ATOMIC_RELAXED)
                          ? __atomic_exchange_n(&c->inbox_top, NULL, __ATOMIC_ACQUIRE) : NULL;
  ps_rma_req_t *r = NULL;
  while (top) { /* newest first: reversed into call order */
    ps_rma_req_t *next = top->next_in;
    top->next_in = r, r = top, top = next;
  }
  int work = r != NULL;
  for (ps_rma_req_t *next; r; r = next) {
    next = r->next_in;
    take(c, r);
  }
  return ps_rma_progress_pass(c) + work;
}

/* Locally complete (ps_rma_local_done): for a staged put, once its bytes
 * are out of the source, though its write may still be in flight. */
static int req_done(const ps_rma_req_t *r) { return __atomic_load_n(&r->done, __ATOMIC_ACQUIRE); }

static ncclResult_t test_body(void *coll, void *request, int *done) {
  ps_rma_comm_t *c = rma_comm(coll);
  ps_rma_req_t *r = ps_htab_get(&ps_rma_req_tab, request);
  if (!c || !done) return ncclInvalidArgument; /* gin_abi.c logged it */
  if (!r || r->comm != c) {
    ps_rma_req_refused(c, request);
    return ncclInvalidArgument;
  }
  *done = 0;
  if (c->threaded) {
    /* the engine thread sets done after the status */
    if (!req_done(r)) return ps_rma_error(c);
    if (r->status) return r->status;
  } else if (r->status) {
    return r->status;
  } else if (!req_done(r)) {
    /* NCCL tests every outstanding request each round besides calling
     * progress: a test makes a pass (when one is due) only for a caller
     * that does not drive progress itself, seen as a request tested not
     * done twice with neither a pass nor a progress call in between. A
     * round then costs one pass however many requests are outstanding, and
     * the tests of a caller that calls progress read no clock. */
    uint64_t calls = __atomic_load_n(&c->progress_calls, __ATOMIC_RELAXED);
    if (r->tested_pass != c->passes || r->tested_calls != calls) {
      r->tested_pass = c->passes, r->tested_calls = calls;
      return c->error;
    }
    ncclResult_t rc = pass_if_due(c);
    if (r->status) return r->status;
    if (rc != ncclSuccess) return rc;
    if (!req_done(r)) return ncclSuccess;
  }
  *done = 1;
  if (c->opstats) ps_rma_note_reported(c, r);
  ps_rma_req_reported(c, r);
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
