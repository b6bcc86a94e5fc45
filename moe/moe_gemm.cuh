/* moe_gemm.cuh: the expert GEMM tile of the fused MoE kernel, on bf16
 * tensor cores with fp32 accumulation.
 *
 * One CTA of PS_GEMM_THREADS computes C[m][n] = sum_k A[m][k] * B_b[n][k]
 * for up to BM (64 or 128) gathered rows m (row m of A at rows[m], K
 * contiguous) and PS_GEMM_N columns n (B_b row-major [N][K], K contiguous:
 * the weight layout), for NB weight matrices at once (GEMM1 needs W1 and W3
 * on the same rows). Tiles of A (by cp.async) and B (by TMA, or cp.async
 * for the gate) stream through shared memory PS_GEMM_STAGES(BM, NB) deep;
 * rows past the valid count are zero-filled. The epilogue is a functor
 * called per output pair (m, n, n+1) with the NB accumulators. 64-row
 * tiles are for few rows per expert (decode: weight streaming, which wants
 * the deeper pipeline), 128-row ones for many (prefill: half the weight
 * traffic per flop).
 *
 * Built for sm_90a (H100/H200) the tile runs on wgmma, operands read straight
 * from shared memory, whose layout below is the hardware's 128-byte swizzle:
 * with 64 rows each of the two warp groups takes all rows and 32 columns,
 * with 128 rows 64 rows and all columns. Elsewhere (the compute_90 PTX,
 * JIT-compiled on later GPUs) it runs on mma.sync m16n8k16 from ldmatrix
 * fragments, 4 x 2 warps of BM/4 rows x 32 columns. */
#ifndef PS_MOE_GEMM_CUH
#define PS_MOE_GEMM_CUH

#include <cuda.h> /* CUtensorMap */
#include <cuda_bf16.h>
#include <stdint.h>

#define PS_GEMM_N 64
#define PS_GEMM_K 64 /* per stage: 128-byte rows, 8 chunks of 16 bytes */
#define PS_GEMM_CH (PS_GEMM_K / 8)
#define PS_GEMM_THREADS 256
/* Bytes of one pipeline stage: a K slice of A and of the NB matrices. */
#define PS_GEMM_STAGE_BYTES(BM, NB) (((BM) + (NB) * PS_GEMM_N) * PS_GEMM_K * 2)
/* Shared memory per CTA: 4 stages of GEMM1 (NB = 2) with 64-row tiles, 3
 * with 128 (2 CTAs on an SM either way), plus the slack that aligns the
 * stages to 1 KiB (the swizzle pattern repeats every 8 rows of 128 B). */
#define PS_GEMM_SMEM(BM) (((BM) == 64 ? 4 : 3) * PS_GEMM_STAGE_BYTES(BM, 2) + 1024)
/* Loads in flight: as many stages as fit, since decode's weight streaming
 * is latency-bound (64 rows: 4 stages for the expert GEMMs, two matrices each, 6 for the gate). */
#define PS_GEMM_STAGES(BM, NB) ((PS_GEMM_SMEM(BM) - 1024) / PS_GEMM_STAGE_BYTES(BM, NB))

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PS_GEMM_WGMMA 1
#else
#define PS_GEMM_WGMMA 0
#endif

/* Rows are PS_GEMM_CH chunks of 16 bytes; chunk c of row r lives at
 * c ^ (r % PS_GEMM_CH) so that the 8 rows one ldmatrix phase reads (same
 * c, consecutive r) fall in distinct banks. From a 1 KiB aligned base this
 * is wgmma's 128-byte swizzle of a K-major operand. */
__device__ __forceinline__ uint32_t ps_gemm_swz(int r, int c)
{
  return (uint32_t)(r * PS_GEMM_K * 2 + ((c ^ (r % PS_GEMM_CH)) << 4));
}

__device__ __forceinline__ void ps_cp_async16(uint32_t dst, const void *src, bool valid)
{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void ps_ldmatrix_x4(uint32_t addr, uint32_t r[4])
{
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ps_mma_bf16(float c[4], const uint32_t a[4], uint32_t b0,
                                            uint32_t b1)
{
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* wgmma operand descriptor of a K-major tile in the layout above: 8-row
 * groups 1 KiB apart (stride offset), 128-byte swizzle; the leading offset
 * is unused in that mode. k16 step s starts 32 * s bytes further. */
__device__ __forceinline__ uint64_t ps_wgmma_desc(uint32_t saddr)
{
  return (uint64_t)((saddr & 0x3ffff) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
         (uint64_t)1 << 62;
}

/* ---- the weights by TMA: one thread loads a stage's PS_GEMM_N x PS_GEMM_K
 * box of each matrix (the tensor map's 128-byte swizzle is the layout
 * above), completing on the stage's mbarrier with its byte count. Fewer
 * instructions and registers than 256 threads' cp.async, and the copy
 * engine, not the warps, generates the addresses. */
__device__ __forceinline__ void ps_mbar_init(uint32_t bar)
{
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}

/* The stage's loads are counted on it: one arrival that expects `bytes`. */
__device__ __forceinline__ void ps_mbar_expect(uint32_t bar, uint32_t bytes)
{
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void ps_mbar_wait(uint32_t bar, uint32_t parity)
{
  asm volatile("{\n.reg .pred p;\nPS_MBAR_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               "@!p bra PS_MBAR_WAIT;\n}\n" ::"r"(bar), "r"(parity)
               : "memory");
}

/* Box (k0, row) of a 2-D tensor map (innermost coordinate first). */
__device__ __forceinline__ void ps_tma_load(uint32_t dst, const CUtensorMap *map, int k0, int row,
                                            uint32_t bar)
{
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[%0], [%1, {%2, %3}], [%4];" ::"r"(dst), "l"(map), "r"(k0), "r"(row), "r"(bar)
               : "memory");
}

/* Where a tile's NB weight matrices come from: b[i] (rows ldb elements
 * apart, the first nrows existing) by cp.async, or, with a tensor map per
 * matrix, the box at row[i] by TMA (rows past the tensor read as zero).
 * The K elements summed start at column kbase of each row (a split of K:
 * the rows of A the caller passes point at their column kbase). */
template <int NB> struct ps_gemm_b {
  const __nv_bfloat16 *b[NB];
  int nrows;
  size_t ldb;
  const CUtensorMap *map[NB]; /* TMA (the tile's template flag) */
  int row[NB];
  int kbase;
};

#if PS_GEMM_WGMMA
/* d[64 x 32] += A[64 x 16] B[32 x 16]^T for the calling warp group; the
 * accumulator fragment is mma.sync's m16n8 one per warp (rows 16 w .. +15
 * of the group's warp w), four n8 tiles along. */
__device__ __forceinline__ void ps_wgmma_m64n32(float d[16], uint64_t da, uint64_t db)
{
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
               "%16, %17, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(da), "l"(db));
}

/* The same with 64 columns: eight n8 tiles along. */
__device__ __forceinline__ void ps_wgmma_m64n64(float d[32], uint64_t da, uint64_t db)
{
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "%32, %33, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                 "+f"(d[30]), "+f"(d[31])
               : "l"(da), "l"(db));
}
#endif

/* rows[m] (m < mrows <= BM) points at row m of A; bs gives this tile's
 * PS_GEMM_N rows of each weight matrix (TMA: by bs.map and bs.row; else
 * by bs.b, bs.ldb and bs.nrows); K (a multiple of PS_GEMM_K) elements of
 * each row are summed over. Every thread of the CTA calls it; `smem` holds
 * PS_GEMM_SMEM(BM) bytes. Epi is called as epi(m, n, acc) for each
 * m < mrows and even n, acc[i][0..1] being columns n and n+1 of matrix i
 * (columns past the weights' rows hold zeros).
 *
 * The rows come from prep(), called by every thread once the first stages'
 * weight loads are in flight: it fills rows[] and returns mrows, both
 * visible to the CTA behind a __syncthreads (with TMA that barrier also
 * publishes the stages' mbarriers, initialised before prep). So whatever the
 * rows wait for (their arrival, a task's row table, the activation) takes
 * place under the weights' HBM latency instead of before it. mrows 0: the
 * weights in flight are drained and nothing is computed. */
template <int BM, int NB, bool TMA, typename Prep, typename Epi>
__device__ void ps_gemm_tile_prep(Prep prep, const __nv_bfloat16 *const *rows,
                                  const ps_gemm_b<NB> &bs, int K, char *smem, Epi epi)
{
  static_assert(BM == 64 || BM == 128, "64- or 128-row tiles");
  constexpr int STAGES = PS_GEMM_STAGES(BM, NB), MI = BM / 64;
  /* a thread's accumulator fragments of 16 rows x 8 columns, per matrix */
  constexpr int FR = 4 * MI;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp & 3, wn = warp >> 2; /* wn: the warp group */
  const uint32_t s0 = ((uint32_t)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
  const uint32_t a_bytes = BM * PS_GEMM_K * 2, b_bytes = PS_GEMM_N * PS_GEMM_K * 2;
  const uint32_t stage_bytes = a_bytes + NB * b_bytes;
  float acc[NB][FR][4];
#pragma unroll
  for (int i = 0; i < NB; i++)
#pragma unroll
    for (int f = 0; f < FR; f++) acc[i][f][0] = acc[i][f][1] = acc[i][f][2] = acc[i][f][3] = 0.f;

  /* 16-byte chunks, 8 per row of a stage: chunk q of thread t is row
   * (t + 256 q) / 8, column (t + 256 q) % 8; A has BM rows, B 64 */
  constexpr int PA = BM * PS_GEMM_CH / PS_GEMM_THREADS, PB = PS_GEMM_N * PS_GEMM_CH / PS_GEMM_THREADS;
  const __nv_bfloat16 *arow[PA];
  constexpr int PBC = TMA ? 1 : PB; /* cp.async weight chunks (none by TMA) */
  size_t boff[PBC];
  bool aok[PA], bok[PBC];
  const int lc = tid % PS_GEMM_CH, lr = tid / PS_GEMM_CH, rstep = PS_GEMM_THREADS / PS_GEMM_CH;
  __shared__ __align__(8) uint64_t bar[STAGES]; /* TMA: stage s's weights are in */
  const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bar);
  if constexpr (TMA) {
    /* the previous tile waited for all of its stages: the barriers are idle */
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; s++) ps_mbar_init(bar0 + 8 * s);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* visible to the copies */
    }
  } else {
#pragma unroll
    for (int q = 0; q < PBC; q++) {
      bok[q] = lr + q * rstep < bs.nrows;
      boff[q] = (size_t)(bok[q] ? lr + q * rstep : 0) * bs.ldb;
    }
  }
  auto load_b = [&](int stage, int k0) {
    uint32_t st = s0 + stage * stage_bytes;
    if constexpr (TMA) {
      if (tid == 0) {
        ps_mbar_expect(bar0 + 8 * stage, NB * b_bytes);
#pragma unroll
        for (int i = 0; i < NB; i++)
          ps_tma_load(st + a_bytes + i * b_bytes, bs.map[i], bs.kbase + k0, bs.row[i], bar0 + 8 * stage);
      }
    } else {
#pragma unroll
      for (int q = 0; q < PBC; q++)
#pragma unroll
        for (int i = 0; i < NB; i++)
          ps_cp_async16(st + a_bytes + i * b_bytes + ps_gemm_swz(lr + q * rstep, lc),
                        bs.b[i] + boff[q] + bs.kbase + k0 + lc * 8, bok[q]);
    }
  };
  auto load_a = [&](int stage, int k0) { /* and closes the stage's group */
    uint32_t st = s0 + stage * stage_bytes;
#pragma unroll
    for (int q = 0; q < PA; q++)
      ps_cp_async16(st + ps_gemm_swz(lr + q * rstep, lc), arow[q] + k0 + lc * 8, aok[q]);
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  const int nk = K / PS_GEMM_K;
  /* the first stages' weights, then the rows (prep), then their A tiles:
   * group 0 holds those weights and A of step 0, group s > 0 A of step s.
   * Every step commits one group (empty past the end), so "all but the
   * newest STAGES-2 groups done" always means "step kt's tiles are in" */
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++)
    if (s < nk) load_b(s, s * PS_GEMM_K);
  const int mrows = prep();
  if (mrows <= 0) { /* CTA-uniform */
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
    if constexpr (TMA)
      for (int s = 0; s < STAGES - 1 && s < nk; s++) ps_mbar_wait(bar0 + 8 * s, 0);
    __syncthreads(); /* shared memory is free for the caller's next tile */
    return;
  }
#pragma unroll
  for (int q = 0; q < PA; q++) {
    aok[q] = lr + q * rstep < mrows;
    arow[q] = rows[aok[q] ? lr + q * rstep : 0];
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < nk) load_a(s, s * PS_GEMM_K);
    else asm volatile("cp.async.commit_group;" ::: "memory");
  }
  for (int kt = 0; kt < nk; kt++) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
    if constexpr (TMA) ps_mbar_wait(bar0 + 8 * (kt % STAGES), (kt / STAGES) & 1);
#if PS_GEMM_WGMMA /* cp.async wrote through the generic proxy, wgmma reads through the async one */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    __syncthreads(); /* step kt's tiles are visible; step kt-1's stage is free */
    {
      int next = kt + STAGES - 1;
      if (next < nk) load_b(next % STAGES, next * PS_GEMM_K), load_a(next % STAGES, next * PS_GEMM_K);
      else asm volatile("cp.async.commit_group;" ::: "memory");
    }
    const uint32_t st = s0 + (kt % STAGES) * stage_bytes;
#if PS_GEMM_WGMMA
    if (BM == 128 && wn * 64 >= mrows) continue; /* group-uniform: its rows are all padding */
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < PS_GEMM_K / 16; kk++) {
#pragma unroll
      for (int i = 0; i < NB; i++) {
        const uint32_t sb = st + a_bytes + i * b_bytes + kk * 32;
        if constexpr (BM == 64)
          ps_wgmma_m64n32(&acc[i][0][0], ps_wgmma_desc(st + kk * 32),
                          ps_wgmma_desc(sb + wn * 32 * PS_GEMM_K * 2));
        else
          ps_wgmma_m64n64(&acc[i][0][0], ps_wgmma_desc(st + wn * 64 * PS_GEMM_K * 2 + kk * 32),
                          ps_wgmma_desc(sb));
      }
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); /* before the stage is reloaded */
#else
    if (wm * 16 * MI >= mrows) continue; /* warp-uniform: this warp's rows are all padding */
#pragma unroll
    for (int kk = 0; kk < PS_GEMM_K / 16; kk++) { /* k16 steps per stage */
      uint32_t a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; mi++) {
        int r = wm * 16 * MI + mi * 16 + (lane & 15), c = kk * 2 + (lane >> 4);
        ps_ldmatrix_x4(st + ps_gemm_swz(r, c), a[mi]);
      }
#pragma unroll
      for (int i = 0; i < NB; i++) {
#pragma unroll
        for (int np = 0; np < 2; np++) { /* two n8 tiles per ldmatrix.x4 */
          uint32_t bf[4];
          int r = wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
          int c = kk * 2 + ((lane >> 3) & 1);
          ps_ldmatrix_x4(st + a_bytes + i * b_bytes + ps_gemm_swz(r, c), bf);
#pragma unroll
          for (int mi = 0; mi < MI; mi++) {
            ps_mma_bf16(acc[i][mi * 4 + np * 2], a[mi], bf[0], bf[1]);
            ps_mma_bf16(acc[i][mi * 4 + np * 2 + 1], a[mi], bf[2], bf[3]);
          }
        }
      }
    }
#endif
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads(); /* shared memory is free for the caller's next tile */

  /* fragment f: rows row0 + g and + 8, columns col0 + 2 t and + 1 */
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int f = 0; f < FR; f++) {
    int row0, col0;
    if (PS_GEMM_WGMMA && BM == 128) row0 = wn * 64 + wm * 16, col0 = f * 8;
    else row0 = wm * 16 * MI + f / 4 * 16, col0 = wn * 32 + f % 4 * 8;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      int m = row0 + g + h * 8;
      if (m < mrows) {
        float v[NB][2];
#pragma unroll
        for (int i = 0; i < NB; i++) v[i][0] = acc[i][f][h * 2], v[i][1] = acc[i][f][h * 2 + 1];
        epi(m, col0 + t * 2, v);
      }
    }
  }
}

/* The same with the rows known up front, weights by cp.async. */
template <int BM, int NB, typename Epi>
__device__ void ps_gemm_tile(const __nv_bfloat16 *const *rows, int mrows,
                             const __nv_bfloat16 *const b[NB], int nrows, size_t ldb, int K,
                             char *smem, Epi epi)
{
  ps_gemm_b<NB> bs = {};
  for (int i = 0; i < NB; i++) bs.b[i] = b[i];
  bs.nrows = nrows, bs.ldb = ldb;
  ps_gemm_tile_prep<BM, NB, false>([&]() { return mrows; }, rows, bs, K, smem, epi);
}

#endif
