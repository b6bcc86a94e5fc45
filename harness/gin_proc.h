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

/* Line-buffers stdout (the parent's lines and the ranks' interleave whole)
 * and maps the shared area; call once in the parent before any fork. */
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

/* A test's rank set: gp_run (no probe, no tick) timed, then the mismatches
 * every rank counted in its slot, totalled into *mismatches, and the seconds
 * it took into *secs. Returns 0 when every rank exited 0 and none counted a
 * mismatch, else -1. */
int gp_run_test(int nproc, gp_child_fn fn, void *arg, double stall_s, const char *what,
                long long *mismatches, double *secs);

/* A benchmark's results through a pipe. Every record starts with a gp_rec_t:
 * the set (a strategy, a path) and row it belongs to, the rank that sent it,
 * whether that rank read the plugin's statistics, and its time. The ranks of
 * a set write whole records (rec_size <= PIPE_BUF, so each write is atomic)
 * to fd[1], inherited across the fork. The parent merges each record, as it
 * arrives (gp_results_drain as gp_run's tick) and at gp_results_close, into
 * its cell of cells[nsets][nrows] (cell_size bytes each, starting with a
 * gp_cell_t): one more rank, stats_ok while every rank's is, the slowest
 * rank's time; then fold(rec, cell) adds the rest. A record of no cell is
 * dropped. */
typedef struct { int set, row, rank, stats_ok; double us; } gp_rec_t;
typedef struct { int ranks, stats_ok; double us; } gp_cell_t;
typedef struct {
  int fd[2];
  size_t rec_size, cell_size;
  void *cells;
  int nsets, nrows;
  void (*fold)(const void *rec, void *cell);
} gp_results_t;
/* Returns 0, or -1 after saying why there is no pipe. */
int gp_results_open(gp_results_t *r, size_t rec_size, void *cells, size_t cell_size, int nsets,
                    int nrows, void (*fold)(const void *rec, void *cell));
void gp_results_drain(void *r);
void gp_results_close(gp_results_t *r);

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

/* Option values (the options themselves: opts.h). */
int gp_parse_int(const char *s, long lo, long hi, int *out);
/* Comma-separated integers in [lo, hi]; returns the count or -1. */
int gp_parse_int_list(const char *s, long lo, long hi, int *out, int max);

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
