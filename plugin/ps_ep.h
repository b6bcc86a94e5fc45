/* One libfabric RDM endpoint with its CQ and AV. Every posted operation
 * carries a ps_op_t whose callback runs when its completion (or error) is
 * read from the CQ. */
#ifndef PS_EP_H
#define PS_EP_H

#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#include "ps_fabric.h"
#include "ps_wire.h"

typedef struct ps_op ps_op_t;
/* err == 0: success, e is the completion; else a negative fi errno and errstr. */
typedef void (*ps_op_cb)(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err,
                         const char *errstr);
struct ps_op {
  struct fi_context2 fictx; /* first: satisfies FI_CONTEXT and FI_CONTEXT2 */
  ps_op_cb cb;
  void *owner;
  int idx;
  /* A receive's sender, set before cb where the endpoint names senders
   * (src_named, ps_ep_t.src_msgs): its fi_addr_t in the endpoint's AV, or
   * FI_ADDR_NOTAVAIL for an address not in it. */
  int src_named;
  fi_addr_t src;
};

typedef struct {
  ps_device_t *dev;
  struct fid_ep *ep;
  struct fid_cq *cq;
  struct fid_av *av;
  uint8_t addr[PS_CTRL_ADDR_MAX];
  size_t addrlen;
  int eagain_retries;
  /* The provider names who sent a message (FI_SOURCE), and who wrote remote
   * CQ data (its device's src_msgs, src_writes). */
  int src_msgs, src_writes;
  /* Completions of peers' writes that carried remote CQ data (no operation
   * of ours attached): handed to this callback, if set, with the writer as
   * a ps_op_t's src (named: 0 where the endpoint cannot say). */
  void (*remote_write)(void *owner, uint64_t data, int named, fi_addr_t src);
  void *remote_owner;
  char fatal[512]; /* a CQ error with no operation attached; non-empty = endpoint unusable */
} ps_ep_t;

ncclResult_t ps_ep_open(ps_device_t *dev, int eagain_retries, ps_ep_t *ep);
void ps_ep_close(ps_ep_t *ep);
/* Inserts a peer's address of `len` bytes (from a handle or a handshake
 * message: untrusted). On shm it is checked first (a name, NUL-terminated
 * within len, of an existing endpoint): libfabric would read past it or
 * crash on a closed endpoint's. ps_ep_insert: len = PS_HANDLE_ADDR_MAX, for
 * the address field of a ps_handle_t or a ps_ctrl_msg_t. */
ncclResult_t ps_ep_insert_len(ps_ep_t *ep, const void *addr, size_t len, fi_addr_t *out);
ncclResult_t ps_ep_insert(ps_ep_t *ep, const void *addr, fi_addr_t *out);
/* Reads completions until the CQ is empty or `budget` were handled. */
ncclResult_t ps_ep_progress(ps_ep_t *ep, int budget, int *handled);
/* Post, retrying -FI_EAGAIN after progress. *posted = 0 when the provider
 * still refused after the configured retries (the caller backs off). */
ncclResult_t ps_ep_tsend(ps_ep_t *ep, const void *buf, size_t len, void *desc, fi_addr_t dest,
                         uint64_t tag, ps_op_t *op, int *posted);
/* ps_ep_tsend with 8 bytes of remote CQ data for the receiver's completion. */
ncclResult_t ps_ep_tsenddata(ps_ep_t *ep, const void *buf, size_t len, void *desc, uint64_t data,
                             fi_addr_t dest, uint64_t tag, ps_op_t *op, int *posted);
ncclResult_t ps_ep_trecv(ps_ep_t *ep, void *buf, size_t len, void *desc, uint64_t tag,
                         ps_op_t *op, int *posted);
/* RMA write, read and atomic with the same retry contract, posted on `tx`:
 * ep->ep or one of its lanes. */
ncclResult_t ps_ep_writemsg(ps_ep_t *ep, struct fid_ep *tx, const struct fi_msg_rma *msg,
                            uint64_t flags, int *posted);
ncclResult_t ps_ep_readmsg(ps_ep_t *ep, const struct fi_msg_rma *msg, uint64_t flags, int *posted);
ncclResult_t ps_ep_atomicmsg(ps_ep_t *ep, struct fid_ep *tx, const struct fi_msg_atomic *msg,
                             uint64_t flags, int *posted);
/* A transmit lane: another endpoint of the same domain sharing ep's CQ and
 * AV (so its completions and fi_addr_t are ep's). FI_FENCE orders within one
 * endpoint, so a lane per peer scopes each fence to its own peer. It also
 * avoids a libfabric 1.17 sockets deadlock: a fenced op holds its peer's
 * connection while it waits for every earlier op of the endpoint, including
 * ones to other peers stuck behind fenced ops of their own. Close lanes
 * before ep. */
ncclResult_t ps_ep_open_lane(ps_ep_t *ep, struct fid_ep **lane);
/* A buffer a caller asks to register: an address where it has bytes, and
 * [buf, +len) inside the address space. ncclInvalidArgument, logged with
 * `fn`, otherwise. */
ncclResult_t ps_ep_check_buffer(const char *fn, const void *buf, size_t len);
/* Registers [buf, +len) with `access` (bound to `ep` under FI_MR_ENDPOINT). */
ncclResult_t ps_ep_reg(ps_ep_t *ep, void *buf, size_t len, uint64_t access, struct fid_mr **mr);
/* The same for memory of CUDA device `cuda_device` (FI_HMEM_CUDA; only on
 * devices whose provider registers it, ps_device_t.hmem), or host memory
 * where cuda_device < 0; by its dma-buf where `dmabuf` is not NULL (only
 * where ps_gpumem_dmabuf said the provider takes one). */
ncclResult_t ps_ep_reg_dev(ps_ep_t *e, void *buf, size_t len, uint64_t access, int cuda_device,
                           const ps_dmabuf_t *dmabuf, struct fid_mr **mr);
/* ps_ep_reg_dev without logging: 0 or the provider's negative fi errno. */
int ps_ep_try_reg(ps_ep_t *e, void *buf, size_t len, uint64_t access, int cuda_device,
                  const ps_dmabuf_t *dmabuf, struct fid_mr **mr);
/* The same on device d, bound to `ep` under FI_MR_ENDPOINT (NULL: not bound,
 * enough to learn whether the provider takes the memory at all). */
int ps_dev_try_reg(ps_device_t *d, struct fid_ep *ep, void *buf, size_t len, uint64_t access,
                   int cuda_device, const ps_dmabuf_t *dmabuf, struct fid_mr **mr);
/* Registers [buf, +len) for send/recv when the provider needs it (FI_MR_LOCAL
 * or FI_MR_ENDPOINT). *mr stays NULL otherwise. */
ncclResult_t ps_ep_reg_local(ps_ep_t *ep, void *buf, size_t len, struct fid_mr **mr);
/* 1 with *pid when the peer named `addr_str` (ps_ep_addr_str's form) is an
 * shm endpoint of ours whose process is gone. shm completes sends into a
 * dead process's memory, so no probe finds it; other providers report a
 * dead peer themselves (0 here). */
int ps_ep_peer_gone(const ps_ep_t *e, const char *addr_str, int *pid);
/* Human-readable form of an endpoint address (for logs). */
void ps_ep_addr_str(ps_ep_t *ep, const void *addr, char *out, size_t outlen);

#endif
