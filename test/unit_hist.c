/* ps_hist: every percentile lies within a quarter octave above the exact
 * one (never below it, never above the maximum); ps_hist_small is exact. */
#include <stdlib.h>

#include "ps_hist.h"
#include "unit_check.h"

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

int main(void) {
  enum { N = 20000 };
  static uint64_t v[N];
  static ps_hist_t h;
  srand(11);
  for (int i = 0; i < N; i++) {
    /* log-uniform from 0 to about 2^44 ns, past the last bucket's start */
    int bits = rand() % 45;
    v[i] = bits ? ((uint64_t)rand() << 20 ^ (uint64_t)rand()) & ((1ULL << bits) - 1) : 0;
    ps_hist_add(&h, v[i]);
  }
  qsort(v, N, sizeof v[0], cmp_u64);
  EXPECT(h.n == N && h.max == v[N - 1], "n %llu max %llu, expected %d and %llu",
         (unsigned long long)h.n, (unsigned long long)h.max, N, (unsigned long long)v[N - 1]);
  static const unsigned pcts[] = {1, 10, 25, 50, 75, 90, 99, 100};
  for (size_t i = 0; i < sizeof pcts / sizeof pcts[0]; i++) {
    uint64_t exact = v[(N * pcts[i] + 99) / 100 - 1], got = ps_hist_pct(&h, pcts[i]);
    /* the bucket's upper bound: at most 25% above (plus one for small values) */
    int ok = got >= exact && got <= h.max &&
             (exact >= (1ULL << 40) || (double)got <= (double)exact * 1.25 + 1);
    EXPECT(ok, "p%u: %llu, exact %llu", pcts[i], (unsigned long long)got,
           (unsigned long long)exact);
  }
  /* small exact values are their own buckets */
  static ps_hist_t s;
  for (uint64_t x = 0; x < 8; x++) ps_hist_add(&s, x);
  EXPECT(ps_hist_pct(&s, 50) == 3 && ps_hist_pct(&s, 100) == 7, "0..7: p50 %llu p100 %llu",
         (unsigned long long)ps_hist_pct(&s, 50), (unsigned long long)ps_hist_pct(&s, 100));
  static ps_hist_t e;
  EXPECT(ps_hist_pct(&e, 50) == 0, "an empty histogram's p50 is %llu", (unsigned long long)ps_hist_pct(&e, 50));

  static ps_hist_small_t d;
  for (uint64_t x = 0; x < 100; x++) ps_hist_small_add(&d, x % 10);
  ps_hist_small_add(&d, 500);
  EXPECT(ps_hist_small_pct(&d, 50) == 5 && ps_hist_small_pct(&d, 100) == 500,
         "small: p50 %llu p100 %llu", (unsigned long long)ps_hist_small_pct(&d, 50),
         (unsigned long long)ps_hist_small_pct(&d, 100));
  return unit_report("unit_hist");
}
