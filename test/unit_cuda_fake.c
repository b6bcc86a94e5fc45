/* ps_cuda_fake.c, the test build's CUDA: each stream runs its operations in
 * enqueue order however late; every operation before a flush names the same
 * mark, and tickets grow by one per mark on their own stream only; a mark is
 * passed only after ps_cuda_flush put it on the stream and everything before
 * it ran, so an older mark never passes a newer ticket; an idle stream's
 * mark does not wait for a busy one; close finishes every flushed operation;
 * bad arguments (NULL ticket, bad stream or device) are refused and leave
 * the ticket sequence as it was; quiesce waits for unflushed work, or fails
 * at its timeout. */
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

/* Polls for up to 30 s; returns ps_cuda_passed's last answer. */
static int wait_passed(ps_cuda_dev_t *d, int s, uint64_t ticket) {
  int r = 0;
  for (long waited = 0; waited < 30000000 && (r = ps_cuda_passed(d, s, ticket)) == 0; waited += 100)
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

/* Many copies to one place: the last one enqueued is the one left once the
 * mark after them passed, and all of them name that one mark. */
static void test_copy_order(void) {
  enum { N = 1000 };
  static uint64_t src[N], dst;
  ps_cuda_dev_t *d = open_with_delay("200");
  if (!d) return;
  for (int i = 0; i < N; i++) src[i] = 0x1000 + (uint64_t)i;
  int bad = 0, other = 0;
  uint64_t first = 0, t = 0;
  for (int i = 0; i < N; i++) {
    bad += ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, &dst, &src[i], sizeof dst, &t) != ncclSuccess;
    if (!i) first = t;
    other += t != first;
  }
  EXPECT(bad == 0 && other == 0 && first != 0,
         "%d h2d enqueues failed, %d named another mark than %llu", bad, other,
         (unsigned long long)first);
  EXPECT(ps_cuda_flush(d) == ncclSuccess, "flush failed");
  EXPECT(wait_passed(d, PS_CUDA_COPY_STREAM, t) == 1, "mark after %d copies never passed", N);
  EXPECT(dst == src[N - 1], "after the mark dst is %#llx, the last copy wrote %#llx",
         (unsigned long long)dst, (unsigned long long)src[N - 1]);
  ps_cuda_close(d);
}

/* copy i then write64(flag, i): whoever sees flag == k sees copies 1..k, and
 * once the last mark passed every copy and the last flag are there. */
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
  uint64_t t = 0;
  for (int i = 1; i <= N; i++) {
    bad += ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, dst[i], src[i], sizeof dst[i], &t) != ncclSuccess;
    bad += ps_cuda_write64(d, PS_CUDA_COPY_STREAM, &flag, (uint64_t)i, &t) != ncclSuccess;
    if (i % 50 == 0) bad += ps_cuda_flush(d) != ncclSuccess; /* marks between the operations too */
  }
  EXPECT(bad == 0, "%d enqueues or flushes failed", bad);
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
  EXPECT(wait_passed(d, PS_CUDA_COPY_STREAM, t) == 1, "the last mark never passed");
  EXPECT(flag == N && memcmp(dst[1], src[1], sizeof dst - sizeof dst[0]) == 0,
         "the last mark passed with flag %llu or copies missing", (unsigned long long)flag);
  ps_cuda_close(d);
}

/* With 20 ms delays a mark behind 30 operations cannot pass at once; the read
 * and out streams do not queue behind the copy stream; an older mark reached
 * does not pass a newer ticket of the same stream. */
static void test_mark_pending(void) {
  enum { N = 30 };
  static uint64_t src[N], dst[N], rd, ot, late;
  ps_cuda_dev_t *d = open_with_delay("20000");
  if (!d) return;
  for (int i = 0; i < N; i++) src[i] = 77 + (uint64_t)i, dst[i] = 0;
  rd = ot = late = 0;
  uint64_t tc = 0, tr = 0, to = 0;
  int bad = 0;
  for (int i = 0; i < N; i++)
    bad += ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, &dst[i], &src[i], sizeof dst[i], &tc) != ncclSuccess;
  bad += ps_cuda_d2h(d, PS_CUDA_READ_STREAM, &rd, &src[0], sizeof rd, &tr) != ncclSuccess;
  bad += ps_cuda_d2h(d, PS_CUDA_OUT_STREAM, &ot, &src[1], sizeof ot, &to) != ncclSuccess;
  bad += ps_cuda_flush(d) != ncclSuccess;
  EXPECT(bad == 0, "%d enqueues or the flush failed", bad);
  EXPECT(ps_cuda_passed(d, PS_CUDA_COPY_STREAM, tc) == 0,
         "mark passed right after flush, behind %d delayed copies", N);
  EXPECT(wait_passed(d, PS_CUDA_READ_STREAM, tr) == 1 &&
             wait_passed(d, PS_CUDA_OUT_STREAM, to) == 1,
         "mark on an idle read/out stream never passed");
  EXPECT(rd == src[0] && ot == src[1], "read/out copies missing after their marks");
  EXPECT(ps_cuda_passed(d, PS_CUDA_COPY_STREAM, tc) == 0,
         "copy stream finished %d delayed copies before 1 on the read/out stream", N);
  EXPECT(wait_passed(d, PS_CUDA_COPY_STREAM, tc) == 1, "mark never passed");
  int missing = 0;
  for (int i = 0; i < N; i++) missing += dst[i] != src[i];
  EXPECT(missing == 0, "%d copies missing after their mark", missing);

  /* Two marks in flight on one stream: the first reached must not pass the
   * second, N delayed copies behind it. */
  uint64_t t1 = 0, t2 = 0;
  bad = ps_cuda_write64(d, PS_CUDA_COPY_STREAM, &late, 99, &t1) != ncclSuccess;
  bad += ps_cuda_flush(d) != ncclSuccess;
  for (int i = 0; i < N; i++) {
    dst[i] = 0;
    bad += ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, &dst[i], &src[i], sizeof dst[i], &t2) != ncclSuccess;
  }
  bad += ps_cuda_flush(d) != ncclSuccess;
  EXPECT(bad == 0 && t1 == tc + 1 && t2 == t1 + 1, "tickets %llu, %llu after %llu (%d failures)",
         (unsigned long long)t1, (unsigned long long)t2, (unsigned long long)tc, bad);
  EXPECT(wait_passed(d, PS_CUDA_COPY_STREAM, t1) == 1 && late == 99, "first mark never passed");
  EXPECT(ps_cuda_passed(d, PS_CUDA_COPY_STREAM, t2) == 0, "the second mark passed with the first");
  EXPECT(wait_passed(d, PS_CUDA_COPY_STREAM, t2) == 1, "second mark never passed");
  missing = 0;
  for (int i = 0; i < N; i++) missing += dst[i] != src[i];
  EXPECT(missing == 0, "%d copies missing after the second mark", missing);
  EXPECT(ps_cuda_passed(d, PS_CUDA_COPY_STREAM, t1) == 1, "a passed mark stopped passing");
  ps_cuda_close(d);
}

/* With no delay the operations run at once, yet no ticket passes until the
 * flush puts its mark on the stream; tickets count marks per stream, and a
 * flush puts none on a stream without new work. */
static void test_not_before_flush(void) {
  static uint64_t src[PS_CUDA_NSTREAMS], dst[PS_CUDA_NSTREAMS];
  ps_cuda_dev_t *d = open_with_delay("0");
  if (!d) return;
  uint64_t t[PS_CUDA_NSTREAMS] = {0}, prev[PS_CUDA_NSTREAMS] = {0};
  for (int round = 0; round < 4; round++) {
    int bad = 0, early = 0, late = 0, wrong = 0;
    for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
      /* round 1 leaves the read stream idle; round 2 gives it work again */
      if (round == 1 && s == PS_CUDA_READ_STREAM) continue;
      src[s] = (uint64_t)round << 8 | (uint64_t)s;
      bad += ps_cuda_h2d(d, s, &dst[s], &src[s], sizeof dst[s], &t[s]) != ncclSuccess;
      wrong += t[s] != prev[s] + 1;
    }
    /* the copies ran, so only the missing mark can hold their tickets back */
    int ran = 0;
    for (long waited = 0; waited < 30000000 && ran < PS_CUDA_NSTREAMS; waited += 100) {
      sleep_us(100);
      ran = 0;
      for (int s = 0; s < PS_CUDA_NSTREAMS; s++)
        ran += __atomic_load_n(&dst[s], __ATOMIC_ACQUIRE) == src[s];
    }
    sleep_us(10000); /* time for a mark put on the stream too early to land */
    for (int s = 0; s < PS_CUDA_NSTREAMS; s++)
      early += (round != 1 || s != PS_CUDA_READ_STREAM) && ps_cuda_passed(d, s, t[s]) != 0;
    bad += ps_cuda_flush(d) != ncclSuccess;
    bad += ps_cuda_flush(d) != ncclSuccess; /* nothing new: no mark, no ticket skipped */
    for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
      late += wait_passed(d, s, t[s]) != 1 || dst[s] != src[s];
      prev[s] = t[s];
    }
    EXPECT(bad == 0, "round %d: %d calls failed", round, bad);
    EXPECT(ran == PS_CUDA_NSTREAMS, "round %d: only %d streams ran their copy at no delay", round,
           ran);
    EXPECT(early == 0, "round %d: %d tickets passed before ps_cuda_flush", round, early);
    EXPECT(late == 0, "round %d: %d tickets never passed after the flush", round, late);
    EXPECT(wrong == 0, "round %d: %d tickets not one past the stream's last", round, wrong);
  }
  ps_cuda_close(d);
}

/* close returns only after every flushed operation ran, though every stream
 * was still busy when it was called. */
static void test_close_drains(void) {
  enum { N = 200 };
  static uint64_t src[N], dst[N], flags[N], rd[N], out[N];
  ps_cuda_dev_t *d = open_with_delay("1000");
  if (!d) return;
  for (int i = 0; i < N; i++) src[i] = 5000 + (uint64_t)i, dst[i] = flags[i] = rd[i] = out[i] = 0;
  uint64_t t[PS_CUDA_NSTREAMS] = {0};
  int bad = 0;
  for (int i = 0; i < N; i++) {
    bad +=
        ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, &dst[i], &src[i], sizeof dst[i], &t[0]) != ncclSuccess;
    bad +=
        ps_cuda_write64(d, PS_CUDA_COPY_STREAM, &flags[i], (uint64_t)i + 1, &t[0]) != ncclSuccess;
    bad += ps_cuda_d2h(d, PS_CUDA_READ_STREAM, &rd[i], &src[i], sizeof rd[i], &t[1]) != ncclSuccess;
    bad +=
        ps_cuda_d2h(d, PS_CUDA_OUT_STREAM, &out[i], &src[i], sizeof out[i], &t[2]) != ncclSuccess;
  }
  bad += ps_cuda_flush(d) != ncclSuccess;
  EXPECT(bad == 0, "%d enqueues or the flush failed", bad);
  int pending = 0;
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) pending += ps_cuda_passed(d, s, t[s]) == 0;
  EXPECT(pending == PS_CUDA_NSTREAMS, "only %d of %d streams still busy before close", pending,
         PS_CUDA_NSTREAMS);
  ps_cuda_close(d);
  int missing = 0;
  for (int i = 0; i < N; i++)
    missing += dst[i] != src[i] || flags[i] != (uint64_t)i + 1 || rd[i] != src[i] || out[i] != src[i];
  EXPECT(missing == 0, "%d of %d operation sets lost by close", missing, N);
}

/* quiesce flushes what was never flushed and returns once every stream
 * reached it; it gives up, failing, at its timeout. */
static void test_quiesce(void) {
  enum { N = 50 };
  static uint64_t src[N], dst[PS_CUDA_NSTREAMS][N];
  ps_cuda_dev_t *d = open_with_delay("2000");
  if (!d) return;
  uint64_t t[PS_CUDA_NSTREAMS] = {0};
  int bad = 0;
  for (int i = 0; i < N; i++) src[i] = 900 + (uint64_t)i;
  memset(dst, 0, sizeof dst);
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++)
    for (int i = 0; i < N; i++)
      bad += ps_cuda_h2d(d, s, &dst[s][i], &src[i], sizeof src[i], &t[s]) != ncclSuccess;
  EXPECT(bad == 0, "%d enqueues failed", bad);
  EXPECT(ps_cuda_quiesce(d, 1000000) != ncclSuccess,
         "quiesce succeeded in 1 ms with about 50 ms of work queued");
  EXPECT(ps_cuda_quiesce(d, 30000000000ull) == ncclSuccess, "quiesce failed");
  int missing = 0, pending = 0;
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
    pending += ps_cuda_passed(d, s, t[s]) != 1;
    missing += memcmp(dst[s], src, sizeof src) != 0;
  }
  EXPECT(pending == 0 && missing == 0,
         "after quiesce %d tickets not passed, %d streams' copies missing", pending, missing);
  ps_cuda_close(d);
}

/* Marks do not pile up over many cycles; host memory is aligned and zeroed;
 * bad arguments are refused without enqueueing anything. */
static void test_cycles_and_args(void) {
  ps_cuda_dev_t *d = open_with_delay("0");
  if (!d) return;
  static uint64_t word[2];
  uint64_t last[PS_CUDA_NSTREAMS] = {0};
  int failed = 0, wrong = 0, stuck = 0;
  for (int i = 0; i < 10000; i++) {
    int s = i % PS_CUDA_NSTREAMS;
    uint64_t t = 0;
    failed += ps_cuda_write64(d, s, &word[0], (uint64_t)i, &t) != ncclSuccess;
    failed += ps_cuda_flush(d) != ncclSuccess;
    wrong += t != last[s] + 1;
    stuck += wait_passed(d, s, t) != 1;
    last[s] = t;
  }
  EXPECT(failed == 0 && wrong == 0 && stuck == 0,
         "10000 enqueue/flush/wait cycles: %d failed, %d tickets out of sequence, %d never passed",
         failed, wrong, stuck);
  EXPECT(word[0] == 9999, "the last write64 left %llu", (unsigned long long)word[0]);

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

  void *p = NULL;
  ps_cuda_dev_t *bad = NULL;
  uint64_t t = 0;
  EXPECT(ps_cuda_write64(d, PS_CUDA_COPY_STREAM, (char *)word + 4, 1, &t) != ncclSuccess,
         "unaligned write64 accepted");
  EXPECT(ps_cuda_h2d(d, PS_CUDA_NSTREAMS, word, word + 1, 8, &t) != ncclSuccess,
         "stream %d accepted", PS_CUDA_NSTREAMS);
  EXPECT(ps_cuda_d2h(d, -1, word, word + 1, 8, &t) != ncclSuccess, "stream -1 accepted");
  EXPECT(ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, word, word + 1, 8, NULL) != ncclSuccess,
         "h2d with a NULL ticket accepted");
  EXPECT(ps_cuda_d2h(d, PS_CUDA_READ_STREAM, word, word + 1, 8, NULL) != ncclSuccess,
         "d2h with a NULL ticket accepted");
  EXPECT(ps_cuda_write64(d, PS_CUDA_OUT_STREAM, word, 1, NULL) != ncclSuccess,
         "write64 with a NULL ticket accepted");
  EXPECT(ps_cuda_h2d(NULL, PS_CUDA_COPY_STREAM, word, word + 1, 8, &t) != ncclSuccess,
         "h2d on a NULL device accepted");
  EXPECT(ps_cuda_flush(NULL) != ncclSuccess, "flush of a NULL device accepted");
  EXPECT(ps_cuda_passed(d, PS_CUDA_NSTREAMS, 1) == -1 && ps_cuda_passed(d, -1, 1) == -1 &&
             ps_cuda_passed(NULL, PS_CUDA_COPY_STREAM, 1) == -1,
         "passed() on a bad stream or device is not -1");
  EXPECT(ps_cuda_passed(d, PS_CUDA_COPY_STREAM, last[0] + 1) == 0,
         "a ticket never handed out passed");
  /* the refused calls above put nothing on the streams */
  EXPECT(ps_cuda_flush(d) == ncclSuccess, "flush after refused calls failed");
  int skipped = 0;
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++)
    skipped += ps_cuda_write64(d, s, &word[1], 7, &t) != ncclSuccess || t != last[s] + 1;
  EXPECT(skipped == 0, "%d streams' tickets moved on after refused calls", skipped);
  EXPECT(ps_cuda_host_alloc(d, 0, &p) != ncclSuccess && !p, "0-byte host_alloc accepted");
  EXPECT(ps_cuda_open(NULL, &bad) != ncclSuccess && !bad, "open(NULL) accepted");
  EXPECT(ps_cuda_available() == 1, "the fake must always be available");
  EXPECT(ps_cuda_ordinal(d) == 0, "fake ordinal %d", ps_cuda_ordinal(d));
  EXPECT(ps_cuda_owns(d, word, sizeof word) == 1 && ps_cuda_owns(d, NULL, 8) == 0, "owns");
  ps_cuda_close(d); /* with unflushed work: must not hang or leak */
  ps_cuda_close(NULL);
}

int main(void) {
  test_copy_order();
  test_write64_after_copy();
  test_mark_pending();
  test_not_before_flush();
  test_close_drains();
  test_quiesce();
  test_cycles_and_args();
  return unit_report("unit_cuda_fake");
}
