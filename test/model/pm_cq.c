/* The model fabric's queues (pm.h says what it is): the endpoints' inbox
 * and notice ring in shared memory, and the completion queue. Producers
 * (NIC threads, peers' NIC threads) never take a lock; readers do. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pm.h"
#include "pm_ring.h"

int pm_inbox_put(pm_ep_seg_t *s, const pm_msg_t *m) {
  uint64_t pos;
  if (!pm_ring_claim(&s->head, s->ring, sizeof s->ring[0], PM_INBOX, &pos)) return -FI_EAGAIN;
  pm_msg_t *slot = &s->ring[pos % PM_INBOX];
  memcpy((char *)slot + sizeof slot->seq, (const char *)m + sizeof m->seq, sizeof *m - sizeof m->seq);
  atomic_store_explicit(&slot->seq, pos + 1, memory_order_release);
  return 0;
}

int pm_inbox_get(pm_ep_seg_t *s, pm_msg_t *out) {
  uint64_t pos = atomic_load_explicit(&s->tail, memory_order_relaxed);
  pm_msg_t *slot = pm_ring_ready(s->ring, sizeof s->ring[0], PM_INBOX, pos);
  if (!slot) return -FI_EAGAIN;
  memcpy((char *)out + sizeof out->seq, (char *)slot + sizeof slot->seq, sizeof *out - sizeof out->seq);
  pm_ring_free(slot, PM_INBOX, pos);
  atomic_store_explicit(&s->tail, pos + 1, memory_order_relaxed);
  return 0;
}

int pm_rcq_put(pm_ep_seg_t *s, uint64_t data, const char *src) {
  uint64_t pos;
  if (!pm_ring_claim(&s->rcq_head, s->rcq, sizeof s->rcq[0], PM_RCQ, &pos)) return -FI_EAGAIN;
  s->rcq[pos % PM_RCQ].data = data;
  memcpy(s->rcq[pos % PM_RCQ].src, src, PM_NAME_LEN);
  atomic_store_explicit(&s->rcq[pos % PM_RCQ].seq, pos + 1, memory_order_release);
  return 0;
}

/* The oldest notice of the ring (single consumer: the CQ's lock), and its
 * writer as an address of av where src is not NULL. */
static int rcq_get(pm_ep_seg_t *s, uint64_t *data, pm_av_t *av, fi_addr_t *src) {
  uint64_t pos = atomic_load_explicit(&s->rcq_tail, memory_order_relaxed);
  __typeof__(&s->rcq[0]) slot = pm_ring_ready(s->rcq, sizeof s->rcq[0], PM_RCQ, pos);
  if (!slot) return -FI_EAGAIN;
  *data = slot->data;
  if (src) {
    char name[PM_NAME_LEN];
    memcpy(name, slot->src, PM_NAME_LEN);
    name[PM_NAME_LEN - 1] = 0;
    *src = pm_av_find(av, name);
  }
  pm_ring_free(slot, PM_RCQ, pos);
  atomic_store_explicit(&s->rcq_tail, pos + 1, memory_order_relaxed);
  return 0;
}

/* --- completion queue: NIC threads add entries without a lock (a ring
 * whose slots say whose turn it is, as the inbox), the way a NIC writes
 * completions into host memory; only readers take the CQ's lock. A full
 * ring spills into a list under its own lock, so that a NIC thread never
 * waits for a reader. --- */
#define PM_CQ_RING 4096

/* An error entry's details, apart from the ring (errors are rare). */
typedef struct {
  int err; /* an fi errno */
  size_t olen;
  char why[96];
} pm_cqe_err_t;

/* With its ring slot's sequence word, one cache line, as a NIC's
 * completion entry: a reader takes a line per completion. The entry's
 * fields but buf, which only FI_MULTI_RECV receives fill (the model offers
 * none), and in its place the sender. */
typedef struct {
  void *op_context;
  uint64_t flags;
  size_t len;
  uint64_t data, tag;
  fi_addr_t src;     /* a received message's sender (FI_SOURCE), else FI_ADDR_NOTAVAIL */
  pm_cqe_err_t *err; /* NULL, or an error entry's details */
} pm_cqe_t;
_Static_assert(sizeof(uint64_t) + sizeof(pm_cqe_t) == 64, "a completion ring slot is one cache line");

typedef struct pm_cq_spill {
  struct pm_cq_spill *next;
  pm_cqe_t x;
} pm_cq_spill_t;

/* A NIC thread's own ring of completions, that thread its only producer:
 * it claims nothing, and the reader never writes a slot, only how far it
 * read (the producer looks there when its last look says full). A NIC
 * writes completion entries the same way. */
#define PM_CQ_LANE 1024
typedef struct {
  struct {
    _Atomic uint64_t seq; /* pos + 1 once written */
    pm_cqe_t x;
  } __attribute__((aligned(64))) *ring;
  uint64_t head __attribute__((aligned(64))), seen_tail; /* the producer's */
  _Atomic uint64_t tail __attribute__((aligned(64)));     /* the reader's */
} pm_cq_lane_t;

struct pm_cq {
  struct fid_cq cq;
  pm_cq_lane_t *lane; /* one per NIC thread (pm_params()->nic_threads) */
  int nlanes;
  pthread_mutex_t lock; /* readers: the ring's tail, the spill list's head, rseg */
  struct {
    _Atomic uint64_t seq;
    pm_cqe_t x;
  } __attribute__((aligned(64))) *ring;
  _Atomic uint64_t head;
  uint64_t tail;
  pthread_mutex_t spill_lock;
  pm_cq_spill_t *spill, **spill_tail;
  _Atomic int spilled;
  char last_err[96];
  pm_ep_seg_t **rseg; /* notice rings of the endpoints bound to it */
  pm_av_t **rav;      /* ... and those endpoints' address vectors */
  int nrseg, rseg_cap;
};

int pm_cq_attach(pm_cq_t *c, pm_ep_seg_t *seg, pm_av_t *av) {
  pthread_mutex_lock(&c->lock);
  if (c->nrseg == c->rseg_cap) {
    int cap = c->rseg_cap ? 2 * c->rseg_cap : 4;
    pm_ep_seg_t **r = realloc(c->rseg, (size_t)cap * sizeof *r);
    if (r) c->rseg = r;
    pm_av_t **a = r ? realloc(c->rav, (size_t)cap * sizeof *a) : NULL;
    if (!a) {
      pthread_mutex_unlock(&c->lock);
      return -FI_ENOMEM;
    }
    c->rav = a, c->rseg_cap = cap;
  }
  c->rav[c->nrseg] = av;
  c->rseg[c->nrseg++] = seg;
  pthread_mutex_unlock(&c->lock);
  return 0;
}

void pm_cq_detach(pm_cq_t *c, pm_ep_seg_t *seg) {
  pthread_mutex_lock(&c->lock);
  for (int i = 0; i < c->nrseg; i++)
    if (c->rseg[i] == seg) {
      c->nrseg--;
      c->rseg[i] = c->rseg[c->nrseg], c->rav[i] = c->rav[c->nrseg];
    }
  pthread_mutex_unlock(&c->lock);
}

_Thread_local int pm_nic_tid = -1;

static void cq_add(pm_cq_t *c, const pm_cqe_t *x) {
  if (pm_nic_tid >= 0 && pm_nic_tid < c->nlanes && !atomic_load_explicit(&c->spilled, memory_order_relaxed)) {
    pm_cq_lane_t *l = &c->lane[pm_nic_tid];
    if (l->head - l->seen_tail >= PM_CQ_LANE)
      l->seen_tail = atomic_load_explicit(&l->tail, memory_order_acquire);
    if (l->head - l->seen_tail < PM_CQ_LANE) {
      __typeof__(&l->ring[0]) slot = &l->ring[l->head % PM_CQ_LANE];
      slot->x = *x;
      atomic_store_explicit(&slot->seq, l->head + 1, memory_order_release);
      l->head++;
      return;
    }
  }
  uint64_t pos;
  if (pm_ring_claim(&c->head, c->ring, sizeof c->ring[0], PM_CQ_RING, &pos)) {
    c->ring[pos % PM_CQ_RING].x = *x;
    atomic_store_explicit(&c->ring[pos % PM_CQ_RING].seq, pos + 1, memory_order_release);
    return;
  }
  pm_cq_spill_t *s = malloc(sizeof *s);
  if (!s) {
    fprintf(stderr, "model fabric: out of memory, a completion is lost\n");
    return;
  }
  s->x = *x, s->next = NULL;
  pthread_mutex_lock(&c->spill_lock);
  *c->spill_tail = s, c->spill_tail = &s->next;
  atomic_store_explicit(&c->spilled, 1, memory_order_release);
  pthread_mutex_unlock(&c->spill_lock);
}

void pm_cq_push(pm_cq_t *cq, const struct fi_cq_tagged_entry *e, fi_addr_t src) {
  pm_cqe_t x = {.op_context = e->op_context, .flags = e->flags, .len = e->len, .data = e->data,
                .tag = e->tag, .src = src};
  cq_add(cq, &x);
}

void pm_cq_push_err(pm_cq_t *cq, void *ctx, uint64_t flags, int err, size_t olen, const char *why) {
  pm_cqe_err_t *d = malloc(sizeof *d);
  if (!d) {
    fprintf(stderr, "model fabric: out of memory, a failed operation's completion is lost\n");
    return;
  }
  *d = (pm_cqe_err_t){.err = err, .olen = olen};
  snprintf(d->why, sizeof d->why, "%s", why);
  cq_add(cq, &(pm_cqe_t){.op_context = ctx, .flags = flags, .src = FI_ADDR_NOTAVAIL, .err = d});
}

/* The next entry to read (reader, c->lock held): a lane's, else the shared
 * ring's, else the spill list's; NULL when there is none. *from says where
 * (a lane's index, -1 the ring, -2 the spill list) for cq_pop. */
static const pm_cqe_t *cq_peek(pm_cq_t *c, int *from) {
  for (int i = 0; i < c->nlanes; i++) {
    pm_cq_lane_t *l = &c->lane[i];
    uint64_t t = atomic_load_explicit(&l->tail, memory_order_relaxed);
    __typeof__(&l->ring[0]) slot = &l->ring[t % PM_CQ_LANE];
    if (atomic_load_explicit(&slot->seq, memory_order_acquire) == t + 1) return *from = i, &slot->x;
  }
  __typeof__(&c->ring[0]) slot = pm_ring_ready(c->ring, sizeof c->ring[0], PM_CQ_RING, c->tail);
  if (slot) return *from = -1, &slot->x;
  if (!atomic_load_explicit(&c->spilled, memory_order_acquire)) return NULL;
  pthread_mutex_lock(&c->spill_lock);
  const pm_cqe_t *x = c->spill ? &c->spill->x : NULL; /* only readers unlink */
  pthread_mutex_unlock(&c->spill_lock);
  return *from = -2, x;
}

static void cq_pop(pm_cq_t *c, int from) {
  if (from >= 0) { /* read: the slot is the producer's again */
    pm_cq_lane_t *l = &c->lane[from];
    atomic_store_explicit(&l->tail, atomic_load_explicit(&l->tail, memory_order_relaxed) + 1,
                          memory_order_release);
    return;
  }
  if (from == -1) {
    pm_ring_free(&c->ring[c->tail % PM_CQ_RING], PM_CQ_RING, c->tail);
    c->tail++;
    return;
  }
  pthread_mutex_lock(&c->spill_lock);
  pm_cq_spill_t *s = c->spill;
  if (!(c->spill = s->next)) c->spill_tail = &c->spill, atomic_store(&c->spilled, 0);
  pthread_mutex_unlock(&c->spill_lock);
  free(s);
}

/* src: where fi_cq_readfrom wants the entries' sources, or NULL. */
static ssize_t cq_readfrom(struct fid_cq *fid, void *buf, size_t count, fi_addr_t *src) {
  pm_cq_t *c = (pm_cq_t *)fid;
  struct fi_cq_tagged_entry *out = buf;
  ssize_t n = 0;
  pthread_mutex_lock(&c->lock);
  uint64_t data;
  for (int i = 0; i < c->nrseg; i++)
    while ((size_t)n < count && !rcq_get(c->rseg[i], &data, c->rav[i], src ? &src[n] : NULL))
      out[n++] = (struct fi_cq_tagged_entry){.flags = FI_REMOTE_WRITE | FI_RMA | FI_REMOTE_CQ_DATA,
                                             .data = data};
  const pm_cqe_t *x = NULL;
  int from = 0;
  while ((size_t)n < count && (x = cq_peek(c, &from)) && !x->err) {
    if (src) src[n] = x->src;
    out[n++] = (struct fi_cq_tagged_entry){.op_context = x->op_context, .flags = x->flags,
                                           .len = x->len, .data = x->data, .tag = x->tag};
    cq_pop(c, from);
  }
  int err = !n && x && x->err;
  pthread_mutex_unlock(&c->lock);
  return n ? n : err ? -FI_EAVAIL : -FI_EAGAIN;
}

static ssize_t cq_read(struct fid_cq *fid, void *buf, size_t count) {
  return cq_readfrom(fid, buf, count, NULL);
}

static ssize_t cq_readerr(struct fid_cq *fid, struct fi_cq_err_entry *buf, uint64_t flags) {
  pm_cq_t *c = (pm_cq_t *)fid;
  (void)flags;
  pthread_mutex_lock(&c->lock);
  int from = 0;
  const pm_cqe_t *x = cq_peek(c, &from);
  if (!x || !x->err) {
    pthread_mutex_unlock(&c->lock);
    return -FI_EAGAIN;
  }
  pm_cqe_err_t *d = x->err;
  *buf = (struct fi_cq_err_entry){.op_context = x->op_context, .flags = x->flags,
                                  .err = d->err, .olen = d->olen, .prov_errno = d->err};
  snprintf(c->last_err, sizeof c->last_err, "%s", d->why);
  cq_pop(c, from);
  free(d);
  pthread_mutex_unlock(&c->lock);
  return 1;
}

static const char *cq_strerror(struct fid_cq *fid, int prov_errno, const void *err_data, char *buf,
                               size_t len) {
  pm_cq_t *c = (pm_cq_t *)fid;
  (void)prov_errno, (void)err_data;
  if (buf && len) snprintf(buf, len, "%s", c->last_err);
  return buf ? buf : c->last_err;
}

static int cq_close(struct fid *fid) {
  pm_cq_t *c = (pm_cq_t *)fid;
  pthread_mutex_destroy(&c->lock);
  pthread_mutex_destroy(&c->spill_lock);
  for (pm_cq_spill_t *s = c->spill, *n; s; s = n) n = s->next, free(s->x.err), free(s);
  for (uint64_t i = c->tail; i < atomic_load(&c->head); i++) /* entries never read */
    if (atomic_load(&c->ring[i % PM_CQ_RING].seq) == i + 1) free(c->ring[i % PM_CQ_RING].x.err);
  for (int i = 0; i < c->nlanes; i++) {
    pm_cq_lane_t *l = &c->lane[i];
    for (uint64_t t = atomic_load(&l->tail); t < l->head; t++) free(l->ring[t % PM_CQ_LANE].x.err);
    free(l->ring);
  }
  free(c->lane);
  free(c->ring);
  free(c->rseg), free(c->rav);
  free(c);
  return 0;
}

static struct fi_ops cq_fi_ops = {.size = sizeof(struct fi_ops), .close = cq_close};
static struct fi_ops_cq cq_ops = {.size = sizeof(struct fi_ops_cq), .read = cq_read,
                                  .readfrom = cq_readfrom, .readerr = cq_readerr,
                                  .strerror = cq_strerror};

int pm_cq_open(struct fid_domain *d, struct fi_cq_attr *attr, struct fid_cq **out, void *ctx) {
  if (attr && attr->format != FI_CQ_FORMAT_TAGGED && attr->format != FI_CQ_FORMAT_UNSPEC)
    return -FI_ENOSYS;
  pm_cq_t *c = calloc(1, sizeof *c);
  if (c && !(c->ring = aligned_alloc(64, PM_CQ_RING * sizeof *c->ring))) free(c), c = NULL;
  if (!c) return -FI_ENOMEM;
  (void)d;
  c->nlanes = pm_params()->nic_threads;
  if (!(c->lane = aligned_alloc(64, (size_t)c->nlanes * sizeof *c->lane))) {
    free(c->ring), free(c);
    return -FI_ENOMEM;
  }
  memset(c->lane, 0, (size_t)c->nlanes * sizeof *c->lane);
  for (int i = 0; i < c->nlanes; i++) {
    pm_cq_lane_t *l = &c->lane[i];
    if (!(l->ring = aligned_alloc(64, PM_CQ_LANE * sizeof *l->ring))) {
      for (int j = 0; j < i; j++) free(c->lane[j].ring);
      free(c->lane), free(c->ring), free(c);
      return -FI_ENOMEM;
    }
    memset(l->ring, 0, PM_CQ_LANE * sizeof *l->ring);
  }
  memset(c->ring, 0, PM_CQ_RING * sizeof *c->ring);
  for (uint64_t i = 0; i < PM_CQ_RING; i++) atomic_store(&c->ring[i].seq, i);
  c->spill_tail = &c->spill;
  pthread_mutex_init(&c->lock, NULL);
  pthread_mutex_init(&c->spill_lock, NULL);
  c->cq = (struct fid_cq){.fid = {.fclass = FI_CLASS_CQ, .context = ctx, .ops = &cq_fi_ops},
                          .ops = &cq_ops};
  *out = &c->cq;
  return 0;
}
