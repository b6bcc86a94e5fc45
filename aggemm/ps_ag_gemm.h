/* Fused AllGather+GEMM's host side (issue 27): the shape checks, the rows of
 * A each rank holds, which ranks a block of C's rows waits for, and the
 * reference the GPU operator will be tested against. Plain C11, no CUDA.
 *
 * R ranks each hold a contiguous block of A's M rows (ps_ag_gemm_shard:
 * sizes within one of each other, in rank order; a block may be empty when
 * M < R) and all of B (K x N); every rank computes C = A x B (M x N). Values
 * are bf16 (uint16_t bit patterns, row-major), accumulated in fp32, C
 * rounded to bf16 (ps_float_to_bf16, round to nearest even). The GPU
 * operator is <perseus/ag_gemm.h>. */
#ifndef PS_AG_GEMM_H
#define PS_AG_GEMM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int m; /* rows of A and C over all ranks, >= 1 */
  int n; /* columns of B and C: a multiple of 8 (16-byte rows of bf16) */
  int k; /* columns of A, rows of B: a multiple of 8 */
} ps_ag_gemm_shape_t;

/* The largest m, n and k: every size the operator computes then fits its
 * types (a window of 2 m k bf16, tile counts in int). */
#define PS_AG_GEMM_MAX_DIM (1 << 24)

/* 0, or -1 with the reason (naming the bad value and what was expected) in
 * ps_ag_gemm_last_error(). */
int ps_ag_gemm_check(const ps_ag_gemm_shape_t *s, int nranks);
const char *ps_ag_gemm_last_error(void);
/* Sets that reason (printf-style) and returns -1. */
int ps_ag_gemm_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Rank r's rows of A (and of C's gathered rows): [*start, *end). */
void ps_ag_gemm_shard(int m, int nranks, int rank, int *start, int *end);

/* The ranks whose rows block `block` of C (rows [block * block_rows,
 * min(m, (block + 1) * block_rows))) needs: [*first, *last], in rank order,
 * empty shards inside the range included. Returns how many, 0 for a block
 * past the last row (or bad arguments). A fused kernel may start the block
 * once every one of them delivered its rows. */
int ps_ag_gemm_block_ranks(int m, int nranks, int block_rows, int block, int *first, int *last);

/* PERSEUS_AG_GEMM_TIMEOUT_MS: how long a fused step waits for a rank's rows
 * (0: forever; unset or empty: 10 minutes); -1 (naming the variable and
 * its value) when it is not a number of milliseconds in 0..7 days. */
int ps_ag_gemm_env_timeout_ms(long long *ms);

/* C = A x B, fp32 accumulation in k order, C rounded to bf16: a [m][k],
 * b [k][n], c [m][n]. */
void ps_ag_gemm_ref(const ps_ag_gemm_shape_t *s, const uint16_t *a, const uint16_t *b, uint16_t *c);

/* Elements of c (as a GPU computed it, [m][n] bf16) that differ from the
 * fp64 product of a and b by more than bf16 rounding of the output (2^-8
 * relative) plus fp32 accumulation over k terms (k * 2^-23 of the sum of
 * the terms' magnitudes): 0 for any correct fp32-accumulated result,
 * whatever the order of the sum. *worst, when not NULL, gets the largest
 * error over its bound. */
long ps_ag_gemm_count_wrong(const ps_ag_gemm_shape_t *s, const uint16_t *a, const uint16_t *b,
                            const uint16_t *c, double *worst);

#ifdef __cplusplus
}
#endif

#endif
