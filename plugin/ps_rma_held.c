/* One-sided engine, target side: signals held until what they cover is
 * there. A signal waits first for its writes (target strategy: `covers`,
 * against the peer's arrived window), then for its staged writes
 * (`covers_staged`, against the copies into the GPU enqueued, for a signal
 * word in a staged window, or done, for any other). Each wait is a min-heap
 * on the number the signal waits for, so an arrival looks only at the
 * signals it can release: a peer's held signals cost log n each, not a scan
 * of all of them per arrival (a peer holding many would otherwise stall the
 * engine for as long as it liked). A signal whose GPU word cannot be
 * tracked yet waits in a queue that each pass retries up to its first
 * refusal. */
#include <stdlib.h>
#include <string.h>

#include "ps_rma_int.h"

/* The number a heap's signals wait for: the held_in and held_done heaps
 * wait for staged writes, held_writes for writes. */
static uint64_t key_of(const ps_rma_held_heap_t *h, const ps_sig_msg_t *m) {
  return h->staged ? m->covers_staged : m->covers;
}

static void sift_up(ps_rma_held_heap_t *h, uint32_t i) {
  while (i > 0) {
    uint32_t up = (i - 1) / 2;
    if (key_of(h, &h->v[up]) <= key_of(h, &h->v[i])) return;
    ps_sig_msg_t t = h->v[up];
    h->v[up] = h->v[i], h->v[i] = t;
    i = up;
  }
}

static void sift_down(ps_rma_held_heap_t *h, uint32_t i) {
  for (;;) {
    uint32_t l = 2 * i + 1, r = l + 1, least = i;
    if (l < h->n && key_of(h, &h->v[l]) < key_of(h, &h->v[least])) least = l;
    if (r < h->n && key_of(h, &h->v[r]) < key_of(h, &h->v[least])) least = r;
    if (least == i) return;
    ps_sig_msg_t t = h->v[least];
    h->v[least] = h->v[i], h->v[i] = t;
    i = least;
  }
}

/* The smallest key's signal comes out while it is below `reached`. */
static int pop_below(ps_rma_held_heap_t *h, uint64_t reached, ps_sig_msg_t *out) {
  if (!h->n || key_of(h, &h->v[0]) >= reached) return 0;
  *out = h->v[0];
  h->v[0] = h->v[--h->n];
  sift_down(h, 0);
  return 1;
}

/* A peer cannot have more signals waiting than its writes in flight; the
 * cap only bounds what a broken peer can make us allocate. */
static int under_cap(ps_rma_comm_t *c, const ps_rma_peer_t *p, const ps_sig_msg_t *m) {
  if (p->nheld < PS_RMA_MAX_REQS) return 1;
  ps_rma_fail(c, ncclSystemError, "rank %u has over %u signals waiting for their data", m->src_rank,
              PS_RMA_MAX_REQS);
  return 0;
}

static int push(ps_rma_comm_t *c, ps_rma_peer_t *p, ps_rma_held_heap_t *h, const ps_sig_msg_t *m) {
  if (!under_cap(c, p, m)) return 0;
  if (h->n == h->cap) {
    uint32_t cap = h->cap ? 2 * h->cap : 16;
    ps_sig_msg_t *v = realloc(h->v, cap * sizeof *v);
    if (!v) {
      ps_rma_fail(c, ncclSystemError, "out of memory holding %u signals of rank %u", h->n + 1,
                  m->src_rank);
      return 0;
    }
    h->v = v, h->cap = cap;
  }
  h->v[h->n] = *m;
  sift_up(h, h->n++);
  p->nheld++;
  return 1;
}

/* Whether m's signal word lies in a staged (GPU) window: its copy is
 * enqueued behind the staged data, so enqueued suffices. */
static int into_staged_window(const ps_rma_comm_t *c, const ps_sig_msg_t *m) {
  ps_rma_region_t *r = m->region_id < c->nregions ? c->regions[m->region_id] : NULL;
  return r && r->staged;
}

/* Applies m, or queues it when the GPU word it adds to cannot be tracked
 * now (ps_rma_apply_signal says 1): a later pass retries it. */
static void apply_or_queue(ps_rma_comm_t *c, ps_rma_peer_t *p, const ps_sig_msg_t *m) {
  if (!ps_rma_apply_signal(c, m)) return;
  ps_rma_held_fifo_t *q = &p->held_ready;
  if (!under_cap(c, p, m)) return;
  if (q->head && q->n == q->cap) { /* room at the front: close the gap */
    memmove(q->v, q->v + q->head, (q->n - q->head) * sizeof *q->v);
    q->n -= q->head, q->head = 0;
  }
  if (q->n == q->cap) {
    uint32_t cap = q->cap ? 2 * q->cap : 16;
    ps_sig_msg_t *v = realloc(q->v, cap * sizeof *v);
    if (!v) {
      ps_rma_fail(c, ncclSystemError, "out of memory holding a signal of rank %u", m->src_rank);
      return;
    }
    q->v = v, q->cap = cap;
  }
  q->v[q->n++] = *m;
  p->nheld++;
}

/* m's writes are there: apply it if its staged writes are too, else hold
 * it for them. */
static void writes_there(ps_rma_comm_t *c, ps_rma_peer_t *p, const ps_sig_msg_t *m) {
  int staged_win = into_staged_window(c, m);
  uint64_t reached = staged_win ? p->stage_in.below : p->stage_done.below;
  if (!m->covers_staged || m->covers_staged < reached) apply_or_queue(c, p, m);
  else (void)push(c, p, staged_win ? &p->held_in : &p->held_done, m);
}

void ps_rma_held_take(ps_rma_comm_t *c, ps_rma_peer_t *p, const ps_sig_msg_t *m) {
  if (m->covers >= p->arrived.below) (void)push(c, p, &p->held_writes, m);
  else writes_there(c, p, m);
}

void ps_rma_held_release(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  /* first the signals whose GPU word had no tracking room: in order, up to
   * the first that still has none (adds commute, so order is free) */
  ps_rma_held_fifo_t *q = &p->held_ready;
  while (!c->error && q->head < q->n && !ps_rma_apply_signal(c, &q->v[q->head])) q->head++, p->nheld--;
  if (q->head == q->n) q->head = q->n = 0;
  ps_sig_msg_t m;
  while (!c->error && pop_below(&p->held_writes, p->arrived.below, &m)) {
    p->nheld--;
    writes_there(c, p, &m);
  }
  while (!c->error && pop_below(&p->held_in, p->stage_in.below, &m)) {
    p->nheld--;
    apply_or_queue(c, p, &m);
  }
  while (!c->error && pop_below(&p->held_done, p->stage_done.below, &m)) {
    p->nheld--;
    apply_or_queue(c, p, &m);
  }
}

void ps_rma_held_init(ps_rma_peer_t *p) {
  p->held_writes = (ps_rma_held_heap_t){.staged = 0};
  p->held_in = p->held_done = (ps_rma_held_heap_t){.staged = 1};
  p->held_ready = (ps_rma_held_fifo_t){0};
  p->nheld = 0;
}

void ps_rma_held_free(ps_rma_peer_t *p) {
  free(p->held_writes.v), free(p->held_in.v), free(p->held_done.v), free(p->held_ready.v);
  ps_rma_held_init(p);
}
