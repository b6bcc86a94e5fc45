/* listen / connect / accept / close: the non-blocking handshake.
 *
 * connect posts CONNECT{its address, conn_id} to the listener's endpoint and
 * returns NULL until ACCEPT{the new recv comm's address, conn_id} comes back.
 * accept turns each CONNECT into a recv comm with its own endpoint. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#ifdef __GLIBC__
#include <malloc.h> /* malloc_trim */
#endif

#include "ps_clock.h"
#include "ps_comm.h"
#include "ps_log.h"
#include "ps_net.h"
#include "ps_stripe.h"
#include "ps_watch.h"

/* Connects under way, at most this many. Abandoned ones are closed after
 * PERSEUS_PEER_TIMEOUT_MS (connecting_reap), but a caller starting connects
 * faster than that would still hold an endpoint and its fds for each.
 * Repeated calls for one listener handle resume one connect, so only
 * connects to distinct listeners count; NCCL has one per connection it is
 * setting up. */
#define PS_CONNECT_PENDING_MAX 4096

static pthread_mutex_t connecting_lock = PTHREAD_MUTEX_INITIALIZER;
static ps_comm_t *connecting; /* send comms whose handshake is under way */
static int nconnecting;
static uint64_t last_trim_ns; /* of the heap, after reaping (connecting_reap) */

static void ctrl_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_ctrl_slot_t *s = op->owner;
  if (err) {
    if (err != -FI_ECANCELED) PS_WARN("connection handshake failed: %s", errstr);
    s->done = -1;
    return;
  }
  s->len = e->len;
  s->done = 1;
}

static ncclResult_t post_ctrl_recv(ps_comm_t *c, uint64_t tag) {
  int posted = 0;
  c->ctrl_rx.done = 0;
  c->ctrl_rx.op = (ps_op_t){.cb = ctrl_done, .owner = &c->ctrl_rx};
  PS_CHECK(ps_ep_trecv(&c->ep, &c->ctrl_rx.msg, sizeof c->ctrl_rx.msg,
                       c->ctrl_rx.mr ? fi_mr_desc(c->ctrl_rx.mr) : NULL, tag, &c->ctrl_rx.op,
                       &posted));
  if (!posted) {
    PS_WARN("provider refused a control receive on %s", c->ep.dev->name);
    return ncclSystemError;
  }
  return ncclSuccess;
}

/* Posts the handshake message held in ctrl_tx. While the provider is still
 * establishing its connection it may answer -FI_EAGAIN for a long time:
 * then the post is simply retried on the next connect/accept call. */
static ncclResult_t post_ctrl_send(ps_comm_t *c) {
  int posted = 0;
  ncclResult_t rc = ps_ep_tsend(&c->ep, &c->ctrl_tx.msg, sizeof c->ctrl_tx.msg,
                                c->ctrl_tx.mr ? fi_mr_desc(c->ctrl_tx.mr) : NULL, c->peer,
                                c->ctrl_tx_tag, &c->ctrl_tx.op, &posted);
  if (rc != ncclSuccess) { /* the address a handle carried, not reachable from our interface */
    PS_WARN("handshake with %s could not leave %s: the peer is gone, or its address is not "
            "reachable from this interface (PERSEUS_IFACE, else NCCL_SOCKET_IFNAME, picks each "
            "host's interface)", c->peer_str[0] ? c->peer_str : "the peer", c->ep.dev->name);
    return rc;
  }
  c->ctrl_tx_unposted = !posted;
  return ncclSuccess;
}

static ncclResult_t send_ctrl(ps_comm_t *c, uint16_t type, uint64_t tag) {
  PS_CHECK(ps_ctrl_encode(&c->ctrl_tx.msg, type, ps_fabric_wire_hash(), c->listen_id, c->conn_id,
                          c->ep.addr, c->ep.addrlen, ps_watch_port(c->ep.dev)));
  ps_stripe_addrs(c->stripe, &c->ctrl_tx.msg);
  c->ctrl_tx.done = 0;
  c->ctrl_tx.op = (ps_op_t){.cb = ctrl_done, .owner = &c->ctrl_tx};
  c->ctrl_tx_tag = tag;
  return post_ctrl_send(c);
}

/* Progress of a comm still in its handshake. */
static ncclResult_t handshake_progress(ps_comm_t *c) {
  if (c->ctrl_tx_unposted) PS_CHECK(post_ctrl_send(c));
  PS_CHECK(ps_ep_progress(&c->ep, 64, NULL));
  if (c->ctrl_tx.done < 0 || c->ctrl_rx.done < 0) return ncclRemoteError;
  return ncclSuccess;
}

ncclResult_t ps_net_listen(int dev, void *handle, void **listen_comm) {
  ps_comm_t *c = NULL;
  if (!handle || !listen_comm) {
    PS_WARN("listen: NULL %s", handle ? "listen comm pointer" : "handle");
    return ncclInvalidArgument;
  }
  *listen_comm = NULL;
  PS_CHECK(ps_comm_alloc(PS_COMM_LISTEN, dev, &c));
  c->listen_id = ps_random64();
  ncclResult_t rc = ps_handle_encode((ps_handle_t *)handle, ps_fabric_wire_hash(), (uint32_t)dev,
                                     c->listen_id, c->ep.addr, c->ep.addrlen);
  if (rc == ncclSuccess) rc = post_ctrl_recv(c, PS_TAG_CONNECT);
  /* connectors waiting for a late ACCEPT probe us (ps_comm_check_listener):
   * a standing receive takes their probes, which would otherwise pile up
   * unmatched in the provider's receive buffers */
  if (rc == ncclSuccess) rc = ps_comm_start_liveness(c);
  if (rc != ncclSuccess) {
    ps_comm_free(c);
    return rc;
  }
  ps_ep_addr_str(&c->ep, c->ep.addr, c->peer_str, sizeof c->peer_str);
  PS_TRACE("listen on dev %d at %s", dev, c->peer_str);
  *listen_comm = c->handle;
  return ncclSuccess;
}

/* Hands a connect back after a connect() call drove it: done (a comm or
 * an error) takes it off the list, else its abandonment clock restarts. */
static void connecting_release(ps_comm_t *c, int done) {
  pthread_mutex_lock(&connecting_lock);
  c->connect_polling = 0;
  c->connect_polled_ns = ps_now_ns();
  for (ps_comm_t **p = &connecting; done && *p; p = &(*p)->next_connecting)
    if (*p == c) {
      *p = c->next_connecting;
      nconnecting--;
      break;
    }
  pthread_mutex_unlock(&connecting_lock);
}

/* NCCL calls connect in a loop until it returns a comm, so a connect whose
 * caller has not called for it in PERSEUS_PEER_TIMEOUT_MS was abandoned
 * (the caller gave up, or failed elsewhere). Every connect() call closes
 * those: abandoned connects then hold at most what one timeout's worth of
 * calls can start, where before each kept an endpoint, its fds and buffers
 * until the process ended. A caller that comes back later starts afresh; the
 * listener may then hold a recv comm of the closed connect, whose peer is
 * gone (its probes fail if it is ever used). */
/* Under connecting_lock: takes the connects no call drives right now for
 * which gone(c, arg) holds off the list; returns them, chained, and their
 * count in *n. */
static ps_comm_t *connecting_unlink(int (*gone)(const ps_comm_t *, const void *), const void *arg,
                                    int *n) {
  ps_comm_t *out = NULL;
  *n = 0;
  for (ps_comm_t **p = &connecting; *p;) {
    ps_comm_t *c = *p;
    if (c->connect_polling || !gone(c, arg)) {
      p = &c->next_connecting;
      continue;
    }
    *p = c->next_connecting;
    nconnecting--;
    c->next_connecting = out;
    out = c;
    (*n)++;
  }
  return out;
}

static void free_chain(ps_comm_t *c) {
  while (c) {
    ps_comm_t *next = c->next_connecting;
    ps_comm_free(c);
    c = next;
  }
}

typedef struct {
  uint64_t now, limit;
  int dev;
  const ps_handle_t *h; /* the connect this call resumes: never reaped by it */
} reap_arg_t;

static int same_listener(const ps_comm_t *c, int dev, const ps_handle_t *h);

static int left_alone(const ps_comm_t *c, const void *arg) {
  const reap_arg_t *a = arg;
  return a->now - c->connect_polled_ns > a->limit && !same_listener(c, a->dev, a->h);
}

static int owned_by(const ps_comm_t *c, const void *arg) {
  return c->owner == *(const uintptr_t *)arg;
}

/* A caller held up elsewhere (an accept that opens endpoints, seconds under
 * load) comes back to its connect late: that one is resumed, not reaped. */
static void connecting_reap(int dev, const ps_handle_t *h) {
  uint64_t limit_ns = (uint64_t)ps_fabric_config()->peer_timeout_ms * 1000000ULL;
  int n;
  pthread_mutex_lock(&connecting_lock);
  /* under the lock: no release stamps a later time meanwhile */
  reap_arg_t a = {.now = ps_now_ns(), .limit = limit_ns, .dev = dev, .h = h};
  ps_comm_t *reaped = connecting_unlink(left_alone, &a, &n);
  int trim = n && a.now - last_trim_ns > limit_ns;
  if (trim) last_trim_ns = a.now;
  pthread_mutex_unlock(&connecting_lock);
  (void)trim;
  if (!n) return;
  PS_WARN("connect: %d connect(s) not called again for %lld ms (PERSEUS_PEER_TIMEOUT_MS) were "
          "abandoned; closed (one was to the listener at %s)",
          n, (long long)ps_fabric_config()->peer_timeout_ms, reaped->peer_str);
  free_chain(reaped);
#ifdef __GLIBC__
  /* libfabric 1.17's rxm callocs 12 MiB per endpoint at fi_enable. Once such
   * a block is freed, glibc raises its mmap threshold and serves the next
   * from its heap, zeroing (touching) it there, and keeps freed heap memory
   * resident: without a trim the reaped endpoints' memory stayed in RSS
   * (830 MB after 1000 abandoned connects, 18 MB with it). A trim on every
   * reap made each new endpoint fault its 12 MiB in again (8x slower
   * connects), hence at most one per PERSEUS_PEER_TIMEOUT_MS. */
  if (trim) malloc_trim(0);
#endif
}

/* A connect is known by what the handle says (listener id and address) and
 * the local device, not by where the handle lies: NCCL may pass a fresh copy
 * on every call, and each copy must resume the one connect. */
static int same_listener(const ps_comm_t *c, int dev, const ps_handle_t *h) {
  return h && c->dev_index == dev && c->connect_to.listen_id == h->listen_id &&
         c->connect_to.addrlen == h->addrlen && !memcmp(c->connect_to.addr, h->addr, h->addrlen);
}

/* The connect under way for this listener, claimed for this call (nothing
 * frees it meanwhile); NULL with *busy set when another thread drives it
 * right now, NULL alone when there is none. */
static ps_comm_t *connecting_claim(int dev, const ps_handle_t *h, int *busy) {
  pthread_mutex_lock(&connecting_lock);
  ps_comm_t *c = connecting;
  while (c && !same_listener(c, dev, h)) c = c->next_connecting;
  *busy = c && c->connect_polling;
  if (*busy) c = NULL;
  if (c) c->connect_polling = 1;
  pthread_mutex_unlock(&connecting_lock);
  return c;
}

static ncclResult_t connect_start(int dev, const ps_handle_t *h, uintptr_t owner) {
  ps_comm_t *c = NULL;
  pthread_mutex_lock(&connecting_lock);
  int n = nconnecting; /* a concurrent start may pass it by one: it bounds, it need not be exact */
  pthread_mutex_unlock(&connecting_lock);
  if (n >= PS_CONNECT_PENDING_MAX) {
    PS_WARN("connect: %d connects to other listeners are still under way (the most perseus "
            "keeps, PS_CONNECT_PENDING_MAX); call connect again until each returns a comm or "
            "fails before starting more",
            PS_CONNECT_PENDING_MAX);
    return ncclInvalidUsage;
  }
  PS_CHECK(ps_comm_alloc(PS_COMM_SEND, dev, &c));
  c->listen_id = h->listen_id;
  c->conn_id = ps_random64();
  c->connect_to = *h;
  c->owner = owner;
  int streams = ps_stripe_wanted(c->ep.dev); /* offered in CONNECT, the listener takes as many */
  ncclResult_t rc = streams ? ps_stripe_open(c->ep.dev, streams, c->nreqs * PS_MAX_RECVS, &c->stripe)
                            : ncclSuccess;
  /* the handshake's clock starts here: opening endpoints is our own time
   * (rxm's own protocol takes about 0.3 s for each, seconds under load) */
  c->connect_ns = ps_now_ns();
  if (rc == ncclSuccess) rc = ps_ep_insert_len(&c->ep, h->addr, h->addrlen, &c->peer);
  if (rc == ncclSuccess) ps_ep_addr_str(&c->ep, h->addr, c->peer_str, sizeof c->peer_str);
  if (rc == ncclSuccess) rc = post_ctrl_recv(c, PS_TAG_ACCEPT);
  if (rc == ncclSuccess) rc = send_ctrl(c, PS_CTRL_CONNECT, PS_TAG_CONNECT);
  if (rc != ncclSuccess) {
    ps_comm_free(c);
    return rc;
  }
  pthread_mutex_lock(&connecting_lock);
  c->connect_polled_ns = ps_now_ns();
  c->next_connecting = connecting;
  connecting = c;
  nconnecting++;
  pthread_mutex_unlock(&connecting_lock);
  return ncclSuccess;
}

/* The handshake message this comm sent (CONNECT or ACCEPT) has not left
 * within PERSEUS_PEER_TIMEOUT_MS of the handshake's start. */
static int ctrl_tx_overdue(const ps_comm_t *c) {
  return c->ctrl_tx.done == 0 &&
         ps_now_ns() - c->connect_ns > (uint64_t)c->cfg->peer_timeout_ms * 1000000ULL;
}

/* Returns ncclSuccess with *ready set once ACCEPT arrived and checked out.
 * A CONNECT the provider has not delivered within PERSEUS_PEER_TIMEOUT_MS
 * means no perseus listener is there (port closed, listener closed, another
 * program on the port): an error, not a NULL comm NCCL would retry for ever
 * (tcp;ofi_rxm retries a refused connection silently). Once delivered, the
 * listener exists and answers when its owner calls accept, however late,
 * unless its process died: past the timeout it is probed for that. */
static ncclResult_t connect_poll(ps_comm_t *c, int *ready) {
  *ready = 0;
  PS_CHECK(handshake_progress(c));
  if (ctrl_tx_overdue(c)) {
    PS_WARN("connect: the listener at %s did not take our CONNECT within %lld ms "
            "(PERSEUS_PEER_TIMEOUT_MS): closed, unreachable, or not a perseus listener",
            c->peer_str, (long long)c->cfg->peer_timeout_ms);
    return ncclRemoteError;
  }
  if (c->ctrl_tx.done && !c->ctrl_rx.done &&
      ps_now_ns() - c->connect_ns > (uint64_t)c->cfg->peer_timeout_ms * 1000000ULL &&
      ps_comm_check_listener(c) != ncclSuccess) {
    PS_WARN("connect: the listener at %s took our CONNECT but is gone (no ACCEPT, and its "
            "process does not answer)", c->peer_str);
    return c->failed;
  }
  if (c->ctrl_rx.done == 0 || c->ctrl_tx.done == 0) return ncclSuccess;
  ps_ctrl_msg_t m;
  PS_CHECK(ps_ctrl_decode(&c->ctrl_rx.msg, c->ctrl_rx.len, PS_CTRL_ACCEPT, ps_fabric_wire_hash(), &m));
  if (m.conn_id == c->conn_id && m.listen_id != c->listen_id) { /* the listener's refusal */
    PS_WARN("connect: the listener at %s has no listen id 0x%llx (its id is 0x%llx): the handle "
            "is stale, corrupt or another listener's",
            c->peer_str, (unsigned long long)c->listen_id, (unsigned long long)m.listen_id);
    return ncclInvalidArgument;
  }
  if (m.conn_id == PS_CONN_DROPPED(c->conn_id) && m.listen_id == c->listen_id) {
    PS_WARN("connect: the listener at %s took our CONNECT but could not accept it (its log says "
            "why)", c->peer_str);
    return ncclRemoteError;
  }
  if (m.conn_id != c->conn_id || m.listen_id != c->listen_id) {
    PS_WARN("handshake rejected: ACCEPT for connection 0x%llx, expected 0x%llx",
            (unsigned long long)m.conn_id, (unsigned long long)c->conn_id);
    return ncclRemoteError;
  }
  /* From now on the peer is the recv comm's own endpoint. */
  c->awaiting_accept = 0;
  PS_CHECK(ps_ep_insert_len(&c->ep, m.addr, m.addrlen, &c->peer));
  if (m.nstreams) {
    if (!c->stripe) {
      PS_WARN("handshake rejected: ACCEPT names %u extra endpoints, we offered none", m.nstreams);
      return ncclRemoteError;
    }
    PS_CHECK(ps_stripe_connect(c->stripe, &m, m.nstreams));
  } else {
    ps_stripe_close(c->stripe);
    c->stripe = NULL;
  }
  ps_ep_addr_str(&c->ep, m.addr, c->peer_str, sizeof c->peer_str);
  PS_CHECK(ps_comm_start_liveness(c));
  c->watch = ps_watch_attach(c->ep.dev, m.addr, m.addrlen, m.watch_port);
  *ready = 1;
  return ncclSuccess;
}

void ps_net_forget_connects(uintptr_t owner) {
  if (!owner) return;
  int n;
  pthread_mutex_lock(&connecting_lock);
  ps_comm_t *gone = connecting_unlink(owned_by, &owner, &n);
  pthread_mutex_unlock(&connecting_lock);
  if (n)
    PS_INFO(NCCL_INIT | NCCL_NET, "finalize: closed %d connect(s) of this context that never "
            "completed (one to the listener at %s)", n, gone->peer_str);
  free_chain(gone);
}

ncclResult_t ps_net_connect(int dev, void *handle, void **send_comm, uintptr_t owner) {
  ps_handle_t h;
  if (!send_comm) {
    PS_WARN("connect: NULL send comm pointer");
    return ncclInvalidArgument;
  }
  *send_comm = NULL;
  ncclResult_t hrc = ps_handle_decode(handle, NCCL_NET_HANDLE_MAXSIZE, ps_fabric_wire_hash(), &h);
  connecting_reap(dev, hrc == ncclSuccess ? &h : NULL);
  PS_CHECK(hrc);
  if (!ps_fabric_dev(dev)) {
    PS_WARN("connect: device %d does not exist (this plugin has %d)", dev, ps_fabric_ndev());
    return ncclInvalidArgument;
  }
  int busy = 0;
  ps_comm_t *c = connecting_claim(dev, &h, &busy);
  if (busy) return ncclSuccess; /* a NULL comm: call again */
  if (!c) return connect_start(dev, &h, owner);
  int ready = 0;
  ncclResult_t rc = connect_poll(c, &ready);
  connecting_release(c, rc != ncclSuccess || ready);
  if (rc != ncclSuccess) {
    PS_WARN("connect to listener 0x%llx failed", (unsigned long long)h.listen_id);
    ps_comm_free(c);
    return rc;
  }
  if (ready) {
    PS_TRACE("connected to %s", c->peer_str);
    *send_comm = c->handle;
  }
  return ncclSuccess;
}

/* A refusal on its way to a connector whose CONNECT was delivered but will
 * get no ACCEPT: it named a listen id this listener does not have (a stale,
 * corrupt or other listener's handle), or the listener could not accept it
 * (its endpoint could not be opened, or its ACCEPT did not leave). Without
 * an answer the connector would wait for an ACCEPT for ever. The refusal
 * is an ACCEPT from the listener's endpoint: for a wrong listen id it echoes
 * the connector's conn_id under the listener's own id, for a dropped
 * CONNECT it carries PS_CONN_DROPPED(conn_id) under the right one. The wire
 * format stays as it is, and a connector of any version fails on either. */
typedef struct ps_nack {
  ps_ctrl_slot_t s;
  fi_addr_t peer;
  int in_av, unposted;
  uint64_t start_ns;
  struct ps_nack *next;
} ps_nack_t;

/* Refusals in flight per listener; more meanwhile are only logged. A
 * refusal the provider holds (to a connector gone, rxm retries for ever)
 * gives its slot back after PERSEUS_PEER_TIMEOUT_MS (nack_progress). */
#define PS_NACK_MAX 16

static void nack_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_ctrl_slot_t *s = op->owner;
  (void)e;
  if (err && err != -FI_ECANCELED)
    PS_INFO(NCCL_NET, "a refusal of a wrong listen id did not reach its connector: %s", errstr);
  s->done = err ? -1 : 1;
}

static void nack_free(ps_comm_t *l, ps_nack_t *n) {
  if (n->in_av && l) fi_av_remove(l->ep.av, &n->peer, 1, 0);
  if (n->s.mr) fi_close(&n->s.mr->fid);
  free(n);
}

static ncclResult_t nack_post(ps_comm_t *l, ps_nack_t *n) {
  int posted = 0;
  PS_CHECK(ps_ep_tsend(&l->ep, &n->s.msg, sizeof n->s.msg, n->s.mr ? fi_mr_desc(n->s.mr) : NULL,
                       n->peer, PS_TAG_ACCEPT, &n->s.op, &posted));
  n->unposted = !posted; /* the provider still connects: try again on the next accept */
  return ncclSuccess;
}

/* Frees the refusals that are done, and those the provider never took
 * within PERSEUS_PEER_TIMEOUT_MS; posts the others again. One the provider
 * took and still holds past then (its connector gone: rxm retries for ever)
 * gives its slot back, its memory kept until the listener closes. */
static void nack_progress(ps_comm_t *l) {
  uint64_t now = ps_now_ns(), limit_ns = (uint64_t)l->cfg->peer_timeout_ms * 1000000ULL;
  for (ps_nack_t **p = &l->nacks; *p;) {
    ps_nack_t *n = *p;
    if (n->unposted && nack_post(l, n) != ncclSuccess) n->s.done = -1;
    int late = now - n->start_ns > limit_ns;
    if (!n->s.done && !late) {
      p = &n->next;
      continue;
    }
    *p = n->next;
    l->nnacks--;
    if (!n->s.done && !n->unposted) { /* the provider still has its buffer */
      n->next = l->nacks_held;
      l->nacks_held = n;
    } else {
      nack_free(l, n);
    }
  }
}

/* Refuses a CONNECT (conn_id from the connector at addr): `answer` is its
 * conn_id for a wrong listen id, PS_CONN_DROPPED(conn_id) for one this
 * listener took but could not accept. */
static ncclResult_t nack_send(ps_comm_t *l, uint64_t answer, const void *addr, size_t addrlen) {
  if (l->nnacks >= PS_NACK_MAX) {
    PS_WARN("accept: %d refusals still in flight; this one is not answered", l->nnacks);
    return ncclSystemError;
  }
  ps_nack_t *n = calloc(1, sizeof *n);
  if (!n) {
    PS_WARN("accept: out of memory for a refusal");
    return ncclSystemError;
  }
  n->s.op = (ps_op_t){.cb = nack_done, .owner = &n->s};
  n->start_ns = ps_now_ns();
  ncclResult_t rc = ps_ctrl_encode(&n->s.msg, PS_CTRL_ACCEPT, ps_fabric_wire_hash(), l->listen_id,
                                   answer, l->ep.addr, l->ep.addrlen, 0);
  if (rc == ncclSuccess) rc = ps_ep_reg_local(&l->ep, &n->s.msg, sizeof n->s.msg, &n->s.mr);
  if (rc == ncclSuccess) rc = ps_ep_insert_len(&l->ep, addr, addrlen, &n->peer);
  n->in_av = rc == ncclSuccess;
  if (rc == ncclSuccess) rc = nack_post(l, n);
  if (rc != ncclSuccess) {
    nack_free(l, n);
    return rc;
  }
  n->next = l->nacks;
  l->nacks = n;
  l->nnacks++;
  return ncclSuccess;
}

/* Builds the recv comm for one validated CONNECT and answers it. */
static ncclResult_t accept_one(ps_comm_t *l, const ps_ctrl_msg_t *m, ps_comm_t **out) {
  ps_comm_t *c = NULL;
  PS_CHECK(ps_comm_alloc(PS_COMM_RECV, l->dev_index, &c));
  c->listen_id = l->listen_id;
  c->conn_id = m->conn_id;
  memcpy(c->connector_addr, m->addr, m->addrlen);
  c->connector_addrlen = m->addrlen;
  /* as many extra endpoints as both sides want */
  int streams = ps_stripe_wanted(c->ep.dev);
  streams = streams < m->nstreams ? streams : m->nstreams;
  ncclResult_t rc = streams ? ps_stripe_open(c->ep.dev, streams, c->nreqs * PS_MAX_RECVS, &c->stripe)
                            : ncclSuccess;
  c->connect_ns = ps_now_ns(); /* after our own set-up, as for connect */
  if (rc == ncclSuccess && c->stripe) rc = ps_stripe_connect(c->stripe, m, streams);
  if (rc == ncclSuccess) rc = ps_ep_insert_len(&c->ep, m->addr, m->addrlen, &c->peer);
  if (rc == ncclSuccess) rc = ps_comm_start_liveness(c);
  if (rc == ncclSuccess) rc = send_ctrl(c, PS_CTRL_ACCEPT, PS_TAG_ACCEPT);
  if (rc != ncclSuccess) {
    ps_comm_free(c);
    return rc;
  }
  ps_ep_addr_str(&c->ep, m->addr, c->peer_str, sizeof c->peer_str);
  c->watch = ps_watch_attach(c->ep.dev, m->addr, m->addrlen, m->watch_port);
  PS_TRACE("accepted connection from %s", c->peer_str);
  *out = c;
  return ncclSuccess;
}

/* A recv comm is handed to NCCL only once its ACCEPT has left (transmit
 * complete): with manual progress nobody else would push it out, and the
 * connecting peer waits for it. A connector that went away meanwhile (the
 * ACCEPT failed, or did not leave within PERSEUS_PEER_TIMEOUT_MS) is dropped
 * and the listener goes on: a later, live connector is still accepted. */
static ncclResult_t accept_poll(ps_comm_t *l, void **recv_comm) {
  ps_comm_t *c = l->accepting;
  ncclResult_t rc = handshake_progress(c);
  if (rc == ncclSuccess && ctrl_tx_overdue(c)) rc = ncclRemoteError;
  if (rc != ncclSuccess) {
    PS_WARN("accept: our ACCEPT did not reach the connector at %s (gone, or it cannot be "
            "reached from a new endpoint); refused through the listener, still listening",
            c->peer_str);
    l->accepting = NULL;
    /* through the connection the connector made: it may still hear that */
    if (nack_send(l, PS_CONN_DROPPED(c->conn_id), c->connector_addr, c->connector_addrlen) !=
        ncclSuccess)
      PS_WARN("accept: the refusal could not be sent");
    ps_comm_free(c);
    return ncclSuccess;
  }
  if (c->ctrl_tx.done == 1) {
    l->accepting = NULL;
    *recv_comm = c->handle;
  }
  return ncclSuccess;
}

ncclResult_t ps_net_accept(void *listen_comm, void **recv_comm) {
  if (!recv_comm) {
    PS_WARN("accept: NULL recv comm pointer");
    return ncclInvalidArgument;
  }
  *recv_comm = NULL;
  ps_comm_t *l = ps_comm_get(listen_comm, PS_COMM_LISTEN);
  if (!l) {
    ps_comm_refused("accept", listen_comm, PS_COMM_LISTEN);
    return ncclInvalidArgument;
  }
  if (l->nacks) { /* refusals leave through the listener's endpoint */
    PS_CHECK(ps_ep_progress(&l->ep, 64, NULL));
    nack_progress(l);
  }
  if (l->accepting) return accept_poll(l, recv_comm);
  PS_CHECK(ps_ep_progress(&l->ep, 64, NULL));
  if (l->ctrl_rx.done == 0) return ncclSuccess;
  ps_ctrl_msg_t m;
  ncclResult_t rc = ncclRemoteError;
  if (l->ctrl_rx.done < 0) /* a connector that failed mid-message (sockets reports it) */
    PS_WARN("accept: a CONNECT failed to arrive; still listening");
  else
    rc = ps_ctrl_decode(&l->ctrl_rx.msg, l->ctrl_rx.len, PS_CTRL_CONNECT, ps_fabric_wire_hash(), &m);
  if (rc == ncclSuccess && m.listen_id != l->listen_id) {
    PS_WARN("accept: a CONNECT for listen id 0x%llx arrived at listener 0x%llx; refused",
            (unsigned long long)m.listen_id, (unsigned long long)l->listen_id);
    if (nack_send(l, m.conn_id, m.addr, m.addrlen) != ncclSuccess)
      PS_WARN("accept: the refusal could not be sent");
    rc = ncclInvalidArgument;
  }
  if (rc == ncclSuccess && accept_one(l, &m, &l->accepting) != ncclSuccess) {
    /* the connector would wait for an ACCEPT for ever: it is told instead */
    PS_WARN("accept: answering a CONNECT failed (logged above); refused, still listening");
    if (nack_send(l, PS_CONN_DROPPED(m.conn_id), m.addr, m.addrlen) != ncclSuccess)
      PS_WARN("accept: the refusal could not be sent");
  }
  /* What could not be accepted is dropped (logged above); keep listening either way. */
  PS_CHECK(post_ctrl_recv(l, PS_TAG_CONNECT));
  return l->accepting ? accept_poll(l, recv_comm) : ncclSuccess;
}

ncclResult_t ps_net_close_listen(void *listen_comm) {
  ps_comm_t *l = ps_comm_get(listen_comm, PS_COMM_LISTEN);
  if (!l) {
    ps_comm_refused("closeListen", listen_comm, PS_COMM_LISTEN);
    return ncclInvalidArgument;
  }
  if (l->accepting) ps_comm_free(l->accepting);
  ps_nack_t *lists[2] = {l->nacks, l->nacks_held};
  ps_comm_free(l); /* its endpoint first: the provider lets go of the refusals' buffers */
  for (int i = 0; i < 2; i++)
    for (ps_nack_t *n = lists[i], *next; n; n = next) {
      next = n->next;
      nack_free(NULL, n);
    }
  return ncclSuccess;
}

/* A second close of one comm finds its handle stale: refused, nothing freed twice. */
static ncclResult_t close_comm(void *comm, int kind, const char *what) {
  ps_comm_t *c = ps_comm_get(comm, kind);
  if (!c) {
    ps_comm_refused(what, comm, kind);
    return ncclInvalidArgument;
  }
  if (c->nfree < c->nreqs)
    PS_INFO(NCCL_NET, "%s with %d request(s) in flight to %s: discarded", what, c->nreqs - c->nfree,
            c->peer_str);
  ps_comm_free(c);
  return ncclSuccess;
}

/* A send comm reaches NCCL only once its connect is done, so it is no
 * longer among the connects under way. */
ncclResult_t ps_net_close_send(void *send_comm) {
  return close_comm(send_comm, PS_COMM_SEND, "closeSend");
}

ncclResult_t ps_net_close_recv(void *recv_comm) {
  return close_comm(recv_comm, PS_COMM_RECV, "closeRecv");
}
