/* moe_kernel.cuh: the fused MoE forward, one persistent cooperative kernel.
 *
 * Phases (every CTA, grid barriers only where a whole-rank table is needed):
 *   gate     the gate GEMM on tensor cores (split-K, fp32 atomics).
 *   --- barrier: logits final
 *   route    warp per token: softmax, top-k, weights; each routed row takes
 *            a slot in its (destination, local expert) segment.
 *   --- barrier: segment sizes final
 *   offsets  a warp per destination: segment offsets (for the combine), the
 *            header (row count per expert), put to the destination (control
 *            handle, one signal), and the return-trip total.
 *   dispatch no barrier before it: each CTA scans the segment counts into
 *            its own offset table in shared memory. Every
 *            routed row goes out: NVLink peers by direct stores, one
 *            perseus_batch tile per row on the expert's handle, a signal per
 *            `batch` rows and a flush by the segment's last row; GIN peers
 *            gather into the send window, and the destination's last row
 *            puts all of them at once (rows handle), or (gin_per_expert) the
 *            segment's last row puts the segment in chunks of `batch` rows,
 *            one signal each.
 *   headers  a warp per source: wait for its header, segment table and
 *            the cumulative tile total per (expert, source).
 *   --- barrier with 128-row tiles (the task table needs every expert's
 *       rows); with 64-row tiles each CTA adds itself to a count instead,
 *       and a CTA's first GEMM1 task loads its first weights, then waits
 *       for every CTA.
 *   experts  a queue of tasks claimed in order: every expert's F/64 GEMM1
 *            tiles (W1 and W3 on the same rows, SiLU-gated, bf16 activation),
 *            each starting when that expert's rows from every source arrived,
 *            then every expert's GEMM2 tasks of 128 columns, each starting
 *            when its expert's GEMM1 is done (GEMM2 stores an NVLink
 *            source's rows straight into its window); the last GEMM2 task
 *            of an expert sets its done mark in each NVLink source's
 *            window, puts a GIN source's rows back (gin_per_expert), or,
 *            as the last expert of a GIN source, puts all of its rows.
 *   combine  warp per (token, column group): wait for the token's experts
 *            (an LSA owner's done mark per expert; a GIN owner's returns),
 *            weighted sum of its rows, loads issued together.
 *   --- the CTAs that posted GIN puts flush them; barrier; CTA 0 clears the
 *       per-forward counters and advances the count of forwards, every CTA
 *       the logits.
 * Everything cumulative (tiles per handle, the count of forwards, which the
 * signals and done marks are compared against) stays monotonic across
 * forwards, so nothing is reset that a peer could still be adding to. The
 * count lives on the GPU, not in the launch's arguments, so that a forward
 * replayed from a CUDA graph is counted like a launched one. */
#ifndef PS_MOE_KERNEL_CUH
#define PS_MOE_KERNEL_CUH

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <nccl.h>
#include <nccl_device.h>

#include "moe_args.h"
#include "moe_gemm.cuh"

#define PS_MOE_THREADS PS_GEMM_THREADS
#define PS_MOE_SMEM(BM) PS_GEMM_SMEM(BM)

/* The forward's index (forwards before it): the count in device memory,
 * which only CTA 0 changes, once every read of it in this forward is done
 * (at the end); read-only until then, so read through the non-coherent
 * cache, where uses can reload it rather than hold it in registers. */
__device__ __forceinline__ unsigned long long ps_fwd(const ps_moe_args &a) { return __ldg(a.st.fwd); }

/* Whether this CTA posted a GIN put or signal in this forward: only those
 * CTAs flush the GIN context at the end. A flush covers its own CTA's puts
 * and polls NCCL's queue indexes, in host memory without GDRCopy: every
 * CTA's threads polling them filled PCIe with reads while the plugin
 * staged our last puts (moe_peers.cuh, ps_moe_host_abort). */
__shared__ int ps_gin_posts;
__device__ __forceinline__ void ps_gin_posted() { ps_gin_posts = 1; }

__device__ __forceinline__ unsigned long long ps_now_ns()
{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* One thread per CTA records a phase mark, at time t or now (t = 0), after
 * a __syncthreads of its phase, into `marks`, this forward's half of prof:
 * the CTA's thread 0 keeps it in shared memory, so that the mark before a
 * barrier does not wait on a load of the count of forwards. */
__device__ __forceinline__ void ps_prof(unsigned long long *marks, int slot, bool earliest,
                                        unsigned long long t = 0)
{
  if (threadIdx.x) return;
  if (!t) t = ps_now_ns();
  if (earliest) atomicMin(marks + slot, t);
  else atomicMax(marks + slot, t);
}

/* Adds ns to one of the sums (WAIT, RUN, EXPERTS_END) of this forward, at
 * a fixed address (the third part of prof, not the forward's half): every
 * task adds to them, and a fixed address spares each add finding the half. */
__device__ __forceinline__ void ps_prof_add(const ps_moe_args &a, int slot, unsigned long long ns)
{
  atomicAdd(a.prof + PS_PROF_SUMS + slot, ns);
}

__device__ __forceinline__ ps_bf16 *ps_win_ptr(const ps_moe_args &a, size_t off)
{
  return (ps_bf16 *)ncclGetLocalPointer(a.win, off);
}

/* Byte offset of row `row` of region [peer][P][H] at `base`. */
__device__ __forceinline__ size_t ps_row_off(const ps_moe_args &a, size_t base, int peer, int row)
{
  return base + ((size_t)peer * a.P + row) * a.H * sizeof(ps_bf16);
}

__device__ __forceinline__ float ps_warp_sum(float v)
{
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* ---- route ----------------------------------------------------------------
 * The gate is a GEMM on tensor cores: tasks of 64 tokens x 64 experts x a
 * slice of hidden (split so that there are about two tasks per CTA even at
 * decode sizes), accumulated into fp32 logits with atomics (zeroed at the
 * end of the previous forward). Then a warp per token: softmax, top-k, slots. */
template <int BM>
__device__ void ps_moe_gate(const ps_moe_args &a, char *smem)
{
  __shared__ const ps_bf16 *rows[BM];
  const int mb = (a.T + BM - 1) / BM, nb = (a.E + PS_GEMM_N - 1) / PS_GEMM_N;
  const int ks = (a.H + a.gate_kc - 1) / a.gate_kc;
  for (int task = blockIdx.x; task < mb * nb * ks; task += gridDim.x) {
    int m0 = task / (nb * ks) * BM, e0 = task / ks % nb * PS_GEMM_N;
    int k0 = task % ks * a.gate_kc, kn = min(a.gate_kc, a.H - k0);
    int mrows = min(BM, a.T - m0);
    if (threadIdx.x < mrows) rows[threadIdx.x] = a.x + (size_t)(m0 + threadIdx.x) * a.H + k0;
    __syncthreads();
    const ps_bf16 *b[1] = {a.gate + (size_t)e0 * a.H + k0};
    ps_gemm_tile<BM, 1>(rows, mrows, b, min(PS_GEMM_N, a.E - e0), a.H, kn, smem,
                    [&](int m, int n, float (*v)[2]) {
                      float *lg = a.st.logits + (size_t)(m0 + m) * a.E + e0 + n;
                      /* the pair in one 8-byte atomic where aligned (E even):
                       * half the atomics into the logits */
                      if (e0 + n + 1 < a.E && !(a.E & 1)) {
                        atomicAdd((float2 *)lg, make_float2(v[0][0], v[0][1]));
                      } else {
                        if (e0 + n < a.E) atomicAdd(lg, v[0][0]);
                        if (e0 + n + 1 < a.E) atomicAdd(lg + 1, v[0][1]);
                      }
                    });
    __syncthreads();
  }
}

/* Unsigned keys in the order of the floats (-0 as +0, so that it ties
 * with it), and back: -inf maps above 0. */
__device__ __forceinline__ unsigned ps_order_key(float x)
{
  const unsigned u = __float_as_uint(x == 0.f ? 0.f : x);
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}
__device__ __forceinline__ float ps_key_float(unsigned k)
{
  return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

/* Softmax and top-k of one token's logits lg[0..E) by a warp: lane r < k
 * gets the r-th pick, its id in *pick_e and its softmax weight in *pick_w;
 * every lane gets the sum of the k weights (added in pick order). Ties: the
 * lower id. NaN ranks last (as -inf) but still ranks, and every pick is an
 * id < E whatever the logits hold (k <= E untaken ones exist), so a NaN in
 * the input cannot send a row out of bounds.
 *
 * PER > 0 (E <= 32 PER): lane l holds the logits of experts l + 32 i,
 * sorted once by (value, then lower id) as 64-bit keys, so that each pick is
 * the warp's best head (two redux.sync) and the winner shifts its list.
 * The sort spares every pick a scan of every held logit, a dependent
 * chain of PER compare-and-branch steps.
 * PER = 0 (any E): the logits are read from memory at every pick. */
template <int PER>
__device__ __forceinline__ float ps_topk_token(const float *lg, int E, int k, int lane,
                                               int *pick_e, float *pick_w)
{
  constexpr int N = PER > 0 ? PER : 1;
  float v[N];
  if constexpr (PER > 0) {
#pragma unroll
    for (int i = 0; i < PER; i++) v[i] = lane + 32 * i < E ? lg[lane + 32 * i] : -INFINITY;
  }
  auto logit = [&](int i, int e) -> float {
    if constexpr (PER > 0) return v[i];
    else return lg[e];
  };
  const int passes = PER > 0 ? PER : (E + 31) / 32;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < passes; i++)
    if (lane + 32 * i < E) mx = fmaxf(mx, logit(i, lane + 32 * i));
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float den = 0.f;
#pragma unroll
  for (int i = 0; i < passes; i++)
    if (lane + 32 * i < E) den += __expf(logit(i, lane + 32 * i) - mx);
  den = ps_warp_sum(den);
  /* a candidate as one key, larger is better: the value's order key above
   * the complement of its id; 0: none (every real key is above 0) */
  auto cand = [](float x, int e) -> unsigned long long {
    x = x != x ? -INFINITY : x;
    return (unsigned long long)ps_order_key(x) << 32 | (unsigned)~e;
  };
  int my_e = 0;
  unsigned my_top = 0;
  if constexpr (PER > 0) {
    unsigned long long c[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) c[i] = lane + 32 * i < E ? cand(v[i], lane + 32 * i) : 0ull;
#pragma unroll
    for (int ph = 0; ph < PER; ph++) /* odd-even transposition sort, best first */
#pragma unroll
      for (int i = ph & 1; i + 1 < PER; i += 2) {
        const unsigned long long hi = c[i] > c[i + 1] ? c[i] : c[i + 1];
        c[i + 1] = c[i] > c[i + 1] ? c[i + 1] : c[i], c[i] = hi;
      }
    for (int r = 0; r < k; r++) {
      const unsigned key = (unsigned)(c[0] >> 32);
      const unsigned top = __reduce_max_sync(0xffffffffu, key);
      const int e = (int)__reduce_min_sync(0xffffffffu, key == top ? ~(unsigned)c[0] : ~0u);
      if ((e & 31) == lane) { /* ours: the next one up */
#pragma unroll
        for (int i = 0; i + 1 < PER; i++) c[i] = c[i + 1];
        c[PER - 1] = 0;
      }
      if (lane == r) my_e = e, my_top = top;
    }
  } else {
    int picked[PERSEUS_MOE_MAX_TOPK]; /* warp-uniform */
    for (int r = 0; r < k; r++) {
      unsigned long long best = 0;
      for (int i = 0; i < passes; i++) {
        const int e = lane + 32 * i;
        bool out = e >= E;
        for (int q = 0; q < r; q++) out |= picked[q] == e;
        const unsigned long long c = out ? 0ull : cand(lg[e], e);
        best = c > best ? c : best;
      }
      const unsigned key = (unsigned)(best >> 32);
      const unsigned top = __reduce_max_sync(0xffffffffu, key);
      const int e = (int)__reduce_min_sync(0xffffffffu, key == top ? ~(unsigned)best : ~0u);
      picked[r] = e;
      if (lane == r) my_e = e, my_top = top;
    }
  }
  const float w = lane < k ? __expf(ps_key_float(my_top) - mx) / den : 0.f;
  float wsum = 0.f;
  for (int q = 0; q < k; q++) wsum += __shfl_sync(0xffffffffu, w, q);
  *pick_e = my_e, *pick_w = w;
  return wsum;
}

/* The top-k with the logits in registers where E allows (PER a power of 2). */
__device__ __forceinline__ float ps_topk_pick(const float *lg, int E, int k, int lane, int *e,
                                              float *w)
{
  if (E <= 32) return ps_topk_token<1>(lg, E, k, lane, e, w);
  if (E <= 64) return ps_topk_token<2>(lg, E, k, lane, e, w);
  if (E <= 128) return ps_topk_token<4>(lg, E, k, lane, e, w);
  if (E <= 256) return ps_topk_token<8>(lg, E, k, lane, e, w);
  return ps_topk_token<0>(lg, E, k, lane, e, w);
}

__device__ void ps_moe_topk(const ps_moe_args &a)
{
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5), w0 = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  for (int t = w0; t < a.T; t += warps) {
    int e;
    float w;
    const float wsum = ps_topk_pick(a.st.logits + (size_t)t * a.E, a.E, a.k, lane, &e, &w);
    if (lane < a.k) {
      if (a.renorm) w /= wsum;
      int dst = e / a.L, j = e % a.L;
      a.st.topk_idx[t * a.k + lane] = e;
      a.st.topk_w[t * a.k + lane] = w;
      a.st.slot[t * a.k + lane] = atomicAdd(&a.st.scnt[dst * a.L + j], 1);
    }
  }
}

/* ---- offsets and headers (a warp per peer) ----------------------------------
 * Whether our header goes to dst (the tests may withhold it). */
__device__ __forceinline__ bool ps_moe_hdr_sent(const ps_moe_args &a, int dst)
{
  return a.test_hdr_skip != -2 && a.test_hdr_skip != dst;
}

/*
 * Inclusive prefix sum of v over the warp's lanes. */
__device__ __forceinline__ int ps_warp_scan(int v, int lane)
{
  for (int o = 1; o < 32; o <<= 1) {
    int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

/* Whether rows to and from GIN peer `peer` move in one put each way. */
__device__ __forceinline__ bool ps_gin_whole(const ps_moe_args &a, int peer)
{
  return !a.gin_per_expert && perseus_lsa_index(a.dc, peer) < 0;
}

/* Rows of a (peer, expert) table cnt/off in all: the last segment's end. */
__device__ __forceinline__ int ps_rows_all(const ps_moe_args &a, const int *cnt, const int *off, int peer)
{
  return off[peer * a.L + a.L - 1] + cnt[peer * a.L + a.L - 1];
}

/* Every CTA's own copy of the segment table of our rows: cnt[dst][j] and
 * off[dst][j] (R x L each, in shared memory), from the final counts. One
 * load round and a shared-memory scan per CTA instead of a grid barrier
 * between the offsets and the dispatch: the scan is local to the CTA, a
 * grid barrier holds every CTA until the last one arrives. */
__device__ void ps_moe_seg_table(const ps_moe_args &a, int *cnt, int *off)
{
  const int lane = threadIdx.x & 31, n = a.R * a.L;
  for (int i = threadIdx.x; i < n; i += blockDim.x) cnt[i] = __ldcg(&a.st.scnt[i]);
  __syncthreads();
  for (int dst = threadIdx.x >> 5; dst < a.R; dst += blockDim.x >> 5) { /* warp-uniform */
    int base = 0;
    for (int j0 = 0; j0 < a.L; j0 += 32) {
      const int j = j0 + lane, c = j < a.L ? cnt[dst * a.L + j] : 0, incl = ps_warp_scan(c, lane);
      if (j < a.L) off[dst * a.L + j] = base + incl - c;
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
}

/* From the CTA's segment table (ps_moe_seg_table): the offsets of our rows
 * for destination dst (for the combine), its header (row count per expert),
 * put to it at once, and the returns to expect from it. */
__device__ void ps_moe_offsets(const ps_moe_args &a, int dst, int lane, const int *cnt,
                               const int *off)
{
  int *hdr = (int *)ncclGetLocalPointer(a.win, a.off_hdr_out + (size_t)dst * a.L * sizeof(int));
  int segs = 0;
  for (int j0 = 0; j0 < a.L; j0 += 32) {
    const int j = j0 + lane, c = j < a.L ? cnt[dst * a.L + j] : 0;
    if (j < a.L)
      a.st.soff[dst * a.L + j] = off[dst * a.L + j], hdr[j] = j == a.test_hdr_j ? a.test_hdr_count : c;
    segs += __popc(__ballot_sync(0xffffffffu, c > 0));
  }
  /* a GIN peer returns one put per segment or all at once; an LSA peer
   * marks each expert done instead (off_done) */
  if (lane == 0 && perseus_lsa_index(a.dc, dst) < 0)
    a.st.tot_c[dst] += (uint64_t)(ps_gin_whole(a, dst) ? segs > 0 : segs);
  __syncwarp(); /* the header, written by every lane */
  /* to dst: one tile, one signal; our own header is read where it is
   * (ps_moe_headers, the same warp) */
  if (lane == 0 && dst != a.dc.rank && ps_moe_hdr_sent(a, dst)) {
    if (perseus_lsa_index(a.dc, dst) < 0) __threadfence_system(), ps_gin_posted(); /* for the proxy's read */
    perseus_batch(a.dc, a.hctl, 1)
        .put(ncclCoopThread(), dst, a.win, a.off_hdr_in + (size_t)a.dc.rank * a.L * sizeof(int),
             a.win, a.off_hdr_out + (size_t)dst * a.L * sizeof(int), a.L * sizeof(int));
  }
}

/* Tiles a (peer, expert) segment of `rows` rows takes on the expert's handle:
 * one per row by stores (NVLink), one per chunk of `batch` rows (or one)
 * through GIN, none when the peer's rows come in one put on the rows handle. */
__device__ __forceinline__ uint64_t ps_seg_tiles(const ps_moe_args &a, int peer, int rows)
{
  if (rows == 0 || ps_gin_whole(a, peer)) return 0;
  if (perseus_lsa_index(a.dc, peer) >= 0) return (uint64_t)rows;
  return a.batch ? (uint64_t)((rows + a.batch - 1) / a.batch) : 1;
}

/* ---- dispatch (scnt, soff: the CTA's segment table, ps_moe_seg_table) ---- */
__device__ void ps_moe_dispatch(const ps_moe_args &a, const int *scnt, const int *soff)
{
  const int lane = threadIdx.x & 31;
  const int gtid = blockIdx.x * blockDim.x + threadIdx.x;
  const int warps = gridDim.x * (blockDim.x >> 5), w0 = gtid >> 5;
  const size_t row_bytes = (size_t)a.H * sizeof(ps_bf16);
  ncclCoopWarp warp;
  for (int r = w0; r < a.T * a.k; r += warps) {
    int t = r / a.k, e = a.st.topk_idx[r], dst = e / a.L, j = e % a.L;
    int seg = dst * a.L + j, row = soff[seg] + a.st.slot[r], n = scnt[seg];
    if (dst == a.dc.rank) { /* our own rows are not copied: GEMM1 reads them in x */
      if (lane == 0) a.st.self_tok[row] = t;
      continue;
    }
    if (dst == a.test_rows_skip) continue; /* tests: the rows withheld */
    perseus_batch_handle h = a.st.hexp[j];
    const char *src = (const char *)(a.x + (size_t)t * a.H); /* x itself: no copy in a window */
    const int l = perseus_lsa_index(a.dc, dst);
    if (l >= 0) { /* stored straight into the peer's receive region */
      perseus_batch pb(a.dc, h, a.batch ? (uint32_t)a.batch : 0xffffffffu);
      pb.store(warp, dst, a.win, ps_row_off(a, a.off_recv, a.dc.rank, row), src, row_bytes);
      if (lane == 0 && atomicAdd(&a.st.sdone[seg], 1) == n - 1) pb.flush(dst);
    } else {
      perseus_tile_copy(warp, (char *)ps_win_ptr(a, ps_row_off(a, a.off_send, dst, row)), src,
                        row_bytes);
      __syncwarp();
      if (lane == 0) {
        __threadfence(); /* the row, before it is counted */
        if (ps_gin_whole(a, dst)) {
          const int all = ps_rows_all(a, scnt, soff, dst);
          if (atomicAdd(&a.st.dsent[dst], 1) == all - 1) {
            __threadfence_system(); /* every row to dst is gathered: all in one put */
            ps_gin_posted();
            perseus_batch(a.dc, a.hrows, 1)
                .put(ncclCoopThread(), dst, a.win, ps_row_off(a, a.off_recv, a.dc.rank, 0), a.win,
                     ps_row_off(a, a.off_send, dst, 0), (size_t)all * row_bytes);
          }
        } else if (atomicAdd(&a.st.sdone[seg], 1) == n - 1) { /* the segment is gathered */
          __threadfence_system();
          ps_gin_posted();
          int first = soff[seg], chunk = a.batch ? a.batch : n;
          perseus_batch pb(a.dc, h, 1);
          for (int c = 0; c < n; c += chunk) {
            int m = n - c < chunk ? n - c : chunk;
            pb.put(ncclCoopThread(), dst, a.win, ps_row_off(a, a.off_recv, a.dc.rank, first + c),
                   a.win, ps_row_off(a, a.off_send, dst, first + c), (size_t)m * row_bytes);
          }
        }
      }
      __syncwarp();
    }
  }
}

#include "moe_peers.cuh"
#include "moe_experts.cuh"

#ifndef PS_MOE_MIN_CTAS
#define PS_MOE_MIN_CTAS 2 /* 128 registers a thread; 1 lets ptxas take 160+ */
#endif
/* BM: the GEMM tiles' rows (64 or 128), chosen per forward by the host */
template <int BM>
__global__ void __launch_bounds__(PS_MOE_THREADS, PS_MOE_MIN_CTAS) ps_moe_forward_kernel(const __grid_constant__ ps_moe_args a)
{
  extern __shared__ __align__(128) char smem[];
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  const int gtid = blockIdx.x * blockDim.x + threadIdx.x, gwarp = gtid >> 5, lane = threadIdx.x & 31;
  /* thread 0's: this forward's marks (ps_prof), and the kernel's start,
   * marked once the count of forwards is in (prefetched under the gate) */
  __shared__ unsigned long long *volatile marks, t_start;
  if (threadIdx.x == 0) {
    ps_gin_posts = 0;
    t_start = ps_now_ns();
    asm volatile("prefetch.global.L1 [%0];" ::"l"(a.st.fwd));
  }
  if (blockIdx.x == 0 && threadIdx.x < PS_PROF_N) /* nothing adds to them before the route's barrier */
    a.prof[PS_PROF_SUMS + threadIdx.x] = 0;
  ps_moe_gate<BM>(a, smem);
  if (threadIdx.x == 0) marks = a.prof + (ps_fwd(a) & 1) * PS_PROF_N;
  ps_prof(marks, PS_PROF_START, true, t_start);
  if (gtid == 0) {
    marks[PS_PROF_WGMMA] = 1 + PS_GEMM_WGMMA, marks[PS_PROF_TOKENS] = a.T;
    marks[PS_PROF_TILE_ROWS] = BM, marks[PS_PROF_GRID] = gridDim.x;
  }
  grid.sync();
  ps_moe_topk(a);
  __syncthreads();
  ps_prof(marks, PS_PROF_ROUTE, false);
  grid.sync();
  { /* the segment table in the dynamic shared memory, free until the experts */
    int *scnt = (int *)smem, *soff = scnt + a.R * a.L;
    ps_moe_seg_table(a, scnt, soff);
    if (gwarp < a.R) ps_moe_offsets(a, gwarp, lane, scnt, soff); /* warp-uniform */
    ps_moe_dispatch(a, scnt, soff);
  }
  __syncthreads();
  ps_prof(marks, PS_PROF_DISPATCH, false);
  if (gwarp < a.R) ps_moe_headers(a, gwarp, lane);
  if constexpr (PS_MOE_TILED(BM)) { /* the task table needs every expert's rows at once */
    grid.sync();
    ps_prof(marks, PS_PROF_HEADERS, true);
  } else { /* no grid barrier: a CTA's first GEMM1 task waits for the count, under its
            * first weights' loads (ps_moe_experts) */
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(a.st.ready, 1);
    }
  }
  const unsigned long long t_ready = ps_moe_experts<BM>(a, smem);
  if (t_ready) ps_prof(marks, PS_PROF_HEADERS, true, t_ready); /* the earliest CTA past its wait */
  ps_prof(marks, PS_PROF_EXPERTS, false);
  ps_moe_combine(a);
  __syncthreads();
  ps_prof(marks, PS_PROF_COMBINE, false);
  if (ps_gin_posts) { /* no put of ours outlives the kernel (CTA-uniform: read past a barrier) */
    ncclGin gin{a.dc, 0};
    gin.flush(ncclCoopCta());
  }
  grid.sync();
  if (blockIdx.x == 0) { /* the per-forward counters and marks, for the next forward */
    for (int i = threadIdx.x; i < a.R * a.L; i += blockDim.x) a.st.scnt[i] = 0, a.st.sdone[i] = 0;
    for (int i = threadIdx.x; i < a.R; i += blockDim.x) a.st.dsent[i] = 0, a.st.rdone[i] = 0;
    for (int i = threadIdx.x; i < a.L; i += blockDim.x) a.st.g1done[i] = 0, a.st.g2done[i] = 0;
    if (threadIdx.x == 0) *a.st.task = 0, *a.st.ready = 0;
    const unsigned long long fwd = ps_fwd(a);
    unsigned long long *next = a.prof + ((fwd + 1) & 1) * PS_PROF_N;
    if (threadIdx.x < PS_PROF_N)
      next[threadIdx.x] = threadIdx.x == PS_PROF_START || threadIdx.x == PS_PROF_HEADERS ? ~0ull : 0;
    __syncthreads(); /* the other CTAs read the count for the last time before the grid
                      * barrier above, this one before this barrier */
    if (threadIdx.x == 0) *a.st.fwd = fwd + 1;
  }
  /* the logits the next forward's gate accumulates into */
  for (size_t i = gtid; i < (size_t)a.T * a.E; i += (size_t)gridDim.x * blockDim.x)
    a.st.logits[i] = 0.f;
}

#endif
