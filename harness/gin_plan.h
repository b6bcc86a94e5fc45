/* gin_plan.h: what perseus_gin_test sends, drawn from the seed (C11, shared
 * with the kernels of gin_test.cu, hence plain fixed-width layouts).
 *
 * Every rank computes the plan of every pair it takes part in from (seed,
 * mode, iteration, source, destination) alone, so a receiver knows what its
 * senders put without being told: tile count, sizes, the sentinel gap before
 * each tile, which tile ends a batch and carries the batch's signal, and the
 * values the two signals of the pair must reach. */
#ifndef PERSEUS_GIN_PLAN_H
#define PERSEUS_GIN_PLAN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GT_GAP_MAX 64       /* sentinel bytes before each tile: 0..63 */
#define GT_TRAIL_BYTES 64   /* sentinel checked after the last tile */
#define GT_SENTINEL 0xA5

enum { GT_MODE_PUT, GT_MODE_ALLTOALL, GT_MODE_N };
enum { GT_SIG_INC, GT_SIG_ADD, GT_SIG_ALT, GT_SIG_MIXED, GT_SIG_N };
enum { GT_ACT_NONE, GT_ACT_INC, GT_ACT_ADD };
extern const char *const gt_mode_names[GT_MODE_N];
extern const char *const gt_sig_names[GT_SIG_N];

struct gt_cfg {
  int ngpus, iters, tmax, ring, sigmode, nctx, watchdog_s;
  int mode_on[GT_MODE_N];
  size_t bmin, bmax;
  uint64_t seed;
};

struct gt_tile {
  uint64_t off;      /* inside the pair's region: the same on both sides */
  uint64_t value;    /* the SignalAdd value */
  uint32_t size;
  uint16_t gap;      /* sentinel bytes just before the tile */
  uint8_t action;    /* GT_ACT_*: a signal ends a batch */
  uint8_t pad;
};

struct gt_peer {
  int rank, ntiles, ctx, reset;
  uint32_t sig_inc, sig_add, counter, pad;
  uint64_t exp_inc, exp_add; /* receiver: what the pair's two signals must reach */
  uint64_t counter_exp;      /* sender: local completions due so far in this mode */
};

/* Signals (by source rank s of n), from GT_SIG_FIRST: put uses s
 * (SignalInc) and n + s (SignalAdd), alltoall 2n + s; counters: one per
 * destination. Signal 0 is left alone: NCCL 2.28.9 may give the world GIN
 * barrier signal0 = 0, and a user signal 0 would then also count the
 * barrier's increments (gin_comm.cuh). */
#define GT_SIG_FIRST 1 /* = GC_SIG_FIRST */
static inline int gt_signal_count(int n) { return GT_SIG_FIRST + 3 * n; }
static inline int gt_counter_count(int n) { return n; }

/* Bytes per (peer) region of a window: room for tmax tiles with their gaps
 * and the trailing sentinel, 4 KiB aligned. */
size_t gt_region_bytes(const struct gt_cfg *c);

/* What src puts to dst in this iteration (t: tmax entries); counter_exp and
 * rank are left to the caller. The last tile always ends a batch. */
void gt_plan_pair(const struct gt_cfg *c, int mode, int iter, int src, int dst, int n,
                  struct gt_peer *p, struct gt_tile *t);

/* -o: a comma-separated list of gt_mode_names or "all" sets mode_on of the
 * struct gt_cfg at cfg (a PS_OPT_FN parser, opts.h); -1 when unknown */
int gt_set_modes(void *cfg, const char *arg);

#ifdef __cplusplus
}
#endif
#endif
