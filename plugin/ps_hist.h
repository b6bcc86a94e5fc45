/* Fixed-size histograms for PERSEUS_STATS: adding a sample never allocates.
 * Below the one-sided engine, like ps_seqwin.h.
 *
 * ps_hist_t, quarter-octave buckets of a duration in ns: 0..7 exactly, then
 * four buckets per power of two (each at most 25% wide), the last also
 * everything from 2^40 ns (18 minutes) up. A percentile is the upper bound
 * of the bucket it falls in, at most the exact maximum, which is kept (so
 * is the sum, for the mean).
 *
 * ps_hist_small_t, exact counts of small values (a queue depth): 0 ..
 * PS_HIST_SMALL - 2 each in their own bucket, the last bucket everything
 * larger (a percentile that falls there reads as the exact maximum). */
#ifndef PS_HIST_H
#define PS_HIST_H

#include <stdint.h>

#define PS_HIST_BUCKETS (8 + 4 * 37 + 1)
#define PS_HIST_SMALL 64

typedef struct {
  uint64_t n, sum, max;
  uint64_t b[PS_HIST_BUCKETS];
} ps_hist_t;

typedef struct {
  uint64_t n, max;
  uint64_t b[PS_HIST_SMALL];
} ps_hist_small_t;

void ps_hist_add(ps_hist_t *h, uint64_t v);
/* The pct-th percentile (0 < pct <= 100) as above; 0 when h is empty. */
uint64_t ps_hist_pct(const ps_hist_t *h, unsigned pct);

void ps_hist_small_add(ps_hist_small_t *h, uint64_t v);
uint64_t ps_hist_small_pct(const ps_hist_small_t *h, unsigned pct);

#endif
