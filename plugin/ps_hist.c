#include "ps_hist.h"

/* The bucket holding the pct-th percentile of n samples: the first whose
 * running count reaches ceil(n * pct / 100). */
static int pct_bucket(const uint64_t *b, int nb, uint64_t n, unsigned pct) {
  uint64_t want = (n * pct + 99) / 100, seen = 0;
  if (!want) want = 1;
  for (int k = 0; k < nb; k++)
    if ((seen += b[k]) >= want) return k;
  return nb - 1;
}

/* v < 8 is its own bucket; above, the power of two of v's top bit and the
 * two bits below it pick one of four buckets. */
static int bucket_of(uint64_t v) {
  if (v < 8) return (int)v;
  int top = 63 - __builtin_clzll(v);
  int k = 8 + 4 * (top - 3) + (int)((v >> (top - 2)) & 3);
  return k < PS_HIST_BUCKETS ? k : PS_HIST_BUCKETS - 1;
}

/* The largest value bucket k holds (k below the last). */
static uint64_t bucket_upper(int k) {
  if (k < 8) return (uint64_t)k;
  int top = 3 + (k - 8) / 4, quarter = (k - 8) % 4;
  return ((uint64_t)(5 + quarter) << (top - 2)) - 1;
}

void ps_hist_add(ps_hist_t *h, uint64_t v) {
  h->b[bucket_of(v)]++;
  h->n++, h->sum += v;
  if (v > h->max) h->max = v;
}

uint64_t ps_hist_pct(const ps_hist_t *h, unsigned pct) {
  if (!h->n) return 0;
  int k = pct_bucket(h->b, PS_HIST_BUCKETS, h->n, pct);
  uint64_t upper = k == PS_HIST_BUCKETS - 1 ? h->max : bucket_upper(k);
  return upper < h->max ? upper : h->max;
}

void ps_hist_small_add(ps_hist_small_t *h, uint64_t v) {
  h->b[v < PS_HIST_SMALL - 1 ? v : PS_HIST_SMALL - 1]++;
  h->n++;
  if (v > h->max) h->max = v;
}

uint64_t ps_hist_small_pct(const ps_hist_small_t *h, unsigned pct) {
  if (!h->n) return 0;
  int k = pct_bucket(h->b, PS_HIST_SMALL, h->n, pct);
  return k == PS_HIST_SMALL - 1 ? h->max : (uint64_t)k;
}
