/* The collective exchange behind every symmetric registration. */
#include <stdio.h>
#include <stdlib.h>

#include "ps_clock.h"
#include "ps_log.h"
#include "ps_rma_int.h"

/* Blocking allgather of one region's {addr, size, key}: each rank sends its
 * part to every peer and receives theirs, progressing until done. */
typedef struct {
  ps_reg_msg_t msg;
  ps_op_t op;
  int done;
  int seen; /* a part naming this slot's rank was taken */
  size_t len;
} ag_slot_t;

static void ag_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ag_slot_t *s = op->owner;
  if (err) PS_WARN("registration exchange failed: %s", errstr);
  s->done = err ? -1 : 1;
  s->len = e ? e->len : 0;
}

#define PS_REG_HELD_NS 50000000ull /* a pass longer than this was the provider's, not ours */

ncclResult_t ps_rma_allgather_region(ps_rma_comm_t *c, ps_rma_region_t *r) {
  int P = c->nranks;
  ag_slot_t *rx = calloc((size_t)P, sizeof *rx), *tx = calloc((size_t)P, sizeof *tx);
  ncclResult_t rc = (rx && tx) ? ncclSuccess : ncclSystemError;
  ps_reg_msg_t mine = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                       .flags = r->staged ? PS_REG_STAGED : 0, .rank = (uint32_t)c->rank,
                       .region_id = r->id, .size = r->size, .key = r->mr ? fi_mr_key(r->mr) : 0,
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
  /* registration is collective: a peer that has not sent its part within
   * PERSEUS_PEER_TIMEOUT_MS is not registering (or is gone) */
  uint64_t start = ps_now_ns(), deadline = start + c->timeout_ns, last = start, longest = 0;
  uint64_t extended = 0;
  unsigned passes = 0;
  for (int left = 1; rc == ncclSuccess && left;) {
    /* the longest gap between our own passes tells a starved or stopped
     * process (ours) from a silent peer in the timeout message */
    uint64_t t = ps_now_ns();
    if (t - last > longest) longest = t - last;
    last = t, passes++;
    ps_rma_progress_pass(c);
    __atomic_add_fetch(&c->progress_calls, 1, __ATOMIC_RELAXED); /* a wait of ours counts as a call */
    rc = c->error;
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
    uint64_t now = ps_now_ns();
    if (now - last > longest) longest = now - last;
    /* Time the provider held this rank inside its calls (connecting, under
     * load: seconds were seen) is time no part could be watched for: it
     * moves the deadline, by one PERSEUS_PEER_TIMEOUT_MS at most, so a
     * provider that keeps doing so still ends in the error below. */
    if (now - t > PS_REG_HELD_NS && extended < c->timeout_ns) {
      uint64_t add = now - t - PS_REG_HELD_NS;
      add = add < c->timeout_ns - extended ? add : c->timeout_ns - extended;
      deadline += add, extended += add;
    }
    if (left && now > deadline) {
      int missing = -1;
      for (int p = 0; p < P && missing < 0; p++)
        if (p != c->rank && !rx[p].done) missing = p;
      char who[64] = "our part was not taken";
      if (missing >= 0) snprintf(who, sizeof who, "rank %d (and maybe others) sent no part", missing);
      PS_WARN("symmetric registration %u: %s within %llu ms (PERSEUS_PEER_TIMEOUT_MS); "
              "registration is collective: every rank must register its window (this rank "
              "made %u progress passes, at most %llu ms apart; %llu ms more for the provider's "
              "own holds)", r->id, who, (unsigned long long)(c->timeout_ns / 1000000), passes,
              (unsigned long long)(longest / 1000000), (unsigned long long)(extended / 1000000));
      rc = ncclRemoteError;
    }
  }
  /* Parts arrive from any peer: each must name a distinct rank. */
  for (int p = 0; rc == ncclSuccess && p < P; p++) {
    if (p == c->rank) continue;
    ps_reg_msg_t m;
    rc = ps_reg_decode(&rx[p].msg, rx[p].len, (uint32_t)P, r->id, &m);
    if (rc == ncclSuccess && (m.rank == (uint32_t)c->rank || rx[m.rank].seen++)) {
      PS_WARN("symmetric registration %u: duplicate part for rank %u", r->id, m.rank);
      rc = ncclRemoteError;
    }
    if (rc == ncclSuccess && !(m.flags & PS_REG_STAGED) != !r->staged) {
      PS_WARN("symmetric registration %u: rank %u registered %s memory, this rank %s memory",
              r->id, m.rank, (m.flags & PS_REG_STAGED) ? "GPU" : "host", r->staged ? "GPU" : "host");
      rc = ncclInvalidUsage;
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
