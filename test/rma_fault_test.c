/* Fault tests of the one-sided tables, driven through the dlopen'd plugin as
 * NCCL's GIN proxy drives them (harness/ps_driver_gin.h), from forked ranks:
 *
 *   perseus_rma_fault_test -s SCENARIO [-a ABI] [-r RANKS] [-p PLUGIN]
 *
 * ABI: gin11 (default), gin12, gin13, rma13, rma14. PERSEUS_PEER_TIMEOUT_MS
 * defaults to 2000 here. Scenarios:
 *   kill_target        rank 0 streams batches of puts + one put+signal to rank 1
 *                      (bounded outstanding requests, polling test()) and
 *                      SIGKILLs it mid-batch: test(), iput or iputSignal must
 *                      fail and queryLastError report it within
 *                      PERSEUS_PEER_TIMEOUT_MS + 3 s. A third rank, if any,
 *                      is a bystander with nothing outstanding to the victim.
 *   kill_target_drain  the same with PERSEUS_ORDERING=drain: the victim is
 *                      stopped mid-batch, so the batch's iputSignal blocks
 *                      waiting for delivery, and killed 0.2 s into that call:
 *                      the call itself must return an error.
 *   bad_args           out-of-range rank, offsets/sizes outside a region,
 *                      misaligned or out-of-range signal offset, bad signal op,
 *                      NULL/foreign request in test(), foreign memory handles,
 *                      NULL request pointer, bad connection/context index:
 *                      each ncclInvalidArgument; then a put+signal still works
 *                      and nothing rejected reached the target.
 * Prints one line (ok/FAIL, detection time); exit 0 pass, 1 fail, 2 usage. */
#include <getopt.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proc.h"
#include "ps_driver_gin.h"
#include "ps_gin_abi.h"

#define NPUT 8                  /* puts per batch, then one put+signal */
#define PUT_BYTES (256 << 10)   /* each: the batch is 2.25 MiB */
#define MAX_OUT 64              /* outstanding requests (NCCL's queue bounds them) */
#define KILL_AFTER 3            /* batches the victim saw before it is killed */
#define MARGIN_S 3.0            /* detection limit: PERSEUS_PEER_TIMEOUT_MS + this */
#define STOP_S 0.2              /* drain: the victim dies this long into iputSignal */
#define LIFE_S 25.0             /* a rank waiting for something gives up after this */

typedef struct {
  const char *abi, *plugin, *scenario;
  int drain;
  double limit_s;
} args_t;

/* MAP_SHARED before the ranks fork: seen by every rank and the parent. */
typedef struct {
  atomic_ullong seen;   /* signal value the victim observed */
  atomic_int arm;       /* drain: rank 0 is entering the blocking iputSignal */
  atomic_int returned;  /* rank 0 got its error (watchdog stands down) */
  atomic_int done;      /* rank 0 finished: bystanders close */
  _Atomic double t_kill;
  double detect_s;
  int detect_rc, batches;
  char where[16], ordering[16], note[200];
} shared_t;

/* Whether `pid` is stopped (SIGSTOP takes effect asynchronously). */
static int stopped(pid_t pid) {
  char path[64], buf[256] = "", *p;
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (f) buf[fread(buf, 1, sizeof buf - 1, f)] = 0, fclose(f);
  return (p = strrchr(buf, ')')) && p[1] == ' ' && p[2] == 'T';
}

static void nap(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

typedef struct {
  drv_gin_t g;
  void *cc, *src_mh, *dst_mh, *sig_mh;
  unsigned char *src, *dst;
  uint64_t *sig; /* one word per source rank */
} win_t;

/* load, connect, register the source, destination and signal windows */
static int setup(drv_rank_t *r, const args_t *a, win_t *w, size_t bytes) {
  memset(w, 0, sizeof *w);
  CHECK(!drv_gin_load(a->plugin, a->abi, &w->g), "loading %s", a->abi);
  ncclResult_t rc = drv_gin_connect(r, &w->g, &w->cc);
  CHECK(rc == ncclSuccess, "connect returned %d", rc);
  w->src = malloc(bytes), w->dst = calloc(1, bytes), w->sig = calloc((size_t)r->nranks, 8);
  CHECK(w->src && w->dst && w->sig, "out of memory");
  drv_fill(w->src, bytes, 100 + (uint64_t)r->rank);
  CHECK(w->g.reg_sym(w->cc, w->src, bytes, NCCL_PTR_HOST, 0, &w->src_mh) == ncclSuccess, "reg src");
  CHECK(w->g.reg_sym(w->cc, w->dst, bytes, NCCL_PTR_HOST, 0, &w->dst_mh) == ncclSuccess, "reg dst");
  CHECK(w->g.reg_sym(w->cc, w->sig, (size_t)r->nranks * 8, NCCL_PTR_HOST, NCCL_NET_MR_FLAG_FORCE_SO,
                     &w->sig_mh) == ncclSuccess, "reg sig");
  CHECK(!drv_gin_barrier(r, &w->g, w->cc, 60), "barrier after registration");
  return 0;
}

/* The victim progresses (its provider may need it) and publishes what it saw. */
static int victim(drv_rank_t *r, shared_t *fs, win_t *w) {
  for (double end = drv_now() + LIFE_S; drv_now() < end;) {
    ncclResult_t rc = w->g.progress(w->cc);
    CHECK(rc == ncclSuccess, "victim: progress failed (rc %d) before it was killed", rc);
    atomic_store(&fs->seen, __atomic_load_n(&w->sig[0], __ATOMIC_ACQUIRE));
  }
  fprintf(stderr, "rank %d: victim was never killed\n", r->rank);
  return 1;
}

/* Nothing of the bystander's is outstanding to the victim: its comm must
 * stay healthy while the origin's fails. */
static int bystander(drv_rank_t *r, shared_t *fs, win_t *w) {
  for (double end = drv_now() + LIFE_S; !atomic_load(&fs->done);) {
    CHECK(drv_now() < end && !drv_peer_failed(r), "bystander: rank 0 failed or never finished");
    ncclResult_t rc = w->g.progress(w->cc);
    CHECK(rc == ncclSuccess, "bystander: progress failed (rc %d) after rank 1 died, though "
          "nothing of ours was outstanding to it", rc);
    nap(0.0002);
  }
  bool err = true;
  CHECK(w->g.last_error(w->cc, &err) == ncclSuccess && !err, "bystander: queryLastError reports an error");
  CHECK(drv_gin_close(&w->g, w->cc) == ncclSuccess, "bystander: close");
  return 0;
}

/* drain: a helper process kills the (stopped) victim STOP_S after rank 0
 * enters iputSignal, and says so if rank 0 is still blocked long after. */
static pid_t start_killer(shared_t *fs, pid_t victim_pid, double limit_s) {
  fflush(NULL);
  pid_t k = fork();
  if (k) return k;
  for (double end = drv_now() + LIFE_S; !atomic_load(&fs->arm);)
    if (drv_now() > end) _exit(1);
  nap(STOP_S);
  atomic_store(&fs->t_kill, drv_now()); /* first: rank 0 may see the error at once */
  kill(victim_pid, SIGKILL);
  for (double end = drv_now() + limit_s + 5; !atomic_load(&fs->returned);)
    if (drv_now() > end) {
      fprintf(stderr, "rank 0 still blocked in iputSignal %.0f s after the kill\n", limit_s + 5);
      _exit(1);
    } else nap(0.01);
  _exit(0);
}

static int origin(drv_rank_t *r, const args_t *a, shared_t *fs, win_t *w) {
  drv_gin_t *g = &w->g;
  void *req[MAX_OUT];
  int nreq = 0, killed = 0, late[MAX_OUT], late_ok = 0; /* late: issued after the kill */
  long issued[2] = {0, 0};                              /* puts, put+signals */
  pid_t vpid = 0, killer = 0;
  for (int i = 0; i < 1000 && (vpid = drv_pid(r, 1)) <= 0; i++) nap(0.001);
  CHECK(vpid > 0, "no pid for rank 1");
  snprintf(fs->ordering, sizeof fs->ordering, "%s", g->ordering ? g->ordering(w->cc) : "?");
  CHECK(!a->drain || !strcmp(fs->ordering, "drain"), "ordering is %s, not drain", fs->ordering);
  ncclResult_t rc = ncclSuccess;
  double start = drv_now();
  for (;;) {
    double t_kill = atomic_load(&fs->t_kill), now = drv_now();
    CHECK(killed || now - start < 15, "victim saw %llu signals in 15 s, wanted %d",
          (unsigned long long)atomic_load(&fs->seen), KILL_AFTER);
    if (t_kill && now - t_kill > a->limit_s + 5) {
      perseus_rma_peer_stats_t st = {0};
      if (g->peer_stats) g->peer_stats(w->cc, 1, &st, sizeof st);
      CHECK(0, "no error from test/iput/iputSignal %.0f s after the kill: %d requests pending, %d "
            "issued after the kill reported done; engine posted %llu of %ld puts, %llu of %ld signals",
            a->limit_s + 5, nreq, late_ok, (unsigned long long)st.puts, issued[0] + issued[1],
            (unsigned long long)st.signals, issued[1]);
    }
    if (nreq + NPUT + 1 <= MAX_OUT) /* one batch: NPUT puts, then a put+signal; same slots */
      for (int k = 0; k <= NPUT; k++) {
        if (!killed && k == NPUT / 2 && atomic_load(&fs->seen) >= KILL_AFTER) {
          killed = 1, fs->batches = (int)atomic_load(&fs->seen);
          drv_mark_killable(r, 1);
          if (a->drain) { /* frozen: no delivery completes from here */
            CHECK(kill(vpid, SIGSTOP) == 0, "kill(SIGSTOP)");
            for (double end = drv_now() + 5; !stopped(vpid);) CHECK(drv_now() < end, "victim not stopped");
            CHECK((killer = start_killer(fs, vpid, a->limit_s)) > 0, "fork");
          } else {
            atomic_store(&fs->t_kill, drv_now());
            CHECK(kill(vpid, SIGKILL) == 0, "kill(SIGKILL)");
          }
        }
        if (k == NPUT && killed && a->drain) atomic_store(&fs->arm, 1);
        void *q = NULL;
        uint64_t off = (uint64_t)k * PUT_BYTES;
        rc = k < NPUT ? g->iput(w->cc, off, w->src_mh, PUT_BYTES, off, w->dst_mh, 1, &q)
                      : g->iput_signal(w->cc, off, w->src_mh, PUT_BYTES, off, w->dst_mh, 1, 0,
                                       w->sig_mh, 1, NCCL_NET_SIGNAL_OP_ADD, &q);
        snprintf(fs->where, sizeof fs->where, "%s", k < NPUT ? "iput" : "iputSignal");
        if (rc != ncclSuccess) goto detected;
        CHECK(q, "%s gave no request", fs->where);
        CHECK(k < NPUT || !killed || !a->drain, "drain: iputSignal returned ncclSuccess %s the "
              "victim was killed, though the batch's puts could not be delivered (victim stopped)",
              atomic_load(&fs->t_kill) ? "after" : "before");
        late[nreq] = killed, req[nreq++] = q, issued[k == NPUT]++;
      }
    for (int i = 0; i < nreq;) {
      int done = 0;
      snprintf(fs->where, sizeof fs->where, "test");
      if ((rc = g->test(w->cc, req[i], &done)) != ncclSuccess) goto detected;
      if (done) late_ok += late[i], --nreq, req[i] = req[nreq], late[i] = late[nreq];
      else i++;
    }
  }
detected:
  atomic_store(&fs->returned, 1), atomic_store(&fs->arm, 1); /* the killer finishes its job */
  double t_err = drv_now(), t_kill = atomic_load(&fs->t_kill);
  fs->detect_rc = rc;
  fs->detect_s = t_kill ? t_err - t_kill : -1;
  if (killer) {
    int st = 0;
    CHECK(waitpid(killer, &st, 0) == killer && WIFEXITED(st) && !WEXITSTATUS(st), "killer process failed");
  }
  CHECK(killed && t_kill, "%s failed (rc %d) before the victim was killed", fs->where, rc);
  bool err = false;
  ncclResult_t qrc = g->last_error(w->cc, &err);
  CHECK(qrc == ncclSuccess && err, "%s failed (rc %d) but queryLastError gives rc %d, has_error %d",
        fs->where, rc, qrc, (int)err);
  CHECK(!a->drain || !strcmp(fs->where, "iputSignal"), "drain: the error came from %s, not from the "
        "blocked iputSignal", fs->where);
  CHECK(fs->detect_s <= a->limit_s, "dead peer detected after %.2f s (limit %.1f s)", fs->detect_s, a->limit_s);
  void *q = NULL; /* a failed comm refuses new work */
  rc = g->iput(w->cc, 0, w->src_mh, 8, 0, w->dst_mh, 1, &q);
  CHECK(rc != ncclSuccess, "iput after the failure succeeded");
  atomic_store(&fs->done, 1);
  rc = drv_gin_close(g, w->cc); /* with requests outstanding to a dead peer: must return */
  if (rc != ncclSuccess)
    snprintf(fs->note, sizeof fs->note, "close after the failure returned %d", rc);
  return 0;
}

static int kill_target(drv_rank_t *r, const args_t *a, shared_t *fs) {
  win_t w;
  if (setup(r, a, &w, (NPUT + 1) * (size_t)PUT_BYTES)) return 1;
  return r->rank == 0 ? origin(r, a, fs, &w) : r->rank == 1 ? victim(r, fs, &w) : bystander(r, fs, &w);
}

#define SZ 4096
#define BAD(call, ...)                                                                      \
  do {                                                                                      \
    ncclResult_t rc_ = (call);                                                              \
    snprintf(what, sizeof what, __VA_ARGS__);                                               \
    CHECK(rc_ == ncclInvalidArgument, "%s: rc %d, expected ncclInvalidArgument (4)", what, rc_); \
    nbad++;                                                                                 \
  } while (0)

/* Rank 0 makes every bad call to rank 1, then one good put+signal. */
static int bad_args(drv_rank_t *r, const args_t *a, shared_t *fs) {
  win_t w;
  if (setup(r, a, &w, SZ)) return 1;
  drv_gin_t *g = &w.g;
  void *cc = w.cc, *sm = w.src_mh, *dm = w.dst_mh, *gm = w.sig_mh, *req = NULL;
  uint32_t P = (uint32_t)r->nranks;
  int nbad = 0, done = 0;
  char what[96];
  if (r->rank == 0) {
    unsigned char zero[256] = {0}, garbage[256];
    memset(garbage, 0xa5, sizeof garbage);
    const uint64_t INC = NCCL_NET_SIGNAL_OP_INC, ADD = NCCL_NET_SIGNAL_OP_ADD;
    BAD(g->iput(cc, 0, sm, 8, 0, dm, P, &req), "iput to rank %u of %u", P, P);
    BAD(g->iput(cc, 0, sm, 8, 0, dm, UINT32_MAX, &req), "iput to rank UINT32_MAX");
    BAD(g->iput_signal(cc, 0, sm, 8, 0, dm, P, 0, gm, 1, INC, &req), "iputSignal to rank %u", P);
    BAD(g->iput_signal(cc, 0, NULL, 0, 0, NULL, P + 5, 0, gm, 1, INC, &req), "signal-only to rank %u", P + 5);
    BAD(g->iput(cc, SZ, sm, 8, 0, dm, 1, &req), "source offset at the region's end");
    BAD(g->iput(cc, SZ - 4, sm, 8, 0, dm, 1, &req), "source crossing the region's end");
    BAD(g->iput(cc, 0, sm, SZ + 1, 0, dm, 1, &req), "size one past the region");
    BAD(g->iput(cc, 0, sm, SIZE_MAX, 0, dm, 1, &req), "size SIZE_MAX");
    BAD(g->iput(cc, UINT64_MAX - 3, sm, 8, 0, dm, 1, &req), "source offset wrapping around");
    BAD(g->iput(cc, 0, sm, 8, SZ - 4, dm, 1, &req), "destination crossing the remote region's end");
    BAD(g->iput(cc, 0, sm, 8, UINT64_MAX, dm, 1, &req), "destination offset UINT64_MAX");
    BAD(g->iput_signal(cc, 0, sm, 8, SZ, dm, 1, 0, gm, 1, ADD, &req), "put+signal whose put is outside");
    BAD(g->iput_signal(cc, 0, sm, SZ * 2, 0, dm, 1, 0, gm, 1, ADD, &req), "put+signal larger than its region");
    const uint64_t sig_offs[] = {4, 1, 8 * (uint64_t)P, 8 * (uint64_t)P - 4, UINT64_MAX - 7};
    for (int i = 0; i < 5; i++)
      BAD(g->iput_signal(cc, 0, sm, 8, 0, dm, 1, sig_offs[i], gm, 1, ADD, &req), "signal offset %llu",
          (unsigned long long)sig_offs[i]);
    const uint32_t ops[] = {0, 3, 7, 0x80000001u, UINT32_MAX};
    for (int i = 0; i < 5; i++)
      BAD(g->iput_signal(cc, 0, sm, 8, 0, dm, 1, 0, gm, 1, ops[i], &req), "signal op %u", ops[i]);
    BAD(g->test(cc, NULL, &done), "test(NULL request)");
    BAD(g->test(cc, zero, &done), "test(zeroed foreign object)");
    BAD(g->test(cc, garbage, &done), "test(0xa5 garbage)");
    BAD(g->test(cc, sm, &done), "test(a memory handle)");
    void *mhs[] = {zero, garbage, NULL};
    for (int i = 0; i < 3; i++) {
      BAD(g->iput(cc, 0, mhs[i], 8, 0, dm, 1, &req), "iput with source mhandle %s", i == 2 ? "NULL" : "foreign");
      BAD(g->iput(cc, 0, sm, 8, 0, mhs[i], 1, &req), "iput with destination mhandle %s", i == 2 ? "NULL" : "foreign");
      BAD(g->iput_signal(cc, 0, sm, 8, 0, dm, 1, 0, mhs[i], 1, INC, &req), "signal mhandle %s",
          i == 2 ? "NULL" : "foreign");
      BAD(g->iput_signal(cc, 0, mhs[i], 8, 0, dm, 1, 0, gm, 1, INC, &req), "put+signal source mhandle %s",
          i == 2 ? "NULL" : "foreign");
    }
    BAD(g->iput(cc, 0, sm, 8, 0, dm, 1, NULL), "iput with a NULL request pointer");
    BAD(g->iput(zero, 0, sm, 8, 0, dm, 1, &req), "iput on a foreign comm");
    if (strcmp(a->abi, "gin11")) { /* v11 has no connection/context index */
      drv_gin_set_index(DRV_GIN_NCONN);
      BAD(g->iput(cc, 0, sm, 8, 0, dm, 1, &req), "connection/context index %d", DRV_GIN_NCONN);
      drv_gin_set_index(-1);
      BAD(g->iput_signal(cc, 0, sm, 8, 0, dm, 1, 0, gm, 1, INC, &req), "connection/context index -1");
      drv_gin_set_index(0);
    }
    bool err = true;
    CHECK(g->last_error(cc, &err) == ncclSuccess && !err, "queryLastError reports an error after "
          "%d rejected calls: a rejected call poisoned the comm", nbad);
    /* the comm still works: one put+signal, its request tested wrongly first */
    req = NULL;
    CHECK(g->iput_signal(cc, 0, sm, SZ, 0, dm, 1, 0, gm, 1, INC, &req) == ncclSuccess && req,
          "put+signal after %d rejected calls", nbad);
    BAD(g->test(cc, req, NULL), "test with a NULL done pointer");
    BAD(g->test(zero, req, &done), "test of a live request on a foreign comm");
    ncclResult_t rc = ncclSuccess;
    CHECK(!drv_gin_wait(g, cc, req, 30, &rc), "put+signal after the rejections did not complete (rc %d)", rc);
    snprintf(fs->note, sizeof fs->note, "%d bad calls refused", nbad);
  } else if (r->rank == 1) {
    for (double end = drv_now() + 30; __atomic_load_n(&w.sig[0], __ATOMIC_ACQUIRE) == 0;) {
      CHECK(drv_now() < end && !drv_peer_failed(r), "no signal from rank 0 in 30 s");
      CHECK(g->progress(cc) == ncclSuccess, "progress");
    }
    long bad = drv_verify(w.dst, SZ, 100);
    CHECK(bad < 0, "put from rank 0: wrong byte at offset %ld", bad);
  }
  CHECK(!drv_gin_barrier(r, g, cc, 60), "final barrier");
  /* nothing rejected reached anyone: one signal, exactly INC, on word 0 only */
  for (int s = 0; s < r->nranks; s++)
    CHECK(w.sig[s] == (uint64_t)(r->rank == 1 && s == 0), "signal word %d is %llu", s,
          (unsigned long long)w.sig[s]);
  if (r->rank != 1)
    CHECK(w.dst[0] == 0 && !memcmp(w.dst, w.dst + 1, SZ - 1), "rank %d's destination was written", r->rank);
  CHECK(drv_gin_close(g, cc) == ncclSuccess, "close");
  return 0;
}

/* Registration is collective: rank 0 registers one more window alone, and
 * must get an error within PERSEUS_PEER_TIMEOUT_MS (+ the margin) while
 * rank 1, alive and progressing, never registers it. */
static int lonely_reg(drv_rank_t *r, const args_t *a, shared_t *fs) {
  win_t w;
  if (setup(r, a, &w, SZ)) return 1;
  if (r->rank == 0) {
    char *extra = calloc(1, SZ);
    void *mh = NULL;
    CHECK(extra, "out of memory");
    double t0 = drv_now();
    ncclResult_t rc = w.g.reg_sym(w.cc, extra, SZ, NCCL_PTR_HOST, 0, &mh);
    double took = drv_now() - t0;
    atomic_store(&fs->done, 1);
    CHECK(rc != ncclSuccess && !mh, "a registration no peer made succeeded (rc %d)", rc);
    CHECK(took <= a->limit_s, "the lonely registration failed after %.2f s, over %.2f s", took,
          a->limit_s);
    snprintf(fs->note, sizeof fs->note, "refused after %.2f s", took);
    /* the failed exchange closed the endpoint: later registrations, host
     * or GPU, are refused too (not a crash on the closed endpoint) */
    for (int type = NCCL_PTR_HOST; type <= NCCL_PTR_CUDA; type++) {
      rc = w.g.reg_sym(w.cc, extra, SZ, type, 0, &mh);
      CHECK(rc != ncclSuccess && !mh, "registration (type %d) on the failed comm returned %d", type, rc);
    }
    free(extra);
  } else {
    for (double end = drv_now() + a->limit_s + 10; !atomic_load(&fs->done);) {
      CHECK(drv_now() < end && !drv_peer_failed(r), "rank 0 never returned from its registration");
      CHECK(w.g.progress(w.cc) == ncclSuccess, "progress");
      nap(0.0002);
    }
  }
  CHECK(drv_gin_close(&w.g, w.cc) == ncclSuccess, "close");
  return 0;
}

static int rank_fn(drv_rank_t *r, void *arg) {
  void **v = arg;
  const args_t *a = v[0];
  if (!strcmp(a->scenario, "lonely_reg")) return lonely_reg(r, a, v[1]);
  return !strcmp(a->scenario, "bad_args") ? bad_args(r, a, v[1]) : kill_target(r, a, v[1]);
}

int main(int argc, char **argv) {
  args_t a = {.abi = "gin11"};
  drv_opts_t o = {.nranks = 0, .timeout_s = 30, .no_load = 1, .no_mesh = 1};
  int c;
  while ((c = getopt(argc, argv, "a:p:s:r:h")) != -1) {
    if (drv_gin_opt(c, optarg, &a.abi, &a.plugin, &a.scenario, &o.nranks)) continue;
    fprintf(stderr, "usage: %s -s kill_target|kill_target_drain|bad_args|lonely_reg [-a gin11|gin12|"
            "gin13|rma13|rma14] [-r RANKS: 2..3 for kill_target*, else 2] [-p PLUGIN]\n", argv[0]);
    return c == 'h' ? 0 : 2;
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  int kill = a.scenario && !strncmp(a.scenario, "kill_target", 11);
  if (!a.scenario || (strcmp(a.scenario, "bad_args") && strcmp(a.scenario, "kill_target") &&
                      strcmp(a.scenario, "kill_target_drain") && strcmp(a.scenario, "lonely_reg"))) {
    fprintf(stderr, "-s kill_target, kill_target_drain, bad_args or lonely_reg is required (-h for help)\n");
    return 2;
  }
  int abi_ok = 0;
  for (int i = 0; i < 5; i++) abi_ok |= !strcmp(a.abi, (const char *[]){"gin11", "gin12", "gin13", "rma13", "rma14"}[i]);
  if (!abi_ok) {
    fprintf(stderr, "unknown ABI '%s' (gin11, gin12, gin13, rma13, rma14)\n", a.abi);
    return 2;
  }
  if (!o.nranks) o.nranks = 2;
  if (o.nranks < 2 || o.nranks > (kill ? 3 : 2)) {
    fprintf(stderr, "%s takes %s ranks, not %d\n", a.scenario, kill ? "2 or 3" : "2", o.nranks);
    return 2;
  }
  a.drain = !strcmp(a.scenario, "kill_target_drain");
  if (a.drain) setenv("PERSEUS_ORDERING", "drain", 1);
  setenv("PERSEUS_PEER_TIMEOUT_MS", "2000", 0);
  a.limit_s = atof(getenv("PERSEUS_PEER_TIMEOUT_MS")) / 1000 + MARGIN_S;
  setvbuf(stdout, NULL, _IOLBF, 0);
  shared_t *fs = ps_proc_shared_map(sizeof *fs);
  if (!fs) return perror("mmap"), 2;
  fs->detect_s = -1;
  o.shared_bytes = drv_gin_shared_bytes(o.nranks);
  void *arg[2] = {&a, fs};
  double t0 = drv_now();
  int rc = drv_run(&o, rank_fn, arg);
  char detail[400] = "";
  if (kill && fs->detect_s >= 0)
    snprintf(detail, sizeof detail, " detection %.3f s in %s (rc %d), after %d batches, ordering %s",
             fs->detect_s, fs->where, fs->detect_rc, fs->batches, fs->ordering);
  else if (kill)
    snprintf(detail, sizeof detail, " detection: none");
  if (fs->note[0]) snprintf(detail + strlen(detail), sizeof detail - strlen(detail), ", %s", fs->note);
  printf("%s %s, %d ranks, provider %s: %s (%.2f s)%s\n", a.scenario, a.abi, o.nranks,
         getenv("PERSEUS_PROVIDER") ? getenv("PERSEUS_PROVIDER") : "auto", rc ? "FAIL" : "ok",
         drv_now() - t0, detail);
  return rc ? 1 : 0;
}
