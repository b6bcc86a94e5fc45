/* The one-sided engine (GIN/RMA): a collective communicator over all ranks,
 * symmetric registration, puts, and put+signal whose signal is kept behind
 * its data by one of the ordering strategies. Version-neutral: the exported
 * ncclGin/ncclRma tables (gin_abi.c) only translate into these calls.
 *
 * `coll` is the engine's comm, which gin_abi.c found through its own handle
 * table: it is trusted to be live. What the engine hands out (listen_comm,
 * mh, req) is a handle (ps_handle.h), never a pointer, and is looked up on
 * every call: a stale, foreign or other comm's one is ncclInvalidArgument
 * with a warning naming it. */
#ifndef PS_RMA_H
#define PS_RMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "perseus/perseus_rma.h"
#include "ps_nccl_abi.h"

/* How "signal after data" is guaranteed (PERSEUS_ORDERING). */
typedef enum {
  PS_ORD_AUTO = 0,
  PS_ORD_ORDERED,  /* the provider orders write -> signal */
  PS_ORD_FENCE,    /* signal posted at once with FI_FENCE */
  PS_ORD_TARGET,   /* target applies signals after counting arrivals */
  PS_ORD_DEFERRED, /* signal parked until the peer's earlier puts delivered */
  PS_ORD_DRAIN,    /* block until the peer's puts delivered (the baseline) */
} ps_ordering_t;
extern const char *const ps_ordering_names[]; /* NULL-terminated, indexed by ps_ordering_t */

typedef perseus_rma_peer_stats_t ps_rma_peer_stats_t;

ncclResult_t ps_rma_listen(int dev, void *handle, void **listen_comm);
/* Collective: every rank calls it with all ranks' handles. */
ncclResult_t ps_rma_connect(void *handles[], int nranks, int rank, void *listen_comm,
                            void **coll_comm);
/* Collective: every rank registers its region of one symmetric window.
 * A window flagged NCCL_NET_MR_FLAG_FORCE_SO (signal words) must be 8-byte
 * aligned. `dmabuf` (NULL: none): the GPU window as NCCL exported it
 * (regMrSymDmaBuf), used where the provider takes dma-bufs (ps_ep.h). */
typedef struct ps_dmabuf ps_dmabuf_t;
ncclResult_t ps_rma_reg_sym(void *coll, void *data, size_t size, int type, uint64_t mr_flags,
                            const ps_dmabuf_t *dmabuf, void **mh);
ncclResult_t ps_rma_dereg_sym(void *coll, void *mh);
/* Operations never return a NULL request: what the provider cannot take yet
 * is queued in order and posted by progress (NCCL's GIN proxy does not
 * retry). The caller bounds how many are outstanding, as NCCL does. */
ncclResult_t ps_rma_iput(void *coll, uint64_t src_off, void *src_mh, size_t size,
                         uint64_t dst_off, void *dst_mh, uint32_t rank, void **req);
/* size 0: signal only. op: NCCL_NET_SIGNAL_OP_INC (adds 1) or _ADD (adds value). */
ncclResult_t ps_rma_iput_signal(void *coll, uint64_t src_off, void *src_mh, size_t size,
                                uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t sig_off,
                                void *sig_mh, uint64_t value, uint32_t op, void **req);
/* RMA read of `size` bytes at remote_off of rank's part into local_off. */
ncclResult_t ps_rma_iget(void *coll, uint64_t remote_off, void *remote_mh, size_t size,
                         uint64_t local_off, void *local_mh, uint32_t rank, void **req);
/* Completes once every earlier put/get to `rank` is delivered. */
ncclResult_t ps_rma_iflush(void *coll, void *mh, uint32_t rank, void **req);
ncclResult_t ps_rma_test(void *coll, void *req, int *done);
ncclResult_t ps_rma_progress(void *coll);
ncclResult_t ps_rma_last_error(void *coll, bool *has_error);
ncclResult_t ps_rma_close_coll(void *coll);
ncclResult_t ps_rma_close_listen(void *listen_comm);
ps_ordering_t ps_rma_ordering(void *coll);
ncclResult_t ps_rma_peer_stats(void *coll, uint32_t rank, ps_rma_peer_stats_t *out);
/* Totals over every comm of the process, closed ones included. */
void ps_rma_process_stats(ps_rma_peer_stats_t *out);

#endif
