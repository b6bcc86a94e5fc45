/* Extra endpoints of a striped two-sided comm and their threads (ps_stripe.h). */
#include "ps_stripe.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ps_log.h"

typedef struct {
  ps_op_t *op;
  void *buf, *desc;
  size_t len;
  uint64_t tag;
  int is_send;
} job_t;

typedef struct {
  ps_stripe_t *owner;
  ps_ep_t ep;
  int opened;
  fi_addr_t peer;
  pthread_t thread;
  int started;
  pthread_mutex_t lock;
  pthread_cond_t wake;
  job_t *ring; /* jobs queued by the comm's caller, posted by the thread */
  unsigned head, count, cap;
} stream_t;

struct ps_stripe {
  int n;
  int stop; /* atomic */
  ps_first_error_t failed; /* a thread's, for the comm's caller */
  stream_t s[PS_MAX_STREAMS - 1];
};

const char *ps_stripe_unset_note(void) {
  return ps_fabric_config()->nstreams < 1 ? " unset: this provider's default on this host" : "";
}

int ps_stripe_wanted(const ps_device_t *d) {
  int64_t want = ps_fabric_config()->nstreams;
  if (want < 1) {
    const char *prov = d->info && d->info->fabric_attr ? d->info->fabric_attr->prov_name : NULL;
    want = ps_stripe_default(prov, sysconf(_SC_NPROCESSORS_ONLN));
  }
  int n = (int)want - 1;
  static int told;
  const char *why = !n ? NULL
                    : d->mr_endpoint ? "its memory registrations are bound to one endpoint"
                    : d->cq_data_size < 8 ? "it carries less than 8 bytes of remote CQ data"
                                          : NULL;
  if (!why) return n;
  if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
    PS_INFO(NCCL_INIT | NCCL_NET, "PERSEUS_NSTREAMS=%d: %s cannot stripe (%s); one endpoint per comm",
            n + 1, d->name, why);
  return 0;
}

/* Posts a job; 1 posted, 0 refused for now (-FI_EAGAIN), -1 failed (the
 * op's callback has run). */
static int post(stream_t *st, const job_t *j) {
  int posted = 0;
  ncclResult_t rc = j->is_send ? ps_ep_tsend(&st->ep, j->buf, j->len, j->desc, st->peer, j->tag,
                                             j->op, &posted)
                               : ps_ep_trecv(&st->ep, j->buf, j->len, j->desc, j->tag, j->op, &posted);
  if (rc == ncclSuccess) return posted;
  ps_first_error(&st->owner->failed, "posting a part of a striped message failed");
  j->op->cb(j->op, NULL, -FI_EIO, "posting a part of a striped message failed");
  return -1;
}

/* Posts queued jobs in order until the provider refuses one; returns how
 * many were posted. */
static unsigned drain_queue(stream_t *st) {
  unsigned n = 0;
  for (;;) {
    pthread_mutex_lock(&st->lock);
    job_t j = st->count ? st->ring[st->head] : (job_t){0};
    int have = st->count > 0;
    pthread_mutex_unlock(&st->lock);
    if (!have) return n;
    int r = post(st, &j);
    if (r == 0) return n; /* stays queued: retried after progress */
    pthread_mutex_lock(&st->lock);
    st->head = (st->head + 1) % st->cap, st->count--;
    pthread_mutex_unlock(&st->lock);
    n += r > 0;
  }
}

/* Polls without a completion before a polling thread naps. */
#define PS_STRIPE_SPINS 256
#define PS_STRIPE_NAP_NS 20000

/* While parts are posted the thread polls (the NCCL proxy thread does the
 * same), napping once a peer keeps it waiting, so that a slow peer does not
 * cost a core per endpoint; idle, it sleeps until a part is queued. */
static void *stream_main(void *arg) {
  stream_t *st = arg;
  ps_stripe_t *s = st->owner;
  uint64_t posted = 0, done = 0;
  unsigned empty = 0;
  while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
    unsigned queued = drain_queue(st);
    posted += queued;
    int handled = 0;
    if (ps_ep_progress(&st->ep, 64, &handled) != ncclSuccess) {
      ps_first_error(&s->failed, "%s", st->ep.fatal);
      break;
    }
    done += (uint64_t)handled;
    empty = handled || queued ? 0 : empty + 1;
    if (posted > done) {
      struct timespec nap = {0, PS_STRIPE_NAP_NS};
      if (empty > PS_STRIPE_SPINS) nanosleep(&nap, NULL);
      else if (empty) sched_yield();
      continue;
    }
    pthread_mutex_lock(&st->lock);
    if (!st->count && !__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
      struct timespec t;
      clock_gettime(CLOCK_REALTIME, &t);
      t.tv_nsec += 1000000; /* and a pass now and then for a provider's own housekeeping */
      if (t.tv_nsec >= 1000000000) t.tv_sec++, t.tv_nsec -= 1000000000;
      pthread_cond_timedwait(&st->wake, &st->lock, &t);
    }
    pthread_mutex_unlock(&st->lock);
  }
  return NULL;
}

static void stream_close(stream_t *st) {
  if (st->started) {
    pthread_mutex_lock(&st->lock);
    pthread_cond_signal(&st->wake);
    pthread_mutex_unlock(&st->lock);
    pthread_join(st->thread, NULL);
    st->started = 0;
  }
  if (st->opened) ps_ep_close(&st->ep);
  st->opened = 0;
  pthread_mutex_destroy(&st->lock);
  pthread_cond_destroy(&st->wake);
  free(st->ring);
  st->ring = NULL;
}

void ps_stripe_close(ps_stripe_t *s) {
  if (!s) return;
  __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
  for (int i = 0; i < s->n; i++) stream_close(&s->s[i]);
  free(s);
}

ncclResult_t ps_stripe_open(ps_device_t *d, int n, int jobs, ps_stripe_t **out) {
  *out = NULL;
  if (n < 1 || n > PS_MAX_STREAMS - 1 || jobs < 1) return ncclInternalError;
  ps_stripe_t *s = calloc(1, sizeof *s);
  if (!s) {
    PS_WARN("striping: out of memory");
    return ncclSystemError;
  }
  ncclResult_t rc = ncclSuccess;
  for (; s->n < n && rc == ncclSuccess; s->n++) {
    stream_t *st = &s->s[s->n];
    st->owner = s, st->cap = (unsigned)jobs;
    pthread_mutex_init(&st->lock, NULL);
    pthread_cond_init(&st->wake, NULL);
    st->ring = calloc(st->cap, sizeof *st->ring);
    rc = st->ring ? ps_ep_open(d, (int)ps_fabric_config()->eagain_retries, &st->ep) : ncclSystemError;
    st->opened = rc == ncclSuccess;
    if (rc == ncclSuccess && st->ep.addrlen > PS_STREAM_ADDR_MAX) {
      PS_INFO(NCCL_INIT | NCCL_NET, "striping: %s addresses take %zu bytes (at most %d fit a "
              "control message); one endpoint per comm", d->name, st->ep.addrlen, PS_STREAM_ADDR_MAX);
      rc = ncclInvalidUsage;
    }
  }
  if (rc != ncclSuccess) {
    ps_stripe_close(s);
    return rc == ncclInvalidUsage ? ncclSuccess : rc; /* too long an address: just no striping */
  }
  *out = s;
  return ncclSuccess;
}

void ps_stripe_addrs(const ps_stripe_t *s, ps_ctrl_msg_t *m) {
  m->nstreams = (uint8_t)ps_stripe_count(s);
  m->stream_addrlen = m->nstreams ? (uint8_t)s->s[0].ep.addrlen : 0;
  for (int i = 0; i < m->nstreams; i++) memcpy(m->stream_addr[i], s->s[i].ep.addr, s->s[i].ep.addrlen);
}

ncclResult_t ps_stripe_connect(ps_stripe_t *s, const ps_ctrl_msg_t *m, int n) {
  if (n > s->n || n > m->nstreams) {
    PS_WARN("striping: the peer names %u extra endpoints, %d expected (we have %d)", m->nstreams, n,
            s->n);
    return ncclRemoteError;
  }
  while (s->n > n) stream_close(&s->s[--s->n]);
  for (int i = 0; i < n; i++) {
    stream_t *st = &s->s[i];
    PS_CHECK(ps_ep_insert_len(&st->ep, m->stream_addr[i], m->stream_addrlen, &st->peer));
    int e = pthread_create(&st->thread, NULL, stream_main, st);
    if (e) {
      PS_WARN("striping: pthread_create failed: %s", strerror(e));
      return ncclSystemError;
    }
    st->started = 1;
  }
  if (n)
    PS_INFO(NCCL_INIT | NCCL_NET, "comm striped over %d endpoints (PERSEUS_NSTREAMS%s), messages of "
            "PERSEUS_STRIPE_MIN=%lld bytes and up", n + 1,
            ps_stripe_unset_note(),
            (long long)ps_fabric_config()->stripe_min);
  return ncclSuccess;
}

int ps_stripe_count(const ps_stripe_t *s) { return s ? s->n : 0; }

ncclResult_t ps_stripe_post(ps_stripe_t *s, int stream, int is_send, void *buf, size_t len,
                            void *desc, uint64_t tag, ps_op_t *op) {
  if (!s || stream < 1 || stream > s->n) return ncclInternalError;
  stream_t *st = &s->s[stream - 1];
  pthread_mutex_lock(&st->lock);
  int full = st->count == st->cap;
  if (!full) {
    st->ring[(st->head + st->count) % st->cap] =
        (job_t){.op = op, .buf = buf, .desc = desc, .len = len, .tag = tag, .is_send = is_send};
    st->count++;
    pthread_cond_signal(&st->wake);
  }
  pthread_mutex_unlock(&st->lock);
  if (full) {
    PS_WARN("striping: %u parts already queued on endpoint %d", st->cap, stream);
    return ncclInternalError;
  }
  return ncclSuccess;
}

const char *ps_stripe_failed(ps_stripe_t *s) {
  return s ? ps_first_error_get(&s->failed) : NULL;
}
