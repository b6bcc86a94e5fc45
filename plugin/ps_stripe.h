/* Striping a two-sided comm over several endpoints (PERSEUS_NSTREAMS).
 *
 * A comm keeps its own endpoint for everything it does today (small
 * messages, the handshake, liveness) and gets PERSEUS_NSTREAMS - 1 extra
 * endpoints, each connected to its twin on the peer's comm and driven by a
 * thread of its own. A message of PERSEUS_STRIPE_MIN bytes or more is cut
 * into one part per endpoint (ps_stripe_part): the first part goes on the
 * comm's endpoint, in order with every other message and matched by NCCL's
 * tag, and its remote CQ data carries the message's total size and its
 * stripe number (every message there carries its size, ps_wire.h). The receiver learns both only there, so it posts the other
 * parts (tagged PS_TAG_STRIPE(number, part)) once the first has arrived; the
 * sender's parts wait at the provider meanwhile. Each extra endpoint's thread
 * posts its parts and reads its completions, so one message's bytes move on
 * as many connections and cores as there are endpoints. */
#ifndef PS_STRIPE_H
#define PS_STRIPE_H

#include <string.h>

#include "ps_ep.h"

typedef struct ps_stripe ps_stripe_t;

/* Part `i` of `parts` of a striped message of n bytes: [*off, *off + *len),
 * cut at cache-line boundaries; a part may be empty (n small for the
 * count). Sender and receiver compute the same. */
static inline void ps_stripe_part(uint64_t n, int parts, int i, uint64_t *off, uint64_t *len) {
  uint64_t q = (n + (uint64_t)parts - 1) / (uint64_t)parts;
  q = (q + 63) & ~(uint64_t)63;
  uint64_t lo = q * (uint64_t)i, hi = lo + q;
  *off = lo < n ? lo : n;
  *len = (hi < n ? hi : n) - *off;
}

/* Endpoints per comm where PERSEUS_NSTREAMS is unset, for provider `prov`
 * (libfabric's prov_name, e.g. "tcp;ofi_rxm") on a host with `cpus` CPUs
 * online: 4 on tcp (alone or under a utility provider) with 16 CPUs or
 * more, where one connection is bound by a core's socket copies and the
 * extra threads have cores to run on; else 1. */
static inline int ps_stripe_default(const char *prov, long cpus) {
  return prov && !strncmp(prov, "tcp", 3) && (!prov[3] || prov[3] == ';') && cpus >= 16 ? 4 : 1;
}
/* Extra endpoints a new comm on d should offer: PERSEUS_NSTREAMS - 1 (unset:
 * ps_stripe_default's count - 1), or 0
 * where the provider cannot stripe (memory registrations bound to one
 * endpoint, no 8 bytes of remote CQ data; said once at INFO). */
int ps_stripe_wanted(const ps_device_t *d);
/* For the INFO line that reports the count: where it came from when
 * PERSEUS_NSTREAMS is unset, else "". */
const char *ps_stripe_unset_note(void);
/* Opens n extra endpoints on d; `jobs` bounds the parts queued on one at a
 * time (every live sub-request has at most one part per endpoint). *out is
 * NULL when none could be opened with an address that fits a control
 * message (logged): the comm then does not stripe. */
ncclResult_t ps_stripe_open(ps_device_t *d, int n, int jobs, ps_stripe_t **out);
/* Writes our endpoints' addresses into a CONNECT or ACCEPT (s may be NULL). */
void ps_stripe_addrs(const ps_stripe_t *s, ps_ctrl_msg_t *m);
/* After the handshake: keeps the first n endpoints (closing the rest),
 * addresses the peer's from m (n of them) and starts their threads. */
ncclResult_t ps_stripe_connect(ps_stripe_t *s, const ps_ctrl_msg_t *m, int n);
/* Stops the threads, then closes the endpoints (their operations die with
 * them). NULL is fine. */
void ps_stripe_close(ps_stripe_t *s);
/* Extra endpoints (0 for NULL). */
int ps_stripe_count(const ps_stripe_t *s);
/* Queues a part on extra endpoint `stream` (1..count): its thread posts it
 * (a send to the peer's twin, or a receive) and runs op's callback, in that
 * thread, when it completes or fails. */
ncclResult_t ps_stripe_post(ps_stripe_t *s, int stream, int is_send, void *buf, size_t len,
                            void *desc, uint64_t tag, ps_op_t *op);
/* Why an extra endpoint failed (its thread stopped using it), or NULL. */
const char *ps_stripe_failed(ps_stripe_t *s);

#endif
