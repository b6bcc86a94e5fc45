/* moe_args.h: the fused MoE kernel's argument and state types, shared by
 * the kernel (moe_kernel.cuh) and the host side (ps_moe_layer.h); no
 * device code of its own. */
#ifndef PS_MOE_ARGS_H
#define PS_MOE_ARGS_H

#include <cuda.h> /* CUtensorMap */
#include <cuda_bf16.h>
#include <nccl.h>
#include <nccl_device.h>

#include "perseus/device.cuh"
#include "perseus/moe_config.h"
#include "ps_moe_ref.h" /* PS_MOE_FAULT_*, PS_MOE_WAIT_* */

typedef __nv_bfloat16 ps_bf16;

/* Per-forward counters (zeroed at the end of each forward) and cumulative
 * state, in plain device memory; R ranks, L local experts. */
struct ps_moe_state {
  int *scnt;          /* [R][L] rows this rank sends to (dst, expert) */
  int *soff;          /* [R][L] their offset in dst's receive region for us */
  int *sdone;         /* [R][L] rows put so far (last one closes the segment) */
  int *dsent;         /* [R] rows gathered for a GIN destination (last one puts them) */
  int *rsegs, *rdone; /* [R] experts with rows from a GIN source, and those returned */
  int *rcnt, *roff;   /* [R][L] rows from (src, expert) and their offset */
  int *g1done;        /* [L] GEMM1 tiles done */
  int *g2done;        /* [L] GEMM2 tasks done */
  int *task;          /* next task of the queue */
  int *ready;         /* CTAs past their dispatch and headers: the experts' rows are known */
  int *fault;         /* sticky: the layer's first fault (PS_MOE_FAULT_*, moe_peers.cuh) */
  int *peer_fault;    /* [R] sticky: a wait for this peer gave up, or its header was refused */
  int *aborted;       /* sticky: a wait saw the host's abort */
  unsigned long long *abort_read; /* when a wait last read the host's abort flag (ns) */
  uint64_t *tot;      /* [L][R] cumulative tiles expected from src on expert handle */
  uint64_t *tot_c;    /* [R] cumulative returns expected from a GIN dst */
  uint64_t *tot_r;    /* [R] cumulative row puts expected from a GIN src (rows handle) */
  float *logits;      /* [T][E] */
  int32_t *topk_idx;  /* [T][k] */
  float *topk_w;      /* [T][k] */
  int32_t *slot;      /* [T][k] row within its segment */
  int32_t *self_tok;  /* [P] the token of each row we route to ourselves (they stay in x) */
  perseus_batch_handle *hexp; /* [L] one handle per local expert */
  unsigned long long *fwd;    /* forwards completed: advanced by the kernel, so that a
                               * forward replayed from a CUDA graph counts too */
};


/* In mapped host memory: the host sets `abort` and reads the first fault
 * without waiting for a forward; `set` is written last. */
struct ps_moe_ctl {
  volatile int abort; /* perseus_moe_abort */
  ps_moe_fault_t f;   /* the first fault (ps_moe_ref.h) */
  volatile int set;
};

struct ps_moe_args {
  ncclDevComm dc;
  ncclWindow_t win;
  perseus_batch_handle hctl, hcomb, hrows; /* hrows: a GIN destination's rows in one put */
  ps_moe_state st;
  const ps_bf16 *gate, *w1, *w3, *w2; /* [E][H]; [L][F][H] x2; [L][H][F] */
  CUtensorMap tm_w1, tm_w3, tm_w2;    /* the same as 2-D tensors of 64 x 64 boxes (TMA) */
  ps_bf16 *act;                       /* [R*P][F] */
  const ps_bf16 *x;                   /* user input [T][H] */
  ps_bf16 *out;                       /* user output [T][H] */
  /* window layout, byte offsets */
  size_t off_recv, off_send, off_comb, off_y, off_hdr_out, off_hdr_in;
  size_t off_done; /* [R][L] u64: forwards whose results of expert j rank d stored here (LSA) */
  int H, F, E, L, k, R, P, T, renorm, batch;
  int gin_per_expert; /* GIN rows: one put per (peer, expert) segment instead of per peer */
  int gate_kc; /* hidden elements per gate task (split-K) */
  /* [3][PS_PROF_N]: forward f's marks and shape in half f % 2 (the other
   * half, cleared at f's end, is f + 1's); the running forward's sums
   * (ps_prof_add) in the third part, cleared at its start */
  unsigned long long *prof;
  ps_moe_ctl *ctl;                /* host-mapped (moe_peers.cuh) */
  unsigned long long timeout_ns; /* a wait for a peer gives up after it (0: never) */
  /* tests (ps_moe_test_header): the count we announce for local expert j
   * (-1: none), and whether the headers are withheld */
  int test_hdr_j, test_hdr_count;
  int test_hdr_skip; /* -1: send every header; -2: none; d >= 0: none to rank d */
  int test_rows_skip; /* tests (ps_moe_test_rows): no rows to rank d (-1: none) */
};

/* Phase marks in global-timer ns: START is the earliest CTA's, HEADERS the
 * earliest to see every CTA past its dispatch and headers (the header
 * barrier, or ps_wait_ready), the others the latest CTA's. The WAIT slots
 * are sums of ns spent waiting: expert tasks for their rows (per CTA), GEMM2
 * tasks for their expert's GEMM1 (per CTA), combine for the returned rows
 * (per token); they tell idle time from weight streaming. The RUN slots sum
 * the tasks' working time, EXPERTS_END each CTA's span in the experts phase:
 * against the phase, the imbalance between CTAs. */
enum { PS_PROF_START, PS_PROF_ROUTE, PS_PROF_DISPATCH, PS_PROF_HEADERS, PS_PROF_EXPERTS,
       PS_PROF_COMBINE, PS_PROF_WAIT_ROWS, PS_PROF_WAIT_GEMM1, PS_PROF_WAIT_COMBINE,
       PS_PROF_WGMMA, /* 1 + whether the GEMMs ran on wgmma (0: no forward yet) */
       PS_PROF_RUN_GEMM1, PS_PROF_RUN_GEMM2, /* ns in GEMM1 / GEMM2 tasks past their waits, per CTA */
       PS_PROF_EXPERTS_END, /* ns from a CTA's first task claim to the end of its last task, per CTA */
       PS_PROF_TOKENS, PS_PROF_TILE_ROWS, PS_PROF_GRID, /* the forward's shape */
       PS_PROF_N };

/* prof's third part: the running forward's sums (ps_prof_add) */
#define PS_PROF_SUMS (2 * PS_PROF_N)

#endif
