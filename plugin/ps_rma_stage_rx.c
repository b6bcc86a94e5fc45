/* Staging, target side: a peer's staged write lands in the receive slot it
 * names; we check its header, copy the payload into the GPU window on the
 * copy stream, and hand the slot back (a credit message) once the copy has
 * finished. Signals on GPU words are applied in stream order behind every
 * copy enqueued before them, so the GPU never sees a signal before its data.
 * Nothing in a slot is trusted: the slot, the header, the window and the
 * range are all checked before the copy engine touches GPU memory. */
#include <stdlib.h>

#include "ps_clock.h"
#include "ps_log.h"
#include "ps_rma_int.h"

static uint32_t ring_size(const ps_rma_comm_t *c) { return (uint32_t)c->nranks * c->stage->per_peer; }

/* The first record names the staged write: it must be the one this
 * receive slot is for, inside the credit we gave, and new. */
static int check_first(ps_rma_comm_t *c, uint32_t src, uint32_t slot, const ps_stage_hdr_t *h) {
  ps_stage_t *st = c->stage;
  ps_rma_peer_t *p = &c->peers[src];
  if (h->stage_seq % st->per_peer != slot || h->stage_seq < p->stage_done.below ||
      h->stage_seq - p->stage_done.below >= st->per_peer) {
    ps_rma_fail(c, ncclRemoteError, "staged write %llu from rank %u in slot %u is outside its "
                "credit (slots free from %llu, %u of them)", (unsigned long long)h->stage_seq, src,
                slot, (unsigned long long)p->stage_done.below, st->per_peer);
    return 0;
  }
  if (ps_seqwin_mark(&p->stage_in, h->stage_seq, st->per_peer)) {
    ps_rma_fail(c, ncclRemoteError, "rank %u sent staged write %llu twice", src,
                (unsigned long long)h->stage_seq);
    return 0;
  }
  return 1;
}

/* What take_record made of a record. */
enum { PS_REC_REFUSED, PS_REC_TAKEN, PS_REC_DROPPED };

/* Record h of a staged write (its payload at byte doff of receive slot
 * buf): checks the window it names and enqueues its copy into the GPU.
 * A window we deregistered is no fault of ours or the peer's (its put left
 * before our notice reached it): the payload is dropped and the caller
 * tells the origin (PS_REC_DROPPED). A window never registered, or not a
 * GPU one, or a range outside it, is a broken peer: the comm fails
 * (PS_REC_REFUSED). */
static int take_record(ps_rma_comm_t *c, uint32_t src, const char *buf, const ps_stage_hdr_t *h,
                       size_t doff, uint64_t *ticket) {
  ps_stage_t *st = c->stage;
  if (h->sig_op) return PS_REC_TAKEN; /* checked against its region when it is applied */
  if (h->region_id < c->nregions && !c->regions[h->region_id]) return PS_REC_DROPPED;
  ps_rma_region_t *r = h->region_id < c->nregions ? c->regions[h->region_id] : NULL;
  if (!r || !r->staged || h->offset > r->size || r->size - h->offset < h->len) {
    ps_rma_fail(c, ncclRemoteError, "staged write from rank %u rejected: region %u offset %llu "
                "+ %llu B is not inside a GPU window (%s%zu B)", src, h->region_id,
                (unsigned long long)h->offset, (unsigned long long)h->len,
                r ? "" : "never registered: ", r ? r->size : (size_t)0);
    return PS_REC_REFUSED;
  }
  if (h->len && ps_cuda_h2d(st->cu, PS_CUDA_COPY_STREAM, r->base + h->offset, buf + doff, h->len,
                            ticket) != ncclSuccess) {
    ps_rma_fail(c, ncclSystemError, "copying a staged write from rank %u into the GPU failed", src);
    return PS_REC_REFUSED;
  }
  return PS_REC_TAKEN;
}

/* Record h: a chunk's put sequence to seqs, or a signal to sigs. */
static void sort_record(uint32_t src, const ps_stage_hdr_t *h, uint64_t *seqs, uint32_t *nseq,
                        ps_sig_msg_t *sigs, uint32_t *nsig) {
  if (!h->sig_op) {
    seqs[(*nseq)++] = h->seq;
    return;
  }
  sigs[(*nsig)++] = (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                                   .op = h->sig_op, .src_rank = src, .region_id = h->region_id,
                                   .offset = h->offset, .value = h->sig_value, .covers = h->seq,
                                   .covers_staged = h->stage_seq};
}

int ps_stage_arrived(ps_rma_comm_t *c, uint32_t src, uint32_t slot, uint64_t *seqs, uint32_t *nseq,
                     ps_sig_msg_t *sigs, uint32_t *nsig, ps_stage_hdr_t *dropped,
                     uint32_t *ndropped) {
  ps_stage_t *st = c->stage;
  *nseq = 0, *nsig = 0, *ndropped = 0;
  if (!st || slot >= st->per_peer) {
    ps_rma_fail(c, ncclRemoteError, "rank %u sent a staged write to slot %u, but it has %u", src,
                slot, st ? st->per_peer : 0);
    return 0;
  }
  const char *buf = st->rx_pool + ((size_t)src * st->per_peer + slot) * st->slot_bytes;
  ps_stage_hdr_t h[PS_STAGE_MAX_RECS];
  size_t doff[PS_STAGE_MAX_RECS];
  uint32_t n = ps_stage_layout(buf, st->slot_bytes, src, PS_STAGE_MAX_RECS, h, doff);
  if (!n) {
    ps_rma_fail(c, ncclRemoteError, "malformed staged write from rank %u in slot %u dropped", src, slot);
    return 0;
  }
  if (!check_first(c, src, slot, &h[0])) return 0;
  uint64_t ticket = 0;
  for (uint32_t i = 0; i < n; i++) {
    int taken = take_record(c, src, buf, &h[i], doff[i], &ticket);
    if (taken == PS_REC_REFUSED) return 0;
    if (taken == PS_REC_DROPPED && !(*ndropped)++) *dropped = h[i];
    /* a dropped chunk still arrived: target's count goes past it */
    sort_record(src, &h[i], seqs, nseq, sigs, nsig);
  }
  ps_stage_copy_t *k = &st->copies[(st->copy_head + st->ncopies) % ring_size(c)];
  *k = (ps_stage_copy_t){.src = src, .stage_seq = h[0].stage_seq, .ticket = ticket};
  st->ncopies++;
  st->changed = 1;
  return 1;
}

/* The copy stream runs in order: finished copies form a prefix of the ring. */
static void poll_copies(ps_rma_comm_t *c, ps_stage_t *st) {
  while (st->ncopies && !c->error) {
    ps_stage_copy_t *k = &st->copies[st->copy_head];
    int done = ps_cuda_passed(st->cu, PS_CUDA_COPY_STREAM, k->ticket);
    if (done < 0) {
      ps_rma_fail(c, ncclSystemError, "copying a staged write from rank %u into the GPU failed", k->src);
      return;
    }
    if (!done) return;
    if (ps_seqwin_mark(&c->peers[k->src].stage_done, k->stage_seq, st->per_peer)) {
      ps_rma_fail(c, ncclSystemError, "no memory to track staged writes of rank %u", k->src);
      return;
    }
    st->copy_head = (st->copy_head + 1) % ring_size(c);
    st->ncopies--;
    st->changed = 1;
  }
}

static void retire_word(ps_stage_t *st, uint32_t i) {
  ps_stage_word_t *w = &st->words[i];
  uint64_t *cell = w->cell;
  st->words[i] = st->words[--st->nwords];
  st->free_cells[PS_STAGE_MAX_WORDS - st->nwords - 1] = cell; /* push */
  st->changed = 1;
}

/* A signal word's mark: its value was read (write value + adds now), or
 * our last write landed with no add in flight (forget the word: the GPU may
 * reset it, and the next add reads afresh). */
static void poll_words(ps_rma_comm_t *c, ps_stage_t *st) {
  for (uint32_t i = 0; i < st->nwords && !c->error;) {
    ps_stage_word_t *w = &st->words[i];
    int done = ps_cuda_passed(st->cu, w->writing ? PS_CUDA_COPY_STREAM : PS_CUDA_READ_STREAM,
                              w->ticket);
    if (done < 0) {
      ps_rma_fail(c, ncclSystemError, "a signal update in GPU memory failed");
      return;
    }
    if (!done) {
      i++;
      continue;
    }
    if (!w->writing) {
      w->last = __atomic_load_n(w->cell, __ATOMIC_ACQUIRE) + w->accum;
      w->accum = 0;
      w->writing = 1;
      if (ps_cuda_write64(st->cu, PS_CUDA_COPY_STREAM, w->addr, w->last, &w->ticket) != ncclSuccess) {
        ps_rma_fail(c, ncclSystemError, "a signal update in GPU memory failed");
        return;
      }
      i++;
      continue;
    }
    retire_word(st, i);
  }
}

int ps_stage_signal(ps_rma_comm_t *c, char *addr, uint64_t add) {
  ps_stage_t *st = c->stage;
  for (uint32_t i = 0; i < st->nwords; i++) {
    ps_stage_word_t *w = &st->words[i];
    if (w->addr != addr) continue;
    if (!w->writing) { /* its read is in flight: the add joins the write after it */
      w->accum += add;
      return 0;
    }
    /* Our last write landed: the GPU may have seen it and reset the word
     * since, so this add starts afresh with a read. Still in flight: the
     * GPU cannot have passed a wait on it, so nothing was reset; add on top. */
    int landed = ps_cuda_passed(st->cu, PS_CUDA_COPY_STREAM, w->ticket);
    if (landed < 0) {
      ps_rma_fail(c, ncclSystemError, "a signal update in GPU memory failed");
      return 0;
    }
    if (landed) {
      retire_word(st, i);
      break;
    }
    w->last += add;
    if (ps_cuda_write64(st->cu, PS_CUDA_COPY_STREAM, addr, w->last, &w->ticket) != ncclSuccess) {
      ps_rma_fail(c, ncclSystemError, "a signal update in GPU memory failed");
      return 0;
    }
    return 0;
  }
  if (st->nwords == PS_STAGE_MAX_WORDS) return 1; /* held until a word retires */
  ps_stage_word_t *w = &st->words[st->nwords];
  /* the top of the free-cell stack; taken for good once nwords grows */
  *w = (ps_stage_word_t){.addr = addr, .accum = add,
                         .cell = st->free_cells[PS_STAGE_MAX_WORDS - st->nwords - 1]};
  if (ps_cuda_d2h(st->cu, PS_CUDA_READ_STREAM, w->cell, addr, sizeof *w->cell, &w->ticket) !=
      ncclSuccess) {
    ps_rma_fail(c, ncclSystemError, "reading a signal in GPU memory failed");
    return 0;
  }
  st->nwords++;
  return 0;
}

/* A credit only matters to its origin: one that cannot be delivered means
 * the origin closed (a credit racing its shutdown) or is unreachable, which
 * its own liveness check reports. Not this comm's failure: stop sending. */
static void drop_credits(ps_rma_comm_t *c, int peer) {
  c->peers[peer].credit_busy = 1; /* never cleared: nothing more goes to it */
}

static void credit_sent(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_rma_comm_t *c = op->owner;
  (void)e;
  c->peers[op->idx].credit_busy = 0;
  if (err) { /* the origin closed, or its own liveness check will say it is gone */
    PS_INFO(NCCL_NET, "one-sided comm rank %d: staging credits to rank %d not delivered (%s); "
            "no more will be sent", c->rank, op->idx, errstr);
    drop_credits(c, op->idx);
    return;
  }
  c->stage->changed = 1; /* more may have been freed meanwhile */
}

/* One credit message in flight per origin; it carries the latest count. */
void ps_stage_send_credits(ps_rma_comm_t *c) {
  ps_stage_t *st = c->stage;
  for (int i = 0; i < c->nranks && !c->error; i++) {
    ps_rma_peer_t *p = &c->peers[i];
    if (p->credit_busy || p->stage_done.below == p->credit_sent) continue;
    st->credit[i] = (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                                   .op = PS_SIG_OP_CREDIT, .src_rank = (uint32_t)c->rank,
                                   .value = p->stage_done.below};
    st->credit_op[i] = (ps_op_t){.cb = credit_sent, .owner = c, .idx = i};
    int posted = 0;
    if (ps_rma_post_credit(c, (uint32_t)i, &st->credit[i], sizeof st->credit[i], st->credit_desc,
                           &st->credit_op[i], &posted) != ncclSuccess) {
      /* the provider's error on the post (the endpoint logged it), not a
       * peer that closed, which shows as a failed completion */
      PS_WARN("one-sided comm rank %d: the provider refused a staging credit to rank %d (its staged "
              "writes to this rank stall without it); no more credits go to it", c->rank, i);
      drop_credits(c, i);
      continue;
    }
    if (!posted) {
      st->changed = 1; /* the provider is full: next pass */
      continue;
    }
    p->credit_busy = 1;
    p->credit_sent = p->stage_done.below;
  }
}

int ps_stage_progress(ps_rma_comm_t *c) {
  ps_stage_t *st = c->stage;
  if (!st) return 0;
  poll_copies(c, st);
  poll_words(c, st);
  if (!st->changed || c->error) return 0;
  st->changed = 0;
  return 1;
}

/* Before a GPU window goes away: the copy engine may still be writing into
 * it (payload copies, signal words). Waits, bounded, until nothing is in
 * flight, so unmapping the memory afterwards cannot fault the GPU. A failed
 * comm tracks its copies no more (and may hold some not yet handed to the
 * GPU): it waits for everything the streams were given, held copies first.
 * 0, or -1 (logged) when something may still be writing at the deadline. */
int ps_stage_quiesce(ps_rma_comm_t *c) {
  ps_stage_t *st = c->stage;
  if (!st) return 0;
  uint64_t deadline = ps_now_ns() + PS_STAGE_QUIESCE_NS;
  while ((st->ncopies || st->nwords) && !c->error && ps_now_ns() < deadline) {
    ps_stage_flush(c);
    poll_copies(c, st);
    poll_words(c, st);
  }
  if (c->error) {
    uint64_t now = ps_now_ns();
    if (!st->cu || ps_cuda_quiesce(st->cu, deadline > now ? deadline - now : 0) == ncclSuccess) return 0;
  } else if (!st->ncopies && !st->nwords) {
    return 0;
  }
  PS_WARN("a GPU window's copies and signal updates were still in flight after %llu ms (%u and %u "
          "tracked)", (unsigned long long)(PS_STAGE_QUIESCE_NS / 1000000), st->ncopies, st->nwords);
  return -1;
}
