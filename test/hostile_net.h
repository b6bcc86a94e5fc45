/* What hostile_net.c and hostile_conn.c (one program, perseus_hostile_net)
 * share. */
#ifndef PS_HOSTILE_NET_H
#define PS_HOSTILE_NET_H

#include <stdio.h>

#include "ps_driver.h"

/* In a scenario function: report where and why, and return 1 (failed). */
#define FAIL_IF(cond, ...)                               \
  do {                                                   \
    if (cond) {                                          \
      fprintf(stderr, __VA_ARGS__);                      \
      fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__); \
      return 1;                                          \
    }                                                    \
  } while (0)

/* Entries in /proc/self/fd, -1 where it cannot be read (hostile_conn.c). */
int hostile_open_fds(void);

/* hostile_conn.c's scenarios (abandon, wrong_id, shm_stale, shm_addr,
 * shm_dead_peer): 0 passed, 1 failed, 77 skipped, 2 not one of them. */
int hostile_conn_scenario(int version, const char *scenario);

/* Closes lc, then connects with its handle: 0 when that fails in time,
 * else 1 (hostile_conn.c). */
int hostile_closed_listener(drv_net_t *net, void *lc, void *handle);

#endif
