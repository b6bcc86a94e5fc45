/* A window over sequence numbers that complete in any order: `below` only
 * moves over a gap-free run (every seq < below is complete). The origin uses
 * one per peer for its puts' completions, the target one per peer for the
 * writes that arrived. */
#ifndef PS_SEQWIN_H
#define PS_SEQWIN_H

#include <stdint.h>

typedef struct {
  uint64_t below;
  uint64_t ring;  /* flags cover [below, below + ring); power of two, 0 until first use */
  uint8_t *flags;
} ps_seqwin_t;

/* Marks `s` complete and advances `below`. -1 (nothing changed) when s is
 * already complete, at least `max_ahead` past `below`, or memory runs out. */
int ps_seqwin_mark(ps_seqwin_t *w, uint64_t s, uint64_t max_ahead);
void ps_seqwin_free(ps_seqwin_t *w);

#endif
