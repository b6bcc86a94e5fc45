/* Host-side pieces every fused operator (MoE, decode, AG+GEMM) shares:
 * the all-reduces of its create (the arguments' agreement across ranks,
 * then whether every rank set up its part), its window's registration, its
 * steps' fault record and its words, and the refusal of a capturing stream.
 * Header only: each operator's library compiles it in. */
#ifndef PS_OP_HOST_H
#define PS_OP_HOST_H

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <perseus/device/batch.cuh> /* perseus_agree_slot */
#include <perseus/device/wait.cuh>

#include "ps_moe_ref.h" /* ps_agree_pack, ps_agree_verdict */

/* The agreement's all-reduce (ps_agree_pack, ps_agree_verdict in
 * ps_moe_ref.h): v, `count` values, replaced by their maximum over the
 * ranks, on a stream of its own. A rank whose own checks refused its
 * arguments takes part too, so that every rank returns instead of waiting
 * in the operator's first collective. 0, or -1 with the failed call in err,
 * after `what` (what the reduction is for). */
static inline int ps_reduce_max(ncclComm_t comm, int64_t *v, int count, const char *what, char *err, size_t len) {
  static_assert(sizeof(long long) == sizeof *v, "agreement words are int64");
  if (count < 1 || count > PERSEUS_AGREE_WORDS) {
    snprintf(err, len, "%s: %d values to reduce (1 to %d)", what, count, PERSEUS_AGREE_WORDS);
    return -1;
  }
  const size_t bytes = (size_t)count * sizeof *v;
  long long *d = NULL;
  cudaStream_t s = NULL;
  ncclResult_t rc = ncclSuccess;
  /* Nothing here allocates device memory (perseus_agree_slot): a rank that
   * ran out still takes part. Without a stream of its own, the legacy one. */
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    (void)cudaGetLastError();
    s = NULL;
  }
  cudaError_t ce = perseus_agree_slot(&d);
  if (ce == cudaSuccess) ce = cudaMemcpyAsync(d, v, bytes, cudaMemcpyHostToDevice, s);
  if (ce == cudaSuccess) rc = ncclAllReduce(d, d, (size_t)count, ncclInt64, ncclMax, comm, s);
  if (ce == cudaSuccess && rc == ncclSuccess) ce = cudaMemcpyAsync(v, d, bytes, cudaMemcpyDeviceToHost, s);
  if (ce == cudaSuccess && rc == ncclSuccess) ce = cudaStreamSynchronize(s);
  if (s) cudaStreamDestroy(s);
  if (ce != cudaSuccess) {
    snprintf(err, len, "%s: %s", what, cudaGetErrorString(ce));
    return -1;
  }
  if (rc != ncclSuccess) {
    snprintf(err, len, "%s: ncclAllReduce failed: %s (%s)", what, ncclGetErrorString(rc), ncclGetLastError(comm));
    return -1;
  }
  return 0;
}

static inline int ps_agree_reduce(ncclComm_t comm, int64_t *v, int count, char *err, size_t len) {
  return ps_reduce_max(comm, v, count, "comparing the config across ranks", err, len);
}

/* A whole agreement for an operator's create: this rank's n (at most 16)
 * fields and whether its own checks passed (`why`: their refusal) against
 * every rank's. 0, or -1 with the reason in err: this rank's refusal, the
 * field the ranks disagree on, or another rank's refusal. */
static inline int ps_op_agree(ncclComm_t comm, const char *const *names, const int64_t *vals, int n, int valid,
                              const char *why, const char *api, char *err, size_t len) {
  int64_t v[2 * 17];
  int nranks = 0;
  if (n > 16) {
    snprintf(err, len, "%d fields to compare across ranks: at most 16", n);
    return -1;
  }
  if (ncclCommCount(comm, &nranks) != ncclSuccess) {
    snprintf(err, len, "ncclCommCount failed (%s)", ncclGetLastError(comm));
    return -1;
  }
  ps_agree_pack(vals, n, valid, v);
  if (ps_agree_reduce(comm, v, 2 * (n + 1), err, len)) return -1;
  if (!valid) {
    snprintf(err, len, "%s", why);
    return -1;
  }
  return ps_agree_verdict(names, vals, n, nranks, v, api, "operator", err, len);
}

/* The operator's symmetric window over buf (from ncclMemAlloc), collective
 * over comm; `what` names it. 0, or -1 with the reason in err. */
static inline int ps_op_window(ncclComm_t comm, void *buf, size_t bytes, ncclWindow_t *win, const char *what,
                               char *err, size_t len) {
  const ncclResult_t rc = ncclCommWindowRegister(comm, buf, bytes, win, NCCL_WIN_COLL_SYMMETRIC);
  if (rc != ncclSuccess) {
    snprintf(err, len, "ncclCommWindowRegister (%s, %zu B) failed: %s (%s)", what, bytes, ncclGetErrorString(rc),
             ncclGetLastError(comm));
    return -1;
  }
  if (*win) return 0;
  snprintf(err, len, "ncclCommWindowRegister gave no window for %s: NCCL has no symmetric memory on this "
           "communicator (CUDA P2P between the local GPUs and cuMem are needed)", what);
  return -1;
}

/* After an operator's work on this rank alone (allocations, kernel sizing),
 * before its first collective after the agreement (the window's
 * registration): whether every rank's succeeded. A rank whose own failed
 * (`ready` 0) takes part too, so that none waits in the registration for
 * it. 0 when every rank is ready; -1 otherwise, with err naming another
 * rank's failure, or empty where this rank's own failure is the reason. */
static inline int ps_op_all_ready(ncclComm_t comm, int ready, const char *api, char *err, size_t len) {
  int64_t failed = !ready;
  err[0] = 0;
  if (ps_reduce_max(comm, &failed, 1, "telling the ranks whether each set up its part", err, len)) return -1;
  if (!ready) return -1;
  if (!failed) return 0;
  snprintf(err, len, "another rank could not set up its part (its %s_last_error() says why): the operator is "
           "created on every rank or on none", api);
  return -1;
}

/* The collective part of an operator's create, after its work on this rank
 * alone (`ready` 0: that failed, its reason already recorded): every rank
 * set up its part before the window's registration or none enters it; then
 * the window over buf, then `attach` (the operator's devcomm and what hangs
 * on it; 0, or -1 with its reason recorded); then every rank keeps the
 * operator or none does. 0, or -1 with a reason not yet recorded in err
 * (empty where this rank's own recorded failure is the reason). */
static inline int ps_op_setup_collective(ncclComm_t comm, int ready, void *buf, size_t bytes, ncclWindow_t *win,
                                         const char *win_what, int (*attach)(void *), void *op, const char *api,
                                         char *err, size_t len) {
  if (ps_op_all_ready(comm, ready, api, err, len)) return -1;
  const int ok = !ps_op_window(comm, buf, bytes, win, win_what, err, len) && !attach(op);
  char later[256]; /* a failed second reduction does not hide this rank's first reason */
  if (ps_op_all_ready(comm, ok, api, ok ? err : later, ok ? len : sizeof later)) return -1;
  return 0;
}

/* A step's fault record (<perseus/device/wait.cuh>): zeroed mapped host
 * memory, *dev as the GPU addresses it. 0, or -1 with the reason in err. */
static inline int ps_fault_alloc(perseus_wait_fault **host, perseus_wait_fault **dev, char *err, size_t len) {
  cudaError_t ce = cudaHostAlloc((void **)host, sizeof **host, cudaHostAllocMapped);
  if (ce != cudaSuccess) {
    *host = NULL;
    snprintf(err, len, "the fault record (mapped host memory): %s", cudaGetErrorString(ce));
    return -1;
  }
  memset(*host, 0, sizeof **host);
  if ((ce = cudaHostGetDevicePointer((void **)dev, *host, 0)) != cudaSuccess) {
    snprintf(err, len, "the fault record's device address: %s", cudaGetErrorString(ce));
    return -1;
  }
  return 0;
}

/* How an operator names what its steps wait for (ps_fault_describe). */
typedef struct {
  const char *api;         /* "perseus_decode": its _abort is named */
  const char *timeout_var; /* "PERSEUS_DECODE_TIMEOUT_MS" */
  unsigned own_what;       /* the record's `what` for a wait on this rank's own blocks */
  const char *own_done;    /* what those blocks count: "records written" */
  const char *peer_units;  /* what a peer's count counts: "records" */
  const char *output;      /* what a failed step leaves invalid: "its output" */
} ps_fault_words;

/* Why a step gave up (an abort, or a wait that timed out on this rank's own
 * blocks or on a peer), into err, after `when`. */
static inline void ps_fault_describe(const perseus_wait_fault *w, const ps_fault_words *o, long long timeout_ms,
                                     const char *when, char *err, size_t len) {
  if (!w->set)
    snprintf(err, len, "%s: the operator was aborted (%s_abort); destroy it", when, o->api);
  else if (w->what == o->own_what)
    snprintf(err, len, "%s: step %llu (from 1) waited %llu ms (%s %lld) for this rank's own blocks (%llu of %llu %s); "
             "destroy the operator", when, w->tag, w->waited_ns / 1000000, o->timeout_var, timeout_ms, w->got,
             w->want, o->own_done);
  else
    snprintf(err, len, "%s: step %llu (from 1) waited %llu ms (%s %lld) for rank %d's %s (count %llu of %llu): "
             "rank %d did not run that step, or failed in it; %s is not valid and the operator cannot go on: "
             "destroy it", when, w->tag, w->waited_ns / 1000000, o->timeout_var, timeout_ms, w->src, o->peer_units,
             w->got, w->want, w->src, o->output);
}

/* Whether a step gave up or the host aborted. */
static inline int ps_fault_any(const perseus_wait_fault *f) { return f && (f->set || f->abort); }

/* Ends the waits of every running and later step (any thread). */
static inline void ps_fault_abort(perseus_wait_fault *f) {
  if (f) __atomic_store_n((unsigned int *)&f->abort, 1u, __ATOMIC_RELEASE);
}

/* A step's counts are the host's, fixed at the call: captured into a graph,
 * every replay would repeat one step's and wait for, or take, the wrong
 * data. 0, or -1 with the reason in err while `st` is capturing. */
static inline int ps_refuse_capture(cudaStream_t st, char *err, size_t len) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  const cudaError_t ce = cudaStreamIsCapturing(st, &cs);
  if (ce != cudaSuccess) {
    snprintf(err, len, "the stream: %s", cudaGetErrorString(ce));
    return -1;
  }
  if (cs == cudaStreamCaptureStatusNone) return 0;
  snprintf(err, len, "stream %p is capturing a CUDA graph: a step cannot be captured (its counts are fixed when "
           "it is called, so a replay would repeat them); call it on the stream directly", (void *)st);
  return -1;
}

#endif
