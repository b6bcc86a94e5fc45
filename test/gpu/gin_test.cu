/* perseus_gin_test: NCCL's device API (ncclGin, proxy backend) over the
 * perseus plugin, every byte verified on the GPU.
 *
 * The parent forks a GPU probe, then one process per GPU (rank r on device
 * r) and never calls CUDA itself (gin_proc.c: rank 0's ncclUniqueId reaches
 * the others through a shared mapping made before the fork; a watchdog names
 * the mode, iteration and GPU stage of a hung rank). Each rank joins the
 * communicator, registers a send and a receive window (ncclMemAlloc +
 * ncclCommWindowRegister, symmetric) and creates a device communicator with
 * GIN signals, counters and a world GIN barrier. Per iteration and peer, a
 * plan drawn from the seed (gin_plan.c; every rank derives what every other
 * rank sends) gives the tiles: count, sizes, the gap before each and which
 * tile ends a batch and carries its signal.
 * Kernels, in stream order:
 *   fill    writes each tile's pattern (source rank, destination, iteration,
 *           tile, byte index) into the send window;
 *   put     world GIN barrier, then one warp per destination: the lanes post
 *           a batch's leading tiles as plain puts in parallel, __syncwarp, and
 *           lane 0 posts the batch's last tile with its signal (what a
 *           megakernel does); every put also counts its local completion;
 *           flush, wait for the counters;
 *   verify  per source, wait for both of its signals, then every tile byte
 *           and every gap byte (sentinel) is checked, counting mismatches;
 *   finish  each signal must hold exactly its expected value; put mode
 *           resets it for the next iteration.
 * Resets must not race adds: resetSignal is a plain store to the signal
 * word, so a next-iteration add landing before it would be lost, and a
 * this-iteration add landing after it would count towards the next. A rank
 * resets only after its own waits saw every add of this iteration, and a
 * sender posts the next iteration's adds only after the next put kernel's
 * world barrier, which every receiver enters after its reset (stream order,
 * release fence).
 * The same barrier keeps a sender from overwriting a tile the receiver has
 * not verified yet. alltoall never resets: its per-peer signal grows by one
 * per iteration and the wait compares with the running total.
 * Exit: 0 all ranks passed, 1 a failure (mismatch, error, watchdog), 77 no GPU
 * or fewer than asked. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <time.h>

#include "gin_comm.cuh"
#include "gin_plan.h"
#include "opts.h"

#define VERIFY_BLOCKS 16 /* blocks per source in the verify kernel */
#define PUT_WARPS 8       /* warps of the put kernel; each takes destinations in turn */

enum { ST_IDLE, ST_BARRIER, ST_POST, ST_FLUSH, ST_WAIT, ST_FINISH };

struct check_result {
  unsigned long long mismatches, first_key;
  unsigned sig_flag, sig_src;
  unsigned long long sig_inc, sig_add;
};

struct dev_progress { /* mapped host memory the kernels report into */
  volatile unsigned stage;
  volatile unsigned waiting[GP_MAX_RANKS]; /* 1 waiting, 2 done */
  volatile unsigned long long seen_inc[GP_MAX_RANKS], seen_add[GP_MAX_RANKS];
};

/* ---- the pattern: the same on host and device ----------------------------- */

__host__ __device__ inline uint32_t mix32(uint32_t x)
{
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}
__host__ __device__ inline uint32_t tile_key(int mode, int src, int dst, int iter, int tile)
{
  uint32_t k = mix32((uint32_t)src * 0x9E3779B1u ^ (uint32_t)dst);
  k = mix32(k ^ (uint32_t)iter * 0x85EBCA77u);
  return mix32(k ^ ((uint32_t)tile << 4 | (uint32_t)mode));
}
__host__ __device__ inline uint8_t pat_byte(uint32_t key, uint64_t i)
{
  uint32_t w = mix32(key ^ (uint32_t)(i >> 2) * 0x27D4EB2Fu ^ (uint32_t)(i >> 34));
  return (uint8_t)(w >> ((i & 3) * 8));
}

/* first-mismatch key: smaller is earlier; src 10 bits, kind 2 (0 data,
 * 1 sentinel), tile 12, byte 32, the byte found 8 */
__device__ inline unsigned long long mm_key(int src, int kind, int tile, uint64_t byte, uint8_t got)
{
  return (unsigned long long)(src & 0x3ff) << 54 | (unsigned long long)kind << 52 |
         (unsigned long long)(tile & 0xfff) << 40 | (byte & 0xffffffffull) << 8 | got;
}

/* ---- kernels --------------------------------------------------------------- */

__global__ void fill_kernel(uint8_t *send, const gt_peer *plans, const gt_tile *tiles,
                            int tmax, size_t region, int me, int iter, int mode)
{
  const gt_peer &p = plans[blockIdx.y];
  uint8_t *base = send + (size_t)p.rank * region;
  for (int k = 0; k < p.ntiles; k++) {
    const gt_tile &t = tiles[blockIdx.y * tmax + k];
    uint32_t key = tile_key(mode, me, p.rank, iter, k);
    for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < t.size; i += gridDim.x * blockDim.x)
      base[t.off + i] = pat_byte(key, i);
  }
}

__device__ inline void put_tile(const ncclGin &gin, ncclTeam world, const gt_peer &p,
                                const gt_tile &t, ncclWindow_t send, ncclWindow_t recv,
                                size_t region)
{
  size_t src_off = (size_t)p.rank * region + t.off, dst_off = (size_t)world.rank * region + t.off;
  ncclGin_CounterInc done{p.counter};
  if (t.action == GT_ACT_INC)
    gin.put(world, p.rank, recv, dst_off, send, src_off, t.size, ncclGin_SignalInc{p.sig_inc}, done);
  else if (t.action == GT_ACT_ADD)
    gin.put(world, p.rank, recv, dst_off, send, src_off, t.size,
            ncclGin_SignalAdd{p.sig_add, t.value}, done);
  else
    gin.put(world, p.rank, recv, dst_off, send, src_off, t.size, ncclGin_None{}, done);
}

__global__ void __launch_bounds__(32 * PUT_WARPS) put_kernel(ncclDevComm dc, ncclGinBarrierHandle bar, ncclWindow_t send,
                           ncclWindow_t recv, const gt_peer *plans, const gt_tile *tiles,
                           int nslots, int tmax, size_t region, int nctx, dev_progress *prog)
{
  if (threadIdx.x == 0) prog->stage = ST_BARRIER;
  gc_world_barrier(dc, bar);
  if (threadIdx.x == 0) prog->stage = ST_POST;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  for (int s = warp; s < nslots; s += nwarps) {
    const gt_peer &p = plans[s];
    const gt_tile *t = tiles + s * tmax;
    ncclGin gin{dc, p.ctx};
    for (int k = 0; k < p.ntiles;) {
      int end = k; /* the batch's last tile carries the signal (the plan ends with one) */
      while (end < p.ntiles - 1 && t[end].action == GT_ACT_NONE) end++;
      for (int j = k + lane; j < end; j += 32)
        put_tile(gin, ncclTeamWorld(dc), p, t[j], send, recv, region);
      __syncwarp(); /* the plain puts hold their queue slots before the signal's */
      if (lane == 0) put_tile(gin, ncclTeamWorld(dc), p, t[end], send, recv, region);
      __syncwarp();
      k = end + 1;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) prog->stage = ST_FLUSH;
  for (int c = 0; c < nctx; c++) {
    ncclGin gin{dc, c};
    gin.flush(ncclCoopCta()); /* the send window may be refilled after this kernel */
  }
  for (int s = threadIdx.x; s < nslots; s += blockDim.x) {
    ncclGin gin{dc, plans[s].ctx};
    gin.waitCounter(ncclCoopThread(), plans[s].counter, plans[s].counter_exp);
  }
}

__global__ void verify_kernel(ncclDevComm dc, const uint8_t *recv, const gt_peer *plans,
                              const gt_tile *tiles, int tmax, size_t region, int iter, int mode,
                              check_result *res, dev_progress *prog)
{
  int s = blockIdx.y;
  const gt_peer &p = plans[s];
  ncclGin gin{dc, p.ctx};
  if (threadIdx.x == 0) {
    for (unsigned spins = 0;; spins++) {
      uint64_t inc = gin.readSignal(p.sig_inc), add = gin.readSignal(p.sig_add);
      if (inc >= p.exp_inc && add >= p.exp_add) break;
      if (blockIdx.x == 0 && (spins & 0xfff) == 0) {
        prog->stage = ST_WAIT;
        prog->waiting[s] = 1;
        prog->seen_inc[s] = inc;
        prog->seen_add[s] = add;
      }
    }
    if (blockIdx.x == 0) prog->waiting[s] = 2;
  }
  __syncthreads(); /* thread 0's acquire covers the block's reads below */
  const uint8_t *base = recv + (size_t)p.rank * region;
  unsigned long long bad = 0, first = ~0ull;
  uint64_t tid = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  uint64_t end = 0;
  for (int k = 0; k < p.ntiles; k++) {
    const gt_tile &t = tiles[s * tmax + k];
    uint32_t key = tile_key(mode, p.rank, dc.rank, iter, k);
    for (uint64_t i = tid; i < t.gap; i += stride) {
      uint8_t got = base[t.off - t.gap + i];
      if (got != GT_SENTINEL && bad++ == 0) first = mm_key(p.rank, 1, k, i, got);
    }
    for (uint64_t i = tid; i < t.size; i += stride) {
      uint8_t got = base[t.off + i];
      if (got != pat_byte(key, i) && bad++ == 0) first = mm_key(p.rank, 0, k, i, got);
    }
    end = t.off + t.size;
  }
  for (uint64_t i = tid; i < GT_TRAIL_BYTES; i += stride) {
    uint8_t got = base[end + i];
    if (got != GT_SENTINEL && bad++ == 0) first = mm_key(p.rank, 1, p.ntiles, i, got);
  }
  if (bad) {
    atomicAdd(&res->mismatches, bad);
    atomicMin(&res->first_key, first);
  }
}

__global__ void finish_kernel(ncclDevComm dc, const gt_peer *plans, int nslots,
                              check_result *res, dev_progress *prog)
{
  if (threadIdx.x == 0) prog->stage = ST_FINISH;
  for (int s = threadIdx.x; s < nslots; s += blockDim.x) {
    const gt_peer &p = plans[s];
    ncclGin gin{dc, p.ctx};
    uint64_t inc = gin.readSignal(p.sig_inc), add = gin.readSignal(p.sig_add);
    if (inc != p.exp_inc || add != p.exp_add) { /* a signal applied twice, or late */
      atomicAdd(&res->mismatches, 1ull);
      if (atomicCAS(&res->sig_flag, 0u, 1u) == 0u) {
        res->sig_src = (unsigned)p.rank;
        res->sig_inc = inc;
        res->sig_add = add;
      }
    }
    if (p.reset) {
      gin.resetSignal(p.sig_inc);
      gin.resetSignal(p.sig_add);
    }
  }
}

/* ---- a rank ----------------------------------------------------------------- */

struct rank_state {
  const gt_cfg *cfg;
  gc_world w;
  gc_window send, recv;
  size_t region;
  int nsend, nrecv, send_rank[GP_MAX_RANKS], recv_rank[GP_MAX_RANKS];
  gt_peer *h_plans, *d_plans; /* [send n][recv n] then tiles [send n*tmax][recv n*tmax] */
  size_t plan_bytes;
  check_result *d_res;
  dev_progress *prog, *d_prog;
  const char *mode;
  int mode_id, iter;
  char last_stage[GP_STAGE_LEN];
};

static gt_peer *send_plans(rank_state *r) { return r->h_plans; }
static gt_peer *recv_plans(rank_state *r) { return r->h_plans + r->cfg->ngpus; }
static gt_tile *send_tiles(rank_state *r) { return (gt_tile *)(r->h_plans + 2 * r->cfg->ngpus); }
static gt_tile *recv_tiles(rank_state *r)
{
  return send_tiles(r) + (size_t)r->cfg->ngpus * r->cfg->tmax;
}
template <typename T> static T *on_dev(rank_state *r, T *h)
{
  return (T *)((char *)r->d_plans + ((char *)h - (char *)r->h_plans));
}

/* progress from the GPU into the rank's stage; unchanged text is no progress */
static void poll_progress(void *arg)
{
  rank_state *r = (rank_state *)arg;
  char buf[GP_STAGE_LEN];
  int len = 0;
  static const char *const names[] = {"launching", "GIN barrier (world, context 0)",
                                      "posting puts", "flush + waiting for local completions",
                                      "waiting for signals:", "checking + resetting signals"};
  unsigned st = r->prog->stage;
  len = snprintf(buf, sizeof(buf), "GPU: %s", names[st <= ST_FINISH ? st : 0]);
  for (int i = 0; st == ST_WAIT && i < r->nrecv && len < (int)sizeof(buf); i++) {
    if (r->prog->waiting[i] != 1) continue;
    const gt_peer *p = &recv_plans(r)[i];
    len += snprintf(buf + len, sizeof(buf) - len, " rank %d inc %llu/%llu add %#llx/%#llx;",
                    p->rank, r->prog->seen_inc[i], (unsigned long long)p->exp_inc,
                    r->prog->seen_add[i], (unsigned long long)p->exp_add);
  }
  if (strcmp(buf, r->last_stage)) {
    memcpy(r->last_stage, buf, sizeof(buf));
    gp_progress(r->mode, r->iter, "%s", buf);
  }
}

static void report_mismatch(rank_state *r, const check_result *res)
{
  const gt_cfg *c = r->cfg;
  fprintf(stderr, "%s: rank %d: mode %s: iteration %d (seed %#" PRIx64 "): %llu mismatch(es)\n",
          gp_prog, r->w.rank, r->mode, r->iter, c->seed, res->mismatches);
  if (res->first_key != ~0ull) {
    unsigned long long k = res->first_key;
    int src = (int)(k >> 54), kind = (int)(k >> 52 & 3), tile = (int)(k >> 40 & 0xfff);
    unsigned long long byte = k >> 8 & 0xffffffffull;
    unsigned got = (unsigned)(k & 0xff);
    int slot = 0;
    for (int i = 0; i < r->nrecv; i++)
      if (recv_plans(r)[i].rank == src) slot = i;
    const gt_peer *p = &recv_plans(r)[slot];
    if (kind == 0 && tile < p->ntiles) {
      const gt_tile *t = &recv_tiles(r)[(size_t)slot * c->tmax + tile];
      unsigned want = pat_byte(tile_key(r->mode_id, src, r->w.rank, r->iter, tile), byte);
      fprintf(stderr, "%s: rank %d:   first: from rank %d, tile %d of %d (%u B at offset %llu "
              "of its region, %s), byte %llu: got %#04x, expected %#04x%s\n", gp_prog, r->w.rank,
              src, tile, p->ntiles, t->size, (unsigned long long)t->off,
              t->action == GT_ACT_INC ? "ends a batch, SignalInc"
              : t->action == GT_ACT_ADD ? "ends a batch, SignalAdd" : "plain put", byte, got, want,
              got == GT_SENTINEL ? " (the sentinel: the tile's data had not landed when its signal "
                                "had)" : "");
    } else {
      fprintf(stderr, "%s: rank %d:   first: from rank %d, sentinel byte %llu %s tile %d "
              "overwritten with %#04x (a put wrote outside its tile)\n", gp_prog, r->w.rank, src,
              byte, tile < p->ntiles ? "before" : "after the last", tile, got);
    }
  }
  if (res->sig_flag) {
    const gt_peer *p = NULL;
    for (int i = 0; i < r->nrecv; i++)
      if (recv_plans(r)[i].rank == (int)res->sig_src) p = &recv_plans(r)[i];
    if (p)
      fprintf(stderr, "%s: rank %d:   signals from rank %u after the wait: inc %llu (expected "
              "%llu), add %#llx (expected %#llx)\n", gp_prog, r->w.rank, res->sig_src,
              res->sig_inc, (unsigned long long)p->exp_inc, res->sig_add,
              (unsigned long long)p->exp_add);
  }
}

static long long run_mode(rank_state *r, int mode)
{
  const gt_cfg *c = r->cfg;
  int n = c->ngpus, me = r->w.rank;
  unsigned long long tiles = 0, bytes = 0, bad = 0;
  uint64_t counter_total[GP_MAX_RANKS] = {0};
  r->mode = gt_mode_names[mode];
  r->mode_id = mode;
  r->iter = -1;
  gp_progress(r->mode, -1, "resetting signals and counters");
  /* nothing adds to these now: the previous mode's waits saw every add */
  gc_reset_kernel<<<1, 256, 0, r->w.stream>>>(r->w.dev, gt_signal_count(n), gt_counter_count(n));
  GC_CUDA(cudaGetLastError(), "gc_reset_kernel<<<1, 256>>>, %d signals", gt_signal_count(n));
  GC_CUDA(cudaMemsetAsync(r->recv.ptr, GT_SENTINEL, r->recv.bytes, r->w.stream), "%zu bytes",
          r->recv.bytes);
  int iter;
  for (iter = 0; iter < c->iters; iter++) {
    r->iter = iter;
    for (int i = 0; i < r->nsend; i++) {
      gt_peer *p = &send_plans(r)[i];
      gt_plan_pair(c, mode, iter, me, r->send_rank[i], n, p, &send_tiles(r)[(size_t)i * c->tmax]);
      counter_total[i] += (uint64_t)p->ntiles;
      p->rank = r->send_rank[i];
      p->counter_exp = counter_total[i];
    }
    for (int i = 0; i < r->nrecv; i++) {
      gt_peer *p = &recv_plans(r)[i];
      gt_tile *t = &recv_tiles(r)[(size_t)i * c->tmax];
      gt_plan_pair(c, mode, iter, r->recv_rank[i], me, n, p, t);
      p->rank = r->recv_rank[i];
      p->counter = 0;
      tiles += (unsigned long long)p->ntiles;
      for (int k = 0; k < p->ntiles; k++) bytes += t[k].size;
      r->prog->waiting[i] = 0;
    }
    r->prog->stage = ST_IDLE;
    GC_CUDA(cudaMemcpyAsync(r->d_plans, r->h_plans, r->plan_bytes, cudaMemcpyHostToDevice,
                            r->w.stream), "%zu bytes of plans", r->plan_bytes);
    GC_CUDA(cudaMemsetAsync(r->d_res, 0, sizeof(check_result), r->w.stream), "result");
    GC_CUDA(cudaMemsetAsync(&r->d_res->first_key, 0xff, sizeof(r->d_res->first_key),
                            r->w.stream), "result");
    cudaStream_t st = r->w.stream;
    fill_kernel<<<dim3(64, r->nsend), 256, 0, st>>>((uint8_t *)r->send.ptr,
        on_dev(r, send_plans(r)), on_dev(r, send_tiles(r)), c->tmax, r->region, me, iter, mode);
    GC_CUDA(cudaGetLastError(), "fill_kernel<<<(64, %d), 256>>>", r->nsend);
    int put_threads = 32 * (r->nsend < PUT_WARPS ? r->nsend : PUT_WARPS);
    put_kernel<<<1, put_threads, 0, st>>>(r->w.dev, r->w.world_bar, r->send.win, r->recv.win,
        on_dev(r, send_plans(r)), on_dev(r, send_tiles(r)), r->nsend, c->tmax, r->region, c->nctx,
        r->d_prog);
    GC_CUDA(cudaGetLastError(), "put_kernel<<<1, %d>>>", put_threads);
    verify_kernel<<<dim3(VERIFY_BLOCKS, r->nrecv), 256, 0, st>>>(r->w.dev,
        (const uint8_t *)r->recv.ptr, on_dev(r, recv_plans(r)), on_dev(r, recv_tiles(r)),
        c->tmax, r->region, iter, mode, r->d_res, r->d_prog);
    GC_CUDA(cudaGetLastError(), "verify_kernel<<<(%d, %d), 256>>>", VERIFY_BLOCKS, r->nrecv);
    finish_kernel<<<1, 32, 0, st>>>(r->w.dev, on_dev(r, recv_plans(r)), r->nrecv, r->d_res,
                                    r->d_prog);
    GC_CUDA(cudaGetLastError(), "finish_kernel<<<1, 32>>>");
    /* The sentinel refill comes after the wait, so no copy-engine work sits
     * behind a kernel that waits for GIN signals: correctness does not need
     * the order, but nothing queued can then be held up by that kernel. */
    gc_wait_stream(&r->w, "iteration", poll_progress, r);
    for (int i = 0; i < r->nrecv; i++) /* sentinel again before the next barrier */
      GC_CUDA(cudaMemsetAsync((uint8_t *)r->recv.ptr + (size_t)r->recv_rank[i] * r->region,
                              GT_SENTINEL, r->region, st), "region of rank %d", r->recv_rank[i]);
    check_result res;
    GC_CUDA(cudaMemcpy(&res, r->d_res, sizeof(res), cudaMemcpyDeviceToHost), "result");
    if (res.mismatches) {
      report_mismatch(r, &res);
      bad += res.mismatches;
      break;
    }
    gp_progress(r->mode, iter, "iteration %d verified", iter);
  }
  gp_sh->slot[me].mismatches += (long long)bad;
  printf("rank %d: mode %s: iterations %d, tiles %llu, bytes %llu, mismatches %llu\n", me,
         r->mode, iter, tiles, bytes, bad);
  fflush(stdout);
  return (long long)bad;
}

static int test_child(int rank, void *arg)
{
  rank_state rs;
  rank_state *r = &rs;
  memset(r, 0, sizeof(*r));
  const gt_cfg *c = r->cfg = (const gt_cfg *)arg;
  int n = c->ngpus;
  gp_progress("init", -1, "starting");
  if (gc_world_init(&r->w, rank, n) != ncclSuccess) return 1;
  for (int i = 1; i < n; i++) {
    if (c->ring && i > 1) break;
    r->send_rank[r->nsend++] = (rank + i) % n;
    r->recv_rank[r->nrecv++] = (rank - i + n) % n;
  }
  r->region = gt_region_bytes(c);
  gc_window_create(&r->w, (size_t)n * r->region, &r->send, "send");
  gc_window_create(&r->w, (size_t)n * r->region, &r->recv, "recv");
  if (gc_devcomm_create(&r->w, gt_signal_count(n), gt_counter_count(n)) != ncclSuccess) return 1;
  if (rank == 0)
    printf("# GIN: %d context(s) (using %d), backend type %d, windows 2 x %zu bytes, world "
           "barrier signals %u..%u\n", (int)r->w.dev.ginContextCount, c->nctx,
           ps_gin_backend(r->w.dev), (size_t)n * r->region, r->w.world_bar.signal0,
           r->w.world_bar.signal0 + r->w.world_bar_signals - 1);
  r->plan_bytes = 2 * (size_t)n * sizeof(gt_peer) + 2 * (size_t)n * c->tmax * sizeof(gt_tile);
  GC_CUDA(cudaMallocHost((void **)&r->h_plans, r->plan_bytes), "%zu bytes", r->plan_bytes);
  GC_CUDA(cudaMalloc((void **)&r->d_plans, r->plan_bytes), "%zu bytes", r->plan_bytes);
  GC_CUDA(cudaMalloc((void **)&r->d_res, sizeof(check_result)), "%zu bytes", sizeof(check_result));
  GC_CUDA(cudaHostAlloc((void **)&r->prog, sizeof(dev_progress), cudaHostAllocMapped),
          "%zu bytes", sizeof(dev_progress));
  memset(r->prog, 0, sizeof(dev_progress));
  GC_CUDA(cudaHostGetDevicePointer((void **)&r->d_prog, r->prog, 0), "%p", (void *)r->prog);

  long long bad = 0;
  for (int m = 0; m < GT_MODE_N && !bad; m++)
    if (c->mode_on[m]) bad += run_mode(r, m);
  if (bad) return 1; /* the others stop at their next barrier; the parent ends them */

  /* nobody deregisters a window a peer may still write to */
  gp_progress("teardown", -1, "final GIN barrier");
  gc_barrier_kernel<<<1, 32, 0, r->w.stream>>>(r->w.dev, r->w.world_bar);
  GC_CUDA(cudaGetLastError(), "gc_barrier_kernel<<<1, 32>>>");
  gc_wait_stream(&r->w, "final barrier", NULL, NULL);
  if (gp_barrier(n)) return 1;
  gp_progress("teardown", -1, "ncclDevCommDestroy, window deregistration, ncclCommDestroy");
  GC_CUDA(cudaFreeHost(r->h_plans), "%p", (void *)r->h_plans);
  GC_CUDA(cudaFree(r->d_plans), "%p", (void *)r->d_plans);
  GC_CUDA(cudaFree(r->d_res), "%p", (void *)r->d_res);
  GC_CUDA(cudaFreeHost(r->prog), "%p", (void *)r->prog);
  gc_world_close(&r->w, &r->send, &r->recv);
  return 0;
}

static void usage(FILE *f)
{
  fprintf(f,
    "usage: perseus_gin_test [options]\n"
    "NCCL device API (ncclGin over the GIN proxy) through the perseus plugin, one forked\n"
    "process per GPU, every byte verified on the GPU.\n"
    "  -o LIST  modes: put, alltoall, all, or a comma-separated list (default put)\n"
    "  -g N     GPUs/ranks, at least 2 (default: all visible)\n"
    "  -n N     iterations per mode (default 200)\n"
    "  -t N     put: at most N tiles per peer and iteration, 1..4096 (default 16)\n"
    "  -b SIZE  smallest tile (default 1)     -e SIZE  largest tile (default 1M; K, M, G)\n"
    "  -s SEED  plan seed (default: from the clock; printed)\n"
    "  -m KIND  put: signal kind per batch: inc, add, alt, mixed (default mixed)\n"
    "  -r       ring: each rank sends to the next only (default: every other rank)\n"
    "  -C N     GIN contexts to spread the peers over, 1..4 (default 1)\n"
    "  -w SEC   watchdog: a rank without progress for SEC seconds is a hang (default 120)\n"
    "Environment: NCCL_NET_PLUGIN (default: the plugin built beside this program),\n"
    "PERSEUS_ORDERING, PERSEUS_PROVIDER; NCCL_GIN_TYPE=2, NCCL_P2P_DISABLE=1,\n"
    "NCCL_SHM_DISABLE=1 and NCCL_NVLS_ENABLE=0 unless set.\n"
    "Exit status: 0 pass, 1 failure (also bad options), 77 no GPU or fewer than asked.\n");
}

int main(int argc, char **argv)
{
  static gt_cfg c;
  const ps_opt_t opts[] = {
    PS_OPT_FN('o', &c, "put", gt_set_modes),
    PS_OPT_INT('g', &c.ngpus, NULL, 2, GP_MAX_RANKS), /* 0: all visible */
    PS_OPT_INT('n', &c.iters, "200", 1, 1 << 24),
    PS_OPT_INT('t', &c.tmax, "16", 1, 4096),
    PS_OPT_SIZE('b', &c.bmin, "1", 1, 0),
    PS_OPT_SIZE('e', &c.bmax, "1M", 1, 1u << 30),
    PS_OPT_SEED('s', &c.seed, NULL), /* from the clock */
    PS_OPT_NAME('m', &c.sigmode, "mixed", gt_sig_names, NULL, GT_SIG_N),
    PS_OPT_FLAG('r', &c.ring),
    PS_OPT_INT('C', &c.nctx, "1", 1, PS_GIN_CONTEXTS),
    PS_OPT_INT('w', &c.watchdog_s, "120", 1, 24 * 3600),
  };
  ps_opts_parse(argc, argv, "perseus_gin_test", opts, PS_OPTS_N(opts), usage, 0);
  if (optind < argc || c.bmin > c.bmax) {
    fprintf(stderr, "perseus_gin_test: need -b <= -e and no extra arguments\n");
    return 1;
  }
  if (gp_init("perseus_gin_test")) return 1;
  printf("# perseus_gin_test: seed %#" PRIx64 ", modes", c.seed);
  for (int m = 0; m < GT_MODE_N; m++)
    if (c.mode_on[m]) printf(" %s", gt_mode_names[m]);
  printf(", %d iterations, tiles 1..%d of %zu..%zu bytes, signals %s, %s, %d context(s)\n",
         c.iters, c.tmax, c.bmin, c.bmax, gt_sig_names[c.sigmode], c.ring ? "ring" : "all pairs",
         c.nctx);
  gp_default_env(stdout);
  int rc = gc_probe_gpus(1, &c.ngpus, c.watchdog_s);
  if (rc >= 0) return rc;
  long long mismatches;
  double secs;
  int failed = gp_run_test(c.ngpus, test_child, &c, c.watchdog_s, "gin test", &mismatches, &secs);
  printf("# %s: %d ranks, mismatches %lld, %.1f s (seed %#" PRIx64 ")\n",
         failed ? "FAILED" : "PASSED", c.ngpus, mismatches, secs, c.seed);
  return failed ? 1 : 0;
}
