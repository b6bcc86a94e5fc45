/* proc.h: a set of forked processes, for the tests and benchmarks that run
 * one process per rank (C11, no CUDA or NCCL). The parent reaps them; on the
 * first one that fails, or when the caller's tick asks (a timeout, a
 * watchdog, a signal), it stops the set: the caller raises its abort flag,
 * the rest are killed, and the reaper waits, bounded, for them to go. */
#ifndef PS_HARNESS_PROC_H
#define PS_HARNESS_PROC_H

#include <stdarg.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A child's body; what it returns is its exit status. */
typedef int (*ps_proc_fn)(int index, void *arg);

typedef struct {
  const char *prog; /* prefix of every message */
  const char *what; /* what the set is doing, for messages */
  double poll_s;    /* between polls while nothing ends */
  /* A child ended with `code` (its exit status, or 128 + the signal that
   * killed it; `signaled` says which). Returns 1 when that fails the set,
   * after saying so. NULL: a nonzero code fails it, reported by ps_proc. */
  int (*ended)(void *arg, int index, pid_t pid, int code, int signaled);
  /* Every poll: returns 1 (after saying why) to stop the set now. */
  int (*tick)(void *arg, double now, const pid_t *pids, int n);
  /* Once, before the others are killed: raise the abort flag, say where
   * each of the remaining ones was (pids[i] > 0: still running). */
  void (*stopping)(void *arg, const pid_t *pids, int n);
  void *arg;
} ps_proc_set_t;

double ps_proc_now(void); /* CLOCK_MONOTONIC, seconds */

/* A zeroed MAP_SHARED anonymous mapping of `bytes`, made before the fork so
 * that the parent and its children see one copy; NULL (errno set) when mmap
 * refuses. */
void *ps_proc_shared_map(size_t bytes);

/* In the parent: SIGINT and SIGTERM go to handler (which notes the signal;
 * the caller's tick then stops the set). The children restore the defaults. */
void ps_proc_catch_signals(void (*handler)(int));

/* Forks n children running fn(index, arg), each restoring the default
 * SIGINT/SIGTERM handling and dying with the parent. Returns 0, or -1 after
 * saying why and killing and reaping those already forked. */
int ps_proc_spawn(const ps_proc_set_t *s, int n, ps_proc_fn fn, void *arg, pid_t *pids);

/* Reaps the n children of pids (each entry is cleared once reaped); codes[i]
 * gets each one's code as ended() sees it (-1: never reaped). Returns 0 when
 * nothing failed the set. */
int ps_proc_reap(const ps_proc_set_t *s, pid_t *pids, int n, int *codes);

/* In a forked child that cannot go on: says on stderr what failed and where,
 *   "<prog>: GPU probe: <msg> (<file>:<line>)"                  rank < 0
 *   "<prog>: [<tag>] rank <rank> (GPU <rank>): <msg> (<file>:<line>)"
 * ("[<tag>] " only where tag is not NULL; rank r runs on GPU r), raises the
 * set's shared *abort_flag so the other ranks leave quietly, flushes stdio
 * where flush is nonzero, and _exit(1)s. */
__attribute__((noreturn, format(printf, 8, 0)))
void ps_proc_child_vdie(const char *prog, const char *tag, int rank, int *abort_flag, int flush,
                        const char *file, int line, const char *fmt, va_list ap);

#ifdef __cplusplus
}
#endif
#endif
