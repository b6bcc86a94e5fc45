/* The collective exchanges of a one-sided comm: every symmetric
 * registration's, and the staging streams' addresses (ps_rma_stream.c). */
#include <stdio.h>
#include <stdlib.h>

#include "ps_clock.h"
#include "ps_log.h"
#include "ps_rma_int.h"

/* What a receive took: its bytes, and who sent them where the endpoint
 * names senders (ps_op_t's src). */
typedef struct {
  size_t len;
  int named;
  fi_addr_t src;
} ag_got_t;

typedef struct {
  ps_op_t op;
  int done;
  ag_got_t got;
} ag_slot_t;

static void ag_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ag_slot_t *s = op->owner;
  if (err) PS_WARN("registration exchange failed: %s", errstr);
  s->done = err ? -1 : 1;
  s->got = (ag_got_t){.len = e ? e->len : 0, .named = op->src_named, .src = op->src};
}

#define PS_REG_HELD_NS 50000000ull /* a pass longer than this was the provider's, not ours */

/* Blocking allgather of one fixed-size message: each rank sends `mine` to
 * every peer and receives theirs, progressing until done. */
/* `what` names the exchange in errors (e.g. "symmetric registration 3").
 * parts: nranks messages of `len` bytes, ours left as is; got[p]: the bytes
 * the part received into slot p had, and its sender (untrusted: the caller
 * decodes each, and checks the rank it claims against its sender). */
static ncclResult_t allgather(ps_rma_comm_t *c, uint64_t tag, const void *mine, size_t len,
                              char *parts, ag_got_t *got, const char *what) {
  int P = c->nranks;
  ag_slot_t *rx = calloc((size_t)P, sizeof *rx), *tx = calloc((size_t)P, sizeof *tx);
  ncclResult_t rc = (rx && tx) ? ncclSuccess : ncclSystemError;
  for (int p = 0; rc == ncclSuccess && p < P; p++) {
    if (p == c->rank) continue;
    int ok = 0;
    rx[p].op = (ps_op_t){.cb = ag_done, .owner = &rx[p]};
    tx[p].op = (ps_op_t){.cb = ag_done, .owner = &tx[p]};
    rc = ps_ep_trecv(&c->ep, parts + (size_t)p * len, len, NULL, tag, &rx[p].op, &ok);
    if (rc == ncclSuccess && !ok) rc = ncclSystemError;
    tx[p].done = 2; /* not posted yet: the loop below posts it */
  }
  /* the exchange is collective: a peer that has not sent its part within
   * PERSEUS_PEER_TIMEOUT_MS is not taking part (or is gone) */
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
    c->own_waits++; /* a wait of ours counts as a call */
    rc = c->error;
    left = 0;
    for (int p = 0; rc == ncclSuccess && p < P; p++) {
      if (p == c->rank) continue;
      if (tx[p].done == 2) { /* -FI_EAGAIN while the provider connects: retry here */
        int ok = 0;
        rc = ps_ep_tsend(&c->ep, mine, len, NULL, c->addr[p], tag, &tx[p].op, &ok);
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
      PS_WARN("%s: %s within %llu ms (PERSEUS_PEER_TIMEOUT_MS); registration is collective: "
              "every rank must register its window (this rank made %u progress passes, at most "
              "%llu ms apart; %llu ms more for the provider's own holds)", what, who,
              (unsigned long long)(c->timeout_ns / 1000000), passes,
              (unsigned long long)(longest / 1000000), (unsigned long long)(extended / 1000000));
      rc = ncclRemoteError;
    }
  }
  for (int p = 0; rc == ncclSuccess && p < P; p++) got[p] = rx[p].got;
  if (rc != ncclSuccess) {
    ps_rma_fail(c, rc, "%s failed", what);
    ps_ep_close(&c->ep); /* operations still posted into parts or from `mine` die with it */
  }
  free(rx), free(tx);
  return rc;
}

/* A decoded part names `rank`: sent by that rank where the endpoint can
 * tell, another rank's, and the first part for it (parts arrive from any
 * peer). seen: one byte per rank. */
static ncclResult_t take_part(ps_rma_comm_t *c, char *seen, uint32_t rank, const ag_got_t *got,
                              const char *what) {
  char kind[80];
  snprintf(kind, sizeof kind, "a part of %s", what);
  if (!ps_rma_sender_ok(c, kind, rank, c->addr, got->named, got->src)) return ncclRemoteError;
  if (rank != (uint32_t)c->rank && !seen[rank]++) return ncclSuccess;
  PS_WARN("%s: duplicate part for rank %u", what, rank);
  return ncclRemoteError;
}

ncclResult_t ps_rma_allgather_region(ps_rma_comm_t *c, ps_rma_region_t *r) {
  int P = c->nranks;
  ps_reg_msg_t mine = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                       .flags = r->staged ? PS_REG_STAGED : 0, .rank = (uint32_t)c->rank,
                       .region_id = r->id, .size = r->size, .key = r->mr ? fi_mr_key(r->mr) : 0,
                       .addr = c->ep.dev->mr_virt_addr ? (uint64_t)(uintptr_t)r->base : 0};
  r->raddr[c->rank] = mine.addr, r->rsize[c->rank] = mine.size, r->rkey[c->rank] = mine.key;
  ps_reg_msg_t *parts = calloc((size_t)P, sizeof *parts);
  ag_got_t *got = calloc((size_t)P, sizeof *got);
  char *seen = calloc((size_t)P, 1);
  char what[48];
  snprintf(what, sizeof what, "symmetric registration %u", r->id);
  ncclResult_t rc = parts && got && seen ? ncclSuccess : ncclSystemError;
  if (rc == ncclSuccess)
    rc = allgather(c, PS_TAG_RMA_REG(r->id), &mine, sizeof mine, (char *)parts, got, what);
  for (int p = 0; rc == ncclSuccess && p < P; p++) {
    if (p == c->rank) continue;
    ps_reg_msg_t m;
    rc = ps_reg_decode(&parts[p], got[p].len, (uint32_t)P, r->id, &m);
    if (rc == ncclSuccess) rc = take_part(c, seen, m.rank, &got[p], what);
    if (rc == ncclSuccess && !(m.flags & PS_REG_STAGED) != !r->staged) {
      PS_WARN("symmetric registration %u: rank %u registered %s memory, this rank %s memory",
              r->id, m.rank, (m.flags & PS_REG_STAGED) ? "GPU" : "host", r->staged ? "GPU" : "host");
      rc = ncclInvalidUsage;
    }
    if (rc == ncclSuccess) r->raddr[m.rank] = m.addr, r->rsize[m.rank] = m.size, r->rkey[m.rank] = m.key;
  }
  if (rc != ncclSuccess && !c->error) ps_rma_fail(c, rc, "%s failed", what);
  free(parts), free(got), free(seen);
  return rc;
}

ncclResult_t ps_rma_allgather_streams(ps_rma_comm_t *c, const ps_streams_msg_t *mine,
                                      ps_streams_msg_t *all) {
  int P = c->nranks;
  const char *what = "staging streams exchange";
  ps_streams_msg_t *parts = calloc((size_t)P, sizeof *parts);
  ag_got_t *got = calloc((size_t)P, sizeof *got);
  char *seen = calloc((size_t)P, 1);
  ncclResult_t rc = parts && got && seen ? ncclSuccess : ncclSystemError;
  if (rc == ncclSuccess)
    rc = allgather(c, PS_TAG_RMA_STREAMS, mine, sizeof *mine, (char *)parts, got, what);
  all[c->rank] = *mine;
  for (int p = 0; rc == ncclSuccess && p < P; p++) {
    if (p == c->rank) continue;
    ps_streams_msg_t m;
    rc = ps_streams_decode(&parts[p], got[p].len, (uint32_t)P, &m);
    if (rc == ncclSuccess) rc = take_part(c, seen, m.rank, &got[p], what);
    if (rc == ncclSuccess) all[m.rank] = m;
  }
  if (rc != ncclSuccess && !c->error) ps_rma_fail(c, rc, "%s failed", what);
  free(parts), free(got), free(seen);
  return rc;
}
