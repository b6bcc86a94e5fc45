/* coll_proc.c: process management of perseus_coll_perf, run in the parent.
 *
 * coll_spawn() resets the per-sweep control fields of the shared mapping, forks
 * the GPU probe child or one child per rank (each restores the default SIGINT
 * and SIGTERM handling and enters coll_ops.c), then reaps them. The reaper
 * polls: on the first child that fails, on SIGINT/SIGTERM, on the overall -T
 * deadline, or when every rank has reported but some hang in NCCL teardown for
 * more than PS_TEARDOWN_GRACE_S, it raises the abort flag, SIGKILLs the rest and
 * says why on stderr. Nothing here calls CUDA or NCCL. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "coll_perf.h"

#ifndef PS_TEARDOWN_GRACE_S
#define PS_TEARDOWN_GRACE_S 60.0
#endif

double coll_now_s(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void kill_all(pid_t *pids, int n)
{
  for (int i = 0; i < n; i++)
    if (pids[i] > 0) kill(pids[i], SIGKILL);
}

/* Reap n children; on the first failure, timeout or signal kill the others.
 * Returns 0 when all exited with status 0. */
static int wait_children(pid_t *pids, int n, const char *what, double deadline, int *timed_out)
{
  int alive = n, failed = 0;
  double killed_at = 0.0, done_at = 0.0;
  while (alive > 0) {
    int status;
    pid_t p = waitpid(-1, &status, WNOHANG);
    if (p > 0) {
      int idx = -1;
      for (int i = 0; i < n; i++)
        if (pids[i] == p) idx = i;
      if (idx < 0) continue;
      pids[idx] = 0;
      alive--;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (!failed) {
        char who[48];
        if (strcmp(what, "GPU probe"))
          snprintf(who, sizeof(who), "rank %d (pid %d)", idx, (int)p);
        else
          snprintf(who, sizeof(who), "pid %d", (int)p);
        if (WIFSIGNALED(status))
          fprintf(stderr, "perseus_coll_perf: %s: %s killed by signal %d (%s)\n", what, who,
                  WTERMSIG(status), strsignal(WTERMSIG(status)));
        else
          fprintf(stderr, "perseus_coll_perf: %s: %s exited with status %d\n", what, who,
                  WEXITSTATUS(status));
        if (alive > 0)
          fprintf(stderr, "perseus_coll_perf: %s: killing the remaining %d process(es)\n",
                  what, alive);
      }
      failed = 1;
      continue;
    }
    if (p < 0 && errno != EINTR) break; /* ECHILD: nothing left */
    double t = coll_now_s();
    if (!failed && coll_signal) {
      fprintf(stderr, "perseus_coll_perf: %s: interrupted by signal %d\n", what, (int)coll_signal);
      failed = 1;
    }
    if (!failed && t > deadline) {
      fprintf(stderr, "perseus_coll_perf: %s: timeout (-T %d s) with %d process(es) still "
              "running; killing them\n", what, coll_cfg.timeout_s, alive);
      *timed_out = 1;
      failed = 1;
    }
    if (!failed && __atomic_load_n(&coll_shm->ranks_done, __ATOMIC_ACQUIRE) == n) {
      if (done_at == 0.0) done_at = t;
      else if (t - done_at > PS_TEARDOWN_GRACE_S) {
        fprintf(stderr, "perseus_coll_perf: %s: all results are in but %d process(es) hang "
                "in NCCL teardown for %.0f s; killing them\n", what, alive, PS_TEARDOWN_GRACE_S);
        failed = 1;
      }
    }
    if (failed) {
      if (killed_at == 0.0) {
        __atomic_store_n(&coll_shm->abort_flag, 1, __ATOMIC_RELEASE);
        kill_all(pids, n);
        killed_at = t;
      } else if (t - killed_at > 30.0) {
        fprintf(stderr, "perseus_coll_perf: %s: %d process(es) did not die after SIGKILL\n",
                what, alive);
        break;
      }
    }
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  return failed ? -1 : 0;
}

int coll_spawn(int sw, int nproc, double deadline, int *timed_out)
{
  pid_t pids[PS_MAX_GPUS], parent = getpid();
  coll_shm->id_ready = coll_shm->abort_flag = coll_shm->ranks_done = 0;
  coll_shm->bar_count = coll_shm->bar_gen = 0;
  fflush(NULL);
  for (int r = 0; r < nproc; r++) {
    pid_t p = fork();
    if (p == 0) {
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      if (sw < 0) coll_probe_main(parent);
      coll_child_main(sw, r, parent);
    }
    if (p < 0) {
      fprintf(stderr, "perseus_coll_perf: fork: %s\n", strerror(errno));
      kill_all(pids, r);
      for (int i = 0; i < r; i++) waitpid(pids[i], NULL, 0);
      return -1;
    }
    pids[r] = p;
  }
  char what[64];
  snprintf(what, sizeof(what), "%s%s", sw < 0 ? "GPU probe" : "sweep ",
           sw < 0 ? "" : coll_sweep_names[sw]);
  return wait_children(pids, nproc, what, deadline, timed_out);
}
