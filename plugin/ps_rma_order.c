/* One-sided engine, the ordering strategies: which ones the provider makes
 * correct (PERSEUS_ORDERING), when a queued signal may go and how it is
 * posted. A signal leaves only after every put it covers was posted, and,
 * per strategy:
 *   ordered  - at once: the provider keeps sends behind earlier writes (SAW);
 *              where it also keeps atomics behind them (WAW) and has native
 *              atomics, as an atomic add the NIC applies (no staging)
 *   fence    - at once, as an atomic add carrying FI_FENCE
 *   target   - at once, saying how many writes it covers; the target applies
 *              it when that many have arrived (remote CQ data counts them)
 *   deferred - once the puts it covers completed with delivery semantics;
 *              later puts keep flowing meanwhile
 *   drain    - like deferred, but the caller blocks until then (the baseline) */
#include "ps_log.h"
#include "ps_rma_int.h"

/* What strategy `s` needs from the provider, or NULL when it has it. */
static const char *provider_missing_for(const ps_device_t *d, ps_ordering_t s) {
  switch (s) {
  case PS_ORD_ORDERED:
    return (d->rma_msg_order & FI_ORDER_SAW) ? NULL : "sends ordered after RMA writes (FI_ORDER_SAW)";
  case PS_ORD_FENCE:
    return d->rma_fence ? NULL : "native atomics with FI_FENCE";
  case PS_ORD_TARGET:
    return d->cq_data_size >= 8 ? NULL : "8 bytes of remote CQ data per RMA write";
  case PS_ORD_DEFERRED:
  case PS_ORD_DRAIN: /* d->rma_delivery_broken says why, in the connect log */
    return d->rma_delivery_broken ? "RMA write completions that mean delivery" : NULL;
  default:
    return NULL;
  }
}

/* ... or from a test plugin's model NIC, which stands in front of it. */
static const char *missing_for(const ps_device_t *d, ps_ordering_t s) {
  const char *lacks = provider_missing_for(d, s);
  return (ps_model_nic && ps_model_nic->missing_for) ? ps_model_nic->missing_for((int)s, lacks) : lacks;
}

/* PERSEUS_ORDERING; auto takes the cheapest strategy the provider's
 * capabilities make correct: no extra work (ordered), a NIC-side fence,
 * counting at the target, waiting for delivery at the origin. */
ncclResult_t ps_order_choose(const ps_device_t *d, ps_ordering_t *out) {
  int v;
  PS_CHECK(ps_env_enum("PERSEUS_ORDERING", ps_ordering_names, PS_ORD_AUTO, &v));
  if (v == PS_ORD_AUTO) {
    const ps_ordering_t pref[] = {PS_ORD_ORDERED, PS_ORD_FENCE, PS_ORD_TARGET, PS_ORD_DEFERRED};
    for (int i = 0; i < 4 && v == PS_ORD_AUTO; i++)
      if (!missing_for(d, pref[i])) v = pref[i];
    if (v == PS_ORD_AUTO) {
      PS_WARN("one-sided: no ordering strategy works on %s (it lacks %s, %s and %s)", d->name,
              missing_for(d, PS_ORD_ORDERED), missing_for(d, PS_ORD_FENCE),
              missing_for(d, PS_ORD_TARGET));
      return ncclInvalidUsage;
    }
  }
  const char *missing = missing_for(d, (ps_ordering_t)v);
  if (missing) {
    const char *why = (v == PS_ORD_DEFERRED || v == PS_ORD_DRAIN) ? d->rma_delivery_broken : NULL;
    PS_WARN("PERSEUS_ORDERING=%s is not possible on %s: the provider lacks %s%s%s%s",
            ps_ordering_names[v], d->name, missing, why ? " (" : "", why ? why : "", why ? ")" : "");
    return ncclInvalidUsage;
  }
  *out = (ps_ordering_t)v;
  return ncclSuccess;
}

static void sig_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  (void)e;
  ps_rma_sig_done(op->owner, err, errstr);
}


/* Whether strategy s on d posts signals as atomic adds rather than messages
 * for the target's proxy to apply. fence: always. ordered: where the
 * provider keeps atomics behind earlier writes (FI_ORDER_WAW covers RMA and
 * atomic writes alike) and applies them itself (what fence needs too). The
 * NIC then applies the signal: the target's proxy never handles it. */
int ps_order_sig_atomic(const ps_device_t *d, ps_ordering_t s) {
  if (s == PS_ORD_FENCE) return 1;
  return s == PS_ORD_ORDERED && (d->rma_msg_order & FI_ORDER_WAW) && !missing_for(d, PS_ORD_FENCE);
}

ncclResult_t ps_order_post_sig(ps_rma_comm_t *c, ps_rma_req_t *r, int *posted) {
  r->sig_op = (ps_op_t){.cb = sig_done, .owner = r};
  /* ordered stops once a GPU window is staged: a staged put reaches its
   * window only when the target copies it out of its staging slot, after
   * the write the atomic follows (fence is refused with staging) */
  if (!c->sig_atomic || (c->ordering == PS_ORD_ORDERED && c->stage))
    return ps_rma_post_sig_send(c, r->peer, &r->sig, sizeof r->sig, r->chunk_desc, PS_TAG_RMA_SIG,
                                &r->sig_op, posted);
  r->operand = r->sig.op == NCCL_NET_SIGNAL_OP_INC ? 1 : r->sig.value;
  struct fi_ioc ioc = {.addr = &r->operand, .count = 1};
  struct fi_msg_atomic m = {.msg_iov = &ioc, .desc = &r->chunk_desc, .iov_count = 1,
                            .addr = c->addr[r->peer], .rma_iov = &r->sig_rma, .rma_iov_count = 1,
                            .datatype = FI_UINT64, .op = FI_SUM, .context = &r->sig_op};
  /* fence: on the peer's lane, behind that peer's puts only; none ahead: no fence */
  int fence = c->ordering == PS_ORD_FENCE && r->need > 1;
  ncclResult_t rc = ps_rma_post_atomic(c, r->peer, &m, FI_COMPLETION | (fence ? FI_FENCE : 0), posted);
  c->peers[r->peer].atomic_sigs += rc == ncclSuccess && *posted;
  return rc;
}

int ps_order_sig_ready(const ps_rma_comm_t *c, const ps_rma_peer_t *p, const ps_rma_req_t *r) {
  if (p->posted_below < r->need) return 0; /* its puts are not even posted */
  if (c->ordering == PS_ORD_DEFERRED || c->ordering == PS_ORD_DRAIN) return p->done.below >= r->need;
  return 1;
}

/* A signal may ride in a staged write (a record behind its put's last chunk)
 * where the strategy posts it at once, and where the writes it covers that
 * did not go through staging land before that staged write: target counts
 * them at the target anyway; ordered needs the provider to keep writes in
 * order (FI_ORDER_WAW), and the write it rides in on the comm's endpoint
 * with them (ps_order_rider_on_comm_ep). deferred and drain keep their wait for
 * delivery. */
int ps_order_sig_may_ride(const ps_rma_comm_t *c) {
  if (c->ordering == PS_ORD_TARGET) return 1;
  return c->ordering == PS_ORD_ORDERED && (c->ep.dev->rma_msg_order & FI_ORDER_WAW);
}

/* Whether a staged write carrying a riding signal must take the comm's
 * endpoint, not a staging stream: under ordered the signal covers the plain
 * writes before it only through the provider's order on one endpoint (the
 * staged writes it covers may take any path: the target holds it for
 * those). */
int ps_order_rider_on_comm_ep(const ps_rma_comm_t *c) { return c->ordering == PS_ORD_ORDERED; }

/* A fence: a wait for delivery (deferred parks, drain blocks) or an
 * FI_FENCE flag. ordered and target get their ordering for nothing. */
int ps_order_count_fence(ps_rma_comm_t *c, ps_rma_peer_t *p, uint64_t need) {
  int waits = (c->ordering == PS_ORD_DEFERRED || c->ordering == PS_ORD_DRAIN) && p->done.below < need;
  int fenced = waits || (c->ordering == PS_ORD_FENCE && need > 1);
  if (fenced) p->st.fences_posted++;
  else p->st.fences_avoided++;
  return waits && c->ordering == PS_ORD_DRAIN;
}
