/* coll_proc.c: process management of perseus_coll_perf, run in the parent.
 *
 * coll_spawn() resets the per-sweep control fields of the shared mapping and
 * runs the GPU probe child or one child per rank (coll_ops.c) as a process
 * set (../harness/proc.h). The set stops on the first child that fails, on
 * SIGINT/SIGTERM, on the overall -T deadline, or when every rank has
 * reported but some hang in NCCL teardown for more than PS_TEARDOWN_GRACE_S:
 * the abort flag goes up, the rest are killed, and stderr says why. Nothing
 * here calls CUDA or NCCL. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "coll_perf.h"
#include "proc.h"

#ifndef PS_TEARDOWN_GRACE_S
#define PS_TEARDOWN_GRACE_S 60.0
#endif

typedef struct {
  int sw, nproc, *timed_out;
  double deadline, done_at;
  int told;    /* tick said why the set stops */
  int stopped; /* the set is being stopped */
  char what[64];
} coll_set_t;

double coll_now_s(void) { return ps_proc_now(); }

static int child(int r, void *arg)
{
  coll_set_t *set = arg;
  if (set->sw < 0) coll_probe_main();
  coll_child_main(set->sw, r);
  return 1; /* not reached: both _exit() */
}

static int ended(void *arg, int r, pid_t pid, int code, int signaled)
{
  coll_set_t *set = arg;
  if (!code) return 0;
  if (set->stopped) return 1; /* the rest, killed after the first failure: said already */
  char who[48];
  if (set->sw >= 0) snprintf(who, sizeof(who), "rank %d (pid %d)", r, (int)pid);
  else snprintf(who, sizeof(who), "pid %d", (int)pid);
  if (signaled)
    fprintf(stderr, "perseus_coll_perf: %s: %s killed by signal %d (%s)\n", set->what, who,
            code - 128, strsignal(code - 128));
  else
    fprintf(stderr, "perseus_coll_perf: %s: %s exited with status %d\n", set->what, who, code);
  return 1;
}

static int why_stop(void *arg, double now, const pid_t *pids, int n)
{
  coll_set_t *set = arg;
  int alive = 0;
  for (int i = 0; i < n; i++) alive += pids[i] > 0;
  if (coll_signal) {
    fprintf(stderr, "perseus_coll_perf: %s: interrupted by signal %d\n", set->what,
            (int)coll_signal);
    return 1;
  }
  if (now > set->deadline) {
    fprintf(stderr, "perseus_coll_perf: %s: timeout (-T %d s) with %d process(es) still "
            "running; killing them\n", set->what, coll_cfg.timeout_s, alive);
    *set->timed_out = 1;
    return 1;
  }
  if (__atomic_load_n(&coll_shm->ranks_done, __ATOMIC_ACQUIRE) == n) {
    if (set->done_at == 0.0) set->done_at = now;
    else if (now - set->done_at > PS_TEARDOWN_GRACE_S) {
      fprintf(stderr, "perseus_coll_perf: %s: all results are in but %d process(es) hang "
              "in NCCL teardown for %.0f s; killing them\n", set->what, alive, PS_TEARDOWN_GRACE_S);
      return 1;
    }
  }
  return 0;
}

static int tick(void *arg, double now, const pid_t *pids, int n)
{
  coll_set_t *set = arg;
  set->told = why_stop(arg, now, pids, n);
  return set->told;
}

static void stopping(void *arg, const pid_t *pids, int n)
{
  coll_set_t *set = arg;
  set->stopped = 1;
  int alive = 0;
  for (int i = 0; i < n; i++) alive += pids[i] > 0;
  if (alive > 0 && !set->told)
    fprintf(stderr, "perseus_coll_perf: %s: killing the remaining %d process(es)\n", set->what,
            alive);
  __atomic_store_n(&coll_shm->abort_flag, 1, __ATOMIC_RELEASE);
}

int coll_spawn(int sw, int nproc, double deadline, int *timed_out)
{
  pid_t pids[PS_MAX_GPUS];
  int codes[PS_MAX_GPUS];
  coll_set_t set = {.sw = sw, .nproc = nproc, .timed_out = timed_out, .deadline = deadline};
  snprintf(set.what, sizeof(set.what), "%s%s", sw < 0 ? "GPU probe" : "sweep ",
           sw < 0 ? "" : coll_sweep_names[sw]);
  ps_proc_set_t ps = {.prog = "perseus_coll_perf", .what = set.what, .poll_s = 0.02,
                      .ended = ended, .tick = tick, .stopping = stopping, .arg = &set};
  coll_shm->id_ready = coll_shm->abort_flag = coll_shm->ranks_done = 0;
  coll_shm->bar_count = coll_shm->bar_gen = 0;
  if (ps_proc_spawn(&ps, nproc, child, &set, pids) != 0) return -1;
  return ps_proc_reap(&ps, pids, nproc, codes);
}
