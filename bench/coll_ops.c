/* coll_ops.c: what the forked children of perseus_coll_perf run.
 *
 * One child per GPU and sweep (rank i on device i) sets the sweep's NCCL
 * environment, fills its send buffer with a known pattern, joins the NCCL
 * communicator and, for every chosen collective and size, launches it the
 * nccl-tests way (element counts, warmup, timed iterations between two
 * cudaEvents), optionally checks the output against the pattern, and rank 0
 * turns the per-rank times into algbw/busbw in the shared mapping. The GPU probe
 * child, which counts the GPUs and reads the versions, lives here too: this is
 * the only file that calls CUDA, so the parent never does. Children that fail
 * report on stderr, raise the shared abort flag and _exit(1). */
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "check_call.h"
#include "coll_perf.h"
#include "proc.h"

#define PS_PAT_P 251                       /* pattern period (prime) */
#define PS_CHUNK_ELEMS ((size_t)16 << 20)  /* host staging for fill/check */

static int g_rank = -1, g_sweep = -1;
static ncclComm_t g_comm;

__attribute__((format(printf, 3, 4), noreturn))
static void child_die(const char *file, int line, const char *fmt, ...)
{
  va_list ap;
  va_start(ap, fmt);
  ps_proc_child_vdie("perseus_coll_perf", g_rank < 0 ? NULL : coll_sweep_names[g_sweep], g_rank,
                     &coll_shm->abort_flag, 0, file, line, fmt, ap);
}

#define CUDACHECK(call) PS_CHECK_CUDA(child_die, call, #call, "")
#define NCCLCHECK(call) PS_CHECK_NCCL(child_die, g_comm, call, #call, "")

/* Another process failed: the parent kills us anyway, leave quietly. */
static void check_abort(void)
{
  if (__atomic_load_n(&coll_shm->abort_flag, __ATOMIC_ACQUIRE)) _exit(1);
}

static void barrier(void)
{
  unsigned gen = __atomic_load_n(&coll_shm->bar_gen, __ATOMIC_ACQUIRE);
  if (__atomic_add_fetch(&coll_shm->bar_count, 1, __ATOMIC_ACQ_REL) == (unsigned)coll_cfg.ngpus) {
    __atomic_store_n(&coll_shm->bar_count, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&coll_shm->bar_gen, 1, __ATOMIC_RELEASE);
    return;
  }
  while (__atomic_load_n(&coll_shm->bar_gen, __ATOMIC_ACQUIRE) == gen) {
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
int coll_counts(int c, size_t bytes, int n, struct ps_counts *k)
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
    for (int p = 0; p < coll_cfg.ngpus && ret == ncclSuccess; p++) {
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
  setenv("NCCL_SOCKET_IFNAME", coll_cfg.iface, 1);
  setenv("PERSEUS_IFACE", coll_cfg.iface, 1);
  setenv("PERSEUS_PROVIDER", coll_cfg.provider, 1);
  if (sw == SW_PERSEUS) {
    setenv("NCCL_NET_PLUGIN", coll_cfg.plugin, 1);
    setenv("NCCL_NET", "Perseus", 1);
  } else {
    setenv("NCCL_NET_PLUGIN", "none", 1);
    setenv("NCCL_NET", "Socket", 1);
  }
}

void coll_child_main(int sw, int rank)
{
  g_rank = rank;
  g_sweep = sw;
  set_sweep_env(sw);
  int n = coll_cfg.ngpus;
  size_t elems = coll_cfg.max_bytes / sizeof(float);
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
    coll_shm->id = id;
    __atomic_store_n(&coll_shm->id_ready, 1, __ATOMIC_RELEASE);
  } else {
    while (!__atomic_load_n(&coll_shm->id_ready, __ATOMIC_ACQUIRE)) {
      check_abort();
      usleep(1000);
    }
  }
  ncclUniqueId id = coll_shm->id;
  ncclResult_t ir = ncclCommInitRank(&g_comm, n, id, rank);
  if (ir != ncclSuccess)
    child_die(__FILE__, __LINE__, "ncclCommInitRank(%d ranks, NCCL_NET=%s) failed: %s "
              "(last error: %s)%s", n, getenv("NCCL_NET"), ncclGetErrorString(ir),
              ncclGetLastError(NULL), sw == SW_PERSEUS ?
              "; NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET shows why the plugin failed" : "");

  for (int c = 0; c < C_N; c++) {
    if (!coll_cfg.coll_on[c]) continue;
    float sum_tab[PS_PAT_P];
    for (int x = 0; x < PS_PAT_P; x++) {
      sum_tab[x] = 0.0f;
      for (int k = 0; k < n; k++) sum_tab[x] += pat(k, (size_t)x);
    }
    for (int i = 0; i < coll_cfg.nsizes; i++) {
      struct ps_result *res = &coll_shm->res[sw][c][i];
      struct ps_counts k;
      if (!coll_counts(c, coll_cfg.sizes[i], n, &k)) {
        if (rank == 0) res->state = 2;
        continue;
      }
      for (int w = 0; w < coll_cfg.warmup; w++) NCCLCHECK(run_coll(c, dsend, drecv, &k, st));
      sync_stream(st);
      barrier();
      CUDACHECK(cudaEventRecord(ev0, st));
      for (int it = 0; it < coll_cfg.iters; it++) NCCLCHECK(run_coll(c, dsend, drecv, &k, st));
      CUDACHECK(cudaEventRecord(ev1, st));
      sync_stream(st);
      float ms = 0.0f;
      CUDACHECK(cudaEventElapsedTime(&ms, ev0, ev1));
      coll_shm->rank_us[rank] = (double)ms * 1e3 / coll_cfg.iters;
      if (coll_cfg.check) {
        CUDACHECK(cudaMemsetAsync(drecv, 0xff, k.recv * sizeof(float), st)); /* NaN */
        NCCLCHECK(run_coll(c, dsend, drecv, &k, st));
        sync_stream(st);
        long long wrong = check_output(c, drecv, &k, host, sum_tab);
        __atomic_add_fetch(&res->wrong, wrong, __ATOMIC_RELAXED);
      }
      barrier();
      if (rank == 0) {
        /* like nccl-tests -a: 0 rank 0, 1 average, 2 min, 3 max over ranks */
        double t = coll_shm->rank_us[0];
        for (int r = 1; r < n && coll_cfg.avg_mode; r++) {
          double u = coll_shm->rank_us[r];
          t = coll_cfg.avg_mode == 1 ? t + u
            : coll_cfg.avg_mode == 2 ? (u < t ? u : t) : (u > t ? u : t);
        }
        res->time_us = coll_cfg.avg_mode == 1 ? t / n : t;
        res->algbw = (double)k.alg_bytes / (res->time_us * 1e3);
        res->busbw = res->algbw * bus_factor(c, n);
        __atomic_store_n(&res->state, 1, __ATOMIC_RELEASE);
        fprintf(stderr, "# [%s] %-14s %12zu B  %10.1f us  busbw %7.2f GB/s  #wrong %lld\n",
                coll_sweep_names[sw], coll_names[c], k.size_col, res->time_us, res->busbw,
                coll_cfg.check ? __atomic_load_n(&res->wrong, __ATOMIC_RELAXED) : 0LL);
      }
    }
  }
  __atomic_add_fetch(&coll_shm->ranks_done, 1, __ATOMIC_RELEASE);
  NCCLCHECK(ncclCommFinalize(g_comm));
  NCCLCHECK(ncclCommDestroy(g_comm));
  CUDACHECK(cudaFree(dsend));
  CUDACHECK(cudaFree(drecv));
  free(host);
  _exit(0);
}

void coll_probe_main(void)
{
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess)
    child_die(__FILE__, __LINE__, "no usable CUDA GPU: cudaGetDeviceCount failed: %s: %s%s",
              cudaGetErrorName(e), cudaGetErrorString(e),
              e == cudaErrorInsufficientDriver ? " (no NVIDIA driver/libcuda.so.1 here?)" : "");
  coll_shm->ndev = n;
  CUDACHECK(cudaDriverGetVersion(&coll_shm->driver_ver));
  CUDACHECK(cudaRuntimeGetVersion(&coll_shm->runtime_ver));
  NCCLCHECK(ncclGetVersion(&coll_shm->nccl_ver));
  for (int d = 0; d < n && d < PS_MAX_GPUS; d++) {
    struct cudaDeviceProp prop;
    CUDACHECK(cudaGetDeviceProperties(&prop, d));
    snprintf(coll_shm->gpu_name[d], PS_NAME_LEN, "%s", prop.name);
    coll_shm->gpu_major[d] = prop.major;
    coll_shm->gpu_minor[d] = prop.minor;
    coll_shm->gpu_mem[d] = prop.totalGlobalMem;
  }
  _exit(0);
}
