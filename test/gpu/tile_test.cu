/* perseus_tile_test: perseus' device library (perseus/device.cuh: tile puts
 * with one signal per batch) on every visible GPU, every byte verified on
 * the GPU, over one path per run: -p lsa (P2P on, tiles stored into NVLink
 * peers, counts by system-scope atomics; each iteration draws plain stores
 * or TMA bulk copies), -p tma (lsa, TMA always) or -p gin (P2P off, ncclGin
 * puts through the perseus plugin, one ncclGin SignalAdd per batch).
 *
 * One forked process per GPU (gin_proc.c: the parent never calls CUDA).
 * Per iteration every rank sends to every other rank; from the seed and the
 * iteration every rank derives what every other rank sends (tile_comm.cuh:
 * 1..-t tiles per pair, 1 B..-e each, misaligned), and draws for itself the
 * batch (1..16 or -B), the producer CTAs (1..-c), the coop (a CTA or a warp
 * per tile), the LSA copy (stores or TMA) and which kernel it launches first. Kernels:
 *   produce (stream A): each coop writes its tiles' pattern (source,
 *           destination, iteration, tile, byte) and puts them, round robin
 *           over all destinations, any CTA to any peer;
 *   flush   (stream A, behind produce: the grid-wide handoff the library
 *           needs): closes every peer's partial batch;
 *   consume (stream B, concurrent with both, so producers and consumers
 *           share the GPU: a deadlock would show as a watchdog hang): per
 *           source, wait() (or a poll() loop on alternate sources) for the
 *           cumulative tile count, check arrived() is exactly that count
 *           and next() agrees, then verify every byte.
 * Counts are never reset; the host barrier after each iteration is what
 * keeps the next iteration's puts off tiles a peer is still verifying.
 * GIN: the plugin's process statistics must count exactly one signal per
 * batch and peer (sum of ceil(tiles / batch)) each iteration, and the
 * program's own GIN signals must still read 0 at the end.
 * Exit: 0 all ranks passed, 1 a failure, 77 no GPU or fewer than asked. */
#include <errno.h>
#include <inttypes.h>
#include <time.h>

#include "opts.h"
#include "tile_comm.cuh"

#define VERIFY_BLOCKS 4 /* consumer blocks per source */

struct tt_cfg {
  int path, ngpus, iters, tmax, bfixed, cmax, watchdog_s;
  size_t emax;
  uint64_t seed;
};

struct tt_result {
  unsigned long long mismatches, count_errors;
  int first_set, src, tile;
  unsigned long long byte, got, want, arrived, expect, own_sig;
};

__global__ void __launch_bounds__(TT_THREADS)
consume_kernel(ncclDevComm dc, perseus_batch_handle h, ncclWindow_t win, tt_plan p,
               const uint64_t *totals_d, int gin, tt_result *res, tt_prog *prog)
{
  int n = p.nranks, s = (p.me + n - 1 - (int)blockIdx.y) % n; /* sources me-1, me-2, ... */
  uint64_t total = totals_d[s];
  perseus_recv recv(dc, h);
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0 && ((p.iter + s) & 1)) { /* a scheduler that must not spin in wait() */
      while (!recv.poll(s, total)) {
        prog->arrived[s] = recv.arrived(s);
        __nanosleep(500);
      }
    } else {
      recv.wait(s, total);
    }
    uint64_t a = recv.arrived(s);
    prog->arrived[s] = a;
    bool bad = a != total; /* no sender may be ahead: the host barrier holds it */
    if (blockIdx.x == 0) {
      /* one caller per source: next() keeps the same running total */
      uint64_t nx = recv.next(s, tt_ntiles(p, s, p.me));
      bad |= nx != total;
      if (gin && blockIdx.y == 0) {
        ncclGin g{dc, h.ctx};
        unsigned long long own = 0;
        for (int i = GC_SIG_FIRST; i < TT_OWN_SIGNALS; i++) own |= g.readSignal(i);
        if (own) {
          atomicAdd(&res->count_errors, 1ull);
          res->own_sig = own;
        }
      }
    }
    if (bad) {
      atomicAdd(&res->count_errors, 1ull);
      res->src = s, res->arrived = a, res->expect = total;
    }
  }
  __syncthreads();
  unsigned long long bad = 0;
  int nt = tt_ntiles(p, s, p.me);
  for (int k = 0; k < nt; k++) {
    const uint8_t *t = (const uint8_t *)ncclGetLocalPointer(win, tt_recv_off(p, s, p.me, k));
    uint32_t size = tt_size(p, s, p.me, k);
    uint64_t key = tt_key(p, s, p.me, k);
    for (uint32_t x = blockIdx.x * blockDim.x + threadIdx.x; x < size;
         x += gridDim.x * blockDim.x) {
      uint8_t got = t[x], want = tt_pat(key, x);
      if (got != want) {
        if (!bad && atomicCAS(&res->first_set, 0, 1) == 0) {
          res->src = s, res->tile = k, res->byte = x, res->got = got, res->want = want;
        }
        bad++;
      }
    }
  }
  if (bad) atomicAdd(&res->mismatches, bad);
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd_system(&prog->cons_blocks, 1u);
}

struct rank_state {
  const tt_cfg *c;
  gc_world w;
  gc_window win;
  perseus_batch_handle h;
  cudaStream_t cons;
  cudaEvent_t cons_done;
  tt_prog *prog, *d_prog;
  tt_result *d_res;
  uint64_t *d_totals;
  int iter, ctas, nprod_blocks;
  uint64_t totals[GP_MAX_RANKS];
  char last[GP_STAGE_LEN];
};

static void poll_progress(void *arg)
{
  rank_state *r = (rank_state *)arg;
  char buf[GP_STAGE_LEN];
  int n = r->c->ngpus;
  int len = snprintf(buf, sizeof(buf), "GPU: producers %u/%d CTAs, flush %u, consumers %u/%d",
                     r->prog->prod_blocks, r->ctas, r->prog->flushed, r->prog->cons_blocks,
                     VERIFY_BLOCKS * (n - 1));
  for (int s = 0; s < n && len < (int)sizeof(buf); s++)
    if (s != r->w.rank)
      len += snprintf(buf + len, sizeof(buf) - len, "; from %d: %llu/%llu", s,
                      r->prog->arrived[s], (unsigned long long)r->totals[s]);
  if (strcmp(buf, r->last)) {
    memcpy(r->last, buf, sizeof(buf));
    gp_progress(NULL, r->iter, "%s", buf);
  }
}

static int test_child(int rank, void *arg)
{
  rank_state rs;
  rank_state *r = &rs;
  memset(r, 0, sizeof(*r));
  const tt_cfg *c = r->c = (const tt_cfg *)arg;
  int n = c->ngpus, gin = c->path == TT_GIN;
  gp_progress(tt_path_names[c->path], -1, "starting");
  if (gc_world_init(&r->w, rank, n) != ncclSuccess) return GP_EXIT_REFUSED;
  tt_plan p;
  memset(&p, 0, sizeof(p));
  p.seed = c->seed, p.me = rank, p.nranks = n, p.tmax = c->tmax, p.emax = (uint32_t)c->emax;
  size_t wbytes;
  tt_layout(&p, &wbytes);
  gc_window_create(&r->w, wbytes, &r->win, "tiles");
  if (tt_devcomm_create(&r->w, c->path, &r->h) != ncclSuccess) return GP_EXIT_REFUSED;
  GC_CUDA(cudaStreamCreateWithFlags(&r->cons, cudaStreamNonBlocking), "consumer stream");
  GC_CUDA(cudaEventCreateWithFlags(&r->cons_done, cudaEventDisableTiming), "event");
  GC_CUDA(cudaHostAlloc((void **)&r->prog, sizeof(tt_prog), cudaHostAllocMapped), "progress");
  GC_CUDA(cudaHostGetDevicePointer((void **)&r->d_prog, r->prog, 0), "progress");
  GC_CUDA(cudaMalloc((void **)&r->d_res, sizeof(tt_result)), "result");
  GC_CUDA(cudaMalloc((void **)&r->d_totals, sizeof(r->totals)), "totals");

  unsigned long long tiles = 0, bytes = 0, sig_exp = 0, sig_seen = 0, bad = 0, cbad = 0;
  int stats_ok = 1, iter;
  perseus_rma_peer_stats_t s0, s1;
  if (gin && gp_rma_stats(&s0)) {
    fprintf(stderr, "%s: rank %d: perseus_rma_process_stats not found: is NCCL_NET_PLUGIN=%s "
            "the perseus plugin? The one-signal-per-batch check needs it\n", gp_prog, rank,
            getenv("NCCL_NET_PLUGIN"));
    return 1;
  }
  for (iter = 0; iter < c->iters; iter++) {
    r->iter = p.iter = iter;
    uint64_t h = tt_hash(p, rank, rank, 0, 6); /* this rank's own draws */
    uint32_t batch = c->bfixed ? (uint32_t)c->bfixed : 1 + (uint32_t)(h % 16);
    int coop = (int)(h >> 8 & 1), cons_first = (int)(h >> 9 & 1);
    int tma = c->path == TT_TMA || (int)(h >> 10 & 1); /* gin: the overload, unused */
    r->ctas = 1 + (int)((h >> 16) % (uint64_t)c->cmax);
    for (int s = 0; s < n; s++)
      if (s != rank) r->totals[s] += (uint64_t)tt_ntiles(p, s, rank);
    for (int j = 1; j < n; j++) {
      int d = (rank + j) % n;
      for (int k = 0; k < tt_ntiles(p, rank, d); k++) bytes += tt_size(p, rank, d, k);
      tiles += (unsigned long long)tt_ntiles(p, rank, d);
    }
    uint64_t want_sig = tt_round_signals(p, batch);
    sig_exp += want_sig;
    memset(r->prog, 0, sizeof(tt_prog));
    r->last[0] = 0;
    gp_progress(NULL, iter, "launching: batch %u, %d CTAs of %s coops%s, %s first", batch,
                r->ctas, coop == TT_COOP_CTA ? "CTA" : "warp", tma ? " (TMA)" : "",
                cons_first ? "consumer" : "producer");
    GC_CUDA(cudaMemcpyAsync(r->d_totals, r->totals, sizeof(r->totals), cudaMemcpyHostToDevice,
                            r->cons), "totals");
    GC_CUDA(cudaMemsetAsync(r->d_res, 0, sizeof(tt_result), r->cons), "result");
    for (int pass = 0; pass < 2; pass++) {
      if (pass == cons_first) {
        consume_kernel<<<dim3(VERIFY_BLOCKS, n - 1), TT_THREADS, 0, r->cons>>>(
            r->w.dev, r->h, r->win.win, p, r->d_totals, gin, r->d_res, r->d_prog);
        GC_CUDA(cudaGetLastError(), "consume_kernel<<<(%d, %d), %d>>>", VERIFY_BLOCKS, n - 1,
                TT_THREADS);
      } else {
        tt_produce_kernel<<<r->ctas, TT_THREADS, 0, r->w.stream>>>(
            r->w.dev, r->h, r->win.win, p, batch, coop, tma, 1, r->d_prog);
        GC_CUDA(cudaGetLastError(), "tt_produce_kernel<<<%d, %d>>>", r->ctas, TT_THREADS);
        tt_flush_kernel<<<1, 32, 0, r->w.stream>>>(r->w.dev, r->h, batch, r->d_prog);
        GC_CUDA(cudaGetLastError(), "tt_flush_kernel<<<1, 32>>>");
      }
    }
    /* one stream to wait for (gc_wait_stream watches NCCL errors meanwhile) */
    GC_CUDA(cudaEventRecord(r->cons_done, r->cons), "consumer done");
    GC_CUDA(cudaStreamWaitEvent(r->w.stream, r->cons_done, 0), "consumer done");
    gc_wait_stream(&r->w, "iteration", poll_progress, r);
    tt_result res;
    GC_CUDA(cudaMemcpy(&res, r->d_res, sizeof(res), cudaMemcpyDeviceToHost), "result");
    if (res.mismatches || res.count_errors) {
      fprintf(stderr, "%s: rank %d: %s: iteration %d (seed %#" PRIx64 ", batch %u, %d CTAs, %s "
              "coops%s): %llu byte mismatch(es), %llu count error(s)\n", gp_prog, rank,
              tt_path_names[c->path], iter, c->seed, batch, r->ctas, coop ? "warp" : "CTA",
              tma ? ", TMA" : "", res.mismatches, res.count_errors);
      if (res.first_set)
        fprintf(stderr, "%s: rank %d:   first: from rank %d, tile %d (%u B), byte %llu: got "
                "%#04llx, expected %#04llx\n", gp_prog, rank, res.src, res.tile,
                tt_size(p, res.src, rank, res.tile), res.byte, res.got, res.want);
      if (res.count_errors)
        fprintf(stderr, "%s: rank %d:   counts: from rank %d arrived %llu, expected exactly "
                "%llu; own signals %d..%d read %#llx\n", gp_prog, rank, res.src, res.arrived,
                res.expect, GC_SIG_FIRST, TT_OWN_SIGNALS - 1, res.own_sig);
      bad += res.mismatches, cbad += res.count_errors;
      break;
    }
    /* every rank verified this iteration: its tiles may be overwritten, and
     * every signal this rank posted has reached its peer */
    gp_progress(NULL, iter, "host barrier after verification");
    if (gp_barrier(n)) return 1;
    if (gin) {
      if (tt_stats_settle(&s0, want_sig, &s1)) return 1;
      unsigned long long got = s1.signals - s0.signals;
      sig_seen += got;
      if (got != want_sig) {
        fprintf(stderr, "%s: rank %d: gin: iteration %d: the plugin posted %llu signals, "
                "expected one per batch and peer: %llu (batch %u; puts %llu, fences %llu)\n",
                gp_prog, rank, iter, got, (unsigned long long)want_sig, batch,
                (unsigned long long)(s1.puts - s0.puts),
                (unsigned long long)(s1.fences_posted - s0.fences_posted));
        stats_ok = 0;
        break;
      }
      s0 = s1;
    }
  }
  gp_sh->slot[rank].mismatches += (long long)(bad + cbad);
  char counted[64] = "";
  if (gin) snprintf(counted, sizeof(counted), ", plugin counted %llu", sig_seen);
  printf("rank %d: path %s: iterations %d, tiles %llu, bytes %llu, signals expected %llu "
         "(ceil(tiles/batch) per peer)%s, mismatches %llu, count errors %llu\n", rank,
         tt_path_names[c->path], iter, tiles, bytes, sig_exp, counted, bad, cbad);
  fflush(stdout);
  if (bad || cbad || !stats_ok) return 1;

  /* nobody deregisters a window a peer may still write to (GIN: let the
   * proxies finish with a barrier through them) */
  gp_progress("teardown", -1, "final barrier");
  if (gin) {
    gc_barrier_kernel<<<1, 32, 0, r->w.stream>>>(r->w.dev, r->w.world_bar);
    GC_CUDA(cudaGetLastError(), "gc_barrier_kernel<<<1, 32>>>");
    gc_wait_stream(&r->w, "final barrier", NULL, NULL);
  }
  if (gp_barrier(n)) return 1;
  GC_CUDA(cudaFree(r->d_res), "result");
  GC_CUDA(cudaFree(r->d_totals), "totals");
  GC_CUDA(cudaFreeHost(r->prog), "progress");
  GC_CUDA(cudaEventDestroy(r->cons_done), "event");
  GC_CUDA(cudaStreamDestroy(r->cons), "consumer stream");
  gc_world_close(&r->w, &r->win, NULL);
  return 0;
}

static void usage(FILE *f)
{
  fprintf(f,
    "usage: perseus_tile_test [options]\n"
    "perseus' device library (tile puts, one signal per batch) on every visible GPU, one\n"
    "forked process per GPU, every byte verified on the GPU.\n"
    "  -p PATH  lsa (P2P on, NVLink stores or TMA copies, drawn per iteration), tma (lsa,\n"
    "           TMA copies only) or gin (P2P off, ncclGin via the plugin); default gin\n"
    "  -g N     GPUs/ranks, at least 2 (default: all visible)\n"
    "  -n N     iterations (default 100)\n"
    "  -t N     at most N tiles per pair and iteration, 1..1024 (default 64)\n"
    "  -e SIZE  largest tile (default 256K; K, M suffixes)\n"
    "  -B N     tiles per signal, 1..4096 (default: random 1..16 per rank and iteration)\n"
    "  -c N     at most N producer CTAs, 1..1024 (default 8)\n"
    "  -s SEED  seed (default: from the clock; printed)\n"
    "  -w SEC   watchdog: a rank without progress for SEC seconds is a hang (default 120)\n"
    "Exit status: 0 pass, 1 failure (also bad options), 77 no GPU or fewer than asked.\n");
}

int main(int argc, char **argv)
{
  static tt_cfg c;
  static const char *const paths[] = {"lsa", "gin", "tma"};
  static const int path_values[] = {TT_LSA, TT_GIN, TT_TMA};
  const ps_opt_t opts[] = {
    PS_OPT_NAME('p', &c.path, "gin", paths, path_values, 3),
    PS_OPT_INT('g', &c.ngpus, NULL, 2, GP_MAX_RANKS), /* 0: all visible */
    PS_OPT_INT('n', &c.iters, "100", 1, 1 << 24),
    PS_OPT_INT('t', &c.tmax, "64", 1, 1024),
    PS_OPT_SIZE('e', &c.emax, "256K", 1, 64u << 20),
    PS_OPT_INT('B', &c.bfixed, NULL, 1, 4096), /* 0: random per rank and iteration */
    PS_OPT_INT('c', &c.cmax, "8", 1, 1024),
    PS_OPT_SEED('s', &c.seed, NULL), /* from the clock */
    PS_OPT_INT('w', &c.watchdog_s, "120", 1, 24 * 3600),
  };
  ps_opts_parse(argc, argv, "perseus_tile_test", opts, PS_OPTS_N(opts), usage, 1);
  if (gp_init("perseus_tile_test")) return 1;
  printf("# perseus_tile_test: path %s, seed %#" PRIx64 ", %d iterations, 1..%d tiles of "
         "1..%zu B per pair, batch %s, 1..%d producer CTAs\n", tt_path_names[c.path], c.seed,
         c.iters, c.tmax, c.emax, c.bfixed ? "fixed" : "1..16", c.cmax);
  if (c.bfixed) printf("# batch: %d tiles per signal\n", c.bfixed);
  int rc = tt_start(c.path, 1, 2, &c.ngpus, c.watchdog_s, 0); /* before any CUDA or NCCL */
  if (rc >= 0) return rc;
  long long mismatches;
  double secs;
  int failed = gp_run_test(c.ngpus, test_child, &c, c.watchdog_s, "tile test", &mismatches, &secs);
  printf("# %s: path %s, %d ranks, mismatches + count errors %lld, %.1f s (seed %#" PRIx64
         ")\n", failed ? "FAILED" : "PASSED", tt_path_names[c.path], c.ngpus, mismatches, secs,
         c.seed);
  return failed ? 1 : 0;
}
