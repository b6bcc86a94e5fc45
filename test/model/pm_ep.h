/* The model fabric's endpoint, shared by its two halves: pm_ep.c (the
 * libfabric endpoint a caller posts to) and pm_nic.c (the NIC threads that
 * perform what was posted). Private to test/model. */
#ifndef PM_EP_H
#define PM_EP_H

#include "pm.h"

enum { OP_WRITE = 1, OP_READ, OP_TSEND, OP_ATOMIC };

/* A posted operation as the caller leaves it in the endpoint's submission
 * ring: one cache line with its sequence word, as a NIC's descriptor (the
 * caller writes it, the NIC reads it once). */
typedef struct {
  _Atomic uint64_t seq; /* the ring's turn (pm_ring.h) */
  void *ctx, *buf;
  uint64_t len;
  uint64_t a0;          /* RMA and atomics: the remote address; a send: the tag */
  uint64_t key, data;
  uint32_t dest;        /* an AV index (PM_AV_BLOCK * PM_AV_BLOCKS of them) */
  uint8_t type, fence, remote_cq;
} __attribute__((aligned(64))) pm_sqe_t;
_Static_assert(sizeof(pm_sqe_t) == 64, "a submission entry is one cache line");
#define PM_SQ 1024 /* entries an endpoint's submission ring holds: beyond, a post is -FI_EAGAIN */

/* An operation inside the NIC, from its submission to its completion: the
 * NIC threads' own (taken from and returned to its endpoint's pool by
 * them), never the caller's. */
typedef struct pm_op {
  struct pm_op *next;
  int type, err;     /* err: move_data failed: the completion's error, `why` its text */
  char written, fence, remote_cq;
  void *ctx, *buf;
  uint64_t cflags; /* the completion's flags */
  size_t len;
  uint64_t raddr, key, tag, data;
  fi_addr_t dest;
  uint64_t posted_ns, arrive_ns, done_ns;
  char *why;       /* allocated where an operation fails (rare), freed once reported */
} __attribute__((aligned(64))) pm_op_t;
_Static_assert(sizeof(pm_op_t) == 128, "a model operation is two cache lines");

typedef struct {
  pm_op_t *head, *tail;
  uint64_t free_ns, last_done_ns;
} pm_link_t;

typedef struct pm_recv {
  struct pm_recv *next;
  void *buf, *ctx;
  size_t len;
  uint64_t tag, ignore;
} pm_recv_t;

typedef struct pm_held { /* a message waiting: an ACK until its time, or one for a full inbox */
  struct pm_held *next;
  pm_msg_t m;
  pm_ep_seg_t *to; /* NULL: an ACK of ours to act on */
} pm_held_t;

/* What one NIC thread owns of an endpoint: the links i with i % n == its
 * number (so a link's operations stay in order, and copies to different
 * peers run in parallel), the submission ring the caller posts operations
 * for those links to (one per thread, as a NIC has a queue per engine: no
 * thread takes another's posts), and the operations it performed. Only
 * `lock` is shared, with thread 0, which hands ACKs to `acking`, and with a
 * thread growing the link array: the threads never wait for each other's
 * passes. */
typedef struct {
  /* Posted and not yet taken: the caller claims an entry and fills it (a
   * NIC's descriptor and doorbell), the thread takes entries in order on
   * its pass; the caller never touches the NIC's operations. */
  pm_sqe_t *sq;
  /* The posters' line: the next position, and how far the thread had taken
   * when a poster last looked (a poster reads sq_taken again only when
   * this says full, so a post reads no line the thread writes). */
  _Atomic uint64_t sq_head __attribute__((aligned(64)));
  _Atomic uint64_t sq_seen;
  uint64_t sq_tail __attribute__((aligned(64))); /* the thread's: next to take */
  _Atomic uint64_t sq_taken;                     /* sq_tail, published once a pass */
  pm_op_t *cache; /* operations taken back from the endpoint's pool */
  pthread_mutex_t lock;            /* the links' queues and `acking` */
  pm_op_t *waiting, *waiting_tail; /* performed RMA, in that order: until done_ns (the thread's own) */
  pm_op_t *acking;                 /* sent: until the target's ACK */
  /* operations on its links and in `waiting`: a thread with none skips the
   * endpoint without taking a lock */
  _Atomic int queued;
  unsigned rnd; /* the reordering NIC's dice */
} __attribute__((aligned(64))) pm_nic_share_t;

typedef struct pm_ep {
  struct fid_ep ep;
  struct pm_ep *next_all;
  pm_domain_t *d;
  pm_cq_t *cq;
  pm_av_t *av;
  char name[PM_NAME_LEN];
  pm_ep_seg_t *seg;
  pm_link_t *links; /* grown holding every share's lock */
  size_t nlinks;    /* atomic where read without a share's lock */
  int nshares;      /* NIC threads: a post to AV index d goes to share d % nshares */
  pm_nic_share_t share[PM_MAX_NIC_THREADS];
  /* thread 0's (the caller adds to recv_top by compare-and-swap): */
  pm_recv_t *recvs;               /* posted receives the NIC thread matches, in order */
  _Atomic(pm_recv_t *) recv_top;  /* posted since its last pass, newest first */
  pm_held_t *unexp, *held;
  unsigned rnd;
  /* Operations are reused, not freed: the NIC threads push finished ones
   * here (a compare-and-swap), and a thread taking new posts takes them
   * back in bulk into its share's `cache`: no allocator call per operation. */
  _Atomic(pm_op_t *) finished;
} pm_ep_t;

/* pm_nic.c: an enabled endpoint joins the NIC threads' passes (started as
 * PERSEUS_MODEL_NIC_THREADS says); a closing one leaves them (its memory is
 * freed only after no pass uses it). */
int pm_nic_add(pm_ep_t *e);
void pm_nic_remove(pm_ep_t *e);
/* A finished operation goes back to its endpoint's pool. */
void pm_op_release(pm_ep_t *e, pm_op_t *op);

#endif
