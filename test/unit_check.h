/* EXPECT for the single-process unit tests: counts checks and failures and
 * prints each failure with its place; main() reports the totals. */
#ifndef PS_UNIT_CHECK_H
#define PS_UNIT_CHECK_H

#include <stdio.h>

static int failures, checks;

#define EXPECT(cond, ...)                                               \
  do {                                                                  \
    checks++;                                                           \
    if (!(cond)) {                                                      \
      failures++;                                                       \
      fprintf(stdout, "FAIL %s:%d: ", __FILE__, __LINE__);              \
      fprintf(stdout, __VA_ARGS__);                                     \
      fputc('\n', stdout);                                              \
    }                                                                   \
  } while (0)

#endif
