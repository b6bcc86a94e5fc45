/* perseus device library: tile puts with decoupled (batched) signaling.
 *
 * A megakernel puts tiles to peers and tells each peer how many arrived.
 * Signaling every tile costs one ordered signal per tile; across nodes every
 * one of them is a fence the proxy or NIC must keep behind its data. Here any
 * number of CTAs add tiles for a destination, and exactly ONE signal goes to
 * that peer per batch of `batch` tiles (or per explicit flush), carrying the
 * tile count and covering every tile put to the peer before it.
 *
 * Built only on NCCL's device API (ncclDevComm, ncclGin, LSA pointers), so it
 * works with any GIN backend (perseus' proxy plugin, NCCL's IB proxy, GDAKI):
 *   - LSA peers (same NVLink domain): tiles are stored directly into the peer's
 *     window; the count is a system-scope atomic add on the peer's counter.
 *   - other peers: ncclGin::put with no remote action; the batch's signal is
 *     ncclGin::signal(SignalAdd{count}) on the same GIN context, which NCCL
 *     makes visible only after every earlier put on that context to that peer.
 *     A batch of one tile carries its signal in the put itself (one proxy
 *     descriptor per tile, not two).
 *
 * Counts are cumulative (never reset between iterations): a receiver waits
 * for "at least N tiles from source s in total", compared with wrap-safe
 * (rolling) arithmetic, so no reset races the next iteration's adds.
 *
 * Resources are reserved through the devcomm's requirements
 * (perseus_batch_requirement), never assumed: one GIN signal per source rank
 * (after the user's own) and 32 bytes of resource buffer per rank. */
#ifndef PERSEUS_DEVICE_BATCH_CUH
#define PERSEUS_DEVICE_BATCH_CUH

#include <nccl.h>
#include <nccl_device.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "perseus/device/tile.cuh"
#include "perseus/device/wait.cuh"

/* What a devcomm reserved for batching. Filled by ncclDevCommCreate through
 * the requirement below; pass it to kernels by value. */
typedef struct {
  ncclGinSignal_t signal0;    /* GIN signal of source rank s: signal0 + s */
  ncclDevResourceHandle_t buf; /* per-rank counters (layout: PERSEUS_BATCH_*) */
  int ctx;                     /* the GIN context every tile and signal uses */
} perseus_batch_handle;

/* Resource buffer words, per rank r of the world: */
enum {
  PERSEUS_BATCH_ADDED = 0,  /* [r] tiles this rank added for destination r */
  PERSEUS_BATCH_BASE = 1,   /* [r] ADDED at the last flush: batches count from here */
  PERSEUS_BATCH_LSA_IN = 2, /* [r] tiles LSA peer r stored here (it adds remotely) */
  PERSEUS_BATCH_SEEN = 3,   /* [r] tiles from r a consumer has taken (perseus_recv::next) */
  PERSEUS_BATCH_WORDS = 4
};

/* Host: fresh devcomm requirements for the NCCL these headers come from.
 * From 2.29 the struct is versioned and ncclDevCommCreate refuses one
 * without NCCL's magic, so it starts from NCCL's initializer (a zeroed one
 * builds but fails at run time); before 2.29, all zero. */
static inline void perseus_devcomm_requirements_init(ncclDevCommRequirements_t *reqs) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
  *reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  memset(reqs, 0, sizeof *reqs);
#endif
}

/* Host: reserves the library's resources in the devcomm requirements
 * `reqs`, before ncclDevCommCreate(comm, reqs, ...):
 *   - its GIN signals (one per rank) as the next block of the user signal
 *     range: h->signal0 = reqs->ginSignalCount, which grows by nranks. So
 *     declare your own signals first (ids 0..k-1 stay yours). Not through
 *     ncclDevResourceRequirements.ginSignalCount/outGinSignalStart: NCCL
 *     2.28.9 copies the requirement list keeping only its buffer fields, so
 *     those signals are never allocated (its own GIN barrier's signal0 stays
 *     0, aliasing user signal 0); the user range is guaranteed to start at 0
 *     and to be this devcomm's.
 *   - its counters (32 bytes per rank) as a resource buffer: `req` (storage
 *     you keep until ncclDevCommCreate returns) is linked at the head of
 *     reqs->resourceRequirementsList and NCCL writes its handle into h->buf.
 *     Reset them before first use (perseus_batch_reset).
 * `ctx` picks the GIN context every tile and signal uses (0 if unsure).
 * `gin`: 0 when the devcomm will have no GIN at all (every peer reachable by
 * NVLink stores; refused, ncclInvalidArgument, where some are not): then no
 * signals are reserved. Reserving signals does not
 * make NCCL connect GIN on a single node: set reqs->ginForceEnable when peers
 * may be beyond NVLink (forcing it where there is no GIN backend fails). */
static inline ncclResult_t perseus_batch_requirement(ncclComm_t comm, int ctx, int gin,
                                                     ncclDevCommRequirements_t *reqs,
                                                     perseus_batch_handle *h,
                                                     ncclDevResourceRequirements_t *req) {
  int nranks = 0;
  if (!reqs || !h || !req || ctx < 0 || reqs->ginSignalCount < 0) return ncclInvalidArgument;
  ncclResult_t rc = ncclCommCount(comm, &nranks);
  if (rc != ncclSuccess) return rc;
  /* peers beyond NVLink need GIN: without its signals their counts could not arrive */
  if (!gin && ncclTeamLsa(comm).nRanks != nranks) return ncclInvalidArgument;
  memset(req, 0, sizeof *req);
  memset(h, 0, sizeof *h);
  h->ctx = ctx;
  if (gin) {
    h->signal0 = (ncclGinSignal_t)reqs->ginSignalCount;
    reqs->ginSignalCount += nranks;
  }
  req->bufferSize = (size_t)nranks * PERSEUS_BATCH_WORDS * sizeof(uint64_t);
  req->bufferAlign = 16;
  req->outBufferHandle = &h->buf;
  req->next = reqs->resourceRequirementsList;
  reqs->resourceRequirementsList = req;
  return ncclSuccess;
}

/* Host: the largest batch up to 64 that divides n, for a producer that puts
 * n tiles to a peer each round: whole batches only, so no flush is needed. */
static inline uint32_t perseus_batch_whole(int n) {
  for (int d = 64; d > 1; d--)
    if (n % d == 0) return (uint32_t)d;
  return 1;
}

#if __CUDACC__
/* Wrap-safe "a has reached b" for cumulative counts. */
__device__ __forceinline__ bool perseus_reached(uint64_t a, uint64_t b) {
  return (int64_t)(a - b) >= 0;
}

/* The LSA index of world rank `peer`, or -1 when it is not reachable by loads
 * and stores (then tiles go through GIN). */
__device__ __forceinline__ int perseus_lsa_index(ncclDevComm const &dc, int peer) {
  int l = peer - (dc.rank - dc.lsaRank);
  return (l >= 0 && l < dc.lsaSize) ? l : -1;
}

__device__ __forceinline__ uint64_t *perseus_batch_word(ncclDevComm const &dc,
                                                        perseus_batch_handle h, int word, int r) {
  return (uint64_t *)ncclGetResourceBufferLocalPointer(dc, h.buf) + (size_t)word * dc.nRanks + r;
}

/* Zeroes this rank's counts of `h`: its resource-buffer words and its GIN
 * batch signals (one per GIN source rank). A new devcomm's counts need not
 * start at 0: NCCL (2.28) gives GIN signals from a pool without clearing
 * them, so a range that a destroyed devcomm used starts with its old counts,
 * and no NCCL version promises to order its own clearing of a resource
 * buffer before a peer's first add. So before the first put or signal
 * through `h`: every rank runs this (the threads of one kernel, `tid` of
 * `nthreads`), then every rank passes a barrier (e.g. a one-word
 * ncclAllReduce behind the kernel on its stream), so that no peer's add can
 * land before the reset (perseus_batch_devcomm_create does all of it). */
__device__ __forceinline__ void perseus_batch_reset(ncclDevComm const &dc, perseus_batch_handle h,
                                                    int tid, int nthreads) {
  uint64_t *words = perseus_batch_word(dc, h, 0, 0);
  for (int i = tid; i < PERSEUS_BATCH_WORDS * dc.nRanks; i += nthreads) words[i] = 0;
  /* no GIN: nothing to reset. Otherwise the same ncclGin{dc, h.ctx} the
   * puts use, whatever NCCL makes of a ctx beyond its count. */
  if (dc.ginContextCount == 0) return;
  ncclGin gin{dc, h.ctx};
  for (int r = tid; r < dc.nRanks; r += nthreads)
    if (perseus_lsa_index(dc, r) < 0) gin.resetSignal(h.signal0 + (ncclGinSignal_t)r);
}

/* Sender side. Construct one per thread (cheap: references and registers).
 * `batch` (>= 1) tiles per signal: 1 is per-tile signaling. Every rank must
 * use the same handle; batch may differ per call site and per run. */
struct perseus_batch {
  ncclDevComm const &dc;
  perseus_batch_handle h;
  uint32_t batch;

  __device__ perseus_batch(ncclDevComm const &dc_, perseus_batch_handle h_, uint32_t batch_)
      : dc(dc_), h(h_), batch(batch_ ? batch_ : 1) {}

  /* Puts one tile: `bytes` from src window offset to peer's dst window offset,
   * and counts it; the put that completes a batch sends the batch's signal.
   * Called by every thread of `coop` (a warp, or a CTA: ncclCoopCta{}), whose
   * threads produced the tile in src beforehand (put syncs the coop first).
   * The source may be reused when put returns for an LSA peer, after a flush
   * of the GIN context (ncclGin::flush) for a GIN peer; the destination slot
   * belongs to the peer until it consumed the tile. Any number of coops, in
   * any CTAs, may put to the same peer concurrently. */
  template <typename Coop>
  __device__ void put(Coop coop, int peer, ncclWindow_t dst, size_t dst_off, ncclWindow_t src,
                      size_t src_off, size_t bytes) const {
    put_impl(coop, peer, dst, dst_off, src, src_off, bytes, nullptr);
  }

  /* The same, but an LSA peer's tile moves by TMA bulk copies
   * (perseus_tile_copy_tma) through `smem`, the coop's own shared memory
   * for the call; a GIN peer's tile does not use it. */
  template <typename Coop>
  __device__ void put(Coop coop, int peer, ncclWindow_t dst, size_t dst_off, ncclWindow_t src,
                      size_t src_off, size_t bytes, perseus_tma_smem smem) const {
    put_impl(coop, peer, dst, dst_off, src, src_off, bytes, &smem);
  }

  /* The same for an LSA peer (perseus_lsa_index(dc, peer) >= 0) only, from
   * any local memory `src`, a window or not: what put does for such a peer.
   * A GIN put needs a registered source: use put. */
  template <typename Coop>
  __device__ void store(Coop coop, int peer, ncclWindow_t dst, size_t dst_off, const void *src,
                        size_t bytes) const {
    store_impl(coop, peer, perseus_lsa_index(dc, peer), dst, dst_off, (const char *)src, bytes,
               nullptr);
  }

 private:
  template <typename Coop>
  __device__ void put_impl(Coop &coop, int peer, ncclWindow_t dst, size_t dst_off,
                           ncclWindow_t src, size_t src_off, size_t bytes,
                           const perseus_tma_smem *tma) const {
    int l = perseus_lsa_index(dc, peer);
    if (l >= 0) {
      store_impl(coop, peer, l, dst, dst_off, (const char *)ncclGetLocalPointer(src, src_off),
                 bytes, tma);
      return;
    }
    coop.sync(); /* every lane's part of the tile is written */
    if (coop.thread_rank() == 0) {
      ncclGin gin{dc, h.ctx};
      if (batch == 1) {
        /* a batch of one: its signal rides in the put, one proxy descriptor
         * and one network operation instead of two; NCCL applies it after
         * the put's bytes */
        gin.put(ncclTeamWorld(dc), peer, dst, dst_off, src, src_off, bytes,
                ncclGin_SignalAdd{h.signal0 + (ncclGinSignal_t)dc.rank, 1});
        atomicAdd((unsigned long long *)perseus_batch_word(dc, h, PERSEUS_BATCH_ADDED, peer), 1ULL);
      } else {
        gin.put(ncclTeamWorld(dc), peer, dst, dst_off, src, src_off, bytes);
        count(peer, l, 1);
      }
    }
    coop.sync();
  }

  /* An LSA peer's tile: stores into its window through the LSA pointer, then the count. */
  template <typename Coop>
  __device__ void store_impl(Coop &coop, int peer, int l, ncclWindow_t dst, size_t dst_off,
                             const char *s, size_t bytes, const perseus_tma_smem *tma) const {
    coop.sync(); /* every lane's part of the tile is written */
    char *d = (char *)ncclGetLsaPointer(dst, dst_off, l);
    if (tma) perseus_tile_copy_tma(coop, d, s, bytes, *tma);
    else perseus_tile_copy(coop, d, s, bytes);
    coop.sync(); /* every lane's stores before the count's release */
    if (coop.thread_rank() == 0) count(peer, l, 1);
    coop.sync();
  }

 public:

  /* Closes the peer's partial batch: one signal for the tiles added since
   * the last full batch or flush (none if there are none). Call from one
   * thread, when no put() to this peer is in progress (e.g. after a
   * grid-wide sync, or from the last producer); later puts count their
   * batches from here. */
  __device__ void flush(int peer) const {
    uint64_t added = *(volatile uint64_t *)perseus_batch_word(dc, h, PERSEUS_BATCH_ADDED, peer);
    volatile uint64_t *base = perseus_batch_word(dc, h, PERSEUS_BATCH_BASE, peer);
    uint64_t rest = (added - *base) % batch;
    if (rest) signal(peer, perseus_lsa_index(dc, peer), rest);
    *base = added;
    __threadfence();
  }

  /* Counts one tile that was stored straight into LSA peer `peer`'s window
   * (perseus_lsa_index(dc, peer) >= 0) instead of put: by this thread, by
   * threads of its coop synchronized with it since (a __syncwarp or
   * __syncthreads, as put does), or by other threads whose stores this
   * thread acquired, each made visible at system scope first
   * (__threadfence_system before the flag or atomic this thread read).
   * Signals like put does. One thread. */
  __device__ void stored(int peer) const {
    __threadfence_system();
    count(peer, perseus_lsa_index(dc, peer), 1);
  }

  /* Tiles added for `peer` so far and tiles already covered by signals. */
  __device__ uint64_t added(int peer) const {
    return *(volatile uint64_t *)perseus_batch_word(dc, h, PERSEUS_BATCH_ADDED, peer);
  }

 private:
  __device__ void count(int peer, int l, uint64_t n) const {
    __threadfence_system(); /* the tile (stores or put) before the count */
    uint64_t after =
        atomicAdd((unsigned long long *)perseus_batch_word(dc, h, PERSEUS_BATCH_ADDED, peer), n) + n;
    uint64_t base = *(volatile uint64_t *)perseus_batch_word(dc, h, PERSEUS_BATCH_BASE, peer);
    /* the put that fills a batch closes it; later batches' closers may
     * signal first: adds commute, and each signal covers every earlier tile */
    if ((after - base) % batch == 0) signal(peer, l, batch);
  }

  __device__ void signal(int peer, int l, uint64_t n) const {
    if (l >= 0) {
      uint64_t *in = (uint64_t *)ncclGetResourceBufferLsaPointer(dc, h.buf, l) +
                     (size_t)PERSEUS_BATCH_LSA_IN * dc.nRanks + dc.rank;
      __threadfence_system();
      atomicAdd_system((unsigned long long *)in, n);
    } else {
      ncclGin gin{dc, h.ctx};
      gin.signal(ncclTeamWorld(dc), peer, ncclGin_SignalAdd{h.signal0 + (ncclGinSignal_t)dc.rank, n});
    }
  }
};

/* Receiver side. */
struct perseus_recv {
  ncclDevComm const &dc;
  perseus_batch_handle h;

  __device__ perseus_recv(ncclDevComm const &dc_, perseus_batch_handle h_) : dc(dc_), h(h_) {}

  /* Tiles that arrived from `src` in total (acquire: their bytes are readable). */
  __device__ uint64_t arrived(int src) const {
    int l = perseus_lsa_index(dc, src);
    if (l >= 0) {
      uint64_t v = *(volatile uint64_t *)perseus_batch_word(dc, h, PERSEUS_BATCH_LSA_IN, src);
      __threadfence_system();
      return v;
    }
    ncclGin gin{dc, h.ctx};
    return gin.readSignal(h.signal0 + (ncclGinSignal_t)src);
  }

  /* Non-blocking: whether at least `total` tiles from `src` arrived. For
   * schedulers that must not spin. Any thread. */
  __device__ bool poll(int src, uint64_t total) const { return perseus_reached(arrived(src), total); }

  /* Blocks until at least `total` tiles (cumulative since the start) from
   * `src` arrived; afterwards every byte of those tiles is readable by the
   * calling thread (acquire). Any thread; spins with no limit, so a peer
   * that never sends hangs the caller: wait_for is the bounded form. */
  __device__ void wait(int src, uint64_t total) const {
    while (!poll(src, total)) {
    }
  }

  /* wait, bounded (perseus/device/wait.cuh): true once `total` tiles from
   * `src` arrived (acquire, as wait); false when the bound's time passed
   * (the fault names `src` and the caller's `what`) or a fault was already
   * recorded. Any thread; naps between polls. */
  __device__ bool wait_for(int src, uint64_t total, const perseus_wait_bound &b, unsigned int what = 0) const {
    return perseus_wait_until(b, src, what, total, [&] { return arrived(src); });
  }

  /* For consumers that let the library keep the running total: reserves the
   * next `ntiles` tiles from `src` and returns the total to wait for. One
   * caller per source at a time (or all consumers of `src` serialised). */
  __device__ uint64_t next(int src, uint64_t ntiles) const {
    return atomicAdd((unsigned long long *)perseus_batch_word(dc, h, PERSEUS_BATCH_SEEN, src), ntiles) + ntiles;
  }
};

/* Host: device words for a set-up's agreement (a small all-reduce every
 * rank takes part in, e.g. whether each one's set-up succeeded). Module
 * memory, not an allocation: a rank whose allocations fail (device memory
 * exhausted) can still take part, so that its peers learn of its failure
 * instead of waiting for it in the next collective. Set-ups take the slots
 * in turn, so that set-ups of other comms on other threads use other words. */
#define PERSEUS_AGREE_SLOTS 32
#define PERSEUS_AGREE_WORDS 64
static __device__ long long perseus_agree_words[PERSEUS_AGREE_SLOTS][PERSEUS_AGREE_WORDS];
static inline cudaError_t perseus_agree_slot(long long **words) {
  static unsigned next;
  void *base = NULL;
  const cudaError_t ce = cudaGetSymbolAddress(&base, perseus_agree_words);
  const unsigned slot = __atomic_fetch_add(&next, 1u, __ATOMIC_RELAXED) % PERSEUS_AGREE_SLOTS;
  *words = ce == cudaSuccess ? (long long *)base + (size_t)slot * PERSEUS_AGREE_WORDS : NULL;
  return ce;
}

/* One CTA: this rank's counts of `h` back to 0. */
static __global__ void perseus_batch_reset_kernel(ncclDevComm dc, perseus_batch_handle h) {
  perseus_batch_reset(dc, h, threadIdx.x, blockDim.x);
}

/* Host, collective over `comm` (the caller's GPU current): a devcomm whose
 * only resource is one batching handle on GIN context 0, for operators that
 * need nothing more. `gin` as in perseus_batch_requirement (when set, GIN is
 * forced on). Every rank's counts are reset and a barrier (a one-word
 * ncclAllReduce on the legacy stream) keeps any peer's add behind the
 * reset. On failure nothing is left created and *failed (when not NULL)
 * names the call that failed. */
static inline ncclResult_t perseus_batch_devcomm_create(ncclComm_t comm, int gin, ncclDevComm *dev,
                                                        perseus_batch_handle *h, const char **failed) {
  ncclDevResourceRequirements_t req;
  ncclDevCommRequirements_t reqs;
  const char *what = "perseus_batch_requirement (GIN context 0)";
  perseus_devcomm_requirements_init(&reqs);
  reqs.ginForceEnable = gin;
  reqs.ginContextCount = 1;
  ncclResult_t rc = perseus_batch_requirement(comm, 0, gin, &reqs, h, &req);
  if (rc == ncclSuccess) {
    what = "ncclDevCommCreate (one perseus batch handle)";
    rc = ncclDevCommCreate(comm, &reqs, dev);
  }
  if (rc != ncclSuccess) {
    if (failed) *failed = what;
    return rc;
  }
  /* Every rank takes part in the barrier, carrying whether its own reset
   * failed (maximum over the ranks), so that all of them fail together
   * instead of some waiting in it for ever. */
  static thread_local char why[192];
  long long *word = NULL, own = 0, any = 0;
  cudaError_t ce = perseus_agree_slot(&word);
  if (ce != cudaSuccess) {
    snprintf(why, sizeof why, "the barrier's word (perseus_agree_slot): %s", cudaGetErrorString(ce));
    what = why, rc = ncclUnhandledCudaError;
  } else {
    (void)cudaGetLastError(); /* an earlier, unrelated error is not the reset's */
    if (gin && dev->ginContextCount < 1) {
      what = "ncclDevCommCreate gave no GIN context", own = 1;
    } else {
      perseus_batch_reset_kernel<<<1, 128>>>(*dev, *h);
      if ((ce = cudaGetLastError()) != cudaSuccess) {
        snprintf(why, sizeof why, "launching the batch counts' reset: %s", cudaGetErrorString(ce));
        what = why, own = 1;
      }
    }
    if ((ce = cudaMemcpy(word, &own, sizeof own, cudaMemcpyHostToDevice)) != cudaSuccess) {
      snprintf(why, sizeof why, "the barrier's word: %s", cudaGetErrorString(ce));
      what = why, rc = ncclUnhandledCudaError;
    } else if ((rc = ncclAllReduce(word, word, 1, ncclInt64, ncclMax, comm, 0)) != ncclSuccess) {
      what = "ncclAllReduce (the barrier after the reset)";
    } else if ((ce = cudaMemcpy(&any, word, sizeof any, cudaMemcpyDeviceToHost)) != cudaSuccess) {
      snprintf(why, sizeof why, "the barrier after the reset: %s", cudaGetErrorString(ce));
      what = why, rc = ncclUnhandledCudaError;
    } else if (any) {
      if (!own) what = "another rank could not reset its batch counts (its error says why)";
      rc = ncclInvalidUsage;
    }
  }
  if (rc != ncclSuccess) {
    (void)ncclDevCommDestroy(comm, dev);
    if (failed) *failed = what;
  }
  return rc;
}
#endif /* __CUDACC__ */

#endif
