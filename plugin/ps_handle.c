#include "ps_handle.h"

#include <stdio.h>
#include <stdlib.h>

#include "ps_log.h"

#define PS_HTAB_SLOTS (1u << PS_HTAB_IDX_BITS)
#define PS_HTAB_CHUNK (1u << PS_HTAB_CHUNK_BITS)

/* Called with the lock held: every chunk of [first, first + n) exists. */
static ncclResult_t ensure_chunks(ps_htab_t *t, uint32_t first, uint32_t n) {
  for (uint32_t k = first >> PS_HTAB_CHUNK_BITS; k <= (first + n - 1) >> PS_HTAB_CHUNK_BITS; k++) {
    if (t->chunks[k]) continue;
    ps_hslot_t *c = calloc(PS_HTAB_CHUNK, sizeof *c);
    if (!c) {
      PS_WARN("%s table: out of memory for %u more slots", t->what, PS_HTAB_CHUNK);
      return ncclSystemError;
    }
    /* lookups read chunk pointers without the lock */
    __atomic_store_n(&t->chunks[k], c, __ATOMIC_RELEASE);
  }
  return ncclSuccess;
}

ncclResult_t ps_htab_reserve(ps_htab_t *t, uint32_t n, uint32_t *first) {
  ncclResult_t rc = ncclSuccess;
  pthread_mutex_lock(&t->lock);
  /* A table's blocks have one size (1, or a comm's request pool), so the
   * last block released fits at once; the generations tell its users apart. */
  for (size_t i = t->nfree; i-- > 0;)
    if (t->free[i].n == n) {
      *first = t->free[i].first;
      t->free[i] = t->free[--t->nfree];
      goto out;
    }
  if (n == 0 || n > PS_HTAB_SLOTS - t->top) {
    PS_WARN("%s table full: %u slots reserved, %u more asked for (at most %u)", t->what, t->top, n,
            PS_HTAB_SLOTS);
    rc = ncclSystemError;
    goto out;
  }
  rc = ensure_chunks(t, t->top, n);
  if (rc == ncclSuccess) {
    *first = t->top;
    __atomic_store_n(&t->top, t->top + n, __ATOMIC_RELAXED); /* explain reads it unlocked */
  }
out:
  pthread_mutex_unlock(&t->lock);
  return rc;
}

/* A slot the caller reserved: its chunk exists. */
static ps_hslot_t *owned(ps_htab_t *t, uint32_t idx) {
  return &t->chunks[idx >> PS_HTAB_CHUNK_BITS][idx & (PS_HTAB_CHUNK - 1)];
}

void ps_htab_release(ps_htab_t *t, uint32_t first, uint32_t n) {
  for (uint32_t i = first; i < first + n; i++)
    if (__atomic_load_n(&owned(t, i)->obj, __ATOMIC_RELAXED)) ps_htab_unbind(t, i);
  pthread_mutex_lock(&t->lock);
  if (t->nfree == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 64;
    ps_hblock_t *f = realloc(t->free, cap * sizeof *f);
    if (!f) {
      /* the slots are lost for reuse, which costs index space, not safety */
      PS_WARN("%s table: out of memory, %u slots not reused", t->what, n);
      pthread_mutex_unlock(&t->lock);
      return;
    }
    t->free = f;
    t->cap = cap;
  }
  t->free[t->nfree++] = (ps_hblock_t){.first = first, .n = n};
  pthread_mutex_unlock(&t->lock);
}

void *ps_htab_bind(ps_htab_t *t, uint32_t idx, void *obj) {
  ps_hslot_t *s = owned(t, idx);
  __atomic_store_n(&s->obj, obj, __ATOMIC_RELAXED);
  uint64_t v = (uint64_t)t->tag << 56 | (uint64_t)s->gen << PS_HTAB_IDX_BITS | idx;
  return (void *)(uintptr_t)v;
}

void ps_htab_unbind(ps_htab_t *t, uint32_t idx) {
  ps_hslot_t *s = owned(t, idx);
  __atomic_store_n(&s->obj, NULL, __ATOMIC_RELAXED);
  __atomic_store_n(&s->gen, s->gen + 1, __ATOMIC_RELAXED);
}

void ps_htab_explain(ps_htab_t *t, const void *h, char *buf, size_t n) {
  uint64_t v = (uint64_t)(uintptr_t)h;
  uint32_t idx = (uint32_t)(v & (PS_HTAB_SLOTS - 1)), gen = (uint32_t)(v >> PS_HTAB_IDX_BITS);
  ps_hslot_t *s = (v >> 56) == t->tag ? ps_htab_slot(t, idx) : NULL;
  if (!h)
    snprintf(buf, n, "NULL is not a perseus %s", t->what);
  else if (!s || idx >= __atomic_load_n(&t->top, __ATOMIC_RELAXED))
    snprintf(buf, n, "%p is not a perseus %s", h, t->what);
  else if (__atomic_load_n(&s->gen, __ATOMIC_RELAXED) == gen)
    snprintf(buf, n, "%p is a perseus %s slot with nothing bound (forged?)", h, t->what);
  else
    snprintf(buf, n, "%p is a stale %s (slot %u generation %u, the slot is at generation %u now): "
             "it was %s", h, t->what, idx, gen, __atomic_load_n(&s->gen, __ATOMIC_RELAXED),
             t->gone);
}

void ps_htab_refused(ps_htab_t *t, const void *h, const char *call) {
  char why[200];
  ps_htab_explain(t, h, why, sizeof why);
  PS_WARN("%s: %s", call, why);
}
