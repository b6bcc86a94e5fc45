/* Flash-Decode's host side (ps_decode.h): shape checks, shards and the fp64
 * reference. */
#include <math.h>
#include <stdlib.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ps_decode.h"
#include "ps_moe_ref.h" /* ps_env_timeout_ms */

static _Thread_local char ps_decode_err[256];

const char *ps_decode_last_error(void) { return ps_decode_err; }

int ps_decode_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ps_decode_err, sizeof ps_decode_err, fmt, ap);
  va_end(ap);
  return -1;
}

int ps_decode_check_config(const ps_decode_config_t *c, int nranks) {
  ps_decode_err[0] = '\0';
  if (!c) return ps_decode_fail("no config");
  if (nranks < 1) return ps_decode_fail("%d ranks: expected at least 1", nranks);
  if (c->batch < 1 || c->batch > PS_DECODE_MAX_BATCH)
    return ps_decode_fail("batch %d: expected 1 to %d sequences", c->batch, PS_DECODE_MAX_BATCH);
  if (c->kv_heads < 1 || c->kv_heads > PS_DECODE_MAX_HEADS)
    return ps_decode_fail("kv_heads %d: expected 1 to %d", c->kv_heads, PS_DECODE_MAX_HEADS);
  if (c->q_heads < 1 || c->q_heads > PS_DECODE_MAX_HEADS || c->q_heads % c->kv_heads)
    return ps_decode_fail("q_heads %d: expected a multiple of kv_heads (%d) from 1 to %d", c->q_heads, c->kv_heads,
                          PS_DECODE_MAX_HEADS);
  if (c->head_dim < 8 || c->head_dim % 8 || c->head_dim > PS_DECODE_MAX_HEAD_DIM)
    return ps_decode_fail("head_dim %d: expected a multiple of 8 from 8 to %d", c->head_dim,
                PS_DECODE_MAX_HEAD_DIM);
  if (c->max_context < 1 || c->max_context > PS_DECODE_MAX_CONTEXT)
    return ps_decode_fail("max_context %d: expected 1 to %d tokens", c->max_context, PS_DECODE_MAX_CONTEXT);
  return 0;
}

int ps_decode_check_lengths(const ps_decode_config_t *c, const int *len) {
  ps_decode_err[0] = '\0';
  if (!len) return ps_decode_fail("no sequence lengths");
  for (int b = 0; b < c->batch; b++)
    if (len[b] < 1 || len[b] > c->max_context)
      return ps_decode_fail("sequence %d has %d tokens: expected 1 to max_context (%d)", b, len[b],
                  c->max_context);
  return 0;
}

int ps_decode_env_timeout_ms(long long *ms) {
  if (ps_env_timeout_ms("PERSEUS_DECODE_TIMEOUT_MS", ms) == 0) return 0;
  return ps_decode_fail("PERSEUS_DECODE_TIMEOUT_MS '%s': expected milliseconds in 0..%lld (0: wait forever)",
                        getenv("PERSEUS_DECODE_TIMEOUT_MS"), (long long)PS_MOE_MAX_TIMEOUT_MS);
}

void ps_decode_shard(int len, int nranks, int rank, int *start, int *end) {
  *start = (int)((long long)len * rank / nranks);
  *end = (int)((long long)len * (rank + 1) / nranks);
}

void ps_decode_ref_partial(const ps_decode_config_t *c, double scale, const double *q,
                           const double *k, const double *v, size_t stride, const int *n,
                           double *o, double *lse) {
  const size_t D = (size_t)c->head_dim, group = (size_t)(c->q_heads / c->kv_heads);
  for (size_t b = 0; b < (size_t)c->batch; b++)
    for (size_t h = 0; h < (size_t)c->q_heads; h++) {
      const double *qv = q + (b * (size_t)c->q_heads + h) * D;
      const size_t row = (b * (size_t)c->kv_heads + h / group) * stride * D;
      double *out = o + (b * (size_t)c->q_heads + h) * D;
      memset(out, 0, D * sizeof *out);
      double m = -INFINITY, l = 0.0;
      for (size_t j = 0; j < (size_t)n[b]; j++) { /* the running max keeps exp() below 1 */
        double s = 0.0;
        for (size_t d = 0; d < D; d++) s += qv[d] * k[row + j * D + d];
        s *= scale;
        double grow = s > m ? exp(m - s) : 1.0, w = s > m ? 1.0 : exp(s - m);
        if (s > m) m = s;
        l = l * grow + w;
        for (size_t d = 0; d < D; d++) out[d] = out[d] * grow + w * v[row + j * D + d];
      }
      if (l > 0.0)
        for (size_t d = 0; d < D; d++) out[d] /= l;
      lse[b * (size_t)c->q_heads + h] = n[b] ? m + log(l) : -INFINITY;
    }
}

void ps_decode_ref_combine(const ps_decode_config_t *c, int nranks, const double *const *o_parts,
                           const double *const *lse_parts, double *out) {
  const size_t D = (size_t)c->head_dim, rows = (size_t)c->batch * (size_t)c->q_heads;
  for (size_t i = 0; i < rows; i++) {
    double m = -INFINITY, sum = 0.0;
    for (int r = 0; r < nranks; r++)
      if (lse_parts[r][i] > m) m = lse_parts[r][i];
    memset(out + i * D, 0, D * sizeof *out);
    if (m == -INFINITY) continue; /* every shard empty: a length check refuses that */
    for (int r = 0; r < nranks; r++) {
      if (lse_parts[r][i] == -INFINITY) continue; /* an empty shard adds nothing */
      double w = exp(lse_parts[r][i] - m);
      sum += w;
      for (size_t d = 0; d < D; d++) out[i * D + d] += w * o_parts[r][i * D + d];
    }
    for (size_t d = 0; d < D; d++) out[i * D + d] /= sum;
  }
}
