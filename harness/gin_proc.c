/* gin_proc.c: process management, host barrier, watchdog, option parsing,
 * environment and plugin statistics for the GIN programs (see gin_proc.h).
 * Nothing here calls CUDA or NCCL. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dl_find.h"
#include "gin_proc.h"
#include "proc.h"
#include "size_parse.h"

#ifndef PS_INSTALLED_PLUGIN_PATH
#define PS_INSTALLED_PLUGIN_PATH "/usr/local/lib/libnccl-net-perseus.so"
#endif
#define GP_PLUGIN_BASENAME "libnccl-net-perseus.so"

struct gp_shared *gp_sh;
int gp_rank = -1;
const char *gp_prog = "perseus_gin";
static volatile sig_atomic_t gp_signal;

static void on_signal(int sig) { gp_signal = sig; }

double gp_now(void) { return ps_proc_now(); }

int gp_init(const char *prog)
{
  setvbuf(stdout, NULL, _IOLBF, 0);
  gp_prog = prog;
  gp_sh = ps_proc_shared_map(sizeof(*gp_sh));
  if (!gp_sh) {
    fprintf(stderr, "%s: mmap(%zu bytes, MAP_SHARED|MAP_ANONYMOUS): %s\n", prog, sizeof(*gp_sh),
            strerror(errno));
    return -1;
  }
  ps_proc_catch_signals(on_signal);
  return 0;
}

static struct gp_slot *my_slot(void) { return &gp_sh->slot[gp_rank < 0 ? 0 : gp_rank]; }

void gp_beat(void)
{
  double t = gp_now();
  __atomic_store(&my_slot()->beat, &t, __ATOMIC_RELEASE);
}

void gp_progress(const char *mode, int iter, const char *fmt, ...)
{
  struct gp_slot *s = my_slot();
  if (mode) snprintf(s->mode, sizeof(s->mode), "%s", mode);
  s->iter = iter;
  if (fmt) {
    char buf[GP_STAGE_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    memcpy(s->stage, buf, sizeof(buf)); /* display only: a torn read is harmless */
  }
  gp_beat();
}

int gp_aborted(void) { return __atomic_load_n(&gp_sh->abort_flag, __ATOMIC_ACQUIRE); }
void gp_raise_abort(void) { __atomic_store_n(&gp_sh->abort_flag, 1, __ATOMIC_RELEASE); }

int gp_barrier(int n)
{
  unsigned gen = __atomic_load_n(&gp_sh->bar_gen, __ATOMIC_ACQUIRE);
  if (__atomic_add_fetch(&gp_sh->bar_count, 1, __ATOMIC_ACQ_REL) == (unsigned)n) {
    __atomic_store_n(&gp_sh->bar_count, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&gp_sh->bar_gen, 1, __ATOMIC_RELEASE);
    return 0;
  }
  /* waiting for a slower rank is not a hang of ours: the watchdog goes by
   * the rank that stopped, whose beat is the one that ages */
  for (unsigned lap = 0; __atomic_load_n(&gp_sh->bar_gen, __ATOMIC_ACQUIRE) == gen; lap++) {
    if (gp_aborted()) return -1;
    if (lap % 1024 == 0) gp_beat();
    sched_yield();
  }
  return 0;
}

void gp_publish_id(const void *id, size_t len)
{
  memcpy(gp_sh->unique_id, id, len < GP_ID_BYTES ? len : GP_ID_BYTES);
  __atomic_store_n(&gp_sh->id_ready, 1, __ATOMIC_RELEASE);
}

int gp_wait_id(void *id, size_t len)
{
  while (!__atomic_load_n(&gp_sh->id_ready, __ATOMIC_ACQUIRE)) {
    if (gp_aborted()) return -1;
    usleep(1000);
  }
  memcpy(id, gp_sh->unique_id, len < GP_ID_BYTES ? len : GP_ID_BYTES);
  return 0;
}

/* ---- parent side ---------------------------------------------------------- */

static void describe_rank(FILE *f, int r, int pid, double now, int probe, double stall_s)
{
  struct gp_slot *s = &gp_sh->slot[r];
  double beat;
  __atomic_load(&s->beat, &beat, __ATOMIC_ACQUIRE);
  char who[32];
  if (probe) snprintf(who, sizeof(who), "GPU probe");
  else snprintf(who, sizeof(who), "rank %d", r);
  fprintf(f, "%s:   %s (pid %d): mode %s, iteration %d: %.*s (last progress %.1f s ago)%s\n",
          gp_prog, who, pid, s->mode[0] ? s->mode : "-", s->iter, GP_STAGE_LEN, s->stage,
          now - beat, stall_s > 0 && now - beat > stall_s ? "  <-- HUNG" : "");
}

typedef struct {
  int probe;
  gp_child_fn fn;
  void *arg;
  double stall_s;
  const char *what;
  gp_tick_fn tick;
  void *tick_arg;
  int spids[GP_MAX_RANKS];     /* pids for messages (the reaper clears its own) */
  int watchdog[GP_MAX_RANKS];  /* stopped by the watchdog */
  int described;               /* where each rank was has been said */
  int stopped;                 /* the set is being stopped */
} gp_set_t;

static int gp_child(int r, void *arg)
{
  gp_set_t *set = arg;
  gp_rank = set->probe ? -1 : r;
  gp_sh->slot[r].pid = (int)getpid();
  return set->fn(r, set->arg);
}

static int gp_ended(void *arg, int r, pid_t pid, int code, int signaled)
{
  gp_set_t *set = arg;
  if (code == 0) return 0;
  if (set->stopped) return 1; /* the rest, killed after the first failure: said already */
  if (signaled)
    fprintf(stderr, "%s: %s: %s %d (pid %d) killed by signal %d (%s)\n", gp_prog, set->what,
            set->probe ? "GPU probe" : "rank", r, (int)pid, code - 128, strsignal(code - 128));
  else if (code != GP_EXIT_REFUSED && code != GP_EXIT_SKIP)
    fprintf(stderr, "%s: %s: %s %d (pid %d) exited with status %d\n", gp_prog, set->what,
            set->probe ? "GPU probe" : "rank", r, (int)pid, code);
  return 1;
}

static int gp_tick(void *arg, double now, const pid_t *pids, int n)
{
  gp_set_t *set = arg;
  if (set->tick) set->tick(set->tick_arg);
  if (gp_signal) {
    fprintf(stderr, "%s: %s: interrupted by signal %d\n", gp_prog, set->what, (int)gp_signal);
    return 1;
  }
  if (set->stall_s <= 0) return 0;
  int stalled = 0;
  for (int i = 0; i < n; i++) {
    double beat;
    __atomic_load(&gp_sh->slot[i].beat, &beat, __ATOMIC_ACQUIRE);
    if (pids[i] > 0 && now - beat > set->stall_s) stalled = 1;
  }
  if (!stalled) return 0;
  fprintf(stderr, "%s: %s: watchdog: no progress for %.0f s (-w); a hang, killing the "
          "run. Where each rank was:\n", gp_prog, set->what, set->stall_s);
  for (int i = 0; i < n; i++) {
    if (pids[i] <= 0) continue;
    describe_rank(stderr, i, set->spids[i], now, set->probe, set->stall_s);
    set->watchdog[i] = 1;
  }
  set->described = 1;
  return 1;
}

static void gp_stopping(void *arg, const pid_t *pids, int n)
{
  gp_set_t *set = arg;
  set->stopped = 1;
  int alive = 0;
  for (int i = 0; i < n; i++) alive += pids[i] > 0;
  if (!set->described && alive > 0) {
    fprintf(stderr, "%s: %s: stopping the other %d rank(s), which were at:\n", gp_prog,
            set->what, alive);
    for (int i = 0; i < n; i++)
      if (pids[i] > 0) describe_rank(stderr, i, set->spids[i], gp_now(), set->probe, set->stall_s);
  }
  gp_raise_abort();
}

int gp_run(int nproc, int probe, gp_child_fn fn, void *arg, double stall_s, const char *what,
           gp_tick_fn tick, void *tick_arg, int *codes)
{
  if (nproc < 1 || nproc > GP_MAX_RANKS) return -1;
  gp_set_t set = {.probe = probe, .fn = fn, .arg = arg, .stall_s = stall_s, .what = what,
                  .tick = tick, .tick_arg = tick_arg};
  ps_proc_set_t ps = {.prog = gp_prog, .what = what, .poll_s = 0.02, .ended = gp_ended,
                      .tick = gp_tick, .stopping = gp_stopping, .arg = &set};
  pid_t pids[GP_MAX_RANKS];
  gp_sh->id_ready = gp_sh->abort_flag = 0;
  gp_sh->bar_count = gp_sh->bar_gen = 0;
  double t0 = gp_now();
  for (int r = 0; r < nproc; r++) {
    memset(&gp_sh->slot[r], 0, sizeof(gp_sh->slot[r]));
    gp_sh->slot[r].iter = -1;
    snprintf(gp_sh->slot[r].stage, GP_STAGE_LEN, "starting");
    gp_sh->slot[r].beat = t0;
  }
  if (ps_proc_spawn(&ps, nproc, gp_child, &set, pids) != 0) return -1;
  for (int r = 0; r < nproc; r++) set.spids[r] = (int)pids[r];
  ps_proc_reap(&ps, pids, nproc, codes);
  if (tick) tick(tick_arg);
  for (int r = 0; r < nproc; r++) {
    if (set.watchdog[r]) codes[r] = GP_EXIT_WATCHDOG;
    if (codes[r] != 0) return -1;
  }
  return 0;
}

int gp_run_test(int nproc, gp_child_fn fn, void *arg, double stall_s, const char *what,
                long long *mismatches, double *secs)
{
  int codes[GP_MAX_RANKS];
  double t0 = gp_now();
  int failed = gp_run(nproc, 0, fn, arg, stall_s, what, NULL, NULL, codes);
  *mismatches = 0;
  for (int r = 0; r < nproc && r < GP_MAX_RANKS; r++) *mismatches += gp_sh->slot[r].mismatches;
  *secs = gp_now() - t0;
  return failed || *mismatches ? -1 : 0;
}

int gp_results_open(gp_results_t *r, size_t rec_size, void *cells, size_t cell_size, int nsets,
                    int nrows, void (*fold)(const void *rec, void *cell))
{
  r->rec_size = rec_size, r->cells = cells, r->cell_size = cell_size;
  r->nsets = nsets, r->nrows = nrows, r->fold = fold;
  if (rec_size < sizeof(gp_rec_t) || rec_size > PIPE_BUF) {
    fprintf(stderr, "%s: result records of %zu bytes: not %zu..PIPE_BUF\n", gp_prog, rec_size,
            sizeof(gp_rec_t));
    return -1;
  }
  if (pipe(r->fd) || fcntl(r->fd[0], F_SETFL, O_NONBLOCK)) {
    fprintf(stderr, "%s: pipe: %s\n", gp_prog, strerror(errno));
    return -1;
  }
  return 0;
}

void gp_results_drain(void *arg)
{
  gp_results_t *r = arg;
  union { max_align_t align; gp_rec_t head; unsigned char bytes[PIPE_BUF]; } rec;
  while (read(r->fd[0], rec.bytes, r->rec_size) == (ssize_t)r->rec_size) {
    const gp_rec_t *h = &rec.head;
    if (h->set < 0 || h->set >= r->nsets || h->row < 0 || h->row >= r->nrows) continue;
    gp_cell_t *x = (gp_cell_t *)((char *)r->cells +
                                 ((size_t)h->set * (size_t)r->nrows + (size_t)h->row) * r->cell_size);
    x->stats_ok = x->ranks == 0 ? h->stats_ok : x->stats_ok && h->stats_ok;
    x->ranks++;
    if (h->us > x->us) x->us = h->us;
    r->fold(rec.bytes, x);
  }
}

void gp_results_close(gp_results_t *r)
{
  gp_results_drain(r);
  close(r->fd[0]), close(r->fd[1]);
}

/* ---- options -------------------------------------------------------------- */

/* the parsers themselves are shared with the other programs (size_parse.c) */
int gp_parse_int(const char *s, long lo, long hi, int *out)
{
  return sp_parse_int(s, lo, hi, out);
}

int gp_parse_int_list(const char *s, long lo, long hi, int *out, int max)
{
  return sp_parse_int_list(s, lo, hi, out, max);
}


/* ---- environment ---------------------------------------------------------- */

static void default_plugin(void)
{
  if (getenv("NCCL_NET_PLUGIN")) return;
  char exe[PATH_MAX], cand[PATH_MAX + 64], real[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (len > 0) {
    exe[len] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash) *slash = '\0';
    /* the build tree: build/bench/<program> or build/test/gpu/<program>,
     * and build/plugin/<plugin> */
    static const char *const up[] = {"..", "../.."};
    for (size_t i = 0; i < sizeof(up) / sizeof(up[0]); i++) {
      snprintf(cand, sizeof(cand), "%s/%s/plugin/%s", exe, up[i], GP_PLUGIN_BASENAME);
      if (access(cand, R_OK) == 0 && realpath(cand, real)) {
        setenv("NCCL_NET_PLUGIN", real, 0);
        return;
      }
    }
  }
  if (access(PS_INSTALLED_PLUGIN_PATH, R_OK) == 0) {
    setenv("NCCL_NET_PLUGIN", PS_INSTALLED_PLUGIN_PATH, 0);
    return;
  }
  setenv("NCCL_NET_PLUGIN", "perseus", 0); /* libnccl-net-perseus.so via LD_LIBRARY_PATH */
}

void gp_default_env(FILE *f)
{
  /* every peer over the network, hence over GIN and the plugin */
  setenv("NCCL_P2P_DISABLE", "1", 0);
  setenv("NCCL_SHM_DISABLE", "1", 0);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  setenv("NCCL_GIN_TYPE", "2", 0); /* NCCL_NET_DEVICE_GIN_PROXY */
  /* Lazy module loading deadlocks the staging path: launching a not yet
   * loaded kernel behind one that waits for GIN signals stalls the plugin's
   * copies and signal writes, so nothing arrives; every module loads at
   * start instead. */
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  default_plugin();
  static const char *const names[] = {
    "NCCL_NET_PLUGIN", "NCCL_GIN_TYPE", "PERSEUS_ORDERING", "PERSEUS_PROVIDER", "PERSEUS_IFACE",
    "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_SOCKET_IFNAME",
    "NCCL_GIN_NCONTEXTS", "NCCL_GIN_PROXY_QUEUE_SIZE", "CUDA_VISIBLE_DEVICES"};
  fprintf(f, "# env:");
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    const char *v = getenv(names[i]);
    fprintf(f, " %s=%s", names[i], v ? v : "(unset)");
  }
  fprintf(f, "\n");
}

int gp_test_hosts(int *hosts)
{
  const char *v = getenv("PERSEUS_TEST_HOSTS");
  *hosts = 0;
  if (!v || !*v) return 0;
  if (gp_parse_int(v, 0, GP_MAX_RANKS, hosts)) {
    fprintf(stderr, "%s: PERSEUS_TEST_HOSTS='%s': expected a host count 0..%d (0: the real host)\n",
            gp_prog, v, GP_MAX_RANKS);
    return -1;
  }
  return 0;
}

/* ---- plugin statistics ---------------------------------------------------- */

typedef int (*gp_process_stats_fn)(perseus_rma_peer_stats_t *, size_t);

int gp_rma_stats(perseus_rma_peer_stats_t *out)
{
  static gp_process_stats_fn fn;
  static int looked;
  if (!looked) {
    looked = 1;
    void *h = dlopen(GP_PLUGIN_BASENAME, RTLD_NOW | RTLD_NOLOAD);
    if (!h) { /* NCCL_NET_PLUGIN named a path: find the loaded copy by name */
      char path[PATH_MAX] = "";
      if (ps_dl_find("libnccl-net-perseus", path, sizeof(path)) == 0 && path[0])
        h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    }
    if (h) *(void **)&fn = dlsym(h, "perseus_rma_process_stats"); /* h stays open */
  }
  memset(out, 0, sizeof(*out));
  if (!fn || fn(out, sizeof(*out)) != 0) return -1;
  return 0;
}
