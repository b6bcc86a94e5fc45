/* ps_moe_layer.h: the layer object of perseus' fused MoE layer and what
 * its host-side files (moe.cu, moe_status.cu) share. */
#ifndef PS_MOE_LAYER_H
#define PS_MOE_LAYER_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_args.h"
#include "perseus/moe.h"

extern "C" {
#include "ps_moe_ref.h"
}

struct perseus_moe {
  ncclComm_t comm;
  perseus_moe_config_t cfg;
  int rank, nranks, L, P, gin;
  int grid[2];     /* CTAs of the forward kernel with 64- and 128-row GEMM tiles */
  int tile_rows;   /* PERSEUS_MOE_TILE_ROWS (0: by the rows per expert) */
  ncclDevComm dc;
  int have_dc;
  int have_weights; /* perseus_moe_load_weights succeeded once */
  void *win_ptr;
  ncclWindow_t win;
  size_t win_bytes;
  ps_moe_args args; /* everything but the per-forward fields */
  void *dev;        /* one allocation: state, weights, activation */
  cudaEvent_t done; /* recorded behind each forward (in a captured graph too) */
  ps_moe_ctl *ctl;  /* host-mapped: the kernel's first fault, the host's abort (moe_peers.cuh) */
};

/* On failure: the reason (the call, its error, the context given as a
 * format and arguments) into perseus_moe_last_error(), and return. */
#define PS_MOE_FAIL_(failed, call_text, err_text, ret, ...)                                      \
  do {                                                                                            \
    if (failed) {                                                                                 \
      char ctx_[256];                                                                             \
      snprintf(ctx_, sizeof(ctx_), __VA_ARGS__);                                                  \
      ps_moe_set_error("%s failed: %s (%s)", call_text, err_text, ctx_);                         \
      return ret;                                                                                 \
    }                                                                                             \
  } while (0)
#define PS_MOE_CUDA(call, ...)                                                                    \
  do {                                                                                            \
    const cudaError_t e_ = (call);                                                                \
    PS_MOE_FAIL_(e_ != cudaSuccess, #call, cudaGetErrorString(e_), ncclUnhandledCudaError,       \
                 __VA_ARGS__);                                                                    \
  } while (0)
#define PS_MOE_NCCL(call, ...)                                                                    \
  do {                                                                                            \
    const ncclResult_t r_ = (call);                                                               \
    PS_MOE_FAIL_(r_ != ncclSuccess, #call, ncclGetErrorString(r_), r_, __VA_ARGS__);             \
  } while (0)

/* moe_status.cu */
/* Every rank's config valid and the same (collective, before any size is
 * taken from it); the environment (PERSEUS_MOE_TILE_ROWS, _TIMEOUT_MS) is
 * read there and counts as config: a bad value fails every rank. */
ncclResult_t ps_moe_agree(perseus_moe *m);
/* The host-mapped control block (ps_moe_agree read PERSEUS_MOE_TIMEOUT_MS). */
ncclResult_t ps_moe_ctl_create(perseus_moe *m);
/* ncclRemoteError, the reason in the error, once the layer failed. */
ncclResult_t ps_moe_fault_check(const perseus_moe *m);

#endif
