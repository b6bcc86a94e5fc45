// The fused AllGather+GEMM operator (<perseus/ag_gemm.h>) around its kernel
// (ag_gemm_fused.cu): the window, the devcomm, the tensor maps, the grid
// and its split of K, the steps and their faults.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <perseus/ag_gemm.h>

#include "ag_gemm_args.cuh"
#include "ps_ag_gemm.h"
#include "ps_op_host.h"

using namespace agk;

namespace {

typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                              const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

int fail_nccl(const char *what, ncclResult_t rc, ncclComm_t comm) {
  return ps_ag_gemm_fail("%s failed: %s (%s)", what, ncclGetErrorString(rc),
                         comm ? ncclGetLastError(comm) : "");
}

// The base of every rank's window as this GPU maps it (NULL beyond NVLink).
__global__ void window_bases(ncclDevComm dc, ncclWindow_t win, void **out) {
  for (int s = 0; s < dc.nRanks; s++) {
    const int l = perseus_lsa_index(dc, s);
    out[s] = l >= 0 ? ncclGetLsaPointer(win, 0, l) : nullptr;
  }
}

} // namespace

struct perseus_ag_gemm {
  ncclComm_t comm;
  int rank, nranks, mode, grid, comm_blocks, piece_rows, gin_any, have_dev, splits;
  ps_ag_gemm_shape_t s;
  uint32_t batch;
  uint64_t steps;
  void *buf;
  ncclWindow_t win;
  ncclDevComm dev;
  perseus_batch_handle h;
  unsigned long long *counters; // [0] local_done, [1] the tickets of both halves, [2..3] the waits' state
  perseus_wait_fault *fault, *fault_dev; // mapped host memory: the first wait that gave up, or the abort
  long long timeout_ms;                  // PERSEUS_AG_GEMM_TIMEOUT_MS
  float *ws;
  unsigned int *tile_done;
  encode_fn encode;
  const void *map_of, *amap_of; // the B and A the tensor maps describe
  CUtensorMap map, amap, wmap[kTmaRanks];
  int wmaps;
};

// The reason a step gave up, into the operator's error; -1.
static int fail_fault(const perseus_ag_gemm_t *f, const char *when) {
  static const ps_fault_words words = {"perseus_ag_gemm", "PERSEUS_AG_GEMM_TIMEOUT_MS", WAIT_SPLITS,
                                       "split-K partials stored", "rows", "C"};
  char err[512];
  ps_fault_describe(f->fault, &words, f->timeout_ms, when, err, sizeof err);
  return ps_ag_gemm_fail("%s", err);
}

// A bf16 matrix of `rows` x `cols` (cols contiguous) at p, in boxes of
// box_rows x ag::kBK with the 128-byte swizzle the GEMM's stages use.
static int encode_map(perseus_ag_gemm_t *f, CUtensorMap *m, const void *p, int rows, int cols, int box_rows,
                      const char *what) {
  const cuuint64_t dim[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, stride[1] = {(cuuint64_t)cols * 2};
  const cuuint32_t box[2] = {ag::kBK, (cuuint32_t)box_rows}, estride[2] = {1, 1};
  const CUresult r = f->encode(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)p, dim, stride, box, estride,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return ps_ag_gemm_fail("cuTensorMapEncodeTiled failed (CUresult %d) for %s: %d x %d bf16 at %p", (int)r, what,
                           rows, cols, p);
  return 0;
}

// The windows' tensor maps: the own one (push), or every NVLink peer's (pull).
static int window_maps(perseus_ag_gemm_t *f) {
  const int rows = 2 * f->s.m;
  if (f->mode == PERSEUS_AG_GEMM_PUSH) {
    f->wmaps = 1;
    return encode_map(f, &f->wmap[0], f->buf, rows, f->s.k, ag::kBM, "the own window");
  }
  if (f->nranks > kTmaRanks) return 0; // every row by cp.async
  void **bases = NULL, *host[kTmaRanks];
  cudaError_t ce = cudaMalloc(&bases, kTmaRanks * sizeof(void *));
  if (ce == cudaSuccess) {
    window_bases<<<1, 1>>>(f->dev, f->win, bases);
    ce = cudaGetLastError();
  }
  if (ce == cudaSuccess) ce = cudaMemcpy(host, bases, f->nranks * sizeof(void *), cudaMemcpyDeviceToHost);
  if (bases) cudaFree(bases);
  if (ce != cudaSuccess) return ps_ag_gemm_fail("reading the peers' window addresses: %s", cudaGetErrorString(ce));
  for (int r = 0; r < f->nranks; r++)
    if (r != f->rank && encode_map(f, &f->wmap[r], host[r], rows, f->s.k, ag::kBM, "a peer's window")) return -1;
  f->wmaps = f->nranks;
  return 0;
}

// The operator's devcomm (GIN where a peer is beyond NVLink) and its
// windows' tensor maps, after the window: 0, or -1 with the reason recorded.
static int attach_dev(void *op) {
  perseus_ag_gemm_t *f = (perseus_ag_gemm_t *)op;
  const char *what = "";
  const ncclResult_t rc = perseus_batch_devcomm_create(f->comm, f->gin_any, &f->dev, &f->h, &what);
  if (rc != ncclSuccess) return fail_nccl(what, rc, f->comm);
  f->have_dev = 1;
  return window_maps(f);
}

// What create checks on this rank alone: 0, or -1 with the reason. Sets
// the timeout, the SM count, the blocks an SM holds and the TMA encoder.
static int local_checks(ncclComm_t comm, const ps_ag_gemm_shape_t *s, int R, int mode, long long *timeout_ms,
                        int *sms, int *per_sm, void **encode) {
  if (ps_ag_gemm_check(s, R)) return -1;
  if (s->k % PS_GEMM_K)
    return ps_ag_gemm_fail("k %d: the fused kernel takes a multiple of %d", s->k, PS_GEMM_K);
  if (mode != PERSEUS_AG_GEMM_PUSH && mode != PERSEUS_AG_GEMM_PULL)
    return ps_ag_gemm_fail("mode %d: expected PERSEUS_AG_GEMM_PUSH (0) or PERSEUS_AG_GEMM_PULL (1)", mode);
  const int lsa = ncclTeamLsa(comm).nRanks;
  if (mode == PERSEUS_AG_GEMM_PULL && lsa != R)
    return ps_ag_gemm_fail("pull reads every peer's rows over NVLink, but %d of %d ranks are beyond it "
                           "(lsaSize %d): use push", R - lsa, R, lsa);
  if (ps_ag_gemm_env_timeout_ms(timeout_ms)) return -1;
  int dev = 0, cc_major = 0, cc_minor = 0, coop = 0;
  cudaError_t ce = cudaGetDevice(&dev);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (ce == cudaSuccess && (cc_major != 9 || cc_minor != 0))
    return ps_ag_gemm_fail("GPU %d has compute capability %d.%d: the fused kernel is built for 9.0 (sm_90a: "
                           "H100, H200) alone", dev, cc_major, cc_minor);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
  if (ce == cudaSuccess && !coop)
    return ps_ag_gemm_fail("GPU %d has no cooperative launch, which the fused kernel needs", dev);
  if (ce == cudaSuccess) ce = prepare(per_sm);
  if (ce != cudaSuccess) return ps_ag_gemm_fail("sizing the fused kernel's grid: %s", cudaGetErrorString(ce));
  if (*per_sm < 1)
    return ps_ag_gemm_fail("the fused kernel fits no block on an SM (%zu B of shared memory)", ag::kSmem);
  cudaDriverEntryPointQueryResult q;
  ce = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", encode, 12000, cudaEnableDefault, &q);
  if (ce != cudaSuccess || !*encode || q != cudaDriverEntryPointSuccess)
    return ps_ag_gemm_fail("the CUDA driver has no cuTensorMapEncodeTiled (%s, query result %d): TMA needs a "
                           "driver of CUDA 12.0 or later", cudaGetErrorString(ce), (int)q);
  return 0;
}

// Every rank's checks passed and its shape and mode are the same, before the
// first collective; a rank refused here still takes part. 0, or -1.
static int agree(ncclComm_t comm, const ps_ag_gemm_shape_t *s, int mode, int valid) {
  static const char *const names[] = {"m", "n", "k", "mode"};
  enum { N = sizeof names / sizeof names[0] };
  const int64_t vals[N] = {s->m, s->n, s->k, mode};
  char why[256], err[512];
  snprintf(why, sizeof why, "%s", ps_ag_gemm_last_error());
  if (ps_op_agree(comm, names, vals, N, valid, why, "perseus_ag_gemm", err, sizeof err))
    return ps_ag_gemm_fail("%s", err);
  return 0;
}

int perseus_ag_gemm_create(ncclComm_t comm, const perseus_ag_gemm_shape_t *shape, int mode, perseus_ag_gemm_t **out) {
  if (!out) return ps_ag_gemm_fail("no place for the operator (out is NULL)");
  *out = NULL;
  if (!comm) return ps_ag_gemm_fail("no communicator");
  if (!shape) return ps_ag_gemm_fail("no shape (NULL)");
  const ps_ag_gemm_shape_t shape_in = {shape->m, shape->n, shape->k}, *s = &shape_in;
  int R = 0, rank = 0, sms = 0, per_sm = 0;
  ncclResult_t rc = ncclCommCount(comm, &R);
  if (rc == ncclSuccess) rc = ncclCommUserRank(comm, &rank);
  if (rc != ncclSuccess) return fail_nccl("ncclCommCount/ncclCommUserRank", rc, comm);
  long long timeout_ms = 0;
  void *fn = NULL;
  const int valid = local_checks(comm, s, R, mode, &timeout_ms, &sms, &per_sm, &fn) == 0;
  if (agree(comm, s, mode, valid)) return -1;
  const int lsa = ncclTeamLsa(comm).nRanks;
  cudaError_t ce = cudaSuccess;
  perseus_ag_gemm_t *f = (perseus_ag_gemm_t *)calloc(1, sizeof(*f));
  char why[512];
  if (!f) {
    ps_op_all_ready(comm, 0, "perseus_ag_gemm", why, sizeof why); // the others are told
    return ps_ag_gemm_fail("out of host memory");
  }
  int r0, r1;
  ps_ag_gemm_shard(s->m, R, rank, &r0, &r1);
  f->comm = comm, f->rank = rank, f->nranks = R, f->mode = mode, f->s = *s, f->encode = (encode_fn)fn;
  f->gin_any = lsa != R, f->timeout_ms = timeout_ms;
  f->grid = per_sm * sms;
  f->comm_blocks = f->grid < kMaxCommBlocks ? f->grid : kMaxCommBlocks;
  const size_t row_bytes = (size_t)s->k * 2;
  f->piece_rows = row_bytes >= kPieceBytes ? 1 : (int)(kPieceBytes / row_bytes);
  const int pieces = r1 > r0 ? (r1 - r0 + f->piece_rows - 1) / f->piece_rows : 1;
  f->batch = perseus_batch_whole(pieces);
  // K splits where the tiles alone would leave half the grid idle (few rows:
  // the GEMM streams B, and every block should stream a share), at least
  // two k-steps each, their sums (8 bytes an element a split, written and
  // read, mostly in L2) at most B's bytes, then as few as cover the steps
  // evenly
  const int tiles = (s->m + ag::kBM - 1) / ag::kBM * ((s->n + ag::kBN - 1) / ag::kBN), ksteps = s->k / ag::kBK;
  const int tile_rows = s->m < ag::kBM ? s->m : ag::kBM;
  int splits = 2 * tiles <= f->grid ? f->grid / tiles : 1;
  if (splits > ksteps / 2) splits = ksteps / 2;
  if (splits > s->k / (4 * tile_rows)) splits = s->k / (4 * tile_rows);
  if (splits < 1) splits = 1;
  const int per = (ksteps + splits - 1) / splits;
  f->splits = (ksteps + per - 1) / per;
  const size_t bytes = 2 * (size_t)s->m * row_bytes;
  int err = 0;
  if ((rc = ncclMemAlloc(&f->buf, bytes)) != ncclSuccess) {
    err = fail_nccl("ncclMemAlloc (the gathered-A window)", rc, comm);
  } else if ((ce = cudaMalloc(&f->counters, 4 * sizeof(*f->counters))) != cudaSuccess ||
             (ce = cudaMemset(f->counters, 0, 4 * sizeof(*f->counters))) != cudaSuccess) {
    err = ps_ag_gemm_fail("the operator's counters: %s", cudaGetErrorString(ce));
  } else if (ps_fault_alloc(&f->fault, &f->fault_dev, why, sizeof why)) {
    err = ps_ag_gemm_fail("%s", why);
  } else if (f->splits > 1 &&
             ((ce = cudaMalloc(&f->ws, (size_t)f->splits * s->m * s->n * sizeof(float))) != cudaSuccess ||
              (ce = cudaMalloc(&f->tile_done, 2 * tiles * sizeof(unsigned int))) != cudaSuccess ||
              (ce = cudaMemset(f->tile_done, 0, 2 * tiles * sizeof(unsigned int))) != cudaSuccess)) {
    err = ps_ag_gemm_fail("the split-K sums (%d splits of %d x %d floats): %s", f->splits, s->m, s->n,
                          cudaGetErrorString(ce));
  }
  if (ps_op_setup_collective(comm, !err, f->buf, bytes, &f->win, "the gathered-A window", attach_dev, f,
                             "perseus_ag_gemm", why, sizeof why)) {
    if (why[0]) ps_ag_gemm_fail("%s", why);
    err = -1;
  }
  if (err) {
    perseus_ag_gemm_destroy(f);
    return -1;
  }
  *out = f;
  return 0;
}

int perseus_ag_gemm_step(perseus_ag_gemm_t *f, const uint16_t *a, const uint16_t *bt, uint16_t *c,
                          cudaStream_t st) {
  if (!f) return ps_ag_gemm_fail("no operator");
  int r0, r1;
  ps_ag_gemm_shard(f->s.m, f->nranks, f->rank, &r0, &r1);
  if ((!a && r1 > r0) || !bt || !c) // a rank whose shard is empty has no a to pass
    return ps_ag_gemm_fail("a NULL device pointer (a %p for %d rows, bt %p, c %p)", (const void *)a, r1 - r0,
                           (const void *)bt, (const void *)c);
  if (((uintptr_t)a | (uintptr_t)bt) % 16 || (uintptr_t)c % 4)
    return ps_ag_gemm_fail("a %p, bt %p, c %p: expected a and bt 16-byte aligned, c 4-byte aligned",
                           (const void *)a, (const void *)bt, (const void *)c);
  if (ps_fault_any(f->fault)) return fail_fault(f, "an earlier step failed");
  char err[256];
  if (ps_refuse_capture(st, err, sizeof err)) return ps_ag_gemm_fail("%s", err);
  const ps_ag_gemm_shape_t &s = f->s;
  if (f->map_of != bt) {
    f->map_of = NULL;
    if (encode_map(f, &f->map, bt, s.n, s.k, ag::kBN, "B")) return -1;
    f->map_of = bt;
  }
  if (r1 > r0 && f->amap_of != a) {
    f->amap_of = NULL;
    if (encode_map(f, &f->amap, a, r1 - r0, s.k, ag::kBM, "this rank's rows of A")) return -1;
    f->amap_of = a;
  }
  ag_args x;
  x.bmap = f->map, x.amap = f->amap, x.wmaps = f->wmaps, x.dc = f->dev, x.h = f->h, x.win = f->win;
  for (int i = 0; i < f->wmaps; i++) x.wmap[i] = f->wmap[i];
  x.a = (const __nv_bfloat16 *)a, x.c = (__nv_bfloat16 *)c;
  x.M = s.m, x.N = s.n, x.K = s.k, x.mode = f->mode, x.comm_blocks = f->comm_blocks;
  x.piece_rows = f->piece_rows, x.half = (int)(f->steps % 2), x.gin_any = f->gin_any, x.batch = f->batch;
  x.step1 = f->steps + 1, x.local_done = f->counters, x.tickets = (unsigned int *)(f->counters + 1);
  x.splits = f->splits, x.ws = f->ws, x.tile_done = f->tile_done;
  x.wb.timeout_ns = (unsigned long long)f->timeout_ms * 1000000ull, x.wb.tag = f->steps + 1, x.wb.fault = f->fault_dev;
  x.wb.state = f->counters + 2;
  const cudaError_t e = launch(x, f->grid, st);
  if (e != cudaSuccess) return ps_ag_gemm_fail("fused kernel launch: %s", cudaGetErrorString(e));
  f->steps++;
  return 0;
}

void perseus_ag_gemm_shard(int m, int nranks, int rank, int *start, int *end) {
  ps_ag_gemm_shard(m, nranks, rank, start, end);
}

const char *perseus_ag_gemm_last_error(void) { return ps_ag_gemm_last_error(); }

int perseus_ag_gemm_check(const perseus_ag_gemm_t *f) {
  if (!f) return ps_ag_gemm_fail("no operator");
  return ps_fault_any(f->fault) ? fail_fault(f, "a step failed") : 0;
}

void perseus_ag_gemm_abort(perseus_ag_gemm_t *f) {
  if (f) ps_fault_abort(f->fault);
}

void perseus_ag_gemm_destroy(perseus_ag_gemm_t *f) {
  if (!f) return;
  if (f->have_dev) (void)ncclDevCommDestroy(f->comm, &f->dev);
  if (f->win) (void)ncclCommWindowDeregister(f->comm, f->win);
  if (f->buf) (void)ncclMemFree(f->buf);
  if (f->counters) cudaFree(f->counters);
  if (f->fault) cudaFreeHost(f->fault);
  if (f->ws) cudaFree(f->ws);
  if (f->tile_done) cudaFree(f->tile_done);
  free(f);
}
