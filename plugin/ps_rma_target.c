/* One-sided engine, target side: signals arrive as messages and are applied
 * here, after validation against the registered regions; under the target
 * strategy a signal also waits until the writes it covers have arrived,
 * counted from their remote CQ data. Nothing a peer sends is trusted. */
#include <stdlib.h>
#include <string.h>

#include "ps_log.h"
#include "ps_rma_int.h"

static void apply_signal(ps_rma_comm_t *c, const ps_sig_msg_t *m) {
  ps_rma_region_t *r = m->region_id < c->nregions ? c->regions[m->region_id] : NULL;
  if (!r || m->offset % 8 || m->offset > r->size || r->size - m->offset < 8) {
    ps_rma_fail(c, ncclRemoteError,
                "signal from rank %u rejected: region %u offset %llu outside its %zu bytes",
                m->src_rank, m->region_id, (unsigned long long)m->offset, r ? r->size : (size_t)0);
    return;
  }
  uint64_t add = m->op == NCCL_NET_SIGNAL_OP_INC ? 1 : m->value;
  /* The data it covers is in memory (the strategy made sure); release
   * ordering publishes the new value after everything written before it. */
  __atomic_fetch_add((uint64_t *)(r->base + m->offset), add, __ATOMIC_RELEASE);
}

/* Applies the held signals of a peer whose writes have all arrived. Signals
 * commute (adds), so the order among them does not matter. */
static void apply_ready(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  for (uint32_t i = 0; i < p->nheld;) {
    if (p->held[i].msg.covers < p->arrived.below) {
      ps_sig_msg_t m = p->held[i].msg;
      p->held[i] = p->held[--p->nheld];
      apply_signal(c, &m);
    } else {
      i++;
    }
  }
}

/* Remote CQ data of a peer's write: source rank (high 32 bits) and the low
 * 32 bits of the write's sequence number, widened against our window. */
void ps_rma_remote_write(void *comm, uint64_t data) {
  ps_rma_comm_t *c = comm;
  uint64_t src = data >> 32;
  if (src >= (uint64_t)c->nranks) {
    ps_rma_fail(c, ncclRemoteError, "a write arrived tagged with source rank %llu of %d",
                (unsigned long long)src, c->nranks);
    return;
  }
  ps_rma_peer_t *p = &c->peers[src];
  uint64_t s = p->arrived.below + (uint32_t)((uint32_t)data - (uint32_t)p->arrived.below);
  if (ps_seqwin_mark(&p->arrived, s, PS_RMA_MAX_WINDOW)) {
    ps_rma_fail(c, ncclRemoteError, "rank %llu sent write %llu, a duplicate or over %u ahead of "
                "its oldest missing one (%llu)", (unsigned long long)src, (unsigned long long)s,
                PS_RMA_MAX_WINDOW, (unsigned long long)p->arrived.below);
    return;
  }
  if (p->nheld) apply_ready(c, p);
}

static void on_signal(ps_rma_comm_t *c, const ps_rma_sig_slot_t *s, size_t len) {
  ps_sig_msg_t m;
  if (ps_sig_decode(&s->msg, len, (uint32_t)c->nranks, &m) != ncclSuccess) {
    ps_rma_fail(c, ncclRemoteError, "malformed signal message dropped");
    return;
  }
  ps_rma_peer_t *p = &c->peers[m.src_rank];
  if (m.covers < p->arrived.below) {
    apply_signal(c, &m);
    return;
  }
  /* A peer cannot have more signals waiting than its writes in flight; the
   * cap only bounds what a broken peer can make us allocate. */
  if (p->nheld == p->cap_held) {
    uint32_t cap = p->cap_held ? 2 * p->cap_held : 16;
    ps_rma_held_sig_t *n = cap <= PS_RMA_MAX_REQS ? realloc(p->held, cap * sizeof *n) : NULL;
    if (!n) {
      ps_rma_fail(c, ncclSystemError, "rank %u has over %u signals waiting for their data",
                  m.src_rank, p->cap_held);
      return;
    }
    p->held = n, p->cap_held = cap;
  }
  p->held[p->nheld++].msg = m;
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
  on_signal(c, s, e->len);
  if (post_sig_slot(c, s) != ncclSuccess) ps_rma_fail(c, ncclSystemError, "cannot re-post a signal receive");
}

static ncclResult_t post_sig_slot(ps_rma_comm_t *c, ps_rma_sig_slot_t *s) {
  int ok = 0;
  PS_CHECK(ps_ep_trecv(&c->ep, &s->msg, sizeof s->msg, c->sig_slots_desc, PS_TAG_RMA_SIG, &s->op, &ok));
  return ok ? ncclSuccess : ncclSystemError;
}

ncclResult_t ps_rma_post_sig_slots(ps_rma_comm_t *c) {
  PS_CHECK(ps_ep_reg_local(&c->ep, c->sig_slots, sizeof c->sig_slots, &c->sig_slots_mr));
  c->sig_slots_desc = c->sig_slots_mr ? fi_mr_desc(c->sig_slots_mr) : NULL;
  c->ep.remote_write = ps_rma_remote_write;
  c->ep.remote_owner = c;
  for (int i = 0; i < PS_RMA_SIG_SLOTS; i++) {
    c->sig_slots[i].op = (ps_op_t){.cb = sig_rx_done, .owner = &c->sig_slots[i], .idx = i};
    c->sig_slots[i].comm = c;
    PS_CHECK(post_sig_slot(c, &c->sig_slots[i]));
  }
  return ncclSuccess;
}
