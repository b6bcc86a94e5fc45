/* Test-only ps_cuda.h (built with -DPS_FAKE_CUDA, never shipped): "device
 * memory" is host memory and each stream is a worker thread that runs its
 * operations strictly in order, each after a random delay of up to
 * PS_FAKE_CUDA_MAX_DELAY_US (default 500) microseconds. A caller that uses a
 * copy's bytes before the event recorded after it says done sees stale data
 * most of the time instead of almost never. */
#ifndef PS_FAKE_CUDA
#error "ps_cuda_fake.c is the test build's CUDA; compile it with -DPS_FAKE_CUDA"
#endif

#ifndef _GNU_SOURCE /* meson passes it; a bare -std=c11 compile needs POSIX */
#define _POSIX_C_SOURCE 200809L
#endif
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ps_cuda.h"
#include "ps_log.h"

#define PS_FAKE_DEFAULT_DELAY_US 500ul
#define PS_FAKE_MAX_DELAY_US 10000000ul /* 10 s: beyond that it is a typo */

enum { OP_COPY, OP_WRITE64, OP_EVENT };

typedef struct ps_fake_op {
  struct ps_fake_op *next;
  int kind;
  void *dst;
  const void *src;
  size_t n;
  uint64_t value; /* OP_WRITE64's value, OP_EVENT's record generation */
  ps_cuda_event_t *ev;
} ps_fake_op_t;

typedef struct {
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  ps_fake_op_t *head, *tail; /* head stays queued while it runs */
  int stop;
  uint64_t rng;
  unsigned long max_delay_us;
} ps_fake_stream_t;

/* Records are numbered so a release and re-record while an older record is
 * still queued cannot be marked done by that older one. */
struct ps_cuda_event {
  struct ps_cuda_event *next, *all_next;
  uint64_t gen;      /* latest record; caller side only */
  uint64_t done_gen; /* highest record its stream has reached (atomic) */
};

struct ps_cuda_dev {
  ps_fake_stream_t s[PS_CUDA_NSTREAMS];
  int started; /* worker threads running */
  pthread_mutex_t lock; /* the event pool */
  ps_cuda_event_t *free_ev, *all_ev;
};

int ps_cuda_available(void) { return 1; }

static uint64_t rng_next(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

static void fake_delay(ps_fake_stream_t *st) {
  if (!st->max_delay_us) return;
  unsigned long us = (unsigned long)(rng_next(&st->rng) % (st->max_delay_us + 1));
  struct timespec ts = {.tv_sec = (time_t)(us / 1000000), .tv_nsec = (long)(us % 1000000) * 1000};
  while (nanosleep(&ts, &ts) && errno == EINTR) {
  }
}

static void run_op(const ps_fake_op_t *op) {
  switch (op->kind) {
  case OP_COPY:
    memcpy(op->dst, op->src, op->n);
    break;
  case OP_WRITE64:
    /* release: the bytes of every earlier copy are visible before the value */
    __atomic_store_n((uint64_t *)op->dst, op->value, __ATOMIC_RELEASE);
    break;
  case OP_EVENT: {
    uint64_t cur = __atomic_load_n(&op->ev->done_gen, __ATOMIC_RELAXED);
    while (cur < op->value && !__atomic_compare_exchange_n(&op->ev->done_gen, &cur, op->value, 0,
                                                           __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
    }
    break;
  }
  }
}

/* Runs the queue in order until close asks it to stop and it is empty. */
static void *stream_main(void *arg) {
  ps_fake_stream_t *st = arg;
  pthread_mutex_lock(&st->lock);
  for (;;) {
    while (!st->head && !st->stop) pthread_cond_wait(&st->cond, &st->lock);
    ps_fake_op_t *op = st->head;
    if (!op) break;
    pthread_mutex_unlock(&st->lock);
    fake_delay(st);
    run_op(op);
    pthread_mutex_lock(&st->lock);
    st->head = op->next;
    if (!st->head) st->tail = NULL;
    free(op);
  }
  pthread_mutex_unlock(&st->lock);
  return NULL;
}

static unsigned long delay_from_env(void) {
  const char *v = getenv("PS_FAKE_CUDA_MAX_DELAY_US");
  if (!v || !*v) return PS_FAKE_DEFAULT_DELAY_US;
  char *end = NULL;
  errno = 0;
  unsigned long us = strtoul(v, &end, 10);
  if (errno || *end || v[0] == '-' || us > PS_FAKE_MAX_DELAY_US) {
    PS_WARN("PS_FAKE_CUDA_MAX_DELAY_US=%s is not 0..%lu; using %lu", v, PS_FAKE_MAX_DELAY_US,
            PS_FAKE_DEFAULT_DELAY_US);
    return PS_FAKE_DEFAULT_DELAY_US;
  }
  return us;
}

static void stream_stop(ps_fake_stream_t *st) {
  pthread_mutex_lock(&st->lock);
  st->stop = 1;
  pthread_cond_signal(&st->cond);
  pthread_mutex_unlock(&st->lock);
  pthread_join(st->thread, NULL);
}

static void dev_free(ps_cuda_dev_t *d) {
  for (int i = 0; i < PS_CUDA_NSTREAMS; i++) {
    pthread_cond_destroy(&d->s[i].cond);
    pthread_mutex_destroy(&d->s[i].lock);
  }
  for (ps_cuda_event_t *e = d->all_ev, *n; e; e = n) {
    n = e->all_next;
    free(e);
  }
  pthread_mutex_destroy(&d->lock);
  free(d);
}

ncclResult_t ps_cuda_open(const void *dev_ptr, ps_cuda_dev_t **out) {
  if (!out || !dev_ptr) {
    PS_WARN("ps_cuda_open: NULL %s", out ? "device pointer" : "out");
    return ncclInvalidArgument;
  }
  *out = NULL;
  ps_cuda_dev_t *d = calloc(1, sizeof *d);
  if (!d) {
    PS_WARN("ps_cuda_open (fake): out of memory");
    return ncclSystemError;
  }
  unsigned long max_us = delay_from_env();
  pthread_mutex_init(&d->lock, NULL);
  for (int i = 0; i < PS_CUDA_NSTREAMS; i++) {
    ps_fake_stream_t *st = &d->s[i];
    pthread_mutex_init(&st->lock, NULL);
    pthread_cond_init(&st->cond, NULL);
    st->max_delay_us = max_us;
    st->rng = ((uint64_t)getpid() * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)(i + 1) * 0xBF58476D1CE4E5B9ull);
    if (!st->rng) st->rng = 1; /* xorshift's one stuck state */
  }
  for (int i = 0; i < PS_CUDA_NSTREAMS; i++) {
    int e = pthread_create(&d->s[i].thread, NULL, stream_main, &d->s[i]);
    if (e) {
      PS_WARN("ps_cuda_open (fake): pthread_create failed: %s", strerror(e));
      for (int j = 0; j < i; j++) stream_stop(&d->s[j]);
      dev_free(d);
      return ncclSystemError;
    }
  }
  d->started = 1;
  PS_INFO(NCCL_INIT, "fake CUDA: streams delay each operation by 0..%lu us", max_us);
  *out = d;
  return ncclSuccess;
}

void ps_cuda_close(ps_cuda_dev_t *d) {
  if (!d) return;
  /* The workers finish everything queued before they exit. */
  if (d->started)
    for (int i = 0; i < PS_CUDA_NSTREAMS; i++) stream_stop(&d->s[i]);
  dev_free(d);
}

int ps_cuda_ordinal(const ps_cuda_dev_t *d) { return d ? 0 : -1; }

int ps_cuda_owns(ps_cuda_dev_t *d, const void *ptr, size_t size) {
  (void)size;
  return d && ptr;
}

ncclResult_t ps_cuda_host_alloc(ps_cuda_dev_t *d, size_t size, void **out) {
  if (!d || !out || !size) {
    PS_WARN("ps_cuda_host_alloc: bad arguments (device %p, %zu bytes)", (void *)d, size);
    return ncclInvalidArgument;
  }
  *out = NULL;
  void *p = NULL;
  int e = posix_memalign(&p, 64, size);
  if (e) {
    PS_WARN("ps_cuda_host_alloc (fake) of %zu bytes failed: %s", size, strerror(e));
    return ncclSystemError;
  }
  memset(p, 0, size);
  *out = p;
  return ncclSuccess;
}

void ps_cuda_host_free(ps_cuda_dev_t *d, void *p) {
  (void)d;
  free(p);
}

static ncclResult_t enqueue(ps_cuda_dev_t *d, int s, const char *what, const ps_fake_op_t *tmpl) {
  if (!d || s < 0 || s >= PS_CUDA_NSTREAMS) {
    PS_WARN("%s: bad device %p or stream %d", what, (void *)d, s);
    return ncclInvalidArgument;
  }
  ps_fake_op_t *op = malloc(sizeof *op);
  if (!op) {
    PS_WARN("%s (fake): out of memory", what);
    return ncclSystemError;
  }
  *op = *tmpl;
  op->next = NULL;
  ps_fake_stream_t *st = &d->s[s];
  pthread_mutex_lock(&st->lock);
  if (st->tail) st->tail->next = op;
  else st->head = op;
  st->tail = op;
  pthread_cond_signal(&st->cond);
  pthread_mutex_unlock(&st->lock);
  return ncclSuccess;
}

ncclResult_t ps_cuda_d2h(ps_cuda_dev_t *d, int s, void *host_dst, const void *dev_src, size_t n) {
  ps_fake_op_t op = {.kind = OP_COPY, .dst = host_dst, .src = dev_src, .n = n};
  return enqueue(d, s, "ps_cuda_d2h", &op);
}

ncclResult_t ps_cuda_h2d(ps_cuda_dev_t *d, int s, void *dev_dst, const void *host_src, size_t n) {
  ps_fake_op_t op = {.kind = OP_COPY, .dst = dev_dst, .src = host_src, .n = n};
  return enqueue(d, s, "ps_cuda_h2d", &op);
}

ncclResult_t ps_cuda_write64(ps_cuda_dev_t *d, int s, void *dev_dst, uint64_t value) {
  if ((uintptr_t)dev_dst % 8) {
    PS_WARN("ps_cuda_write64: %p is not 8-byte aligned", dev_dst);
    return ncclInvalidArgument;
  }
  ps_fake_op_t op = {.kind = OP_WRITE64, .dst = dev_dst, .value = value};
  return enqueue(d, s, "ps_cuda_write64", &op);
}

void ps_cuda_event_release(ps_cuda_dev_t *d, ps_cuda_event_t *ev) {
  if (!d || !ev) return;
  pthread_mutex_lock(&d->lock);
  ev->next = d->free_ev;
  d->free_ev = ev;
  pthread_mutex_unlock(&d->lock);
}

ncclResult_t ps_cuda_event_record(ps_cuda_dev_t *d, int s, ps_cuda_event_t **out) {
  if (!d || !out) {
    PS_WARN("ps_cuda_event_record: NULL %s", d ? "out" : "device");
    return ncclInvalidArgument;
  }
  *out = NULL;
  pthread_mutex_lock(&d->lock);
  ps_cuda_event_t *e = d->free_ev;
  if (e) d->free_ev = e->next;
  pthread_mutex_unlock(&d->lock);
  if (!e) {
    if (!(e = calloc(1, sizeof *e))) {
      PS_WARN("ps_cuda_event_record (fake): out of memory");
      return ncclSystemError;
    }
    pthread_mutex_lock(&d->lock);
    e->all_next = d->all_ev;
    d->all_ev = e;
    pthread_mutex_unlock(&d->lock);
  }
  ps_fake_op_t op = {.kind = OP_EVENT, .ev = e, .value = e->gen + 1};
  ncclResult_t r = enqueue(d, s, "ps_cuda_event_record", &op);
  if (r != ncclSuccess) {
    ps_cuda_event_release(d, e);
    return r;
  }
  e->gen++;
  *out = e;
  return ncclSuccess;
}

int ps_cuda_event_done(ps_cuda_dev_t *d, ps_cuda_event_t *ev) {
  if (!d || !ev) {
    PS_WARN("ps_cuda_event_done: NULL %s", d ? "event" : "device");
    return -1;
  }
  /* acquire: pairs with the worker's release, so the bytes are visible */
  return __atomic_load_n(&ev->done_gen, __ATOMIC_ACQUIRE) >= ev->gen;
}
