/* gin_plan.c: perseus_gin_test's plans, drawn from the seed (gin_plan.h). */
#include <stdio.h>
#include <string.h>

#include "gin_plan.h"

const char *const gt_mode_names[GT_MODE_N] = {"put", "alltoall"};
const char *const gt_sig_names[GT_SIG_N] = {"inc", "add", "alt", "mixed"};

static uint64_t splitmix(uint64_t *s)
{
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static int log2_floor(uint64_t v) { return 63 - __builtin_clzll(v); }

/* log-uniform: tiny tiles as likely as large ones */
static size_t rand_size(uint64_t *s, size_t lo, size_t hi)
{
  if (lo >= hi) return lo;
  int elo = log2_floor(lo), ehi = log2_floor(hi);
  int e = elo + (int)(splitmix(s) % (uint64_t)(ehi - elo + 1));
  size_t a = (size_t)1 << e, b = ((size_t)2 << e) - 1;
  if (a < lo) a = lo;
  if (b > hi) b = hi;
  return a + (size_t)(splitmix(s) % (b - a + 1));
}

size_t gt_region_bytes(const struct gt_cfg *c)
{
  size_t r = (size_t)c->tmax * (c->bmax + GT_GAP_MAX) + GT_TRAIL_BYTES;
  return (r + 4095) & ~(size_t)4095;
}

void gt_plan_pair(const struct gt_cfg *c, int mode, int iter, int src, int dst, int n,
                  struct gt_peer *p, struct gt_tile *t)
{
  uint64_t key = (uint64_t)mode << 60 | (uint64_t)iter << 24;
  uint64_t s = c->seed ^ key ^ ((uint64_t)src << 12 | (uint64_t)dst);
  uint64_t s_iter = c->seed ^ key ^ 0xfffffful; /* the same for every pair */
  splitmix(&s);
  memset(p, 0, sizeof(*p));
  p->ctx = (src + dst) % c->nctx;
  p->sig_inc = (uint32_t)(GT_SIG_FIRST + (mode == GT_MODE_PUT ? 0 : 2) * n + src);
  p->sig_add = (uint32_t)(GT_SIG_FIRST + n + src);
  p->counter = (uint32_t)dst;
  p->reset = mode == GT_MODE_PUT;
  p->ntiles = mode == GT_MODE_PUT ? 1 + (int)(splitmix(&s) % (uint64_t)c->tmax) : 1;
  /* put: a signal per tile, one for all tiles, or random batches, in turn */
  int policy = mode == GT_MODE_PUT ? iter % 3 : 0, left = 0, batches = 0;
  size_t a2a_size = rand_size(&s_iter, c->bmin, c->bmax);
  uint64_t off = 0;
  for (int k = 0; k < p->ntiles; k++) {
    struct gt_tile *d = &t[k];
    memset(d, 0, sizeof(*d));
    d->gap = (uint16_t)(splitmix(&s) % GT_GAP_MAX);
    d->size = (uint32_t)(mode == GT_MODE_PUT ? rand_size(&s, c->bmin, c->bmax) : a2a_size);
    d->off = off + d->gap;
    off = d->off + d->size;
    if (left == 0)
      left = policy == 0 ? 1 : policy == 1 ? p->ntiles
           : 1 + (int)(splitmix(&s) % (uint64_t)(p->ntiles - k));
    if (--left > 0) continue; /* a plain put inside the batch */
    int inc = mode == GT_MODE_ALLTOALL || c->sigmode == GT_SIG_INC ||
              (c->sigmode == GT_SIG_ALT && batches % 2 == 0) ||
              (c->sigmode == GT_SIG_MIXED && (splitmix(&s) & 1));
    batches++;
    if (inc) {
      d->action = GT_ACT_INC;
      d->value = 1;
      p->exp_inc++;
    } else { /* high bits too: the proxy carries 64-bit signal values in pieces */
      d->action = GT_ACT_ADD;
      d->value = 1 + splitmix(&s) % 65536 + ((splitmix(&s) % 16) << 36);
      p->exp_add += d->value;
    }
  }
  /* alltoall never resets its signal: the wait compares with the running total */
  if (mode == GT_MODE_ALLTOALL) p->exp_inc = (uint64_t)iter + 1;
}

int gt_set_modes(void *cfg, const char *arg)
{
  struct gt_cfg *c = cfg;
  char buf[128], *save = NULL;
  if (snprintf(buf, sizeof(buf), "%s", arg) >= (int)sizeof(buf)) return -1;
  memset(c->mode_on, 0, sizeof(c->mode_on));
  for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    int all = !strcmp(t, "all"), found = all;
    for (int m = 0; m < GT_MODE_N; m++)
      if (all || !strcmp(t, gt_mode_names[m])) c->mode_on[m] = found = 1;
    if (!found) return -1;
  }
  for (int m = 0; m < GT_MODE_N; m++)
    if (c->mode_on[m]) return 0;
  return -1; /* no mode named: a test of nothing would pass */
}
