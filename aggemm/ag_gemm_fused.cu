// AllGather+GEMM in one kernel a step (ps_ag_gemm_fused.h): a few blocks
// share this rank's rows of A while the rest compute the tiles of C whose
// rows are already here, every tile waiting only for the ranks its rows
// come from.
#include <cuda.h>
#include <nccl.h>
#include <nccl_device.h>
#include <perseus/device.cuh>
#include <stdlib.h>

#include "moe_gemm.cuh"
#include "ps_ag_gemm_fused.h"

namespace {

constexpr int kBM = 128;                  // rows of a tile of C
constexpr int kBN = 2 * PS_GEMM_N;        // its columns: the GEMM tile's two matrices side by side
constexpr size_t kSmem = PS_GEMM_SMEM(kBM);
constexpr size_t kPieceBytes = 64 * 1024; // what one block shares at a time
constexpr int kMaxCommBlocks = 16;

struct ag_args {
  CUtensorMap bmap; // B as [N][K], boxes of PS_GEMM_N rows x PS_GEMM_K
  ncclDevComm dc;
  perseus_batch_handle h;
  ncclWindow_t win;
  const __nv_bfloat16 *a;
  __nv_bfloat16 *c;
  int M, N, K, mode, comm_blocks, piece_rows, half, gin_any;
  uint32_t batch;        // this rank's pieces per LSA signal
  uint64_t step1;        // steps so far, this one included
  unsigned long long *local_done; // this rank's pieces shared, over every step (GIN only)
  unsigned int *tickets; // [2]: the tiles handed out in the steps of each window half
  int splits;            // K splits a tile (1: none); more where tiles alone leave SMs idle
  float *ws;             // splits > 1: each split's sums in fp32, [splits][M][N]
  unsigned int *tile_done; // splits > 1: the splits of each tile done (zero between steps)
};

__device__ __forceinline__ int shard_start(int m, int R, int r) { return (int)((long long)m * r / R); }

// The rank whose shard holds `row`: the last one whose shard starts at or before it.
__device__ __forceinline__ int owner(int m, int R, int row) {
  return (int)(((long long)(row + 1) * R + m - 1) / m) - 1;
}

__device__ __forceinline__ int pieces_of(int rows, int per) { return rows > 0 ? (rows + per - 1) / per : 0; }

// What this rank counts from source s each step: one put (GIN), or s's
// pieces, an empty shard still one, so that no rank can run two steps ahead
// of a peer that may still read the window half it would write.
__device__ __forceinline__ uint64_t units_from(const ag_args &a, int s) {
  if (perseus_lsa_index(a.dc, s) < 0) return 1;
  const int R = a.dc.nRanks;
  return (uint64_t)max(1, pieces_of(shard_start(a.M, R, s + 1) - shard_start(a.M, R, s), a.piece_rows));
}

template <typename Done>
__device__ void backoff_until(Done done) {
  for (unsigned ns = 32; !done(); ns = ns < 1024 ? 2 * ns : ns) __nanosleep(ns);
}

__device__ __forceinline__ size_t row_off(const ag_args &a, int row) {
  return ((size_t)a.half * a.M + row) * a.K * sizeof(__nv_bfloat16);
}

// This block's pieces of the shard (rows [r0, r0 + mine)): into every
// NVLink peer's window (push) or the own one, counted for every peer (pull);
// peers beyond NVLink get the whole shard in one put from the own window,
// from the block that shares the last piece.
__device__ void share_shard(const ag_args &a, int r0, int mine) {
  const int R = a.dc.nRanks, me = a.dc.rank, pieces = max(1, pieces_of(mine, a.piece_rows));
  const bool own_copy = a.mode == PS_AG_GEMM_PULL || a.gin_any;
  perseus_batch pb(a.dc, a.h, a.batch);
  for (int p = blockIdx.x; p < pieces; p += a.comm_blocks) {
    const int lo = p * a.piece_rows, n = min(a.piece_rows, mine - lo);
    const size_t off = row_off(a, r0 + lo), bytes = n > 0 ? (size_t)n * a.K * sizeof(__nv_bfloat16) : 0;
    const char *src = (const char *)(a.a + (size_t)lo * a.K);
    ncclCoopCta cta;
    if (own_copy && bytes) perseus_tile_copy(cta, (char *)ncclGetLocalPointer(a.win, off), src, bytes);
    __syncthreads();
    for (int j = 1; j < R; j++) {
      const int peer = (me + j) % R;
      if (perseus_lsa_index(a.dc, peer) < 0) continue;
      if (a.mode == PS_AG_GEMM_PUSH && bytes) pb.store(cta, peer, a.win, off, src, bytes);
      else if (threadIdx.x == 0) pb.stored(peer); // pull: the peer reads it here
    }
    if (a.gin_any && threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(a.local_done, 1ULL) + 1 == a.step1 * pieces) {
        __threadfence();
        // The source half is written again two steps on, after this put's
        // signal let every peer finish this step: it has been read by then.
        perseus_batch whole(a.dc, a.h, 1);
        const size_t from = row_off(a, r0), all = (size_t)mine * a.K * sizeof(__nv_bfloat16);
        for (int j = 1; j < R; j++) {
          const int peer = (me + j) % R;
          if (perseus_lsa_index(a.dc, peer) >= 0) continue;
          if (mine) whole.put(ncclCoopThread(), peer, a.win, from, a.win, from, all);
          else whole.stored(peer);
        }
      }
    }
    __syncthreads();
  }
}

// After a split's sums went into its slice of ws: the tile's last split
// adds the slices, rounds into C and leaves the tile's count at zero for the
// next step.
__device__ void finish_split(const ag_args &a, int tile, int m0, int mrows, int n0, bool *last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(&a.tile_done[tile], 1u) == (unsigned)a.splits - 1;
  __syncthreads();
  if (!*last) return;
  __threadfence();
  const int pairs = min(kBN, a.N - n0) / 2;
  for (int i = threadIdx.x; i < mrows * pairs; i += blockDim.x) {
    const size_t at = (size_t)(m0 + i / pairs) * a.N + n0 + 2 * (i % pairs), slice = (size_t)a.M * a.N;
    float x = 0.f, y = 0.f;
    for (int sp = 0; sp < a.splits; sp++) {
      const float2 v = __ldcg((const float2 *)(a.ws + sp * slice + at));
      x += v.x, y += v.y;
    }
    *(__nv_bfloat162 *)(a.c + at) = __floats2bfloat162_rn(x, y);
  }
  if (threadIdx.x == 0) a.tile_done[tile] = 0;
}

__global__ void __launch_bounds__(PS_GEMM_THREADS, 2) ag_gemm_kernel(const __grid_constant__ ag_args a) {
  extern __shared__ __align__(128) char smem[];
  __shared__ const __nv_bfloat16 *rows[kBM];
  __shared__ unsigned int ticket;
  __shared__ bool last_split;
  const int R = a.dc.nRanks, me = a.dc.rank;
  const int r0 = shard_start(a.M, R, me), mine = shard_start(a.M, R, me + 1) - r0;
  if (blockIdx.x == 0 && threadIdx.x == 0) a.tickets[a.half ^ 1] = 0; // the next step's; the last one's ended
  if (blockIdx.x < a.comm_blocks) share_shard(a, r0, mine);

  // Tiles in the order their rows arrive: this rank's own first (read from
  // a itself), then round the ranks.
  const int mblocks = (a.M + kBM - 1) / kBM, nt = (a.N + kBN - 1) / kBN, tiles = mblocks * nt;
  const int ksteps = a.K / PS_GEMM_K, per_split = (ksteps + a.splits - 1) / a.splits;
  const int b0 = mine > 0 ? r0 / kBM : 0;
  perseus_recv rv(a.dc, a.h);
  for (;;) {
    if (threadIdx.x == 0) ticket = atomicAdd(&a.tickets[a.half], 1u);
    __syncthreads();
    const int t = (int)ticket;
    __syncthreads(); // read by all before the next ticket
    if (t >= tiles * a.splits) break;
    const int tile = t / a.splits, m0 = (b0 + tile / nt) % mblocks * kBM, n0 = tile % nt * kBN;
    const int mrows = min(kBM, a.M - m0), kb = t % a.splits * per_split * PS_GEMM_K;
    ps_gemm_b<2> bs = {};
    bs.map[0] = bs.map[1] = &a.bmap;
    bs.row[0] = n0, bs.row[1] = n0 + PS_GEMM_N, bs.kbase = kb;
    auto prep = [&]() -> int {
      if (threadIdx.x == 0) {
        const int last = owner(a.M, R, m0 + mrows - 1);
        for (int s = owner(a.M, R, m0); s <= last; s++)
          if (s != me) {
            const uint64_t want = a.step1 * units_from(a, s);
            backoff_until([&] { return rv.poll(s, want); });
          }
        __threadfence();
      }
      __syncthreads();
      if (threadIdx.x < mrows) {
        const int row = m0 + threadIdx.x, s = owner(a.M, R, row);
        const size_t off = row_off(a, row);
        rows[threadIdx.x] =
            kb + (s == me ? a.a + (size_t)(row - r0) * a.K
                  : a.mode == PS_AG_GEMM_PULL
                      ? (const __nv_bfloat16 *)ncclGetLsaPointer(a.win, off, perseus_lsa_index(a.dc, s))
                      : (const __nv_bfloat16 *)ncclGetLocalPointer(a.win, off));
      }
      __syncthreads();
      return mrows;
    };
    const int kn = min(a.K - kb, per_split * PS_GEMM_K);
    ps_gemm_tile_prep<kBM, 2, true>(prep, rows, bs, kn, smem, [&](int m, int cc, float(*v)[2]) {
      const size_t at = (size_t)(m0 + m) * a.N;
#pragma unroll
      for (int i = 0; i < 2; i++) {
        const int col = n0 + i * PS_GEMM_N + cc;
        if (col >= a.N) continue;
        if (a.splits == 1) {
          *(__nv_bfloat162 *)(a.c + at + col) = __floats2bfloat162_rn(v[i][0], v[i][1]);
        } else {
          __stcg((float2 *)(a.ws + (size_t)(t % a.splits) * a.M * a.N + at + col), make_float2(v[i][0], v[i][1]));
        }
      }
    });
    if (a.splits > 1) finish_split(a, tile, m0, mrows, n0, &last_split);
  }
  // The step ends only once every peer counted this step, those whose rows
  // no tile needed (empty shards) included: so no peer can be two steps
  // ahead, writing a window half this rank may still read.
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (int s = 0; s < R; s++)
      if (s != me) {
        const uint64_t want = a.step1 * units_from(a, s);
        backoff_until([&] { return rv.poll(s, want); });
      }
}

typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                              const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

int fail_nccl(const char *what, ncclResult_t rc, ncclComm_t comm) {
  return ps_ag_gemm_fail("%s failed: %s (%s)", what, ncclGetErrorString(rc),
                         comm ? ncclGetLastError(comm) : "");
}


} // namespace

struct ps_ag_gemm_fused {
  ncclComm_t comm;
  int rank, nranks, mode, grid, comm_blocks, piece_rows, gin_any, have_dev, splits;
  ps_ag_gemm_shape_t s;
  uint32_t batch;
  uint64_t steps;
  void *buf;
  ncclWindow_t win;
  ncclDevComm dev;
  perseus_batch_handle h;
  unsigned long long *counters; // [0] local_done, [1] the tickets of both halves
  float *ws;
  unsigned int *tile_done;
  encode_fn encode;
  const void *map_of; // the B the tensor map describes
  CUtensorMap map;
};

int ps_ag_gemm_fused_create(ncclComm_t comm, const ps_ag_gemm_shape_t *s, int mode, ps_ag_gemm_fused_t **out) {
  if (!out) return ps_ag_gemm_fail("no place for the operator (out is NULL)");
  *out = NULL;
  if (!comm) return ps_ag_gemm_fail("no communicator");
  int R = 0, rank = 0, dev = 0, sms = 0, per_sm = 0;
  ncclResult_t rc = ncclCommCount(comm, &R);
  if (rc == ncclSuccess) rc = ncclCommUserRank(comm, &rank);
  if (rc != ncclSuccess) return fail_nccl("ncclCommCount/ncclCommUserRank", rc, comm);
  if (ps_ag_gemm_check(s, R)) return -1;
  if (s->k % PS_GEMM_K)
    return ps_ag_gemm_fail("k %d: the fused kernel takes a multiple of %d", s->k, PS_GEMM_K);
  if (mode != PS_AG_GEMM_PUSH && mode != PS_AG_GEMM_PULL)
    return ps_ag_gemm_fail("mode %d: expected PS_AG_GEMM_PUSH (0) or PS_AG_GEMM_PULL (1)", mode);
  const int lsa = ncclTeamLsa(comm).nRanks;
  if (mode == PS_AG_GEMM_PULL && lsa != R)
    return ps_ag_gemm_fail("pull reads every peer's rows over NVLink, but %d of %d ranks are beyond it "
                           "(lsaSize %d): use push", R - lsa, R, lsa);
  cudaError_t ce = cudaGetDevice(&dev);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (ce == cudaSuccess)
    ce = cudaFuncSetAttribute(ag_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem);
  if (ce == cudaSuccess)
    ce = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ag_gemm_kernel, PS_GEMM_THREADS, kSmem);
  if (ce != cudaSuccess) return ps_ag_gemm_fail("sizing the fused kernel's grid: %s", cudaGetErrorString(ce));
  if (per_sm < 1)
    return ps_ag_gemm_fail("the fused kernel fits no block on an SM (%zu B of shared memory)", kSmem);
  void *fn = NULL;
  cudaDriverEntryPointQueryResult q;
  ce = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
  if (ce != cudaSuccess || !fn || q != cudaDriverEntryPointSuccess)
    return ps_ag_gemm_fail("the CUDA driver has no cuTensorMapEncodeTiled (%s, query result %d): TMA needs a "
                           "driver of CUDA 12.0 or later", cudaGetErrorString(ce), (int)q);
  ps_ag_gemm_fused_t *f = (ps_ag_gemm_fused_t *)calloc(1, sizeof(*f));
  if (!f) return ps_ag_gemm_fail("out of host memory");
  int r0, r1;
  ps_ag_gemm_shard(s->m, R, rank, &r0, &r1);
  f->comm = comm, f->rank = rank, f->nranks = R, f->mode = mode, f->s = *s, f->encode = (encode_fn)fn;
  f->gin_any = lsa != R;
  f->grid = per_sm * sms;
  f->comm_blocks = f->grid < kMaxCommBlocks ? f->grid : kMaxCommBlocks;
  const size_t row_bytes = (size_t)s->k * 2;
  f->piece_rows = row_bytes >= kPieceBytes ? 1 : (int)(kPieceBytes / row_bytes);
  const int pieces = r1 > r0 ? (r1 - r0 + f->piece_rows - 1) / f->piece_rows : 1;
  f->batch = perseus_batch_whole(pieces);
  // K splits where the tiles alone would leave half the grid idle (few rows:
  // the GEMM streams B, and every block should stream a share), at least
  // two k-steps each, their sums (8 bytes an element a split, written and
  // read) at most a quarter of B's bytes, then as few as cover the steps
  // evenly
  const int tiles = (s->m + kBM - 1) / kBM * ((s->n + kBN - 1) / kBN), ksteps = s->k / PS_GEMM_K;
  const int tile_rows = s->m < kBM ? s->m : kBM;
  int splits = 2 * tiles <= f->grid ? f->grid / tiles : 1;
  if (splits > ksteps / 2) splits = ksteps / 2;
  if (splits > s->k / (16 * tile_rows)) splits = s->k / (16 * tile_rows);
  if (splits < 1) splits = 1;
  const int per = (ksteps + splits - 1) / splits;
  f->splits = (ksteps + per - 1) / per;
  const size_t bytes = 2 * (size_t)s->m * row_bytes;
  int err = 0;
  if ((rc = ncclMemAlloc(&f->buf, bytes)) != ncclSuccess) {
    err = fail_nccl("ncclMemAlloc (the gathered-A window)", rc, comm);
  } else if ((rc = ncclCommWindowRegister(comm, f->buf, bytes, &f->win, NCCL_WIN_COLL_SYMMETRIC)) !=
             ncclSuccess) {
    err = fail_nccl("ncclCommWindowRegister (the gathered-A window)", rc, comm);
  } else if (!f->win) {
    err = ps_ag_gemm_fail("ncclCommWindowRegister gave no window: NCCL has no symmetric memory on this "
                          "communicator");
  } else if ((ce = cudaMalloc(&f->counters, 2 * sizeof(*f->counters))) != cudaSuccess ||
             (ce = cudaMemset(f->counters, 0, 2 * sizeof(*f->counters))) != cudaSuccess) {
    err = ps_ag_gemm_fail("the operator's counters: %s", cudaGetErrorString(ce));
  } else if (f->splits > 1 &&
             ((ce = cudaMalloc(&f->ws, (size_t)f->splits * s->m * s->n * sizeof(float))) != cudaSuccess ||
              (ce = cudaMalloc(&f->tile_done, tiles * sizeof(unsigned int))) != cudaSuccess ||
              (ce = cudaMemset(f->tile_done, 0, tiles * sizeof(unsigned int))) != cudaSuccess)) {
    err = ps_ag_gemm_fail("the split-K sums (%d splits of %d x %d floats): %s", f->splits, s->m, s->n,
                          cudaGetErrorString(ce));
  } else {
    const char *what = "";
    if ((rc = perseus_batch_devcomm_create(comm, f->gin_any, &f->dev, &f->h, &what)) != ncclSuccess)
      err = fail_nccl(what, rc, comm);
    else
      f->have_dev = 1;
  }
  if (err) {
    ps_ag_gemm_fused_destroy(f);
    return -1;
  }
  *out = f;
  return 0;
}

int ps_ag_gemm_fused_step(ps_ag_gemm_fused_t *f, const uint16_t *a, const uint16_t *bt, uint16_t *c,
                          cudaStream_t st) {
  if (!f) return ps_ag_gemm_fail("no operator");
  if (!a || !bt || !c) return ps_ag_gemm_fail("a NULL device pointer (a %p, bt %p, c %p)", (const void *)a,
                                              (const void *)bt, (const void *)c);
  if (((uintptr_t)a | (uintptr_t)bt) % 16 || (uintptr_t)c % 4)
    return ps_ag_gemm_fail("a %p, bt %p, c %p: expected a and bt 16-byte aligned, c 4-byte aligned",
                           (const void *)a, (const void *)bt, (const void *)c);
  const ps_ag_gemm_shape_t &s = f->s;
  if (f->map_of != bt) {
    const cuuint64_t dim[2] = {(cuuint64_t)s.k, (cuuint64_t)s.n}, stride[1] = {(cuuint64_t)s.k * 2};
    const cuuint32_t box[2] = {PS_GEMM_K, PS_GEMM_N}, estride[2] = {1, 1};
    const CUresult r = f->encode(&f->map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)bt, dim, stride, box,
                                 estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      f->map_of = NULL;
      return ps_ag_gemm_fail("cuTensorMapEncodeTiled failed (CUresult %d) for B: %d x %d bf16 at %p", (int)r,
                             s.n, s.k, (const void *)bt);
    }
    f->map_of = bt;
  }
  ag_args x;
  x.bmap = f->map, x.dc = f->dev, x.h = f->h, x.win = f->win;
  x.a = (const __nv_bfloat16 *)a, x.c = (__nv_bfloat16 *)c;
  x.M = s.m, x.N = s.n, x.K = s.k, x.mode = f->mode, x.comm_blocks = f->comm_blocks;
  x.piece_rows = f->piece_rows, x.half = (int)(f->steps % 2), x.gin_any = f->gin_any, x.batch = f->batch;
  x.step1 = f->steps + 1, x.local_done = f->counters, x.tickets = (unsigned int *)(f->counters + 1);
  x.splits = f->splits, x.ws = f->ws, x.tile_done = f->tile_done;
  ag_gemm_kernel<<<f->grid, PS_GEMM_THREADS, kSmem, st>>>(x);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ps_ag_gemm_fail("fused kernel launch: %s", cudaGetErrorString(e));
  f->steps++;
  return 0;
}

void ps_ag_gemm_fused_destroy(ps_ag_gemm_fused_t *f) {
  if (!f) return;
  if (f->have_dev) (void)ncclDevCommDestroy(f->comm, &f->dev);
  if (f->win) (void)ncclCommWindowDeregister(f->comm, f->win);
  if (f->buf) (void)ncclMemFree(f->buf);
  if (f->counters) cudaFree(f->counters);
  if (f->ws) cudaFree(f->ws);
  if (f->tile_done) cudaFree(f->tile_done);
  free(f);
}
