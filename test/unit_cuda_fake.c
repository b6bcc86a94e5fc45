/* ps_cuda_fake.c, the test build's CUDA: each stream runs its operations in
 * enqueue order however late, an event is done only once everything before
 * it ran, and close finishes every queued operation. */
#ifndef _GNU_SOURCE /* meson passes it; a bare -std=c11 compile needs POSIX */
#define _POSIX_C_SOURCE 200809L
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ps_cuda.h"
#include "unit_check.h"

static void sleep_us(long us) {
  struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* Polls for up to 30 s; returns event_done's last answer. */
static int wait_done(ps_cuda_dev_t *d, ps_cuda_event_t *ev) {
  int r = 0;
  for (long waited = 0; waited < 30000000 && (r = ps_cuda_event_done(d, ev)) == 0; waited += 100)
    sleep_us(100);
  return r;
}

static ps_cuda_dev_t *open_with_delay(const char *max_us) {
  static char token; /* any non-NULL "device pointer" */
  ps_cuda_dev_t *d = NULL;
  setenv("PS_FAKE_CUDA_MAX_DELAY_US", max_us, 1);
  EXPECT(ps_cuda_open(&token, &d) == ncclSuccess && d, "open with delay %s failed", max_us);
  return d;
}

/* Many copies to one place: the last one enqueued is the one left. */
static void test_copy_order(void) {
  enum { N = 1000 };
  static uint64_t src[N], dst;
  ps_cuda_dev_t *d = open_with_delay("200");
  if (!d) return;
  for (int i = 0; i < N; i++) src[i] = 0x1000 + (uint64_t)i;
  int bad = 0;
  for (int i = 0; i < N; i++) bad += ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, &dst, &src[i], sizeof dst) != ncclSuccess;
  EXPECT(bad == 0, "%d h2d enqueues failed", bad);
  ps_cuda_event_t *ev = NULL;
  EXPECT(ps_cuda_event_record(d, PS_CUDA_COPY_STREAM, &ev) == ncclSuccess && ev, "record failed");
  if (ev) {
    EXPECT(wait_done(d, ev) == 1, "event after %d copies never done", N);
    EXPECT(dst == src[N - 1], "after the event dst is %#llx, the last copy wrote %#llx", (unsigned long long)dst,
           (unsigned long long)src[N - 1]);
    ps_cuda_event_release(d, ev);
  }
  ps_cuda_close(d);
}

/* copy i then write64(flag, i): whoever sees flag == k sees copies 1..k. */
static void test_write64_after_copy(void) {
  enum { N = 400, W = 8 };
  static uint64_t src[N + 1][W], dst[N + 1][W];
  static uint64_t flag;
  memset(dst, 0, sizeof dst);
  flag = 0;
  ps_cuda_dev_t *d = open_with_delay("100");
  if (!d) return;
  for (int i = 1; i <= N; i++)
    for (int w = 0; w < W; w++) src[i][w] = (uint64_t)i << 8 | (uint64_t)w;
  int bad = 0;
  for (int i = 1; i <= N; i++) {
    bad += ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, dst[i], src[i], sizeof dst[i]) != ncclSuccess;
    bad += ps_cuda_write64(d, PS_CUDA_COPY_STREAM, &flag, (uint64_t)i) != ncclSuccess;
  }
  EXPECT(bad == 0, "%d enqueues failed", bad);
  uint64_t checked = 0;
  int stale = 0, backwards = 0;
  for (long waited = 0; checked < N && waited < 30000000; waited += 50) {
    uint64_t k = __atomic_load_n(&flag, __ATOMIC_ACQUIRE);
    if (k < checked) backwards++;
    /* only copies the flag vouches for: later ones may be running now */
    for (; checked < k; checked++)
      stale += memcmp(dst[checked + 1], src[checked + 1], sizeof dst[0]) != 0;
    sleep_us(50);
  }
  EXPECT(checked == N, "flag reached %llu of %d", (unsigned long long)checked, N);
  EXPECT(stale == 0, "%d copies not visible when the flag after them was", stale);
  EXPECT(backwards == 0, "the flag went backwards %d times", backwards);
  ps_cuda_close(d);
}

/* With 20 ms delays an event behind 30 operations cannot be done at once;
 * the read and out streams do not queue behind the copy stream. */
static void test_event_pending(void) {
  enum { N = 30 };
  static uint64_t src[N], dst[N];
  ps_cuda_dev_t *d = open_with_delay("20000");
  if (!d) return;
  for (int i = 0; i < N; i++) src[i] = 77 + (uint64_t)i, dst[i] = 0;
  for (int i = 0; i < N; i++) ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, &dst[i], &src[i], sizeof dst[i]);
  ps_cuda_event_t *ev = NULL, *rd = NULL, *ot = NULL;
  EXPECT(ps_cuda_event_record(d, PS_CUDA_COPY_STREAM, &ev) == ncclSuccess, "record failed");
  EXPECT(ps_cuda_event_record(d, PS_CUDA_READ_STREAM, &rd) == ncclSuccess, "record (read) failed");
  EXPECT(ps_cuda_event_record(d, PS_CUDA_OUT_STREAM, &ot) == ncclSuccess, "record (out) failed");
  if (!ev || !rd || !ot) {
    ps_cuda_close(d);
    return;
  }
  EXPECT(ps_cuda_event_done(d, ev) == 0, "event done right after record, behind %d delayed copies", N);
  EXPECT(wait_done(d, rd) == 1 && wait_done(d, ot) == 1, "event on an idle read/out stream never done");
  EXPECT(ps_cuda_event_done(d, ev) == 0, "copy stream finished %d delayed copies before 1 on the read/out stream",
         N);
  EXPECT(wait_done(d, ev) == 1, "event never done");
  int missing = 0;
  for (int i = 0; i < N; i++) missing += dst[i] != src[i];
  EXPECT(missing == 0, "%d copies missing after their event", missing);

  /* Released while pending and recorded again behind new work: the older
   * record reaching the stream must not mark the new one done. */
  static uint64_t late = 0;
  ps_cuda_event_release(d, ev);
  ps_cuda_event_t *e1 = NULL, *e2 = NULL;
  ps_cuda_write64(d, PS_CUDA_COPY_STREAM, &late, 99);
  EXPECT(ps_cuda_event_record(d, PS_CUDA_COPY_STREAM, &e1) == ncclSuccess, "record e1 failed");
  ps_cuda_event_release(d, e1);
  for (int i = 0; i < N; i++) ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, &dst[i], &src[i], sizeof dst[i]);
  EXPECT(ps_cuda_event_record(d, PS_CUDA_COPY_STREAM, &e2) == ncclSuccess, "record e2 failed");
  EXPECT(e1 == e2, "the pool did not reuse the released event (%p, %p)", (void *)e1, (void *)e2);
  if (e2) {
    while (__atomic_load_n(&late, __ATOMIC_ACQUIRE) != 99) sleep_us(100);
    sleep_us(30000); /* past e1's own delay, well before N more */
    EXPECT(ps_cuda_event_done(d, e2) == 0, "a re-recorded event was marked done by its older record");
    EXPECT(wait_done(d, e2) == 1, "re-recorded event never done");
    ps_cuda_event_release(d, e2);
  }
  ps_cuda_event_release(d, rd);
  ps_cuda_event_release(d, ot);
  ps_cuda_close(d);
}

/* close returns only after every queued operation ran. */
static void test_close_drains(void) {
  enum { N = 200 };
  static uint64_t src[N], dst[N], flags[N], rd[N], out[N];
  ps_cuda_dev_t *d = open_with_delay("1000");
  if (!d) return;
  for (int i = 0; i < N; i++) src[i] = 5000 + (uint64_t)i, dst[i] = flags[i] = rd[i] = out[i] = 0;
  for (int i = 0; i < N; i++) {
    ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, &dst[i], &src[i], sizeof dst[i]);
    ps_cuda_write64(d, PS_CUDA_COPY_STREAM, &flags[i], (uint64_t)i + 1);
    ps_cuda_d2h(d, PS_CUDA_READ_STREAM, &rd[i], &src[i], sizeof rd[i]);
    ps_cuda_d2h(d, PS_CUDA_OUT_STREAM, &out[i], &src[i], sizeof out[i]);
  }
  ps_cuda_event_t *ev = NULL; /* left unreleased: close frees it */
  ps_cuda_event_record(d, PS_CUDA_COPY_STREAM, &ev);
  ps_cuda_close(d);
  int missing = 0;
  for (int i = 0; i < N; i++)
    missing += dst[i] != src[i] || flags[i] != (uint64_t)i + 1 || rd[i] != src[i] || out[i] != src[i];
  EXPECT(missing == 0, "%d of %d operation sets lost by close", missing, N);
}

/* The pool reuses events; host memory is aligned and zeroed; bad arguments
 * are refused. */
static void test_pool_and_args(void) {
  ps_cuda_dev_t *d = open_with_delay("0");
  if (!d) return;
  ps_cuda_event_t *first = NULL, *held[4] = {0};
  int other = 0, failed = 0;
  for (int i = 0; i < 10000; i++) {
    ps_cuda_event_t *ev = NULL;
    failed += ps_cuda_event_record(d, i % PS_CUDA_NSTREAMS, &ev) != ncclSuccess;
    if (!first) first = ev;
    other += ev != first;
    ps_cuda_event_release(d, ev);
  }
  EXPECT(failed == 0 && other == 0, "10000 record/release cycles: %d failed, %d new events", failed, other);
  for (int i = 0; i < 4; i++) ps_cuda_event_record(d, PS_CUDA_READ_STREAM, &held[i]);
  for (int i = 0; i < 4; i++) {
    EXPECT(held[i] && wait_done(d, held[i]) == 1, "held event %d not done", i);
    ps_cuda_event_release(d, held[i]);
  }
  int unaligned = 0, dirty = 0;
  for (int i = 0; i < 1000; i++) {
    void *p = NULL;
    size_t n = 1 + (size_t)(i * 977 % 70000);
    failed += ps_cuda_host_alloc(d, n, &p) != ncclSuccess;
    if (!p) continue;
    unaligned += (uintptr_t)p % 64 != 0;
    for (size_t j = 0; j < n; j++) dirty += ((unsigned char *)p)[j] != 0;
    memset(p, 0xAB, n);
    ps_cuda_host_free(d, p);
  }
  EXPECT(failed == 0 && unaligned == 0 && dirty == 0, "host_alloc: %d failed, %d unaligned, %d dirty bytes", failed,
         unaligned, dirty);

  static uint64_t word[2];
  void *p = NULL;
  ps_cuda_dev_t *bad = NULL;
  EXPECT(ps_cuda_write64(d, PS_CUDA_COPY_STREAM, (char *)word + 4, 1) != ncclSuccess, "unaligned write64 accepted");
  EXPECT(ps_cuda_h2d(d, PS_CUDA_NSTREAMS, word, word + 1, 8) != ncclSuccess, "stream %d accepted", PS_CUDA_NSTREAMS);
  EXPECT(ps_cuda_d2h(d, -1, word, word + 1, 8) != ncclSuccess, "stream -1 accepted");
  EXPECT(ps_cuda_host_alloc(d, 0, &p) != ncclSuccess && !p, "0-byte host_alloc accepted");
  EXPECT(ps_cuda_open(NULL, &bad) != ncclSuccess && !bad, "open(NULL) accepted");
  EXPECT(ps_cuda_available() == 1, "the fake must always be available");
  EXPECT(ps_cuda_ordinal(d) == 0, "fake ordinal %d", ps_cuda_ordinal(d));
  EXPECT(ps_cuda_owns(d, word, sizeof word) == 1 && ps_cuda_owns(d, NULL, 8) == 0, "owns");
  ps_cuda_close(d);
  ps_cuda_close(NULL);
}

int main(void) {
  test_copy_order();
  test_write64_after_copy();
  test_event_pending();
  test_close_drains();
  test_pool_and_args();
  printf("unit_cuda_fake: %d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
