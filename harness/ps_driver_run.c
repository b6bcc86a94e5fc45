/* Forked ranks over shared memory: spawn, barrier, full-mesh connect. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "proc.h"
#include "ps_driver.h"
#include "size_parse.h"

struct drv_shared {
  atomic_int arrived, generation, failed;
  int nranks;
  pid_t pids[DRV_MAX_RANKS];
  atomic_int killed_ok[DRV_MAX_RANKS];
  unsigned char handles[DRV_MAX_RANKS][DRV_MAX_RANKS][NCCL_NET_HANDLE_MAXSIZE];
};

double drv_now(void) { return ps_proc_now(); }

static void nap(void) {
  struct timespec ts = {0, 50000};
  nanosleep(&ts, NULL);
}

int drv_barrier(drv_rank_t *r, int timeout_s) { return drv_barrier_poll(r, timeout_s, NULL, NULL); }

int drv_barrier_poll(drv_rank_t *r, int timeout_s, int (*poll)(void *), void *arg) {
  drv_shared_t *s = r->sh;
  int gen = atomic_load(&s->generation);
  if (atomic_fetch_add(&s->arrived, 1) == s->nranks - 1) {
    atomic_store(&s->arrived, 0);
    atomic_fetch_add(&s->generation, 1);
    return 0;
  }
  double end = drv_now() + timeout_s;
  while (atomic_load(&s->generation) == gen) {
    if (atomic_load(&s->failed) || drv_now() > end) {
      fprintf(stderr, "rank %d: barrier abandoned (%s)\n", r->rank,
              atomic_load(&s->failed) ? "another rank failed" : "timeout");
      return -1;
    }
    if (poll && poll(arg)) {
      fprintf(stderr, "rank %d: barrier abandoned (progress failed)\n", r->rank);
      return -1;
    }
    if (!poll) nap();
  }
  return 0;
}

int drv_pid(drv_rank_t *r, int rank) { return r->sh->pids[rank]; }

int drv_peer_failed(drv_rank_t *r) { return atomic_load(&r->sh->failed); }

void drv_mark_killable(drv_rank_t *r, int rank) { atomic_store(&r->sh->killed_ok[rank], 1); }

int drv_mesh(drv_rank_t *r, int timeout_s) {
  int n = r->nranks, me = r->rank;
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    if (r->net.listen(r->dev, r->sh->handles[me][p], &r->listen[p]) != ncclSuccess) {
      fprintf(stderr, "rank %d: listen failed\n", me);
      return -1;
    }
  }
  if (drv_barrier(r, timeout_s)) return -1;
  double end = drv_now() + timeout_s;
  for (;;) {
    int pending = 0;
    for (int p = 0; p < n; p++) {
      if (p == me) continue;
      if (!r->send[p] && r->net.connect(r->dev, r->sh->handles[p][me], &r->send[p])) {
        fprintf(stderr, "rank %d: connect to %d failed\n", me, p);
        return -1;
      }
      if (!r->recv[p] && r->net.accept(r->listen[p], &r->recv[p])) {
        fprintf(stderr, "rank %d: accept from %d failed\n", me, p);
        return -1;
      }
      pending += !r->send[p] + !r->recv[p];
    }
    if (!pending) return drv_barrier(r, timeout_s);
    if (drv_now() > end) {
      fprintf(stderr, "rank %d: mesh not connected after %d s\n", me, timeout_s);
      return -1;
    }
  }
}

void drv_close_mesh(drv_rank_t *r) {
  for (int p = 0; p < r->nranks; p++) {
    if (r->send[p]) r->net.close_send(r->send[p]);
    if (r->recv[p]) r->net.close_recv(r->recv[p]);
    if (r->listen[p]) r->net.close_listen(r->listen[p]);
    r->send[p] = r->recv[p] = r->listen[p] = NULL;
  }
}

int drv_wait(drv_rank_t *r, void *req, int *sizes, double timeout_s, ncclResult_t *rcp) {
  double end = drv_now() + timeout_s;
  int done = 0;
  ncclResult_t rc = ncclSuccess;
  while (!done) {
    rc = r->net.test(req, &done, sizes);
    if (rc != ncclSuccess) break;
    if (!done && drv_now() > end) {
      if (rcp) *rcp = ncclInProgress;
      return -1;
    }
  }
  if (rcp) *rcp = rc;
  return rc == ncclSuccess ? 0 : -1;
}

/* PS_TEST_RANK_ENV="R:VAR=VALUE ...": rank R sets VAR before it loads the
 * plugin, for tests of settings that differ between ranks. -1 when an item
 * is not of that form. */
static int rank_env(int rank) {
  const char *spec = getenv("PS_TEST_RANK_ENV");
  if (!spec) return 0;
  char *copy = strdup(spec), *save = NULL;
  int bad = !copy;
  for (char *t = copy ? strtok_r(copy, " ", &save) : NULL; t && !bad; t = strtok_r(NULL, " ", &save)) {
    char *colon = strchr(t, ':'), *eq = colon ? strchr(colon, '=') : NULL, *end = NULL;
    long r = strtol(t, &end, 10);
    if (!colon || !eq || eq == colon + 1 || end != colon || t[0] < '0' || t[0] > '9') {
      fprintf(stderr, "PS_TEST_RANK_ENV: '%s' is not RANK:VAR=VALUE\n", t);
      bad = 1;
    } else if (r == rank) {
      *eq = 0;
      bad = setenv(colon + 1, eq + 1, 1) != 0;
    }
  }
  free(copy);
  return bad ? -1 : 0;
}

static int rank_main(const drv_opts_t *o, drv_shared_t *sh, void *user, int rank, drv_rank_fn fn,
                     void *arg) {
  void *slots[3 * DRV_MAX_RANKS] = {0};
  drv_rank_t r = {.rank = rank, .nranks = o->nranks, .dev = 0, .sh = sh, .user = user,
                  .send = slots, .recv = slots + DRV_MAX_RANKS, .listen = slots + 2 * DRV_MAX_RANKS};
  if (rank_env(rank)) return 2;
  if (o->no_load) return fn(&r, arg);
  if (drv_load(o->plugin, o->version, &r.net)) return 2;
  int ndev = 0;
  if (r.net.devices(&ndev) || ndev < 1) {
    fprintf(stderr, "rank %d: plugin reports no device\n", rank);
    return 2;
  }
  if (!o->no_mesh && drv_mesh(&r, o->timeout_s)) return 3;
  int rc = fn(&r, arg);
  drv_close_mesh(&r);
  r.net.finalize();
  return rc;
}

typedef struct {
  const drv_opts_t *o;
  drv_shared_t *sh;
  void *user;
  drv_rank_fn fn;
  void *arg;
  double end;
  int bad;
} run_t;

static int rank_child(int rank, void *arg) {
  run_t *run = arg;
  int rc = rank_main(run->o, run->sh, run->user, rank, run->fn, run->arg);
  if (rc) atomic_store(&run->sh->failed, 1);
  return rc;
}

static int rank_ended(void *arg, int rank, pid_t pid, int code, int signaled) {
  run_t *run = arg;
  (void)pid;
  if (signaled && atomic_load(&run->sh->killed_ok[rank])) return 0; /* killed on purpose */
  if (!code) return 0;
  run->bad = 1;
  atomic_store(&run->sh->failed, 1);
  if (signaled) fprintf(stderr, "rank %d died of signal %d\n", rank, code - 128);
  else fprintf(stderr, "rank %d exited with %d\n", rank, code);
  return 0;
}

static int run_tick(void *arg, double now, const pid_t *pids, int n) {
  run_t *run = arg;
  (void)pids, (void)n;
  if (now <= run->end) return 0;
  fprintf(stderr, "run exceeded %d s: killing remaining ranks\n", run->o->timeout_s);
  run->bad = 1;
  return 1;
}

int drv_run(const drv_opts_t *o, drv_rank_fn fn, void *arg) {
  if (o->nranks < 1 || o->nranks > DRV_MAX_RANKS) {
    fprintf(stderr, "ranks must be in [1, %d], got %d\n", DRV_MAX_RANKS, o->nranks);
    return -1;
  }
  size_t bytes = sizeof(drv_shared_t) + o->shared_bytes;
  drv_shared_t *sh = ps_proc_shared_map(bytes);
  if (!sh) return -1;
  sh->nranks = o->nranks;
  void *user = (char *)sh + sizeof *sh;
  run_t run = {.o = o, .sh = sh, .user = user, .fn = fn, .arg = arg,
               .end = drv_now() + (o->timeout_s > 0 ? o->timeout_s : 600)};
  /* a rank that fails does not stop the others: they must notice it
   * (drv_peer_failed) or a test kills ranks on purpose; only the timeout
   * stops the set */
  ps_proc_set_t set = {.prog = "perseus", .what = "ranks", .poll_s = 0.002, .ended = rank_ended,
                       .tick = run_tick, .arg = &run};
  /* sh->pids stay for the ranks (drv_pid); the reaper clears its copy */
  pid_t pids[DRV_MAX_RANKS];
  int codes[DRV_MAX_RANKS];
  if (ps_proc_spawn(&set, o->nranks, rank_child, &run, sh->pids) == 0) {
    memcpy(pids, sh->pids, (size_t)o->nranks * sizeof *pids);
    ps_proc_reap(&set, pids, o->nranks, codes);
  } else
    run.bad = 1;
  if (o->collect && o->shared_bytes) memcpy(o->collect, user, o->shared_bytes);
  munmap(sh, bytes);
  return run.bad ? -1 : 0;
}

/* xorshift64* stream keyed by the message id: any byte out of place shows. */
void drv_fill(void *buf, size_t n, uint64_t id) {
  uint64_t x = id * 0x9E3779B97F4A7C15ULL + 0x1234567ULL;
  unsigned char *p = buf;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    uint64_t v = x * 0x2545F4914F6CDD1DULL;
    memcpy(p + i, &v, 8);
  }
  x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
  uint64_t v = x * 0x2545F4914F6CDD1DULL;
  for (; i < n; i++, v >>= 8) p[i] = (unsigned char)v;
}

long drv_verify(const void *buf, size_t n, uint64_t id) {
  uint64_t x = id * 0x9E3779B97F4A7C15ULL + 0x1234567ULL;
  const unsigned char *p = buf;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    uint64_t v = x * 0x2545F4914F6CDD1DULL, got;
    memcpy(&got, p + i, 8);
    if (got != v)
      for (int k = 0; k < 8; k++)
        if (p[i + k] != (unsigned char)(v >> (8 * k))) return (long)(i + k);
  }
  x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
  uint64_t v = x * 0x2545F4914F6CDD1DULL;
  for (; i < n; i++, v >>= 8)
    if (p[i] != (unsigned char)v) return (long)i;
  return -1;
}

long drv_count_wrong(const void *buf, size_t n, uint64_t id) {
  long off = drv_verify(buf, n, id);
  if (off < 0) return 0;
  /* slow path, only when something is wrong: compare against a fresh copy */
  unsigned char *want = malloc(n);
  if (!want) return (long)n - off;
  drv_fill(want, n, id);
  long bad = 0;
  for (size_t i = (size_t)off; i < n; i++) bad += want[i] != ((const unsigned char *)buf)[i];
  free(want);
  return bad;
}

void drv_describe_host(char *out, size_t n) {
  struct utsname u;
  if (uname(&u)) snprintf(u.nodename, sizeof u.nodename, "?");
  char cpu[256] = "?", line[256];
  FILE *f = fopen("/proc/cpuinfo", "r");
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "model name", 10)) {
      char *c = strchr(line, ':');
      snprintf(cpu, sizeof cpu, "%s", c ? c + 2 : line);
      cpu[strcspn(cpu, "\n")] = 0;
      break;
    }
  if (f) fclose(f);
  time_t now = time(NULL);
  char date[64];
  strftime(date, sizeof date, "%Y-%m-%d %H:%M", localtime(&now));
  snprintf(out, n, "%s (%ld cores, %s), %s", u.nodename, sysconf(_SC_NPROCESSORS_ONLN), cpu, date);
}

void drv_default_fabric(void) {
  const char *p = getenv("PERSEUS_PROVIDER"), *i = getenv("PERSEUS_IFACE");
  if (!p || !*p) setenv("PERSEUS_PROVIDER", p = "tcp;ofi_rxm", 1);
  if (!i || !*i) setenv("PERSEUS_IFACE", !strcmp(p, "shm") ? "shm" : "lo", 1);
}

size_t drv_parse_size(const char *flag, const char *s, size_t lo, size_t hi) {
  size_t v;
  if (sp_parse_size(s, 1, &v) || v < lo || v > hi) {
    fprintf(stderr, "%s '%s': expected a size from %zu to %zu (digits, optional K/M/G/T)\n", flag,
            s, lo, hi);
    exit(2);
  }
  return v;
}

double drv_parse_factor(const char *flag, const char *s, double hi) {
  double v;
  if (sp_parse_factor(s, hi, &v)) {
    fprintf(stderr, "%s '%s': expected a factor above 1 and at most %g\n", flag, s, hi);
    exit(2);
  }
  return v;
}

const char *drv_parse_plugin(const char *flag, const char *s) {
  if (!*s) {
    fprintf(stderr, "%s '': expected a plugin file (a path, or a name dlopen finds)\n", flag);
    exit(2);
  }
  return s;
}

int drv_parse_int(const char *flag, const char *s, int lo, int hi) {
  int v;
  if (sp_parse_int(s, lo, hi, &v)) {
    fprintf(stderr, "%s '%s': expected an integer from %d to %d\n", flag, s, lo, hi);
    exit(2);
  }
  return v;
}

/* The file's first page holds its name, for drv_shared_free; the caller's
 * memory starts after it. */
#define SHARED_HEAD 4096

/* Window files of processes that ended without freeing them (killed). */
static void reap_dead_windows(void) {
  DIR *dir = opendir("/dev/shm");
  if (!dir) return;
  for (struct dirent *de; (de = readdir(dir));) {
    int pid;
    char w;
    if (sscanf(de->d_name, "pm_%d_%c", &pid, &w) == 2 && w == 'w' && pid > 0 && kill(pid, 0) &&
        errno == ESRCH)
      shm_unlink(de->d_name);
  }
  closedir(dir);
}

void *drv_shared_alloc(size_t size) {
  static unsigned n;
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, reap_dead_windows);
  char name[64];
  snprintf(name, sizeof name, "/pm_%d_w%u", (int)getpid(), __atomic_fetch_add(&n, 1, __ATOMIC_RELAXED));
  size_t total = SHARED_HEAD + ((size + 4095) & ~(size_t)4095);
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
  char *p = fd < 0 || ftruncate(fd, (off_t)total)
                ? MAP_FAILED
                : mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    fprintf(stderr, "shared memory of %zu bytes (%s): %s\n", total, name, strerror(errno));
    if (fd >= 0) shm_unlink(name);
  }
  if (fd >= 0) close(fd);
  if (p == MAP_FAILED) return NULL;
  snprintf(p, SHARED_HEAD, "%s", name); /* the name stays while the memory lives: peers map by it */
  return p + SHARED_HEAD;
}

void drv_shared_free(void *mem, size_t size) {
  if (!mem) return;
  char *p = (char *)mem - SHARED_HEAD;
  shm_unlink(p);
  munmap(p, SHARED_HEAD + ((size + 4095) & ~(size_t)4095));
}
