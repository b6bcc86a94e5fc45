/* Unit tests of the MoE host side (moe/): bf16 conversion, config checks
 * and their messages, the device buffer layout, the fp64 reference against
 * closed forms, routing acceptance and output comparison.
 * Exit: 0 pass, 1 fail. */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_moe_ref.h"

#include "unit_check.h"

#include "unit_capture.h" /* capture_begin/capture_end around what writes to stderr */

static uint16_t bf(float f) { return ps_float_to_bf16(f); }
static int is_nan_bf16(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

static float f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* --- bf16 --- */
static void test_bf16(void) {
  EXPECT(ps_bf16_to_float(0x3f80) == 1.0f, "0x3f80 is %g, not 1", ps_bf16_to_float(0x3f80));
  EXPECT(ps_bf16_to_float(0xc040) == -3.0f, "0xc040 is %g, not -3", ps_bf16_to_float(0xc040));
  EXPECT(isinf(ps_bf16_to_float(0x7f80)), "0x7f80 is not infinity");
  struct {
    uint32_t in;
    uint16_t out;
    const char *what;
  } r[] = {
      {0x3f800000, 0x3f80, "1.0 exact"},
      {0x3f808000, 0x3f80, "1 + 2^-8: tie to even (down)"},
      {0x3f818000, 0x3f82, "1 + 3*2^-8: tie to even (up)"},
      {0x3f808001, 0x3f81, "just above the tie rounds up"},
      {0x3f807fff, 0x3f80, "just below the tie rounds down"},
      {0xbf818000, 0xbf82, "negative tie to even"},
      {0x7f7fffff, 0x7f80, "FLT_MAX rounds to infinity"},
      {0x00018000, 0x0002, "subnormal tie to even (up)"},
      {0x80000000, 0x8000, "-0 keeps its sign"},
  };
  for (size_t i = 0; i < sizeof r / sizeof r[0]; i++) {
    uint16_t got = ps_float_to_bf16(f32(r[i].in));
    EXPECT(got == r[i].out, "%s: 0x%08x -> 0x%04x, expected 0x%04x", r[i].what, (unsigned)r[i].in, got,
           r[i].out);
  }
  /* payload only in the dropped bits: truncation would give infinity */
  EXPECT(is_nan_bf16(ps_float_to_bf16(f32(0x7f800001))), "NaN 0x7f800001 -> 0x%04x",
         ps_float_to_bf16(f32(0x7f800001)));
  EXPECT(is_nan_bf16(ps_float_to_bf16(f32(0xffffffff))), "NaN 0xffffffff -> 0x%04x",
         ps_float_to_bf16(f32(0xffffffff)));
  int bad = 0;
  for (uint32_t b = 0; b <= 0xffff; b++) {
    uint16_t back = ps_float_to_bf16(ps_bf16_to_float((uint16_t)b));
    bad += is_nan_bf16((uint16_t)b) ? !is_nan_bf16(back) : back != b;
  }
  EXPECT(bad == 0, "%d of 65536 bf16 values did not round-trip", bad);
}

/* --- errors and config --- */
static const perseus_moe_config_t base = {
    .hidden = 128, .ffn = 256, .experts = 16, .topk = 4, .max_tokens = 64, .renormalize = 1, .batch = 0};

enum { NRANKS = -1 }; /* a case that changes nranks instead of a field */

static void test_config(void) {
  int n = 0;
  const ps_moe_preset_t *p = ps_moe_presets(&n);
  EXPECT(n == 3, "%d presets, expected 3", n);
  const int ranks[] = {1, 2, 4, 8};
  for (int i = 0; i < n; i++)
    for (size_t r = 0; r < sizeof ranks / sizeof ranks[0]; r++)
      for (int t = 0; t < 2; t++) {
        int tokens = t ? PS_MOE_PREFILL_TOKENS : PS_MOE_DECODE_TOKENS;
        perseus_moe_config_t c = ps_moe_preset_config(&p[i], tokens, t ? 64 : 0);
        EXPECT(perseus_moe_check_config(&c, ranks[r]) == 0, "%s at %d ranks, %d tokens refused: %s",
               p[i].name, ranks[r], tokens, perseus_moe_last_error());
      }
  const ps_moe_preset_t *g = ps_moe_preset_find("gpt-oss-120b");
  EXPECT(g && g->hidden == 2880 && g->ffn == 2880 && g->experts == 128 && g->topk == 4,
         "gpt-oss-120b preset missing or wrong");
  const ps_moe_preset_t *d = ps_moe_preset_find("deepseek-v3");
  EXPECT(d && d->hidden == 7168 && d->ffn == 2048 && d->experts == 256 && d->topk == 8 && d->renormalize == 1,
         "deepseek-v3 preset missing or wrong");
  EXPECT(ps_moe_preset_find("qwen3") == NULL && ps_moe_preset_find(NULL) == NULL, "unknown name found");

  perseus_moe_config_t c = base;
  EXPECT(perseus_moe_check_config(&c, 4) == 0, "base config refused: %s", perseus_moe_last_error());
  /* limits are inclusive */
  struct {
    size_t off;
    int v, nranks;
  } ok[] = {
      {offsetof(perseus_moe_config_t, hidden), 65536, 4},
      {offsetof(perseus_moe_config_t, ffn), 64, 4},
      {offsetof(perseus_moe_config_t, topk), 16, 4},
      {offsetof(perseus_moe_config_t, max_tokens), 1 << 20, 4},
      {offsetof(perseus_moe_config_t, renormalize), 0, 4},
      {offsetof(perseus_moe_config_t, batch), 1 << 20, 4},
      {offsetof(perseus_moe_config_t, gin_per_expert), 1, 4},
      {offsetof(perseus_moe_config_t, experts), 4096, 4096},
  };
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    c = base;
    *(int *)((char *)&c + ok[i].off) = ok[i].v;
    EXPECT(perseus_moe_check_config(&c, ok[i].nranks) == 0, "boundary value %d refused: %s", ok[i].v,
           perseus_moe_last_error());
  }

  /* each bad value is refused, and the message says "<field> <value>" */
  struct {
    long off; /* NRANKS: the value is nranks */
    int v, nranks;
    const char *named, *also;
  } bad[] = {
      {offsetof(perseus_moe_config_t, hidden), 1000, 4, "hidden 1000 ", "multiple of 64 (PERSEUS_MOE_TILE)"},
      {offsetof(perseus_moe_config_t, hidden), 0, 4, "hidden 0 ", NULL},
      {offsetof(perseus_moe_config_t, hidden), -64, 4, "hidden -64 ", NULL},
      {offsetof(perseus_moe_config_t, hidden), 65600, 4, "hidden 65600 ", "65536"},
      {offsetof(perseus_moe_config_t, ffn), 100, 4, "ffn 100 ", "PERSEUS_MOE_TILE"},
      {offsetof(perseus_moe_config_t, ffn), 0, 4, "ffn 0 ", NULL},
      {offsetof(perseus_moe_config_t, ffn), 131072, 4, "ffn 131072 ", NULL},
      {offsetof(perseus_moe_config_t, experts), 0, 4, "experts 0 ", NULL},
      {offsetof(perseus_moe_config_t, experts), 130, 4, "experts 130 ", "divisible by 4 ranks"},
      {offsetof(perseus_moe_config_t, experts), 8192, 4, "experts 8192 ", "4096"},
      {offsetof(perseus_moe_config_t, topk), 0, 4, "topk 0 ", "1..16 (min(experts, PERSEUS_MOE_MAX_TOPK))"},
      {offsetof(perseus_moe_config_t, topk), 17, 4, "topk 17 ", "1..16"},
      {offsetof(perseus_moe_config_t, max_tokens), 0, 4, "max_tokens 0 ", NULL},
      {offsetof(perseus_moe_config_t, max_tokens), -1, 4, "max_tokens -1 ", NULL},
      {offsetof(perseus_moe_config_t, max_tokens), (1 << 20) + 1, 4, "max_tokens 1048577 ", NULL},
      {offsetof(perseus_moe_config_t, renormalize), 2, 4, "renormalize 2 ", "0 or 1"},
      {offsetof(perseus_moe_config_t, renormalize), -1, 4, "renormalize -1 ", NULL},
      {offsetof(perseus_moe_config_t, batch), -1, 4, "batch -1 ", NULL},
      {offsetof(perseus_moe_config_t, batch), (1 << 20) + 1, 4, "batch 1048577 ", NULL},
      {offsetof(perseus_moe_config_t, gin_per_expert), 2, 4, "gin_per_expert 2 ", "0 (one GIN put per destination)"},
      {offsetof(perseus_moe_config_t, gin_per_expert), -1, 4, "gin_per_expert -1 ", NULL},
      {NRANKS, 0, 0, "nranks 0 ", NULL},
      {NRANKS, -1, -1, "nranks -1 ", NULL},
      {NRANKS, 5000, 5000, "nranks 5000 ", "4096"},
      {NRANKS, 3, 3, "experts 16 ", "divisible by 3 ranks"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    c = base;
    if (bad[i].off != NRANKS) *(int *)((char *)&c + bad[i].off) = bad[i].v;
    ps_moe_clear_error();
    int rc = perseus_moe_check_config(&c, bad[i].nranks);
    const char *msg = perseus_moe_last_error();
    EXPECT(rc == -1, "'%s' accepted", bad[i].named);
    EXPECT(strstr(msg, bad[i].named) != NULL, "'%s': message '%s' does not name it", bad[i].named, msg);
    EXPECT(!bad[i].also || strstr(msg, bad[i].also), "'%s': message '%s' lacks '%s'", bad[i].named, msg,
           bad[i].also);
  }
  /* topk above a small expert count: the bound is min(experts, 16) */
  c = base;
  c.experts = 4, c.topk = 5;
  EXPECT(perseus_moe_check_config(&c, 1) == -1 && strstr(perseus_moe_last_error(), "topk 5 must be in 1..4"),
         "topk 5 of 4 experts: '%s'", perseus_moe_last_error());
  EXPECT(perseus_moe_check_config(NULL, 1) == -1 && strstr(perseus_moe_last_error(), "NULL"),
         "NULL config: '%s'", perseus_moe_last_error());

  /* every field in range, one buffer too big: 64 x 2^20 x 16 x 65536 x 2 = 2^47 */
  c = (perseus_moe_config_t){.hidden = 65536, .ffn = 64, .experts = 1024, .topk = 16, .max_tokens = 1 << 20};
  EXPECT(perseus_moe_check_config(&c, 64) == -1 &&
             strstr(perseus_moe_last_error(),
                    "recv_bytes needs 140737488355328 bytes, more than 70368744177664"),
         "2^47-byte receive buffer: '%s'", perseus_moe_last_error());
  c.hidden = 64, c.ffn = 65536;
  EXPECT(perseus_moe_check_config(&c, 64) == -1 &&
             strstr(perseus_moe_last_error(), "act_bytes needs 140737488355328 bytes"),
         "2^47-byte activation buffer: '%s'", perseus_moe_last_error());
  c.hidden = 32768, c.ffn = 64; /* exactly 2^46: the limit is inclusive */
  EXPECT(perseus_moe_check_config(&c, 64) == 0, "2^46-byte buffer refused: %s", perseus_moe_last_error());
}

/* --- GEMM tile rows: the variable and the choice --- */
static void test_tile_rows(void) {
  const char *good[] = {"", "0", "64", "128"};
  const int want[] = {0, 0, 64, 128};
  for (int i = 0; i < 4; i++) {
    setenv("PERSEUS_MOE_TILE_ROWS", good[i], 1);
    int v = -5;
    EXPECT(ps_moe_env_tile_rows(&v) == 0 && v == want[i], "PERSEUS_MOE_TILE_ROWS '%s': %d", good[i], v);
  }
  const char *bad[] = {"32", "96", "x", "64k", "-64", "256", "064", "+64", " 64", "0x40", "00", "128 "};
  for (int i = 0; i < (int)(sizeof bad / sizeof bad[0]); i++) {
    setenv("PERSEUS_MOE_TILE_ROWS", bad[i], 1);
    int v = -5;
    EXPECT(ps_moe_env_tile_rows(&v) == -1, "PERSEUS_MOE_TILE_ROWS '%s' accepted", bad[i]);
    EXPECT(strstr(perseus_moe_last_error(), "PERSEUS_MOE_TILE_ROWS") &&
               strstr(perseus_moe_last_error(), bad[i]),
           "error '%s' names neither the variable nor '%s'", perseus_moe_last_error(), bad[i]);
  }
  unsetenv("PERSEUS_MOE_TILE_ROWS");
  perseus_moe_config_t c = base; /* 16 experts, top-4: rows per expert = tokens * 4 * ranks / 16 */
  EXPECT(ps_moe_tile_rows(&c, 1, 0, 0) == 64, "no tokens: 64-row tiles");
  EXPECT(ps_moe_tile_rows(&c, 1, 188, 0) == 64, "47 rows per expert: 64-row tiles");
  EXPECT(ps_moe_tile_rows(&c, 1, 192, 0) == 128, "48 rows per expert: 128-row tiles");
  EXPECT(ps_moe_tile_rows(&c, 4, 48, 0) == 128, "48 rows per expert from 4 ranks: 128-row tiles");
  EXPECT(ps_moe_tile_rows(&c, 4, 1 << 20, 0) == 128, "2^20 tokens: 128-row tiles");
  EXPECT(ps_moe_tile_rows(&c, 4, 1 << 20, 64) == 64, "forced 64 wins");
  EXPECT(ps_moe_tile_rows(&c, 1, 1, 128) == 128, "forced 128 wins");
}

static void test_error_log(void) {
  perseus_moe_config_t c = base;
  c.hidden = 1000;
  const char *want = "perseus moe: hidden 1000 is not a multiple of 64 (PERSEUS_MOE_TILE)\n";
  const char *levels[] = {"info", "Trace", "WARN", "VERSION", "", NULL};
  const int logs[] = {1, 1, 1, 0, 0, 0};
  const char *prev = getenv("NCCL_DEBUG");
  char saved[64];
  snprintf(saved, sizeof saved, "%s", prev ? prev : "NONE");
  for (int i = 0; i < 6; i++) {
    if (levels[i])
      setenv("NCCL_DEBUG", levels[i], 1);
    else
      unsetenv("NCCL_DEBUG");
    capture_begin();
    perseus_moe_check_config(&c, 4);
    const char *out = capture_end();
    if (logs[i])
      EXPECT(strcmp(out, want) == 0, "NCCL_DEBUG=%s: stderr '%s'", levels[i], out);
    else
      EXPECT(out[0] == '\0', "NCCL_DEBUG=%s: printed '%s'", levels[i] ? levels[i] : "(unset)", out);
  }
  setenv("NCCL_DEBUG", saved, 1);
}

static void *other_thread(void *arg) {
  char *seen = arg;
  strcpy(seen, perseus_moe_last_error()); /* a fresh thread has none */
  perseus_moe_config_t c = base;
  c.ffn = 100;
  perseus_moe_check_config(&c, 4);
  strcat(seen, "|");
  strncat(seen, perseus_moe_last_error(), 200);
  return NULL;
}

static void test_thread_local(void) {
  ps_moe_set_error("main's error %d", 7);
  static char seen[512];
  pthread_t t;
  EXPECT(pthread_create(&t, NULL, other_thread, seen) == 0, "pthread_create failed");
  pthread_join(t, NULL);
  EXPECT(strncmp(seen, "|ffn 100 ", 9) == 0, "other thread saw '%s'", seen);
  EXPECT(strcmp(perseus_moe_last_error(), "main's error 7") == 0, "main's error became '%s'",
         perseus_moe_last_error());
  ps_moe_clear_error();
  EXPECT(perseus_moe_last_error()[0] == '\0', "clear left '%s'", perseus_moe_last_error());
}

/* --- layout --- */
static void test_layout(void) {
  perseus_moe_config_t c = base;
  c.max_tokens = 10;
  ps_moe_layout_t l;
  /* 4 ranks: L = 4, rows = 10 * min(4, 4) = 40; rows x hidden x 2 x 4 ranks */
  EXPECT(ps_moe_layout(&c, 4, &l) == 0, "layout refused: %s", perseus_moe_last_error());
  EXPECT(l.local_experts == 4 && l.rows_per_peer == 40, "L %d rows %zu, expected 4 and 40", l.local_experts,
         l.rows_per_peer);
  EXPECT(l.recv_bytes == 40960 && l.send_bytes == 40960 && l.comb_bytes == 40960 && l.y_bytes == 40960,
         "row buffers %zu %zu %zu %zu, expected 40960", l.recv_bytes, l.send_bytes, l.comb_bytes, l.y_bytes);
  EXPECT(l.act_bytes == 81920, "act_bytes %zu, expected 81920", l.act_bytes);
  /* 4 x 3 x 256 x 128 x 2 + 16 x 128 x 2 */
  EXPECT(l.weight_bytes == 790528, "weight_bytes %zu, expected 790528", l.weight_bytes);
  EXPECT(l.total_bytes == 1036288, "total_bytes %zu, expected 1036288", l.total_bytes);
  /* 8 ranks: L = 2 < topk, so a token sends at most 2 rows to one peer */
  EXPECT(ps_moe_layout(&c, 8, &l) == 0 && l.local_experts == 2 && l.rows_per_peer == 20 &&
             l.recv_bytes == 8 * 20 * 128 * 2 && l.weight_bytes == 2 * 3 * 256 * 128 * 2 + 16 * 128 * 2,
         "8 ranks: L %d rows %zu recv %zu weight %zu", l.local_experts, l.rows_per_peer, l.recv_bytes,
         l.weight_bytes);
  EXPECT(ps_moe_layout(&c, 1, &l) == 0 && l.rows_per_peer == 40 && l.recv_bytes == 10240 &&
             l.act_bytes == 20480,
         "1 rank: rows %zu recv %zu act %zu", l.rows_per_peer, l.recv_bytes, l.act_bytes);

  EXPECT(ps_moe_layout(&c, 3, &l) == -1 &&
             strstr(perseus_moe_last_error(), "experts 16 is not divisible by 3"),
         "16 experts on 3 ranks: '%s'", perseus_moe_last_error());
  c.topk = 0;
  EXPECT(ps_moe_layout(&c, 4, &l) == -1 && strstr(perseus_moe_last_error(), "topk 0"), "topk 0: '%s'",
         perseus_moe_last_error());
  /* past 64 bits: layout applies none of check_config's range limits */
  c = (perseus_moe_config_t){.hidden = 1 << 30, .ffn = 64, .experts = 16, .topk = 16, .max_tokens = INT_MAX};
  l.total_bytes = 12345;
  EXPECT(ps_moe_layout(&c, 1, &l) == -1 && strstr(perseus_moe_last_error(), "recv_bytes") &&
             strstr(perseus_moe_last_error(), "overflows 64 bits"),
         "2^66-byte receive buffer: '%s'", perseus_moe_last_error());
  EXPECT(l.total_bytes == 12345, "a refused layout wrote its output");
  c = (perseus_moe_config_t){
      .hidden = 1 << 30, .ffn = 1 << 30, .experts = INT_MAX, .topk = 1, .max_tokens = 1};
  EXPECT(ps_moe_layout(&c, 1, &l) == -1 && strstr(perseus_moe_last_error(), "weight_bytes") &&
             strstr(perseus_moe_last_error(), "overflows 64 bits"),
         "weights of 2^31 huge experts: '%s'", perseus_moe_last_error());
  /* each weight term fits 64 bits, their sum does not (one expert per rank) */
  c = (perseus_moe_config_t){
      .hidden = 1342177280, .ffn = INT_MAX, .experts = INT_MAX, .topk = 1, .max_tokens = 1};
  EXPECT(ps_moe_layout(&c, INT_MAX, &l) == -1 && strstr(perseus_moe_last_error(), "weight_bytes = ") &&
             strstr(perseus_moe_last_error(), " + "),
         "weights and gate past 64 bits together: '%s'", perseus_moe_last_error());
}

/* --- reference against closed forms --- */
static double silu(double a) { return a / (1.0 + exp(-a)); }

/* x = (1, 2, 0...), logits g_e, W1_e[0][0] = a_e, W3_e[0][1] = b_e, and
 * W2_e[5][0] = 1.5, W2_e[7][0] = -0.25: y_e[5] = 1.5 silu(a_e) 2 b_e,
 * y_e[7] = -0.25 silu(a_e) 2 b_e, every other output 0. */
enum { HC = 64, EC = 4 };
static uint16_t cx[HC], cgate[EC * HC], cw1[EC * HC * HC], cw3[EC * HC * HC], cw2[EC * HC * HC];

static void test_closed_form(void) {
  const double g[EC] = {0.5, 2, -1, 1}, a[EC] = {1, -0.5, 2, 0.75}, b[EC] = {0.5, 1, 1.5, -2};
  perseus_moe_config_t c = {
      .hidden = HC, .ffn = HC, .experts = EC, .topk = 2, .max_tokens = 1, .renormalize = 1};
  cx[0] = bf(1), cx[1] = bf(2);
  for (int e = 0; e < EC; e++) {
    size_t o = (size_t)e * HC * HC;
    cgate[e * HC] = bf((float)g[e]);
    cw1[o] = bf((float)a[e]);
    cw3[o + 1] = bf((float)b[e]);
    cw2[o + 5 * HC] = bf(1.5f), cw2[o + 7 * HC] = bf(-0.25f);
  }
  double logits[EC];
  ps_moe_ref_logits(&c, cx, 1, cgate, logits);
  for (int e = 0; e < EC; e++) EXPECT(logits[e] == g[e], "logit %d: %g, expected %g", e, logits[e], g[e]);

  double y[HC];
  for (int e = 0; e < EC; e++) {
    size_t o = (size_t)e * HC * HC;
    ps_moe_ref_expert(&c, cx, cw1 + o, cw3 + o, cw2 + o, y);
    double v = silu(a[e]) * 2 * b[e];
    int others = 0;
    for (int h = 0; h < HC; h++) others += h != 5 && h != 7 && y[h] != 0.0;
    EXPECT(fabs(y[5] - 1.5 * v) < 1e-15 && fabs(y[7] + 0.25 * v) < 1e-15 && !others,
           "expert %d: y5 %.17g y7 %.17g (expected %.17g %.17g), %d others nonzero", e, y[5], y[7], 1.5 * v,
           -0.25 * v, others);
  }

  /* top-2 of (0.5, 2, -1, 1) is {1, 3}; renormalized w1 = 1 / (1 + e^-1) */
  int32_t idx[2] = {1, 3};
  double w1 = 1.0 / (1.0 + exp(-1.0)), w3 = 1.0 - w1;
  float w[2] = {(float)w1, (float)w3};
  char why[256];
  EXPECT(ps_moe_ref_check_routing(&c, logits, idx, w, 1e-6, why, sizeof why) == 0, "closed form routing: %s",
         why);
  ps_moe_ref_token(&c, cx, idx, w, cw1, cw3, cw2, y);
  double v = w[0] * silu(a[1]) * 2 * b[1] + w[1] * silu(a[3]) * 2 * b[3];
  EXPECT(fabs(y[5] - 1.5 * v) < 1e-12 && fabs(y[7] + 0.25 * v) < 1e-12 && y[0] == 0.0 && y[63] == 0.0,
         "token: y5 %.17g y7 %.17g, expected %.17g %.17g", y[5], y[7], 1.5 * v, -0.25 * v);

  /* without renormalization the weights are the softmax over all four */
  double s = exp(0.5) + exp(2.0) + exp(-1.0) + exp(1.0);
  float raw[2] = {(float)(exp(2.0) / s), (float)(exp(1.0) / s)};
  c.renormalize = 0;
  EXPECT(ps_moe_ref_check_routing(&c, logits, idx, raw, 1e-6, why, sizeof why) == 0, "raw weights: %s", why);
  EXPECT(ps_moe_ref_check_routing(&c, logits, idx, w, 1e-6, why, sizeof why) == -1,
         "renormalized weights accepted without renormalize");
}

/* --- the reference against a plain loop where F spans several chunks --- */
static void test_expert_random(void) {
  enum { H = 64, F = 320, E = 3 };
  static uint16_t x[H], w1[E * F * H], w3[E * F * H], w2[E * H * F];
  perseus_moe_config_t c = {
      .hidden = H, .ffn = F, .experts = E, .topk = 2, .max_tokens = 1, .renormalize = 1};
  ps_moe_fill_bf16(x, H, 1, 1.0f);
  ps_moe_fill_bf16(w1, E * F * H, 2, 0.125f);
  ps_moe_fill_bf16(w3, E * F * H, 3, 0.125f);
  ps_moe_fill_bf16(w2, E * H * F, 4, (float)(1.0 / sqrt(F)));
  double want[E][H], y[H];
  for (int e = 0; e < E; e++) {
    double act[F];
    for (int f = 0; f < F; f++) {
      double p = 0, q = 0;
      for (int h = 0; h < H; h++) {
        p += (double)ps_bf16_to_float(w1[(e * F + f) * H + h]) * ps_bf16_to_float(x[h]);
        q += (double)ps_bf16_to_float(w3[(e * F + f) * H + h]) * ps_bf16_to_float(x[h]);
      }
      act[f] = silu(p) * q;
    }
    for (int h = 0; h < H; h++) {
      want[e][h] = 0;
      for (int f = 0; f < F; f++) want[e][h] += (double)ps_bf16_to_float(w2[(e * H + h) * F + f]) * act[f];
    }
    ps_moe_ref_expert(&c, x, w1 + e * F * H, w3 + e * F * H, w2 + e * H * F, y);
    double err = 0, rms = ps_moe_rms(want[e], H);
    for (int h = 0; h < H; h++) err = fmax(err, fabs(y[h] - want[e][h]));
    EXPECT(rms > 0.01 && err <= 1e-12 * rms, "expert %d: max error %g against the plain loop (rms %g)", e,
           err, rms);
  }
  int32_t idx[2] = {2, 0};
  float w[2] = {0.625f, 0.375f};
  ps_moe_ref_token(&c, x, idx, w, w1, w3, w2, y);
  double err = 0;
  for (int h = 0; h < H; h++) err = fmax(err, fabs(y[h] - (0.625 * want[2][h] + 0.375 * want[0][h])));
  EXPECT(err <= 1e-12, "token: max error %g against the weighted experts", err);
}

/* --- routing --- */
static void test_routing(void) {
  enum { E = 8 };
  perseus_moe_config_t c = {
      .hidden = 64, .ffn = 64, .experts = E, .topk = 2, .max_tokens = 1, .renormalize = 1};
  const double l[E] = {0.1, 3.0, 2.5, -1, 0.5, 2.5 - 1e-4, 0, -2};
  char why[256];
  /* two chosen, renormalized: w_a = 1 / (1 + e^(l_b - l_a)) */
  const float w1 = (float)(1 / (1 + exp(-0.5))), w2 = (float)(1 / (1 + exp(0.5))); /* {1, 2} */
#define PAIR(a, b)                                                                                           \
  { (float)(1 / (1 + exp(l[b] - l[a]))), (float)(1 / (1 + exp(l[a] - l[b]))) }
  struct {
    int32_t idx[2];
    float w[2];
    double tol;
    int ok;
    const char *why, *what;
  } r[] = {
      {{1, 2}, PAIR(1, 2), 1e-6, 1, NULL, "the top 2"},
      {{2, 1}, PAIR(2, 1), 1e-6, 1, NULL, "the top 2 in the other order"},
      {{1, 5}, PAIR(1, 5), 1e-3, 1, NULL, "a near-tie swap within tol"},
      {{1, 5}, PAIR(1, 5), 1e-6, 0, "expert 5 has logit", "a near-tie swap beyond tol"},
      {{1, 0}, PAIR(1, 0), 1e-3, 0, "expert 0 has logit", "a wrong expert"},
      {{1, 1}, {0.5f, 0.5f}, 1e-3, 0, "expert 1 chosen twice", "a duplicate"},
      {{1, 8}, PAIR(1, 2), 1e-3, 0, "idx[1] = 8", "id past the end"},
      {{-1, 1}, PAIR(1, 2), 1e-3, 0, "idx[0] = -1", "a negative id"},
      {{1, 2}, {w1 * 1.05f, w2}, 1e-3, 0, "weight", "a weight 5% off"},
      {{1, 2}, {w1 + 5e-4f, w2}, 1e-3, 1, NULL, "a weight within 1e-3"},
      {{1, 2}, {NAN, w2}, 1e-3, 0, "weight", "a NaN weight"},
  };
#undef PAIR
  for (size_t i = 0; i < sizeof r / sizeof r[0]; i++) {
    int rc = ps_moe_ref_check_routing(&c, l, r[i].idx, r[i].w, r[i].tol, why, sizeof why);
    EXPECT(rc == (r[i].ok ? 0 : -1), "%s: rc %d (%s)", r[i].what, rc, why);
    EXPECT(!r[i].why || strstr(why, r[i].why), "%s: reason '%s' lacks '%s'", r[i].what, why, r[i].why);
  }

  /* what a GPU does (fp32 logits, lower id on ties) passes with tol 1e-3 */
  enum { H = 256, T = 64, K = 4, E2 = 32 };
  static uint16_t x[T * H], gate[E2 * H];
  static double ref[T * E2];
  c = (perseus_moe_config_t){
      .hidden = H, .ffn = 64, .experts = E2, .topk = K, .max_tokens = T, .renormalize = 1};
  ps_moe_fill_bf16(x, T * H, 11, 1.0f);
  ps_moe_fill_bf16(gate, E2 * H, 12, 1.0f / 16);
  ps_moe_ref_logits(&c, x, T, gate, ref);
  int refused = 0;
  for (int t = 0; t < T; t++) {
    float lf[E2], mx = -INFINITY, sum = 0, chosen = 0;
    for (int e = 0; e < E2; e++) {
      lf[e] = 0;
      for (int h = 0; h < H; h++) lf[e] += ps_bf16_to_float(x[t * H + h]) * ps_bf16_to_float(gate[e * H + h]);
      mx = fmaxf(mx, lf[e]);
    }
    for (int e = 0; e < E2; e++) sum += expf(lf[e] - mx);
    int32_t idx[K];
    float w[K];
    for (int i = 0; i < K; i++) {
      int best = -1;
      for (int e = 0; e < E2; e++) {
        int taken = 0;
        for (int j = 0; j < i; j++) taken |= idx[j] == e;
        if (!taken && (best < 0 || lf[e] > lf[best])) best = e;
      }
      idx[i] = best;
      w[i] = expf(lf[best] - mx) / sum;
      chosen += w[i];
    }
    for (int i = 0; i < K; i++) w[i] /= chosen;
    refused += ps_moe_ref_check_routing(&c, ref + t * E2, idx, w, 1e-3, why, sizeof why) != 0;
  }
  EXPECT(refused == 0, "%d of %d fp32 routings refused (last: %s)", refused, T, why);
}

/* --- compare --- */
static void test_compare(void) {
  const double want[5] = {1, 2, -3, 0, 100};
  uint16_t got[5];
  for (int i = 0; i < 5; i++) got[i] = bf((float)want[i]);
  size_t nbad = 99, first = 99;
  double max_err = -1;
  EXPECT(ps_moe_ref_compare(got, want, 5, 1e-2, 1e-3, &nbad, &max_err, &first) == 0 && nbad == 0 &&
             first == 5 && max_err == 0,
         "exact: nbad %zu first %zu max_err %g", nbad, first, max_err);
  got[2] = bf(-3.5f);
  got[4] = bf(100.5f); /* 0.5 <= 1e-3 + 1e-2 * 100: within */
  EXPECT(ps_moe_ref_compare(got, want, 5, 1e-2, 1e-3, &nbad, &max_err, &first) == -1 && nbad == 1 &&
             first == 2 && max_err == 0.5,
         "one off: nbad %zu first %zu max_err %g", nbad, first, max_err);
  got[1] = bf(NAN);
  EXPECT(ps_moe_ref_compare(got, want, 5, 1e-2, 1e-3, &nbad, &max_err, &first) == -1 && nbad == 2 &&
             first == 1 && isinf(max_err),
         "with a NaN: nbad %zu first %zu max_err %g", nbad, first, max_err);
  got[3] = bf(0.01f); /* atol alone decides near zero */
  EXPECT(ps_moe_ref_compare(got + 3, want + 3, 1, 0.5, 1e-3, NULL, NULL, NULL) == -1 &&
             ps_moe_ref_compare(got + 3, want + 3, 1, 0.5, 0.02, NULL, NULL, NULL) == 0,
         "0.01 against 0: atol not applied");
  const double v[4] = {3, -3, 3, -3};
  EXPECT(fabs(ps_moe_rms(v, 4) - 3) < 1e-15, "rms %g, expected 3", ps_moe_rms(v, 4));
}

/* --- test data --- */
static void test_rand(void) {
  uint64_t s = 0;
  uint64_t r0 = ps_moe_rand(&s), r1 = ps_moe_rand(&s);
  EXPECT(r0 == 0xe220a8397b1dcdafull && r1 == 0x6e789e6aa1b965f4ull, "splitmix64(0): %016llx %016llx",
         (unsigned long long)r0, (unsigned long long)r1);
  uint16_t head[4];
  ps_moe_fill_bf16(head, 4, 42, 0.5f);
  EXPECT(head[0] == 0x3e77 && head[1] == 0xbeae && head[2] == 0xbe63 && head[3] == 0xbe20,
         "fill(seed 42): %04x %04x %04x %04x", head[0], head[1], head[2], head[3]);
  enum { N = 4096 };
  static uint16_t a[N], b[N], d[N];
  ps_moe_fill_bf16(a, N, 7, 0.125f);
  ps_moe_fill_bf16(b, N, 7, 0.125f);
  ps_moe_fill_bf16(d, N, 8, 0.125f);
  double mean_abs = 0;
  int out = 0, neg = 0, same = 0;
  for (int i = 0; i < N; i++) {
    float v = ps_bf16_to_float(a[i]);
    out += !(fabsf(v) <= 0.125f);
    neg += v < 0;
    mean_abs += fabsf(v) / N;
    same += a[i] == d[i];
  }
  EXPECT(!memcmp(a, b, sizeof a), "the same seed gave different data");
  EXPECT(same < N / 16, "seeds 7 and 8 agree on %d of %d values", same, N);
  EXPECT(out == 0, "%d values outside [-0.125, 0.125]", out);
  EXPECT(neg > N * 45 / 100 && neg < N * 55 / 100, "%d of %d negative", neg, N);
  EXPECT(fabs(mean_abs - 0.0625) < 0.003, "mean |v| %g, expected 0.0625", mean_abs);
}

int main(void) {
  /* the refusals are logged when NCCL_DEBUG asks; keep the output to the
   * verdicts unless PS_UNIT_VERBOSE=1 */
  if (!getenv("PS_UNIT_VERBOSE")) setenv("NCCL_DEBUG", "NONE", 1);
  test_bf16();
  test_config();
  test_error_log();
  test_tile_rows();
  test_thread_local();
  test_layout();
  test_closed_form();
  test_expert_random();
  test_routing();
  test_compare();
  test_rand();
  return unit_report("unit_moe_ref");
}
