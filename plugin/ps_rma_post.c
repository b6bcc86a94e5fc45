/* How the engine's RMA writes reach the provider: directly, or, in test
 * builds only (-DPS_REORDER_TEST, never the plugin), through an "unordered
 * NIC" that holds each write 0-2 ms and sends the held ones in random order,
 * so a signal that does not really wait for its data overtakes it. */
#include <stdlib.h>

#include "ps_comm.h"
#include "ps_rma_int.h"

#ifdef PS_REORDER_TEST
struct ps_held_write {
  struct iovec iov;
  struct fi_rma_iov rma;
  void *desc, *context;
  fi_addr_t addr;
  uint64_t flags, data;
  uint64_t release_ns;
};

static uint64_t next_rand(ps_rma_comm_t *c) {
  c->rng = c->rng * 6364136223846793005ULL + 1442695040888963407ULL;
  return c->rng >> 17;
}

ncclResult_t ps_rma_post_write(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_rma *m,
                               uint64_t flags, int *posted) {
  (void)peer; /* no lanes: fence is refused on the unordered NIC */
  *posted = 0;
  if (c->nheld == c->cap_held) {
    int cap = c->cap_held ? 2 * c->cap_held : 256;
    struct ps_held_write *n = realloc(c->held, (size_t)cap * sizeof *n);
    if (!n) return ncclSystemError;
    c->held = n, c->cap_held = cap;
  }
  *posted = 1;
  c->held[c->nheld++] = (struct ps_held_write){
      .iov = m->msg_iov[0], .rma = m->rma_iov[0], .desc = m->desc[0], .context = m->context,
      .addr = m->addr, .flags = flags, .data = m->data,
      .release_ns = ps_now_ns() + next_rand(c) % 2000000};
  return ncclSuccess;
}

void ps_rma_release_held(ps_rma_comm_t *c) {
  uint64_t now = ps_now_ns();
  for (int tries = c->nheld; tries > 0 && c->nheld > 0; tries--) {
    int i = (int)(next_rand(c) % (uint64_t)c->nheld);
    struct ps_held_write *h = &c->held[i];
    if (h->release_ns > now) continue;
    struct fi_msg_rma m = {.msg_iov = &h->iov, .desc = &h->desc, .iov_count = 1, .addr = h->addr,
                           .rma_iov = &h->rma, .rma_iov_count = 1, .context = h->context,
                           .data = h->data};
    ssize_t rc = fi_writemsg(c->ep.ep, &m, h->flags);
    if (rc == -FI_EAGAIN) return;
    if (rc) {
      ps_rma_fail(c, ncclSystemError, "held write: %s", fi_strerror((int)-rc));
      return;
    }
    c->held[i] = c->held[--c->nheld];
  }
}

void ps_rma_free_held(ps_rma_comm_t *c) { free(c->held); }
#else
ncclResult_t ps_rma_post_write(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_rma *m,
                               uint64_t flags, int *posted) {
  return ps_ep_writemsg(&c->ep, c->lanes ? c->lanes[peer] : c->ep.ep, m, flags, posted);
}
void ps_rma_release_held(ps_rma_comm_t *c) { (void)c; }
void ps_rma_free_held(ps_rma_comm_t *c) { (void)c; }
#endif
