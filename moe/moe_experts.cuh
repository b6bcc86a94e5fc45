/* moe_experts.cuh: the expert FFN task queue and the combine of the fused
 * MoE kernel (included by moe_kernel.cuh).
 *
 * Rows of local expert j are the segments (src, j) of the receive window,
 * src = 0..R-1: row m of the expert is row roff[src][j] + (m - rows of the
 * earlier sources) of region src; our own rows (src = us) are read in x
 * instead, through self_tok. Activation rows keep the same global index
 * g = src * P + row in `act`. Output rows go to the source's combine region
 * at row `row` directly when the source is an LSA peer or us, else to the y
 * window at g, so that a GIN source's segment is contiguous and returns in
 * one put. */
#ifndef PS_MOE_EXPERTS_CUH
#define PS_MOE_EXPERTS_CUH

/* Whether the kernel with BM-row tiles runs row-tile tasks (ps_moe_experts),
 * and the most local experts it takes (the host uses 64-row tiles above) */
#define PS_MOE_TILED(BM) ((BM) == 128)
#define PS_MOE_TILED_MAX_L 512

/* Gathered row indices g of rows m0 .. m0+BM-1 of expert j; returns how
 * many (0 when m0 is past its rows) and sets *total, its rows from every
 * source. Warp 0 reads the segments of 32 sources at a time (one load
 * round: counts and offsets together) into a prefix table that each row's
 * thread then searches, instead of each thread walking the sources' counts
 * one dependent load after another; the same round gives the total. */
template <int BM>
__device__ int ps_expert_rows(const ps_moe_args &a, int j, int m0, int *g, int *total)
{
  __shared__ int beg[33], off[32]; /* beg[i]: rows before chunk source i; beg[32]: the chunk's end */
  const int lane = threadIdx.x & 31, r = m0 + (int)threadIdx.x;
  int base = 0; /* rows of the sources before the chunk */
  for (int s0 = 0; s0 < a.R; s0 += 32) { /* uniform */
    __syncthreads(); /* the previous chunk's table is read */
    if (threadIdx.x < 32) {
      const int s = s0 + lane, c = s < a.R ? a.st.rcnt[s * a.L + j] : 0;
      const int o = s < a.R ? a.st.roff[s * a.L + j] : 0;
      beg[lane + 1] = base + ps_warp_scan(c, lane);
      off[lane] = o;
      if (lane == 0) beg[0] = base;
    }
    __syncthreads();
    if (threadIdx.x < BM && r >= beg[0] && r < beg[32]) {
      int i = 0;
      while (r >= beg[i + 1]) i++;
      g[threadIdx.x] = (s0 + i) * a.P + off[i] + (r - beg[i]);
    }
    base = beg[32];
  }
  __syncthreads();
  *total = base;
  return max(0, min(BM, base - m0));
}

__device__ __forceinline__ void ps_spin_until(const int *ctr, int want)
{
  while (*(const volatile int *)ctr < want) {
  }
  __threadfence();
}

/* Thread 0 waits until every CTA is past its dispatch and headers: the
 * rows' tables (rcnt, roff, self_tok, the signal counts) are complete, and
 * returns when. */
__device__ __forceinline__ unsigned long long ps_wait_ready(const ps_moe_args &a)
{
  ps_spin_until(a.st.ready, (int)gridDim.x);
  return ps_now_ns();
}

/* GEMM1 tile n0..n0+63 of expert j, its row tile mt (tiled kernel) or all
 * of its rows: act = silu(X W1^T) * (X W3^T). The first weights are loaded while
 * the rows are awaited and looked up, and, for the CTA's first task of the
 * untiled kernel (t_ready set), while the dispatch ends (ps_wait_ready, its
 * time in *t_ready). */
template <int BM>
__device__ void ps_expert_gemm1(const ps_moe_args &a, int j, int n0, int mt, char *smem,
                                unsigned long long *t_ready)
{
  __shared__ int g[BM];
  __shared__ const ps_bf16 *rows[BM];
  const unsigned long long ts = ps_now_ns();
  unsigned long long waited = 0; /* the profile's task time leaves the wait out */
  const ps_bf16 *recv = ps_win_ptr(a, a.off_recv);
  ps_gemm_b<2> bs = {};
  bs.map[0] = &a.tm_w1, bs.map[1] = &a.tm_w3, bs.row[0] = bs.row[1] = j * a.F + n0;
  int total = 0;
  const int mfirst = PS_MOE_TILED(BM) ? mt * BM : 0;
  for (int m0 = mfirst; m0 == mfirst || (!PS_MOE_TILED(BM) && m0 < total); m0 += BM) {
    auto prep = [&]() -> int {
      if (m0 == mfirst) { /* this expert's rows from every peer */
        const unsigned long long t0 = ps_now_ns();
        if (t_ready) {
          if (threadIdx.x == 0) *t_ready = ps_wait_ready(a);
          __syncthreads();
        }
        for (int s = threadIdx.x; s < a.R; s += blockDim.x) {
          if (s == a.dc.rank || a.st.rcnt[s * a.L + j] == 0) continue;
          const bool whole = ps_gin_whole(a, s);
          const perseus_recv rv(a.dc, whole ? a.hrows : a.st.hexp[j]);
          const uint64_t want = whole ? a.st.tot_r[s] : a.st.tot[j * a.R + s];
          ps_moe_wait(a, PS_MOE_WAIT_ROWS, s, [&] { return rv.poll(s, want); }); /* else garbage */
        }
        __syncthreads();
        waited = ps_now_ns() - t0;
        if (threadIdx.x == 0) ps_prof_add(a, PS_PROF_WAIT_ROWS, waited);
      }
      const int n = ps_expert_rows<BM>(a, j, m0, g, &total);
      if (n <= 0) return 0;
      if (threadIdx.x < n) { /* our own rows from x (the dispatch left them there), a peer's received */
        const int gi = g[threadIdx.x];
        rows[threadIdx.x] = gi / a.P == a.dc.rank ? a.x + (size_t)a.st.self_tok[gi % a.P] * a.H
                                                  : recv + (size_t)gi * a.H;
      }
      __syncthreads();
      return n;
    };
    ps_gemm_tile_prep<BM, 2, true>(prep, rows, bs, a.H, smem, [&](int m, int c, float (*v)[2]) {
      float h0 = v[0][0], h1 = v[0][1];
      float y0 = h0 / (1.f + __expf(-h0)) * v[1][0], y1 = h1 / (1.f + __expf(-h1)) * v[1][1];
      *(__nv_bfloat162 *)(a.act + (size_t)g[m] * a.F + n0 + c) = __floats2bfloat162_rn(y0, y1);
    });
    __syncthreads();
  }
  if (threadIdx.x == 0) ps_prof_add(a, PS_PROF_RUN_GEMM1, ps_now_ns() - ts - waited);
}

/* GEMM2 tasks take 128 columns of Y: the rows of W2 for columns h0..h0+63
 * and h0+64..h0+127 are the tile's two matrices (as W1 and W3 are in
 * GEMM1), so a task reads the activation rows once for 128 columns and each
 * k-step carries as many weight bytes as GEMM1's. */
#define PS_MOE_G2_COLS (2 * PS_GEMM_N)
__device__ __forceinline__ int ps_g2_tasks(const ps_moe_args &a)
{
  return (a.H + PS_MOE_G2_COLS - 1) / PS_MOE_G2_COLS;
}

/* GEMM2 columns h0 .. h0 + 127 of expert j (h0 .. h0 + 63 at the end of a
 * hidden size that is an odd multiple of 64), row tile mt (tiled kernel) or all, once
 * g1done[j] reached g1_want: Y = act W2^T. A row of an LSA
 * source (ourselves included) goes straight into that source's combine
 * region, where ps_expert_return would have put it; a GIN source's into the
 * y window, which ps_expert_return puts. */
template <int BM>
__device__ void ps_expert_gemm2(const ps_moe_args &a, int j, int h0, int mt, int g1_want, char *smem)
{
  __shared__ int g[BM];
  __shared__ const ps_bf16 *rows[BM];
  __shared__ ps_bf16 *out[BM];
  const unsigned long long ts = ps_now_ns();
  unsigned long long waited = 0; /* thread 0's; the profile's task time leaves it out */
  /* a missing second half re-reads the first one's weights (from L2) and
   * writes nothing */
  const bool half2 = h0 + PS_GEMM_N < a.H;
  ps_gemm_b<2> bs = {};
  bs.map[0] = bs.map[1] = &a.tm_w2;
  bs.row[0] = j * a.H + h0, bs.row[1] = bs.row[0] + (half2 ? PS_GEMM_N : 0);
  int total = 0;
  const int mfirst = PS_MOE_TILED(BM) ? mt * BM : 0;
  for (int m0 = mfirst; m0 == mfirst || (!PS_MOE_TILED(BM) && m0 < total); m0 += BM) {
    auto prep = [&]() -> int { /* under the first weights' loads */
      if (m0 == mfirst) {
        if (threadIdx.x == 0) {
          const unsigned long long t0 = ps_now_ns();
          ps_spin_until(&a.st.g1done[j], g1_want);
          waited = ps_now_ns() - t0;
          ps_prof_add(a, PS_PROF_WAIT_GEMM1, waited);
        }
        __syncthreads();
      }
      const int n = ps_expert_rows<BM>(a, j, m0, g, &total);
      if (n <= 0) return 0;
      if (threadIdx.x < n) {
        const int gi = g[threadIdx.x], src = gi / a.P, l = perseus_lsa_index(a.dc, src);
        rows[threadIdx.x] = a.act + (size_t)gi * a.F;
        out[threadIdx.x] = l >= 0 ? (ps_bf16 *)ncclGetLsaPointer(a.win, ps_row_off(a, a.off_comb,
                                                                        a.dc.rank, gi % a.P), l)
                                  : ps_win_ptr(a, a.off_y) + (size_t)gi * a.H;
      }
      __syncthreads();
      return n;
    };
    ps_gemm_tile_prep<BM, 2, true>(prep, rows, bs, a.F, smem, [&](int m, int c, float (*v)[2]) {
      ps_bf16 *yr = out[m] + h0 + c;
      *(__nv_bfloat162 *)yr = __floats2bfloat162_rn(v[0][0], v[0][1]);
      if (half2) *(__nv_bfloat162 *)(yr + PS_GEMM_N) = __floats2bfloat162_rn(v[1][0], v[1][1]);
    });
    __syncthreads();
  }
  if (threadIdx.x == 0) ps_prof_add(a, PS_PROF_RUN_GEMM2, ps_now_ns() - ts - waited);
}

/* Each source's output rows of expert j back to it: an LSA source's are
 * already there (ps_expert_gemm2 stored them), so only the expert's done
 * mark in its window is set, which lets its combine start on the tokens of
 * this expert while others still run; a GIN source's are put, one tile per
 * segment, or, when its rows travel in one put each way, counted, and the
 * last of its experts puts all of them. A source that failed here
 * (moe_peers.cuh) gets a poisoned mark, or over GIN nothing (it was told
 * when it failed: ps_moe_tell). Every GEMM2
 * task of j made its rows visible at system scope before the caller saw it
 * done; so did the callers before for their experts. One thread. */
__device__ void ps_expert_return(const ps_moe_args &a, int j)
{
  const size_t row_bytes = (size_t)a.H * sizeof(ps_bf16);
  perseus_batch pb(a.dc, a.hcomb, 1);
  __threadfence_system(); /* other CTAs' rows, for a GIN proxy's copy */
  for (int s = 0; s < a.R; s++) {
    int c = a.st.rcnt[s * a.L + j], r = a.st.roff[s * a.L + j];
    if (c == 0) continue;
    /* a source that failed here: its rows (or its wait) may be incomplete */
    const bool failed = ps_peer_failed(a, s);
    if (const int l = perseus_lsa_index(a.dc, s); l >= 0) {
      ps_moe_mark_done(a, l, j, failed);
    } else if (failed) { /* not returned: it was told (ps_moe_tell) */
    } else if (!ps_gin_whole(a, s)) {
      /* our rows sit in the sender's combine region for us at the same offset */
      ps_gin_posted();
      pb.put(ncclCoopThread(), s, a.win, ps_row_off(a, a.off_comb, a.dc.rank, r), a.win,
             ps_row_off(a, a.off_y, s, r), (size_t)c * row_bytes);
    } else if (atomicAdd(&a.st.rdone[s], 1) == a.st.rsegs[s] - 1) {
      __threadfence_system(); /* the other experts' rows, whose returns we acquired */
      ps_gin_posted();
      pb.put(ncclCoopThread(), s, a.win, ps_row_off(a, a.off_comb, a.dc.rank, 0), a.win,
             ps_row_off(a, a.off_y, s, 0),
             (size_t)ps_rows_all(a, a.st.rcnt, a.st.roff, s) * row_bytes);
    }
  }
}

/* Row-tile tasks (the 128-row kernel, which the host uses only up to
 * PS_MOE_TILED_MAX_L local experts): a task is one column tile of one row
 * tile of an expert, and the row tiles of a column tile are adjacent in the
 * queue. An expert with many rows (prefill, more so with more ranks) then
 * has its column tile's weights streamed by several CTAs at about the same
 * time, mostly read from HBM once and shared in L2, instead of once per row
 * tile by one CTA. Experts without rows get no tasks. The 64-row kernel
 * (decode: few rows an expert) keeps a task per column tile, all rows. */

/* Returns, in thread 0, when the CTA saw every CTA past its dispatch and
 * headers (0: it did not wait there: the tiled kernel, which passed a grid
 * barrier, or a CTA whose first task was not GEMM1). Always inlined: ptxas
 * serializes every wgmma of a kernel that calls a function holding them, and
 * nvcc's inliner outlines this one once the kernel grows past its budget. */
template <int BM>
__device__ __forceinline__ unsigned long long ps_moe_experts(const ps_moe_args &a, char *smem)
{
  /* task: the claimed index; then expert, column tile (GEMM2 from n1), row
   * tile and the expert's row tiles */
  __shared__ int task, tj, ti, tmt, ttiles;
  __shared__ int tpre[PS_MOE_TILED_MAX_L + 1]; /* row tiles of the experts before j */
  /* every GEMM1 tile (expert by expert) before any GEMM2 tile: a CTA that
   * holds a GEMM2 tile waits for its expert's GEMM1, so GEMM2 tiles queued
   * early would idle CTAs that could stream weights meanwhile */
  const int n1 = a.F / PS_GEMM_N, n2 = ps_g2_tasks(a);
  constexpr bool tiled = PS_MOE_TILED(BM);
  /* when the CTA waited for the rows' tables (thread 0's), and whether it did
   * (GEMM2 tasks rely on it through their expert's GEMM1) */
  unsigned long long t_ready = 0;
  bool seen = tiled; /* CTA-uniform; the tiled kernel passed a grid barrier */
  if (tiled && threadIdx.x < 32) { /* warp 0: row tiles per expert, prefix */
    const int lane = threadIdx.x;
    int base = 0;
    for (int j0 = 0; j0 < a.L; j0 += 32) {
      const int j = j0 + lane;
      int rows = 0;
      if (j < a.L)
        for (int s = 0; s < a.R; s++) rows += a.st.rcnt[s * a.L + j];
      const int incl = ps_warp_scan((rows + BM - 1) / BM, lane);
      if (j < a.L) tpre[j + 1] = base + incl;
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) tpre[0] = 0;
  }
  __syncthreads();
  const int ntiles = tiled ? tpre[a.L] : a.L; /* untiled: one "tile" an expert, all its rows */
  const int t1 = ntiles * n1, tall = ntiles * (n1 + n2);
  const unsigned long long t0 = ps_now_ns();
  unsigned long long t_end = t0; /* the end of this CTA's last task */
  for (bool first = true;; first = false) {
    /* a CTA's first task is its own index, the queue's counter hands out the
     * rest: at the start the CTAs do not all contend for one atomic */
    if (threadIdx.x == 0) {
      const int tk = first ? (int)blockIdx.x : (int)gridDim.x + atomicAdd(a.st.task, 1);
      task = tk;
      if (tk < tall) {
        const bool g1 = tk < t1;
        const int n = g1 ? n1 : n2, r = g1 ? tk : tk - t1;
        if (tiled) { /* the expert j with n tpre[j] <= r < n tpre[j + 1] */
          int lo = 0, hi = a.L - 1;
          while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (n * tpre[mid] <= r) lo = mid;
            else hi = mid - 1;
          }
          const int tiles = tpre[lo + 1] - tpre[lo], rr = r - n * tpre[lo];
          tj = lo, ti = (g1 ? 0 : n1) + rr / tiles, tmt = rr % tiles, ttiles = tiles;
        } else {
          tj = r / n, ti = (g1 ? 0 : n1) + r % n, tmt = 0, ttiles = 1;
        }
      }
    }
    __syncthreads();
    const int tk = task, j = tj, i = ti, mt = tmt, tiles = ttiles;
    __syncthreads();
    if (tk >= tall) {
      if (threadIdx.x == 0) ps_prof_add(a, PS_PROF_EXPERTS_END, t_end - t0);
      if (!seen) { /* the combine reads the offsets' tables */
        if (threadIdx.x == 0) ps_wait_ready(a);
        __syncthreads();
      }
      break;
    }
    if (i < n1) {
      ps_expert_gemm1<BM>(a, j, i * PS_GEMM_N, mt, smem, seen ? NULL : &t_ready);
      seen = true;
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&a.st.g1done[j], 1);
      }
    } else {
      ps_expert_gemm2<BM>(a, j, (i - n1) * PS_MOE_G2_COLS, mt, n1 * tiles, smem);
      __shared__ int last;
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system(); /* rows stored into LSA peers' windows, before they are counted */
        last = atomicAdd(&a.st.g2done[j], 1) == n2 * tiles - 1;
        if (last) __threadfence();
      }
      __syncthreads();
      if (last && threadIdx.x == 0) ps_expert_return(a, j);
    }
    t_end = ps_now_ns();
  }
  return t_ready;
}

/* ---- combine: warp per (token, column group) ---------------------------------
 * Items of `per` chunks of 256 columns (8 a lane), as few chunks an item as
 * still give every warp one: at decode a token spreads over several warps
 * instead of one warp reading its k x H / 256 row pieces one after another;
 * at prefill a warp takes a whole token and waits for it once. The rows'
 * addresses and weights are looked up once per item, their loads issued
 * together. */
#define PS_COMBINE_ROWS 8 /* row loads in flight per lane */
__device__ void ps_moe_combine(const ps_moe_args &a)
{
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x >> 5);
  const int w0 = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int chunks = (a.H + 255) / 256;
  const int per = min(chunks, max(1, (int)(((long long)a.T * chunks + warps - 1) / warps)));
  const int groups = (chunks + per - 1) / per;
  perseus_recv rv(a.dc, a.hcomb);
  __shared__ unsigned long long waited_cta; /* this CTA's tokens' waits, ns */
  unsigned long long waited = 0;
  if (threadIdx.x == 0) waited_cta = 0;
  __syncthreads();
  for (int it = w0; it < a.T * groups; it += warps) {
    const int t = it / groups, g0 = it % groups * per, g1 = min(g0 + per, chunks);
    const unsigned long long t0 = ps_now_ns();
    int dst = 0, j = 0;
    if (lane < a.k) { /* each of the token's experts is done */
      const int e = a.st.topk_idx[t * a.k + lane];
      dst = e / a.L, j = e % a.L;
      if (perseus_lsa_index(a.dc, dst) >= 0) { /* its mark, set by dst (ps_expert_return) */
        const uint64_t *done = (const uint64_t *)ncclGetLocalPointer(
            a.win, a.off_done + ((size_t)dst * a.L + j) * sizeof(uint64_t));
        const unsigned long long want = ps_fwd(a) + 1;
        uint64_t v = 0;
        auto ready = [&] {
          asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(done) : "memory");
          return v >= want;
        };
        /* our own results come from our own tasks, whose waits are bounded:
         * a timeout here would only race theirs and blame ourselves */
        if (dst == a.dc.rank) while (!ready()) {}
        else ps_moe_wait(a, PS_MOE_WAIT_RESULTS, dst, ready);
        if (v & PS_MOE_POISON) ps_moe_fail(a, PS_MOE_FAULT_PEER, dst, PS_MOE_WAIT_RESULTS, j);
      } else { /* a GIN destination: everything it returns, or its poison */
        const uint64_t want = a.st.tot_c[dst];
        uint64_t v = 0;
        ps_moe_wait(a, PS_MOE_WAIT_RESULTS, dst, [&] {
          v = rv.arrived(dst);
          return perseus_reached(v, want);
        });
        if (v & PS_MOE_GIN_POISON) ps_moe_fail(a, PS_MOE_FAULT_PEER, dst, PS_MOE_WAIT_RESULTS, -1);
      }
    }
    __syncwarp();
    if (g0 == 0) waited += ps_now_ns() - t0; /* once per token */
    /* lane i < k: the token's i-th result row (written by a peer: read at L2,
     * __ldcg, past L1) and its weight, looked up once and passed round */
    const ps_bf16 *row = NULL;
    float wt = 0.f;
    if (lane < a.k) {
      const int r = a.st.soff[dst * a.L + j] + a.st.slot[t * a.k + lane];
      row = ps_win_ptr(a, ps_row_off(a, a.off_comb, dst, r));
      wt = a.st.topk_w[t * a.k + lane];
    }
    /* every lane takes every chunk (the shuffles need them all); hidden is a
     * multiple of 64, not of 256, so a lane's columns may be past the end */
    for (int ch = g0; ch < g1; ch++) {
      const int c = ch * 256 + lane * 8;
      const bool mine = c < a.H;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int i0 = 0; i0 < a.k; i0 += PS_COMBINE_ROWS) {
        uint4 v[PS_COMBINE_ROWS];
        float w[PS_COMBINE_ROWS];
#pragma unroll
        for (int q = 0; q < PS_COMBINE_ROWS; q++) {
          v[q] = make_uint4(0, 0, 0, 0), w[q] = 0.f;
          if (i0 + q < a.k) { /* warp-uniform */
            const ps_bf16 *r = (const ps_bf16 *)__shfl_sync(0xffffffffu, (unsigned long long)row, i0 + q);
            w[q] = __shfl_sync(0xffffffffu, wt, i0 + q);
            if (mine) v[q] = __ldcg((const uint4 *)(r + c));
          }
        }
#pragma unroll
        for (int q = 0; q < PS_COMBINE_ROWS; q++) {
          const __nv_bfloat162 *b = (const __nv_bfloat162 *)&v[q];
#pragma unroll
          for (int h = 0; h < 4; h++) {
            float2 f = __bfloat1622float2(b[h]);
            acc[2 * h] += w[q] * f.x, acc[2 * h + 1] += w[q] * f.y;
          }
        }
      }
      if (!mine) continue;
      uint4 o;
      __nv_bfloat162 *ob = (__nv_bfloat162 *)&o;
#pragma unroll
      for (int h = 0; h < 4; h++) ob[h] = __floats2bfloat162_rn(acc[2 * h], acc[2 * h + 1]);
      *(uint4 *)(a.out + (size_t)t * a.H + c) = o;
    }
  }
  if (lane == 0) atomicAdd(&waited_cta, waited);
  __syncthreads();
  if (threadIdx.x == 0) ps_prof_add(a, PS_PROF_WAIT_COMBINE, waited_cta);
}

#endif
