/* perseus device library: waits that end.
 *
 * A kernel that waits on a peer hangs its GPU when the peer never delivers
 * (it died, it skipped a step, its kernel failed). A perseus_wait_bound
 * gives every such wait a time limit and a shared fault record:
 *
 *   - the first wait of the kernel that gives up records which rank it
 *     waited for, the count it wanted and the last it saw (perseus_wait_fault);
 *   - every wait after that returns false at once, in this kernel and in
 *     later ones given the same record, so a kernel whose peer is gone runs
 *     to its end quickly (its outputs are not valid) instead of timing out
 *     once per wait;
 *   - the host may raise `abort` in the record to end every wait, also
 *     those with no time limit.
 *
 * Put the record where the host can read it while kernels run: pinned host
 * memory mapped into the GPU (cudaHostAlloc with cudaHostAllocMapped). The
 * waits do not read it: a fault known to the GPU is a word in device memory
 * (`state`), and one thread of the GPU at a time looks at the host's record
 * (for the abort) at most every PERSEUS_WAIT_HOST_READ_NS. Hundreds of
 * waiting blocks reading host memory would fill PCIe with reads and slow
 * the blocks still working. */
#ifndef PERSEUS_DEVICE_WAIT_CUH
#define PERSEUS_DEVICE_WAIT_CUH

#include <stdint.h>

/* Written once, by the first wait that gives up, `set` last, so that a
 * reader who sees it set sees the rest; `abort` is the host's alone (GPU
 * atomics on mapped host memory are not atomic with the CPU's). */
typedef struct {
  volatile unsigned int set;   /* 0: no timeout; 1: the fields below say which */
  volatile unsigned int abort; /* nonzero: the host ended every wait */
  unsigned int claim;          /* taken by the GPU thread that records (atomicCAS) */
  unsigned int pad;
  int src;                    /* the rank waited for */
  unsigned int what;          /* the caller's code for what was waited for */
  unsigned long long want;    /* the count waited for */
  unsigned long long got;     /* the last count seen */
  unsigned long long tag;     /* the caller's tag of the wait, e.g. its step */
  unsigned long long waited_ns; /* how long the wait had waited */
} perseus_wait_fault;

/* What a kernel's waits share; pass it to kernels by value. */
typedef struct {
  unsigned long long timeout_ns; /* 0: no limit (a recorded fault still ends a wait) */
  unsigned long long tag;        /* copied into the fault */
  perseus_wait_fault *fault;     /* never NULL */
  /* device memory, 2 words zeroed with the record: [0] nonzero once a fault
   * is known on the GPU; [1] when a GPU thread last read the record (ns) */
  unsigned long long *state;
} perseus_wait_bound;

/* How often at most the GPU reads the host's record (ns). */
#define PERSEUS_WAIT_HOST_READ_NS 100000ull

#if __CUDACC__
/* The GPU's global timer in ns. */
__device__ __forceinline__ unsigned long long perseus_now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* perseus_wait_failed with the clock already read (`now`). */
__device__ inline bool perseus_wait_failed_at(const perseus_wait_bound &b, unsigned long long now) {
  if (*(volatile unsigned long long *)&b.state[0]) return true;
  const unsigned long long last = *(volatile unsigned long long *)&b.state[1];
  if (now - last < PERSEUS_WAIT_HOST_READ_NS || atomicCAS(&b.state[1], last, now) != last) return false;
  if (!(b.fault->set | b.fault->abort)) return false;
  atomicExch(&b.state[0], 1ull);
  return true;
}

/* Whether a fault was recorded (this kernel's waits, an earlier kernel's,
 * or the host's abort, seen within about PERSEUS_WAIT_HOST_READ_NS). */
__device__ inline bool perseus_wait_failed(const perseus_wait_bound &b) {
  return perseus_wait_failed_at(b, perseus_now_ns());
}

/* Records a timeout (the first one only). */
__device__ inline void perseus_wait_record(const perseus_wait_bound &b, int src, unsigned int what,
                                           unsigned long long want, unsigned long long got,
                                           unsigned long long waited_ns) {
  perseus_wait_fault *f = b.fault;
  if (atomicCAS(&f->claim, 0u, 1u) != 0) return;
  f->src = src, f->what = what, f->want = want, f->got = got, f->tag = b.tag, f->waited_ns = waited_ns;
  __threadfence_system();
  f->set = 1;
  __threadfence_system();
  atomicExch(&b.state[0], 1ull);
}

/* Polls `count()` (which acquires what it counts) until it reaches `want`
 * in rolling arithmetic: true; false when the bound's time passed (the fault
 * is recorded, naming `src` and `what`) or a fault was recorded. Naps from
 * 32 ns growing to about a microsecond between polls: waiting blocks leave
 * the memory system to the blocks still working. */
template <typename Count>
__device__ bool perseus_wait_until(const perseus_wait_bound &b, int src, unsigned int what, uint64_t want,
                                   Count count) {
  unsigned long long t0 = 0;
  unsigned ns = 32;
  for (unsigned n = 0;; n++) {
    const uint64_t got = count();
    if ((int64_t)(got - want) >= 0) return true;
    if (n % 32 == 31) {
      const unsigned long long now = perseus_now_ns();
      if (perseus_wait_failed_at(b, now)) return false;
      if (!t0) t0 = now;
      else if (b.timeout_ns && now - t0 > b.timeout_ns) {
        perseus_wait_record(b, src, what, want, got, now - t0);
        return false;
      }
    }
    __nanosleep(ns);
    if (ns < 1024) ns *= 2;
  }
}
#endif

#endif
