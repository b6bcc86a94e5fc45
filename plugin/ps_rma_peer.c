/* One-sided engine, the lowest floor: failing the comm, looking up a
 * region, and the per-peer accounting every other floor does as operations
 * start and finish. Calls nothing of the engine's. */
#include <stdarg.h>
#include <stdio.h>

#include "ps_clock.h"
#include "ps_log.h"
#include "ps_rma_int.h"

void ps_rma_fail(ps_rma_comm_t *c, ncclResult_t rc, const char *fmt, ...) {
  if (c->error) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->error_msg, sizeof c->error_msg, fmt, ap);
  va_end(ap);
  /* the reason is logged before the error is seen: a caller on another
   * thread (NCCL's, with an engine thread) that sees it finds the log */
  PS_WARN("one-sided comm rank %d: %s", c->rank, c->error_msg);
  __atomic_store_n(&c->error, rc, __ATOMIC_RELEASE);
}

/* PERSEUS_STATS: one more operation posted to p */
static void PS_COLD __attribute__((noinline)) note_started(ps_rma_peer_t *p) {
  ps_hist_small_add(&p->ops->depth, p->outstanding);
  p->ops->stuck = 0;
}

void ps_rma_op_started(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  if (!p->outstanding++) p->active_ns = c->now_ns;
  if (p->outstanding > p->st.inflight_max) p->st.inflight_max = p->outstanding;
  if (p->ops) note_started(p);
}
/* An idle peer gets work: its liveness clock starts now. */
void ps_rma_wake(ps_rma_peer_t *p) {
  if (!ps_rma_peer_busy(p)) p->active_ns = ps_now_ns();
}
void ps_rma_op_finished(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  p->outstanding--;
  p->active_ns = c->now_ns;
}

/* Any error completion fails the comm, cancellation included: we never
 * cancel (close discards the endpoint unread), so -FI_ECANCELED is the
 * provider flushing operations to a peer that went away (tcp does this). */
static int op_failed(ps_rma_req_t *r, int err, int sig, const char *errstr) {
  if (!err) return 0;
  r->status = ncclRemoteError;
  /* the window the provider refused names the likely cause (deregistered
   * there): the signal's, else the put's or get's remote one (uses[1]) */
  char win[64] = "";
  if (sig)
    snprintf(win, sizeof win, " (window %u, offset %llu)", r->sig.region_id,
             (unsigned long long)r->sig.offset);
  else if (r->nuses >= 2)
    snprintf(win, sizeof win, " (rank %u's part of window %u)", r->peer, r->uses[1]);
  ps_rma_fail(r->comm, ncclRemoteError, "%s%s to rank %u failed: %s",
              sig ? "signal" : r->is_get ? "get" : "put", win, r->peer, errstr);
  return 1;
}

static void unuse(ps_rma_comm_t *c, ps_rma_req_t *r, int refused) {
  for (int i = 0; i < r->nuses; i++) {
    ps_rma_region_t *g = r->uses[i] < c->nregions ? c->regions[r->uses[i]] : NULL;
    if (!g) continue; /* gone with a failed comm */
    if (refused) PS_RMA_SHARED_ADD(c, g->busy_named, -1);
    else PS_RMA_SHARED_ADD(c, g->busy_freed, 1);
  }
  r->nuses = 0;
}
void ps_rma_unuse_windows(ps_rma_comm_t *c, ps_rma_req_t *r) { unuse(c, r, 0); }
void ps_rma_unuse_refused(ps_rma_comm_t *c, ps_rma_req_t *r) { unuse(c, r, 1); }

/* The engine lets go of r last: it joins the returned list (NCCL's thread
 * takes that whole when its free list runs dry), so that the engine never
 * takes the lock or the lines of NCCL's free list. */
void ps_rma_req_return(ps_rma_comm_t *c, ps_rma_req_t *r) {
  r->next = __atomic_load_n(&c->returned, __ATOMIC_RELAXED);
  if (!c->threaded) { /* NCCL's thread takes it under c->lock too */
    __atomic_store_n(&c->returned, r, __ATOMIC_RELAXED);
    return;
  }
  while (!__atomic_compare_exchange_n(&c->returned, &r->next, r, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
  }
}

/* test() may report r from here: its source may be reused, and its windows
 * stop counting it (what is still in flight reads only staging memory). */
void ps_rma_local_done(ps_rma_comm_t *c, ps_rma_req_t *r) {
  if (r->done) return; /* only the engine sets it */
  if (!r->settled) r->early = 1, c->early_open++;
  ps_rma_unuse_windows(c, r);
  if (c->peers[r->peer].ops) r->ts.local_done = ps_rma_stats_now();
  __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
}

void ps_rma_staged_check(ps_rma_comm_t *c, ps_rma_req_t *r) {
  /* a signal that neither rides nor was handed over still needs r */
  if (r->staged && r->copied == r->nchunks + r->sig_rides &&
      (!r->has_sig || r->sig_rides || r->sig_stage >= PS_STAGE_POSTED))
    ps_rma_local_done(c, r);
}

/* Once r's data and signal both completed, the engine is done with it; it
 * goes back to the pool here if test() already reported it, else there. */
static void settle(ps_rma_comm_t *c, ps_rma_req_t *r) {
  if (r->settled || (r->data_stage && r->data_stage != PS_STAGE_DONE) ||
      (r->sig_stage && r->sig_stage != PS_STAGE_DONE))
    return;
  r->settled = 1;
  if (r->early) c->early_open--;
  if (c->peers[r->peer].ops) ps_rma_note_settled(c, r);
  ps_rma_local_done(c, r);
  /* last: once both bits are set r may be reused at once */
  if (ps_rma_life_mark(c, r, PS_REQ_SETTLED) & PS_REQ_REPORTED)
    ps_rma_req_return(c, r);
}

/* A put's chunk (seq) completed; the whole put once every chunk has. */
void ps_rma_put_done(ps_rma_req_t *r, uint64_t seq, int err, const char *errstr) {
  ps_rma_comm_t *c = r->comm;
  ps_rma_peer_t *p = &c->peers[r->peer];
  ps_rma_op_finished(c, p);
  if (++r->done_chunks == r->nchunks) r->data_stage = PS_STAGE_DONE;
  if (!op_failed(r, err, 0, errstr) && !r->is_get) {
    /* Completions come in any order; done.below only moves over a gap-free run. */
    if (ps_seqwin_mark(&p->done, seq, UINT64_MAX))
      ps_rma_fail(c, ncclSystemError, "no memory to track puts to rank %u", r->peer);
    else if (p->sq_head)
      c->backlog = 1; /* a deferred signal may be free to go */
  }
  if (p->ops && r->data_stage == PS_STAGE_DONE) r->ts.data_done = ps_rma_stats_now();
  settle(c, r); /* last: once settled, r may be handed back (test()) and reused */
}

void ps_rma_sig_done(ps_rma_req_t *r, int err, const char *errstr) {
  ps_rma_peer_t *p = &r->comm->peers[r->peer];
  if (p->ops) r->ts.sig_done = ps_rma_stats_now();
  ps_rma_op_finished(r->comm, p);
  r->sig_stage = PS_STAGE_DONE;
  op_failed(r, err, 1, errstr);
  settle(r->comm, r);
}

/* --- PERSEUS_STATS --- */

void ps_rma_note_call(ps_rma_req_t *r) { r->ts = (ps_rma_stamps_t){.call = ps_now_ns()}; }

uint64_t ps_rma_stats_now(void) { return ps_now_ns(); }

void ps_rma_note_stop(ps_rma_peer_t *p, int why) {
  ps_rma_opstats_t *o = p->ops;
  o->held_passes[why]++;
  if (o->stuck != why + 1) o->held[why]++, o->stuck = why + 1;
}

void ps_rma_note_post(ps_rma_peer_t *p, uint64_t t0, int posted, uint64_t *first) {
  uint64_t now = ps_now_ns();
  ps_hist_add(&p->ops->iv[PS_IV_POST], now - t0);
  if (!posted) ps_rma_note_stop(p, PS_HELD_PROVIDER);
  else if (!*first) *first = now;
}

/* From step a to step b, where the request went through both. */
static void add_span(ps_hist_t *h, uint64_t a, uint64_t b) {
  if (a && b) ps_hist_add(h, b > a ? b - a : 0);
}

/* The engine's steps, once r settled (the engine's thread). */
void ps_rma_note_settled(ps_rma_comm_t *c, const ps_rma_req_t *r) {
  ps_rma_opstats_t *o = c->peers[r->peer].ops;
  const ps_rma_stamps_t *t = &r->ts;
  add_span(&o->iv[PS_IV_QUEUED], t->call, t->posted);
  add_span(&o->iv[PS_IV_COPY], t->copy_start, t->copy_done);
  add_span(&o->iv[PS_IV_WIRE], t->posted, t->data_done);
  add_span(&o->iv[PS_IV_SIGWAIT], t->call, t->sig_posted);
  add_span(&o->iv[PS_IV_SETTLED], t->call, ps_now_ns());
}

/* test() reported r (NCCL's thread): what NCCL saw. */
void ps_rma_note_reported(ps_rma_comm_t *c, const ps_rma_req_t *r) {
  ps_rma_opstats_t *o = c->peers[r->peer].ops;
  uint64_t now = ps_now_ns();
  add_span(&o->iv[PS_IV_LAG], r->ts.local_done, now);
  add_span(&o->iv[PS_IV_TOTAL], r->ts.call, now);
}

/* c->calls: wall time counts as busy from a call that found or left a
 * request outstanding to the next call. A nested entry (drain progresses
 * inside a put) is part of the outer call. */
uint64_t ps_rma_call_begins(ps_rma_comm_t *c) {
  ps_rma_callstats_t *s = c->calls;
  if (s->depth++) return 1;
  uint64_t now = ps_now_ns();
  s->was_busy = __atomic_load_n(&c->live_reqs, __ATOMIC_RELAXED) > 0;
  if (s->was_busy) s->busy_ns += now - s->last_ns;
  s->last_ns = now;
  return now;
}

void ps_rma_call_ends(ps_rma_comm_t *c, int kind, uint64_t t0) {
  ps_rma_callstats_t *s = c->calls;
  if (--s->depth) return;
  uint64_t now = ps_now_ns();
  if (!s->was_busy && !__atomic_load_n(&c->live_reqs, __ATOMIC_RELAXED)) {
    s->last_ns = now, s->last_data_ns = 0;
    return;
  }
  s->busy_ns += now - s->last_ns;
  s->last_ns = now;
  s->n[kind]++, s->ns[kind] += now - t0;
  if (kind == PS_CALL_DATA) {
    /* live only grows by data calls: busy at this one's begin means busy
     * since the last one */
    if (s->was_busy && s->last_data_ns) ps_hist_add(&s->data_gap, t0 - s->last_data_ns);
    s->last_data_ns = t0;
    s->data_since_progress = 1;
  } else if (kind == PS_CALL_PROGRESS) {
    s->progress_new += s->data_since_progress;
    s->data_since_progress = 0;
  }
}

void ps_rma_note_step(uint64_t *step, int which, uint64_t *t) {
  uint64_t now = ps_now_ns();
  step[which] += now - *t;
  *t = now;
}
