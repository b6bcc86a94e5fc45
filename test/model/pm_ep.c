/* The model fabric's endpoint: the libfabric calls a caller posts with (pm_nic.c performs
 * what they post; pm.h says what the fabric is). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "pm_ep.h"
#include "pm_ring.h"

/* --- posting --- */
/* Claims position pos of share s's submission ring, 0 when the ring is full.
 * The claim reads only the posters' line, never the entry, which the NIC
 * thread read last: the entry's line then moves to the poster with its
 * store, which the core completes in the background, as a descriptor write
 * to a real NIC's ring does. */
static int sq_claim(pm_nic_share_t *s, uint64_t *pos) {
  uint64_t p = atomic_load_explicit(&s->sq_head, memory_order_relaxed);
  do {
    uint64_t seen = atomic_load_explicit(&s->sq_seen, memory_order_acquire);
    if (p - seen >= PM_SQ) { /* full as far as we know: look at how far the thread took */
      uint64_t taken = atomic_load_explicit(&s->sq_taken, memory_order_acquire);
      if (p - taken >= PM_SQ) return 0;
      atomic_store_explicit(&s->sq_seen, taken, memory_order_release);
    }
  } while (!atomic_compare_exchange_weak_explicit(&s->sq_head, &p, p + 1, memory_order_relaxed,
                                                  memory_order_relaxed));
  *pos = p;
  return 1;
}

/* Claims the next submission entry of the ring of the link's NIC thread,
 * fills it and hands it over (the release of its sequence word):
 * -FI_EAGAIN when the ring is full, as a NIC's send queue would be. */
static ssize_t post(pm_ep_t *e, int type, void *ctx, void *buf, size_t len, fi_addr_t dest, uint64_t a0,
                    uint64_t key, uint64_t data, int remote_cq, uint64_t flags) {
  if (!e->seg) return -FI_EOPBADSTATE; /* not enabled */
  if (!pm_av_get(e->av, dest)) return -FI_EINVAL;
  pm_nic_share_t *s = &e->share[dest % (fi_addr_t)e->nshares];
  uint64_t pos;
  if (!sq_claim(s, &pos)) return -FI_EAGAIN;
  pm_sqe_t *q = &s->sq[pos % PM_SQ];
  q->ctx = ctx, q->buf = buf, q->len = len, q->a0 = a0, q->key = key, q->data = data;
  q->dest = (uint32_t)dest, q->type = (uint8_t)type, q->fence = !!(flags & FI_FENCE);
  q->remote_cq = (uint8_t)remote_cq;
  atomic_store_explicit(&q->seq, pos + 1, memory_order_release);
  return 0;
}

/* A tagged send; with has_data, `data` reaches the receiver as remote CQ data. */
static ssize_t send_tagged(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest,
                           uint64_t tag, int has_data, uint64_t data, void *ctx) {
  return post((pm_ep_t *)ep, OP_TSEND, ctx, (void *)buf, len, dest, tag, 0, data, has_data, 0);
}

static ssize_t tsend(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest,
                     uint64_t tag, void *ctx) {
  (void)desc;
  return send_tagged(ep, buf, len, dest, tag, 0, 0, ctx);
}

static ssize_t tsenddata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                         fi_addr_t dest, uint64_t tag, void *ctx) {
  (void)desc;
  return send_tagged(ep, buf, len, dest, tag, 1, data, ctx);
}

static ssize_t trecv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src,
                     uint64_t tag, uint64_t ignore, void *ctx) {
  pm_ep_t *e = (pm_ep_t *)ep;
  (void)desc, (void)src;
  pm_recv_t *r = calloc(1, sizeof *r);
  if (!r) return -FI_ENOMEM;
  *r = (pm_recv_t){.buf = buf, .len = len, .tag = tag, .ignore = ignore, .ctx = ctx};
  /* a compare-and-swap, not the endpoint's lock, which a NIC thread holds
   * through its pass: re-posting a receive must not wait for one */
  r->next = atomic_load_explicit(&e->recv_top, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(&e->recv_top, &r->next, r, memory_order_release,
                                                memory_order_relaxed))
    ;
  return 0;
}

static ssize_t rma_msg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags, int type) {
  if (msg->iov_count != 1 || msg->rma_iov_count != 1 || msg->msg_iov[0].iov_len != msg->rma_iov[0].len)
    return -FI_EINVAL;
  return post((pm_ep_t *)ep, type, msg->context, msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, msg->addr,
              msg->rma_iov[0].addr, msg->rma_iov[0].key, msg->data,
              type == OP_WRITE && (flags & FI_REMOTE_CQ_DATA), flags);
}

static ssize_t writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags) {
  return rma_msg(ep, msg, flags, OP_WRITE);
}
static ssize_t readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags) {
  return rma_msg(ep, msg, flags, OP_READ);
}

/* uint64 add of one element: what signals need. */
static ssize_t atomicmsg(struct fid_ep *ep, const struct fi_msg_atomic *msg, uint64_t flags) {
  if (!pm_params()->atomics || msg->iov_count != 1 || msg->rma_iov_count != 1 ||
      msg->msg_iov[0].count != 1 || msg->rma_iov[0].count != 1 || msg->datatype != FI_UINT64 ||
      msg->op != FI_SUM)
    return -FI_EOPNOTSUPP;
  return post((pm_ep_t *)ep, OP_ATOMIC, msg->context, NULL, 8, msg->addr, msg->rma_iov[0].addr,
              msg->rma_iov[0].key, *(const uint64_t *)msg->msg_iov[0].addr, 0, flags);
}

/* --- endpoint object --- */
static void free_ops(pm_op_t *op) {
  while (op) {
    pm_op_t *n = op->next;
    free(op->why);
    free(op);
    op = n;
  }
}

static int ep_close(struct fid *fid) {
  pm_ep_t *e = (pm_ep_t *)fid;
  pm_nic_remove(e);
  for (size_t i = 0; i < e->nlinks; i++) free_ops(e->links[i].head);
  for (int t = 0; t < PM_MAX_NIC_THREADS; t++) {
    free_ops(e->share[t].waiting), free_ops(e->share[t].acking), free_ops(e->share[t].cache);
    free(e->share[t].sq);
    pthread_mutex_destroy(&e->share[t].lock);
  }
  free_ops(atomic_load(&e->finished));
  for (pm_recv_t *r = e->recvs, *n; r; r = n) n = r->next, free(r);
  for (pm_recv_t *r = atomic_load(&e->recv_top), *n; r; r = n) n = r->next, free(r);
  for (pm_held_t *h = e->unexp, *n; h; h = n) n = h->next, free(h);
  for (pm_held_t *h = e->held, *n; h; h = n) n = h->next, free(h);
  if (e->seg) pm_cq_detach(e->cq, e->seg), pm_unlink(e->name, e->seg, sizeof *e->seg);
  free(e->links);
  free(e);
  return 0;
}

static int ep_bind(struct fid *fid, struct fid *bfid, uint64_t flags) {
  pm_ep_t *e = (pm_ep_t *)fid;
  (void)flags;
  if (bfid->fclass == FI_CLASS_CQ) e->cq = (pm_cq_t *)bfid;
  else if (bfid->fclass == FI_CLASS_AV) e->av = (pm_av_t *)bfid;
  else return -FI_EINVAL;
  return 0;
}

static int ep_control(struct fid *fid, int command, void *arg) {
  pm_ep_t *e = (pm_ep_t *)fid;
  (void)arg;
  if (command != FI_ENABLE) return -FI_ENOSYS;
  if (!e->cq || !e->av) return -FI_ENOCQ;
  if (e->seg) return 0;
  for (int t = 0; t < e->nshares; t++) {
    pm_nic_share_t *s = &e->share[t];
    if (!s->sq && !(s->sq = aligned_alloc(_Alignof(pm_sqe_t), PM_SQ * sizeof *s->sq))) return -FI_ENOMEM;
    for (uint64_t i = 0; i < PM_SQ; i++) atomic_store(&s->sq[i].seq, 0); /* position i ready: i + 1 */
  }
  e->seg = pm_create(e->name, sizeof *e->seg);
  if (!e->seg) return -FI_ENOMEM;
  e->seg->magic = PM_MAGIC, e->seg->pid = getpid();
  memcpy(e->seg->dom, e->d->seg_name, PM_NAME_LEN);
  for (uint64_t i = 0; i < PM_INBOX; i++) atomic_store(&e->seg->ring[i].seq, i);
  for (uint64_t i = 0; i < PM_RCQ; i++) atomic_store(&e->seg->rcq[i].seq, i);
  int rc = pm_cq_attach(e->cq, e->seg, e->av);
  if (rc) {
    pm_unlink(e->name, e->seg, sizeof *e->seg);
    e->seg = NULL;
    return rc;
  }
  return pm_nic_add(e);
}

static int ep_getname(fid_t fid, void *addr, size_t *len) {
  pm_ep_t *e = (pm_ep_t *)fid;
  size_t have = *len;
  *len = PM_NAME_LEN;
  if (!e->seg) return -FI_EOPBADSTATE;
  if (have < PM_NAME_LEN) return -FI_ETOOSMALL;
  memcpy(addr, e->name, PM_NAME_LEN);
  return 0;
}

static struct fi_ops ep_fi_ops = {.size = sizeof(struct fi_ops), .close = ep_close, .bind = ep_bind,
                                  .control = ep_control};
static struct fi_ops_ep ep_ops = {.size = sizeof(struct fi_ops_ep)};
static struct fi_ops_cm cm_ops = {.size = sizeof(struct fi_ops_cm), .getname = ep_getname};
static struct fi_ops_msg msg_ops = {.size = sizeof(struct fi_ops_msg)};
static struct fi_ops_tagged tagged_ops = {.size = sizeof(struct fi_ops_tagged), .send = tsend,
                                          .senddata = tsenddata, .recv = trecv};
static struct fi_ops_rma rma_ops = {.size = sizeof(struct fi_ops_rma), .writemsg = writemsg,
                                    .readmsg = readmsg};
static struct fi_ops_atomic atomic_ops = {.size = sizeof(struct fi_ops_atomic), .writemsg = atomicmsg};

int pm_ep_open(struct fid_domain *domain, struct fi_info *info, struct fid_ep **out, void *ctx) {
  (void)info;
  pm_ep_t *e = aligned_alloc(_Alignof(pm_ep_t), (sizeof *e + 63) / 64 * 64); /* its shares are aligned */
  if (!e) return -FI_ENOMEM;
  memset(e, 0, sizeof *e);
  e->d = (pm_domain_t *)domain;
  e->rnd = (unsigned)pm_now_ns();
  e->nshares = pm_params()->nic_threads;
  for (int t = 0; t < PM_MAX_NIC_THREADS; t++) {
    pthread_mutex_init(&e->share[t].lock, NULL);
    e->share[t].rnd = e->rnd + (unsigned)t;
  }
  e->ep = (struct fid_ep){.fid = {.fclass = FI_CLASS_EP, .context = ctx, .ops = &ep_fi_ops},
                          .ops = &ep_ops, .cm = &cm_ops, .msg = &msg_ops, .rma = &rma_ops,
                          .tagged = &tagged_ops, .atomic = &atomic_ops};
  *out = &e->ep;
  return 0;
}
