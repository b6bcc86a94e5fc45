/* The model fabric's NIC threads (pm.h says what they do): each pass
 * takes what was posted onto its links, performs what arrived (writes and
 * reads straight into the peer's memory, sends, atomics and their
 * acknowledgements as inbox messages) and completes it one latency later. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "pm_ep.h"
#include "pm_ring.h"

/* Held for reading by the NIC threads through each pass, for writing (writers first) where
 * an endpoint comes or goes (its memory is freed only when no pass uses it). */
static pthread_rwlock_t all_lock = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
static pm_ep_t *all_eps;
static pthread_t nic[PM_MAX_NIC_THREADS];
static int nic_running; /* threads started */
static _Atomic int nic_stop;

static void push_back(pm_held_t **list, pm_held_t *h) {
  h->next = NULL;
  while (*list) list = &(*list)->next;
  *list = h;
}

static int hold(pm_held_t **list, const pm_msg_t *m, pm_ep_seg_t *to) {
  pm_held_t *h = calloc(1, sizeof *h);
  if (!h) return -FI_ENOMEM;
  h->m = *m, h->to = to;
  push_back(list, h);
  return 0;
}

/* A message to another endpoint: into its inbox now, or held until there is room. */
static void send_msg(pm_ep_t *e, pm_ep_seg_t *to, const pm_msg_t *m) {
  if (pm_inbox_put(to, m) && hold(&e->held, m, to))
    fprintf(stderr, "model fabric: out of memory, a message is lost\n");
}

void pm_op_release(pm_ep_t *e, pm_op_t *op) {
  op->next = atomic_load_explicit(&e->finished, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(&e->finished, &op->next, op, memory_order_release,
                                                memory_order_relaxed))
    ;
}

/* Fails op with err, saying why (kept until its completion is reported). */
static void op_fail(pm_op_t *op, int err, const char *why) {
  op->err = err;
  free(op->why);
  op->why = strdup(why);
}

static void complete(pm_ep_t *e, pm_op_t *op, int err, const char *why) {
  if (err) {
    pm_cq_push_err(e->cq, op->ctx, op->cflags, err, 0, why ? why : "out of memory for the reason");
    free(op->why);
    op->why = NULL;
  } else {
    struct fi_cq_tagged_entry c = {.op_context = op->ctx, .flags = op->cflags, .len = op->len};
    pm_cq_push(e->cq, &c, FI_ADDR_NOTAVAIL);
  }
  pm_op_release(e, op);
}

/* The registration `key` of `dom` covering [addr, addr + len) with `access`. */
static const char *check_mr(pm_dom_seg_t *dom, uint64_t key, uint64_t addr, size_t len, uint64_t access) {
  uint64_t slot = key >> 48;
  if (slot >= PM_MAX_MR) return "no such key";
  pm_mr_slot_t *s = &dom->mr[slot];
  if (atomic_load(&s->key) != key) return "key not registered there";
  if (addr < s->addr || addr + len < addr || addr + len > s->addr + s->len)
    return "outside the registration";
  if (!(s->access & access)) return "registration does not allow that access";
  return NULL;
}

static int my_pid(void) {
  static _Atomic int pid;
  int p = atomic_load_explicit(&pid, memory_order_relaxed);
  if (!p) atomic_store_explicit(&pid, p = (int)getpid(), memory_order_relaxed);
  return p;
}

/* Moves a write's or read's bytes (op->written = 1), or says why it failed
 * (op->err, op->why). Touches no endpoint state: the NIC thread runs it
 * without the endpoint's lock, so that the caller's posts do not wait for
 * the copies of the operations ahead of theirs. */
static void move_data(pm_ep_t *e, pm_op_t *op) {
  const pm_peer_t *peer = pm_av_get(e->av, op->dest);
  if (!peer) {
    op_fail(op, FI_EINVAL, "destination not in the address vector");
    return;
  }
  const char *bad = check_mr(peer->dom, op->key, op->raddr, op->len,
                             op->type == OP_WRITE ? FI_REMOTE_WRITE : FI_REMOTE_READ);
  if (bad) {
    op_fail(op, FI_EACCES, bad);
    return;
  }
  char why[128];
  if (pm_move(&peer->dom->mr[op->key >> 48], peer->pid, op->type == OP_READ, op->buf, op->raddr,
              op->len, why, sizeof why)) {
    op_fail(op, FI_EIO, why);
    return;
  }
  op->written = 1;
}

static int is_rma(const pm_op_t *op) { return op->type == OP_WRITE || op->type == OP_READ; }

/* An operation leaves its link for good (completed, or to its ACK). */
static void leave(pm_nic_share_t *s) { atomic_fetch_sub_explicit(&s->queued, 1, memory_order_relaxed); }

/* Performs an operation whose time came (s: the share of its link, locked);
 * -FI_EAGAIN when the target's inbox or notice ring is full. */
static int perform(pm_ep_t *e, pm_nic_share_t *s, pm_op_t *op, uint64_t now) {
  const pm_params_t *p = pm_params();
  const pm_peer_t *peer = pm_av_get(e->av, op->dest);
  if (!peer) {
    complete(e, op, FI_EINVAL, "destination not in the address vector");
    leave(s);
    return 0;
  }
  if (is_rma(op)) {
    if (!op->written && !op->err) move_data(e, op);
    if (op->err) {
      complete(e, op, op->err, op->why);
      leave(s);
      return 0;
    }
    if (op->remote_cq && pm_rcq_put(peer->seg, op->data, e->name))
      return -FI_EAGAIN; /* the data is there; its notice next time */
    op->done_ns = now + p->latency_ns + (op->type == OP_READ ? (uint64_t)(op->len * p->ns_per_byte) : 0);
    op->next = NULL;
    if (s->waiting_tail) s->waiting_tail->next = op;
    else s->waiting = op;
    s->waiting_tail = op;
    return 0;
  }
  pm_msg_t m = {.type = op->type == OP_TSEND ? PM_MSG_TSEND : PM_MSG_ATOMIC, .src_pid = my_pid(),
                .tag = op->tag, .len = op->len, .addr = op->type == OP_TSEND ? (uint64_t)(uintptr_t)op->buf : op->raddr,
                .key = op->key, .data = op->data, .ctx = (uint64_t)(uintptr_t)op,
                .has_data = op->type == OP_TSEND && op->remote_cq};
  memcpy(m.src, e->name, PM_NAME_LEN);
  if (op->type == OP_TSEND && op->len <= PM_INLINE && op->len) memcpy(m.inl, op->buf, op->len);
  if (pm_inbox_put(peer->seg, &m)) return -FI_EAGAIN;
  op->next = s->acking;
  s->acking = op;
  leave(s); /* thread 0 completes it when the ACK comes */
  return 0;
}

static void ack(pm_ep_t *e, const pm_msg_t *to_whom, uint32_t status) {
  pm_ep_seg_t *seg = pm_map(to_whom->src, sizeof(pm_ep_seg_t));
  if (!seg) return; /* the origin closed its endpoint */
  pm_msg_t m = {.type = PM_MSG_ACK, .ctx = to_whom->ctx, .status = status,
                .not_before_ns = pm_now_ns() + pm_params()->latency_ns};
  send_msg(e, seg, &m);
}

static void on_ack(pm_ep_t *e, const pm_msg_t *m, int n) {
  for (int t = 0; t < n; t++) {
    pm_nic_share_t *s = &e->share[t];
    pm_op_t *op = NULL;
    pthread_mutex_lock(&s->lock);
    for (pm_op_t **p = &s->acking; *p; p = &(*p)->next)
      if ((uint64_t)(uintptr_t)*p == m->ctx) {
        op = *p;
        *p = op->next;
        break;
      }
    pthread_mutex_unlock(&s->lock);
    if (op) {
      complete(e, op, (int)m->status, m->status ? "the target refused the operation" : NULL);
      return;
    }
  }
}

static void on_atomic(pm_ep_t *e, const pm_msg_t *m) {
  const char *bad = check_mr(e->d->seg, m->key, m->addr, 8, FI_REMOTE_WRITE);
  if (!bad && m->addr % 8) bad = "misaligned";
  if (!bad) __atomic_fetch_add((uint64_t *)(uintptr_t)m->addr, m->data, __ATOMIC_SEQ_CST);
  ack(e, m, bad ? FI_EACCES : 0);
}

/* The receives posted since the last pass join the list, in posting order. */
static void take_recvs(pm_ep_t *e) {
  if (!atomic_load_explicit(&e->recv_top, memory_order_relaxed)) return;
  pm_recv_t *top = atomic_exchange_explicit(&e->recv_top, NULL, memory_order_acquire), *in = NULL;
  while (top) {
    pm_recv_t *next = top->next;
    top->next = in, in = top, top = next;
  }
  pm_recv_t **tail = &e->recvs;
  while (*tail) tail = &(*tail)->next;
  *tail = in;
}

/* Matches arrived messages with posted receives, both in order, and pulls the data. */
static int match(pm_ep_t *e) {
  int work = 0;
  take_recvs(e);
  for (pm_held_t **u = &e->unexp; *u;) {
    pm_msg_t *m = &(*u)->m;
    pm_recv_t **r = &e->recvs;
    while (*r && ((m->tag | (*r)->ignore) != ((*r)->tag | (*r)->ignore))) r = &(*r)->next;
    if (!*r) {
      u = &(*u)->next;
      continue;
    }
    pm_recv_t *rv = *r;
    *r = rv->next;
    size_t n = m->len < rv->len ? m->len : rv->len;
    struct iovec l = {rv->buf, n}, rem = {(void *)(uintptr_t)m->addr, n};
    ssize_t got = !n ? 0 : m->len <= PM_INLINE ? (memcpy(rv->buf, m->inl, n), (ssize_t)n)
                                               : process_vm_readv(m->src_pid, &l, 1, &rem, 1, 0);
    if (got != (ssize_t)n)
      pm_cq_push_err(e->cq, rv->ctx, FI_RECV | FI_TAGGED, FI_EIO, 0, "the sender's data is gone");
    else if (m->len > rv->len)
      pm_cq_push_err(e->cq, rv->ctx, FI_RECV | FI_TAGGED, FI_ETRUNC, m->len - rv->len,
                     "message larger than the receive");
    else
      pm_cq_push(e->cq, &(struct fi_cq_tagged_entry){
                            .op_context = rv->ctx, .len = m->len, .buf = rv->buf, .tag = m->tag,
                            .flags = FI_RECV | FI_TAGGED | FI_MSG | (m->has_data ? FI_REMOTE_CQ_DATA : 0),
                            .data = m->has_data ? m->data : 0},
                 pm_av_find(e->av, m->src));
    ack(e, m, 0);
    pm_held_t *done = *u;
    *u = done->next;
    free(done), free(rv);
    work = 1;
  }
  return work;
}

/* FI_FENCE: an operation goes only once everything before it on its link
 * completed (none queued ahead of it, none performed and not completed:
 * all of them in the link's share). */
static int fence_holds(const pm_nic_share_t *s, const pm_op_t *op, int ahead) {
  if (!op->fence) return 0;
  if (ahead) return 1;
  for (const pm_op_t *w = s->waiting; w; w = w->next)
    if (w->dest == op->dest) return 1;
  for (const pm_op_t *w = s->acking; w; w = w->next)
    if (w->dest == op->dest) return 1;
  return 0;
}

static int take_posted(pm_ep_t *e, pm_nic_share_t *s, int n);

/* Thread tid's links (of n threads), its share s locked: each link's
 * operations whose time came, in order (or, reordering, any of them). */
static int links_pass(pm_ep_t *e, pm_nic_share_t *s, uint64_t now, int tid, int n) {
  int work = 0;
  for (size_t i = (size_t)tid; i < e->nlinks; i += (size_t)n) {
    pm_link_t *l = &e->links[i];
    if (pm_params()->reorder) { /* any operation whose time came, in no particular order */
      pm_op_t *prev = NULL;
      for (pm_op_t *op = l->head, *next; op; op = next) {
        next = op->next;
        /* arrived, and half of those each pass: a late NIC thread reorders too */
        if (op->arrive_ns > now || fence_holds(s, op, prev != NULL) ||
            ((s->rnd = s->rnd * 1103515245 + 12345) >> 16 & 1)) {
          prev = op;
          work |= op->arrive_ns <= now;
          continue;
        }
        if (prev) prev->next = next;
        else l->head = next;
        if (l->tail == op) l->tail = prev;
        if (perform(e, s, op, now)) { /* back where it was */
          op->next = next;
          if (prev) prev->next = op;
          else l->head = op;
          if (!next) l->tail = op;
          break;
        }
        work = 1;
      }
      continue;
    }
    while (l->head && l->head->arrive_ns <= now && !fence_holds(s, l->head, 0)) {
      pm_op_t *op = l->head;
      if (is_rma(op) && !op->written && !op->err) {
        /* it stays at the head (only this thread takes from there); posts
         * append behind it meanwhile */
        pthread_mutex_unlock(&s->lock);
        move_data(e, op);
        pthread_mutex_lock(&s->lock);
        l = &e->links[i]; /* a post to a new destination may have grown the array */
      }
      pm_op_t *next = op->next;
      if (perform(e, s, op, now)) break;
      l->head = next;
      if (!next) l->tail = NULL;
      work = 1;
    }
  }
  return work;
}

/* The thread's performed RMA operations whose acknowledgement came back. */
static int complete_waiting(pm_ep_t *e, pm_nic_share_t *s, uint64_t now) {
  int work = 0;
  while (s->waiting && s->waiting->done_ns <= now) {
    pm_op_t *op = s->waiting;
    if (!(s->waiting = op->next)) s->waiting_tail = NULL;
    complete(e, op, 0, NULL);
    leave(s);
    work = 1;
  }
  return work;
}

/* One pass of NIC thread `tid` of `n` over an endpoint: the posts to its
 * links and its share of the links; thread 0 also does the rest (messages,
 * atomics, ACKs, matching). Returns whether it found work. */
static int ep_pass(pm_ep_t *e, uint64_t now, int tid, int n) {
  pm_nic_share_t *s = &e->share[tid];
  int work = take_posted(e, s, n);
  if (atomic_load_explicit(&s->queued, memory_order_acquire)) {
    pthread_mutex_lock(&s->lock);
    work |= links_pass(e, s, now, tid, n);
    pthread_mutex_unlock(&s->lock);
    work |= complete_waiting(e, s, now);
  }
  if (tid) return work;
  pm_msg_t m;
  while (!pm_inbox_get(e->seg, &m)) {
    work = 1;
    if (m.type == PM_MSG_TSEND) hold(&e->unexp, &m, NULL);
    else if (m.type == PM_MSG_ATOMIC) on_atomic(e, &m);
    else if (m.type == PM_MSG_ACK) hold(&e->held, &m, NULL);
  }
  for (pm_held_t **h = &e->held; *h;) {
    pm_held_t *x = *h;
    if (x->to ? pm_inbox_put(x->to, &x->m) != 0 : x->m.not_before_ns > now) {
      h = &x->next;
      continue;
    }
    if (!x->to) on_ack(e, &x->m, n);
    *h = x->next;
    free(x);
    work = 1;
  }
  work |= match(e);
  return work;
}

static void *nic_main(void *arg) {
  int tid = (int)(intptr_t)arg, n = pm_params()->nic_threads;
  int idle = 0;
  char name[16]; /* per-thread CPU time in /proc/<pid>/task/<tid>/stat names it */
  snprintf(name, sizeof name, "model-nic%d", tid);
  pm_nic_tid = tid;
  (void)pthread_setname_np(pthread_self(), name);
  while (!atomic_load(&nic_stop)) {
    uint64_t now = pm_now_ns();
    int work = 0;
    pthread_rwlock_rdlock(&all_lock);
    for (pm_ep_t *e = all_eps; e; e = e->next_all) work |= ep_pass(e, now, tid, n);
    pthread_rwlock_unlock(&all_lock);
    idle = work ? 0 : idle + 1;
    if (idle > 2000) nanosleep(&(struct timespec){0, 20000}, NULL); /* nothing for a while */
    else if (idle > 50) sched_yield();
  }
  return NULL;
}

void pm_nic_stop(void) {
  pthread_rwlock_wrlock(&all_lock);
  int running = nic_running;
  nic_running = 0;
  pthread_rwlock_unlock(&all_lock);
  if (!running) return;
  atomic_store(&nic_stop, 1);
  for (int i = 0; i < running; i++) pthread_join(nic[i], NULL);
  atomic_store(&nic_stop, 0);
}

/* Makes the link array hold dest (any thread, holding no share's lock):
 * it grows holding every share's lock, since the threads read it under
 * theirs. 0, or -1 when out of memory. */
static int grow_links(pm_ep_t *e, fi_addr_t dest, int nthreads) {
  if (dest < __atomic_load_n(&e->nlinks, __ATOMIC_ACQUIRE)) return 0;
  for (int t = 0; t < nthreads; t++) pthread_mutex_lock(&e->share[t].lock);
  int rc = 0;
  if (dest >= e->nlinks) { /* another thread may have grown it meanwhile */
    size_t n = dest + 16;
    pm_link_t *l = realloc(e->links, n * sizeof *l);
    if (l) {
      memset(l + e->nlinks, 0, (n - e->nlinks) * sizeof *l);
      e->links = l;
      __atomic_store_n(&e->nlinks, n, __ATOMIC_RELEASE);
    } else {
      rc = -1;
    }
  }
  for (int t = nthreads - 1; t >= 0; t--) pthread_mutex_unlock(&e->share[t].lock);
  return rc;
}

/* Puts op on its link l as a NIC would (the link's share locked): it
 * starts when the link is free and it was posted (a fenced one also once
 * everything before it completed), holds the link for len / bandwidth and
 * arrives one latency later. */
static void to_link(pm_ep_t *e, pm_link_t *l, pm_op_t *op) {
  const pm_params_t *p = pm_params();
  uint64_t start = op->posted_ns > l->free_ns ? op->posted_ns : l->free_ns;
  if (op->fence && l->last_done_ns > start) start = l->last_done_ns;
  l->free_ns = start + (uint64_t)(op->len * p->ns_per_byte);
  op->arrive_ns = l->free_ns + p->latency_ns;
  /* A NIC that claims order and lies: every RMA operation falls 100 ms
   * behind what follows it, long enough for a target descheduled on a busy
   * host (2 cores, ASan, a parallel test run) to still see the overtaking
   * signal first: at 10 ms a loaded run once saw none in 64 batches. One
   * that says nothing: each operation its own path through the fabric, up
   * to a latency and 200 us more. */
  if (p->reorder && p->ordered)
    op->arrive_ns += is_rma(op) ? p->latency_ns + 100000000 : 0;
  else if (p->reorder)
    op->arrive_ns += (e->rnd = e->rnd * 1103515245 + 12345) % (p->latency_ns + 200000);
  if (op->arrive_ns + p->latency_ns > l->last_done_ns) l->last_done_ns = op->arrive_ns + p->latency_ns;
  op->next = NULL;
  if (l->tail) l->tail->next = op;
  else l->head = op;
  l->tail = op;
}

/* An operation for a new post of share s: from the endpoint's pool, which
 * the NIC threads refill as operations finish. */
static pm_op_t *new_op(pm_ep_t *e, pm_nic_share_t *s) {
  if (!s->cache) s->cache = atomic_exchange_explicit(&e->finished, NULL, memory_order_acquire);
  pm_op_t *op = s->cache;
  if (op) s->cache = op->next;
  else op = aligned_alloc(_Alignof(pm_op_t), sizeof *op);
  return op;
}

static uint64_t completion_flags(int type) {
  switch (type) {
    case OP_TSEND: return FI_SEND | FI_TAGGED | FI_MSG;
    case OP_WRITE: return FI_RMA | FI_WRITE;
    case OP_READ: return FI_RMA | FI_READ;
    default: return FI_ATOMIC | FI_WRITE;
  }
}

/* The operations posted to share s since its last pass go onto their
 * links, in order; the time they are taken stands for their posting time (a
 * NIC fetches a descriptor after its doorbell, not at it), read once a
 * pass, after the first descriptor was seen: no operation starts before it
 * was posted. */
static int take_posted(pm_ep_t *e, pm_nic_share_t *s, int n) {
  int any = 0;
  uint64_t now = 0;
  for (pm_sqe_t *q; (q = pm_ring_ready(s->sq, sizeof *s->sq, PM_SQ, s->sq_tail));) {
    if (!now) now = pm_now_ns();
    pm_op_t *op = new_op(e, s);
    if (!op) break; /* out of memory: the posts wait for a later pass */
    *op = (pm_op_t){.type = q->type, .ctx = q->ctx, .cflags = completion_flags(q->type), .buf = q->buf,
                    .len = q->len, .dest = q->dest, .key = q->key, .data = q->data, .fence = (char)q->fence,
                    .remote_cq = (char)q->remote_cq, .posted_ns = now};
    if (q->type == OP_TSEND) op->tag = q->a0;
    else op->raddr = q->a0;
    s->sq_tail++; /* the entry stays as it is: posters count what was taken (sq_taken) */
    any = 1;
    if (grow_links(e, op->dest, n)) {
      complete(e, op, FI_ENOMEM, "out of memory for a link");
      continue;
    }
    pthread_mutex_lock(&s->lock);
    to_link(e, &e->links[op->dest], op);
    atomic_fetch_add_explicit(&s->queued, 1, memory_order_release);
    pthread_mutex_unlock(&s->lock);
  }
  if (any) atomic_store_explicit(&s->sq_taken, s->sq_tail, memory_order_release);
  return any;
}

int pm_nic_add(pm_ep_t *e) {
  pthread_rwlock_wrlock(&all_lock);
  e->next_all = all_eps;
  all_eps = e;
  int want = pm_params()->nic_threads;
  while (nic_running < want &&
         !pthread_create(&nic[nic_running], NULL, nic_main, (void *)(intptr_t)nic_running))
    nic_running++;
  int ok = nic_running == want;
  pthread_rwlock_unlock(&all_lock);
  return ok ? 0 : -FI_EOTHER;
}

void pm_nic_remove(pm_ep_t *e) {
  pthread_rwlock_wrlock(&all_lock);
  for (pm_ep_t **p = &all_eps; *p; p = &(*p)->next_all)
    if (*p == e) {
      *p = e->next_all;
      break;
    }
  pthread_rwlock_unlock(&all_lock);
}
