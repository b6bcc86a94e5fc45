/* Test and benchmark inputs from a hash of their place: a value made alike
 * on every rank's GPU and on the host, so a reference needs no copy from
 * any rank. The caller packs the place (seed, tensor, indices) into 64 bits. */
#ifndef PERSEUS_PLACE_HASH_CUH
#define PERSEUS_PLACE_HASH_CUH

#include <stdint.h>

/* The splitmix64 finalizer: every bit of x stirs every bit of the result. */
__host__ __device__ inline uint64_t ps_place_mix(uint64_t x)
{
  x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27, x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* A value in [-1, 1) from `place` (24 bits of its mix: exact in float). */
__host__ __device__ inline float ps_place_value(uint64_t place)
{
  return (float)(ps_place_mix(place) >> 40) / (float)(1 << 24) * 2.f - 1.f;
}

#endif
