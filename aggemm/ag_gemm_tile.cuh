// The AllGather+GEMM kernel's GEMM pipeline on sm_90a: warp-specialized,
// one block an SM.
//
// A block has three warp groups. Group 0 loads: per K step of 64 it
// brings B's 256 x 64 box by TMA and a 128-row slice of A into one of
// kStages shared-memory stages, A by TMA too where the tile's rows lie in
// one buffer (the caller's own shard, this rank's window, or one peer's
// over NVLink), else gathered row by row with cp.async. Groups 1
// and 2 compute: each holds 64 rows x 256 columns of fp32 sums in
// registers (wgmma m64n256k16, operands straight from shared memory, one
// group of wgmmas kept in flight). Stages pass between them on mbarriers:
// `full` (the loader's 128 threads, each once its cp.async group, if any,
// landed and was fenced for the async proxy, plus TMA's byte count) and `empty`
// (one arrival per compute group once its wgmmas read the stage). The
// loader takes tickets (ag_gemm_fused.cu) and hands each tile to the
// compute groups through a two-slot ring, so it runs up to kStages steps
// (and across tiles) ahead of them: the wait for a tile's rows and its
// first loads overlap the tile before. Register budgets move with
// setmaxnreg: the loader needs few, the compute groups 128 sums each.
#ifndef PS_AG_GEMM_TILE_CUH
#define PS_AG_GEMM_TILE_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "moe_gemm.cuh" // the 128-byte swizzle, wgmma descriptors, TMA and mbarrier helpers

namespace ag {

constexpr int kBM = 128, kBN = 256, kBK = PS_GEMM_K, kStages = 4;
constexpr int kGroup = 128, kThreads = 3 * kGroup;
constexpr int kLag = 2; // the loader's cp.async groups in flight before it reports a stage full
constexpr uint32_t kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
constexpr size_t kSmem = kStages * kStageBytes + 1024; // + the slack that aligns stages to 1 KiB
static_assert(kLag < kStages, "the loader must report a stage before it waits to reuse it");

// What the loader hands the compute groups: the ticket (the tile and its K
// split) and the rows it has.
struct slot_t {
  int ticket, mrows;
};

struct pipe_t {
  uint64_t full[kStages], empty[kStages], slot_full[2], slot_empty[2];
  slot_t slot[2];
  const __nv_bfloat16 *rows[kBM]; // the loader's current tile, K offset included
};

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void group_sync(int id) { // one warp group's named barrier
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kGroup) : "memory");
}

// Called by one thread before the block's first barrier.
__device__ __forceinline__ void pipe_init(pipe_t &p) {
  for (int s = 0; s < kStages; s++) mbar_init(&p.full[s], kGroup + 1), mbar_init(&p.empty[s], 2);
  for (int s = 0; s < 2; s++) mbar_init(&p.slot_full[s], 1), mbar_init(&p.slot_empty[s], 2);
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
}

// For other targets than sm_90a (nvcc's -arch=sm_90 adds one) these trap:
// the operator refuses GPUs of other compute capabilities than 9.0.
#if !PS_GEMM_WGMMA
template <int N> __device__ __forceinline__ void regs_dec() { __trap(); }
template <int N> __device__ __forceinline__ void regs_inc() { __trap(); }
__device__ __forceinline__ void ag_wgmma_m64n256(float *, uint64_t, uint64_t) { __trap(); }
__device__ __forceinline__ void wg_fence() {}
__device__ __forceinline__ void wg_commit() {}
template <int N> __device__ __forceinline__ void wg_wait() {}
#else
// wgmma's fence (before the first of a group: the sums were written by other
// instructions), commit of the group, and wait until at most N are pending
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int N> __device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// d[64 x 256] += A[64 x 16] B[256 x 16]^T for the calling warp group; thread
// (warp w, lane l) holds rows 16 w + l / 4 (+ 8) and columns 8 j + 2 (l % 4)
// (+ 1) in d[4 j .. 4 j + 3].
__device__ __forceinline__ void ag_wgmma_m64n256(float d[128], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db));
}
#endif

} // namespace ag

#endif
