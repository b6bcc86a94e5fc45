/* Host-side pieces every fused operator (MoE, decode, AG+GEMM) shares:
 * the all-reduce of its agreement across ranks, its steps' fault record,
 * and the refusal of a capturing stream. Header only: each operator's
 * library compiles it in. */
#ifndef PS_OP_HOST_H
#define PS_OP_HOST_H

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <perseus/device/wait.cuh>

#include "ps_moe_ref.h" /* ps_agree_pack, ps_agree_verdict */

/* The agreement's all-reduce (ps_agree_pack, ps_agree_verdict in
 * ps_moe_ref.h): v, `count` values, replaced by their maximum over the
 * ranks, on a stream of its own. A rank whose own checks refused its
 * arguments takes part too, so that every rank returns instead of waiting
 * in the operator's first collective. 0, or -1 with the failed call in err. */
static inline int ps_agree_reduce(ncclComm_t comm, int64_t *v, int count, char *err, size_t len) {
  const size_t bytes = (size_t)count * sizeof *v;
  void *d = NULL;
  cudaStream_t s = NULL;
  ncclResult_t rc = ncclSuccess;
  cudaError_t ce = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (ce == cudaSuccess) ce = cudaMalloc(&d, bytes);
  if (ce == cudaSuccess) ce = cudaMemcpyAsync(d, v, bytes, cudaMemcpyHostToDevice, s);
  if (ce == cudaSuccess) rc = ncclAllReduce(d, d, (size_t)count, ncclInt64, ncclMax, comm, s);
  if (ce == cudaSuccess && rc == ncclSuccess) ce = cudaMemcpyAsync(v, d, bytes, cudaMemcpyDeviceToHost, s);
  if (ce == cudaSuccess && rc == ncclSuccess) ce = cudaStreamSynchronize(s);
  if (d) cudaFree(d);
  if (s) cudaStreamDestroy(s);
  if (ce != cudaSuccess) {
    snprintf(err, len, "comparing the config across ranks: %s", cudaGetErrorString(ce));
    return -1;
  }
  if (rc != ncclSuccess) {
    snprintf(err, len, "comparing the config across ranks: ncclAllReduce failed: %s (%s)", ncclGetErrorString(rc),
             ncclGetLastError(comm));
    return -1;
  }
  return 0;
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
