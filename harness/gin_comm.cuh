/* gin_comm.cuh: the NCCL side shared by perseus_gin_test and perseus_gin_perf,
 * run in the forked rank processes: error checks that name the call and its
 * values, communicator and symmetric-window setup, the device communicator
 * with GIN signals, counters and a GIN barrier over the world team, a stream
 * wait that notices NCCL async errors and aborted peers, and the GPU probe.
 * CUDA C++ only because ncclDevComm, ncclGinBarrierHandle and the kernels are. */
#ifndef PERSEUS_GIN_COMM_CUH
#define PERSEUS_GIN_COMM_CUH

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include "check_call.h"
#include "gin_proc.h"
#include "nccl_compat.cuh"
#include "proc.h"

static ncclComm_t gc_comm_for_errors; /* for ncclGetLastError in messages */

__attribute__((format(printf, 3, 4), noreturn))
static inline void gc_die(const char *file, int line, const char *fmt, ...)
{
  va_list ap;
  va_start(ap, fmt);
  ps_proc_child_vdie(gp_prog, NULL, gp_rank, &gp_sh->abort_flag, 1, file, line, fmt, ap);
}

/* GC_CUDA(call, "fmt", values...): the call, its values, CUDA's verdict;
 * GC_NCCL likewise with NCCL's (check_call.h). */
#define GC_CUDA(call, fmt, ...) PS_CHECK_CUDA(gc_die, call, #call, " (" fmt ")", ##__VA_ARGS__)
#define GC_NCCL(call, fmt, ...) \
  PS_CHECK_NCCL(gc_die, gc_comm_for_errors, call, #call, " (" fmt ")", ##__VA_ARGS__)

struct gc_world {
  int rank, nranks;
  ncclComm_t comm;
  cudaStream_t stream;
  ncclDevComm dev;
  ncclGinBarrierHandle world_bar; /* one GIN barrier over every rank */
  int world_bar_signals;          /* the GIN signals it uses from signal0 */
  int have_dev;
};

struct gc_window {
  void *ptr;
  size_t bytes;
  ncclWindow_t win;
};

/* Pretend hosts (gp_test_hosts): consecutive ranks on one, each on its own
 * GPU there; the GPUs of several hosts may be the same ones (NCCL's
 * duplicate-GPU check is per host), and peers on other hosts are GIN peers.
 * The GPU of `rank`, and its host (-1: the real one). */
static inline int gc_rank_gpu(int rank) { return gp_sh->hosts ? rank % gp_sh->host_ranks : rank; }
static inline int gc_rank_host(int rank) { return gp_sh->hosts ? rank / gp_sh->host_ranks : -1; }

/* cudaSetDevice, the unique id through the shared area, ncclCommInitRank.
 * Returns NCCL's result so a caller can report a refusal; CUDA errors die. */
static inline ncclResult_t gc_world_init(gc_world *w, int rank, int nranks)
{
  memset(w, 0, sizeof(*w));
  w->rank = rank;
  w->nranks = nranks;
  int dev = gc_rank_gpu(rank);
  if (gp_sh->hosts) {
    char host[32];
    snprintf(host, sizeof(host), "perseus-host-%d", gc_rank_host(rank));
    setenv("NCCL_HOSTID", host, 1);
  }
  gp_progress(NULL, -1, "cudaSetDevice(%d)", dev);
  GC_CUDA(cudaSetDevice(dev), "device %d", dev);
  GC_CUDA(cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking), "device %d", rank);
  ncclUniqueId id;
  if (rank == 0) {
    GC_NCCL(ncclGetUniqueId(&id), "rank %d", rank);
    gp_publish_id(&id, sizeof(id));
  } else {
    gp_progress(NULL, -1, "waiting for rank 0's ncclUniqueId");
    if (gp_wait_id(&id, sizeof(id))) _exit(1);
  }
  gp_progress(NULL, -1, "ncclCommInitRank(%d ranks, rank %d)", nranks, rank);
  ncclResult_t r = ncclCommInitRank(&w->comm, nranks, id, rank);
  if (r != ncclSuccess) {
    fprintf(stderr, "%s: rank %d: ncclCommInitRank(%d ranks, rank %d, NCCL_NET_PLUGIN=%s) "
            "failed: %s (last error: %s); NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET shows why\n",
            gp_prog, rank, nranks, rank, getenv("NCCL_NET_PLUGIN"), ncclGetErrorString(r),
            ncclGetLastError(NULL));
    w->comm = NULL;
    return r;
  }
  gc_comm_for_errors = w->comm;
  return ncclSuccess;
}

/* ncclMemAlloc + ncclCommWindowRegister (collective: every rank, same order). */
static inline void gc_window_create(gc_world *w, size_t bytes, gc_window *out, const char *what)
{
  out->bytes = bytes;
  gp_progress(NULL, -1, "ncclMemAlloc + ncclCommWindowRegister(%s, %zu bytes)", what, bytes);
  GC_NCCL(ncclMemAlloc(&out->ptr, bytes), "%s window, %zu bytes", what, bytes);
  out->win = NULL;
  GC_NCCL(ncclCommWindowRegister(w->comm, out->ptr, bytes, &out->win, NCCL_WIN_COLL_SYMMETRIC),
          "%s window, ptr %p, %zu bytes, NCCL_WIN_COLL_SYMMETRIC", what, out->ptr, bytes);
  /* NCCL 2.28 returns success without a window when the communicator has no
   * symmetric memory support (CUDA P2P between all local GPUs, cuMem) */
  if (!out->win)
    gc_die(__FILE__, __LINE__, "ncclCommWindowRegister(%s window, %zu bytes) gave no window: no "
           "symmetric memory support (needs CUDA P2P between every pair of local GPUs and "
           "NCCL_CUMEM_ENABLE; NCCL_DEBUG=INFO says 'isAllCudaP2p')", what, bytes);
}

static inline void gc_window_destroy(gc_world *w, gc_window *win)
{
  GC_NCCL(ncclCommWindowDeregister(w->comm, win->win), "ptr %p, %zu bytes", win->ptr, win->bytes);
  GC_NCCL(ncclMemFree(win->ptr), "ptr %p", win->ptr);
}

/* The device communicator. Asking for GIN signals is what makes NCCL connect
 * GIN (ncclGinConnectOnce: the plugin's listen/connect and, for the proxy,
 * createContext per GIN context) and register every existing window with it;
 * ginForceEnable says so explicitly. The world GIN barrier is a resource
 * requirement: its signals (and, in 2.28, its epochs) come from the devcomm's
 * resources, [nsignals, +world_bar_signals) from 2.29 (nccl_compat.cuh).
 * Returns NCCL's result so a refused strategy can be reported as such. */
static inline ncclResult_t gc_devcomm_create(gc_world *w, int nsignals, int ncounters)
{
  ncclDevCommRequirements reqs;
  ncclDevResourceRequirements bar_req;
  ps_devcomm_reqs_init(&reqs);
  reqs.ginForceEnable = true;
  reqs.ginContextCount = PS_GIN_CONTEXTS; /* a hint; dev.ginContextCount says */
  reqs.ginSignalCount = nsignals; /* before the barrier's, which may follow (nccl_compat.cuh) */
  reqs.ginCounterCount = ncounters;
  GC_NCCL(ps_gin_barrier_requirement(w->comm, ncclTeamWorld(w->comm), &reqs, &w->world_bar,
                                     &bar_req, &w->world_bar_signals),
          "world team of %d ranks, 1 barrier", w->nranks);
  gp_progress(NULL, -1, "ncclDevCommCreate(%d GIN signals, %d counters): GIN connect", nsignals,
              ncounters);
  ncclResult_t r = ncclDevCommCreate(w->comm, &reqs, &w->dev);
  if (r != ncclSuccess) {
    fprintf(stderr, "%s: rank %d: ncclDevCommCreate(ginSignalCount %d, ginCounterCount %d, "
            "ginForceEnable) failed: %s (last error: %s)\n", gp_prog, w->rank, nsignals,
            ncounters, ncclGetErrorString(r), ncclGetLastError(w->comm));
    return r;
  }
  w->have_dev = 1;
  if (w->dev.ginContextCount < 1)
    gc_die(__FILE__, __LINE__, "ncclDevCommCreate gave no GIN context (ginContextCount 0)");
  if (ps_gin_backend(w->dev) != NCCL_NET_DEVICE_GIN_PROXY)
    fprintf(stderr, "%s: rank %d: warning: GIN backend type %d, not the proxy (%d)\n", gp_prog,
            w->rank, ps_gin_backend(w->dev), (int)NCCL_NET_DEVICE_GIN_PROXY);
  return ncclSuccess;
}

/* Waits for the stream without blocking in CUDA, so NCCL's async errors (a
 * failed GIN proxy, a dead peer) and an aborting set are seen; poll(arg) runs
 * every lap (progress reports). */
static inline void gc_wait_stream(gc_world *w, const char *what, void (*poll)(void *), void *arg)
{
  for (unsigned lap = 0;; lap++) {
    cudaError_t e = cudaStreamQuery(w->stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady)
      gc_die(__FILE__, __LINE__, "%s: cudaStreamQuery failed: %s: %s", what, cudaGetErrorName(e),
             cudaGetErrorString(e));
    ncclResult_t ae = ncclSuccess;
    GC_NCCL(ncclCommGetAsyncError(w->comm, &ae), "%s", what);
    if (ae != ncclSuccess && ae != ncclInProgress)
      gc_die(__FILE__, __LINE__, "%s: NCCL async error: %s (last error: %s)", what,
             ncclGetErrorString(ae), ncclGetLastError(w->comm));
    if (gp_aborted()) _exit(1);
    if (poll) poll(arg);
    usleep(lap < 100 ? 20 : 500);
  }
}

/* What enqueue() puts on w's stream, captured into a CUDA graph, ready to
 * launch; enqueue returns the NCCL-style result of the call it makes, and
 * a failure is reported with last_error() (the library's reason). */
template <typename Enqueue>
static inline cudaGraphExec_t gc_capture(gc_world *w, const char *what, Enqueue enqueue,
                                         const char *(*last_error)(void))
{
  cudaGraph_t g;
  cudaGraphExec_t gx;
  GC_CUDA(cudaStreamBeginCapture(w->stream, cudaStreamCaptureModeThreadLocal), "%s", what);
  ncclResult_t r = enqueue();
  GC_CUDA(cudaStreamEndCapture(w->stream, &g), "%s", what);
  if (r != ncclSuccess)
    gc_die(__FILE__, __LINE__, "%s under capture: %s", what, last_error());
  GC_CUDA(cudaGraphInstantiate(&gx, g, 0), "%s", what);
  GC_CUDA(cudaGraphDestroy(g), "%s", what);
  return gx;
}

/* The GPU probe child (gp_run with probe != 0): counts the GPUs
 * (GP_EXIT_SKIP when there is none) and records NCCL's version and each GPU's
 * name in the shared area. detail (perseus_gin_test) also reports progress,
 * records the CUDA driver and runtime versions and appends "(sm_XY)" to the
 * names; perseus_gin_perf prints the bare names. */
static inline int gc_probe(int detail)
{
  if (detail) gp_progress("probe", -1, "cudaGetDeviceCount");
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n < 1) {
    fprintf(stderr, "%s: no usable CUDA GPU: cudaGetDeviceCount: %s\n", gp_prog,
            e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return GP_EXIT_SKIP;
  }
  gp_sh->ndev = n;
  if (detail) {
    GC_CUDA(cudaDriverGetVersion(&gp_sh->driver_version), "");
    GC_CUDA(cudaRuntimeGetVersion(&gp_sh->runtime_version), "");
  }
  GC_NCCL(ncclGetVersion(&gp_sh->nccl_version), "");
  for (int d = 0; d < n && d < GP_MAX_RANKS; d++) {
    cudaDeviceProp prop;
    GC_CUDA(cudaGetDeviceProperties(&prop, d), "device %d", d);
    if (detail)
      snprintf(gp_sh->gpu_name[d], GP_NAME_LEN, "%.80s (sm_%d%d)", prop.name, prop.major,
               prop.minor);
    else
      snprintf(gp_sh->gpu_name[d], GP_NAME_LEN, "%.80s", prop.name);
  }
  return 0;
}

static inline void gc_world_destroy(gc_world *w)
{
  if (w->have_dev) GC_NCCL(ncclDevCommDestroy(w->comm, &w->dev), "rank %d", w->rank);
  GC_NCCL(ncclCommFinalize(w->comm), "rank %d", w->rank);
  GC_NCCL(ncclCommDestroy(w->comm), "rank %d", w->rank);
  GC_CUDA(cudaStreamDestroy(w->stream), "rank %d", w->rank);
}

/* A rank's teardown once no peer still puts into its windows: the device
 * communicator, then the windows a and b (b may be NULL), then the world. */
static inline void gc_world_close(gc_world *w, gc_window *a, gc_window *b)
{
  if (w->have_dev) GC_NCCL(ncclDevCommDestroy(w->comm, &w->dev), "rank %d", w->rank);
  w->have_dev = 0;
  gc_window_destroy(w, a);
  if (b) gc_window_destroy(w, b);
  gc_world_destroy(w);
}

/* gp_run's child for the probe; arg points at gc_probe's detail. */
static inline int gc_probe_child(int /* rank */, void *arg) { return gc_probe(*(const int *)arg); }

/* In the parent, after gp_init and the environment: runs the GPU probe
 * (gc_probe(detail)) in a child and settles *ngpus (0: every visible GPU, at
 * most GP_MAX_RANKS). detail (the tests) also prints NCCL's and CUDA's
 * versions before and each rank's GPU after. Returns -1 to go on, else main's
 * exit status: GP_EXIT_SKIP without a GPU or with fewer than asked, 1 when
 * the probe failed. */
static inline int gc_probe_gpus_min(int detail, int min_gpus, int *ngpus, double stall_s)
{
  int codes[GP_MAX_RANKS], hosts;
  if (gp_test_hosts(&hosts)) return 1; /* a bad value is refused, GPU or not */
  if (gp_run(1, 1, gc_probe_child, &detail, stall_s, "GPU probe", NULL, NULL, codes))
    return codes[0] == GP_EXIT_SKIP ? GP_EXIT_SKIP : 1;
  if (detail) {
    int nv = gp_sh->nccl_version;
    printf("# NCCL %d.%d.%d (built against %d.%d.%d), CUDA runtime %d, driver %d\n", nv / 10000,
           nv / 100 % 100, nv % 100, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, gp_sh->runtime_version,
           gp_sh->driver_version);
  }
  if (*ngpus == 0) *ngpus = gp_sh->ndev < GP_MAX_RANKS ? gp_sh->ndev : GP_MAX_RANKS;
  if (hosts) {
    if (*ngpus < min_gpus || *ngpus % hosts) {
      fprintf(stderr, "%s: PERSEUS_TEST_HOSTS=%d: %d ranks%s cannot be split into %d hosts of as "
              "many ranks\n", gp_prog, hosts, *ngpus,
              *ngpus < min_gpus ? " (too few for this program)" : "", hosts);
      return 1;
    }
    gp_sh->hosts = hosts, gp_sh->host_ranks = *ngpus / hosts;
    if (gp_sh->host_ranks > gp_sh->ndev) {
      printf("# %d GPU(s) visible, %d needed (PERSEUS_TEST_HOSTS=%d: %d ranks per host, each on "
             "its own GPU): skipped\n", gp_sh->ndev, gp_sh->host_ranks, hosts, gp_sh->host_ranks);
      return GP_EXIT_SKIP;
    }
    printf("# %d ranks as %d pretend hosts of %d (PERSEUS_TEST_HOSTS): peers on other hosts go "
           "over the network (GIN)%s\n", *ngpus, hosts, gp_sh->host_ranks,
           hosts > 1 && gp_sh->host_ranks * hosts > gp_sh->ndev
               ? "; hosts share the GPUs, time-sliced, so timings say little" : "");
  } else if (*ngpus < min_gpus || *ngpus > gp_sh->ndev) {
    printf("# %d GPU(s) visible, %d needed: skipped%s\n", gp_sh->ndev,
           *ngpus < min_gpus ? min_gpus : *ngpus,
           *ngpus > gp_sh->ndev ? " (PERSEUS_TEST_HOSTS=N makes N pretend hosts that share them)"
                                : "");
    return GP_EXIT_SKIP;
  }
  if (detail)
    for (int d = 0; d < *ngpus; d++) {
      int g = gc_rank_gpu(d);
      if (gp_sh->hosts) printf("# rank %d: host %d, GPU %d: %s\n", d, gc_rank_host(d), g,
                               gp_sh->gpu_name[g]);
      else printf("# rank %d: GPU %d: %s\n", d, g, gp_sh->gpu_name[g]);
    }
  return -1;
}

/* " [rank] GPU name" for each of n ranks, for the benchmarks' machine line;
 * under pretend hosts (PERSEUS_TEST_HOSTS) with the host and GPU. */
static inline void gc_print_rank_gpus(int n)
{
  for (int d = 0; d < n; d++) {
    if (!gp_sh->hosts) {
      printf(" [%d] %s", d, gp_sh->gpu_name[d]);
      continue;
    }
    int g = gc_rank_gpu(d);
    printf(" [%d] host %d GPU %d: %s", d, gc_rank_host(d), g, gp_sh->gpu_name[g]);
  }
}

/* The same for programs that need at least 2 GPUs. */
static inline int gc_probe_gpus(int detail, int *ngpus, double stall_s)
{
  return gc_probe_gpus_min(detail, 2, ngpus, stall_s);
}

/* Every rank, over GIN (context 0, so through the plugin): signals to every
 * peer, then waits for theirs. acq_rel: what this rank wrote before (a
 * resetSignal, a verified buffer) is visible before any peer passes. */
__device__ __forceinline__ void gc_world_barrier(ncclDevComm const &dc, ncclGinBarrierHandle bar)
{
  ncclGin gin{dc, 0};
  ncclGinBarrierSession<ncclCoopCta> b{ncclCoopCta(), gin, ncclTeamWorld(dc), bar, 0};
  b.sync(ncclCoopCta(), cuda::memory_order_acq_rel, ncclGinFenceLevel::Relaxed);
}

__global__ void gc_barrier_kernel(ncclDevComm dc, ncclGinBarrierHandle bar)
{
  gc_world_barrier(dc, bar);
}

/* Zeroes the first nsignals signals and ncounters counters in every GIN
 * context. Only safe when no put that adds to them is in flight. */
/* User signals start at GC_SIG_FIRST: NCCL 2.28.9 may give the world GIN
 * barrier signal0 = 0, so signal 0 is left to the barrier (its epochs must
 * never be reset). From 2.29 the barrier's signals follow the program's
 * (ps_gin_barrier_requirement) and signal 0 is merely unused. */
#define GC_SIG_FIRST 1

__global__ void gc_reset_kernel(ncclDevComm dc, int nsignals, int ncounters)
{
  for (int ctx = 0; ctx < dc.ginContextCount; ctx++) {
    ncclGin gin{dc, ctx};
    for (int s = GC_SIG_FIRST + threadIdx.x; s < nsignals; s += blockDim.x) gin.resetSignal(s);
    for (int c = threadIdx.x; c < ncounters; c += blockDim.x) gin.resetCounter(c);
  }
}

#endif
