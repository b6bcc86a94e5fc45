/* How the engine's writes, reads, atomics and messages reach the provider:
 * the one place they are handed to the endpoint. A test plugin's model NIC
 * (ps_model_nic.h) may take writes and signal messages first and hand them
 * over later; the shipped plugin has none. */
#include "ps_log.h"
#include "ps_rma_int.h"

ncclResult_t ps_rma_model_open(ps_rma_comm_t *c) {
  if (!ps_model_nic || !ps_model_nic->open) return ncclSuccess;
  return ps_model_nic->open(c->rank, &c->model);
}

void ps_rma_model_close(ps_rma_comm_t *c) {
  if (c->model) ps_model_nic->close(c->model);
  c->model = NULL;
}

void ps_rma_release_held(ps_rma_comm_t *c) {
  if (!c->model || !ps_model_nic->release) return;
  const char *what = "held operation";
  ncclResult_t rc = ps_model_nic->release(c->model, &c->ep, &what);
  if (rc != ncclSuccess) ps_rma_fail(c, rc, "%s: the provider refused it", what);
}

/* A write on a fence lane comes from the lane's own address, which the
 * target's check of a writer (ps_rma_ident.c) would refuse: none carries
 * remote CQ data (target opens no lanes, fence refuses staging). */
static ncclResult_t post_write(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_rma *m,
                               uint64_t flags, int *posted) {
  if (c->model && ps_model_nic->write) return ps_model_nic->write(c->model, m, flags, posted);
  return ps_ep_writemsg(&c->ep, c->lanes ? c->lanes[peer] : c->ep.ep, m, flags, posted);
}

ncclResult_t ps_rma_post_sig_send(ps_rma_comm_t *c, uint32_t peer, void *buf, size_t len,
                                  void *desc, uint64_t tag, ps_op_t *op, int *posted) {
  if (c->model && ps_model_nic->send)
    return ps_model_nic->send(c->model, buf, len, desc, c->addr[peer], tag, op, posted);
  return ps_ep_tsend(&c->ep, buf, len, desc, c->addr[peer], tag, op, posted);
}

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
  return post_write(c, peer, m, flags, posted);
}

ncclResult_t ps_rma_post_staged(ps_rma_comm_t *c, uint32_t peer, struct fi_msg_rma *m, uint32_t slot,
                                ps_rma_sop_t *sop, int has_sig, int *posted) {
  m->data = PS_STAGED_DATA | (uint64_t)c->rank << 32 | slot;
  uint64_t flags = write_flags(c) | FI_REMOTE_CQ_DATA;
  if (c->streams && !(has_sig && ps_order_rider_on_comm_ep(c))) {
    ps_rma_stream_post(c, peer, m, flags, sop, posted);
    return ncclSuccess;
  }
  return post_write(c, peer, m, flags, posted);
}

ncclResult_t ps_rma_post_read(ps_rma_comm_t *c, const struct fi_msg_rma *m, int *posted) {
  return ps_ep_readmsg(&c->ep, m, FI_COMPLETION, posted);
}

/* Where the peer's puts went: its lane under fence (FI_FENCE orders behind
 * that peer's puts only), else the comm's endpoint. */
ncclResult_t ps_rma_post_atomic(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_atomic *m,
                                uint64_t flags, int *posted) {
  return ps_ep_atomicmsg(&c->ep, c->lanes ? c->lanes[peer] : c->ep.ep, m, flags, posted);
}

/* Staging credits go straight to the provider, never through a model NIC. */
ncclResult_t ps_rma_post_credit(ps_rma_comm_t *c, uint32_t peer, void *buf, size_t len, void *desc,
                                ps_op_t *op, int *posted) {
  return ps_ep_tsend(&c->ep, buf, len, desc, c->addr[peer], PS_TAG_RMA_SIG, op, posted);
}

/* --- a closing comm's probes (PS_TAG_RMA_PROBE) --- */

#define PS_CLOSE_GONE_NS 1000000000ULL /* probes refused this long: the peer is unreachable */

static void probe_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_rma_comm_t *c = op->owner;
  (void)e;
  c->peers[op->idx].probing = 0;
  if (err)
    ps_rma_fail(c, ncclRemoteError, "closing: rank %d is gone (a message to it failed: %s); "
                "what this rank reported done to it is lost", op->idx, errstr);
}

/* A provider that keeps refusing even an empty message to a peer for
 * PS_CLOSE_GONE_NS (tcp;ofi_rxm answers -FI_EAGAIN for good once the peer's
 * process exited) says it cannot reach it either. */
void ps_rma_probe_waited_peers(ps_rma_comm_t *c, uint64_t now) {
  for (int i = 0; i < c->nranks && !c->error; i++) {
    ps_rma_peer_t *p = &c->peers[i];
    if (i == c->rank || p->probing || !ps_rma_peer_busy(p))
      continue;
    int posted = 0;
    p->probe_op = (ps_op_t){.cb = probe_done, .owner = c, .idx = i};
    if (ps_rma_post_sig_send(c, (uint32_t)i, NULL, 0, NULL, PS_TAG_RMA_PROBE, &p->probe_op, &posted) !=
        ncclSuccess) {
      ps_rma_fail(c, ncclRemoteError, "closing: probing rank %d failed", i);
    } else if (posted) {
      p->probing = 1, p->probe_refused_ns = 0;
    } else if (!p->probe_refused_ns) {
      p->probe_refused_ns = now;
    } else if (now - p->probe_refused_ns >= PS_CLOSE_GONE_NS) {
      ps_rma_fail(c, ncclRemoteError, "closing: rank %d is unreachable (the provider refused even an "
                  "empty message to it for %llu ms); what this rank reported done to it is lost", i,
                  PS_CLOSE_GONE_NS / 1000000ULL);
    }
  }
}
