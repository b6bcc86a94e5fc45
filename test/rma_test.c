/* The one-sided engine's ordering invariant, from forked ranks:
 *
 *   perseus_rma_test [-r RANKS] [-b BATCHES]   (PERSEUS_ORDERING picks the strategy)
 *
 * Every rank puts a random number of random-size tiles to every peer, then
 * one put+signal (ADD of the batch's tile count, sometimes with a tile of its
 * own, sometimes signal-only). Receivers poll their signal words while
 * progressing; the moment a value is observed, every tile of every batch it
 * covers must already be in memory, byte for byte. */
#include <getopt.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_driver.h"
#include "ps_gin_abi.h"
#include "ps_net.h"
#include "ps_rma.h"

#define SLOT 65536           /* bytes per (source, batch) in the data window */
#define MAX_TILES 8
#define TILE_MAX (SLOT / MAX_TILES)
#define MAX_BATCHES 64
#define MAX_REQS 4096

typedef struct {
  int batches;
  int expect_refusal; /* -R: the engine must refuse this provider/ordering at connect */
} args_t;

/* Batch layout, computable on both sides: tile count and sizes. */
static uint64_t mix(uint64_t x) {
  x ^= x >> 33, x *= 0xff51afd7ed558ccdULL, x ^= x >> 33;
  return x;
}
static int ntiles(int src, int dst, int b) { return 1 + (int)(mix((uint64_t)src << 40 | (uint64_t)dst << 20 | (uint64_t)b) % MAX_TILES); }
static size_t tile_size(int src, int dst, int b, int t) {
  return 1 + mix(((uint64_t)src << 48) ^ ((uint64_t)dst << 32) ^ ((uint64_t)b << 8) ^ (uint64_t)t) % TILE_MAX;
}
static uint64_t tile_id(int src, int dst, int b, int t) { return ((uint64_t)src << 48) | ((uint64_t)dst << 32) | ((uint64_t)b << 8) | (uint64_t)t; }

static int rank_fn(drv_rank_t *r, void *arg) {
  const args_t *a = arg;
  int P = r->nranks, me = r->rank, B = a->batches;
  unsigned char (*handles)[NCCL_NET_HANDLE_MAXSIZE] = r->user;
  void *hp[16], *lc = NULL, *cc = NULL;
  CHECK(ps_net_init(NULL) == ncclSuccess, "init");
  CHECK(ps_rma_listen(0, handles[me], &lc) == ncclSuccess, "listen");
  CHECK(!drv_barrier(r, 60), "barrier");
  for (int p = 0; p < P; p++) hp[p] = handles[p];
  ncclResult_t crc = ps_rma_connect(hp, P, me, lc, &cc);
  if (a->expect_refusal) {
    CHECK(crc == ncclInvalidUsage, "connect returned %d, expected the refusal ncclInvalidUsage (5)", crc);
    ps_rma_close_listen(lc);
    return 0;
  }
  CHECK(crc == ncclSuccess, "connect");
  size_t data_bytes = (size_t)P * B * SLOT, src_bytes = (size_t)P * B * SLOT;
  unsigned char *data = calloc(1, data_bytes), *src = malloc(src_bytes);
  uint64_t *sig = calloc((size_t)P, 8);
  void *data_mh, *src_mh, *sig_mh;
  CHECK(data && src && sig, "oom");
  CHECK(ps_rma_reg_sym(cc, data, data_bytes, NCCL_PTR_HOST, 0, &data_mh) == ncclSuccess, "reg data");
  CHECK(ps_rma_reg_sym(cc, src, src_bytes, NCCL_PTR_HOST, 0, &src_mh) == ncclSuccess, "reg src");
  CHECK(ps_rma_reg_sym(cc, sig, (size_t)P * 8, NCCL_PTR_HOST, NCCL_NET_MR_FLAG_FORCE_SO, &sig_mh) == ncclSuccess, "reg sig");
  /* what each source has been seen to cover so far */
  int verified[16] = {0};
  uint64_t cum[16][MAX_BATCHES + 1];
  for (int s = 0; s < P; s++) {
    cum[s][0] = 0;
    for (int b = 0; b < B; b++) cum[s][b + 1] = cum[s][b] + (uint64_t)ntiles(s, me, b);
  }
  void **reqs = calloc(MAX_REQS, sizeof *reqs);
  int nreq = 0;
  CHECK(reqs != NULL, "oom");
  int b = 0, q = 0, done_sending = 0;
  double end = drv_now() + 120;
  for (;;) {
    CHECK(!drv_peer_failed(r), "stopping: another rank failed");
    CHECK(drv_now() < end, "stalled: batch %d, verified from rank 0..: %d %d", b, verified[0], verified[1 % P]);
    /* send: one (batch, peer) step per loop turn, interleaved with checking */
    if (!done_sending && nreq < MAX_REQS - MAX_TILES - 1) {
      if (q == me) q++;
      if (q >= P) q = 0, b++;
      if (b >= B) done_sending = 1;
      else if (q != me) {
        int n = ntiles(me, q, b), own = (b % 3 == 0) ? 0 : 1; /* last tile rides with the signal */
        for (int t = 0; t < n; t++) {
          size_t off = ((size_t)(q * B + b)) * SLOT + (size_t)t * TILE_MAX, dst = ((size_t)(me * B + b)) * SLOT + (size_t)t * TILE_MAX;
          size_t sz = tile_size(me, q, b, t);
          drv_fill(src + off, sz, tile_id(me, q, b, t));
          void *req = NULL;
          if (t == n - 1 && own)
            while (!req) { /* refused for now: progress, then try again */
              CHECK(ps_rma_iput_signal(cc, off, src_mh, sz, dst, data_mh, (uint32_t)q, (uint64_t)me * 8, sig_mh, (uint64_t)n, NCCL_NET_SIGNAL_OP_ADD, &req) == ncclSuccess, "iputSignal");
              if (!req) CHECK(ps_rma_progress(cc) == ncclSuccess, "progress");
            }
          else
            while (!req) { /* refused for now: progress, then try again */
              CHECK(ps_rma_iput(cc, off, src_mh, sz, dst, data_mh, (uint32_t)q, &req) == ncclSuccess, "iput");
              if (!req) CHECK(ps_rma_progress(cc) == ncclSuccess, "progress");
            }
          reqs[nreq++] = req;
        }
        if (!own) { /* signal-only, after the batch's puts */
          void *req = NULL;
          while (!req) { /* refused for now: progress, then try again */
            CHECK(ps_rma_iput_signal(cc, 0, NULL, 0, 0, NULL, (uint32_t)q, (uint64_t)me * 8, sig_mh, (uint64_t)n, NCCL_NET_SIGNAL_OP_ADD, &req) == ncclSuccess, "signal");
            if (!req) CHECK(ps_rma_progress(cc) == ncclSuccess, "progress");
          }
          reqs[nreq++] = req;
        }
        q++;
      }
    }
    CHECK(ps_rma_progress(cc) == ncclSuccess, "progress");
    for (int i = 0; i < nreq;) {
      int done = 0;
      CHECK(ps_rma_test(cc, reqs[i], &done) == ncclSuccess, "test");
      if (done) reqs[i] = reqs[--nreq];
      else i++;
    }
    /* receive: what a signal value promises must be there now */
    int all = 1;
    for (int s = 0; s < P; s++) {
      if (s == me) continue;
      uint64_t v = __atomic_load_n(&sig[s], __ATOMIC_ACQUIRE);
      CHECK(v <= cum[s][B], "signal from %d is %llu, more than the %llu ever sent", s, (unsigned long long)v, (unsigned long long)cum[s][B]);
      while (verified[s] < B && cum[s][verified[s] + 1] <= v) {
        int vb = verified[s];
        for (int t = 0; t < ntiles(s, me, vb); t++) {
          size_t dst = ((size_t)(s * B + vb)) * SLOT + (size_t)t * TILE_MAX;
          long bad = drv_verify(data + dst, tile_size(s, me, vb, t), tile_id(s, me, vb, t));
          CHECK(bad < 0, "signal %llu from rank %d covers batch %d, but tile %d is wrong at byte %ld: the signal overtook its data", (unsigned long long)v, s, vb, t, bad);
        }
        verified[s]++;
      }
      all &= verified[s] == B;
    }
    if (all && done_sending && nreq == 0) break;
  }
  ps_rma_peer_stats_t st;
  CHECK(ps_rma_peer_stats(cc, (uint32_t)((me + 1) % P), &st) == ncclSuccess, "stats");
  if (me == 0)
    printf("rank 0 -> %d: %llu puts, %llu signals, %llu fences posted, %llu avoided, blocked %.3f ms, max in flight %llu\n",
           (me + 1) % P, (unsigned long long)st.puts, (unsigned long long)st.signals, (unsigned long long)st.fences_posted,
           (unsigned long long)st.fences_avoided, st.blocked_ns / 1e6, (unsigned long long)st.inflight_max);
  CHECK(!drv_barrier(r, 60), "final barrier"); /* nobody closes while peers still read */
  ps_rma_dereg_sym(cc, data_mh), ps_rma_dereg_sym(cc, src_mh), ps_rma_dereg_sym(cc, sig_mh);
  ps_rma_close_coll(cc);
  ps_rma_close_listen(lc);
  free(data), free(src), free(sig), free(reqs);
  return 0;
}

int main(int argc, char **argv) {
  args_t a = {.batches = 24};
  drv_opts_t o = {.nranks = 2, .timeout_s = 180, .no_load = 1, .no_mesh = 1};
  int c;
  while ((c = getopt(argc, argv, "r:b:Rh")) != -1) {
    if (c == 'r') o.nranks = atoi(optarg);
    else if (c == 'R') a.expect_refusal = 1;
    else if (c == 'b') a.batches = atoi(optarg);
    else {
      fprintf(stderr, "usage: %s [-r RANKS 2..16] [-b BATCHES 1..%d] [-R: expect the ordering to be refused]\n", argv[0], MAX_BATCHES);
      return c == 'h' ? 0 : 2;
    }
  }
  if (o.nranks < 2 || o.nranks > 16 || a.batches < 1 || a.batches > MAX_BATCHES) {
    fprintf(stderr, "ranks must be 2..16 and batches 1..%d\n", MAX_BATCHES);
    return 2;
  }
  o.shared_bytes = (size_t)o.nranks * NCCL_NET_HANDLE_MAXSIZE;
  double t0 = drv_now();
  int rc = drv_run(&o, rank_fn, &a);
  printf("rma invariant, %d ranks, %d batches, provider %s, ordering %s: %s (%.2f s)\n", o.nranks,
         a.batches, getenv("PERSEUS_PROVIDER") ? getenv("PERSEUS_PROVIDER") : "auto",
         getenv("PERSEUS_ORDERING") ? getenv("PERSEUS_ORDERING") : "auto", rc ? "FAIL" : "ok", drv_now() - t0);
  return rc ? 1 : 0;
}
