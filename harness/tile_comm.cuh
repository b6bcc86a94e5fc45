/* tile_comm.cuh: what perseus_tile_test and perseus_tile_perf share on top of
 * gin_comm.cuh: the NCCL environment per path (LSA: P2P on, every peer of
 * the NVLink node reached by stores; GIN: P2P off, every peer through the
 * plugin), the device communicator with perseus' batch requirement (and its
 * signal ranges checked), the deterministic tile plan both sides derive, and
 * the producer and flush kernels built on perseus_batch.
 * Run in the forked rank processes, except tt_set_env (the parent, before
 * any fork: NCCL reads the variables at init). */
#ifndef PERSEUS_TILE_COMM_CUH
#define PERSEUS_TILE_COMM_CUH

#include <stdlib.h>

#include "gin_comm.cuh"
#include "place_hash.cuh"
#include "perseus/device.cuh"

/* tma: the LSA path with tiles moved by TMA bulk copies (perseus_tile_copy_tma) */
enum { TT_LSA, TT_GIN, TT_TMA, TT_PATH_N };
static const char *const tt_path_names[TT_PATH_N] = {"lsa", "gin", "tma"};
enum { TT_COOP_CTA, TT_COOP_WARP };

/* Signals the programs keep for themselves, [GC_SIG_FIRST, TT_OWN_SIGNALS):
 * unused, so they must read 0 at the end; a batch signal landing there would
 * show. Signal 0 is left to the world barrier (gin_comm.cuh, GC_SIG_FIRST). */
#define TT_OWN_SIGNALS (GC_SIG_FIRST + 2)
#define TT_THREADS 256
#define TT_WARPS (TT_THREADS / 32)
#define TT_TMA_SMEM 32768 /* per CTA: a CTA coop's TMA stages, or 1/TT_WARPS per warp */

/* The parent sets the path's environment before forking the ranks. LSA must
 * leave P2P on (symmetric windows mapped peer to peer, dc.lsaSize == nranks
 * on one NVLink node); GIN must turn it off so that no peer is an LSA peer
 * and every tile crosses the plugin. Both: eager module loading (see
 * gp_default_env), no NVLS (multicast stays off on these hosts). */
static inline void tt_set_env(int path, FILE *f)
{
  if (path == TT_GIN) {
    setenv("NCCL_P2P_DISABLE", "1", 1);
    setenv("NCCL_SHM_DISABLE", "1", 1);
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    gp_default_env(f); /* GIN type 2 (proxy), the plugin, EAGER; prints */
  } else {
    FILE *null = fopen("/dev/null", "w");
    gp_default_env(null ? null : f); /* plugin, EAGER; then undo P2P/SHM off */
    if (null) fclose(null);
    unsetenv("NCCL_P2P_DISABLE");
    unsetenv("NCCL_SHM_DISABLE");
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    fprintf(f, "# env (lsa): NCCL_P2P_DISABLE=(unset) NCCL_SHM_DISABLE=(unset) "
            "NCCL_NVLS_ENABLE=0 CUDA_MODULE_LOADING=%s NCCL_NET_PLUGIN=%s\n",
            getenv("CUDA_MODULE_LOADING"), getenv("NCCL_NET_PLUGIN"));
  }
}

/* In the parent after the GPU probe, under pretend hosts (PERSEUS_TEST_HOSTS):
 * the GIN path runs any split; the LSA path needs NVLink peers, so a host of
 * one rank refuses it, and so does a program that wants every peer on
 * NVLink (mixed = 0; the MoE programs take a mix: NVLink within a host, GIN
 * across). Returns -1 to go on, else main's exit status. */
static inline int tt_check_hosts(int path, int mixed)
{
  if (!gp_sh->hosts || path == TT_GIN || (mixed && gp_sh->host_ranks > 1)) return -1;
  fprintf(stderr, "%s: -p %s with PERSEUS_TEST_HOSTS=%d (%d rank(s) per host): %s; use -p gin\n",
          gp_prog, tt_path_names[path], gp_sh->hosts, gp_sh->host_ranks,
          gp_sh->host_ranks > 1 ? "this program needs every peer on NVLink"
                                : "a rank alone on its host has no NVLink peer");
  return 1;
}

/* The parent's start on one path, after gp_init: the path's environment
 * (tt_set_env, said on stdout), the GPU probe (gc_probe_gpus_min: at least
 * min_gpus; *ngpus settled) and the pretend hosts checked for the path
 * (tt_check_hosts). Returns -1 to go on, else main's exit status. */
static inline int tt_start(int path, int detail, int min_gpus, int *ngpus, double stall_s,
                           int mixed)
{
  tt_set_env(path, stdout);
  int rc = gc_probe_gpus_min(detail, min_gpus, ngpus, stall_s);
  return rc >= 0 ? rc : tt_check_hosts(path, mixed);
}

/* ---- the tile plan --------------------------------------------------------
 * Everything a receiver must know about what a sender sends (how many
 * tiles, their sizes and offsets) is a hash of (seed, iteration, source,
 * destination, tile), so no plan travels between ranks. */
struct tt_plan {
  uint64_t seed;
  int iter, me, nranks, tmax;
  uint32_t emax;       /* largest tile */
  size_t stride, half; /* tile slot; offset of the receive half of the window */
  int fixed_tiles;     /* perf: every pair sends exactly this many tiles */
  uint32_t fixed_size; /* perf: every tile has this size, aligned */
};

__host__ __device__ inline uint64_t tt_hash(const tt_plan &p, int s, int d, int k, int what)
{
  uint64_t x = ps_place_mix(p.seed ^ (uint64_t)p.iter * 0x9e3779b97f4a7c15ull);
  return ps_place_mix(x ^ ((uint64_t)s << 48 | (uint64_t)d << 32 | (uint64_t)(uint32_t)k << 4 |
                     (uint64_t)what));
}

__host__ __device__ inline int tt_ntiles(const tt_plan &p, int s, int d)
{
  return p.fixed_tiles ? p.fixed_tiles : 1 + (int)(tt_hash(p, s, d, 0, 1) % (uint64_t)p.tmax);
}

/* Log-uniform-ish sizes: a uniform draw in 1..emax would almost never give
 * the small and odd sizes that exercise the copy's tails. */
__host__ __device__ inline uint32_t tt_size(const tt_plan &p, int s, int d, int k)
{
  if (p.fixed_size) return p.fixed_size;
  uint64_t h = tt_hash(p, s, d, k, 2);
  uint32_t cap = p.emax >> (h % 20);
  return 1 + (uint32_t)((h >> 8) % (cap ? cap : 1));
}

/* Source and destination misalignment (independent; half of each aligned,
 * the rest 0..15), so LSA copies run every word width, TMA copies both
 * their bulk path and their fallback, and GIN puts start at odd addresses. */
__host__ __device__ inline size_t tt_misalign(const tt_plan &p, int s, int d, int k, int what)
{
  uint64_t h = tt_hash(p, s, d, k, what);
  return p.fixed_size || (h >> 8 & 1) ? 0 : h % 16;
}

__host__ __device__ inline size_t tt_send_off(const tt_plan &p, int d, int k)
{
  return ((size_t)d * p.tmax + k) * p.stride + tt_misalign(p, p.me, d, k, 3);
}

__host__ __device__ inline size_t tt_recv_off(const tt_plan &p, int s, int d, int k)
{
  return p.half + ((size_t)s * p.tmax + k) * p.stride + tt_misalign(p, s, d, k, 4);
}

/* Byte `b` of a tile whose key encodes source, destination, iteration and
 * tile: the multiply spreads the byte index into the top bits, so a shifted
 * or stale byte reads differently. */
__host__ __device__ inline uint8_t tt_pat(uint64_t key, uint64_t b)
{
  uint64_t x = (key ^ b) * 0x9e3779b97f4a7c15ull;
  return (uint8_t)(x >> 56);
}

__host__ __device__ inline uint64_t tt_key(const tt_plan &p, int s, int d, int k)
{
  return tt_hash(p, s, d, k, 5);
}

/* Slot size and window bytes: a send half [destination][tile] and a receive
 * half [source][tile], each slot the largest tile plus 16 for misalignment. */
static inline void tt_layout(tt_plan *p, size_t *win_bytes)
{
  p->stride = ((size_t)p->emax + 16 + 15) & ~(size_t)15;
  p->half = (size_t)p->nranks * p->tmax * p->stride;
  *win_bytes = 2 * p->half;
}

/* ---- device communicator --------------------------------------------------
 * gc_devcomm_create takes no extra resource requirements, so this one links
 * perseus_batch_requirement (and, for GIN, the world GIN barrier) itself.
 * LSA creates no GIN at all: in NCCL 2.28.9 signals asked for only through
 * resource requirements do not activate GIN on one node (dev_runtime.cc:
 * only nNodes > 1, ginForceEnable or the top-level counts do), and every
 * peer is reached by stores. */
static inline ncclResult_t tt_devcomm_create(gc_world *w, int path, perseus_batch_handle *h)
{
  ncclDevCommRequirements reqs;
  ncclDevResourceRequirements breq, barreq;
  ps_devcomm_reqs_init(&reqs);
  if (path == TT_GIN) {
    reqs.ginForceEnable = true; /* one node: nothing else makes NCCL connect GIN */
    reqs.ginContextCount = 1;
    reqs.ginSignalCount = TT_OWN_SIGNALS; /* ours first; the barrier's (2.29) and library's follow */
    GC_NCCL(ps_gin_barrier_requirement(w->comm, ncclTeamWorld(w->comm), &reqs, &w->world_bar,
                                       &barreq, &w->world_bar_signals),
            "world team of %d ranks", w->nranks);
  }
  /* no GIN on the lsa path: no signals reserved (every peer must be LSA,
   * checked below) */
  GC_NCCL(perseus_batch_requirement(w->comm, 0, path == TT_GIN, &reqs, h, &breq),
          "rank %d, context 0", w->rank);
  gp_progress(NULL, -1, "ncclDevCommCreate(%s, perseus batch requirement)",
              tt_path_names[path]);
  ncclResult_t r = ncclDevCommCreate(w->comm, &reqs, &w->dev);
  if (r != ncclSuccess) {
    fprintf(stderr, "%s: rank %d: ncclDevCommCreate(%s) failed: %s (last error: %s)\n", gp_prog,
            w->rank, tt_path_names[path], ncclGetErrorString(r), ncclGetLastError(w->comm));
    return r;
  }
  w->have_dev = 1;
  const ncclDevComm &dc = w->dev;
  unsigned s0 = (unsigned)h->signal0, n = (unsigned)w->nranks;
  if (w->rank == 0)
    printf("# %s: batch handle signal0 %u (signals %u..%u), ctx %d, resource buffer handle %u; "
           "lsaSize %d of %d ranks; GIN contexts %d, signals %d%s\n", tt_path_names[path], s0,
           s0, s0 + n - 1, h->ctx, (unsigned)h->buf, dc.lsaSize, dc.nRanks, dc.ginContextCount,
           dc.ginSignalCount, path == TT_GIN ? "" : " (GIN not used)");
  if (path != TT_GIN) {
    if (dc.lsaSize != w->nranks)
      gc_die(__FILE__, __LINE__, "lsa path: dc.lsaSize %d != %d ranks: not every peer is "
             "reachable by stores (P2P off? more than one NVLink domain?)", dc.lsaSize, w->nranks);
    return ncclSuccess;
  }
  unsigned b0 = (unsigned)w->world_bar.signal0, bn = (unsigned)w->world_bar_signals;
  if (w->rank == 0)
    printf("# gin: program signals %d..%d, world GIN barrier signals %u..%u\n", GC_SIG_FIRST,
           TT_OWN_SIGNALS - 1, b0, b0 + bn - 1);
  /* The resource buffers of the barrier and the library must not overlap:
   * NCCL assigns them in list order, 128-byte aligned (from 2.29 the
   * barrier's is empty). */
  size_t bo = ncclGetResourceBufferOffset(ps_gin_barrier_buffer(w->world_bar)),
         lo = ncclGetResourceBufferOffset(h->buf);
  if (w->rank == 0)
    printf("# gin: resource buffers: world barrier [%zu, +%zu), batch counters [%zu, +%zu)\n", bo,
           barreq.bufferSize, lo, breq.bufferSize);
  if (bo < lo + breq.bufferSize && lo < bo + barreq.bufferSize)
    gc_die(__FILE__, __LINE__, "resource buffers overlap: world barrier [%zu, +%zu), batch "
           "counters [%zu, +%zu)", bo, barreq.bufferSize, lo, breq.bufferSize);
  /* the library takes the user signals after ours (TT_OWN_SIGNALS). NCCL's
   * barrier handle is reported as is: NCCL drops the GIN signal counts of
   * resource requirements when it copies them (deepCopyDevCommRequirements
   * keeps only the buffer fields), so in 2.28 the barrier's signal0 stays 0
   * and is never allocated; user signal 0 is left to it (GC_SIG_FIRST). From
   * 2.29 its signals are user signals after ours (ps_gin_barrier_requirement). */
  if (s0 < TT_OWN_SIGNALS)
    gc_die(__FILE__, __LINE__, "batch signals %u..%u overlap the program's signals 0..%d", s0,
           s0 + n - 1, TT_OWN_SIGNALS - 1);
  if (b0 < s0 + n && s0 < b0 + bn)
    gc_die(__FILE__, __LINE__, "batch signals %u..%u overlap the world barrier's %u..%u", s0,
           s0 + n - 1, b0, b0 + bn - 1);
  if (s0 + n > (unsigned)dc.ginSignalCount)
    gc_die(__FILE__, __LINE__, "batch signals %u..%u beyond the devcomm's %d signals", s0,
           s0 + n - 1, dc.ginSignalCount);
  if (dc.lsaSize != 1)
    gc_die(__FILE__, __LINE__, "gin path: dc.lsaSize %d: some peers are LSA peers and would "
           "bypass GIN (NCCL_P2P_DISABLE=1 not in effect?)", dc.lsaSize);
  if (dc.ginContextCount < 1)
    gc_die(__FILE__, __LINE__, "ncclDevCommCreate gave no GIN context");
  return ncclSuccess;
}

/* Mapped host memory the kernels report into, for the watchdog's text. */
struct tt_prog {
  unsigned prod_blocks, flushed, cons_blocks;
  unsigned long long arrived[GP_MAX_RANKS];
};

/* ---- producer and flush ---------------------------------------------------
 * Work item i is tile k for destination d, destinations in the order
 * me+1, me+2, ...; coop unit u takes items u, u+U, ... (round robin), so any
 * CTA or warp may put to any peer, concurrently with the others. */
template <typename Coop>
__device__ void tt_produce(Coop coop, int u, int U, ncclDevComm const &dc, perseus_batch b,
                           ncclWindow_t win, const tt_plan &p, int fill,
                           const perseus_tma_smem *tma)
{
  int n = p.nranks, total = 0;
  for (int j = 1; j < n; j++) total += tt_ntiles(p, p.me, (p.me + j) % n);
  for (int i = u; i < total; i += U) {
    int j = 1, k = i, d;
    for (;; j++) {
      d = (p.me + j) % n;
      int t = tt_ntiles(p, p.me, d);
      if (k < t) break;
      k -= t;
    }
    uint32_t size = tt_size(p, p.me, d, k);
    size_t soff = tt_send_off(p, d, k), doff = tt_recv_off(p, p.me, d, k);
    if (fill) { /* produce the tile in place, as a megakernel's compute would */
      uint8_t *src = (uint8_t *)ncclGetLocalPointer(win, soff);
      uint64_t key = tt_key(p, p.me, d, k);
      for (uint32_t x = coop.thread_rank(); x < size; x += coop.size()) src[x] = tt_pat(key, x);
    }
    /* every lane's bytes before the put: the LSA branch of put() copies at
     * once, with lanes reading bytes other lanes wrote */
    coop.sync();
    if (tma) b.put(coop, d, win, doff, win, soff, size, *tma);
    else b.put(coop, d, win, doff, win, soff, size);
  }
  (void)dc;
}

__global__ void __launch_bounds__(TT_THREADS)
tt_produce_kernel(ncclDevComm dc, perseus_batch_handle h, ncclWindow_t win, tt_plan p,
                  uint32_t batch, int coop, int tma, int fill, tt_prog *prog)
{
  __shared__ __align__(128) char smem[TT_TMA_SMEM];
  perseus_batch b(dc, h, batch);
  if (coop == TT_COOP_CTA) {
    perseus_tma_smem t = {smem, TT_TMA_SMEM};
    tt_produce(ncclCoopCta(), blockIdx.x, gridDim.x, dc, b, win, p, fill, tma ? &t : NULL);
  } else {
    int warp = threadIdx.x / 32;
    perseus_tma_smem t = {smem + warp * (TT_TMA_SMEM / TT_WARPS), TT_TMA_SMEM / TT_WARPS};
    tt_produce(ncclCoopWarp(), blockIdx.x * TT_WARPS + warp, gridDim.x * TT_WARPS, dc, b, win,
               p, fill, tma ? &t : NULL);
  }
  __syncthreads();
  if (prog && threadIdx.x == 0) atomicAdd_system(&prog->prod_blocks, 1u);
}

/* The grid-wide handoff is the kernel boundary: launched behind the
 * producer on the same stream, no put() is in progress for any peer. One
 * thread per peer. */
__global__ void tt_flush_kernel(ncclDevComm dc, perseus_batch_handle h, uint32_t batch,
                                tt_prog *prog)
{
  perseus_batch b(dc, h, batch);
  for (int j = 1 + threadIdx.x; j < dc.nRanks; j += blockDim.x) b.flush((dc.rank + j) % dc.nRanks);
  __syncthreads();
  if (prog && threadIdx.x == 0) atomicAdd_system(&prog->flushed, 1u);
}

/* Signals a rank posts in one round with `batch`: one per full batch and
 * one for each peer's partial rest. */
static inline uint64_t tt_round_signals(const tt_plan &p, uint32_t batch)
{
  uint64_t s = 0;
  for (int j = 1; j < p.nranks; j++)
    s += ((uint64_t)tt_ntiles(p, p.me, (p.me + j) % p.nranks) + batch - 1) / batch;
  return s;
}

/* The plugin's counters lag its posts by a moment: a peer can see a signal
 * before the proxy thread that posted it has counted it. Waits (up to 2 s)
 * until at least `want` signals were counted since `s0`. Returns 0 or -1
 * (no plugin statistics). */
static inline int tt_stats_settle(const perseus_rma_peer_stats_t *s0, uint64_t want,
                                  perseus_rma_peer_stats_t *s1)
{
  for (int i = 0; i < 2000; i++) {
    if (gp_rma_stats(s1)) return -1;
    if (s1->signals - s0->signals >= want) return 0;
    usleep(1000);
  }
  return 0;
}

#endif
