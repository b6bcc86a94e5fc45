/* perseus device library: moving one tile within the NVLink domain (LSA
 * peers), two ways.
 *
 * perseus_tile_copy(coop, dst, src, bytes): every thread of `coop` (an NCCL
 * coop: ncclCoopThread, ncclCoopWarp, ncclCoopCta, ...) copies a strided
 * share, 16 bytes at a time when both pointers are 16-byte aligned
 * (coalesced across the coop's lanes), else 8, 4 or 1. No ordering: the
 * caller releases the stores before telling anyone (perseus_batch::put does,
 * with a system-scope fence before its count).
 *
 * perseus_tile_copy_tma(coop, dst, src, bytes, smem): on Hopper (sm_90+),
 * one thread of the coop drives the bulk-copy engine (TMA): chunks go
 * global -> shared -> global through two stages of the coop's shared-memory
 * buffer, the load of one overlapping the store of the other, so the coop's
 * other lanes issue no loads or stores at all. Returns when the stores are
 * complete, ordered for the thread that made them (lane 0), which is the
 * thread perseus_batch::put counts from. Falls back to perseus_tile_copy
 * before sm_90, for pointers not 16-byte aligned, or when `smem` is too
 * small (under 48 bytes). */
#ifndef PERSEUS_DEVICE_TILE_CUH
#define PERSEUS_DEVICE_TILE_CUH

#include <stddef.h>
#include <stdint.h>

#if __CUDACC__
/* Loads a thread keeps in flight before their stores. A tile's words are
 * independent, but the compiler may not move a load above an earlier store
 * to memory it cannot prove apart, so a plain loop pays one load latency per
 * word; a warp copying a 4 KiB row would pay eight, four a round pays two
 * (eight: more code than nvcc inlines into the MoE kernel). Narrow words
 * (tails, unaligned tiles) keep the plain loop: less code in kernels. */
#ifndef PERSEUS_COPY_UNROLL
#define PERSEUS_COPY_UNROLL 4
#endif
template <typename Word, typename Coop>
__device__ __forceinline__ void perseus_copy_words(Coop &coop, char *dst, const char *src, size_t n) {
  constexpr int U = sizeof(Word) >= 8 ? PERSEUS_COPY_UNROLL : 1;
  Word *d = (Word *)dst;
  const Word *s = (const Word *)src;
  const size_t step = coop.size();
  size_t i = coop.thread_rank();
  for (; U > 1 && i + (U - 1) * step < n; i += U * step) {
    Word v[U];
#pragma unroll
    for (int u = 0; u < U; u++) v[u] = s[i + u * step];
#pragma unroll
    for (int u = 0; u < U; u++) d[i + u * step] = v[u];
  }
  for (; i < n; i += step) d[i] = s[i];
}

template <typename Coop>
__device__ __forceinline__ void perseus_tile_copy(Coop &coop, char *dst, const char *src, size_t bytes) {
  uintptr_t a = (uintptr_t)dst | (uintptr_t)src;
  if (a % 16 == 0) {
    perseus_copy_words<uint4>(coop, dst, src, bytes / 16);
    size_t done = bytes & ~(size_t)15;
    dst += done, src += done, bytes -= done;
  } else if (a % 8 == 0) {
    perseus_copy_words<uint64_t>(coop, dst, src, bytes / 8);
    size_t done = bytes & ~(size_t)7;
    dst += done, src += done, bytes -= done;
  } else if (a % 4 == 0) {
    perseus_copy_words<uint32_t>(coop, dst, src, bytes / 4);
    size_t done = bytes & ~(size_t)3;
    dst += done, src += done, bytes -= done;
  }
  perseus_copy_words<char>(coop, dst, src, bytes); /* the tail (or an unaligned tile) */
}
/* Shared memory a coop lends perseus_tile_copy_tma for one call: `p`
 * 16-byte aligned, `bytes` of it (the first 16 hold the copy's mbarrier, the
 * rest two stages); nothing else may touch it during the call. */
struct perseus_tma_smem {
  void *p;
  uint32_t bytes;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void perseus_tma_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

/* One thread: dst[0, n) = src[0, n), n a multiple of 16, both 16-aligned. */
__device__ __forceinline__ void perseus_tma_copy_thread(char *dst, const char *src, size_t n,
                                                        char *smem, uint32_t stage) {
  uint32_t bar = (uint32_t)__cvta_generic_to_shared(smem);
  uint32_t buf = bar + 16;
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
  /* the barrier's init, and the coop's generic writes of src (synced
   * before the call), are seen by the async proxy */
  asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async;" ::: "memory");
  uint32_t parity = 0;
  for (size_t off = 0, i = 0; off < n; i++) {
    uint32_t len = (uint32_t)(n - off < stage ? n - off : stage);
    uint32_t s = buf + (uint32_t)(i & 1) * stage;
    /* the store that last used this stage (two chunks ago) has read it */
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(len)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(s), "l"(src + off), "r"(len), "r"(bar)
        : "memory");
    perseus_tma_wait(bar, parity);
    parity ^= 1;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + off),
                 "r"(s), "r"(len)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    off += len;
  }
  /* every store complete, and ordered before this thread's later generic
   * accesses (the batch count's release) */
  asm volatile("cp.async.bulk.wait_group 0;\n fence.proxy.async;" ::: "memory");
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
#endif

template <typename Coop>
__device__ __forceinline__ void perseus_tile_copy_tma(Coop &coop, char *dst, const char *src,
                                                      size_t bytes, perseus_tma_smem smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t stage = smem.bytes >= 48 ? ((smem.bytes - 16) / 2) & ~15u : 0;
  if (stage && ((uintptr_t)dst | (uintptr_t)src | (uintptr_t)smem.p) % 16 == 0) {
    size_t body = bytes & ~(size_t)15;
    if (body && coop.thread_rank() == 0) perseus_tma_copy_thread(dst, src, body, (char *)smem.p, stage);
    perseus_copy_words<char>(coop, dst + body, src + body, bytes - body); /* < 16 B */
    coop.sync(); /* the buffer is free again for every lane */
    return;
  }
#endif
  (void)smem;
  perseus_tile_copy(coop, dst, src, bytes);
}
#endif /* __CUDACC__ */

#endif
