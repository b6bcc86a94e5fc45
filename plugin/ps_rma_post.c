/* How the engine's RMA writes and signal messages reach the provider:
 * directly, or, in test builds only (never the plugin), through a model NIC:
 *   -DPS_REORDER_TEST  an "unordered NIC" that holds each write 0-2 ms and
 *                      sends the held ones in random order, so a signal that
 *                      does not really wait for its data overtakes it;
 *   -DPS_LATENCY_TEST  a "distant NIC" that hands every write and signal
 *                      message to the provider PERSEUS_TEST_LATENCY_US after
 *                      it was posted, in order: fabric latency on loopback,
 *                      where a drain must wait it out once per batch and the
 *                      NIC-ordered strategies pipeline past it. */
#include <stdlib.h>
#include <string.h>

#include "ps_clock.h"
#include "ps_env.h"
#include "ps_log.h"
#include "ps_rma_int.h"

#if defined(PS_REORDER_TEST) || defined(PS_LATENCY_TEST)
struct ps_held_op {
  int is_send; /* a signal message (tagged send), else an RMA write */
  struct iovec iov;
  struct fi_rma_iov rma;
  void *desc, *context;
  fi_addr_t addr;
  uint64_t flags, data, tag;
  uint64_t release_ns;
};

/* Appends op to the held queue (grown as needed); *posted = 1. */
static ncclResult_t hold(ps_rma_comm_t *c, const struct ps_held_op *op, int *posted) {
  *posted = 0;
  if (c->held_head > 0 && c->nheld == c->cap_held) { /* room at the front: close the gap */
    memmove(c->held, c->held + c->held_head, (size_t)(c->nheld - c->held_head) * sizeof *c->held);
    c->nheld -= c->held_head, c->held_head = 0;
  }
  if (c->nheld == c->cap_held) {
    int cap = c->cap_held ? 2 * c->cap_held : 256;
    struct ps_held_op *n = realloc(c->held, (size_t)cap * sizeof *n);
    if (!n) return ncclSystemError;
    c->held = n, c->cap_held = cap;
  }
  c->held[c->nheld++] = *op;
  *posted = 1;
  return ncclSuccess;
}

static ssize_t send_held(ps_rma_comm_t *c, const struct ps_held_op *h) {
  if (h->is_send)
    return fi_tsend(c->ep.ep, h->iov.iov_base, h->iov.iov_len, h->desc, h->addr, h->tag, h->context);
  void *desc = h->desc;
  struct fi_msg_rma m = {.msg_iov = &h->iov, .desc = &desc, .iov_count = 1, .addr = h->addr,
                         .rma_iov = &h->rma, .rma_iov_count = 1, .context = h->context,
                         .data = h->data};
  return fi_writemsg(c->ep.ep, &m, h->flags);
}

/* An RMA write as the model NIC holds it (release time set by the caller). */
static struct ps_held_op held_write(const struct fi_msg_rma *m, uint64_t flags) {
  return (struct ps_held_op){.iov = m->msg_iov[0], .rma = m->rma_iov[0], .desc = m->desc[0],
                             .context = m->context, .addr = m->addr, .flags = flags,
                             .data = m->data};
}

void ps_rma_free_held(ps_rma_comm_t *c) { free(c->held); }
#endif

#ifdef PS_REORDER_TEST
ncclResult_t ps_rma_model_nic_init(ps_rma_comm_t *c) {
  c->rng = 0x9e3779b97f4a7c15ULL ^ (uint64_t)c->rank;
  return ncclSuccess;
}

static uint64_t next_rand(ps_rma_comm_t *c) {
  c->rng = c->rng * 6364136223846793005ULL + 1442695040888963407ULL;
  return c->rng >> 17;
}

ncclResult_t ps_rma_post_write(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_rma *m,
                               uint64_t flags, int *posted) {
  (void)peer; /* no lanes: fence is refused on the unordered NIC */
  struct ps_held_op op = held_write(m, flags);
  op.release_ns = ps_now_ns() + next_rand(c) % 2000000;
  return hold(c, &op, posted);
}

void ps_rma_release_held(ps_rma_comm_t *c) {
  uint64_t now = ps_now_ns();
  for (int tries = c->nheld; tries > 0 && c->nheld > 0; tries--) {
    int i = (int)(next_rand(c) % (uint64_t)c->nheld);
    struct ps_held_op *h = &c->held[i];
    if (h->release_ns > now) continue;
    ssize_t rc = send_held(c, h);
    if (rc == -FI_EAGAIN) return;
    if (rc) {
      ps_rma_fail(c, ncclSystemError, "held write: %s", fi_strerror((int)-rc));
      return;
    }
    c->held[i] = c->held[--c->nheld];
  }
}
#elif defined(PS_LATENCY_TEST)
ncclResult_t ps_rma_model_nic_init(ps_rma_comm_t *c) {
  int64_t us = 0;
  PS_CHECK(ps_env_int("PERSEUS_TEST_LATENCY_US", 50, 0, 10000000, &us));
  c->latency_ns = (uint64_t)us * 1000;
  return ncclSuccess;
}

static ncclResult_t hold_for_latency(ps_rma_comm_t *c, struct ps_held_op *op, int *posted) {
  op->release_ns = ps_now_ns() + c->latency_ns;
  return hold(c, op, posted);
}

ncclResult_t ps_rma_post_write(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_rma *m,
                               uint64_t flags, int *posted) {
  (void)peer; /* no lanes: fence is refused on the distant NIC */
  struct ps_held_op op = held_write(m, flags);
  return hold_for_latency(c, &op, posted);
}

ncclResult_t ps_rma_post_sig_send(ps_rma_comm_t *c, uint32_t peer, void *buf, size_t len,
                                  void *desc, uint64_t tag, ps_op_t *op, int *posted) {
  struct ps_held_op h = {.is_send = 1, .iov = {.iov_base = buf, .iov_len = len}, .desc = desc,
                         .context = op, .addr = c->addr[peer], .tag = tag};
  return hold_for_latency(c, &h, posted);
}

void ps_rma_release_held(ps_rma_comm_t *c) {
  uint64_t now = ps_now_ns();
  while (c->held_head < c->nheld && c->held[c->held_head].release_ns <= now) {
    ssize_t rc = send_held(c, &c->held[c->held_head]);
    if (rc == -FI_EAGAIN) return; /* in order: nothing overtakes the refused one */
    if (rc) {
      ps_rma_fail(c, ncclSystemError, "held operation: %s", fi_strerror((int)-rc));
      return;
    }
    c->held_head++;
  }
  if (c->held_head == c->nheld) c->held_head = c->nheld = 0;
}
#else
ncclResult_t ps_rma_model_nic_init(ps_rma_comm_t *c) {
  (void)c;
  return ncclSuccess;
}
ncclResult_t ps_rma_post_write(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_rma *m,
                               uint64_t flags, int *posted) {
  return ps_ep_writemsg(&c->ep, c->lanes ? c->lanes[peer] : c->ep.ep, m, flags, posted);
}
void ps_rma_release_held(ps_rma_comm_t *c) { (void)c; }
void ps_rma_free_held(ps_rma_comm_t *c) { (void)c; }
#endif

#ifndef PS_LATENCY_TEST
ncclResult_t ps_rma_post_sig_send(ps_rma_comm_t *c, uint32_t peer, void *buf, size_t len,
                                  void *desc, uint64_t tag, ps_op_t *op, int *posted) {
  return ps_ep_tsend(&c->ep, buf, len, desc, c->addr[peer], tag, op, posted);
}
#endif

/* Completion must mean "in the target's memory" where a signal waits for it. */
static uint64_t write_flags(const ps_rma_comm_t *c) {
  if (c->ordering == PS_ORD_DEFERRED || c->ordering == PS_ORD_DRAIN)
    return FI_COMPLETION | FI_DELIVERY_COMPLETE;
  return FI_COMPLETION;
}

ncclResult_t ps_rma_post_put(ps_rma_comm_t *c, uint32_t peer, struct fi_msg_rma *m, uint64_t seq,
                             int *posted) {
  uint64_t flags = write_flags(c);
  if (c->ordering == PS_ORD_TARGET) {
    flags |= FI_REMOTE_CQ_DATA; /* the target tracks which of our writes arrived */
    m->data = (uint64_t)c->rank << 32 | (uint32_t)seq;
  }
  return ps_rma_post_write(c, peer, m, flags, posted);
}

ncclResult_t ps_rma_post_staged(ps_rma_comm_t *c, uint32_t peer, struct fi_msg_rma *m, uint32_t slot,
                                int *posted) {
  m->data = PS_STAGED_DATA | (uint64_t)c->rank << 32 | slot;
  return ps_rma_post_write(c, peer, m, write_flags(c) | FI_REMOTE_CQ_DATA, posted);
}

ncclResult_t ps_rma_post_read(ps_rma_comm_t *c, const struct fi_msg_rma *m, int *posted) {
  return ps_ep_readmsg(&c->ep, m, FI_COMPLETION, posted);
}

/* On the peer's lane (fence strategy): FI_FENCE orders behind that peer's puts only. */
ncclResult_t ps_rma_post_atomic(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_atomic *m,
                                uint64_t flags, int *posted) {
  return ps_ep_atomicmsg(&c->ep, c->lanes[peer], m, flags, posted);
}

/* Staging credits go straight to the provider, never through a model NIC. */
ncclResult_t ps_rma_post_credit(ps_rma_comm_t *c, uint32_t peer, void *buf, size_t len, void *desc,
                                ps_op_t *op, int *posted) {
  return ps_ep_tsend(&c->ep, buf, len, desc, c->addr[peer], PS_TAG_RMA_SIG, op, posted);
}
