/* perseus MoE: the per-thread error, config checks and the device buffer
 * layout. Plain C11; the GPU side calls these before it allocates. */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_moe_ref.h"

static _Thread_local char ps_moe_err[512];

const char *perseus_moe_last_error(void) { return ps_moe_err; }

void ps_moe_clear_error(void) { ps_moe_err[0] = '\0'; }

static int ps_moe_ieq(const char *a, const char *b) {
  for (; *a && *b; a++, b++)
    if (toupper((unsigned char)*a) != toupper((unsigned char)*b)) return 0;
  return *a == *b;
}

/* Read on every error, not cached: errors are rare and tests change it. */
static int ps_moe_log_enabled(void) {
  const char *v = getenv("NCCL_DEBUG");
  return v && (ps_moe_ieq(v, "WARN") || ps_moe_ieq(v, "INFO") || ps_moe_ieq(v, "TRACE"));
}

void ps_moe_set_error(const char *fmt, ...) {
  /* via a local buffer: the arguments may point into ps_moe_err itself */
  char msg[sizeof ps_moe_err];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  memcpy(ps_moe_err, msg, sizeof msg);
  if (ps_moe_log_enabled()) fprintf(stderr, "perseus moe: %s\n", ps_moe_err);
}

/* Digits only, no leading zero: strtol would also take " 64", "+64", "064". */
static int unsigned_decimal(const char *v) {
  if (!isdigit((unsigned char)v[0]) || (v[0] == '0' && v[1])) return 0;
  for (; *v; v++)
    if (!isdigit((unsigned char)*v)) return 0;
  return 1;
}

/* --- GEMM tile rows --- */

int ps_moe_env_tile_rows(int *out) {
  const char *v = getenv("PERSEUS_MOE_TILE_ROWS");
  *out = 0;
  if (!v || !*v) return 0;
  long n = unsigned_decimal(v) && strlen(v) < 8 ? strtol(v, NULL, 10) : -1;
  if (n != 0 && n != 64 && n != 128) {
    ps_moe_set_error("PERSEUS_MOE_TILE_ROWS '%s': expected 0 (automatic), 64 or 128", v);
    return -1;
  }
  *out = (int)n;
  return 0;
}

int ps_env_timeout_ms(const char *var, long long *out) {
  const char *v = getenv(var);
  *out = PS_MOE_DEFAULT_TIMEOUT_MS;
  if (!v || !*v) return 0;
  char *end;
  errno = 0;
  long long n = strtoll(v, &end, 10);
  if (!unsigned_decimal(v) || *end || errno || n > PS_MOE_MAX_TIMEOUT_MS) return -1;
  *out = n;
  return 0;
}

int ps_moe_env_timeout_ms(long long *out) {
  if (ps_env_timeout_ms("PERSEUS_MOE_TIMEOUT_MS", out) == 0) return 0;
  ps_moe_set_error("PERSEUS_MOE_TIMEOUT_MS '%s': expected milliseconds in 0..%lld (0: wait forever)",
                   getenv("PERSEUS_MOE_TIMEOUT_MS"), (long long)PS_MOE_MAX_TIMEOUT_MS);
  return -1;
}

int ps_moe_tile_rows(const perseus_moe_config_t *cfg, int nranks, int ntokens, int forced) {
  if (forced) return forced;
  uint64_t rows = (uint64_t)ntokens * (uint64_t)cfg->topk * (uint64_t)nranks;
  /* 128-row tiles from 48 rows per expert on average: each weight tile
   * loaded serves twice the rows; 64-row tiles below: small experts pad
   * fewer rows and give more tasks to spread across the CTAs */
  return rows >= 48 * (uint64_t)cfg->experts ? 128 : 64;
}

/* --- layout --- */

static uint64_t ps_moe_buffer_limit(void) {
  return (uint64_t)SIZE_MAX < PS_MOE_MAX_BUFFER_BYTES ? (uint64_t)SIZE_MAX : PS_MOE_MAX_BUFFER_BYTES;
}

/* The product of n factors into *out; -1 (naming the buffer and its factors)
 * on 64-bit overflow. */
static int ps_moe_product(const char *name, int n, const uint64_t *f, uint64_t *out) {
  uint64_t v = 1;
  int ovf = 0;
  for (int i = 0; i < n; i++) {
    if (f[i] && v > UINT64_MAX / f[i]) ovf = 1;
    v *= f[i];
  }
  if (ovf) {
    char desc[160];
    size_t len = 0;
    desc[0] = '\0';
    for (int i = 0; i < n && len < sizeof desc; i++)
      len += (size_t)snprintf(desc + len, sizeof desc - len, "%s%" PRIu64, i ? " x " : "", f[i]);
    ps_moe_set_error("%s = %s overflows 64 bits", name, desc);
    return -1;
  }
  *out = v;
  return 0;
}

static int ps_moe_fits(const char *name, uint64_t bytes, size_t *out) {
  uint64_t lim = ps_moe_buffer_limit();
  if (bytes > lim) {
    ps_moe_set_error("%s needs %" PRIu64 " bytes, more than %" PRIu64 " (the most for one buffer)", name,
                     bytes, lim);
    return -1;
  }
  *out = (size_t)bytes;
  return 0;
}

int ps_moe_layout(const perseus_moe_config_t *cfg, int nranks, ps_moe_layout_t *out) {
  if (!cfg || !out) {
    ps_moe_set_error("layout: %s is NULL", cfg ? "out" : "cfg");
    return -1;
  }
  const struct {
    const char *name;
    int v;
  } pos[] = {{"nranks", nranks},        {"hidden", cfg->hidden}, {"ffn", cfg->ffn},
             {"experts", cfg->experts}, {"topk", cfg->topk},     {"max_tokens", cfg->max_tokens}};
  for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++) {
    if (pos[i].v < 1) {
      ps_moe_set_error("%s %d must be >= 1", pos[i].name, pos[i].v);
      return -1;
    }
  }
  if (cfg->experts % nranks) {
    ps_moe_set_error("experts %d is not divisible by %d ranks", cfg->experts, nranks);
    return -1;
  }
  ps_moe_layout_t l;
  memset(&l, 0, sizeof l);
  l.local_experts = cfg->experts / nranks;
  uint64_t R = (uint64_t)nranks, H = (uint64_t)cfg->hidden, F = (uint64_t)cfg->ffn;
  uint64_t L = (uint64_t)l.local_experts, E = (uint64_t)cfg->experts;
  uint64_t per_token = (uint64_t)(cfg->topk < l.local_experts ? cfg->topk : l.local_experts);
  uint64_t rows = (uint64_t)cfg->max_tokens * per_token; /* < 2^31 * 2^31: no overflow */
  l.rows_per_peer = (size_t)rows;

  uint64_t row_h, row_f, w_exp, w_gate, w;
  if (ps_moe_product("recv_bytes", 4, (const uint64_t[]){R, rows, H, 2}, &row_h) ||
      ps_moe_product("act_bytes", 4, (const uint64_t[]){R, rows, F, 2}, &row_f) ||
      ps_moe_product("weight_bytes", 5, (const uint64_t[]){L, 3, F, H, 2}, &w_exp) ||
      ps_moe_product("weight_bytes", 3, (const uint64_t[]){E, H, 2}, &w_gate))
    return -1;
  if (w_exp > UINT64_MAX - w_gate) {
    ps_moe_set_error("weight_bytes = %" PRIu64 " + %" PRIu64 " overflows 64 bits", w_exp, w_gate);
    return -1;
  }
  w = w_exp + w_gate;
  if (ps_moe_fits("recv_bytes", row_h, &l.recv_bytes) || ps_moe_fits("send_bytes", row_h, &l.send_bytes) ||
      ps_moe_fits("comb_bytes", row_h, &l.comb_bytes) || ps_moe_fits("act_bytes", row_f, &l.act_bytes) ||
      ps_moe_fits("y_bytes", row_h, &l.y_bytes) || ps_moe_fits("weight_bytes", w, &l.weight_bytes))
    return -1;
  /* each term is <= 2^46, so the sum of seven fits 64 bits */
  uint64_t total = 4 * row_h + row_f + w;
  if (total > (uint64_t)SIZE_MAX) {
    ps_moe_set_error("total_bytes %" PRIu64 " does not fit size_t", total);
    return -1;
  }
  l.total_bytes = (size_t)total;
  *out = l;
  return 0;
}

/* --- config --- */

static int ps_moe_check_width(const char *name, int v) {
  if (v < 1 || v > PS_MOE_MAX_WIDTH) {
    ps_moe_set_error("%s %d must be in %d..%d", name, v, PERSEUS_MOE_TILE, PS_MOE_MAX_WIDTH);
    return -1;
  }
  if (v % PERSEUS_MOE_TILE) {
    ps_moe_set_error("%s %d is not a multiple of %d (PERSEUS_MOE_TILE)", name, v, PERSEUS_MOE_TILE);
    return -1;
  }
  return 0;
}

int perseus_moe_check_config(const perseus_moe_config_t *cfg, int nranks) {
  if (!cfg) {
    ps_moe_set_error("config is NULL");
    return -1;
  }
  if (nranks < 1 || nranks > PS_MOE_MAX_RANKS) {
    ps_moe_set_error("nranks %d must be in 1..%d", nranks, PS_MOE_MAX_RANKS);
    return -1;
  }
  if (ps_moe_check_width("hidden", cfg->hidden) || ps_moe_check_width("ffn", cfg->ffn)) return -1;
  if (cfg->experts < 1 || cfg->experts > PS_MOE_MAX_EXPERTS) {
    ps_moe_set_error("experts %d must be in 1..%d", cfg->experts, PS_MOE_MAX_EXPERTS);
    return -1;
  }
  if (cfg->experts % nranks) {
    ps_moe_set_error("experts %d is not divisible by %d ranks", cfg->experts, nranks);
    return -1;
  }
  int kmax = cfg->experts < PERSEUS_MOE_MAX_TOPK ? cfg->experts : PERSEUS_MOE_MAX_TOPK;
  if (cfg->topk < 1 || cfg->topk > kmax) {
    ps_moe_set_error("topk %d must be in 1..%d (min(experts, PERSEUS_MOE_MAX_TOPK))", cfg->topk, kmax);
    return -1;
  }
  if (cfg->max_tokens < 1 || cfg->max_tokens > PS_MOE_MAX_TOKENS) {
    ps_moe_set_error("max_tokens %d must be in 1..%d", cfg->max_tokens, PS_MOE_MAX_TOKENS);
    return -1;
  }
  if (cfg->renormalize != 0 && cfg->renormalize != 1) {
    ps_moe_set_error("renormalize %d must be 0 or 1", cfg->renormalize);
    return -1;
  }
  if (cfg->batch < 0 || cfg->batch > PS_MOE_MAX_BATCH) {
    ps_moe_set_error("batch %d must be in 0..%d (0: one signal per destination and expert)", cfg->batch,
                     PS_MOE_MAX_BATCH);
    return -1;
  }
  if (cfg->gin_per_expert != 0 && cfg->gin_per_expert != 1) {
    ps_moe_set_error("gin_per_expert %d must be 0 (one GIN put per destination) or 1 (one per "
                     "destination and expert)", cfg->gin_per_expert);
    return -1;
  }
  ps_moe_layout_t l;
  return ps_moe_layout(cfg, nranks, &l);
}

/* --- agreement across ranks --- */

void ps_agree_pack(const int64_t *vals, int n, int valid, int64_t *out) {
  for (int i = 0; i < n; i++) out[i] = vals[i], out[n + 1 + i] = -vals[i];
  out[n] = valid ? 1 : 0, out[2 * n + 1] = -out[n];
}

int ps_agree_verdict(const char *const *names, const int64_t *vals, int n, int nranks, const int64_t *maxed,
                     const char *api, const char *noun, char *err, size_t len) {
  if (-maxed[2 * n + 1] < 1) { /* some rank refused (its own error says why) */
    snprintf(err, len, "another rank's config was refused (its %s_last_error() says why): the %s is "
             "created on every rank or on none", api, noun);
    return -1;
  }
  for (int i = 0; i < n; i++) {
    const int64_t lo = -maxed[n + 1 + i], hi = maxed[i];
    if (lo != hi) {
      snprintf(err, len, "ranks disagree on the config: %s is %" PRId64 " here and ranges over %" PRId64
               "..%" PRId64 " across the %d ranks (every rank must create the %s with the same config)",
               names[i], vals[i], lo, hi, nranks, noun);
      return -1;
    }
  }
  return 0;
}

static const char *const ps_moe_agree_names[PS_MOE_AGREE_FIELDS - 1] = {
    "hidden", "ffn", "experts", "topk", "max_tokens", "renormalize", "batch", "gin_per_expert"};

static void ps_moe_agree_values(const perseus_moe_config_t *cfg, int64_t v[PS_MOE_AGREE_FIELDS - 1]) {
  const int f[PS_MOE_AGREE_FIELDS - 1] = {cfg->hidden,     cfg->ffn,        cfg->experts, cfg->topk,
                                          cfg->max_tokens, cfg->renormalize, cfg->batch,  cfg->gin_per_expert};
  for (int i = 0; i < PS_MOE_AGREE_FIELDS - 1; i++) v[i] = f[i];
}

void ps_moe_agree_pack(const perseus_moe_config_t *cfg, int valid, int64_t out[2 * PS_MOE_AGREE_FIELDS]) {
  int64_t v[PS_MOE_AGREE_FIELDS - 1];
  ps_moe_agree_values(cfg, v);
  ps_agree_pack(v, PS_MOE_AGREE_FIELDS - 1, valid, out);
}

int ps_moe_agree_check(const perseus_moe_config_t *cfg, int nranks, const int64_t maxed[2 * PS_MOE_AGREE_FIELDS]) {
  int64_t v[PS_MOE_AGREE_FIELDS - 1];
  char why[sizeof ps_moe_err];
  ps_moe_agree_values(cfg, v);
  if (ps_agree_verdict(ps_moe_agree_names, v, PS_MOE_AGREE_FIELDS - 1, nranks, maxed, "perseus_moe", "layer",
                       why, sizeof why) == 0)
    return 0;
  ps_moe_set_error("%s", why);
  return -1;
}

void ps_moe_fault_text(char *buf, size_t len, int rank, const ps_moe_fault_t *f,
                       unsigned long long timeout_ms) {
  static const char *const waits[] = {"its header", "its rows", "its results"};
  const char *w = f->what >= 0 && f->what < (int)(sizeof(waits) / sizeof(waits[0])) ? waits[f->what] : "?";
  char why[320];
  if (f->kind == PS_MOE_FAULT_HEADER)
    snprintf(why, sizeof(why), "refused a header from rank %d: local expert %d has %d rows (%lld "
             "with the experts before it), at most %d are allowed from one source (max_tokens x "
             "min(topk, local experts)); its rows were dropped", f->peer, f->expert, f->count,
             f->rows, f->room);
  else if (f->kind == PS_MOE_FAULT_PEER && f->expert >= 0) /* a poisoned done mark */
    snprintf(why, sizeof(why), "got no valid results from rank %d for its local expert %d (that "
             "rank failed this one: see its error)", f->peer, f->expert);
  else if (f->kind == PS_MOE_FAULT_PEER) /* told while it waited (ps_moe_told, a GIN poison) */
    snprintf(why, sizeof(why), "waited for %s from rank %d, which failed this rank (see its "
             "error)", w, f->peer);
  else if (f->kind == PS_MOE_FAULT_TIMEOUT)
    snprintf(why, sizeof(why), "waited %llu ms (PERSEUS_MOE_TIMEOUT_MS) for %s from rank %d: the "
             "forward went on without them", timeout_ms, w, f->peer);
  else if (f->kind == PS_MOE_FAULT_ABORT)
    snprintf(why, sizeof(why), "was aborted (perseus_moe_abort) while it waited for %s from rank "
             "%d", w, f->peer);
  else
    snprintf(why, sizeof(why), "failed (fault %d, unknown to this build) concerning rank %d",
             f->kind, f->peer);
  snprintf(buf, len, "rank %d %s; that forward's output is not valid and the layer cannot run "
           "further forwards: destroy it", rank, why);
}
