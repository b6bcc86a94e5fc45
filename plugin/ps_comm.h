/* Communicators of the two-sided net plugin. Each send/recv comm owns its
 * endpoint (one NCCL proxy thread drives a comm, so no locking on the data
 * path); the listen comm owns the endpoint connect requests arrive on. */
#ifndef PS_COMM_H
#define PS_COMM_H

#include "ps_ep.h"
#include "ps_handle.h"

#define PS_MAX_RECVS 8
/* bits, so that a lookup can accept several kinds */
enum { PS_COMM_LISTEN = 1, PS_COMM_SEND = 2, PS_COMM_RECV = 4 };
enum { PS_REQ_SEND = 1, PS_REQ_RECV = 2 };

typedef struct ps_comm ps_comm_t;

/* NCCL holds comms and requests by handle (ps_handle.h), never by address. */
extern ps_htab_t ps_comm_tab, ps_req_tab;

typedef struct ps_req {
  void *handle; /* what NCCL holds while the request is live */
  ps_op_t ops[PS_MAX_RECVS];
  ps_comm_t *comm;
  /* ncomplete and status are also written by stripe threads (atomics) */
  int type, n, posted, ncomplete;
  ncclResult_t status;
  /* parts of sub-request i not yet complete (1 unless striped; atomic) and
   * the operations of its parts on the extra endpoints (ps_stripe.h) */
  int parts_left[PS_MAX_RECVS];
  ps_op_t part_ops[PS_MAX_RECVS][PS_MAX_STREAMS - 1];
  uint64_t part_len[PS_MAX_RECVS][PS_MAX_STREAMS - 1];
  void *data[PS_MAX_RECVS];
  void *desc[PS_MAX_RECVS];
  size_t cap[PS_MAX_RECVS], sizes[PS_MAX_RECVS];
  uint64_t tag[PS_MAX_RECVS];
} ps_req_t;

typedef struct {
  ps_ctrl_msg_t msg;
  struct fid_mr *mr; /* for providers that need registered buffers */
  ps_op_t op;
  int done;      /* 1 = completed, -1 = failed */
  size_t len;
} ps_ctrl_slot_t;

struct ps_comm {
  int kind;
  int dev_index;
  void *handle;                /* what NCCL holds */
  uint32_t slot, req_slots;    /* ps_comm_tab slot; first of nreqs ps_req_tab slots */
  int has_slot, has_req_slots; /* reserved (a comm that failed half-built may not have them) */
  ps_ep_t ep;
  const ps_config_t *cfg;
  fi_addr_t peer;
  char peer_str[64];
  ncclResult_t failed;
  /* request pool */
  ps_req_t *reqs;
  ps_req_t **free_reqs;
  int nreqs, nfree;
  ps_req_t *pending; /* a grouped receive not fully posted yet (at most one) */
  /* liveness */
  uint64_t last_activity_ns, probe_sent_ns;
  uint64_t probe_refused_since_ns; /* provider refusing the probe post (-FI_EAGAIN) since */
  int probe_failures;              /* probes queued behind our own sends failed in a row */
  int probe_behind;                /* the probe in flight was posted behind sends of ours */
  int probe_inflight;
  int awaiting_accept; /* a connect whose listener is probed while ACCEPT is late */
  int probe_to_listener; /* the probe in flight went to the listener, not the peer */
  /* sends posted / finished on this comm: a probe is queued behind the data
   * posted before it, which gets one more timeout to leave (check_liveness) */
  uint64_t tx_posted, tx_finished, probe_after_tx;
  ps_op_t probe_tx, probe_rx;
  struct ps_watch *watch; /* the link to the peer's host (ps_watch.h), NULL = none */
  struct ps_stripe *stripe; /* extra endpoints (ps_stripe.h), NULL = one endpoint */
  uint32_t stripe_seq;      /* striped messages sent */
  /* handshake */
  uint64_t listen_id, conn_id;
  ps_ctrl_slot_t ctrl_tx, ctrl_rx;
  uint64_t ctrl_tx_tag;
  int ctrl_tx_unposted;
  ps_handle_t connect_to;   /* send side: the listener's handle; a connect() with
                             * the same contents (and device) resumes this one */
  uint64_t connect_ns;     /* when the handshake started (connect, or accepting its CONNECT) */
  ps_comm_t *next_connecting;
  uint64_t connect_polled_ns; /* send side: the caller's last connect() for it (ps_conn.c) */
  uintptr_t owner;            /* send side: the NCCL context that started it (v11+), else 0 */
  int connect_polling;        /* send side: a connect() call is driving it now */
  /* recv side: the connector's address from its CONNECT, to refuse it
   * through the listener's endpoint where our ACCEPT cannot leave */
  uint8_t connector_addr[PS_CTRL_ADDR_MAX];
  uint32_t connector_addrlen;
  ps_comm_t *accepting; /* listen side: recv comm whose ACCEPT is still leaving */
  struct ps_nack *nacks; /* listen side: refusals in flight (ps_conn.c) */
  struct ps_nack *nacks_held; /* listen side: refusals past the timeout the provider still holds */
  int nnacks;
};

ncclResult_t ps_comm_alloc(int kind, int dev, ps_comm_t **out);
void ps_comm_free(ps_comm_t *c);
/* Drives a comm: posts deferred receives, reads completions, probes an idle
 * peer. Returns the comm's failure, if any: a failed comm's endpoints are
 * closed by then, so no buffer of its requests is touched afterwards. */
ncclResult_t ps_comm_progress(ps_comm_t *c);
/* Fails the comm (the first reason is logged and kept) and closes its
 * endpoints; returns the comm's failure. */
ncclResult_t ps_comm_fail(ps_comm_t *c, ncclResult_t rc, const char *why);
/* A connect whose CONNECT the listener's endpoint took, with no ACCEPT
 * after PERSEUS_PEER_TIMEOUT_MS: the listener's process is probed as an
 * established comm's peer is (a listener that merely accepts late answers
 * the probes), so a dead one fails the connect rather than leaving NCCL a
 * NULL comm for ever. Returns the comm's failure, if any. */
ncclResult_t ps_comm_check_listener(ps_comm_t *c);
/* Posts what is left of a partly posted grouped receive, in order. Returns
 * the comm's failure, if any; c->pending stays set while the provider refuses. */
ncclResult_t ps_comm_flush_pending(ps_comm_t *c);
/* Posts sub-receive i of r on the comm's endpoint (*posted = 0: refused). */
ncclResult_t ps_comm_post_recv(ps_comm_t *c, ps_req_t *r, int i, int *posted);
/* Arms the liveness machinery once the peer address is known. */
ncclResult_t ps_comm_start_liveness(ps_comm_t *c);

/* The live comm behind a handle NCCL passed, if it is one of `kinds`
 * (PS_COMM_* bits); NULL otherwise. */
static inline ps_comm_t *ps_comm_get(const void *h, int kinds) {
  ps_comm_t *c = ps_htab_get(&ps_comm_tab, h);
  return c && (c->kind & kinds) ? c : NULL;
}
/* Logs why `call` refuses h (not ours, stale, or a comm of another kind). */
void ps_comm_refused(const char *call, const void *h, int kinds);

#endif
