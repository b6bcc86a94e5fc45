/* Fused AllGather+GEMM's host side (ps_ag_gemm.h): shape checks, shards,
 * the ranks a block of rows waits for, and the references. */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "ps_ag_gemm.h"
#include "ps_moe_ref.h" /* the bf16 conversions, the timeout variable rule */

static _Thread_local char ag_err[256];

const char *ps_ag_gemm_last_error(void) { return ag_err; }

int ps_ag_gemm_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ag_err, sizeof ag_err, fmt, ap);
  va_end(ap);
  return -1;
}

int ps_ag_gemm_check(const ps_ag_gemm_shape_t *s, int nranks) {
  ag_err[0] = '\0';
  if (!s) return ps_ag_gemm_fail("no shape");
  if (nranks < 1) return ps_ag_gemm_fail("%d ranks: expected at least 1", nranks);
  if (s->m < 1) return ps_ag_gemm_fail("m %d: expected at least 1 row", s->m);
  if (s->n < 8 || s->n % 8) return ps_ag_gemm_fail("n %d: expected a positive multiple of 8", s->n);
  if (s->k < 8 || s->k % 8) return ps_ag_gemm_fail("k %d: expected a positive multiple of 8", s->k);
  if (s->m > PS_AG_GEMM_MAX_DIM || s->n > PS_AG_GEMM_MAX_DIM || s->k > PS_AG_GEMM_MAX_DIM)
    return ps_ag_gemm_fail("m %d, n %d, k %d: expected each at most %d", s->m, s->n, s->k, PS_AG_GEMM_MAX_DIM);
  /* the fused kernel's tiles of 128 x 256 are counted in int, twice over */
  const long long tiles = (s->m + 127LL) / 128 * ((s->n + 255LL) / 256);
  if (tiles > INT_MAX / 2)
    return ps_ag_gemm_fail("m %d x n %d makes %lld tiles of 128 x 256: expected at most %d", s->m, s->n, tiles,
                           INT_MAX / 2);
  return 0;
}

int ps_ag_gemm_env_timeout_ms(long long *ms) {
  if (ps_env_timeout_ms("PERSEUS_AG_GEMM_TIMEOUT_MS", ms) == 0) return 0;
  return ps_ag_gemm_fail("PERSEUS_AG_GEMM_TIMEOUT_MS '%s': expected milliseconds in 0..%lld (0: wait forever)",
                         getenv("PERSEUS_AG_GEMM_TIMEOUT_MS"), (long long)PS_MOE_MAX_TIMEOUT_MS);
}

void ps_ag_gemm_shard(int m, int nranks, int rank, int *start, int *end) {
  *start = (int)((long long)m * rank / nranks);
  *end = (int)((long long)m * (rank + 1) / nranks);
}

/* The rank whose shard holds row `row` (0 <= row < m): the last one whose
 * shard starts at or before it, m r / R < row + 1 (shards before an empty
 * one start at the same row; the empty ones end there). */
static int owner(int m, int nranks, int row) {
  return (int)(((long long)(row + 1) * nranks + m - 1) / m) - 1;
}

int ps_ag_gemm_block_ranks(int m, int nranks, int block_rows, int block, int *first, int *last) {
  if (m < 1 || nranks < 1 || block_rows < 1 || block < 0 || (long long)block * block_rows >= m)
    return 0;
  long long lo = (long long)block * block_rows, end = lo + block_rows < m ? lo + block_rows : m;
  *first = owner(m, nranks, (int)lo), *last = owner(m, nranks, (int)end - 1);
  return *last - *first + 1;
}

void ps_ag_gemm_ref(const ps_ag_gemm_shape_t *s, const uint16_t *a, const uint16_t *b, uint16_t *c) {
  const size_t M = (size_t)s->m, N = (size_t)s->n, K = (size_t)s->k;
  for (size_t i = 0; i < M; i++)
    for (size_t j = 0; j < N; j++) {
      float acc = 0.0f;
      for (size_t x = 0; x < K; x++) acc += ps_bf16_to_float(a[i * K + x]) * ps_bf16_to_float(b[x * N + j]);
      c[i * N + j] = ps_float_to_bf16(acc);
    }
}

long ps_ag_gemm_count_wrong(const ps_ag_gemm_shape_t *s, const uint16_t *a, const uint16_t *b,
                            const uint16_t *c, double *worst) {
  const size_t M = (size_t)s->m, N = (size_t)s->n, K = (size_t)s->k;
  long wrong = 0;
  double over = 0.0;
  for (size_t i = 0; i < M; i++)
    for (size_t j = 0; j < N; j++) {
      double want = 0.0, mag = 0.0;
      for (size_t x = 0; x < K; x++) {
        double t = (double)ps_bf16_to_float(a[i * K + x]) * (double)ps_bf16_to_float(b[x * N + j]);
        want += t, mag += fabs(t);
      }
      /* fp32 sums of k terms err by up to about k * 2^-24 of their magnitude each way */
      double bound = ldexp(fabs(want), -8) + (double)K * ldexp(mag, -23) + 1e-30;
      double got = (double)ps_bf16_to_float(c[i * N + j]), err = fabs(got - want);
      if (!(err <= bound)) { /* NaN is wrong too */
        wrong++;
        double e = isnan(err) ? INFINITY : err - bound;
        if (e > over) over = e;
      }
    }
  if (worst) *worst = over;
  return wrong;
}
