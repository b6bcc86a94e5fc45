/* Host side of the perseus MoE layer (internal): the per-thread error, the
 * device buffer layout, model presets, and an fp64 CPU reference of the
 * layer defined in include/perseus/moe.h for tests. Plain C11 (usable from
 * C++/CUDA host code); bf16 values are uint16_t bit patterns. */
#ifndef PS_MOE_REF_H
#define PS_MOE_REF_H

#include <stddef.h>
#include <stdint.h>

#include "perseus/moe_config.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define PS_MOE_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define PS_MOE_PRINTF(f, a)
#endif

/* Limits perseus_moe_check_config enforces. */
#define PS_MOE_MAX_RANKS 4096
#define PS_MOE_MAX_WIDTH 65536 /* hidden and ffn */
#define PS_MOE_MAX_EXPERTS 4096
#define PS_MOE_MAX_TOKENS (1 << 20)
#define PS_MOE_MAX_BATCH (1 << 20)
#define PS_MOE_MAX_BUFFER_BYTES ((uint64_t)1 << 46) /* any one device buffer */

/* Tokens per rank of the two benchmark regimes. */
#define PS_MOE_DECODE_TOKENS 128
#define PS_MOE_PREFILL_TOKENS 4096

/* --- errors (moe_config.c) ---
 * Formats the calling thread's perseus_moe_last_error(); also printed to
 * stderr as "perseus moe: <message>" when NCCL_DEBUG is WARN, INFO or TRACE. */
void ps_moe_set_error(const char *fmt, ...) PS_MOE_PRINTF(1, 2);
void ps_moe_clear_error(void);

/* --- device buffer sizes (moe_config.c), all in bytes ---
 * A source sends a destination at most min(topk, local_experts) rows per
 * token (one per chosen expert that lives there), hence rows_per_peer. */
typedef struct {
  int local_experts;    /* L = experts / nranks */
  size_t rows_per_peer; /* max_tokens * min(topk, L) */
  size_t recv_bytes;    /* dispatch receive: [source][row][hidden] bf16 */
  size_t send_bytes;    /* gathered outgoing rows: [destination][row][hidden] bf16 */
  size_t comb_bytes;    /* combine receive: [destination][row][hidden] bf16 */
  size_t act_bytes;     /* activation scratch: [nranks * rows_per_peer][ffn] bf16 */
  size_t y_bytes;       /* expert output rows before they go back: [rows][hidden] bf16 */
  size_t weight_bytes;  /* L * (W1, W3 [ffn][hidden], W2 [hidden][ffn]) + gate [experts][hidden] */
  size_t total_bytes;   /* the sum of the above */
} ps_moe_layout_t;

/* 0, or -1 with the error set when a field is not positive, experts is not
 * divisible by nranks, or a size overflows or exceeds PS_MOE_MAX_BUFFER_BYTES.
 * Does not apply the other limits of perseus_moe_check_config. */
int ps_moe_layout(const perseus_moe_config_t *cfg, int nranks, ps_moe_layout_t *out);

/* --- agreement across ranks (moe_config.c) ---
 * perseus_moe_create packs each rank's config and whether it passed
 * perseus_moe_check_config into v, -v (PS_MOE_AGREE_FIELDS each), takes the
 * element-wise maximum over the ranks (one all-reduce: both the maximum and
 * the minimum of every field), and checks the result: 0 when every rank's
 * config is valid and the same, else -1 with the field, this rank's value
 * and the range across the ranks in the error. Every rank reaches the same
 * verdict, so none goes on into a collective that the others left. */
#define PS_MOE_AGREE_FIELDS 9
/* The same for any operator's n fields (the fused decode's and AG+GEMM's
 * too): out holds 2 (n + 1) values, the fields and `valid`, then their
 * negations; ps_agree_verdict takes the element-wise maximum over the ranks
 * and this rank's fields: 0, or -1 with the reason in err (api: the
 * operator's prefix, for its _last_error(); noun: "layer", "operator"). */
void ps_agree_pack(const int64_t *vals, int n, int valid, int64_t *out);
int ps_agree_verdict(const char *const *names, const int64_t *vals, int n, int nranks, const int64_t *maxed,
                     const char *api, const char *noun, char *err, size_t len);
void ps_moe_agree_pack(const perseus_moe_config_t *cfg, int valid, int64_t out[2 * PS_MOE_AGREE_FIELDS]);
int ps_moe_agree_check(const perseus_moe_config_t *cfg, int nranks,
                       const int64_t maxed[2 * PS_MOE_AGREE_FIELDS]);

/* --- a failed forward's reason (moe_config.c) ---
 * The kernel records the layer's first fault (moe_peers.cuh) in host-mapped
 * memory; perseus_moe_forward and perseus_moe_last_profile report it. */
enum { PS_MOE_FAULT_NONE, PS_MOE_FAULT_HEADER, PS_MOE_FAULT_TIMEOUT, PS_MOE_FAULT_ABORT,
       PS_MOE_FAULT_PEER };
enum { PS_MOE_WAIT_HEADER, PS_MOE_WAIT_ROWS, PS_MOE_WAIT_RESULTS };
typedef struct {
  int kind, peer; /* PS_MOE_FAULT_*, and the peer it concerns */
  int what;       /* the wait (PS_MOE_WAIT_*) */
  int expert;     /* a refused header's expert; a poisoned mark's; -1: the peer told us */
  int count, room; /* a refused header: that expert's count, the most one source may send */
  long long rows; /* and the rows of the experts up to that one */
} ps_moe_fault_t;
/* "rank R <what happened>; that forward's output is not valid and the layer
 * cannot run further forwards: destroy it", into buf (always terminated). */
void ps_moe_fault_text(char *buf, size_t len, int rank, const ps_moe_fault_t *f,
                       unsigned long long timeout_ms);

/* --- GEMM tile rows (moe_config.c) ---
 * PERSEUS_MOE_TILE_ROWS: 0 (automatic), 64 or 128; -1 with the variable
 * named in the error if it holds anything else. */
int ps_moe_env_tile_rows(int *out);
/* PERSEUS_MOE_TIMEOUT_MS: how long a forward waits for a peer's header,
 * rows or results before the layer fails (0: forever); the default when
 * unset or empty, -1 with the variable named in the error when it is not a
 * number of milliseconds in 0..PS_MOE_MAX_TIMEOUT_MS. */
#define PS_MOE_DEFAULT_TIMEOUT_MS 600000LL /* 10 minutes: PyTorch's default for a collective */
#define PS_MOE_MAX_TIMEOUT_MS (7LL * 24 * 3600 * 1000)
int ps_moe_env_timeout_ms(long long *out);
/* The same rule for any operator's variable `var` (the fused decode and
 * AG+GEMM's too): 0 with the value (or the default), -1 when it is not a
 * number of milliseconds in 0..PS_MOE_MAX_TIMEOUT_MS (the caller names it). */
int ps_env_timeout_ms(const char *var, long long *out);
/* The tile rows a forward uses: `forced` if non-zero, else 128 once the
 * rows an expert gets on average (ntokens * topk * nranks / experts, every
 * rank taken to have ntokens) reach 48, so that a tile reads the weights for
 * more rows, else 64 (a deeper weight pipeline for few rows). */
int ps_moe_tile_rows(const perseus_moe_config_t *cfg, int nranks, int ntokens, int forced);

/* --- model shapes (moe_presets.c) --- */
typedef struct {
  const char *name;
  int hidden, ffn, experts, topk, renormalize;
} ps_moe_preset_t;

const ps_moe_preset_t *ps_moe_presets(int *n);
const ps_moe_preset_t *ps_moe_preset_find(const char *name); /* NULL if unknown */
perseus_moe_config_t ps_moe_preset_config(const ps_moe_preset_t *p, int max_tokens, int batch);

/* --- fp64 reference (moe_ref.c) --- */
float ps_bf16_to_float(uint16_t b);
uint16_t ps_float_to_bf16(float f); /* round to nearest even; NaN stays NaN */

/* logits [T][E] = x [T][H] . gate [E][H]^T, in fp64. */
void ps_moe_ref_logits(const perseus_moe_config_t *c, const uint16_t *x, int T, const uint16_t *gate,
                       double *logits);

/* Whether a GPU's routing of one token (topk ids and fp32 weights, any order)
 * is acceptable given the fp64 logits of that token: ids distinct and in
 * range, each chosen logit >= the k-th largest - tol (fp32 logits may break
 * near-ties differently), and each weight within 1e-3 + 1e-2 * |want| of the
 * fp64 weight for the chosen set. 0, or -1 with the reason in `why`. */
int ps_moe_ref_check_routing(const perseus_moe_config_t *c, const double *logits_row, const int32_t *idx,
                             const float *w, double tol, char *why, size_t whylen);

/* y [H] = W2 (silu(W1 x) * (W3 x)) for one expert, fp64 throughout.
 * w1, w3: [F][H]; w2: [H][F]. */
void ps_moe_ref_expert(const perseus_moe_config_t *c, const uint16_t *x_row, const uint16_t *w1,
                       const uint16_t *w3, const uint16_t *w2, double *y);

/* out_row [H] = sum_i w[i] * y_{idx[i]}(x_row) over the topk given ids, with
 * the global weights w1_all, w3_all [E][F][H] and w2_all [E][H][F]. The ids
 * must be valid (check them with ps_moe_ref_check_routing first). */
void ps_moe_ref_token(const perseus_moe_config_t *c, const uint16_t *x_row, const int32_t *idx,
                      const float *w, const uint16_t *w1_all, const uint16_t *w3_all, const uint16_t *w2_all,
                      double *out_row);

/* Counts elements with |got - want| > atol + rtol * |want| (a NaN counts).
 * 0 if none, else -1. Optional outputs: nbad, max_err (max |got - want|,
 * infinity for a NaN), first_bad (n if none). For a GPU forward, rtol 2e-2
 * and atol 2e-2 * ps_moe_rms(want): the GPU rounds the activation to bf16
 * before the second GEMM and the output to bf16. */
int ps_moe_ref_compare(const uint16_t *got, const double *want, size_t n, double rtol, double atol,
                       size_t *nbad, double *max_err, size_t *first_bad);
double ps_moe_rms(const double *v, size_t n);

/* Deterministic test data, the same for CPU and GPU tests: splitmix64, and
 * n values uniform in [-scale, scale) rounded to bf16. Tests use x with scale
 * 1, gate, W1 and W3 with 1/sqrt(hidden), W2 with 1/sqrt(ffn). */
uint64_t ps_moe_rand(uint64_t *state);
void ps_moe_fill_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale);

#ifdef __cplusplus
}
#endif
#endif
