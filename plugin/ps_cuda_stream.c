/* The staging streams of ps_cuda.h: operations are held, handed over in
 * runs (one batch call per kind), and each stream's own thread makes its
 * driver calls, so that a progress pass only queues them and the copies
 * into and out of the GPU are issued side by side. */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ps_clock.h"
#include "ps_cuda_int.h"
#include "ps_log.h"

static ncclResult_t stream_of(ps_cuda_dev_t *d, int s, const char *op, stream_t **out) {
  if (!d || s < 0 || s >= PS_CUDA_NSTREAMS) {
    PS_WARN("%s: bad device %p or stream %d", op, (void *)d, s);
    return ncclInvalidArgument;
  }
  *out = &d->s[s];
  return ncclSuccess;
}

/* --- held operations, handed to the driver in runs --- */

static void copy_attr(int kind, int ordinal, cu_copy_attr_t *a) {
  cu_location_t dev = {CU_MEM_LOCATION_TYPE_DEVICE, ordinal}, host = {CU_MEM_LOCATION_TYPE_HOST, 0};
  *a = (cu_copy_attr_t){.src_access_order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                        .src_hint = kind == HELD_D2H ? dev : host,
                        .dst_hint = kind == HELD_D2H ? host : dev};
}

/* Copies h[0..n) (one direction) in one driver call where it can batch. */
static CUresult hand_copies(ps_cuda_dev_t *d, stream_t *x, const held_t *h, uint32_t n) {
  if (n > 1 && (ps_cu.copy_batch_v2 || ps_cu.copy_batch_v1)) {
    CUdeviceptr dst[PS_CUDA_HELD], src[PS_CUDA_HELD];
    size_t len[PS_CUDA_HELD], first = 0, fail = 0;
    cu_copy_attr_t attr;
    copy_attr(h[0].kind, d->ordinal, &attr);
    for (uint32_t i = 0; i < n; i++) dst[i] = h[i].dst, src[i] = h[i].src, len[i] = h[i].n;
    return ps_cu.copy_batch_v2 ? ps_cu.copy_batch_v2(dst, src, len, n, &attr, &first, 1, x->st)
                            : ps_cu.copy_batch_v1(dst, src, len, n, &attr, &first, 1, &fail, x->st);
  }
  CUresult rc = CUDA_SUCCESS;
  for (uint32_t i = 0; i < n && rc == CUDA_SUCCESS; i++) rc = ps_cu.memcpy_async(h[i].dst, h[i].src, h[i].n, x->st);
  return rc;
}

/* Writes h[0..n), and mark number `mark` when not 0, in one call. */
static CUresult hand_writes(stream_t *x, const held_t *h, uint32_t n, uint64_t mark) {
  cu_memop_t op[PS_CUDA_HELD + 1];
  for (uint32_t i = 0; i < n; i++) {
    memset(&op[i], 0, sizeof op[i]);
    op[i].write_value.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op[i].write_value.address = h[i].dst;
    op[i].write_value.value64 = h[i].value;
    op[i].write_value.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  if (mark) {
    memset(&op[n], 0, sizeof op[n]);
    op[n].write_value.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op[n].write_value.address = x->reached_dev;
    op[n].write_value.value64 = mark;
    op[n].write_value.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  return ps_cu.batch_memop(x->st, n + (mark ? 1u : 0u), op, 0);
}

/* A stream's thread: job j's operations in runs of one kind (copies in one
 * batch call, writes and the mark in one memop call). */
static void run_job(ps_cuda_dev_t *d, stream_t *x, const job_t *j) {
  uint32_t i = 0;
  int mark = j->mark != 0;
  while (i < j->n || mark) {
    uint32_t k = i;
    while (k < j->n && j->op[k].kind == j->op[i].kind) k++;
    const char *what = "cuStreamBatchMemOp_v2";
    CUresult rc;
    if (i < j->n && j->op[i].kind != HELD_WRITE) {
      what = ps_cu.copy_batch_v2 || ps_cu.copy_batch_v1 ? "cuMemcpyBatchAsync" : "cuMemcpyAsync";
      rc = hand_copies(d, x, &j->op[i], k - i);
    } else {
      int marking = mark && k == j->n;
      rc = hand_writes(x, &j->op[i], k - i, marking ? j->mark : 0);
      if (marking) mark = 0;
    }
    if (rc != CUDA_SUCCESS) {
      PS_WARN("%s (GPU %d, stream %d, %u operations) failed: %s", what, d->ordinal, (int)(x - d->s),
              k - i, ps_cu_err(rc));
      __atomic_store_n(&x->failed, 1, __ATOMIC_RELEASE);
      return;
    }
    i = k;
  }
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static void account(job_stats_t *s, const job_t *j, uint64_t t0, uint64_t t1) {
  uint64_t wait = t0 > j->queued_ns ? t0 - j->queued_ns : 0, call = t1 - t0;
  s->jobs++, s->ops += j->n, s->wait_ns += wait, s->call_ns += call;
  if (wait > s->wait_max_ns) s->wait_max_ns = wait;
  if (call > s->call_max_ns) s->call_max_ns = call;
}

static int jobs_waiting(stream_t *x) {
  return __atomic_load_n(&x->jobs_head, __ATOMIC_RELAXED) != __atomic_load_n(&x->jobs_tail, __ATOMIC_SEQ_CST);
}

/* Spins a while after its last job (the engine hands work over every pass
 * while busy), then sleeps until woken. */
static void *submitter_main(void *arg) {
  stream_t *x = arg;
  ps_cuda_dev_t *d = x->dev;
  if (ps_cu.ctx_push(d->ctx) != CUDA_SUCCESS) {
    PS_WARN("GPU %d: the thread of staging stream %d cannot make its context current", d->ordinal,
            (int)(x - d->s));
    __atomic_store_n(&x->failed, 1, __ATOMIC_RELEASE);
  }
  for (unsigned idle = 0;;) {
    uint64_t head = __atomic_load_n(&x->jobs_head, __ATOMIC_RELAXED);
    if (head != __atomic_load_n(&x->jobs_tail, __ATOMIC_ACQUIRE)) {
      const job_t *j = &x->jobs[head % PS_CUDA_JOBS];
      uint64_t t0 = ps_now_ns();
      if (!__atomic_load_n(&x->failed, __ATOMIC_ACQUIRE)) run_job(d, x, j);
      account(&x->js, j, t0, ps_now_ns());
      __atomic_store_n(&x->jobs_head, head + 1, __ATOMIC_RELEASE);
      idle = 0;
      continue;
    }
    if (__atomic_load_n(&d->stop, __ATOMIC_ACQUIRE)) break;
    if (++idle < 20000) {
      cpu_relax();
      continue;
    }
    pthread_mutex_lock(&x->wake_lock);
    __atomic_store_n(&x->sleeping, 1, __ATOMIC_SEQ_CST);
    if (!jobs_waiting(x) && !__atomic_load_n(&d->stop, __ATOMIC_ACQUIRE)) {
      struct timespec t;
      clock_gettime(CLOCK_REALTIME, &t);
      t.tv_nsec += 10000000; /* a lost wake costs at most this */
      if (t.tv_nsec >= 1000000000) t.tv_sec++, t.tv_nsec -= 1000000000;
      pthread_cond_timedwait(&x->wake, &x->wake_lock, &t);
    }
    __atomic_store_n(&x->sleeping, 0, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&x->wake_lock);
    idle = 0;
  }
  CUcontext c;
  ps_cu.ctx_pop(&c);
  return NULL;
}

static void wake_submitter(stream_t *x) {
  pthread_mutex_lock(&x->wake_lock);
  pthread_cond_signal(&x->wake);
  pthread_mutex_unlock(&x->wake_lock);
}

#define PS_CUDA_HANDOVER_MAX_NS (30ULL * 1000000000ULL)

/* Queues stream x's held operations for its thread, with its next mark
 * when `mark` (and anything was queued since the last), and wakes the
 * thread where it sleeps. Waits while the queue is full. */
static ncclResult_t hand_over(stream_t *x, int mark) {
  mark = mark && (x->unmarked || x->nheld);
  if (!x->nheld && !mark) return ncclSuccess;
  if (__atomic_load_n(&x->failed, __ATOMIC_ACQUIRE)) {
    x->nheld = 0;
    return ncclUnhandledCudaError; /* the submitting thread logged why */
  }
  uint64_t tail = x->jobs_tail, since = 0;
  /* a full queue drains as the thread's driver calls return: one that
   * never returns (a wedged driver) fails the stream, not the caller's pass */
  while (tail - __atomic_load_n(&x->jobs_head, __ATOMIC_ACQUIRE) >= PS_CUDA_JOBS) {
    uint64_t now = ps_now_ns();
    if (!since) since = now;
    if (__atomic_load_n(&x->failed, __ATOMIC_ACQUIRE) || now - since > PS_CUDA_HANDOVER_MAX_NS) {
      if (!__atomic_exchange_n(&x->failed, 1, __ATOMIC_ACQ_REL))
        PS_WARN("a staging stream's thread took none of its %d queued jobs for %llu s: its driver "
                "call does not return; the stream fails", PS_CUDA_JOBS,
                (unsigned long long)(PS_CUDA_HANDOVER_MAX_NS / 1000000000ULL));
      x->nheld = 0;
      return ncclUnhandledCudaError;
    }
    sched_yield();
  }
  job_t *j = &x->jobs[tail % PS_CUDA_JOBS];
  j->n = x->nheld;
  memcpy(j->op, x->held, x->nheld * sizeof *x->held);
  j->mark = mark ? x->marks + 1 : 0;
  j->queued_ns = ps_now_ns();
  if (x->nheld) { /* the oldest held operation's wait for a hand-over */
    uint64_t held = j->queued_ns - x->first_held_ns;
    x->held_ns += held;
    if (held > x->held_max_ns) x->held_max_ns = held;
  }
  __atomic_store_n(&x->jobs_tail, tail + 1, __ATOMIC_SEQ_CST);
  if (x->nheld) x->unmarked = 1;
  if (mark) x->marks++, x->unmarked = 0;
  x->nheld = 0;
  if (__atomic_load_n(&x->sleeping, __ATOMIC_SEQ_CST)) wake_submitter(x);
  return ncclSuccess;
}

static int overlaps(CUdeviceptr a, size_t an, CUdeviceptr b, size_t bn) {
  return a < b + bn && b < a + an;
}

/* Holds op on stream s; hands the held ones over first where op could not
 * join them (another kind of copy, an overlap, no room). */
static ncclResult_t hold(ps_cuda_dev_t *d, int s, const held_t *op, const char *what,
                         uint64_t *ticket) {
  stream_t *x;
  PS_CHECK(stream_of(d, s, what, &x));
  if (!ticket) {
    PS_WARN("%s: NULL ticket", what);
    return ncclInvalidArgument;
  }
  int flush = x->nheld == PS_CUDA_HELD;
  if (op->kind != HELD_WRITE && x->nheld && x->held[x->nheld - 1].kind == op->kind) {
    for (uint32_t i = x->nheld; i-- > 0 && x->held[i].kind == op->kind && !flush;)
      flush = overlaps(op->dst, op->n, x->held[i].dst, x->held[i].n) ||
              overlaps(op->dst, op->n, x->held[i].src, x->held[i].n) ||
              overlaps(op->src, op->n, x->held[i].dst, x->held[i].n);
  }
  if (flush) PS_CHECK(hand_over(x, 0));
  held_t *last = x->nheld ? &x->held[x->nheld - 1] : NULL;
  if (last && op->kind != HELD_WRITE && last->kind == op->kind && last->src + last->n == op->src &&
      last->dst + last->n == op->dst) {
    last->n += op->n; /* the driver's cost is per copy: adjacent chunks go as one */
  } else {
    if (!x->nheld) x->first_held_ns = ps_now_ns();
    x->held[x->nheld++] = *op;
  }
  *ticket = x->marks + 1;
  return ncclSuccess;
}

ncclResult_t ps_cuda_d2h(ps_cuda_dev_t *d, int s, void *host_dst, const void *dev_src, size_t n,
                         uint64_t *ticket) {
  held_t op = {.kind = HELD_D2H, .dst = ps_cu_dptr(host_dst), .src = ps_cu_dptr(dev_src), .n = n};
  return hold(d, s, &op, "ps_cuda_d2h", ticket);
}

ncclResult_t ps_cuda_h2d(ps_cuda_dev_t *d, int s, void *dev_dst, const void *host_src, size_t n,
                         uint64_t *ticket) {
  held_t op = {.kind = HELD_H2D, .dst = ps_cu_dptr(dev_dst), .src = ps_cu_dptr(host_src), .n = n};
  return hold(d, s, &op, "ps_cuda_h2d", ticket);
}

ncclResult_t ps_cuda_write64(ps_cuda_dev_t *d, int s, void *dev_dst, uint64_t value,
                             uint64_t *ticket) {
  if ((uintptr_t)dev_dst % 8) {
    PS_WARN("ps_cuda_write64: %p is not 8-byte aligned", dev_dst);
    return ncclInvalidArgument;
  }
  held_t op = {.kind = HELD_WRITE, .dst = ps_cu_dptr(dev_dst), .value = value};
  return hold(d, s, &op, "ps_cuda_write64", ticket);
}

/* Every stream's held operations and its mark; lazy: only streams whose
 * thread has nothing queued (the rest go with a later pass, in one call). */
static ncclResult_t flush_streams(ps_cuda_dev_t *d, int lazy, const char *what) {
  if (!d) {
    PS_WARN("%s: NULL device", what);
    return ncclInvalidArgument;
  }
  ncclResult_t r = ncclSuccess;
  for (int s = 0; s < PS_CUDA_NSTREAMS && r == ncclSuccess; s++)
    if (!lazy || !jobs_waiting(&d->s[s])) r = hand_over(&d->s[s], 1);
  return r;
}

ncclResult_t ps_cuda_flush(ps_cuda_dev_t *d) { return flush_streams(d, 0, "ps_cuda_flush"); }

ncclResult_t ps_cuda_flush_lazy(ps_cuda_dev_t *d) { return flush_streams(d, 1, "ps_cuda_flush_lazy"); }

int ps_cuda_passed(ps_cuda_dev_t *d, int s, uint64_t ticket) {
  stream_t *x;
  if (stream_of(d, s, "ps_cuda_passed", &x) != ncclSuccess || __atomic_load_n(&x->failed, __ATOMIC_ACQUIRE))
    return -1;
  if (__atomic_load_n(x->reached, __ATOMIC_ACQUIRE) >= ticket) return 1;
  if (ticket > x->marks) return 0; /* its mark is not on the stream yet */
  uint64_t now = ps_now_ns();
  if (now < x->next_query_ns) return 0;
  x->next_query_ns = now + 1000000;
  if (ps_cu_ctx_push(d, "ps_cuda_passed") != ncclSuccess) return -1;
  CUresult rc = ps_cu.stream_query(x->st);
  ps_cu_ctx_pop("ps_cuda_passed");
  if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_NOT_READY) {
    PS_WARN("cuStreamQuery (GPU %d, stream %d) failed: %s", d->ordinal, s, ps_cu_err(rc));
    return -1;
  }
  return __atomic_load_n(x->reached, __ATOMIC_ACQUIRE) >= ticket;
}

uint64_t ps_cuda_last_mark(const ps_cuda_dev_t *d, int s) {
  return d && s >= 0 && s < PS_CUDA_NSTREAMS ? d->s[s].marks : 0;
}

/* Streams, the pinned words their marks land in (mapped for the GPU), and
 * a thread per stream for its driver calls. */
ncclResult_t ps_cuda_streams_start(ps_cuda_dev_t *d) {
  CUresult rc = ps_cu.mem_host_alloc((void **)&d->marks_mem, PS_CUDA_NSTREAMS * 64,
                                  CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
  if (rc != CUDA_SUCCESS) {
    PS_WARN("cuMemHostAlloc (GPU %d, mapped) failed: %s", d->ordinal, ps_cu_err(rc));
    d->marks_mem = NULL;
    return ncclUnhandledCudaError;
  }
  memset(d->marks_mem, 0, PS_CUDA_NSTREAMS * 64);
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
    stream_t *x = &d->s[s];
    x->reached = d->marks_mem + s * 8;
    if ((rc = ps_cu.host_get_device_pointer(&x->reached_dev, (void *)x->reached, 0)) != CUDA_SUCCESS) {
      PS_WARN("cuMemHostGetDevicePointer_v2 (GPU %d) failed: %s", d->ordinal, ps_cu_err(rc));
      return ncclUnhandledCudaError;
    }
    /* Non-blocking: legacy stream 0 work (NCCL's own or the user's) must
     * never hold up a staging copy. */
    if ((rc = ps_cu.stream_create(&x->st, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
      PS_WARN("cuStreamCreate (GPU %d) failed: %s", d->ordinal, ps_cu_err(rc));
      x->st = NULL;
      return ncclUnhandledCudaError;
    }
  }
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
    stream_t *x = &d->s[s];
    x->dev = d;
    pthread_mutex_init(&x->wake_lock, NULL);
    pthread_cond_init(&x->wake, NULL);
    if (!(x->jobs = calloc(PS_CUDA_JOBS, sizeof *x->jobs)) ||
        pthread_create(&x->submitter, NULL, submitter_main, x)) {
      PS_WARN("GPU %d: cannot start the thread that hands staging stream %d's copies to the driver",
              d->ordinal, s);
      return ncclSystemError;
    }
    x->started = 1;
    char name[16];
    snprintf(name, sizeof name, "perseus-cu%d.%d", d->ordinal % 100, s);
    (void)pthread_setname_np(x->submitter, name);
  }
  return ncclSuccess;
}

void ps_cuda_streams_stop(ps_cuda_dev_t *d) {
  static const char *const name[PS_CUDA_NSTREAMS] = {"copy", "read", "out"};
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) /* as the fake runs them */
    if (d->s[s].started && d->s[s].nheld) (void)hand_over(&d->s[s], 0);
  __atomic_store_n(&d->stop, 1, __ATOMIC_SEQ_CST); /* each ends once its queue is empty */
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
    stream_t *x = &d->s[s];
    if (x->started) {
      wake_submitter(x);
      pthread_join(x->submitter, NULL);
      x->started = 0;
    }
    if (x->jobs) {
      pthread_mutex_destroy(&x->wake_lock);
      pthread_cond_destroy(&x->wake);
    }
    free(x->jobs);
    x->jobs = NULL;
    const job_stats_t *js = &x->js;
    if (!js->jobs) continue;
    PS_INFO(NCCL_INIT, "GPU %d %s stream: %llu hand-overs of %.1f operations; the oldest held "
            "%.1f us (max %.0f) before its hand-over, which waited %.1f us (max %.0f) for the "
            "stream's thread; driver calls %.1f us (max %.0f) each", d->ordinal, name[s],
            (unsigned long long)js->jobs, (double)js->ops / (double)js->jobs,
            (double)x->held_ns / 1e3 / (double)js->jobs, (double)x->held_max_ns / 1e3,
            (double)js->wait_ns / 1e3 / (double)js->jobs, (double)js->wait_max_ns / 1e3,
            (double)js->call_ns / 1e3 / (double)js->jobs, (double)js->call_max_ns / 1e3);
  }
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
    if (!d->s[s].st) continue;
    CUresult rc = ps_cu.stream_synchronize(d->s[s].st);
    if (rc != CUDA_SUCCESS) PS_WARN("cuStreamSynchronize (GPU %d) failed: %s", d->ordinal, ps_cu_err(rc));
    rc = ps_cu.stream_destroy(d->s[s].st);
    if (rc != CUDA_SUCCESS) PS_WARN("cuStreamDestroy_v2 (GPU %d) failed: %s", d->ordinal, ps_cu_err(rc));
  }
  if (d->marks_mem) {
    CUresult rc = ps_cu.mem_free_host(d->marks_mem);
    if (rc != CUDA_SUCCESS) PS_WARN("cuMemFreeHost (GPU %d) failed: %s", d->ordinal, ps_cu_err(rc));
  }
}
