/* The model fabric's bounded rings (pm.h says what the fabric is): slots
 * that each begin with a sequence word saying whose turn it is. Producers
 * claim a slot (a compare-and-swap on the ring's head when several share
 * it), fill it and store pos + 1 into its sequence word; the one consumer
 * reads slots in order and hands each back to the producers' next lap. */
#ifndef PM_RING_H
#define PM_RING_H

#include <stdatomic.h>
#include <stdint.h>

/* Claims the next slot of the ring of n slots `stride` bytes apart at base,
 * whose producers share *head: 1 with *pos (the caller fills slot pos % n,
 * then stores pos + 1 into its sequence word, releasing it), 0 when full. */
static inline int pm_ring_claim(_Atomic uint64_t *head, void *base, size_t stride, uint64_t n, uint64_t *pos) {
  uint64_t p = atomic_load_explicit(head, memory_order_relaxed);
  for (;;) {
    _Atomic uint64_t *seq = (_Atomic uint64_t *)((char *)base + (p % n) * stride);
    uint64_t have = atomic_load_explicit(seq, memory_order_acquire);
    if (have == p) {
      if (atomic_compare_exchange_weak(head, &p, p + 1)) return *pos = p, 1;
    } else if (have < p) {
      return 0;
    } else {
      p = atomic_load_explicit(head, memory_order_relaxed);
    }
  }
}

/* The consumer's side: the slot at position pos once its producer released
 * it, else NULL; pm_ring_free hands it to the producers' next lap. */
static inline void *pm_ring_ready(void *base, size_t stride, uint64_t n, uint64_t pos) {
  _Atomic uint64_t *seq = (_Atomic uint64_t *)((char *)base + (pos % n) * stride);
  return atomic_load_explicit(seq, memory_order_acquire) == pos + 1 ? (void *)seq : NULL;
}

static inline void pm_ring_free(void *slot, uint64_t n, uint64_t pos) {
  atomic_store_explicit((_Atomic uint64_t *)slot, pos + n, memory_order_release);
}

#endif
