// Flash-Decode in one kernel per step (<perseus/decode.h>): partials, their
// exchange and the combine, with the blocks of a step handing records to
// each other through counters instead of kernel boundaries.
#include <nccl.h>
#include <nccl_device.h>
#include <perseus/device.cuh>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <perseus/decode.h>

#include "ps_op_host.h"
#include "ps_decode.h"
#include "ps_decode_dev.cuh"

struct perseus_decode {
  ncclComm_t comm;
  int rank, nranks, splits, mode, grid, have_dev;
  ps_decode_config_t cfg;
  int max_shard;
  size_t part;        // floats of one rank's records
  size_t smem;        // dynamic shared memory of a block
  uint32_t batch;     // records per signal
  uint64_t steps;
  void *buf;
  ncclWindow_t win;
  ncclDevComm dev;
  perseus_batch_handle h;
  unsigned long long *local_done; // [0] this rank's records written, over every step; [1..2] the waits' state
  perseus_wait_fault *fault;      // mapped host memory: the first wait that gave up, or the host's abort
  perseus_wait_fault *fault_dev;  // the same as the GPU maps it
  long long timeout_ms;           // PERSEUS_DECODE_TIMEOUT_MS
};

namespace {

using ps_decode_dev::kThreads;
static_assert(kThreads == ps_decode_dev::kCombineThreads, "one block shape for both phases");

struct fused_args {
  ncclDevComm dc;
  perseus_batch_handle h;
  ncclWindow_t win;
  int B, Hq, Hkv, D, splits, mode;
  float scale;
  const uint16_t *q, *k, *v;
  size_t stride;
  const int *n;
  uint16_t *out;
  size_t part;      // floats per rank's records
  int half;         // the window half of this step
  uint32_t batch;
  uint64_t total;   // records from each NVLink peer (and this rank's), counted since the start
  uint64_t steps;   // puts from each GIN peer since the start: one a step
  unsigned long long *local_done;
  perseus_wait_bound wb; // every wait of the step
};

// What a fused step waits for (perseus_wait_fault::what), or found wrong.
enum { WAIT_OWN_RECORDS = 1, WAIT_PEER_RECORDS = 2, BAD_LENGTH = 3 };

// A pulling combiner reads rank r's records where r wrote them.
struct pulled_recs {
  ncclWindow_t win;
  size_t first; // floats: the half's start
  size_t part;
  int me;
  ncclDevComm const *dc;
  __device__ const float *operator()(int r) const {
    const size_t off = (first + (size_t)r * part) * sizeof(float);
    if (r == me) return (const float *)ncclGetLocalPointer(win, off);
    return (const float *)ncclGetLsaPointer(win, off, perseus_lsa_index(*dc, r));
  }
};

// Three blocks an SM where the group allows (as the standalone partial
// kernel gets): the combine phase must not cost the partial phase a block.
template <int G, int U>
__global__ void __launch_bounds__(kThreads, G <= 4 ? 3 : 1) fused_kernel(fused_args a) {
  extern __shared__ float sh[];
  const int R = a.dc.nRanks, me = a.dc.rank, items = a.B * a.Hkv * a.splits;
  const size_t RF = ps_decode_record_floats(G, a.D), first = (size_t)a.half * R * a.part;
  const size_t mine = first + (size_t)me * a.part; // floats from the window's start
  float *recs = (float *)ncclGetLocalPointer(a.win, mine * sizeof(float));
  perseus_batch pb(a.dc, a.h, a.batch);

  // 1. this block's chunks: partial, then to every peer
  for (int it = blockIdx.x; it < items; it += gridDim.x) {
    const int s = it % a.splits, hk = it / a.splits % a.Hkv, b = it / a.splits / a.Hkv;
    // a length outside the shard is the caller's error: recorded (the step
    // then ends without its combine) and kept inside k and v meanwhile
    int len = a.n[b];
    if (len < 0 || (size_t)len > a.stride) {
      if (threadIdx.x == 0) perseus_wait_record(a.wb, b, BAD_LENGTH, a.stride, (unsigned long long)(long long)len, 0);
      len = len < 0 ? 0 : (int)a.stride;
    }
    const int per = (len + a.splits - 1) / a.splits;
    const int t0 = min(len, s * per), t1 = min(len, t0 + per);
    const size_t row = ((size_t)b * a.Hkv + hk) * a.stride * a.D;
    ps_decode_dev::partial_chunk<G, U>(a.D, a.scale, a.q + ((size_t)b * a.Hq + (size_t)hk * G) * a.D,
                                       a.k + row, a.v + row, t0, t1, recs + it * RF, sh);
    const size_t off = (mine + it * RF) * sizeof(float);
    for (int j = 1; j < R; j++) {
      const int peer = (me + j) % R;
      if (perseus_lsa_index(a.dc, peer) < 0) continue; // GIN peers: the whole block below
      if (a.mode == PERSEUS_DECODE_PUSH) pb.put(ncclCoopCta(), peer, a.win, off, a.win, off, RF * sizeof(float));
      else if (threadIdx.x == 0) pb.stored(peer); // it stays here; the peer reads it
    }
    if (threadIdx.x == 0) {
      __threadfence();
      // the block that writes the step's last record puts all of them to
      // each GIN peer at once: one put and its signal per peer and step.
      // Its source half is written again two steps later, after this put's
      // signal let the peer finish the step and send the next one's: the
      // put has read it by then, so no ncclGin::flush is needed.
      if (atomicAdd(a.local_done, 1ULL) + 1 == a.total) {
        __threadfence();
        perseus_batch whole(a.dc, a.h, 1);
        for (int j = 1; j < R; j++) {
          const int peer = (me + j) % R;
          if (perseus_lsa_index(a.dc, peer) < 0)
            whole.put(ncclCoopThread(), peer, a.win, mine * sizeof(float), a.win, mine * sizeof(float),
                      a.part * sizeof(float));
        }
      }
    }
  }

  // 2. every record of the step: this rank's blocks' and every peer's. The
  // launch is cooperative, so every block is running. The waiting threads
  // nap: spinning blocks would slow the L2 for the blocks still reading the
  // cache. A wait that gives up (a peer that never sends) ends the step
  // without its combine; the host reads why (perseus_decode_check).
  __shared__ int gave_up;
  if (threadIdx.x == 0) {
    bool ok = perseus_wait_until(a.wb, me, WAIT_OWN_RECORDS, a.total,
                                 [&] { return *(volatile unsigned long long *)a.local_done; });
    perseus_recv rv(a.dc, a.h);
    for (int j = 1; ok && j < R; j++) {
      const int src = (me + j) % R;
      ok = rv.wait_for(src, perseus_lsa_index(a.dc, src) < 0 ? a.steps : a.total, a.wb, WAIT_PEER_RECORDS);
    }
    __threadfence();
    gave_up = !ok;
  }
  __syncthreads();
  if (gave_up) return;

  // 3. the rows
  for (int row = blockIdx.x; row < a.B * a.Hq; row += gridDim.x) {
    const int b = row / a.Hq, h = row % a.Hq;
    if (a.mode == PERSEUS_DECODE_PUSH)
      ps_decode_dev::combine_row(a.Hq, a.Hkv, a.D, a.splits, R,
                                 ps_decode_dev::rank_stride_recs{
                                     (const float *)ncclGetLocalPointer(a.win, first * sizeof(float)), a.part},
                                 b, h, a.out, sh);
    else
      ps_decode_dev::combine_row(a.Hq, a.Hkv, a.D, a.splits, R, pulled_recs{a.win, first, a.part, me, &a.dc},
                                 b, h, a.out, sh);
  }
}

template <int G> constexpr int ahead() { return G <= 4 ? 8 : G == 8 ? 4 : 2; }

// Cooperative: the blocks wait for each other's records, so all of them
// must be resident at once (a plain launch next to other work may not be).
template <int G>
cudaError_t launch(const fused_args &a, int grid, size_t smem, cudaStream_t st) {
  void *args[] = {(void *)&a};
  return cudaLaunchCooperativeKernel((const void *)fused_kernel<G, ahead<G>()>, dim3(grid), dim3(kThreads), args,
                                     smem, st);
}

template <int G>
cudaError_t prepare(size_t smem, int *per_sm) {
  cudaError_t e = cudaSuccess;
  if (smem > 48 * 1024)
    e = cudaFuncSetAttribute(fused_kernel<G, ahead<G>()>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)smem);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, fused_kernel<G, ahead<G>()>, kThreads, smem);
  return e;
}

// The reason a step gave up, into the operator's error; -1.
int fail_fault(const perseus_decode_t *f, const char *when) {
  const perseus_wait_fault &w = *f->fault;
  if (w.set && w.what == BAD_LENGTH)
    return ps_decode_fail("%s: step %llu (from 1): n[%d] = %lld tokens, outside this rank's shard of 0..%llu (the "
                          "stride): its output is not valid and the operator cannot go on: destroy it",
                          when, w.tag, w.src, (long long)w.got, w.want);
  static const ps_fault_words words = {"perseus_decode", "PERSEUS_DECODE_TIMEOUT_MS", WAIT_OWN_RECORDS,
                                       "records written", "records", "its output"};
  char err[512];
  ps_fault_describe(&w, &words, f->timeout_ms, when, err, sizeof err);
  return ps_decode_fail("%s", err);
}

int fail_nccl(const char *what, ncclResult_t rc, ncclComm_t comm) {
  return ps_decode_fail("%s failed: %s (%s)", what, ncclGetErrorString(rc),
                        comm ? ncclGetLastError(comm) : "");
}


// The operator's devcomm (GIN where a peer is beyond NVLink), after its
// window: 0, or -1 with the reason recorded.
int attach_dev(void *op) {
  perseus_decode_t *f = (perseus_decode_t *)op;
  const char *what = "";
  const int gin = ncclTeamLsa(f->comm).nRanks != f->nranks;
  const ncclResult_t rc = perseus_batch_devcomm_create(f->comm, gin, &f->dev, &f->h, &what);
  if (rc != ncclSuccess) return fail_nccl(what, rc, f->comm);
  f->have_dev = 1;
  return 0;
}


// What create checks on this rank alone: 0, or -1 with the reason. Sets the
// timeout, the GPU's SM count and the chunks a row (splits resolved).
int local_checks(ncclComm_t comm, const ps_decode_config_t *cfg, int R, int mode, int max_shard, int *splits,
                 long long *timeout_ms, int *sms) {
  if (ps_decode_check_config(cfg, R)) return -1;
  const int G = cfg->q_heads / cfg->kv_heads;
  if (G > PS_DECODE_MAX_GROUP || (G & (G - 1)))
    return ps_decode_fail("q_heads / kv_heads = %d query heads per KV head: the kernel takes 1, 2, "
                          "4, 8 or 16", G);
  if (mode != PERSEUS_DECODE_PUSH && mode != PERSEUS_DECODE_PULL)
    return ps_decode_fail("mode %d: expected PERSEUS_DECODE_PUSH (0) or PERSEUS_DECODE_PULL (1)", mode);
  if (max_shard < 1 || max_shard > cfg->max_context)
    return ps_decode_fail("max_shard %d: expected 1 to max_context (%d) tokens", max_shard, cfg->max_context);
  if (*splits < 0 || *splits > 65535)
    return ps_decode_fail("splits %d: expected 0 (automatic) to 65535", *splits);
  if (ps_decode_env_timeout_ms(timeout_ms)) return -1;
  int coop = 0, dev = 0;
  cudaError_t ce = cudaGetDevice(&dev);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
  if (ce != cudaSuccess) return ps_decode_fail("the current GPU: %s", cudaGetErrorString(ce));
  if (!coop) return ps_decode_fail("GPU %d has no cooperative launch, which the fused kernel needs", dev);
  const int lsa = ncclTeamLsa(comm).nRanks;
  if (mode == PERSEUS_DECODE_PULL && lsa != R)
    return ps_decode_fail("pull reads every peer's records over NVLink, but %d of %d ranks are "
                          "beyond it (lsaSize %d): use push", R - lsa, R, lsa);
  if (!*splits) *splits = ps_decode_splits(cfg, max_shard, *sms);
  const long long items = (long long)cfg->batch * cfg->kv_heads * *splits;
  if (items > INT_MAX)
    return ps_decode_fail("batch %d x kv_heads %d x splits %d = %lld chunks a step: expected at most %d",
                          cfg->batch, cfg->kv_heads, *splits, items, INT_MAX);
  return 0;
}

// Every rank's checks passed and its arguments are the same (the chunk
// count too: GPUs of other SM counts choose others), before the first
// collective; a rank refused here still takes part. 0, or -1 with the reason.
int agree(ncclComm_t comm, const ps_decode_config_t *cfg, int mode, int max_shard, int splits, int valid) {
  static const char *const names[] = {"batch", "q_heads", "kv_heads", "head_dim", "max_context", "max_shard",
                                      "splits (chunks a row; 0 chooses from the GPU's SM count)", "mode"};
  enum { N = sizeof names / sizeof names[0] };
  const int64_t vals[N] = {cfg->batch, cfg->q_heads, cfg->kv_heads, cfg->head_dim, cfg->max_context,
                           max_shard,  splits,        mode};
  char why[256], err[512];
  snprintf(why, sizeof why, "%s", ps_decode_last_error());
  if (ps_op_agree(comm, names, vals, N, valid, why, "perseus_decode", err, sizeof err))
    return ps_decode_fail("%s", err);
  return 0;
}

} // namespace

int perseus_decode_create(ncclComm_t comm, const perseus_decode_config_t *config, int max_shard, int splits,
                          int mode, perseus_decode_t **out) {
  if (!out) return ps_decode_fail("no place for the operator (out is NULL)");
  *out = NULL;
  if (!comm || !config) return ps_decode_fail("no %s", comm ? "config" : "communicator");
  const ps_decode_config_t cfg_in = {config->batch, config->q_heads, config->kv_heads, config->head_dim,
                                     config->max_context},
                           *cfg = &cfg_in;
  int R = 0, rank = 0, sms = 0;
  ncclResult_t rc = ncclCommCount(comm, &R);
  if (rc == ncclSuccess) rc = ncclCommUserRank(comm, &rank);
  if (rc != ncclSuccess) return fail_nccl("ncclCommCount/ncclCommUserRank", rc, comm);
  long long timeout_ms = 0;
  const int valid = local_checks(comm, cfg, R, mode, max_shard, &splits, &timeout_ms, &sms) == 0;
  if (agree(comm, cfg, mode, max_shard, valid ? splits : 0, valid)) return -1;
  const int G = cfg->q_heads / cfg->kv_heads;
  cudaError_t ce = cudaSuccess;
  perseus_decode_t *f = (perseus_decode_t *)calloc(1, sizeof(*f));
  char why[512];
  if (!f) {
    ps_op_all_ready(comm, 0, "perseus_decode", why, sizeof why); // the others are told
    return ps_decode_fail("out of host memory");
  }
  f->comm = comm, f->rank = rank, f->nranks = R, f->mode = mode, f->cfg = *cfg, f->max_shard = max_shard;
  f->timeout_ms = timeout_ms, f->splits = splits;
  f->part = ps_decode_records_floats(cfg, f->splits);
  const int items = cfg->batch * cfg->kv_heads * f->splits;
  f->batch = perseus_batch_whole(items);
  f->smem = ps_decode_dev::partial_smem(G, cfg->head_dim);
  if (f->smem < (kThreads + 32) * sizeof(float)) f->smem = (kThreads + 32) * sizeof(float);
  int per_sm = 0;
  switch (G) {
    case 1: ce = prepare<1>(f->smem, &per_sm); break;
    case 2: ce = prepare<2>(f->smem, &per_sm); break;
    case 4: ce = prepare<4>(f->smem, &per_sm); break;
    case 8: ce = prepare<8>(f->smem, &per_sm); break;
    default: ce = prepare<16>(f->smem, &per_sm); break;
  }
  int err = 0;
  const size_t bytes = 2 * (size_t)R * f->part * sizeof(float);
  if (ce != cudaSuccess) {
    err = ps_decode_fail("sizing the fused kernel's grid (%zu B of shared memory a block): %s", f->smem,
                         cudaGetErrorString(ce));
  } else if (per_sm < 1) {
    err = ps_decode_fail("the fused kernel fits no block on an SM (%zu B of shared memory, %d threads)",
                         f->smem, kThreads);
  } else {
    f->grid = per_sm * sms < items ? per_sm * sms : items;
    if ((rc = ncclMemAlloc(&f->buf, bytes)) != ncclSuccess) {
      err = fail_nccl("ncclMemAlloc (the records window)", rc, comm);
    } else if ((ce = cudaMalloc(&f->local_done, 3 * sizeof(*f->local_done))) != cudaSuccess ||
               (ce = cudaMemset(f->local_done, 0, 3 * sizeof(*f->local_done))) != cudaSuccess) {
      err = ps_decode_fail("the records counter: %s", cudaGetErrorString(ce));
    } else if (ps_fault_alloc(&f->fault, &f->fault_dev, why, sizeof why)) {
      err = ps_decode_fail("%s", why);
    }
  }
  if (ps_op_setup_collective(comm, !err, f->buf, bytes, &f->win, "the records window", attach_dev, f,
                             "perseus_decode", why, sizeof why)) {
    if (why[0]) ps_decode_fail("%s", why);
    err = -1;
  }
  if (err) {
    perseus_decode_destroy(f);
    return -1;
  }
  *out = f;
  return 0;
}

int perseus_decode_splits(const perseus_decode_t *f) { return f ? f->splits : 0; }

int perseus_decode_step(perseus_decode_t *f, float scale, const uint16_t *q, const uint16_t *k,
                         const uint16_t *v, size_t stride, const int *n, uint16_t *out, cudaStream_t st) {
  if (!f) return ps_decode_fail("no operator");
  const void *const ptrs[] = {q, k, v, n, out};
  static const char *const ptr_names[] = {"q", "k", "v", "n", "out"};
  for (int i = 0; i < 5; i++)
    if (!ptrs[i]) return ps_decode_fail("%s is NULL: expected device memory", ptr_names[i]);
  if (((uintptr_t)q | (uintptr_t)k | (uintptr_t)v) % 16)
    return ps_decode_fail("q %p, k %p, v %p: expected 16-byte aligned rows", (const void *)q,
                          (const void *)k, (const void *)v);
  if (stride < 1 || stride > (size_t)f->max_shard)
    return ps_decode_fail("stride %zu: expected 1 to max_shard (%d) tokens", stride, f->max_shard);
  if (ps_fault_any(f->fault)) return fail_fault(f, "an earlier step failed");
  char err[256];
  if (ps_refuse_capture(st, err, sizeof err)) return ps_decode_fail("%s", err);
  const ps_decode_config_t &c = f->cfg;
  const int items = c.batch * c.kv_heads * f->splits;
  fused_args a;
  a.dc = f->dev, a.h = f->h, a.win = f->win;
  a.B = c.batch, a.Hq = c.q_heads, a.Hkv = c.kv_heads, a.D = c.head_dim, a.splits = f->splits;
  a.mode = f->mode, a.scale = scale, a.q = q, a.k = k, a.v = v, a.stride = stride, a.n = n, a.out = out;
  a.part = f->part, a.half = (int)(f->steps % 2), a.batch = f->batch;
  a.total = (f->steps + 1) * (uint64_t)items, a.steps = f->steps + 1, a.local_done = f->local_done;
  a.wb.timeout_ns = (unsigned long long)f->timeout_ms * 1000000ull, a.wb.tag = f->steps + 1, a.wb.fault = f->fault_dev;
  a.wb.state = f->local_done + 1;
  cudaError_t e;
  switch (c.q_heads / c.kv_heads) {
    case 1: e = launch<1>(a, f->grid, f->smem, st); break;
    case 2: e = launch<2>(a, f->grid, f->smem, st); break;
    case 4: e = launch<4>(a, f->grid, f->smem, st); break;
    case 8: e = launch<8>(a, f->grid, f->smem, st); break;
    default: e = launch<16>(a, f->grid, f->smem, st); break;
  }
  if (e != cudaSuccess) return ps_decode_fail("fused kernel launch: %s", cudaGetErrorString(e));
  f->steps++;
  return 0;
}

void perseus_decode_shard(int len, int nranks, int rank, int *start, int *end) {
  ps_decode_shard(len, nranks, rank, start, end);
}

const char *perseus_decode_last_error(void) { return ps_decode_last_error(); }

int perseus_decode_check(const perseus_decode_t *f) {
  if (!f) return ps_decode_fail("no operator");
  return ps_fault_any(f->fault) ? fail_fault(f, "a step failed") : 0;
}

void perseus_decode_abort(perseus_decode_t *f) {
  if (f) ps_fault_abort(f->fault);
}

void perseus_decode_destroy(perseus_decode_t *f) {
  if (!f) return;
  if (f->have_dev) (void)ncclDevCommDestroy(f->comm, &f->dev);
  if (f->win) (void)ncclCommWindowDeregister(f->comm, f->win);
  if (f->buf) (void)ncclMemFree(f->buf);
  if (f->local_done) cudaFree(f->local_done);
  if (f->fault) cudaFreeHost(f->fault);
  free(f);
}
