/* A recursive lock whose release is one plain store: the one-sided
 * engine's per-comm lock, which every NCCL call takes. A pthread mutex's
 * release is a locked exchange, and a locked instruction waits for every
 * store before it to leave the core: right after a post, that is the store
 * of a descriptor into a line the NIC (or a model NIC's thread) last read,
 * a cross-core round trip the proxy would wait out on every call. The
 * price: no one wakes a waiter. Waiters spin briefly (the holders are NCCL's
 * proxy thread and the engine thread, whose holds are short), then yield,
 * then sleep in short naps, so that a hold that lasts (registration, close,
 * a descheduled holder on a crowded host) does not cost a core. */
#ifndef PS_LOCK_H
#define PS_LOCK_H

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

typedef struct {
  uintptr_t owner; /* atomic: the holder's pthread_self(), 0 when free */
  unsigned depth;  /* the holder's */
} ps_lock_t;

#define PS_LOCK_SPINS 200  /* tries before a waiter yields its core */
#define PS_LOCK_YIELDS 400 /* tries before it naps between tries */
#define PS_LOCK_NAP_NS 20000

static inline void ps_lock_take(ps_lock_t *l) {
  uintptr_t me = (uintptr_t)pthread_self();
  if (__atomic_load_n(&l->owner, __ATOMIC_RELAXED) == me) { /* only we set it to us */
    l->depth++;
    return;
  }
  for (unsigned tries = 0;; tries++) {
    uintptr_t none = 0;
    if (__atomic_load_n(&l->owner, __ATOMIC_RELAXED) == 0 &&
        __atomic_compare_exchange_n(&l->owner, &none, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
      break;
    if (tries >= PS_LOCK_YIELDS) {
      struct timespec nap = {0, PS_LOCK_NAP_NS};
      nanosleep(&nap, NULL);
    } else if (tries >= PS_LOCK_SPINS) {
      sched_yield();
    }
  }
  l->depth = 1;
}

static inline void ps_lock_give(ps_lock_t *l) {
  if (--l->depth == 0) __atomic_store_n(&l->owner, 0, __ATOMIC_RELEASE);
}

#endif
