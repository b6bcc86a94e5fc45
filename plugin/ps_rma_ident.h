/* One-sided engine, floor 8 (ps_rma_ident.c): a peer's claimed rank
 * against the sender the provider names. */
#ifndef PS_RMA_IDENT_H
#define PS_RMA_IDENT_H

#include <stdint.h>
#include <rdma/fabric.h>

typedef struct ps_rma_comm ps_rma_comm_t;

/* Whether what a peer sent (`kind`, for the log: "a signal") claiming rank
 * `claimed` (< nranks) came from that rank: its address in `addr` (the
 * receiving endpoint's, per rank) is `src`, where the endpoint names senders
 * (named). 1 when it did, or nobody can say; else 0, the comm failed naming
 * both ranks. */
int ps_rma_sender_ok(ps_rma_comm_t *c, const char *kind, uint32_t claimed, const fi_addr_t *addr,
                     int named, fi_addr_t src);
/* The same for a write's remote CQ data (the rank it claims is in it). */
int ps_rma_writer_ok(ps_rma_comm_t *c, uint64_t data, const fi_addr_t *addr, int named,
                     fi_addr_t src);
/* For the comm's log line: what is verified, or "sender not verified". */
const char *ps_rma_sender_note(const ps_rma_comm_t *c);

#endif
