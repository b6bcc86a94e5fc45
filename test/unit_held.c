/* The target side's held signals (plugin/ps_rma_held.c) against a stub
 * engine: each signal is applied once, exactly when what it covers is
 * there (its writes, then its staged writes, enqueued for a GPU word in a
 * staged window, copied for any other), a signal whose GPU word has no
 * tracking room waits for a later pass, the cap holds, and a peer holding
 * many signals while its writes trickle in costs little per arrival. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ps_rma_int.h"
#include "unit_check.h"

/* --- the stub engine: applying a signal records it --- */
static ps_rma_peer_t *peer;        /* the one peer under test */
static uint64_t applied, bad_apply; /* signals applied; applied before what they cover */
static uint64_t value_sum;
static int no_room;                 /* apply refuses (no GPU word tracking room) this many more */
static char last_fail[256];

void ps_rma_fail(ps_rma_comm_t *c, ncclResult_t rc, const char *fmt, ...) {
  if (c->error) return;
  c->error = rc;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_fail, sizeof last_fail, fmt, ap);
  va_end(ap);
}

int ps_rma_apply_signal(ps_rma_comm_t *c, const ps_sig_msg_t *m) {
  if (no_room > 0) {
    no_room--;
    return 1;
  }
  ps_rma_region_t *r = m->region_id < c->nregions ? c->regions[m->region_id] : NULL;
  uint64_t staged_reached = r && r->staged ? peer->stage_in.below : peer->stage_done.below;
  if (m->covers >= peer->arrived.below || (m->covers_staged && m->covers_staged >= staged_reached))
    bad_apply++;
  applied++, value_sum += m->value;
  return 0;
}

static ps_sig_msg_t sig(uint64_t covers, uint64_t covers_staged, uint32_t region, uint64_t value) {
  return (ps_sig_msg_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                        .op = NCCL_NET_SIGNAL_OP_ADD, .src_rank = 1, .region_id = region,
                        .value = value, .covers = covers, .covers_staged = covers_staged};
}

static void reset(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  ps_rma_held_free(p);
  c->error = ncclSuccess;
  p->arrived.below = p->stage_in.below = p->stage_done.below = 1;
  applied = bad_apply = value_sum = 0;
  no_room = 0;
  last_fail[0] = 0;
}

static uint64_t next_rand(uint64_t *s) {
  *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
  return *s;
}

int main(void) {
  ps_rma_region_t host = {.staged = 0}, gpu = {.staged = 1};
  ps_rma_region_t *regions[2] = {&host, &gpu};
  ps_rma_comm_t *c = calloc(1, sizeof *c);
  ps_rma_peer_t *p = calloc(1, sizeof *p);
  if (!c || !p) return 1;
  c->regions = regions, c->nregions = 2;
  peer = p;
  ps_rma_held_init(p);
  reset(c, p);

  /* writes: held until every write below `covers` arrived, smallest first */
  ps_sig_msg_t s5 = sig(5, 0, 0, 5), s3 = sig(3, 0, 0, 3), s9 = sig(9, 0, 0, 9), s0 = sig(0, 0, 0, 100);
  ps_rma_held_take(c, p, &s5), ps_rma_held_take(c, p, &s3), ps_rma_held_take(c, p, &s9);
  ps_rma_held_take(c, p, &s0); /* covers nothing: applied at once */
  EXPECT(applied == 1 && value_sum == 100 && p->nheld == 3, "applied %llu (sum %llu), held %u",
         (unsigned long long)applied, (unsigned long long)value_sum, p->nheld);
  p->arrived.below = 4;
  ps_rma_held_release(c, p);
  EXPECT(applied == 2 && value_sum == 103 && p->nheld == 2, "below 4: applied %llu (sum %llu)",
         (unsigned long long)applied, (unsigned long long)value_sum);
  p->arrived.below = 10;
  ps_rma_held_release(c, p);
  EXPECT(applied == 4 && value_sum == 117 && p->nheld == 0 && !bad_apply,
         "below 10: applied %llu (sum %llu), held %u, early %llu", (unsigned long long)applied,
         (unsigned long long)value_sum, p->nheld, (unsigned long long)bad_apply);

  /* staged writes: a GPU word (staged window) waits for the copies to be
   * enqueued, any other word for them to be done; writes first */
  reset(c, p);
  ps_sig_msg_t g = sig(0, 3, 1, 1), h = sig(0, 3, 0, 2), both = sig(2, 2, 1, 4);
  ps_rma_held_take(c, p, &g), ps_rma_held_take(c, p, &h), ps_rma_held_take(c, p, &both);
  EXPECT(applied == 0 && p->nheld == 3, "nothing there yet: applied %llu", (unsigned long long)applied);
  p->stage_in.below = 4; /* enqueued, not done */
  ps_rma_held_release(c, p);
  EXPECT(applied == 1 && value_sum == 1, "enqueued: only the GPU word's signal (sum %llu)",
         (unsigned long long)value_sum);
  p->arrived.below = 3; /* both's writes arrived; its staged writes were enqueued already */
  ps_rma_held_release(c, p);
  EXPECT(applied == 2 && value_sum == 5, "writes arrived: sum %llu", (unsigned long long)value_sum);
  p->stage_done.below = 4;
  ps_rma_held_release(c, p);
  EXPECT(applied == 3 && value_sum == 7 && p->nheld == 0 && !bad_apply, "copies done: sum %llu",
         (unsigned long long)value_sum);

  /* no room to track a GPU word: held, retried by the next pass, in order,
   * up to the first that still has none */
  reset(c, p);
  no_room = 1;
  ps_sig_msg_t r1 = sig(0, 0, 1, 1), r2 = sig(0, 0, 1, 2);
  ps_rma_held_take(c, p, &r1);
  EXPECT(applied == 0 && p->nheld == 1, "refused once: held (%u)", p->nheld);
  ps_rma_held_take(c, p, &r2); /* room again: applied at once */
  EXPECT(applied == 1 && value_sum == 2, "the next one applied (sum %llu)", (unsigned long long)value_sum);
  no_room = 1;
  ps_rma_held_release(c, p);
  EXPECT(applied == 1 && p->nheld == 1, "still no room: kept (%u)", p->nheld);
  ps_rma_held_release(c, p);
  EXPECT(applied == 2 && value_sum == 3 && p->nheld == 0, "room: applied (sum %llu, held %u)",
         (unsigned long long)value_sum, p->nheld);

  /* many held, writes trickling in (in any order), each arrival a release:
   * every signal applied once, none early, and quickly */
  reset(c, p);
  enum { N = 1 << 18 };
  uint64_t rs = 0x9e3779b97f4a7c15ull, want = 0;
  for (uint32_t i = 0; i < N; i++) {
    uint64_t covers = 2 + next_rand(&rs) % N;
    ps_sig_msg_t m = sig(covers, 0, 0, covers);
    want += covers;
    ps_rma_held_take(c, p, &m);
  }
  EXPECT(p->nheld == N && !c->error, "held %u of %u (%s)", p->nheld, N, last_fail);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  /* writes 2.. arrive while write 1 is missing: below stays at 1, and each
   * arrival's release finds nothing to apply */
  for (uint64_t i = 0; i < N; i++) ps_rma_held_release(c, p);
  EXPECT(applied == 0, "applied %llu while write 1 was missing", (unsigned long long)applied);
  for (uint64_t below = 2; below <= N + 2; below++) {
    p->arrived.below = below;
    ps_rma_held_release(c, p);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  EXPECT(applied == N && value_sum == want && !bad_apply && p->nheld == 0,
         "applied %llu of %u (early %llu), sum %llu of %llu", (unsigned long long)applied, N,
         (unsigned long long)bad_apply, (unsigned long long)value_sum, (unsigned long long)want);
  /* a scan of every held signal per arrival takes N^2 / 2 steps (minutes) */
  EXPECT(s < 10, "%u held signals and %u arrivals took %.1f s", N, 2 * N, s);
  printf("%u held signals, %u arrivals: %.3f s\n", N, 2 * N, s);

  /* the cap: a peer cannot make us hold more than PS_RMA_MAX_REQS */
  reset(c, p);
  ps_sig_msg_t far = sig(1u << 21, 0, 0, 1);
  for (uint32_t i = 0; i <= PS_RMA_MAX_REQS && !c->error; i++) ps_rma_held_take(c, p, &far);
  EXPECT(c->error == ncclSystemError && strstr(last_fail, "signals waiting") && p->nheld == PS_RMA_MAX_REQS,
         "past the cap: error %d (%s), held %u", c->error, last_fail, p->nheld);

  ps_rma_held_free(p);
  free(p), free(c);
  return unit_report("unit_held");
}
