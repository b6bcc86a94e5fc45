/* The timeout variables of the fused operators (PERSEUS_MOE_TIMEOUT_MS,
 * PERSEUS_DECODE_TIMEOUT_MS, PERSEUS_AG_GEMM_TIMEOUT_MS) follow one rule:
 * milliseconds in 0..7 days, the default when unset or empty, anything else
 * refused with the variable and its value named. Include after
 * unit_check.h and ps_moe_ref.h. */
#ifndef PS_UNIT_TIMEOUT_ENV_H
#define PS_UNIT_TIMEOUT_ENV_H

#include <stdlib.h>
#include <string.h>

static void check_timeout_env(const char *var, int (*parse)(long long *), const char *(*last_error)(void)) {
  const struct {
    const char *v;
    long long want;
  } good[] = {{NULL, PS_MOE_DEFAULT_TIMEOUT_MS}, {"", PS_MOE_DEFAULT_TIMEOUT_MS}, {"0", 0},
              {"1", 1}, {"2500", 2500}, {"604800000", PS_MOE_MAX_TIMEOUT_MS}};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    if (good[i].v) setenv(var, good[i].v, 1);
    else unsetenv(var);
    long long v = -5;
    EXPECT(parse(&v) == 0 && v == good[i].want, "%s '%s': %lld, want %lld", var,
           good[i].v ? good[i].v : "(unset)", v, good[i].want);
  }
  const char *bad[] = {"-1", "x", "10s", "604800001", "99999999999999999999", " 5", "+5", "05",
                       "0x10", "00"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv(var, bad[i], 1);
    long long v = -5;
    EXPECT(parse(&v) == -1, "%s '%s' accepted (%lld)", var, bad[i], v);
    EXPECT(strstr(last_error(), var) && strstr(last_error(), bad[i]), "error '%s' names neither %s nor '%s'",
           last_error(), var, bad[i]);
  }
  unsetenv(var);
}

#endif
