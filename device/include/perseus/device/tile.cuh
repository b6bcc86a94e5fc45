/* perseus device library: moving one tile by loads and stores (LSA peers).
 *
 * perseus_tile_copy(coop, dst, src, bytes): every thread of `coop` (an NCCL
 * coop: ncclCoopThread, ncclCoopWarp, ncclCoopCta, ...) copies a strided
 * share, 16 bytes at a time when both pointers are 16-byte aligned
 * (coalesced across the coop's lanes), else 8, 4 or 1. No ordering: the
 * caller releases the stores before telling anyone (perseus_batch::put does,
 * with a system-scope fence before its count). */
#ifndef PERSEUS_DEVICE_TILE_CUH
#define PERSEUS_DEVICE_TILE_CUH

#include <stddef.h>
#include <stdint.h>

#if __CUDACC__
template <typename Word, typename Coop>
__device__ __forceinline__ void perseus_copy_words(Coop &coop, char *dst, const char *src, size_t n) {
  Word *d = (Word *)dst;
  const Word *s = (const Word *)src;
  for (size_t i = coop.thread_rank(); i < n; i += coop.size()) d[i] = s[i];
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
#endif /* __CUDACC__ */

#endif
