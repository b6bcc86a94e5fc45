// AllGather+GEMM in one kernel a step (<perseus/ag_gemm.h>): a few blocks
// share this rank's rows of A while the rest compute the tiles of C whose
// rows are already here, every tile waiting only for the ranks its rows
// come from.
#include <cuda.h>
#include <nccl.h>
#include <nccl_device.h>
#include <perseus/device.cuh>
#include <stdlib.h>

#include "ag_gemm_tile.cuh"
#include <perseus/ag_gemm.h>

#include "ps_ag_gemm.h"

namespace {

constexpr size_t kPieceBytes = 64 * 1024; // what one block shares at a time
constexpr int kMaxCommBlocks = 16;
constexpr int kTmaRanks = 8; // pulling from more ranks gathers every row by cp.async

struct ag_args {
  CUtensorMap bmap; // B as [N][K], boxes of ag::kBN rows x ag::kBK
  // A's rows by TMA, in boxes of ag::kBM rows x ag::kBK: amap this rank's
  // shard (the caller's a; set where the shard is not empty), wmap[0] the
  // own window (push) or wmap[s] rank s's (pull, up to kTmaRanks ranks),
  // both halves, [2M][K]. Tiles of rows from both (or, pulling, from two
  // ranks) gather their rows by cp.async instead.
  CUtensorMap amap, wmap[kTmaRanks];
  int wmaps;
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
  unsigned int *tile_done; // splits > 1: per tile and 64-row half, the splits done over every step
};

static_assert(sizeof(ag_args) <= 4000, "the kernel's arguments exceed 4 KiB");

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
  const bool own_copy = a.mode == PERSEUS_AG_GEMM_PULL || a.gin_any;
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
      if (a.mode == PERSEUS_AG_GEMM_PUSH && bytes) pb.store(cta, peer, a.win, off, src, bytes);
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

// A ticket's tile: rows [m0, m0 + mrows) (this rank's own first, then round
// the ranks), columns [n0, n0 + kBN), K steps [kb, kb + nk) of its split.
struct tile_t {
  int tile, m0, mrows, n0, kb, nk;
};

// The tensor map a tile's rows of A come from in one box (and the box's
// first row in it), or NULL where they must be gathered.
__device__ __forceinline__ const CUtensorMap *a_map(const ag_args &a, const tile_t &x, int *row) {
  const int R = a.dc.nRanks, me = a.dc.rank, lo = owner(a.M, R, x.m0), hi = owner(a.M, R, x.m0 + x.mrows - 1);
  if (lo == me && hi == me) return *row = x.m0 - shard_start(a.M, R, me), &a.amap;
  if (lo <= me && me <= hi) return NULL; // own rows and others'
  *row = a.half * a.M + x.m0;
  if (a.mode == PERSEUS_AG_GEMM_PUSH) return &a.wmap[0];
  return lo == hi && lo < a.wmaps ? &a.wmap[lo] : NULL;
}

__device__ __forceinline__ tile_t tile_of(const ag_args &a, int t) {
  const int R = a.dc.nRanks, me = a.dc.rank, r0 = shard_start(a.M, R, me);
  const int mblocks = (a.M + ag::kBM - 1) / ag::kBM, nt = (a.N + ag::kBN - 1) / ag::kBN;
  const int b0 = shard_start(a.M, R, me + 1) > r0 ? r0 / ag::kBM : 0;
  const int ksteps = a.K / ag::kBK, per_split = (ksteps + a.splits - 1) / a.splits;
  tile_t x;
  x.tile = t / a.splits;
  x.m0 = (b0 + x.tile / nt) % mblocks * ag::kBM, x.mrows = min(ag::kBM, a.M - x.m0);
  x.n0 = x.tile % nt * ag::kBN;
  x.kb = t % a.splits * per_split, x.nk = min(ksteps - x.kb, per_split);
  return x;
}

__device__ __forceinline__ int tickets_of(const ag_args &a) {
  return (a.M + ag::kBM - 1) / ag::kBM * ((a.N + ag::kBN - 1) / ag::kBN) * a.splits;
}

// Warp group 0: takes tickets, waits for each tile's rows and streams its
// stages (ag_gemm_tile.cuh). Stages it issued but has not yet reported
// full are `pend`, the oldest first.
__device__ void load_tiles(const ag_args &a, ag::pipe_t &p, uint32_t s0) {
  const int R = a.dc.nRanks, me = a.dc.rank, r0 = shard_start(a.M, R, me), tid = threadIdx.x;
  const int tickets = tickets_of(a);
  const int lc = tid % PS_GEMM_CH, lr = tid / PS_GEMM_CH;
  constexpr int kRowStep = ag::kGroup / PS_GEMM_CH, kChunks = ag::kBM / kRowStep;
  uint32_t it = 0, pend = 0; // stages issued; of them, the newest not yet reported full
  auto report = [&](uint32_t keep) { // stages done but the newest `keep`
    if (pend <= keep) return;
    if (keep == 0) asm volatile("cp.async.wait_group 0;" ::: "memory");
    else asm volatile("cp.async.wait_group %0;" ::"n"(ag::kLag) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); // cp.async wrote them, wgmma reads
    for (; pend > keep; pend--) ag::mbar_arrive(&p.full[(it - pend) % ag::kStages]);
  };
  for (uint32_t i = 0;; i++) {
    report(0); // before a wait that may be long
    const int slot = i & 1;
    if (tid == 0) {
      ps_mbar_wait(ag::smem_addr(&p.slot_empty[slot]), ((i >> 1) & 1) ^ 1);
      // Split K: one ticket a block, the last blocks first (the first ones
      // share the shard), as the splits of a tile wait for each other.
      p.slot[slot].ticket = a.splits == 1 ? (int)atomicAdd(&a.tickets[a.half], 1u)
                            : i == 0      ? (int)(gridDim.x - 1 - blockIdx.x)
                                          : tickets;
    }
    ag::group_sync(1);
    const int t = p.slot[slot].ticket;
    if (t >= tickets) {
      if (tid == 0) ag::mbar_arrive(&p.slot_full[slot]);
      break;
    }
    const tile_t x = tile_of(a, t);
    if (tid == 0) {
      perseus_recv rv(a.dc, a.h);
      const int last = owner(a.M, R, x.m0 + x.mrows - 1);
      for (int s = owner(a.M, R, x.m0); s <= last; s++)
        if (s != me) {
          const uint64_t want = a.step1 * units_from(a, s);
          backoff_until([&] { return rv.poll(s, want); });
        }
      __threadfence();
      p.slot[slot].mrows = x.mrows;
      ag::mbar_arrive(&p.slot_full[slot]);
    }
    int arow = 0;
    const CUtensorMap *amap = a_map(a, x, &arow);
    if (!amap && tid < x.mrows) {
      const int row = x.m0 + tid, s = owner(a.M, R, row);
      const size_t off = row_off(a, row);
      p.rows[tid] =
          x.kb * ag::kBK +
          (s == me ? a.a + (size_t)(row - r0) * a.K
           : a.mode == PERSEUS_AG_GEMM_PULL
               ? (const __nv_bfloat16 *)ncclGetLsaPointer(a.win, off, perseus_lsa_index(a.dc, s))
               : (const __nv_bfloat16 *)ncclGetLocalPointer(a.win, off));
    }
    ag::group_sync(1); // rows[] written after thread 0's wait; read below
    for (int kt = 0; kt < x.nk; kt++) {
      const int st = it % ag::kStages;
      const uint32_t sa = s0 + st * ag::kStageBytes;
      ps_mbar_wait(ag::smem_addr(&p.empty[st]), ((it / ag::kStages) & 1) ^ 1);
      const uint32_t full = ag::smem_addr(&p.full[st]);
      const int k0 = (x.kb + kt) * ag::kBK;
      if (tid == 0) {
        ps_mbar_expect(full, ag::kBBytes + (amap ? ag::kABytes : 0));
        ps_tma_load(sa + ag::kABytes, &a.bmap, k0, x.n0, full);
        if (amap) ps_tma_load(sa, amap, k0, arow, full);
      }
      it++;
      if (amap) { // the box's rows past the tile's are discarded by the epilogue
        ag::mbar_arrive(&p.full[st]);
        continue;
      }
#pragma unroll
      for (int q = 0; q < kChunks; q++) {
        const int r = lr + q * kRowStep;
        const bool ok = r < x.mrows;
        ps_cp_async16(sa + ps_gemm_swz(r, lc), p.rows[ok ? r : 0] + kt * ag::kBK + lc * 8, ok);
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
      pend++;
      report(ag::kLag);
    }
    ag::group_sync(1); // every thread issued this tile's loads before rows[] is rewritten
  }
  report(0);
  // The step ends only once every peer counted this step, those whose rows
  // no tile needed (empty shards) included: so no peer can be two steps
  // ahead, writing a window half this rank may still read.
  if (blockIdx.x == 0 && tid == 0) {
    perseus_recv rv(a.dc, a.h);
    for (int s = 0; s < R; s++)
      if (s != me) {
        const uint64_t want = a.step1 * units_from(a, s);
        backoff_until([&] { return rv.poll(s, want); });
      }
  }
}

// After a split's sums went into its slice of ws: once every split of this
// group's 64 rows stored its slice, each split adds its share of the
// elements over all slices and rounds them into C (a tile's splits run at
// once: split K is used only where the tickets fit the grid). The counts
// grow by `splits` every step, so they are never reset.
__device__ void finish_split(const ag_args &a, int g, int gtid, const tile_t &x, int sp) {
  unsigned int *done = &a.tile_done[2 * x.tile + g];
  __threadfence();
  ag::group_sync(2 + g);
  if (gtid == 0) {
    atomicAdd(done, 1u);
    const unsigned int want = (unsigned int)a.step1 * (unsigned int)a.splits;
    backoff_until([&] { return (int)(*(volatile unsigned int *)done - want) >= 0; });
    __threadfence();
  }
  ag::group_sync(2 + g);
  const int r0 = g * 64, rows = min(64, x.mrows - r0), quads = min(ag::kBN, a.N - x.n0) / 4;
  const size_t slice = (size_t)a.M * a.N;
  for (int i = sp * ag::kGroup + gtid; i < rows * quads; i += a.splits * ag::kGroup) {
    const size_t at = (size_t)(x.m0 + r0 + i / quads) * a.N + x.n0 + 4 * (i % quads);
    float4 u = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int k = 0; k < a.splits; k++) {
      const float4 w = __ldcg((const float4 *)(a.ws + k * slice + at));
      u.x += w.x, u.y += w.y, u.z += w.z, u.w += w.w;
    }
    *(__nv_bfloat162 *)(a.c + at) = __floats2bfloat162_rn(u.x, u.y);
    *(__nv_bfloat162 *)(a.c + at + 2) = __floats2bfloat162_rn(u.z, u.w);
  }
}

// Warp groups 1 and 2 (g = 0, 1): rows [64 g, 64 g + 64) of every tile the
// loader hands over, all kBN columns. A group whose rows are all padding
// (tiles of 64 rows or fewer) multiplies the zeros cp.async filled in:
// behind a branch the compiler cannot prove uniform, every wgmma would be
// serialized.
__device__ void compute_tiles(const ag_args &a, ag::pipe_t &p, uint32_t s0, int g) {
  const int gtid = threadIdx.x - ag::kGroup * (g + 1), warp = gtid / 32, lane = gtid % 32;
  const int tickets = tickets_of(a);
  uint32_t it = 0;
  for (uint32_t i = 0;; i++) {
    const int slot = i & 1;
    ps_mbar_wait(ag::smem_addr(&p.slot_full[slot]), (i >> 1) & 1);
    const ag::slot_t sl = {__shfl_sync(~0u, p.slot[slot].ticket, 0), __shfl_sync(~0u, p.slot[slot].mrows, 0)};
    ag::group_sync(2 + g);
    if (gtid == 0) ag::mbar_arrive(&p.slot_empty[slot]);
    if (sl.ticket >= tickets) break;
    const tile_t x = tile_of(a, sl.ticket);
    float acc[128];
#pragma unroll
    for (int j = 0; j < 128; j++) acc[j] = 0.f;
    for (int kt = 0; kt < x.nk; kt++, it++) {
      const int st = it % ag::kStages;
      const uint32_t sa = s0 + st * ag::kStageBytes;
      ps_mbar_wait(ag::smem_addr(&p.full[st]), (it / ag::kStages) & 1);
      ag::wg_fence();
#pragma unroll
      for (int kk = 0; kk < ag::kBK / 16; kk++)
        ag::ag_wgmma_m64n256(acc, ps_wgmma_desc(sa + g * 64 * ag::kBK * 2 + kk * 32),
                             ps_wgmma_desc(sa + ag::kABytes + kk * 32));
      ag::wg_commit();
      ag::wg_wait<1>(); // the step before is read
      if (kt > 0 && gtid == 0) ag::mbar_arrive(&p.empty[(it - 1) % ag::kStages]);
    }
    ag::wg_wait<0>();
    if (x.nk > 0 && gtid == 0) ag::mbar_arrive(&p.empty[(it - 1) % ag::kStages]);

    const int row0 = g * 64 + warp * 16 + lane / 4, col0 = x.n0 + 2 * (lane % 4);
    float *ws = a.ws + (size_t)(sl.ticket % a.splits) * a.M * a.N;
#pragma unroll
    for (int j = 0; j < 32; j++) {
      const int col = col0 + 8 * j;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int m = row0 + 8 * h;
        if (m >= sl.mrows || col >= a.N) continue;
        const size_t at = (size_t)(x.m0 + m) * a.N + col;
        if (a.splits == 1)
          *(__nv_bfloat162 *)(a.c + at) = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        else
          __stcg((float2 *)(ws + at), make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
      }
    }
    if (a.splits > 1) finish_split(a, g, gtid, x, sl.ticket % a.splits);
  }
}

__global__ void __launch_bounds__(ag::kThreads, 1) ag_gemm_kernel(const __grid_constant__ ag_args a) {
  extern __shared__ __align__(128) char smem[];
  __shared__ ag::pipe_t p;
  const int R = a.dc.nRanks, me = a.dc.rank;
  const int r0 = shard_start(a.M, R, me), mine = shard_start(a.M, R, me + 1) - r0;
  if (threadIdx.x == 0) ag::pipe_init(p);
  if (blockIdx.x == 0 && threadIdx.x == 0) a.tickets[a.half ^ 1] = 0; // the next step's; the last one's ended
  __syncthreads();
  if (blockIdx.x < a.comm_blocks) share_shard(a, r0, mine);
  const uint32_t s0 = (ag::smem_addr(smem) + 1023u) & ~1023u;
  // warp-uniform as far as the compiler can tell (wgmma must not sit in a
  // divergent path), as are the tile's values the compute groups branch on
  const int group = __shfl_sync(~0u, (int)threadIdx.x / ag::kGroup, 0);
  if (group == 0) {
    ag::regs_dec<56>();
    load_tiles(a, p, s0);
  } else {
    ag::regs_inc<224>();
    compute_tiles(a, p, s0, group - 1);
  }
}

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
  unsigned long long *counters; // [0] local_done, [1] the tickets of both halves
  float *ws;
  unsigned int *tile_done;
  encode_fn encode;
  const void *map_of, *amap_of; // the B and A the tensor maps describe
  CUtensorMap map, amap, wmap[kTmaRanks];
  int wmaps;
};

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

int perseus_ag_gemm_create(ncclComm_t comm, const perseus_ag_gemm_shape_t *shape, int mode, perseus_ag_gemm_t **out) {
  if (!out) return ps_ag_gemm_fail("no place for the operator (out is NULL)");
  *out = NULL;
  if (!comm) return ps_ag_gemm_fail("no communicator");
  if (!shape) return ps_ag_gemm_fail("no shape (NULL)");
  const ps_ag_gemm_shape_t shape_in = {shape->m, shape->n, shape->k}, *s = &shape_in;
  int R = 0, rank = 0, dev = 0, sms = 0, per_sm = 0;
  ncclResult_t rc = ncclCommCount(comm, &R);
  if (rc == ncclSuccess) rc = ncclCommUserRank(comm, &rank);
  if (rc != ncclSuccess) return fail_nccl("ncclCommCount/ncclCommUserRank", rc, comm);
  if (ps_ag_gemm_check(s, R)) return -1;
  if (s->k % PS_GEMM_K)
    return ps_ag_gemm_fail("k %d: the fused kernel takes a multiple of %d", s->k, PS_GEMM_K);
  if (mode != PERSEUS_AG_GEMM_PUSH && mode != PERSEUS_AG_GEMM_PULL)
    return ps_ag_gemm_fail("mode %d: expected PERSEUS_AG_GEMM_PUSH (0) or PERSEUS_AG_GEMM_PULL (1)", mode);
  const int lsa = ncclTeamLsa(comm).nRanks;
  if (mode == PERSEUS_AG_GEMM_PULL && lsa != R)
    return ps_ag_gemm_fail("pull reads every peer's rows over NVLink, but %d of %d ranks are beyond it "
                           "(lsaSize %d): use push", R - lsa, R, lsa);
  int cc_major = 0, cc_minor = 0;
  cudaError_t ce = cudaGetDevice(&dev);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (ce == cudaSuccess && (cc_major != 9 || cc_minor != 0))
    return ps_ag_gemm_fail("GPU %d has compute capability %d.%d: the fused kernel is built for 9.0 (sm_90a: "
                           "H100, H200) alone", dev, cc_major, cc_minor);
  if (ce == cudaSuccess) ce = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (ce == cudaSuccess)
    ce = cudaFuncSetAttribute(ag_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ag::kSmem);
  if (ce == cudaSuccess)
    ce = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ag_gemm_kernel, ag::kThreads, ag::kSmem);
  if (ce != cudaSuccess) return ps_ag_gemm_fail("sizing the fused kernel's grid: %s", cudaGetErrorString(ce));
  if (per_sm < 1)
    return ps_ag_gemm_fail("the fused kernel fits no block on an SM (%zu B of shared memory)", ag::kSmem);
  void *fn = NULL;
  cudaDriverEntryPointQueryResult q;
  ce = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
  if (ce != cudaSuccess || !fn || q != cudaDriverEntryPointSuccess)
    return ps_ag_gemm_fail("the CUDA driver has no cuTensorMapEncodeTiled (%s, query result %d): TMA needs a "
                           "driver of CUDA 12.0 or later", cudaGetErrorString(ce), (int)q);
  perseus_ag_gemm_t *f = (perseus_ag_gemm_t *)calloc(1, sizeof(*f));
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
              (ce = cudaMalloc(&f->tile_done, 2 * tiles * sizeof(unsigned int))) != cudaSuccess ||
              (ce = cudaMemset(f->tile_done, 0, 2 * tiles * sizeof(unsigned int))) != cudaSuccess)) {
    err = ps_ag_gemm_fail("the split-K sums (%d splits of %d x %d floats): %s", f->splits, s->m, s->n,
                          cudaGetErrorString(ce));
  } else {
    const char *what = "";
    if ((rc = perseus_batch_devcomm_create(comm, f->gin_any, &f->dev, &f->h, &what)) != ncclSuccess)
      err = fail_nccl(what, rc, comm);
    else
      f->have_dev = 1, err = window_maps(f);
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
  if (!a || !bt || !c) return ps_ag_gemm_fail("a NULL device pointer (a %p, bt %p, c %p)", (const void *)a,
                                              (const void *)bt, (const void *)c);
  if (((uintptr_t)a | (uintptr_t)bt) % 16 || (uintptr_t)c % 4)
    return ps_ag_gemm_fail("a %p, bt %p, c %p: expected a and bt 16-byte aligned, c 4-byte aligned",
                           (const void *)a, (const void *)bt, (const void *)c);
  const ps_ag_gemm_shape_t &s = f->s;
  if (f->map_of != bt) {
    f->map_of = NULL;
    if (encode_map(f, &f->map, bt, s.n, s.k, ag::kBN, "B")) return -1;
    f->map_of = bt;
  }
  int r0, r1;
  ps_ag_gemm_shard(s.m, f->nranks, f->rank, &r0, &r1);
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
  ag_gemm_kernel<<<f->grid, ag::kThreads, ag::kSmem, st>>>(x);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ps_ag_gemm_fail("fused kernel launch: %s", cudaGetErrorString(e));
  f->steps++;
  return 0;
}

void perseus_ag_gemm_shard(int m, int nranks, int rank, int *start, int *end) {
  ps_ag_gemm_shard(m, nranks, rank, start, end);
}

const char *perseus_ag_gemm_last_error(void) { return ps_ag_gemm_last_error(); }

void perseus_ag_gemm_destroy(perseus_ag_gemm_t *f) {
  if (!f) return;
  if (f->have_dev) (void)ncclDevCommDestroy(f->comm, &f->dev);
  if (f->win) (void)ncclCommWindowDeregister(f->comm, f->win);
  if (f->buf) (void)ncclMemFree(f->buf);
  if (f->counters) cudaFree(f->counters);
  if (f->ws) cudaFree(f->ws);
  if (f->tile_done) cudaFree(f->tile_done);
  free(f);
}
