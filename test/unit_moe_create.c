/* Unit tests of what perseus_moe_create decides before it allocates
 * (moe_config.c): the config's agreement across ranks (ps_moe_agree_pack,
 * ps_moe_agree_check; the all-reduce, an element-wise maximum, done here
 * over simulated ranks), PERSEUS_MOE_TIMEOUT_MS, and the reason a failed
 * forward gives (ps_moe_fault_text).
 * Exit: 0 pass, 1 fail. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_moe_ref.h"

#include "unit_check.h"
#include "unit_timeout_env.h"

#define RANKS 4

static perseus_moe_config_t base(void) {
  perseus_moe_config_t c = {.hidden = 2048, .ffn = 768, .experts = 128, .topk = 8,
                            .max_tokens = 128, .renormalize = 1, .batch = 0, .gin_per_expert = 0};
  return c;
}

/* Every rank's verdict on configs cfg[0..n) (valid[r]: its own check);
 * returns how many ranks accepted, the last refusal's reason in why. */
static int agree(const perseus_moe_config_t *cfg, const int *valid, int n, char *why, size_t len) {
  int64_t maxed[2 * PS_MOE_AGREE_FIELDS];
  for (int r = 0; r < n; r++) {
    int64_t v[2 * PS_MOE_AGREE_FIELDS];
    ps_moe_agree_pack(&cfg[r], valid[r], v);
    for (int i = 0; i < 2 * PS_MOE_AGREE_FIELDS; i++) maxed[i] = r == 0 || v[i] > maxed[i] ? v[i] : maxed[i];
  }
  int ok = 0;
  why[0] = '\0';
  for (int r = 0; r < n; r++) {
    ps_moe_clear_error();
    if (ps_moe_agree_check(&cfg[r], n, maxed) == 0) ok++;
    else snprintf(why, len, "%s", perseus_moe_last_error());
  }
  return ok;
}

static void test_same(void) {
  perseus_moe_config_t c[RANKS];
  int valid[RANKS];
  char why[512];
  for (int r = 0; r < RANKS; r++) c[r] = base(), valid[r] = 1;
  int ok = agree(c, valid, RANKS, why, sizeof why);
  EXPECT(ok == RANKS, "the same config on %d ranks: %d accepted (%s)", RANKS, ok, why);
  ok = agree(c, valid, 1, why, sizeof why);
  EXPECT(ok == 1, "one rank: refused (%s)", why);
}

/* Each field in turn differs on one rank: every rank refuses, naming it. */
static void test_each_field(void) {
  static const char *names[] = {"hidden", "ffn", "experts", "topk", "max_tokens",
                                "renormalize", "batch", "gin_per_expert"};
  for (int f = 0; f < (int)(sizeof names / sizeof names[0]); f++) {
    perseus_moe_config_t c[RANKS];
    int valid[RANKS];
    char why[512];
    for (int r = 0; r < RANKS; r++) c[r] = base(), valid[r] = 1;
    int *field[] = {&c[2].hidden, &c[2].ffn,         &c[2].experts, &c[2].topk,
                    &c[2].max_tokens, &c[2].renormalize, &c[2].batch, &c[2].gin_per_expert};
    const int was = *field[f];
    *field[f] = f == 5 || f == 7 ? 1 - was : was + 64;
    int ok = agree(c, valid, RANKS, why, sizeof why);
    EXPECT(ok == 0, "%s differs on rank 2: %d ranks accepted", names[f], ok);
    EXPECT(strstr(why, names[f]) != NULL, "%s differs: the reason does not name it: %s", names[f], why);
    char range[64];
    const int lo = was < *field[f] ? was : *field[f], hi = was < *field[f] ? *field[f] : was;
    snprintf(range, sizeof range, "%d..%d", lo, hi);
    EXPECT(strstr(why, range) != NULL, "%s differs: the reason lacks the range %s: %s", names[f], range, why);
  }
}

/* A rank whose own check refused its config: the others refuse too, saying so. */
static void test_invalid_rank(void) {
  perseus_moe_config_t c[RANKS];
  int valid[RANKS];
  char why[512];
  for (int r = 0; r < RANKS; r++) c[r] = base(), valid[r] = 1;
  c[1].batch = -5, valid[1] = 0; /* a negative value packs and compares like any other */
  int ok = agree(c, valid, RANKS, why, sizeof why);
  EXPECT(ok == 0, "rank 1's config refused: %d ranks accepted", ok);
  EXPECT(strstr(why, "another rank") != NULL, "the reason does not point at another rank: %s", why);
  /* all the same but refused everywhere (e.g. experts not divisible) */
  for (int r = 0; r < RANKS; r++) c[r] = base(), c[r].experts = 6, valid[r] = 0;
  ok = agree(c, valid, RANKS, why, sizeof why);
  EXPECT(ok == 0, "a config refused on every rank: %d ranks accepted", ok);
}

/* Extremes: the largest values and INT_MIN-like ones neither overflow the
 * negation nor compare equal to a neighbour. */
static void test_extremes(void) {
  perseus_moe_config_t c[2];
  int valid[2] = {1, 1};
  char why[512];
  c[0] = base(), c[1] = base();
  c[0].max_tokens = INT32_MAX, c[1].max_tokens = INT32_MAX - 1;
  EXPECT(agree(c, valid, 2, why, sizeof why) == 0, "max_tokens INT32_MAX vs INT32_MAX-1 accepted");
  c[0].max_tokens = c[1].max_tokens = INT32_MAX;
  c[0].batch = INT32_MIN, c[1].batch = INT32_MIN;
  EXPECT(agree(c, valid, 2, why, sizeof why) == 2, "equal extremes refused: %s", why);
}

/* The reason a failed forward gives (ps_moe_fault_text): every kind names
 * the rank, the peer and what it concerns, and ends with what to do. */
static void test_fault_text(void) {
  const struct {
    ps_moe_fault_t f;
    const char *want[3];
  } cases[] = {
      {{PS_MOE_FAULT_HEADER, 2, PS_MOE_WAIT_HEADER, 5, 300, 256, 310},
       {"refused a header from rank 2", "local expert 5 has 300 rows (310 with", "at most 256"}},
      {{PS_MOE_FAULT_TIMEOUT, 3, PS_MOE_WAIT_ROWS, 0, 0, 0, 0},
       {"waited 1500 ms (PERSEUS_MOE_TIMEOUT_MS)", "for its rows from rank 3", "went on without"}},
      {{PS_MOE_FAULT_ABORT, 0, PS_MOE_WAIT_HEADER, 0, 0, 0, 0},
       {"aborted (perseus_moe_abort)", "waited for its header from rank 0", "while it waited"}},
      {{PS_MOE_FAULT_PEER, 1, PS_MOE_WAIT_RESULTS, 4, 0, 0, 0},
       {"got no valid results from rank 1", "for its local expert 4", "see its error"}},
      {{PS_MOE_FAULT_PEER, 6, PS_MOE_WAIT_HEADER, -1, 0, 0, 0},
       {"waited for its header from rank 6", "which failed this rank", "see its error"}},
      {{PS_MOE_FAULT_ABORT, 1, 9, 0, 0, 0, 0}, /* a wait this build does not know */
       {"waited for ? from rank 1", "while it", "aborted"}},
      {{42, 5, PS_MOE_WAIT_ROWS, 0, 0, 0, 0}, {"fault 42", "unknown to this build", "rank 5"}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[480];
    ps_moe_fault_text(text, sizeof text, 7, &cases[i].f, 1500);
    EXPECT(strncmp(text, "rank 7 ", 7) == 0, "fault %zu: does not start with the rank: %s", i, text);
    for (int k = 0; k < 3; k++)
      EXPECT(strstr(text, cases[i].want[k]) != NULL, "fault %zu: '%s' missing: %s", i, cases[i].want[k], text);
    EXPECT(strstr(text, "destroy it") != NULL, "fault %zu: does not say what to do: %s", i, text);
  }
  /* a short buffer: cut, terminated, nothing written past it */
  char small[24];
  memset(small, 'x', sizeof small);
  ps_moe_fault_text(small, 16, 7, &cases[0].f, 0);
  EXPECT(strlen(small) == 15 && small[16] == 'x', "a 16-byte buffer: '%.16s' (%zu)", small, strlen(small));
}

int main(void) {
  if (!getenv("PS_UNIT_VERBOSE")) setenv("NCCL_DEBUG", "NONE", 1);
  test_same();
  test_each_field();
  test_invalid_rank();
  test_extremes();
  check_timeout_env("PERSEUS_MOE_TIMEOUT_MS", ps_moe_env_timeout_ms, perseus_moe_last_error);
  test_fault_text();
  return unit_report("unit_moe_create");
}
