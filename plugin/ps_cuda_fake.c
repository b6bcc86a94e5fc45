/* Test-only ps_cuda.h (built with -DPS_FAKE_CUDA, never shipped): "device
 * memory" is host memory and each stream is a worker thread that runs its
 * operations strictly in order, each after a random delay of
 * PS_FAKE_CUDA_MIN_DELAY_US (default 0) to PS_FAKE_CUDA_MAX_DELAY_US
 * (default 500) microseconds. A caller that uses a
 * copy's bytes before the mark after it was reached sees stale data most of
 * the time instead of almost never. Operations go to the worker at once
 * (nothing is held), but a mark only at ps_cuda_flush, as on a GPU. */
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
#include "ps_fake_dmabuf.h"
#include "ps_log.h"

#define PS_FAKE_DEFAULT_DELAY_US 500ul
#define PS_FAKE_MAX_DELAY_US 10000000ul /* 10 s: beyond that it is a typo */

enum { OP_COPY, OP_WRITE64, OP_MARK };

typedef struct ps_fake_op {
  struct ps_fake_op *next;
  int kind;
  void *dst;
  const void *src;
  size_t n;
  uint64_t value; /* OP_WRITE64's value, OP_MARK's number */
} ps_fake_op_t;

typedef struct {
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  ps_fake_op_t *head, *tail; /* head stays queued while it runs */
  int stop;
  uint64_t rng;
  unsigned long min_delay_us, max_delay_us;
  uint64_t reached;  /* the last mark the worker ran (atomic) */
  uint64_t marks;    /* caller side: marks enqueued */
  int unmarked;      /* caller side: operations since the last mark */
} ps_fake_stream_t;

struct ps_cuda_dev {
  ps_fake_stream_t s[PS_CUDA_NSTREAMS];
  int started; /* worker threads running */
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
  unsigned long span = st->max_delay_us - st->min_delay_us;
  unsigned long us = st->min_delay_us + (unsigned long)(rng_next(&st->rng) % (span + 1));
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
  case OP_MARK: /* release: every earlier operation's bytes are visible first */
    __atomic_store_n((uint64_t *)op->dst, op->value, __ATOMIC_RELEASE);
    break;
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

static unsigned long delay_from_env(const char *name, unsigned long dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end = NULL;
  errno = 0;
  unsigned long us = strtoul(v, &end, 10);
  if (errno || *end || v[0] < '0' || v[0] > '9' || us > PS_FAKE_MAX_DELAY_US) { /* digits only */
    PS_WARN("%s=%s is not 0..%lu; using %lu", name, v, PS_FAKE_MAX_DELAY_US, dflt);
    return dflt;
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
  unsigned long max_us = delay_from_env("PS_FAKE_CUDA_MAX_DELAY_US", PS_FAKE_DEFAULT_DELAY_US);
  unsigned long min_us = delay_from_env("PS_FAKE_CUDA_MIN_DELAY_US", 0);
  if (min_us > max_us) {
    PS_WARN("PS_FAKE_CUDA_MIN_DELAY_US=%lu is above PS_FAKE_CUDA_MAX_DELAY_US=%lu; using %lu", min_us,
            max_us, max_us);
    min_us = max_us;
  }
  for (int i = 0; i < PS_CUDA_NSTREAMS; i++) {
    ps_fake_stream_t *st = &d->s[i];
    pthread_mutex_init(&st->lock, NULL);
    pthread_cond_init(&st->cond, NULL);
    st->max_delay_us = max_us, st->min_delay_us = min_us;
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
  PS_INFO(NCCL_INIT, "fake CUDA: streams delay each operation by %lu..%lu us", min_us, max_us);
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

ncclResult_t ps_cuda_bind_thread(ps_cuda_dev_t *d) { return d ? ncclSuccess : ncclInvalidArgument; }

/* Every pointer is "device memory" of GPU 0 here, as ps_cuda_open takes any. */
int ps_cuda_ptr_ordinal(const void *ptr) { return ptr ? 0 : -1; }

ncclResult_t ps_cuda_probe_alloc(size_t size, int *ordinal, void **out) {
  *out = size ? calloc(1, size) : NULL;
  *ordinal = *out ? 0 : -1;
  return *out ? ncclSuccess : ncclSystemError;
}

void ps_cuda_probe_free(int ordinal, void *p) {
  (void)ordinal;
  free(p);
}

int ps_cuda_compute_major(int ordinal) { return ordinal >= 0 ? 9 : -1; }

/* Page-widened as the driver's (ps_fake_dmabuf_export). */
ncclResult_t ps_cuda_dmabuf_export(int ordinal, const void *ptr, size_t size, int *fd,
                                   uint64_t *offset) {
  (void)ordinal;
  *offset = 0;
  *fd = ptr && size ? ps_fake_dmabuf_export(ptr, size, offset) : -1;
  if (*fd < 0) PS_INFO(NCCL_INIT | NCCL_NET, "fake dma-buf for %p (%zu B) failed", ptr, size);
  return *fd < 0 ? ncclSystemError : ncclSuccess;
}

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

static ncclResult_t enqueue_op(ps_cuda_dev_t *d, int s, const char *what, const ps_fake_op_t *tmpl,
                               uint64_t *ticket) {
  if (!ticket) {
    PS_WARN("%s: NULL ticket", what);
    return ncclInvalidArgument;
  }
  PS_CHECK(enqueue(d, s, what, tmpl));
  d->s[s].unmarked = 1;
  *ticket = d->s[s].marks + 1;
  return ncclSuccess;
}

ncclResult_t ps_cuda_d2h(ps_cuda_dev_t *d, int s, void *host_dst, const void *dev_src, size_t n,
                         uint64_t *ticket) {
  ps_fake_op_t op = {.kind = OP_COPY, .dst = host_dst, .src = dev_src, .n = n};
  return enqueue_op(d, s, "ps_cuda_d2h", &op, ticket);
}

ncclResult_t ps_cuda_h2d(ps_cuda_dev_t *d, int s, void *dev_dst, const void *host_src, size_t n,
                         uint64_t *ticket) {
  ps_fake_op_t op = {.kind = OP_COPY, .dst = dev_dst, .src = host_src, .n = n};
  return enqueue_op(d, s, "ps_cuda_h2d", &op, ticket);
}

ncclResult_t ps_cuda_write64(ps_cuda_dev_t *d, int s, void *dev_dst, uint64_t value,
                             uint64_t *ticket) {
  if ((uintptr_t)dev_dst % 8) {
    PS_WARN("ps_cuda_write64: %p is not 8-byte aligned", dev_dst);
    return ncclInvalidArgument;
  }
  ps_fake_op_t op = {.kind = OP_WRITE64, .dst = dev_dst, .value = value};
  return enqueue_op(d, s, "ps_cuda_write64", &op, ticket);
}

/* The fake's streams take every operation at once: nothing to wait for. */
ncclResult_t ps_cuda_flush_lazy(ps_cuda_dev_t *d) { return ps_cuda_flush(d); }

ncclResult_t ps_cuda_flush(ps_cuda_dev_t *d) {
  if (!d) {
    PS_WARN("ps_cuda_flush: NULL device");
    return ncclInvalidArgument;
  }
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
    ps_fake_stream_t *st = &d->s[s];
    if (!st->unmarked) continue;
    ps_fake_op_t op = {.kind = OP_MARK, .dst = &st->reached, .value = st->marks + 1};
    PS_CHECK(enqueue(d, s, "ps_cuda_flush", &op));
    st->marks++;
    st->unmarked = 0;
  }
  return ncclSuccess;
}

int ps_cuda_passed(ps_cuda_dev_t *d, int s, uint64_t ticket) {
  if (!d || s < 0 || s >= PS_CUDA_NSTREAMS) {
    PS_WARN("ps_cuda_passed: bad device %p or stream %d", (void *)d, s);
    return -1;
  }
  /* acquire: pairs with the worker's release, so the bytes are visible */
  return __atomic_load_n(&d->s[s].reached, __ATOMIC_ACQUIRE) >= ticket;
}

uint64_t ps_cuda_last_mark(const ps_cuda_dev_t *d, int s) {
  return d && s >= 0 && s < PS_CUDA_NSTREAMS ? d->s[s].marks : 0;
}
