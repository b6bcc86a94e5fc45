/* proc.c: forked process sets (see proc.h). */
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* After SIGKILL a process may sit in uninterruptible sleep (a GPU driver
 * call); past this the reaper stops waiting for it and says so. */
#define PS_PROC_KILL_WAIT_S 30.0

double ps_proc_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void *ps_proc_shared_map(size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  memset(p, 0, bytes);
  return p;
}

void ps_proc_catch_signals(void (*handler)(int)) {
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = handler;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
}

static void kill_all(const pid_t *pids, int n) {
  for (int i = 0; i < n; i++)
    if (pids[i] > 0) kill(pids[i], SIGKILL);
}

/* PERSEUS_TEST_NETNS=PREFIX (test/netns_run.sh): process i runs in the
 * network namespace PREFIXi, a host of its own, before anything opens a
 * socket. */
static int enter_netns(const ps_proc_set_t *s, int i) {
  const char *prefix = getenv("PERSEUS_TEST_NETNS");
  if (!prefix || !*prefix) return 0;
  char path[256];
  snprintf(path, sizeof path, "/run/netns/%s%d", prefix, i);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
    fprintf(stderr, "%s: %s: process %d cannot enter network namespace %s: %s\n", s->prog, s->what,
            i, path, strerror(errno));
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  return 0;
}

int ps_proc_spawn(const ps_proc_set_t *s, int n, ps_proc_fn fn, void *arg, pid_t *pids) {
  pid_t parent = getpid();
  fflush(NULL);
  for (int i = 0; i < n; i++) {
    pid_t p = fork();
    if (p == 0) {
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      /* the parent's death (even SIGKILL) takes the set with it */
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(1);
      if (enter_netns(s, i)) _exit(1);
      int code = fn(i, arg);
      fflush(NULL);
      _exit(code);
    }
    if (p < 0) {
      fprintf(stderr, "%s: %s: fork: %s\n", s->prog, s->what, strerror(errno));
      kill_all(pids, i);
      for (int k = 0; k < i; k++) waitpid(pids[k], NULL, 0);
      return -1;
    }
    pids[i] = p;
  }
  return 0;
}

static int default_ended(const ps_proc_set_t *s, int i, pid_t pid, int code, int signaled) {
  if (!code) return 0;
  if (signaled)
    fprintf(stderr, "%s: %s: process %d (pid %d) killed by signal %d (%s)\n", s->prog, s->what, i,
            (int)pid, code - 128, strsignal(code - 128));
  else
    fprintf(stderr, "%s: %s: process %d (pid %d) exited with status %d\n", s->prog, s->what, i,
            (int)pid, code);
  return 1;
}

int ps_proc_reap(const ps_proc_set_t *s, pid_t *pids, int n, int *codes) {
  int alive = n, failed = 0;
  double killed_at = 0.0;
  for (int i = 0; i < n; i++) codes[i] = -1;
  while (alive > 0) {
    int status;
    pid_t p = waitpid(-1, &status, WNOHANG);
    if (p > 0) {
      int i = 0;
      while (i < n && pids[i] != p) i++;
      if (i == n) continue; /* not one of ours */
      pids[i] = 0;
      alive--;
      int signaled = WIFSIGNALED(status);
      codes[i] = signaled ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
      int bad = s->ended ? s->ended(s->arg, i, p, codes[i], signaled)
                         : default_ended(s, i, p, codes[i], signaled);
      if (bad && !failed) {
        failed = 1;
        if (alive > 0 && s->stopping) s->stopping(s->arg, pids, n);
      }
      continue; /* reap whatever else ended before sleeping */
    }
    if (p < 0 && errno != EINTR) break; /* ECHILD: nothing left */
    double now = ps_proc_now();
    if (!failed && s->tick && s->tick(s->arg, now, pids, n)) {
      failed = 1;
      if (s->stopping) s->stopping(s->arg, pids, n);
    }
    if (failed) {
      if (killed_at == 0.0) {
        kill_all(pids, n);
        killed_at = now;
      } else if (now - killed_at > PS_PROC_KILL_WAIT_S) {
        fprintf(stderr, "%s: %s: %d process(es) did not die after SIGKILL\n", s->prog, s->what,
                alive);
        break;
      }
    }
    double poll = s->poll_s > 0 ? s->poll_s : 0.02;
    struct timespec ts = {(time_t)poll, (long)((poll - (double)(time_t)poll) * 1e9)};
    nanosleep(&ts, NULL);
  }
  return failed ? -1 : 0;
}

void ps_proc_child_vdie(const char *prog, const char *tag, int rank, int *abort_flag, int flush,
                        const char *file, int line, const char *fmt, va_list ap) {
  char msg[1024];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  if (rank < 0)
    fprintf(stderr, "%s: GPU probe: %s (%s:%d)\n", prog, msg, file, line);
  else
    fprintf(stderr, "%s: %s%s%srank %d (GPU %d): %s (%s:%d)\n", prog, tag ? "[" : "",
            tag ? tag : "", tag ? "] " : "", rank, rank, msg, file, line);
  __atomic_store_n(abort_flag, 1, __ATOMIC_RELEASE);
  if (flush) fflush(NULL);
  _exit(1);
}
