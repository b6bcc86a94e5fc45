/* Internals shared by ps_rma_comm.c (setup, registration) and ps_rma_ops.c
 * (data path, strategies). */
#ifndef PS_RMA_INT_H
#define PS_RMA_INT_H

#include <rdma/fi_rma.h>

#include "ps_ep.h"
#include "ps_gin_abi.h"
#include "ps_rma.h"

#define PS_RMA_MAGIC 0x524d4143u     /* "RMAC" */
#define PS_RMA_REQ_MAGIC 0x524d5251u /* "RMRQ" */
#define PS_RMA_REG_MAGIC 0x524d4752u /* "RMGR" */
#define PS_RMA_SEQ_RING 4096         /* puts in flight per peer before backpressure */
#define PS_RMA_SIG_SLOTS 64          /* signal receives kept posted */
#define PS_RMA_REQUESTS 8192

/* Tags of the engine's own messages (bit 63: control, as in ps_wire.h). */
#define PS_TAG_RMA_SIG (PS_TAG_CTRL | 0x20)
#define PS_TAG_RMA_REG(id) (PS_TAG_CTRL | 0x100000000ULL | (uint64_t)(id))

typedef struct ps_rma_comm ps_rma_comm_t;

typedef struct {
  uint32_t magic;
  uint32_t id; /* same on every rank: registrations are collective, in order */
  ps_rma_comm_t *comm;
  char *base;
  size_t size;
  struct fid_mr *mr;
  void *desc;
  uint64_t *raddr, *rkey, *rsize; /* per rank: target address (or 0), key, size */
} ps_rma_region_t;

typedef struct ps_rma_req {
  uint32_t magic;
  int put_pending, sig_pending, parked;
  ncclResult_t status;
  uint32_t peer;
  uint64_t need_done; /* the signal waits until every put with seq < need_done delivered */
  uint64_t put_seq;
  ps_op_t put_op, sig_op;
  ps_sig_msg_t sig;
  ps_rma_comm_t *comm;
  struct ps_rma_req *next; /* free list, or the peer's parked FIFO */
} ps_rma_req_t;

typedef struct {
  uint64_t next_seq;  /* sequence of the next put to this peer (from 1) */
  uint64_t done_below; /* every put with seq < done_below has been delivered */
  uint8_t *done;       /* completion flags for seq in [done_below, done_below + RING) */
  ps_rma_req_t *park_head, *park_tail;
  ps_rma_peer_stats_t st;
} ps_rma_peer_t;

typedef struct {
  ps_sig_msg_t msg;
  ps_op_t op;
  ps_rma_comm_t *comm;
} ps_rma_sig_slot_t;

struct ps_rma_comm {
  uint32_t magic;
  int rank, nranks;
  ps_ordering_t ordering;
  ps_ep_t ep;
  fi_addr_t *addr;
  ps_rma_peer_t *peers;
  ps_rma_region_t **regions;
  uint32_t nregions, cap_regions;
  ps_rma_req_t *reqs, *free_reqs;
  ps_rma_sig_slot_t sig_slots[PS_RMA_SIG_SLOTS];
#ifdef PS_REORDER_TEST
  struct ps_held_write *held; /* writes an "unordered NIC" has not sent yet */
  int nheld, cap_held;
  uint64_t rng;
#endif
  int sig_backlog; /* a ready signal was refused (-FI_EAGAIN): retry in progress */
  ncclResult_t error;
  char error_msg[256];
};

/* ps_rma_ops.c */
ncclResult_t ps_rma_post_sig_slots(ps_rma_comm_t *c);
void ps_rma_fail(ps_rma_comm_t *c, ncclResult_t rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
ps_rma_region_t *ps_rma_region(ps_rma_comm_t *c, void *mh);

#endif
