/* perseus MoE layer: the configuration, and what can be checked without a
 * GPU. Plain C (no CUDA or NCCL headers); include/perseus/moe.h has the
 * layer itself and its definition. */
#ifndef PERSEUS_MOE_CONFIG_H
#define PERSEUS_MOE_CONFIG_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PERSEUS_MOE_TILE 64   /* hidden and ffn must be multiples of this */
#define PERSEUS_MOE_MAX_TOPK 16

typedef struct {
  int hidden;      /* H: model width, a multiple of PERSEUS_MOE_TILE */
  int ffn;         /* F: expert intermediate width, a multiple of PERSEUS_MOE_TILE */
  int experts;     /* E: total experts, divisible by the number of ranks */
  int topk;        /* k: 1..min(E, PERSEUS_MOE_MAX_TOPK) */
  int max_tokens;  /* most tokens per rank in one forward, >= 1 */
  int renormalize; /* 1: top-k weights divided by their sum (Qwen3, DeepSeek); 0: raw */
  int batch;       /* NVLink dispatch rows per signal; 0: one signal per (destination, expert) */
  int gin_per_expert; /* GIN peers: 0 (default): one put each way per (source, destination) pair,
                         an expert starts when every source's rows arrived; 1: one put per
                         (destination, expert) segment in chunks of `batch` rows, each expert
                         starts on its own rows (more puts, more overlap) */
} perseus_moe_config_t;

/* Checks a config for `nranks` ranks: 0, or -1 with the reason (naming the
 * bad value and what was expected) in perseus_moe_last_error(). */
int perseus_moe_check_config(const perseus_moe_config_t *cfg, int nranks);

/* The reason for the calling thread's last error ("" if none). */
const char *perseus_moe_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
