#include "ps_comm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_clock.h"
#include "ps_log.h"
#include "ps_model_nic.h"
#include "ps_stripe.h"
#include "ps_watch.h"

/* Tags (ps_handle.h): distinct values in 0x01..0x7f. */
ps_htab_t ps_comm_tab = PS_HTAB_INIT(0x43, "comm", "closed");
ps_htab_t ps_req_tab = PS_HTAB_INIT(0x52, "request", "completed, or its comm closed");

static const char *kind_name(int kind) {
  return kind == PS_COMM_LISTEN ? "listen" : kind == PS_COMM_SEND ? "send" : "recv";
}

void ps_comm_refused(const char *call, const void *h, int kinds) {
  ps_comm_t *c = ps_htab_get(&ps_comm_tab, h);
  if (c) {
    PS_WARN("%s: %p is a perseus %s comm, not a %s comm", call, h, kind_name(c->kind),
            kinds == (PS_COMM_SEND | PS_COMM_RECV) ? "send or recv" : kind_name(kinds));
    return;
  }
  ps_htab_refused(&ps_comm_tab, h, call);
}

ncclResult_t ps_comm_alloc(int kind, int dev, ps_comm_t **out) {
  *out = NULL;
  ps_device_t *d = ps_fabric_dev(dev);
  if (!d) {
    PS_WARN("device %d does not exist (this plugin has %d)", dev, ps_fabric_ndev());
    return ncclInvalidArgument;
  }
  ps_comm_t *c = calloc(1, sizeof *c);
  if (!c) return ncclSystemError;
  c->kind = kind;
  c->dev_index = dev;
  c->cfg = ps_fabric_config();
  c->peer = FI_ADDR_UNSPEC;
  ncclResult_t rc = ps_htab_reserve(&ps_comm_tab, 1, &c->slot);
  if (rc != ncclSuccess) {
    free(c);
    return rc;
  }
  c->has_slot = 1;
  c->handle = ps_htab_bind(&ps_comm_tab, c->slot, c);
  if (kind != PS_COMM_LISTEN) {
    c->nreqs = (int)c->cfg->net_requests;
    c->reqs = calloc((size_t)c->nreqs, sizeof *c->reqs);
    c->free_reqs = calloc((size_t)c->nreqs, sizeof *c->free_reqs);
    if (!c->reqs || !c->free_reqs) PS_WARN("out of memory for a pool of %d requests", c->nreqs);
    rc = c->reqs && c->free_reqs ? ps_htab_reserve(&ps_req_tab, (uint32_t)c->nreqs, &c->req_slots)
                                 : ncclSystemError;
    if (rc != ncclSuccess) {
      ps_comm_free(c);
      return rc;
    }
    c->has_req_slots = 1;
    for (int i = 0; i < c->nreqs; i++) c->free_reqs[c->nfree++] = &c->reqs[c->nreqs - 1 - i];
  }
  rc = ps_ep_open(d, (int)c->cfg->eagain_retries, &c->ep);
  if (rc == ncclSuccess) rc = ps_ep_reg_local(&c->ep, &c->ctrl_tx.msg, sizeof c->ctrl_tx.msg, &c->ctrl_tx.mr);
  if (rc == ncclSuccess) rc = ps_ep_reg_local(&c->ep, &c->ctrl_rx.msg, sizeof c->ctrl_rx.msg, &c->ctrl_rx.mr);
  if (rc != ncclSuccess) {
    ps_comm_free(c);
    return rc;
  }
  c->last_activity_ns = ps_now_ns();
  *out = c;
  return ncclSuccess;
}

/* Closes the comm's endpoints, at its end and, for a failed comm, before
 * the failure reaches the caller: operations still posted (other parts of a striped message, other grouped
 * receives) die with them, so no provider writes into or reads from a buffer
 * the caller frees on the error. Not from a completion callback. */
static void quiesce(ps_comm_t *c) {
  ps_stripe_close(c->stripe); /* first: its threads complete into our requests */
  c->stripe = NULL;
  ps_ep_close(&c->ep);
}

void ps_comm_free(ps_comm_t *c) {
  if (!c) return;
  /* Handles of this comm and of its requests in flight go stale first:
   * nothing looks up a comm half torn down. */
  if (c->has_req_slots) ps_htab_release(&ps_req_tab, c->req_slots, (uint32_t)c->nreqs);
  if (c->has_slot) ps_htab_release(&ps_comm_tab, c->slot, 1);
  quiesce(c);
  ps_watch_detach(c->watch);
  if (c->ctrl_tx.mr) fi_close(&c->ctrl_tx.mr->fid);
  if (c->ctrl_rx.mr) fi_close(&c->ctrl_rx.mr->fid);
  free(c->reqs);
  free(c->free_reqs);
  free(c);
}

static void fail_comm(ps_comm_t *c, ncclResult_t rc, const char *why) {
  if (c->failed) return;
  c->failed = rc;
  PS_WARN("connection to %s failed: %s", c->peer_str[0] ? c->peer_str : "peer", why);
}

ncclResult_t ps_comm_fail(ps_comm_t *c, ncclResult_t rc, const char *why) {
  fail_comm(c, rc, why);
  quiesce(c);
  return c->failed;
}

/* Probe receives are re-posted as they complete; a probe carries no data. */
static void probe_rx_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err,
                          const char *errstr) {
  ps_comm_t *c = op->owner;
  (void)e;
  if (err) {
    if (err != -FI_ECANCELED) fail_comm(c, ncclRemoteError, errstr);
    return;
  }
  int posted = 0;
  if (ps_ep_trecv(&c->ep, NULL, 0, NULL, PS_TAG_PROBE, &c->probe_rx, &posted) != ncclSuccess ||
      !posted)
    fail_comm(c, ncclSystemError, "could not re-post the liveness receive");
}

/* A failed probe means a dead peer, except when it was queued behind sends
 * of ours still in flight: sockets (libfabric 1.17) failed such a probe with
 * -FI_EIO while the peer was alive and the send before it still streaming
 * (one CI run, 64 MiB on a loaded 2-core machine). That provider drops the
 * connection of a failed send, so the next probe, PS_PROBE_RETRY_MS later,
 * connects afresh: PS_PROBE_TRIES failures in a row declare the peer dead
 * (a dead peer's tries fail within milliseconds). */
#define PS_PROBE_TRIES 3
#define PS_PROBE_RETRY_MS 10
/* One more failed try in a series (a failed probe, or a refused post after
 * one): the peer is gone at PS_PROBE_TRIES, else the next try comes in
 * PS_PROBE_RETRY_MS rather than PERSEUS_KEEPALIVE_MS. */
static void probe_try_failed(ps_comm_t *c, uint64_t now, const char *why) {
  if (++c->probe_failures >= PS_PROBE_TRIES) {
    char msg[400];
    snprintf(msg, sizeof msg, "%d liveness probes in a row failed, peer is gone: %s",
             c->probe_failures, why);
    fail_comm(c, ncclRemoteError, msg);
    return;
  }
  PS_INFO(NCCL_NET, "liveness probe %d to %s failed (%s): trying again", c->probe_failures,
          c->peer_str[0] ? c->peer_str : "peer", why);
  uint64_t wait_ns = (uint64_t)c->cfg->keepalive_ms * 1000000ULL;
  uint64_t retry_ns = (uint64_t)PS_PROBE_RETRY_MS * 1000000ULL;
  c->last_activity_ns = now - (wait_ns > retry_ns ? wait_ns - retry_ns : 0);
}

static void probe_tx_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err,
                          const char *errstr) {
  ps_comm_t *c = op->owner;
  (void)e;
  c->probe_inflight = 0;
  if (c->probe_to_listener && !c->awaiting_accept) { /* it says nothing of the accepted peer */
    c->probe_to_listener = 0;
    return;
  }
  uint64_t now = ps_now_ns();
  if (ps_model_nic && ps_model_nic->probe_done) /* a test plugin's model NIC may fail it */
    err = ps_model_nic->probe_done(err, c->probe_behind, c->probe_failures, PS_PROBE_TRIES, &errstr);
  if (!err) {
    c->last_activity_ns = now;
    c->probe_failures = 0;
    return;
  }
  if (c->probe_behind || c->probe_failures) {
    probe_try_failed(c, now, errstr);
    return;
  }
  char msg[400];
  snprintf(msg, sizeof msg, "liveness probe failed, peer is gone: %s", errstr);
  fail_comm(c, ncclRemoteError, msg);
}

ncclResult_t ps_comm_start_liveness(ps_comm_t *c) {
  int posted = 0;
  char s[64];
  ps_ep_addr_str(&c->ep, c->ep.addr, s, sizeof s);
  c->probe_rx = (ps_op_t){.cb = probe_rx_done, .owner = c};
  c->probe_tx = (ps_op_t){.cb = probe_tx_done, .owner = c};
  PS_CHECK(ps_ep_trecv(&c->ep, NULL, 0, NULL, PS_TAG_PROBE, &c->probe_rx, &posted));
  if (!posted) {
    PS_WARN("provider refused the liveness receive on %s", s);
    return ncclSystemError;
  }
  return ncclSuccess;
}

static int comm_busy(const ps_comm_t *c) { return c->nfree < c->nreqs; }

/* Only a comm with requests in flight needs to know whether its peer lives:
 * an idle one costs nothing. A dead peer shows up as a failed probe (the
 * provider reports the broken connection) or as no completion in time. */
static void check_liveness(ps_comm_t *c, uint64_t now) {
  if (c->kind == PS_COMM_LISTEN || c->peer == FI_ADDR_UNSPEC || (!comm_busy(c) && !c->awaiting_accept)) {
    /* idle time counts against nothing, not even a probe still in flight */
    c->last_activity_ns = c->probe_sent_ns = now;
    c->probe_refused_since_ns = 0;
    c->probe_failures = 0;
    return;
  }
  const char *cut = ps_watch_broken(c->watch, now);
  if (cut) {
    fail_comm(c, ncclRemoteError, cut);
    return;
  }
  if (c->probe_inflight) {
    /* Any completion since it was posted restarts its clock. Queued behind
     * sends of ours, it gets one more timeout: a message that takes long to
     * leave under load is not a dead peer, but one that never leaves (a peer
     * alive that does not take it, a provider that wedged the connection)
     * must not hang its sender for ever. */
    const int behind = c->tx_finished < c->probe_after_tx;
    const uint64_t timeout_ns = (uint64_t)c->cfg->peer_timeout_ms * 1000000ULL * (behind ? 2 : 1);
    if (c->last_activity_ns > c->probe_sent_ns) c->probe_sent_ns = now;
    if (now - c->probe_sent_ns > timeout_ns) {
      char msg[200];
      if (behind)
        snprintf(msg, sizeof msg, "%llu send(s) of ours made no progress for %llu ms (twice "
                 "PERSEUS_PEER_TIMEOUT_MS): the peer does not take them",
                 (unsigned long long)(c->probe_after_tx - c->tx_finished),
                 (unsigned long long)(timeout_ns / 1000000));
      else
        snprintf(msg, sizeof msg, "no answer to a liveness probe within %lld ms (PERSEUS_PEER_TIMEOUT_MS)",
                 (long long)c->cfg->peer_timeout_ms);
      fail_comm(c, ncclRemoteError, msg);
    }
    return;
  }
  if (now - c->last_activity_ns < (uint64_t)c->cfg->keepalive_ms * 1000000ULL) return;
  int pid = 0;
  if (ps_ep_peer_gone(&c->ep, c->peer_str, &pid)) { /* shm: no probe could tell */
    char msg[96];
    snprintf(msg, sizeof msg, "its process %d is gone", pid);
    fail_comm(c, ncclRemoteError, msg);
    return;
  }
  int posted = 0;
  if (ps_ep_tsend(&c->ep, NULL, 0, NULL, c->peer, PS_TAG_PROBE, &c->probe_tx, &posted) !=
      ncclSuccess) {
    /* An error, not a refusal: sockets returns -FI_ENOENT when its connect
     * for the probe did not complete in time, which a loaded CI machine saw
     * with a live peer. Counted like a refusal below (the peer is declared
     * dead only after PERSEUS_PEER_TIMEOUT_MS of them); the next try comes
     * after PERSEUS_KEEPALIVE_MS. */
    c->last_activity_ns = now;
    posted = 0;
  }
  if (posted) {
    c->probe_inflight = 1;
    c->probe_to_listener = c->awaiting_accept;
    c->probe_sent_ns = now;
    c->probe_after_tx = c->tx_posted;
    c->probe_behind = c->tx_finished < c->tx_posted;
    c->probe_refused_since_ns = 0;
    return;
  }
  if (c->probe_failures) { /* a series of tries after a failed probe */
    probe_try_failed(c, now, "the provider refused the probe");
    return;
  }
  /* A provider whose connection to a dead peer is gone may refuse the post
   * (-FI_EAGAIN, or an error) for ever: that time counts against the timeout too. */
  if (!c->probe_refused_since_ns) c->probe_refused_since_ns = now;
  if (now - c->probe_refused_since_ns > (uint64_t)c->cfg->peer_timeout_ms * 1000000ULL) {
    char msg[160];
    snprintf(msg, sizeof msg, "provider refused every liveness probe for %lld ms (PERSEUS_PEER_TIMEOUT_MS)",
             (long long)c->cfg->peer_timeout_ms);
    fail_comm(c, ncclRemoteError, msg);
  }
}

ncclResult_t ps_comm_check_listener(ps_comm_t *c) {
  uint64_t now = ps_now_ns();
  if (!c->awaiting_accept) { /* the first look: probe at once */
    c->awaiting_accept = 1;
    c->probe_tx = (ps_op_t){.cb = probe_tx_done, .owner = c};
    c->last_activity_ns = now - (uint64_t)c->cfg->keepalive_ms * 1000000ULL;
    c->probe_sent_ns = now;
  }
  check_liveness(c, now);
  return c->failed;
}

ncclResult_t ps_comm_post_recv(ps_comm_t *c, ps_req_t *r, int i, int *posted) {
  return ps_ep_trecv(&c->ep, r->data[i], r->cap[i], r->desc[i], r->tag[i], &r->ops[i], posted);
}

static ncclResult_t post_pending(ps_comm_t *c) {
  ps_req_t *r = c->pending;
  while (r && r->posted < r->n) {
    int i = r->posted, ok = 0;
    PS_CHECK(ps_comm_post_recv(c, r, i, &ok));
    if (!ok) return ncclSuccess; /* still refused: try on the next call */
    r->posted++;
  }
  c->pending = NULL;
  return ncclSuccess;
}

ncclResult_t ps_comm_flush_pending(ps_comm_t *c) {
  ncclResult_t rc = c->failed ? ncclSuccess : post_pending(c);
  if (rc != ncclSuccess) fail_comm(c, rc, "posting a deferred receive failed");
  if (c->failed) quiesce(c);
  return c->failed;
}

static void progress_once(ps_comm_t *c) {
  if (ps_comm_flush_pending(c) != ncclSuccess) return;
  int handled = 0;
  ncclResult_t rc = ps_ep_progress(&c->ep, 256, &handled);
  if (rc != ncclSuccess) fail_comm(c, rc, c->ep.fatal);
  uint64_t now = ps_now_ns();
  if (handled) { /* the peer shows life; a probe retry after a failure keeps its own clock */
    c->probe_refused_since_ns = 0;
    if (!c->probe_failures) c->last_activity_ns = now;
  }
  const char *why = ps_stripe_failed(c->stripe);
  if (why) fail_comm(c, ncclRemoteError, why);
  check_liveness(c, now);
}

ncclResult_t ps_comm_progress(ps_comm_t *c) {
  if (!c->failed) progress_once(c);
  if (c->failed) quiesce(c);
  return c->failed;
}
