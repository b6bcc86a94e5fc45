// AllGather+GEMM in one kernel a step (<perseus/ag_gemm.h>): a few blocks
// share this rank's rows of A while the rest compute the tiles of C whose
// rows are already here, every tile waiting only for the ranks its rows
// come from.
#include <perseus/ag_gemm.h>

#include "ag_gemm_args.cuh"

using namespace agk;

namespace {

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
      // A wait that gives up (a peer that never shares) records why and
      // lets the tile go on with stale rows: the step ends, its C is not
      // valid, and the host reads why (perseus_ag_gemm_check).
      perseus_recv rv(a.dc, a.h);
      const int last = owner(a.M, R, x.m0 + x.mrows - 1);
      for (int s = owner(a.M, R, x.m0); s <= last; s++)
        if (s != me) rv.wait_for(s, a.step1 * units_from(a, s), a.wb, WAIT_ROWS);
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
      if (s != me) rv.wait_for(s, a.step1 * units_from(a, s), a.wb, WAIT_STEP_END);
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
    // 32-bit counts: their rolling distance to `want`, carried over to 64 bits
    const unsigned int want = (unsigned int)a.step1 * (unsigned int)a.splits;
    perseus_wait_until(a.wb, a.dc.rank, WAIT_SPLITS, want,
                       [&] { return (uint64_t)want + (int64_t)(int)(*(volatile unsigned int *)done - want); });
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

} // namespace

namespace agk {

cudaError_t prepare(int *per_sm) {
  cudaError_t ce = cudaFuncSetAttribute(ag_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ag::kSmem);
  if (ce == cudaSuccess) ce = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, ag_gemm_kernel, ag::kThreads, ag::kSmem);
  return ce;
}

cudaError_t launch(const ag_args &a, int grid, cudaStream_t st) {
  void *args[] = {(void *)&a};
  return cudaLaunchCooperativeKernel((const void *)ag_gemm_kernel, dim3(grid), dim3(ag::kThreads), args, ag::kSmem, st);
}

} // namespace agk
