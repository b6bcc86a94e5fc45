/* Unit tests of Flash-Decode's host side (decode/ps_decode.h): shape and
 * length checks and their messages, the shards of a sequence, and the fp64
 * reference: closed forms, and the combine of any split equal to attention
 * over the whole sequence (empty shards and large scores included);
 * PERSEUS_DECODE_TIMEOUT_MS. Exit: 0 pass, 1 fail. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_decode.h"
#include "ps_moe_ref.h"

#include "unit_check.h"
#include "unit_timeout_env.h"

static const ps_decode_config_t good = {.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 16,
                                        .max_context = 64};

/* --- checks --- */
static void bad_config(ps_decode_config_t c, int nranks, const char *field, const char *value) {
  EXPECT(ps_decode_check_config(&c, nranks) == -1, "%s %s accepted", field, value);
  const char *e = ps_decode_last_error();
  EXPECT(strstr(e, field) && strstr(e, value), "%s %s: the error does not name it: '%s'", field,
         value, e);
}

static void test_checks(void) {
  EXPECT(ps_decode_check_config(&good, 4) == 0 && !ps_decode_last_error()[0], "a valid config: %s",
         ps_decode_last_error());
  ps_decode_config_t c = good;
  c.batch = 0, bad_config(c, 4, "batch", "0");
  c = good, c.kv_heads = 0, bad_config(c, 4, "kv_heads", "0");
  c = good, c.q_heads = 7, bad_config(c, 4, "q_heads", "7");
  c = good, c.q_heads = 0, bad_config(c, 4, "q_heads", "0");
  c = good, c.head_dim = 12, bad_config(c, 4, "head_dim", "12");
  c = good, c.head_dim = 0, bad_config(c, 4, "head_dim", "0");
  c = good, c.head_dim = PS_DECODE_MAX_HEAD_DIM + 8, bad_config(c, 4, "head_dim", "264");
  c = good, c.max_context = 0, bad_config(c, 4, "max_context", "0");
  /* the bounds that keep the operator's sizes inside int and size_t */
  c = good, c.batch = PS_DECODE_MAX_BATCH + 1, bad_config(c, 4, "batch", "65537");
  c = good, c.kv_heads = 8192, c.q_heads = 8192, bad_config(c, 4, "kv_heads", "8192");
  c = good, c.kv_heads = 1, c.q_heads = PS_DECODE_MAX_HEADS + 1, bad_config(c, 4, "q_heads", "4097");
  c = good, c.max_context = PS_DECODE_MAX_CONTEXT + 1, bad_config(c, 4, "max_context", "1073741825");
  c = good, c.batch = PS_DECODE_MAX_BATCH, c.q_heads = c.kv_heads = PS_DECODE_MAX_HEADS;
  c.max_context = PS_DECODE_MAX_CONTEXT;
  EXPECT(ps_decode_check_config(&c, 4) == 0, "the largest config refused: %s", ps_decode_last_error());
  bad_config(good, 0, "ranks", "0");
  EXPECT(ps_decode_check_config(NULL, 1) == -1, "a NULL config accepted");

  int ok[3] = {1, 64, 17}, zero[3] = {5, 0, 5}, over[3] = {5, 5, 65};
  EXPECT(ps_decode_check_lengths(&good, ok) == 0, "valid lengths: %s", ps_decode_last_error());
  EXPECT(ps_decode_check_lengths(&good, zero) == -1 && strstr(ps_decode_last_error(), "sequence 1") &&
             strstr(ps_decode_last_error(), "0 tokens"),
         "an empty sequence: '%s'", ps_decode_last_error());
  EXPECT(ps_decode_check_lengths(&good, over) == -1 && strstr(ps_decode_last_error(), "sequence 2") &&
             strstr(ps_decode_last_error(), "65"),
         "a sequence over max_context: '%s'", ps_decode_last_error());
}

/* --- shards --- */
static void test_shards(void) {
  for (int len = 0; len <= 40; len++)
    for (int R = 1; R <= 9; R++) {
      int prev = 0, lo = len, hi = 0;
      for (int r = 0; r < R; r++) {
        int s, e;
        ps_decode_shard(len, R, r, &s, &e);
        EXPECT(s == prev && e >= s, "len %d, %d ranks: shard %d is [%d, %d), after %d", len, R, r, s, e,
               prev);
        prev = e;
        lo = e - s < lo ? e - s : lo, hi = e - s > hi ? e - s : hi;
      }
      EXPECT(prev == len, "len %d, %d ranks: the shards end at %d", len, R, prev);
      EXPECT(hi - lo <= 1, "len %d, %d ranks: shard sizes %d to %d", len, R, lo, hi);
    }
}

/* --- the reference --- */
static uint64_t seed = 0x9e3779b97f4a7c15ull;
static double rnd(void) { /* uniform in [-1, 1) */
  seed = seed * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(seed >> 11) / (double)(1ull << 52) - 1.0;
}

static double rel_err(const double *a, const double *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return sqrt(num / (den > 0 ? den : 1));
}

static void test_closed_forms(void) {
  ps_decode_config_t c = {.batch = 1, .q_heads = 2, .kv_heads = 1, .head_dim = 8, .max_context = 8};
  double q[16], k[64], v[64], o[16], lse[2];
  for (int i = 0; i < 16; i++) q[i] = rnd();
  for (int i = 0; i < 64; i++) k[i] = rnd(), v[i] = rnd();
  int one = 1;
  ps_decode_ref_partial(&c, 0.5, q, k, v, 8, &one, o, lse);
  for (int h = 0; h < 2; h++) {
    double s = 0;
    for (int d = 0; d < 8; d++) s += q[h * 8 + d] * k[d];
    EXPECT(fabs(lse[h] - 0.5 * s) < 1e-12, "one token: lse %g, expected %g", lse[h], 0.5 * s);
    EXPECT(rel_err(o + h * 8, v, 8) < 1e-15, "one token: the output is not its value row");
  }
  /* every key the same: equal weights, the mean of the values */
  for (int j = 1; j < 8; j++) memcpy(k + j * 8, k, 8 * sizeof *k);
  int eight = 8;
  ps_decode_ref_partial(&c, 1.0, q, k, v, 8, &eight, o, lse);
  double mean[8] = {0}, s = 0;
  for (int j = 0; j < 8; j++)
    for (int d = 0; d < 8; d++) mean[d] += v[j * 8 + d] / 8;
  for (int d = 0; d < 8; d++) s += q[d] * k[d];
  EXPECT(rel_err(o, mean, 8) < 1e-14, "equal keys: the output is not the mean of the values");
  EXPECT(fabs(lse[0] - (s + log(8.0))) < 1e-12, "equal keys: lse %g, expected %g", lse[0], s + log(8.0));
  int none = 0;
  ps_decode_ref_partial(&c, 1.0, q, k, v, 8, &none, o, lse);
  EXPECT(lse[0] == -INFINITY && o[0] == 0.0, "an empty shard: lse %g, o[0] %g", lse[0], o[0]);
}

/* Any split over ranks combines to the whole sequence's attention. */
static void check_split(const ps_decode_config_t *c, const int *len, int R, double scale) {
  const size_t B = (size_t)c->batch, D = (size_t)c->head_dim, S = (size_t)c->max_context;
  EXPECT(B <= 64 && R <= 16, "check_split takes at most 64 sequences and 16 ranks");
  if (B > 64 || R > 16) return;
  const size_t qn = B * (size_t)c->q_heads * D, kn = B * (size_t)c->kv_heads * S * D;
  double *q = malloc(qn * sizeof *q), *k = malloc(kn * sizeof *k), *v = malloc(kn * sizeof *v);
  double *whole = malloc(qn * sizeof *whole), *wlse = malloc(B * (size_t)c->q_heads * sizeof *wlse);
  double *out = malloc(qn * sizeof *out), *ks = malloc(kn * sizeof *ks), *vs = malloc(kn * sizeof *vs);
  double *o[16], *lse[16];
  for (size_t i = 0; i < qn; i++) q[i] = rnd();
  for (size_t i = 0; i < kn; i++) k[i] = rnd(), v[i] = rnd();
  ps_decode_ref_partial(c, scale, q, k, v, S, len, whole, wlse);
  for (int r = 0; r < R; r++) {
    int n[64];
    /* the rank's shard copied to the front of its own rows, as a rank holds it */
    for (size_t b = 0; b < B; b++) {
      int s0, e0;
      ps_decode_shard(len[b], R, r, &s0, &e0);
      n[b] = e0 - s0;
      for (size_t h = 0; h < (size_t)c->kv_heads; h++) {
        size_t row = (b * (size_t)c->kv_heads + h) * S * D;
        memcpy(ks + row, k + row + (size_t)s0 * D, (size_t)n[b] * D * sizeof *k);
        memcpy(vs + row, v + row + (size_t)s0 * D, (size_t)n[b] * D * sizeof *v);
      }
    }
    o[r] = malloc(qn * sizeof *o[r]), lse[r] = malloc(B * (size_t)c->q_heads * sizeof *lse[r]);
    ps_decode_ref_partial(c, scale, q, ks, vs, S, n, o[r], lse[r]);
    for (size_t i = 0; i < B * (size_t)c->q_heads; i++) /* an empty shard's output is never read */
      if (lse[r][i] == -INFINITY)
        for (size_t d = 0; d < D; d++) o[r][i * D + d] = NAN;
  }
  ps_decode_ref_combine(c, R, (const double *const *)o, (const double *const *)lse, out);
  double e = rel_err(out, whole, qn);
  EXPECT(e < 1e-12, "%d ranks, scale %g: the combined output is off by %g (relative)", R, scale, e);
  for (int r = 0; r < R; r++) free(o[r]), free(lse[r]);
  free(q), free(k), free(v), free(whole), free(wlse), free(out), free(ks), free(vs);
}

static void test_splits(void) {
  ps_decode_config_t c = {.batch = 4, .q_heads = 8, .kv_heads = 2, .head_dim = 16, .max_context = 37};
  int len[4] = {1, 5, 37, 2}; /* 1 and 2 tokens over up to 16 ranks: empty shards */
  static const int ranks[] = {1, 2, 3, 5, 8, 16};
  for (size_t i = 0; i < sizeof ranks / sizeof *ranks; i++) {
    check_split(&c, len, ranks[i], 1.0 / sqrt(16.0));
    check_split(&c, len, ranks[i], 400.0); /* scores in the hundreds: exp() must not overflow */
  }
}

int main(void) {
  test_checks();
  test_shards();
  test_closed_forms();
  test_splits();
  check_timeout_env("PERSEUS_DECODE_TIMEOUT_MS", ps_decode_env_timeout_ms, ps_decode_last_error);
  return unit_report("unit_decode");
}
