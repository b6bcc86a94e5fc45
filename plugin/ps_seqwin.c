#include "ps_seqwin.h"

#include <stdlib.h>

/* Grows the ring until it covers s; flags keep their sequence numbers. */
static int cover(ps_seqwin_t *w, uint64_t s) {
  uint64_t ring = w->ring ? w->ring : 1024;
  while (ring <= s - w->below) ring *= 2;
  if (ring == w->ring) return 0;
  uint8_t *n = calloc(ring, 1);
  if (!n) return -1;
  for (uint64_t q = w->below; q < w->below + w->ring; q++) n[q & (ring - 1)] = w->flags[q & (w->ring - 1)];
  free(w->flags);
  w->flags = n, w->ring = ring;
  return 0;
}

int ps_seqwin_mark(ps_seqwin_t *w, uint64_t s, uint64_t max_ahead) {
  if (s < w->below || s - w->below >= max_ahead || cover(w, s) || w->flags[s & (w->ring - 1)])
    return -1;
  w->flags[s & (w->ring - 1)] = 1;
  while (w->flags[w->below & (w->ring - 1)]) w->flags[w->below++ & (w->ring - 1)] = 0;
  return 0;
}

void ps_seqwin_free(ps_seqwin_t *w) {
  free(w->flags);
  w->flags = NULL, w->ring = 0;
}
