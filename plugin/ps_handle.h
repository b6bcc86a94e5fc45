/* Handle tables. What the net plugin hands NCCL (comms, requests, memory
 * handles) is not a pointer but a value packing a table tag, a slot index and
 * the slot's generation. Every call looks its argument up: a value that is
 * not ours (another tag, a slot never reserved) or stale (the slot was freed,
 * or freed and reused since, so its generation moved on) is refused without
 * touching the freed object, because the slots themselves are never freed.
 * A stale pointer checked against a magic in the object it points to was
 * caught only while freed memory happened to be overwritten.
 *
 * Value layout (64 bits): tag (8) | generation (32) | index (24). Tags are
 * 0x01..0x7f. Not 0: a user-space pointer has its top byte clear (x86-64,
 * AArch64 without pointer tags), so it is refused by the tag alone, and a
 * handle is never NULL. Bit 63 clear: NCCL's GIN proxy carries a window
 * handle to the GPU and back in a 63-bit field of its descriptors (the top
 * bit is the descriptor's flag, gin_proxy_device_host_common.h, 2.28-2.30).
 * A slot's generation wraps after 2^32 reuses. */
#ifndef PS_HANDLE_H
#define PS_HANDLE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "ps_nccl_abi.h"

_Static_assert(sizeof(void *) == 8, "handles pack 64 bits into a pointer");

#define PS_HTAB_IDX_BITS 24
#define PS_HTAB_CHUNK_BITS 12
#define PS_HTAB_NCHUNKS (1u << (PS_HTAB_IDX_BITS - PS_HTAB_CHUNK_BITS))

typedef struct {
  uint32_t gen; /* moves on each time the slot's object goes away */
  void *obj;    /* NULL while nothing is bound */
} ps_hslot_t;

typedef struct {
  uint32_t first, n;
} ps_hblock_t;

typedef struct {
  uint8_t tag;
  const char *what;     /* "comm", "request", "memory handle": for messages */
  const char *gone;     /* how its objects go away: "closed", "deregistered" */
  pthread_mutex_t lock; /* reserve and release; lookups take no lock */
  uint32_t top;         /* slots [0, top) were reserved at some point */
  ps_hblock_t *free;    /* released blocks, reused by size */
  size_t nfree, cap;
  /* chunks of 2^PS_HTAB_CHUNK_BITS slots, allocated on first use, never freed */
  ps_hslot_t *chunks[PS_HTAB_NCHUNKS];
} ps_htab_t;

/* A tag outside 0x01..0x7f does not compile (a negative array size). */
#define PS_HTAB_INIT(tag_, what_, gone_)                                                  \
  {.tag = (uint8_t)((tag_) + 0 * sizeof(char[(tag_) > 0 && (tag_) < 0x80 ? 1 : -1])),     \
   .what = (what_), .gone = (gone_), .lock = PTHREAD_MUTEX_INITIALIZER}

/* Reserves n consecutive slots (n >= 1, nothing bound); *first receives the
 * first index. ncclSystemError (logged) when memory or the index space runs out. */
ncclResult_t ps_htab_reserve(ps_htab_t *t, uint32_t n, uint32_t *first);
/* Unbinds whatever is still bound in a reserved block and returns it for reuse. */
void ps_htab_release(ps_htab_t *t, uint32_t first, uint32_t n);
/* Binds obj to reserved slot idx (nothing bound) and returns its handle. The
 * owner of the slot calls bind and unbind; lookups may come from any thread. */
void *ps_htab_bind(ps_htab_t *t, uint32_t idx, void *obj);
void ps_htab_unbind(ps_htab_t *t, uint32_t idx);
/* Writes why `h` is not a live handle of this table into buf (for the
 * warning the caller logs): foreign, or stale and since when. */
void ps_htab_explain(ps_htab_t *t, const void *h, char *buf, size_t n);
/* Logs "call: <why h is not a live handle of t>". */
void ps_htab_refused(ps_htab_t *t, const void *h, const char *call);

static inline ps_hslot_t *ps_htab_slot(ps_htab_t *t, uint32_t idx) {
  ps_hslot_t *chunk = __atomic_load_n(&t->chunks[idx >> PS_HTAB_CHUNK_BITS], __ATOMIC_ACQUIRE);
  return chunk ? &chunk[idx & ((1u << PS_HTAB_CHUNK_BITS) - 1)] : NULL;
}

/* The object a live handle names; NULL for anything else. The data path's
 * whole cost: a tag, an index and a generation compare. */
static inline void *ps_htab_get(ps_htab_t *t, const void *h) {
  uint64_t v = (uint64_t)(uintptr_t)h;
  if ((v >> 56) != t->tag) return NULL;
  ps_hslot_t *s = ps_htab_slot(t, (uint32_t)(v & ((1u << PS_HTAB_IDX_BITS) - 1)));
  if (!s || __atomic_load_n(&s->gen, __ATOMIC_RELAXED) != (uint32_t)(v >> PS_HTAB_IDX_BITS))
    return NULL;
  return __atomic_load_n(&s->obj, __ATOMIC_RELAXED);
}

/* The object h names, or NULL with the reason logged for `call`. */
static inline void *ps_htab_lookup(ps_htab_t *t, const void *h, const char *call) {
  void *obj = ps_htab_get(t, h);
  if (!obj) ps_htab_refused(t, h, call);
  return obj;
}

#endif
