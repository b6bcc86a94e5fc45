/* ps_seqwin: out-of-order completions advance `below` only over gap-free
 * runs; duplicates, stale and too-far sequence numbers are refused. */
#include <stdlib.h>

#include "ps_seqwin.h"
#include "unit_check.h"

int main(void) {
  /* 5000 sequence numbers completed in a random order (the ring must grow
   * past its first 1024 slots); below is always the first missing one. */
  enum { N = 5000 };
  static uint64_t order[N];
  static uint8_t seen[N + 2];
  for (int i = 0; i < N; i++) order[i] = (uint64_t)i + 1;
  srand(7);
  for (int i = N - 1; i > 0; i--) {
    int j = rand() % (i + 1);
    uint64_t t = order[i];
    order[i] = order[j], order[j] = t;
  }
  ps_seqwin_t w = {.below = 1};
  uint64_t first_missing = 1;
  int bad_below = 0;
  for (int i = 0; i < N; i++) {
    EXPECT(ps_seqwin_mark(&w, order[i], N + 1) == 0, "mark %llu refused", (unsigned long long)order[i]);
    seen[order[i]] = 1;
    while (first_missing <= N && seen[first_missing]) first_missing++;
    bad_below += w.below != first_missing;
  }
  EXPECT(bad_below == 0, "below differed from the first missing seq %d times", bad_below);
  EXPECT(w.below == N + 1, "below %llu after all %d, expected %d", (unsigned long long)w.below, N, N + 1);

  /* refusals leave the window as it was */
  EXPECT(ps_seqwin_mark(&w, 10, N) != 0, "a completed (stale) seq was accepted");
  EXPECT(ps_seqwin_mark(&w, N + 3, 16) == 0, "a seq inside the window was refused");
  EXPECT(ps_seqwin_mark(&w, N + 3, 16) != 0, "a duplicate was accepted");
  EXPECT(ps_seqwin_mark(&w, N + 1 + 16, 16) != 0, "a seq max_ahead past below was accepted");
  EXPECT(w.below == N + 1, "below moved to %llu over a gap", (unsigned long long)w.below);
  EXPECT(ps_seqwin_mark(&w, N + 2, 16) == 0 && ps_seqwin_mark(&w, N + 1, 16) == 0 && w.below == N + 4,
         "filling the gap should move below to %d, got %llu", N + 4, (unsigned long long)w.below);
  ps_seqwin_free(&w);
  printf("unit_seqwin: %d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
