/* Flash-Decode's host side (issue 27): split-KV decode attention's shapes,
 * their checks, the split of a sequence's KV cache over ranks, and the fp64
 * reference the GPU kernels and the fused operator (<perseus/decode.h>) are
 * tested against. Plain C11, no CUDA; internal (not installed).
 *
 * Decode attention for B sequences, one new query token each: query head h
 * (of Hq) attends over its sequence's KV cache through KV head
 * h / (Hq / Hkv) (grouped-query attention), head dim D, scores scaled by
 * `scale`. The cache of a sequence of `len` tokens is cut into R contiguous
 * shards, one per rank (ps_decode_shard; a shard may be empty when len < R).
 * Each rank computes, per (sequence, query head), its shard's normalized
 * partial output o_r and log-sum-exp lse_r (empty shard: o_r = 0, lse_r =
 * -inf); the owner combines them:
 *   O = sum_r exp(lse_r - M) o_r / sum_r exp(lse_r - M),  M = max_r lse_r,
 * which equals attention over the whole sequence. */
#ifndef PS_DECODE_H
#define PS_DECODE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PS_DECODE_MAX_HEAD_DIM 256
/* Upper bounds that keep every size the operator computes inside int and
 * size_t: sequences a step, heads, tokens of one sequence. */
#define PS_DECODE_MAX_BATCH 65536
#define PS_DECODE_MAX_HEADS 4096
#define PS_DECODE_MAX_CONTEXT (1 << 30)

typedef struct {
  int batch;       /* B: sequences per step, >= 1 */
  int q_heads;     /* Hq, a multiple of kv_heads */
  int kv_heads;    /* Hkv, >= 1 */
  int head_dim;    /* D: a multiple of 8 (16-byte rows of bf16), at most PS_DECODE_MAX_HEAD_DIM */
  int max_context; /* most tokens one sequence's cache holds over all ranks, >= 1 */
} ps_decode_config_t;

/* 0, or -1 with the reason (naming the bad value and what was expected) in
 * ps_decode_last_error(). */
int ps_decode_check_config(const ps_decode_config_t *cfg, int nranks);
/* 0, or -1 (reason as above) for a step's sequence lengths: each 1..max_context. */
int ps_decode_check_lengths(const ps_decode_config_t *cfg, const int *len);
const char *ps_decode_last_error(void);
/* Sets the reason ps_decode_last_error() gives (printf format); returns -1. */
int ps_decode_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* PERSEUS_DECODE_TIMEOUT_MS: how long a fused step waits for a rank's
 * records (0: forever; unset or empty: PS_MOE_DEFAULT_TIMEOUT_MS, 10
 * minutes); -1 (naming the variable and its value) when it is not a number
 * of milliseconds in 0..7 days. */
int ps_decode_env_timeout_ms(long long *ms);

/* Rank r's shard of a sequence of `len` tokens over `nranks`: [*start, *end),
 * contiguous, in rank order, sizes differing by at most one, covering
 * [0, len) exactly; empty where len < nranks. */
void ps_decode_shard(int len, int nranks, int rank, int *start, int *end);

/* Layouts (row-major, fp64 for the reference): q [B][Hq][D]; a rank's or the
 * whole cache k, v [B][Hkv][tokens][D] with `stride` tokens a (b, head) row
 * (the shard's tokens first); o [B][Hq][D]; lse [B][Hq]. */

/* One shard: tokens [0, n[b]) of sequence b's rows of k and v (n[b] may be
 * 0), into o and lse. The whole sequence is the shard of one rank. */
void ps_decode_ref_partial(const ps_decode_config_t *cfg, double scale, const double *q,
                           const double *k, const double *v, size_t stride, const int *n,
                           double *o, double *lse);
/* The combine of `nranks` partials (o_parts[r], lse_parts[r]) into out. */
void ps_decode_ref_combine(const ps_decode_config_t *cfg, int nranks, const double *const *o_parts,
                           const double *const *lse_parts, double *out);

#ifdef __cplusplus
}
#endif

#endif
