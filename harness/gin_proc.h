/* gin_proc.h: the process side shared by perseus_gin_test and perseus_gin_perf
 * (C11, no CUDA): one forked process per GPU, a shared anonymous mapping made
 * before the fork through which rank 0 hands out the ncclUniqueId and every
 * rank reports where it is (mode, iteration, stage), a host barrier, a
 * watchdog that kills a set of ranks that stopped making progress and says
 * where each one was, option parsers, the NCCL environment defaults, and the
 * plugin's process-wide one-sided statistics. The parent never calls CUDA. */
#ifndef PERSEUS_GIN_PROC_H
#define PERSEUS_GIN_PROC_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "perseus/perseus_rma.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GP_MAX_RANKS 32
#define GP_STAGE_LEN 240
#define GP_NAME_LEN 96
#define GP_ID_BYTES 128     /* NCCL_UNIQUE_ID_BYTES */
#define GP_EXIT_REFUSED 3   /* NCCL init or device comm creation failed */
#define GP_EXIT_WATCHDOG 124
#define GP_EXIT_SKIP 77     /* meson's "skipped": no GPU, or fewer than asked */

struct gp_slot {
  int pid;
  int iter;                  /* current iteration; -1 outside the loops */
  char mode[24];
  char stage[GP_STAGE_LEN];  /* what the rank (or its GPU) is doing now */
  double beat;               /* gp_now() at the last sign of progress */
  long long mismatches;
};

struct gp_shared {
  int id_ready, abort_flag;
  unsigned bar_count, bar_gen;
  unsigned char unique_id[GP_ID_BYTES];
  /* filled by the probe child */
  int ndev, nccl_version, runtime_version, driver_version;
  char gpu_name[GP_MAX_RANKS][GP_NAME_LEN];
  int hosts, host_ranks; /* set by the parent: PERSEUS_TEST_HOSTS and ranks per host (0: real) */
  struct gp_slot slot[GP_MAX_RANKS];
};

extern struct gp_shared *gp_sh; /* mapped by gp_init() */
extern int gp_rank;             /* in a child: its rank; -1 in the parent and the probe */
extern const char *gp_prog;     /* program name for messages */

/* Maps the shared area; call once in the parent before any fork. */
int gp_init(const char *prog);
double gp_now(void);

/* A child's rank body: returns its exit status (0, 1, GP_EXIT_REFUSED, ...). */
typedef int (*gp_child_fn)(int rank, void *arg);
/* Called by the parent every poll tick (about 20 ms), e.g. to drain a pipe. */
typedef void (*gp_tick_fn)(void *arg);

/* Forks nproc children running fn (rank 0..nproc-1; nproc == 1 with
 * probe != 0 runs a probe whose gp_rank stays -1), reaps them, and on the
 * first failure, on SIGINT/SIGTERM, or when a child's beat is older than
 * stall_s, kills the rest and says why, naming each rank's mode, iteration and
 * stage. codes[r] gets each child's exit status (128+signal if killed by a
 * signal, GP_EXIT_WATCHDOG if the watchdog stopped it). Returns 0 when every
 * child exited 0. */
int gp_run(int nproc, int probe, gp_child_fn fn, void *arg, double stall_s, const char *what,
           gp_tick_fn tick, void *tick_arg, int *codes);

/* In a child: where it is now; fmt NULL keeps the stage text. Counts as a
 * sign of progress (refreshes the beat). */
void gp_progress(const char *mode, int iter, const char *fmt, ...)
  __attribute__((format(printf, 3, 4)));
void gp_beat(void);
/* In a child: another rank failed, leave quietly (the parent kills us anyway). */
int gp_aborted(void);
void gp_raise_abort(void);
/* In a child: wait until all n ranks arrive; -1 if the set is aborting. */
int gp_barrier(int n);
/* In a child: rank 0 publishes the NCCL unique id, the others wait for it. */
void gp_publish_id(const void *id, size_t len);
int gp_wait_id(void *id, size_t len);

/* Option values. Sizes take K/M/G suffixes (powers of 2). */
int gp_parse_size(const char *s, size_t *out);
int gp_parse_int(const char *s, long lo, long hi, int *out);
/* Comma-separated integers in [lo, hi]; returns the count or -1. */
int gp_parse_int_list(const char *s, long lo, long hi, int *out, int max);
/* A seed: any unsigned 64-bit number strtoull reads (base 0). */
int gp_parse_seed(const char *s, uint64_t *out);
/* The default seed: from the clock and the pid. */
uint64_t gp_clock_seed(void);

/* NCCL environment for GIN over the plugin: sets NCCL_P2P_DISABLE=1,
 * NCCL_SHM_DISABLE=1, NCCL_NVLS_ENABLE=0 and NCCL_GIN_TYPE=2 (proxy) where
 * unset, and NCCL_NET_PLUGIN to the plugin built next to this program where
 * unset and present. Prints the values that matter on f. */
void gp_default_env(FILE *f);

/* PERSEUS_TEST_HOSTS (0..GP_MAX_RANKS, default 0): the ranks pretend to be on
 * that many hosts (NCCL_HOSTID), consecutive ranks on one host, so peers on
 * another host are network (GIN) peers; 0 keeps the real host. Returns 0 and
 * sets *hosts, or -1 after saying what is wrong with the value. */
int gp_test_hosts(int *hosts);

/* Totals of perseus_rma_process_stats() over the plugin NCCL loaded in this
 * process; -1 where the plugin is not loaded or lacks the function. */
int gp_rma_stats(perseus_rma_peer_stats_t *out);

#ifdef __cplusplus
}
#endif
#endif
