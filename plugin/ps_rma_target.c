/* One-sided engine, target side: signals arrive as messages and are applied
 * here, after validation against the registered regions; under the target
 * strategy a signal also waits until the writes it covers have arrived,
 * counted from their remote CQ data, and behind staged writes until they
 * are in the GPU (ps_rma_stage_rx.c). Nothing a peer sends is trusted.
 *
 * A signal into a window we deregistered, or into a word we registered
 * misaligned, is refused and sent back to its origin (PS_TAG_RMA_NACK),
 * whose comm fails naming the window: the origin's request completed when
 * its message left, so without this the origin would report success for a
 * signal nobody will ever see. A staged put into a GPU window we
 * deregistered is refused the same way (its bytes are dropped in
 * ps_rma_stage_rx.c). Our own comm goes on: nothing here was touched. A
 * signal that could never apply (it covers what no working peer can have
 * sent) fails our comm instead of waiting forever. And when we deregister
 * a window, every peer is told at once (PS_SIG_OP_CLOSED on the same tag),
 * so that its later calls into our part are refused at the call: a plain
 * put into a closed window would otherwise be dropped by some providers
 * without an error on either side. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_log.h"
#include "ps_rma_int.h"

/* Queues the refusal of m (its origin in m->src_rank) back to its origin:
 * sent by the next progress pass. */
static void queue_nack(ps_rma_comm_t *c, const ps_sig_msg_t *m, int reason) {
  ps_rma_nack_t *n = &c->nacks[m->src_rank];
  if (n->state != PS_NACK_IDLE) return; /* one on its way already fails that comm */
  n->msg = *m;
  n->msg.src_rank = (uint32_t)c->rank;
  n->msg.covers = (uint64_t)reason;
  n->msg.covers_staged = 0;
  n->state = PS_NACK_QUEUED;
  c->nack_pending = 1;
}

static void refuse_signal(ps_rma_comm_t *c, const ps_sig_msg_t *m, int reason) {
  const char *why = reason == PS_NACK_DEREGISTERED
                        ? "the window was deregistered here"
                        : "the word is not 8-byte aligned here (the window was registered at a "
                          "misaligned address)";
  PS_WARN("one-sided comm rank %d: signal from rank %u into window %u at offset %llu refused: %s; "
          "rank %u is told", c->rank, m->src_rank, m->region_id, (unsigned long long)m->offset, why,
          m->src_rank);
  queue_nack(c, m, reason);
}

/* A staged write from src carried n chunks into a window we deregistered,
 * h the first: their bytes were dropped (the slot is freed as usual). The
 * origin's put was reported done, so it is told, as for a signal. */
static void refuse_staged(ps_rma_comm_t *c, uint32_t src, const ps_stage_hdr_t *h, uint32_t n) {
  PS_WARN("one-sided comm rank %d: staged put from rank %u into window %u at offset %llu (%u "
          "chunk%s, the first %llu B) dropped: the window was deregistered here; rank %u is told",
          c->rank, src, h->region_id, (unsigned long long)h->offset, n, n == 1 ? "" : "s",
          (unsigned long long)h->len, src);
  ps_sig_msg_t m = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                    .op = NCCL_NET_SIGNAL_OP_ADD, .src_rank = src, .region_id = h->region_id,
                    .offset = h->offset, .value = h->len};
  queue_nack(c, &m, PS_NACK_PUT_DEREGISTERED);
}

/* 0: applied, or refused (or, on a GPU word, queued behind the copies
 * before it); 1: no room to track the GPU word now, keep it held. */
int ps_rma_apply_signal(ps_rma_comm_t *c, const ps_sig_msg_t *m) {
  if (m->region_id < c->nregions && !c->regions[m->region_id]) {
    refuse_signal(c, m, PS_NACK_DEREGISTERED);
    return 0;
  }
  ps_rma_region_t *r = m->region_id < c->nregions ? c->regions[m->region_id] : NULL;
  if (r && c->stage && r == c->stage->rx) { /* a window of ours no NCCL call can name */
    ps_rma_fail(c, ncclRemoteError, "signal from rank %u rejected: region %u is this rank's staging "
                "receive slots, not a window", m->src_rank, m->region_id);
    return 0;
  }
  if (!r || m->offset % 8 || m->offset > r->size || r->size - m->offset < 8) {
    /* the origin checked the offset against the size we advertised: a peer
     * that names a window never registered or a word outside it is broken */
    ps_rma_fail(c, ncclRemoteError,
                "signal from rank %u rejected: region %u offset %llu outside its %zu bytes",
                m->src_rank, m->region_id, (unsigned long long)m->offset, r ? r->size : (size_t)0);
    return 0;
  }
  if ((uintptr_t)(r->base + m->offset) % 8) {
    refuse_signal(c, m, PS_NACK_MISALIGNED);
    return 0;
  }
  uint64_t add = m->op == NCCL_NET_SIGNAL_OP_INC ? 1 : m->value;
  if (r->gpu) return ps_stage_signal(c, r->base + m->offset, add);
  /* The data it covers is in memory (the strategy made sure); release
   * ordering publishes the new value after everything written before it. */
  __atomic_fetch_add((uint64_t *)(r->base + m->offset), add, __ATOMIC_RELEASE);
  return 0;
}

/* A working peer's signal covers only what it posted before the signal:
 * under target, writes at most PS_RMA_MAX_WINDOW past the oldest one that
 * has not arrived (mark_arrived's bound), and staged writes inside the
 * credit we gave (ps_stage_arrived's). A signal beyond those, or one that
 * counts writes this comm's strategy never counts, could never apply: held,
 * it would wait without a word, so the comm fails naming the value. */
static int coverable(ps_rma_comm_t *c, const ps_rma_peer_t *p, const ps_sig_msg_t *m) {
  if (m->covers && c->ordering != PS_ORD_TARGET) {
    ps_rma_fail(c, ncclInvalidUsage, "rank %u sent a signal that waits until %llu of its writes "
                "arrived, as the target strategy counts them, but this rank's ordering is %s, "
                "which never counts them: every rank must set the same PERSEUS_ORDERING",
                m->src_rank, (unsigned long long)m->covers, ps_ordering_names[c->ordering]);
    return 0;
  }
  if (m->covers >= p->arrived.below + PS_RMA_MAX_WINDOW) {
    ps_rma_fail(c, ncclRemoteError, "rank %u sent a signal covering its writes up to %llu, over %u "
                "past the oldest one missing (%llu): it could never apply", m->src_rank,
                (unsigned long long)m->covers, PS_RMA_MAX_WINDOW,
                (unsigned long long)p->arrived.below);
    return 0;
  }
  if (!m->covers_staged) return 1;
  if (!c->stage || m->covers_staged >= p->stage_done.below + c->stage->per_peer) {
    char have[96] = "this rank stages nothing (no GPU window)";
    if (c->stage)
      snprintf(have, sizeof have, "its credit holds staged writes %llu to %llu",
               (unsigned long long)p->stage_done.below,
               (unsigned long long)(p->stage_done.below + c->stage->per_peer - 1));
    ps_rma_fail(c, ncclRemoteError, "rank %u sent a signal covering its staged writes up to %llu, "
                "but %s: it could never apply", m->src_rank, (unsigned long long)m->covers_staged,
                have);
    return 0;
  }
  return 1;
}

static void take_signal(ps_rma_comm_t *c, const ps_sig_msg_t *m);

static void mark_arrived(ps_rma_comm_t *c, uint32_t src, uint64_t s) {
  ps_rma_peer_t *p = &c->peers[src];
  if (ps_seqwin_mark(&p->arrived, s, PS_RMA_MAX_WINDOW)) {
    ps_rma_fail(c, ncclRemoteError, "rank %u sent write %llu, a duplicate or over %u ahead of "
                "its oldest missing one (%llu)", src, (unsigned long long)s,
                PS_RMA_MAX_WINDOW, (unsigned long long)p->arrived.below);
    return;
  }
  if (p->nheld) ps_rma_held_release(c, p);
}

/* Remote CQ data of a peer's write: a staged write (PS_STAGED_DATA, rank,
 * receive slot), or the source rank (high 32 bits) and the low 32 bits of
 * the write's sequence number, widened against our window. Its writer is
 * checked against that rank (a staging stream's arrival was, against the
 * stream's addresses, before it got here). */
static void remote_write(void *comm, uint64_t data, int named, fi_addr_t writer) {
  ps_rma_comm_t *c = comm;
  if (c->error) return; /* a failed comm takes no more input from peers (nor copies it) */
  if (!ps_rma_writer_ok(c, data, c->addr, named, writer)) return;
  uint64_t src = (data & ~PS_STAGED_DATA) >> 32;
  if (src >= (uint64_t)c->nranks) {
    ps_rma_fail(c, ncclRemoteError, "a write arrived tagged with source rank %llu of %d",
                (unsigned long long)src, c->nranks);
    return;
  }
  if (data & PS_STAGED_DATA) {
    uint64_t seqs[PS_STAGE_MAX_RECS];
    ps_sig_msg_t sigs[PS_STAGE_MAX_RECS];
    ps_stage_hdr_t dropped;
    uint32_t nseq, nsig, ndropped;
    if (!ps_stage_arrived(c, (uint32_t)src, (uint32_t)data, seqs, &nseq, sigs, &nsig, &dropped,
                          &ndropped))
      return;
    if (ndropped) refuse_staged(c, (uint32_t)src, &dropped, ndropped);
    for (uint32_t i = 0; i < nseq && c->ordering == PS_ORD_TARGET && !c->error; i++)
      mark_arrived(c, (uint32_t)src, seqs[i]);
    for (uint32_t i = 0; i < nsig && !c->error; i++) take_signal(c, &sigs[i]);
    return;
  }
  ps_rma_peer_t *p = &c->peers[src];
  mark_arrived(c, (uint32_t)src,
               p->arrived.below + (uint32_t)((uint32_t)data - (uint32_t)p->arrived.below));
}

/* Staging's part of a progress pass, then what it moved: held signals whose
 * data is now there are applied, and the receive slots freed are credited. */
void ps_rma_target_progress(ps_rma_comm_t *c) {
  if (!ps_stage_progress(c)) return;
  for (int i = 0; i < c->nranks; i++)
    if (c->peers[i].nheld) ps_rma_held_release(c, &c->peers[i]);
  ps_stage_send_credits(c);
}

static void on_signal(ps_rma_comm_t *c, const ps_rma_sig_slot_t *s, size_t len) {
  ps_sig_msg_t m;
  if (ps_sig_decode(&s->msg, len, (uint32_t)c->nranks, &m) != ncclSuccess) {
    ps_rma_fail(c, ncclRemoteError, "malformed signal message dropped");
    return;
  }
  const char *kind = m.op == PS_SIG_OP_CREDIT ? "a credit" : "a signal";
  if (!ps_rma_sender_ok(c, kind, m.src_rank, c->addr, s->op.src_named, s->op.src)) return;
  if (m.op == PS_SIG_OP_CREDIT) {
    ps_stage_credit(c, m.src_rank, m.value);
    return;
  }
  if (m.op == PS_SIG_OP_CLOSED) { /* notices come on the refusal tag */
    ps_rma_fail(c, ncclRemoteError, "rank %u sent a window-closed notice as a signal", m.src_rank);
    return;
  }
  take_signal(c, &m);
}

/* A signal, from a message or a staged write: applied when what it covers
 * is there, else held until it is (ps_rma_held.c). */
static void take_signal(ps_rma_comm_t *c, const ps_sig_msg_t *m) {
  if (coverable(c, &c->peers[m->src_rank], m)) ps_rma_held_take(c, &c->peers[m->src_rank], m);
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
  if (c->error) return; /* a failed comm takes no more input from peers */
  on_signal(c, s, e->len);
  if (post_sig_slot(c, s) != ncclSuccess) ps_rma_fail(c, ncclSystemError, "cannot re-post a signal receive");
}

static ncclResult_t post_sig_slot(ps_rma_comm_t *c, ps_rma_sig_slot_t *s) {
  int ok = 0;
  uint64_t tag = s->op.idx < PS_RMA_SIG_SLOTS ? PS_TAG_RMA_SIG : PS_TAG_RMA_NACK;
  PS_CHECK(ps_ep_trecv(&c->ep, &s->msg, sizeof s->msg, c->sig_slots_desc, tag, &s->op, &ok));
  if (!ok) PS_WARN("one-sided comm: the provider refused a signal receive");
  return ok ? ncclSuccess : ncclSystemError;
}

/* A peer deregistered its part of a window (ps_rma_notice_closed): our
 * later calls into it are refused. A window we deregistered too is
 * forgotten already (collective teardown sends these both ways). */
static void on_closed(ps_rma_comm_t *c, ps_rma_sig_slot_t *s, const ps_sig_msg_t *m) {
  if (m->region_id >= c->nregions || m->src_rank == (uint32_t)c->rank ||
      (c->stage && c->regions[m->region_id] && c->regions[m->region_id] == c->stage->rx)) {
    ps_rma_fail(c, ncclRemoteError, "rank %u says it deregistered window %u, which was never "
                "registered (%u windows)", m->src_rank, m->region_id, c->nregions);
    return;
  }
  ps_rma_region_t *r = c->regions[m->region_id];
  if (r) {
    __atomic_store_n(&r->rclosed[m->src_rank], 1, __ATOMIC_RELEASE);
    PS_INFO(NCCL_NET, "one-sided comm rank %d: rank %u deregistered its part of window %u; calls "
            "into it are refused from now on", c->rank, m->src_rank, m->region_id);
  }
  if (post_sig_slot(c, s) != ncclSuccess)
    ps_rma_fail(c, ncclSystemError, "cannot re-post a refusal receive");
}

/* A peer refused one of our signals (refuse_signal) or dropped a staged put
 * of ours (refuse_staged): the caller believes it landed, so the comm fails,
 * naming the window and, where it is still registered here, its local
 * address. Or a peer's window-closed notice. */
static void nack_rx_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err,
                         const char *errstr) {
  ps_rma_sig_slot_t *s = op->owner;
  ps_rma_comm_t *c = s->comm;
  ps_sig_msg_t m;
  if (err) {
    if (err != -FI_ECANCELED) ps_rma_fail(c, ncclRemoteError, "refusal receive failed: %s", errstr);
    return;
  }
  if (c->error) return; /* a failed comm takes no more input from peers */
  if (ps_sig_decode(&s->msg, e->len, (uint32_t)c->nranks, &m) != ncclSuccess ||
      m.op == PS_SIG_OP_CREDIT) {
    ps_rma_fail(c, ncclRemoteError, "malformed refusal message dropped");
    return;
  }
  const char *kind = m.op == PS_SIG_OP_CLOSED ? "a window-closed notice" : "a refusal";
  if (!ps_rma_sender_ok(c, kind, m.src_rank, c->addr, s->op.src_named, s->op.src)) return;
  if (m.op == PS_SIG_OP_CLOSED) {
    on_closed(c, s, &m);
    return;
  }
  ps_rma_region_t *r = m.region_id < c->nregions ? c->regions[m.region_id] : NULL;
  char here[96] = "deregistered here too";
  if (r) snprintf(here, sizeof here, "here at %p, %zu B, still registered", (void *)r->base, r->size);
  if (m.covers == PS_NACK_PUT_DEREGISTERED) {
    ps_rma_fail(c, ncclRemoteError, "rank %u dropped our staged put (%llu B at offset %llu) into "
                "window %u (%s): the window is deregistered there: every rank must stop writing "
                "into a window before any rank deregisters it", m.src_rank,
                (unsigned long long)m.value, (unsigned long long)m.offset, m.region_id, here);
    return;
  }
  const char *why = m.covers == PS_NACK_DEREGISTERED
                        ? "the window is deregistered there: every rank must stop signalling a "
                          "window before any rank deregisters it"
                    : m.covers == PS_NACK_MISALIGNED
                        ? "the word is not 8-byte aligned there: that rank registered the window "
                          "at a misaligned address"
                        : "no reason given";
  ps_rma_fail(c, ncclRemoteError, "rank %u refused our signal (%s %llu) into window %u (%s) at "
              "offset %llu: %s", m.src_rank, m.op == NCCL_NET_SIGNAL_OP_INC ? "INC" : "ADD",
              (unsigned long long)m.value, m.region_id, here, (unsigned long long)m.offset, why);
}

static void nack_sent(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_rma_comm_t *c = op->owner;
  (void)e;
  c->nacks[op->idx].state = PS_NACK_IDLE;
  if (err) /* the origin is gone: its own liveness check, or ours, says so */
    PS_WARN("one-sided comm rank %d: the refusal to rank %d was not delivered: %s", c->rank,
            op->idx, errstr);
}

void ps_rma_send_nacks(ps_rma_comm_t *c) {
  c->nack_pending = 0;
  for (int i = 0; i < c->nranks; i++) {
    ps_rma_nack_t *n = &c->nacks[i];
    if (n->state != PS_NACK_QUEUED) continue;
    n->op = (ps_op_t){.cb = nack_sent, .owner = c, .idx = i};
    int posted = 0;
    if (ps_rma_post_sig_send(c, (uint32_t)i, &n->msg, sizeof n->msg, c->nacks_desc,
                             PS_TAG_RMA_NACK, &n->op, &posted) != ncclSuccess) {
      PS_WARN("one-sided comm rank %d: the provider refused the refusal to rank %d", c->rank, i);
      n->state = PS_NACK_IDLE;
      continue;
    }
    if (posted) n->state = PS_NACK_SENT;
    else c->nack_pending = 1; /* the provider is full: next pass */
  }
}

static void notice_sent(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err,
                        const char *errstr) {
  ps_rma_comm_t *c = op->owner;
  ps_rma_notice_t *n = &c->notes[op->idx];
  (void)e;
  n->busy = 0;
  if (err) { /* the peer closed (collective teardown): it needs no more */
    PS_INFO(NCCL_NET, "one-sided comm rank %d: window-closed notice to rank %d not delivered (%s)",
            c->rank, op->idx, errstr);
    n->gone = 1, n->nq = 0;
  } else if (n->nq) {
    c->note_pending = 1;
  }
}

void ps_rma_send_notices(ps_rma_comm_t *c) {
  c->note_pending = 0;
  for (int i = 0; i < c->nranks; i++) {
    ps_rma_notice_t *n = &c->notes[i];
    if (n->busy || n->gone || !n->nq) continue;
    n->msg = (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                            .op = PS_SIG_OP_CLOSED, .src_rank = (uint32_t)c->rank,
                            .region_id = n->queue[0]};
    n->op = (ps_op_t){.cb = notice_sent, .owner = c, .idx = i};
    int posted = 0;
    if (ps_rma_post_sig_send(c, (uint32_t)i, &n->msg, sizeof n->msg, c->notes_desc,
                             PS_TAG_RMA_NACK, &n->op, &posted) != ncclSuccess) {
      /* a post error (not a delivery failure): the peer's calls into
       * windows we deregister go unchecked from now on */
      PS_WARN("one-sided comm rank %d: the provider refused a window-closed notice to rank %d "
              "(window %u); no more notices go to it", c->rank, i, n->queue[0]);
      n->gone = 1, n->nq = 0;
      continue;
    }
    if (!posted) {
      c->note_pending = 1; /* the provider is full: next pass */
      continue;
    }
    n->busy = 1;
    memmove(n->queue, n->queue + 1, --n->nq * sizeof *n->queue);
  }
}

void ps_rma_notice_closed(ps_rma_comm_t *c, uint32_t id) {
  for (int i = 0; i < c->nranks; i++) {
    ps_rma_notice_t *n = &c->notes[i];
    if (i == c->rank || n->gone) continue;
    if (n->nq == n->cap) {
      uint32_t cap = n->cap ? 2 * n->cap : 8, *q = realloc(n->queue, cap * sizeof *q);
      if (!q) { /* the peer's calls into it will go unseen, as without notices */
        PS_WARN("one-sided comm rank %d: out of memory telling rank %d that window %u is "
                "deregistered", c->rank, i, id);
        continue;
      }
      n->queue = q, n->cap = cap;
    }
    n->queue[n->nq++] = id;
  }
  ps_rma_send_notices(c);
}

/* One registered entry per peer of `size` bytes (what the provider sends
 * from: refusals, notices); NULL on failure, logged. */
static void *per_peer_sendable(ps_rma_comm_t *c, size_t size, const char *what,
                               struct fid_mr **mr, void **desc) {
  void *p = calloc((size_t)c->nranks, size);
  if (!p) {
    PS_WARN("one-sided comm: out of memory for %d %s", c->nranks, what);
    return NULL;
  }
  if (ps_ep_reg_local(&c->ep, p, (size_t)c->nranks * size, mr) != ncclSuccess) {
    free(p);
    return NULL;
  }
  *desc = *mr ? fi_mr_desc(*mr) : NULL;
  return p;
}

ncclResult_t ps_rma_post_sig_slots(ps_rma_comm_t *c) {
  PS_CHECK(ps_ep_reg_local(&c->ep, c->sig_slots, sizeof c->sig_slots, &c->sig_slots_mr));
  c->sig_slots_desc = c->sig_slots_mr ? fi_mr_desc(c->sig_slots_mr) : NULL;
  c->nacks = per_peer_sendable(c, sizeof *c->nacks, "refusal slots", &c->nacks_mr, &c->nacks_desc);
  c->notes = per_peer_sendable(c, sizeof *c->notes, "window-closed notices", &c->notes_mr,
                               &c->notes_desc);
  if (!c->nacks || !c->notes) return ncclSystemError;
  c->ep.remote_write = remote_write;
  c->ep.remote_owner = c;
  for (int i = 0; i < PS_RMA_SIG_SLOTS + PS_RMA_NACK_SLOTS; i++) {
    ps_op_cb cb = i < PS_RMA_SIG_SLOTS ? sig_rx_done : nack_rx_done;
    c->sig_slots[i].op = (ps_op_t){.cb = cb, .owner = &c->sig_slots[i], .idx = i};
    c->sig_slots[i].comm = c;
    PS_CHECK(post_sig_slot(c, &c->sig_slots[i]));
  }
  return ncclSuccess;
}
