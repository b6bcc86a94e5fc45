#include "ps_clock.h"

#include <sys/random.h>
#include <time.h>
#include <unistd.h>

uint64_t ps_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

uint64_t ps_random64(void) {
  uint64_t x = 0;
  if (getrandom(&x, sizeof x, 0) != (ssize_t)sizeof x) x = ps_now_ns() ^ ((uint64_t)getpid() << 32);
  return x | 1; /* never 0: 0 means "unset" */
}
