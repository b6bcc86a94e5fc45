/* perseus_coll_perf: nccl-tests-style benchmark of NCCL collectives.
 *
 * One invocation runs the whole sweep twice on the same GPUs and link: once with
 * NCCL loading the perseus net plugin (NCCL_NET=Perseus), once with NCCL's
 * built-in Socket transport (NCCL_NET=Socket), each in freshly forked children
 * (one process per GPU, rank i on device i), then prints both side by side with
 * the ratio of bus bandwidths. P2P, SHM and NVLS are always off and every byte
 * goes over the loopback interface.
 *
 * The parent never calls CUDA: a probe child counts the GPUs. Children talk to
 * the parent through one shared anonymous mapping made before any fork. */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <link.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#ifndef PS_DEFAULT_PLUGIN_PATH
#define PS_DEFAULT_PLUGIN_PATH "libnccl-net-perseus.so"
#endif
#ifndef PS_INSTALLED_PLUGIN_PATH
#define PS_INSTALLED_PLUGIN_PATH "/usr/local/lib/libnccl-net-perseus.so"
#endif
#ifndef PS_VERSION
#define PS_VERSION "unknown"
#endif

#define PS_MAX_SIZES 64
#define PS_MAX_GPUS 64
#define PS_NAME_LEN 256
#define PS_PAT_P 251                       /* pattern period (prime) */
#define PS_CHUNK_ELEMS ((size_t)16 << 20)  /* host staging for fill/check */
#ifndef PS_TEARDOWN_GRACE_S
#define PS_TEARDOWN_GRACE_S 60.0
#endif
#define PS_BIG_BYTES ((size_t)64 << 20)    /* ratio average from here up */

enum { SW_PERSEUS, SW_SOCKET, SW_N };
enum { C_ALL_REDUCE, C_ALL_GATHER, C_REDUCE_SCATTER, C_ALLTOALL, C_BROADCAST, C_N };
static const char *const sweep_names[SW_N] = {"perseus", "socket"};
static const char *const coll_names[C_N] = {"all_reduce", "all_gather", "reduce_scatter",
                                            "alltoall", "broadcast"};
static const char *const coll_ops[C_N] = {"sum", "none", "sum", "none", "none"};

struct ps_result {
  int state;          /* 0 not measured, 1 measured, 2 skipped (0 elements) */
  double time_us, algbw, busbw;
  long long wrong;    /* summed over ranks */
};

struct ps_shared {
  /* filled by the probe child */
  int ndev, driver_ver, runtime_ver, nccl_ver;
  char gpu_name[PS_MAX_GPUS][PS_NAME_LEN];
  int gpu_major[PS_MAX_GPUS], gpu_minor[PS_MAX_GPUS];
  size_t gpu_mem[PS_MAX_GPUS];
  /* per-sweep control, reset by the parent before each fork */
  int id_ready, abort_flag, ranks_done;
  unsigned bar_count, bar_gen;
  double rank_us[PS_MAX_GPUS];  /* per-rank time of the current size */
  ncclUniqueId id;
  struct ps_result res[SW_N][C_N][PS_MAX_SIZES];
};

struct ps_cfg {
  int ngpus, iters, warmup, check, timeout_s, avg_mode;
  size_t min_bytes, max_bytes, factor;
  int coll_on[C_N], sweep_on[SW_N];
  char plugin[PATH_MAX];
  const char *iface, *provider;
  size_t sizes[PS_MAX_SIZES];
  int nsizes;
};

struct ps_counts { size_t send, recv, param, size_col, alg_bytes; };

static struct ps_cfg cfg;
static struct ps_shared *shm;
static int g_rank = -1, g_sweep = -1;
static ncclComm_t g_comm;
static volatile sig_atomic_t g_signal;

/* ---------------------------------------------------------------- children */

static void child_die(const char *file, int line, const char *fmt, ...)
{
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (g_rank < 0)
    fprintf(stderr, "perseus_coll_perf: GPU probe: %s (%s:%d)\n", msg, file, line);
  else
    fprintf(stderr, "perseus_coll_perf: [%s] rank %d (GPU %d): %s (%s:%d)\n",
            sweep_names[g_sweep], g_rank, g_rank, msg, file, line);
  __atomic_store_n(&shm->abort_flag, 1, __ATOMIC_RELEASE);
  _exit(1);
}

#define CUDACHECK(call) do {                                                  \
    cudaError_t e_ = (call);                                                  \
    if (e_ != cudaSuccess)                                                    \
      child_die(__FILE__, __LINE__, "%s failed: %s: %s", #call,              \
                cudaGetErrorName(e_), cudaGetErrorString(e_));                \
  } while (0)

#define NCCLCHECK(call) do {                                                  \
    ncclResult_t r_ = (call);                                                 \
    if (r_ != ncclSuccess)                                                    \
      child_die(__FILE__, __LINE__, "%s failed: %s (last error: %s)", #call,  \
                ncclGetErrorString(r_), ncclGetLastError(g_comm));            \
  } while (0)

/* Another process failed: the parent kills us anyway, leave quietly. */
static void check_abort(void)
{
  if (__atomic_load_n(&shm->abort_flag, __ATOMIC_ACQUIRE)) _exit(1);
}

static void barrier(void)
{
  unsigned gen = __atomic_load_n(&shm->bar_gen, __ATOMIC_ACQUIRE);
  if (__atomic_add_fetch(&shm->bar_count, 1, __ATOMIC_ACQ_REL) == (unsigned)cfg.ngpus) {
    __atomic_store_n(&shm->bar_count, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&shm->bar_gen, 1, __ATOMIC_RELEASE);
    return;
  }
  while (__atomic_load_n(&shm->bar_gen, __ATOMIC_ACQUIRE) == gen) {
    check_abort();
    sched_yield();
  }
}

/* Small integers stored in float: sums over ranks stay exact. */
static inline float pat(int rank, size_t e)
{
  return (float)((int)(((e % PS_PAT_P) * 7 + (size_t)rank * 13) % PS_PAT_P) - PS_PAT_P / 2);
}

/* Element counts as nccl-tests derives them from a byte size. */
static int coll_counts(int c, size_t bytes, int n, struct ps_counts *k)
{
  size_t count = bytes / sizeof(float);
  size_t base = (count / (size_t)n) & ~(size_t)3;
  switch (c) {
  case C_ALL_GATHER:     k->send = base;     k->recv = base * n; k->param = base; break;
  case C_REDUCE_SCATTER: k->send = base * n; k->recv = base;     k->param = base; break;
  case C_ALLTOALL:       k->send = base * n; k->recv = base * n; k->param = base; break;
  default:               k->send = count;    k->recv = count;    k->param = count; break;
  }
  k->size_col = (k->send > k->recv ? k->send : k->recv) * sizeof(float);
  k->alg_bytes = (c == C_ALL_REDUCE || c == C_BROADCAST ? count : base * n) * sizeof(float);
  return k->param > 0;
}

static double bus_factor(int c, int n)
{
  switch (c) {
  case C_ALL_REDUCE: return 2.0 * (n - 1) / n;
  case C_BROADCAST: return 1.0;
  default: return (double)(n - 1) / n;
  }
}

static ncclResult_t run_coll(int c, const float *s, float *r, const struct ps_counts *k,
                             cudaStream_t st)
{
  ncclResult_t ret = ncclSuccess, end;
  switch (c) {
  case C_ALL_REDUCE: return ncclAllReduce(s, r, k->param, ncclFloat, ncclSum, g_comm, st);
  case C_ALL_GATHER: return ncclAllGather(s, r, k->param, ncclFloat, g_comm, st);
  case C_REDUCE_SCATTER:
    return ncclReduceScatter(s, r, k->param, ncclFloat, ncclSum, g_comm, st);
  case C_BROADCAST: return ncclBroadcast(s, r, k->param, ncclFloat, 0, g_comm, st);
  case C_ALLTOALL:
    if ((ret = ncclGroupStart()) != ncclSuccess) return ret;
    for (int p = 0; p < cfg.ngpus && ret == ncclSuccess; p++) {
      ret = ncclSend(s + (size_t)p * k->param, k->param, ncclFloat, p, g_comm, st);
      if (ret == ncclSuccess)
        ret = ncclRecv(r + (size_t)p * k->param, k->param, ncclFloat, p, g_comm, st);
    }
    end = ncclGroupEnd();
    return ret != ncclSuccess ? ret : end;
  }
  return ncclInvalidArgument;
}

/* Wait for the stream, but notice NCCL async errors and failed peers. */
static void sync_stream(cudaStream_t st)
{
  for (;;) {
    cudaError_t e = cudaStreamQuery(st);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) CUDACHECK(e);
    ncclResult_t ae;
    NCCLCHECK(ncclCommGetAsyncError(g_comm, &ae));
    if (ae != ncclSuccess)
      child_die(__FILE__, __LINE__, "NCCL async error: %s (last error: %s)",
                ncclGetErrorString(ae), ncclGetLastError(g_comm));
    check_abort();
    sched_yield();
  }
}

static float expected(int c, size_t o, size_t base, const float *sum_tab)
{
  switch (c) {
  case C_ALL_REDUCE: return sum_tab[o % PS_PAT_P];
  case C_ALL_GATHER: return pat((int)(o / base), o % base);
  case C_REDUCE_SCATTER: return sum_tab[((size_t)g_rank * base + o) % PS_PAT_P];
  case C_ALLTOALL: return pat((int)(o / base), (size_t)g_rank * base + o % base);
  default: return pat(0, o);
  }
}

static long long check_output(int c, const float *drecv, const struct ps_counts *k,
                              float *host, const float *sum_tab)
{
  long long wrong = 0;
  for (size_t off = 0; off < k->recv; off += PS_CHUNK_ELEMS) {
    size_t len = k->recv - off < PS_CHUNK_ELEMS ? k->recv - off : PS_CHUNK_ELEMS;
    CUDACHECK(cudaMemcpy(host, drecv + off, len * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < len; i++)
      if (!(host[i] == expected(c, off + i, k->param, sum_tab))) wrong++;
  }
  return wrong;
}

static void set_sweep_env(int sw)
{
  setenv("NCCL_P2P_DISABLE", "1", 1);
  setenv("NCCL_SHM_DISABLE", "1", 1);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("NCCL_SOCKET_IFNAME", cfg.iface, 1);
  setenv("PERSEUS_IFACE", cfg.iface, 1);
  setenv("PERSEUS_PROVIDER", cfg.provider, 1);
  if (sw == SW_PERSEUS) {
    setenv("NCCL_NET_PLUGIN", cfg.plugin, 1);
    setenv("NCCL_NET", "Perseus", 1);
  } else {
    setenv("NCCL_NET_PLUGIN", "none", 1);
    setenv("NCCL_NET", "Socket", 1);
  }
}

static void child_main(int sw, int rank, pid_t parent)
{
  g_rank = rank;
  g_sweep = sw;
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(1);
  set_sweep_env(sw);
  int n = cfg.ngpus;
  size_t elems = cfg.max_bytes / sizeof(float);
  if (elems < 4) elems = 4;
  size_t hlen = elems < PS_CHUNK_ELEMS ? elems : PS_CHUNK_ELEMS;
  float *host = malloc(hlen * sizeof(float)), *dsend = NULL, *drecv = NULL;
  if (!host) child_die(__FILE__, __LINE__, "out of host memory (%zu bytes)", hlen * 4);

  CUDACHECK(cudaSetDevice(rank));
  CUDACHECK(cudaMalloc((void **)&dsend, elems * sizeof(float)));
  CUDACHECK(cudaMalloc((void **)&drecv, elems * sizeof(float)));
  for (size_t off = 0; off < elems; off += hlen) {
    size_t len = elems - off < hlen ? elems - off : hlen;
    for (size_t i = 0; i < len; i++) host[i] = pat(rank, off + i);
    CUDACHECK(cudaMemcpy(dsend + off, host, len * sizeof(float), cudaMemcpyHostToDevice));
  }
  cudaStream_t st;
  cudaEvent_t ev0, ev1;
  CUDACHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CUDACHECK(cudaEventCreate(&ev0));
  CUDACHECK(cudaEventCreate(&ev1));

  if (rank == 0) {
    ncclUniqueId id;
    NCCLCHECK(ncclGetUniqueId(&id));
    shm->id = id;
    __atomic_store_n(&shm->id_ready, 1, __ATOMIC_RELEASE);
  } else {
    while (!__atomic_load_n(&shm->id_ready, __ATOMIC_ACQUIRE)) {
      check_abort();
      usleep(1000);
    }
  }
  ncclUniqueId id = shm->id;
  ncclResult_t ir = ncclCommInitRank(&g_comm, n, id, rank);
  if (ir != ncclSuccess)
    child_die(__FILE__, __LINE__, "ncclCommInitRank(%d ranks, NCCL_NET=%s) failed: %s "
              "(last error: %s)%s", n, getenv("NCCL_NET"), ncclGetErrorString(ir),
              ncclGetLastError(NULL), sw == SW_PERSEUS ?
              "; NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET shows why the plugin failed" : "");

  for (int c = 0; c < C_N; c++) {
    if (!cfg.coll_on[c]) continue;
    float sum_tab[PS_PAT_P];
    for (int x = 0; x < PS_PAT_P; x++) {
      sum_tab[x] = 0.0f;
      for (int k = 0; k < n; k++) sum_tab[x] += pat(k, (size_t)x);
    }
    for (int i = 0; i < cfg.nsizes; i++) {
      struct ps_result *res = &shm->res[sw][c][i];
      struct ps_counts k;
      if (!coll_counts(c, cfg.sizes[i], n, &k)) {
        if (rank == 0) res->state = 2;
        continue;
      }
      for (int w = 0; w < cfg.warmup; w++) NCCLCHECK(run_coll(c, dsend, drecv, &k, st));
      sync_stream(st);
      barrier();
      CUDACHECK(cudaEventRecord(ev0, st));
      for (int it = 0; it < cfg.iters; it++) NCCLCHECK(run_coll(c, dsend, drecv, &k, st));
      CUDACHECK(cudaEventRecord(ev1, st));
      sync_stream(st);
      float ms = 0.0f;
      CUDACHECK(cudaEventElapsedTime(&ms, ev0, ev1));
      shm->rank_us[rank] = (double)ms * 1e3 / cfg.iters;
      if (cfg.check) {
        CUDACHECK(cudaMemsetAsync(drecv, 0xff, k.recv * sizeof(float), st)); /* NaN */
        NCCLCHECK(run_coll(c, dsend, drecv, &k, st));
        sync_stream(st);
        long long wrong = check_output(c, drecv, &k, host, sum_tab);
        __atomic_add_fetch(&res->wrong, wrong, __ATOMIC_RELAXED);
      }
      barrier();
      if (rank == 0) {
        /* like nccl-tests -a: 0 rank 0, 1 average, 2 min, 3 max over ranks */
        double t = shm->rank_us[0];
        for (int r = 1; r < n && cfg.avg_mode; r++) {
          double u = shm->rank_us[r];
          t = cfg.avg_mode == 1 ? t + u : cfg.avg_mode == 2 ? (u < t ? u : t) : (u > t ? u : t);
        }
        res->time_us = cfg.avg_mode == 1 ? t / n : t;
        res->algbw = (double)k.alg_bytes / (res->time_us * 1e3);
        res->busbw = res->algbw * bus_factor(c, n);
        __atomic_store_n(&res->state, 1, __ATOMIC_RELEASE);
        fprintf(stderr, "# [%s] %-14s %12zu B  %10.1f us  busbw %7.2f GB/s  #wrong %lld\n",
                sweep_names[sw], coll_names[c], k.size_col, res->time_us, res->busbw,
                cfg.check ? __atomic_load_n(&res->wrong, __ATOMIC_RELAXED) : 0LL);
      }
    }
  }
  __atomic_add_fetch(&shm->ranks_done, 1, __ATOMIC_RELEASE);
  NCCLCHECK(ncclCommFinalize(g_comm));
  NCCLCHECK(ncclCommDestroy(g_comm));
  CUDACHECK(cudaFree(dsend));
  CUDACHECK(cudaFree(drecv));
  free(host);
  _exit(0);
}

static void probe_main(pid_t parent)
{
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(1);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess)
    child_die(__FILE__, __LINE__, "no usable CUDA GPU: cudaGetDeviceCount failed: %s: %s%s",
              cudaGetErrorName(e), cudaGetErrorString(e),
              e == cudaErrorInsufficientDriver ? " (no NVIDIA driver/libcuda.so.1 here?)" : "");
  shm->ndev = n;
  CUDACHECK(cudaDriverGetVersion(&shm->driver_ver));
  CUDACHECK(cudaRuntimeGetVersion(&shm->runtime_ver));
  NCCLCHECK(ncclGetVersion(&shm->nccl_ver));
  for (int d = 0; d < n && d < PS_MAX_GPUS; d++) {
    struct cudaDeviceProp prop;
    CUDACHECK(cudaGetDeviceProperties(&prop, d));
    snprintf(shm->gpu_name[d], PS_NAME_LEN, "%s", prop.name);
    shm->gpu_major[d] = prop.major;
    shm->gpu_minor[d] = prop.minor;
    shm->gpu_mem[d] = prop.totalGlobalMem;
  }
  _exit(0);
}

/* ------------------------------------------------------------------ parent */

static double now_s(void)
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
    double t = now_s();
    if (!failed && g_signal) {
      fprintf(stderr, "perseus_coll_perf: %s: interrupted by signal %d\n", what, (int)g_signal);
      failed = 1;
    }
    if (!failed && t > deadline) {
      fprintf(stderr, "perseus_coll_perf: %s: timeout (-T %d s) with %d process(es) still "
              "running; killing them\n", what, cfg.timeout_s, alive);
      *timed_out = 1;
      failed = 1;
    }
    if (!failed && __atomic_load_n(&shm->ranks_done, __ATOMIC_ACQUIRE) == n) {
      if (done_at == 0.0) done_at = t;
      else if (t - done_at > PS_TEARDOWN_GRACE_S) {
        fprintf(stderr, "perseus_coll_perf: %s: all results are in but %d process(es) hang "
                "in NCCL teardown for %.0f s; killing them\n", what, alive, PS_TEARDOWN_GRACE_S);
        failed = 1;
      }
    }
    if (failed) {
      if (killed_at == 0.0) {
        __atomic_store_n(&shm->abort_flag, 1, __ATOMIC_RELEASE);
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

static int spawn(int sw, int nproc, double deadline, int *timed_out)
{
  pid_t pids[PS_MAX_GPUS], parent = getpid();
  shm->id_ready = shm->abort_flag = shm->ranks_done = 0;
  shm->bar_count = shm->bar_gen = 0;
  fflush(NULL);
  for (int r = 0; r < nproc; r++) {
    pid_t p = fork();
    if (p == 0) {
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      if (sw < 0) probe_main(parent);
      child_main(sw, r, parent);
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
           sw < 0 ? "" : sweep_names[sw]);
  return wait_children(pids, nproc, what, deadline, timed_out);
}

static int find_nccl(struct dl_phdr_info *info, size_t size, void *out)
{
  (void)size;
  if (info->dlpi_name && strstr(info->dlpi_name, "libnccl.so")) {
    snprintf(out, PATH_MAX, "%s", info->dlpi_name);
    return 1;
  }
  return 0;
}

static int parse_size(const char *s, size_t *out)
{
  char *end;
  errno = 0;
  if (!isdigit((unsigned char)s[0])) return -1;
  unsigned long long v = strtoull(s, &end, 10), mul = 1;
  if (errno) return -1;
  switch (toupper((unsigned char)*end)) {
  case 'K': mul = 1ULL << 10; end++; break;
  case 'M': mul = 1ULL << 20; end++; break;
  case 'G': mul = 1ULL << 30; end++; break;
  case 'T': mul = 1ULL << 40; end++; break;
  default: break;
  }
  if (*end == 'B' || *end == 'b') end++;
  if (*end || v > SIZE_MAX / mul) return -1;
  *out = (size_t)(v * mul);
  return 0;
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -1;
  *out = (int)v;
  return 0;
}

static int set_colls(const char *arg)
{
  char buf[256], *save = NULL;
  snprintf(buf, sizeof(buf), "%s", arg);
  memset(cfg.coll_on, 0, sizeof(cfg.coll_on));
  for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    int found = 0;
    for (int c = 0; c < C_N; c++) {
      /* all_reduce, allreduce and all-reduce all name the same collective */
      const char *a = t, *b = coll_names[c];
      while (*a || *b) {
        if (*a == '_' || *a == '-') { a++; continue; }
        if (*b == '_') { b++; continue; }
        if (tolower((unsigned char)*a) != *b) break;
        a++, b++;
      }
      if (!*a && !*b) cfg.coll_on[c] = found = 1;
    }
    if (!strcmp(t, "all")) {
      for (int c = 0; c < C_N; c++) cfg.coll_on[c] = 1;
      found = 1;
    }
    if (!found) return -1;
  }
  return 0;
}

static int find_plugin(const char *arg)
{
  char exe[PATH_MAX], cand[3][PATH_MAX + 64];
  const char *base = strrchr(PS_DEFAULT_PLUGIN_PATH, '/');
  base = base ? base + 1 : PS_DEFAULT_PLUGIN_PATH;
  int nc = 0;
  if (arg) {
    snprintf(cand[nc++], sizeof(cand[0]), "%s", arg);
  } else {
    ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (len > 0) {
      exe[len] = '\0';
      char *slash = strrchr(exe, '/');
      if (slash) *slash = '\0';
      /* the build tree: build/bench/<exe> next to build/plugin/<plugin> */
      snprintf(cand[nc++], sizeof(cand[0]), "%s/../plugin/%s", exe, base);
    }
    snprintf(cand[nc++], sizeof(cand[0]), "%s", PS_DEFAULT_PLUGIN_PATH);
    snprintf(cand[nc++], sizeof(cand[0]), "%s", PS_INSTALLED_PLUGIN_PATH);
  }
  for (int i = 0; i < nc; i++)
    if (access(cand[i], R_OK) == 0 && realpath(cand[i], cfg.plugin)) return 0;
  fprintf(stderr, "perseus_coll_perf: perseus plugin not found (tried:");
  for (int i = 0; i < nc; i++) fprintf(stderr, " %s", cand[i]);
  fprintf(stderr, "); pass -P PATH or -m socket\n");
  return -1;
}

static void usage(FILE *f)
{
  fprintf(f,
    "usage: perseus_coll_perf [options]\n"
    "NCCL collectives, nccl-tests style: NCCL with the perseus net plugin vs NCCL's\n"
    "built-in Socket transport, in one run, one forked process per GPU, over loopback.\n"
    "  -g N      number of GPUs/ranks (default: all visible GPUs)\n"
    "  -b SIZE   min bytes (default 1M; suffixes K, M, G)\n"
    "  -e SIZE   max bytes (default 1G)\n"
    "  -f N      multiplication factor between sizes (default 2)\n"
    "  -n N      timed iterations per size (default 20)\n"
    "  -w N      warmup iterations per size (default 5)\n"
    "  -c 0|1    check results (default 1)\n"
    "  -a 0..3   time reported: 0 rank 0, 1 average over ranks, 2 min, 3 max (default 1)\n"
    "  -o LIST   all_reduce, all_gather, reduce_scatter, alltoall, broadcast, all\n"
    "            or a comma-separated list (default all_reduce)\n"
    "  -m MODE   both, perseus or socket (default both)\n"
    "  -P PATH   perseus plugin (default: the built libnccl-net-perseus.so)\n"
    "  -I IFACE  interface for NCCL_SOCKET_IFNAME and PERSEUS_IFACE (default lo)\n"
    "  -T SEC    overall timeout in seconds (default 900)\n"
    "  -h, --help  this text\n"
    "Always set: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0;\n"
    "PERSEUS_PROVIDER defaults to \"tcp;ofi_rxm\" unless already set.\n"
    "Exit status: 0 all good; 1 error, timeout or wrong results; 2 usage.\n");
}

static int parse_args(int argc, char **argv)
{
  static const struct option longopts[] = {{"help", no_argument, NULL, 'h'}, {0, 0, 0, 0}};
  const char *plugin_arg = NULL;
  int opt, v;
  cfg.min_bytes = 1 << 20;
  cfg.max_bytes = 1 << 30;
  cfg.factor = 2;
  cfg.iters = 20;
  cfg.warmup = 5;
  cfg.check = 1;
  cfg.avg_mode = 1;
  cfg.timeout_s = 900;
  cfg.iface = "lo";
  cfg.coll_on[C_ALL_REDUCE] = 1;
  cfg.sweep_on[SW_PERSEUS] = cfg.sweep_on[SW_SOCKET] = 1;
  while ((opt = getopt_long(argc, argv, "g:b:e:f:n:w:c:a:o:m:P:I:T:h", longopts, NULL)) != -1) {
    int bad = 0;
    switch (opt) {
    case 'g': bad = parse_int(optarg, 1, PS_MAX_GPUS, &cfg.ngpus); break;
    case 'b': bad = parse_size(optarg, &cfg.min_bytes) || cfg.min_bytes == 0; break;
    case 'e': bad = parse_size(optarg, &cfg.max_bytes) || cfg.max_bytes == 0; break;
    case 'f': bad = parse_int(optarg, 1, 1 << 20, &v); cfg.factor = (size_t)v; break;
    case 'n': bad = parse_int(optarg, 1, 1 << 24, &cfg.iters); break;
    case 'w': bad = parse_int(optarg, 0, 1 << 24, &cfg.warmup); break;
    case 'c': bad = parse_int(optarg, 0, 1, &cfg.check); break;
    case 'a': bad = parse_int(optarg, 0, 3, &cfg.avg_mode); break;
    case 'o': bad = set_colls(optarg); break;
    case 'm':
      cfg.sweep_on[SW_PERSEUS] = !strcmp(optarg, "both") || !strcmp(optarg, "perseus");
      cfg.sweep_on[SW_SOCKET] = !strcmp(optarg, "both") || !strcmp(optarg, "socket");
      bad = !cfg.sweep_on[SW_PERSEUS] && !cfg.sweep_on[SW_SOCKET];
      break;
    case 'P': plugin_arg = optarg; break;
    case 'I': cfg.iface = optarg; break;
    case 'T': bad = parse_int(optarg, 1, 7 * 24 * 3600, &cfg.timeout_s); break;
    case 'h': usage(stdout); exit(0);
    default: usage(stderr); return -1;
    }
    if (bad) {
      fprintf(stderr, "perseus_coll_perf: bad value for -%c: '%s'\n", opt, optarg);
      return -1;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "perseus_coll_perf: unexpected argument '%s'\n", argv[optind]);
    return -1;
  }
  if (cfg.min_bytes > cfg.max_bytes || (cfg.factor < 2 && cfg.min_bytes != cfg.max_bytes)) {
    fprintf(stderr, "perseus_coll_perf: need -b <= -e and -f >= 2 (unless -b == -e)\n");
    return -1;
  }
  for (size_t s = cfg.min_bytes; s <= cfg.max_bytes; s *= cfg.factor) {
    if (cfg.nsizes == PS_MAX_SIZES) {
      fprintf(stderr, "perseus_coll_perf: more than %d sizes; raise -f\n", PS_MAX_SIZES);
      return -1;
    }
    cfg.sizes[cfg.nsizes++] = s;
    if (cfg.factor < 2 || s > SIZE_MAX / cfg.factor) break;
  }
  const char *prov = getenv("PERSEUS_PROVIDER");
  cfg.provider = prov && *prov ? prov : "tcp;ofi_rxm";
  if (cfg.sweep_on[SW_PERSEUS] && find_plugin(plugin_arg)) return -1;
  return 0;
}

static void print_cell(const struct ps_result *r)
{
  if (r->state == 1 && cfg.check)
    printf("  %10.1f %7.2f %7.2f %7lld", r->time_us, r->algbw, r->busbw, r->wrong);
  else if (r->state == 1)
    printf("  %10.1f %7.2f %7.2f %7s", r->time_us, r->algbw, r->busbw, "N/A");
  else
    printf("  %10s %7s %7s %7s", "-", "-", "-", "-");
}

static void print_table(int c, long long *wrong_total)
{
  int n = cfg.ngpus, cnt[SW_N] = {0}, nratio = 0;
  double sum[SW_N] = {0}, ratio_sum = 0;
  printf("\n# %s (op %s), float, out-of-place, %d ranks, %d iters, %d warmup\n",
         coll_names[c], coll_ops[c], n, cfg.iters, cfg.warmup);
  printf("# %32s  %s  %s\n", "", "------------ perseus: ------------",
         "------------ socket: -------------");
  printf("# %10s %12s %8s  %10s %7s %7s %7s  %10s %7s %7s %7s  %8s\n", "size", "count", "type",
         "time(us)", "algbw", "busbw", "#wrong", "time(us)", "algbw", "busbw", "#wrong", "ratio");
  printf("# %10s %12s %8s  %10s %7s %7s %7s  %10s %7s %7s %7s  %8s\n", "(B)", "(elements)", "",
         "", "(GB/s)", "(GB/s)", "", "", "(GB/s)", "(GB/s)", "", "busbw p/s");
  for (int i = 0; i < cfg.nsizes; i++) {
    struct ps_counts k;
    if (!coll_counts(c, cfg.sizes[i], n, &k)) continue;
    const struct ps_result *r[SW_N];
    for (int s = 0; s < SW_N; s++) {
      r[s] = &shm->res[s][c][i];
      if (r[s]->state == 1) {
        sum[s] += r[s]->busbw;
        cnt[s]++;
        if (cfg.check) *wrong_total += r[s]->wrong;
      }
    }
    printf("  %10zu %12zu %8s", k.size_col, k.param, "float");
    print_cell(r[SW_PERSEUS]);
    print_cell(r[SW_SOCKET]);
    if (r[0]->state == 1 && r[1]->state == 1 && r[1]->busbw > 0) {
      double ratio = r[0]->busbw / r[1]->busbw;
      printf("  %8.3f\n", ratio);
      if (k.size_col >= PS_BIG_BYTES) ratio_sum += ratio, nratio++;
    } else {
      printf("  %8s\n", "-");
    }
  }
  char avg[SW_N][32], rat[32] = "n/a";
  for (int s = 0; s < SW_N; s++) {
    snprintf(avg[s], sizeof(avg[s]), "n/a");
    if (cnt[s]) snprintf(avg[s], sizeof(avg[s]), "%.3f GB/s", sum[s] / cnt[s]);
  }
  if (nratio) snprintf(rat, sizeof(rat), "%.3f (%d sizes)", ratio_sum / nratio, nratio);
  printf("# Avg bus bandwidth perseus: %s, socket: %s; avg ratio perseus/socket for sizes "
         ">= 64 MiB: %s\n", avg[SW_PERSEUS], avg[SW_SOCKET], rat);
}

static void on_signal(int sig)
{
  g_signal = sig;
}

int main(int argc, char **argv)
{
  if (parse_args(argc, argv)) return 2;
  shm = mmap(NULL, sizeof(*shm), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) {
    fprintf(stderr, "perseus_coll_perf: mmap: %s\n", strerror(errno));
    return 1;
  }
  memset(shm, 0, sizeof(*shm));
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);

  double t0 = now_s(), deadline = t0 + cfg.timeout_s;
  char date[64], host[256] = "?", ncclpath[PATH_MAX] = "?";
  time_t tt = time(NULL);
  strftime(date, sizeof(date), "%Y-%m-%d %H:%M:%S %Z", localtime(&tt));
  gethostname(host, sizeof(host) - 1);
  dl_iterate_phdr(find_nccl, ncclpath);
  printf("# perseus_coll_perf %s: NCCL with the perseus plugin vs NCCL's Socket transport\n",
         PS_VERSION);
  printf("# date %s, host %s\n", date, host);

  int timed_out = 0;
  if (spawn(-1, 1, deadline, &timed_out)) {
    fprintf(stderr, "perseus_coll_perf: cannot use the GPUs (see above)\n");
    return 1;
  }
  if (shm->ndev < 1) {
    fprintf(stderr, "perseus_coll_perf: no CUDA GPU visible\n");
    return 1;
  }
  if (cfg.ngpus == 0) cfg.ngpus = shm->ndev < PS_MAX_GPUS ? shm->ndev : PS_MAX_GPUS;
  if (cfg.ngpus > shm->ndev) {
    fprintf(stderr, "perseus_coll_perf: -g %d but only %d GPU(s) visible\n", cfg.ngpus,
            shm->ndev);
    return 1;
  }
  int nv = shm->nccl_ver, rv = shm->runtime_ver, dv = shm->driver_ver;
  printf("# NCCL %d.%d.%d (%s; built against %d.%d.%d), CUDA runtime %d.%d, driver %d.%d\n",
         nv / 10000, nv / 100 % 100, nv % 100, ncclpath, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH,
         rv / 1000, rv % 1000 / 10, dv / 1000, dv % 1000 / 10);
  for (int d = 0; d < cfg.ngpus; d++)
    printf("# rank %d: GPU %d %s (sm_%d%d, %.0f GiB)\n", d, d, shm->gpu_name[d],
           shm->gpu_major[d], shm->gpu_minor[d], shm->gpu_mem[d] / (double)(1 << 30));
  if (getenv("CUDA_VISIBLE_DEVICES"))
    printf("# CUDA_VISIBLE_DEVICES=%s\n", getenv("CUDA_VISIBLE_DEVICES"));
  static const char *const avg_names[4] = {"rank 0 only", "average over ranks",
                                           "min over ranks", "max over ranks"};
  printf("# nGpus %d, minBytes %zu, maxBytes %zu, step factor %zu, iters %d, warmup %d, "
         "check %d, timeout %d s; time per iteration from cudaEvents, %s\n",
         cfg.ngpus, cfg.min_bytes, cfg.max_bytes, cfg.factor, cfg.iters, cfg.warmup, cfg.check,
         cfg.timeout_s, avg_names[cfg.avg_mode]);
  printf("# env (both): NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 "
         "NCCL_SOCKET_IFNAME=%s PERSEUS_IFACE=%s PERSEUS_PROVIDER=%s\n",
         cfg.iface, cfg.iface, cfg.provider);
  if (cfg.sweep_on[SW_PERSEUS])
    printf("# env (perseus): NCCL_NET=Perseus NCCL_NET_PLUGIN=%s\n", cfg.plugin);
  if (cfg.sweep_on[SW_SOCKET]) printf("# env (socket): NCCL_NET=Socket NCCL_NET_PLUGIN=none\n");
  if (cfg.ngpus == 1) printf("# note: 1 rank moves no data over the network; busbw is 0\n");

  int failed = 0;
  for (int sw = 0; sw < SW_N; sw++) {
    if (!cfg.sweep_on[sw]) continue;
    if (timed_out || g_signal) {
      fprintf(stderr, "perseus_coll_perf: sweep %s not run\n", sweep_names[sw]);
      break;
    }
    fflush(stdout);
    fprintf(stderr, "# sweep %s: %d ranks\n", sweep_names[sw], cfg.ngpus);
    if (spawn(sw, cfg.ngpus, deadline, &timed_out)) {
      fprintf(stderr, "perseus_coll_perf: sweep %s failed; its results are incomplete\n",
              sweep_names[sw]);
      failed = 1;
    }
  }

  long long wrong = 0;
  for (int c = 0; c < C_N; c++)
    if (cfg.coll_on[c]) print_table(c, &wrong);
  printf("#\n# Out of bounds values : %lld %s\n", wrong,
         !cfg.check ? "(not checked)" : wrong ? "FAILED" : "OK");
  printf("# total time %.1f s%s\n", now_s() - t0,
         failed ? "; ERROR: a sweep failed or timed out, see stderr" : "");
  fflush(stdout);
  return failed || wrong ? 1 : 0;
}
