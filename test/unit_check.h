/* EXPECT for the single-process unit tests: counts checks and failures and
 * prints each failure with its place; main() ends with unit_report(). */
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

/* The totals line "<name>: N checks, M failed: ok|FAIL"; returns main()'s
 * exit status. */
static inline int unit_report(const char *name)
{
  printf("%s: %d checks, %d failed: %s\n", name, checks, failures, failures ? "FAIL" : "ok");
  return failures ? 1 : 0;
}

#endif
