/* Unit tests of fused AllGather+GEMM's host side (aggemm/ps_ag_gemm.h): shape
 * checks and their messages, the rows each rank holds, the ranks a block
 * of C waits for (against a brute-force owner map), and the references:
 * the fp32 one passes the fp64 check on random shapes (M not a multiple of
 * a block, empty shards), in any summation order, and a planted error of
 * one element is caught; PERSEUS_AG_GEMM_TIMEOUT_MS. Exit: 0 pass, 1 fail. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_ag_gemm.h"
#include "ps_moe_ref.h"

#include "unit_check.h"
#include "unit_timeout_env.h"

static void bad_shape(ps_ag_gemm_shape_t s, int nranks, const char *field, const char *value) {
  EXPECT(ps_ag_gemm_check(&s, nranks) == -1, "%s %s accepted", field, value);
  const char *e = ps_ag_gemm_last_error();
  EXPECT(strstr(e, field) && strstr(e, value), "%s %s: the error does not name it: '%s'", field,
         value, e);
}

static void test_checks(void) {
  const ps_ag_gemm_shape_t good = {.m = 130, .n = 64, .k = 72};
  EXPECT(ps_ag_gemm_check(&good, 4) == 0 && !ps_ag_gemm_last_error()[0], "a valid shape: %s",
         ps_ag_gemm_last_error());
  ps_ag_gemm_shape_t s = good;
  s.m = 0, bad_shape(s, 4, "m", "0");
  s = good, s.n = 12, bad_shape(s, 4, "n", "12");
  s = good, s.n = 0, bad_shape(s, 4, "n", "0");
  s = good, s.k = 4, bad_shape(s, 4, "k", "4");
  s = good, s.k = -8, bad_shape(s, 4, "k", "-8");
  bad_shape(good, 0, "ranks", "0");
  /* sizes that would overflow the operator's counts (16M x 16M: 2^39 / 2^15 tiles) */
  s = good, s.m = PS_AG_GEMM_MAX_DIM + 1, bad_shape(s, 4, "m", "16777217");
  s = good, s.k = PS_AG_GEMM_MAX_DIM + 8, bad_shape(s, 4, "k", "16777224");
  s = good, s.m = PS_AG_GEMM_MAX_DIM, s.n = PS_AG_GEMM_MAX_DIM, bad_shape(s, 4, "tiles", "8589934592");
  s = good, s.m = 65536, s.n = 65536, s.k = 65536;
  EXPECT(ps_ag_gemm_check(&s, 8) == 0, "65536 x 65536 x 65536 refused: %s", ps_ag_gemm_last_error());
  s = good, s.m = 3;
  EXPECT(ps_ag_gemm_check(&s, 8) == 0, "fewer rows than ranks (empty shards) refused: %s",
         ps_ag_gemm_last_error());
  EXPECT(ps_ag_gemm_check(NULL, 1) == -1, "a NULL shape accepted");
}

/* Shards cover [0, m) in rank order, sizes within one; every block's ranks
 * are exactly the owners of its rows (and the empty shards between them). */
static void test_shards_and_blocks(void) {
  for (int m = 1; m <= 70; m++)
    for (int R = 1; R <= 9; R++) {
      int owner[70], next = 0, lo = m, hi = 0;
      for (int r = 0; r < R; r++) {
        int a, b;
        ps_ag_gemm_shard(m, R, r, &a, &b);
        EXPECT(a == next && b >= a, "m %d, %d ranks: rank %d holds [%d, %d) after row %d", m, R, r, a, b,
               next);
        for (int i = a; i < b && i < m; i++) owner[i] = r;
        lo = b - a < lo ? b - a : lo, hi = b - a > hi ? b - a : hi;
        next = b;
      }
      EXPECT(next == m && hi - lo <= 1, "m %d, %d ranks: shards end at %d, sizes %d..%d", m, R, next,
             lo, hi);
      for (int br = 1; br <= 9; br += 4)
        for (int blk = 0; blk * br < m + 2 * br; blk++) {
          int first = -1, last = -1, n = ps_ag_gemm_block_ranks(m, R, br, blk, &first, &last);
          if (blk * br >= m) {
            EXPECT(n == 0, "m %d: block %d of %d rows is past the end, yet %d ranks", m, blk, br, n);
            continue;
          }
          int top = (blk + 1) * br < m ? (blk + 1) * br : m;
          EXPECT(n == last - first + 1 && first == owner[blk * br] && last == owner[top - 1],
                 "m %d, %d ranks, block %d of %d rows: ranks %d..%d (%d), rows owned by %d..%d", m, R,
                 blk, br, first, last, n, owner[blk * br], owner[top - 1]);
        }
    }
  int f, l;
  EXPECT(ps_ag_gemm_block_ranks(10, 2, 0, 0, &f, &l) == 0 && ps_ag_gemm_block_ranks(10, 0, 4, 0, &f, &l) == 0 &&
             ps_ag_gemm_block_ranks(10, 2, 4, -1, &f, &l) == 0,
         "bad block arguments not refused");
}

/* The fp32 reference passes the fp64 check on random shapes; so does a sum
 * in the other order; one element off by 2% is caught. */
static void test_reference(void) {
  static const int shapes[][3] = {{1, 8, 8}, {7, 16, 24}, {130, 24, 64}, {64, 8, 512}, {33, 40, 1024}};
  for (size_t t = 0; t < sizeof shapes / sizeof shapes[0]; t++) {
    ps_ag_gemm_shape_t s = {.m = shapes[t][0], .n = shapes[t][1], .k = shapes[t][2]};
    size_t M = (size_t)s.m, N = (size_t)s.n, K = (size_t)s.k;
    uint16_t *a = malloc(M * K * 2), *b = malloc(K * N * 2), *c = malloc(M * N * 2), *r = malloc(M * N * 2);
    if (!a || !b || !c || !r) {
      EXPECT(0, "out of memory");
      return;
    }
    ps_moe_fill_bf16(a, M * K, 100 + t, 1.0f);
    ps_moe_fill_bf16(b, K * N, 200 + t, 1.0f / sqrtf((float)K));
    ps_ag_gemm_ref(&s, a, b, c);
    double worst = 0;
    long w = ps_ag_gemm_count_wrong(&s, a, b, c, &worst);
    EXPECT(w == 0, "%dx%dx%d: the fp32 reference has %ld elements wrong (worst %.3g over)", s.m, s.n, s.k,
           w, worst);
    for (size_t i = 0; i < M; i++) /* the k terms summed backwards */
      for (size_t j = 0; j < N; j++) {
        float acc = 0.0f;
        for (size_t x = K; x-- > 0;) acc += ps_bf16_to_float(a[i * K + x]) * ps_bf16_to_float(b[x * N + j]);
        r[i * N + j] = ps_float_to_bf16(acc);
      }
    EXPECT(ps_ag_gemm_count_wrong(&s, a, b, r, NULL) == 0, "%dx%dx%d: a backward sum called wrong", s.m,
           s.n, s.k);
    size_t at = (M * N) / 2;
    float v = ps_bf16_to_float(c[at]);
    c[at] = ps_float_to_bf16(v * 1.02f + (v == 0.0f ? 0.1f : 0.0f));
    EXPECT(ps_ag_gemm_count_wrong(&s, a, b, c, NULL) == 1, "%dx%dx%d: one element 2%% off not caught", s.m,
           s.n, s.k);
    c[at] = 0x7fc0; /* NaN */
    EXPECT(ps_ag_gemm_count_wrong(&s, a, b, c, NULL) == 1, "%dx%dx%d: a NaN not caught", s.m, s.n, s.k);
    free(a), free(b), free(c), free(r);
  }
  /* a closed form: A all ones, B all twos: every element 2k */
  ps_ag_gemm_shape_t s = {.m = 3, .n = 8, .k = 16};
  uint16_t a[3 * 16], b[16 * 8], c[3 * 8];
  for (int i = 0; i < 48; i++) a[i] = ps_float_to_bf16(1.0f);
  for (int i = 0; i < 128; i++) b[i] = ps_float_to_bf16(2.0f);
  ps_ag_gemm_ref(&s, a, b, c);
  int exact = 1;
  for (int i = 0; i < 24; i++) exact &= ps_bf16_to_float(c[i]) == 32.0f;
  EXPECT(exact, "ones times twos over k = 16 is not 32 everywhere");
}

int main(void) {
  test_checks();
  test_shards_and_blocks();
  test_reference();
  check_timeout_env("PERSEUS_AG_GEMM_TIMEOUT_MS", ps_ag_gemm_env_timeout_ms, ps_ag_gemm_last_error);
  return unit_report("unit_ag_gemm");
}
