/* One-sided engine, floor 8: who sent what the engine takes. A peer's
 * messages (signals, credits, refusals, window-closed notices, registration
 * and staging-streams parts) name their sender's rank, and its writes'
 * remote CQ data the writer's: taken on the peer's word, one peer could act
 * as another (apply signals and mark writes arrived in its name, hand out
 * its keys). Where the provider names the sender too (FI_SOURCE; which
 * providers, and for which completions, ps_fabric.c says) the two must
 * agree; where it cannot, the rank is taken on the peer's word, as the
 * comm's log line says once. */
#include <stdio.h>
#include <string.h>

#include "ps_log.h"
#include "ps_rma_int.h"

int ps_rma_sender_ok(ps_rma_comm_t *c, const char *kind, uint32_t claimed, const fi_addr_t *addr,
                     int named, fi_addr_t src) {
  if (!named || src == addr[claimed]) return 1;
  int from = -1;
  for (int p = 0; p < c->nranks && from < 0; p++)
    if (addr[p] == src) from = p;
  char who[48] = "an address that is no rank of this comm";
  if (from >= 0) snprintf(who, sizeof who, "rank %d", from);
  ps_rma_fail(c, ncclRemoteError, "%s claiming to come from rank %u was sent by %s: a peer posing "
              "as another rank", kind, claimed, who);
  return 0;
}

int ps_rma_writer_ok(ps_rma_comm_t *c, uint64_t data, const fi_addr_t *addr, int named,
                     fi_addr_t src) {
  uint64_t claimed = (data & ~PS_STAGED_DATA) >> 32;
  if (claimed >= (uint64_t)c->nranks) return 1; /* the target refuses it, naming the value */
  return ps_rma_sender_ok(c, (data & PS_STAGED_DATA) ? "a staged write" : "a write's remote CQ data",
                          (uint32_t)claimed, addr, named, src);
}

const char *ps_rma_sender_note(const ps_rma_comm_t *c) {
  if (c->ep.src_writes) return "senders verified (messages and writes)";
  if (c->ep.src_msgs)
    return "senders of messages verified; sender not verified for writes (the provider does not "
           "name writers)";
  if (!strcmp(c->ep.dev->info->fabric_attr->prov_name, "tcp;ofi_rxm"))
    return "sender not verified (rxm's passthru to tcp names no senders; with "
           "PERSEUS_TCP_PASSTHRU=0 rxm's own protocol names those of messages)";
  return "sender not verified (the provider names no senders, or none that was seen to be right)";
}
