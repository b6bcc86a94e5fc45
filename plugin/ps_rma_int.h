/* Internals shared by the one-sided engine's files. The engine is built in
 * floors; each file calls only the floors below it (gin_abi.c, above them
 * all, calls the entry points in ps_rma.h):
 *   2 ps_rma_comm.c     setup: listen, connect, close, symmetric registration
 *                       (its blocking allgather progresses through floor 3),
 *                       staging's receive region, stats
 *     ps_rma_thread.c   the engine thread (PERSEUS_PROGRESS_THREAD): its
 *                       loop of passes and the inbox NCCL's calls fill
 *   3 ps_rma_ops.c      per-peer queues, pump, progress, test and the
 *                       put/get/put+signal/flush entry points
 *     ps_rma_req.c      requests, and the request and window handle tables
 *   4 ps_rma_order.c    the ordering strategies: which one, when a queued
 *                       signal may go, how it is posted, fence accounting
 *   5 ps_rma_target.c   target side: signal messages applied (or refused,
 *                       and the refusal sent back), write arrivals counted
 *   6 ps_rma_stage.c    staging for GPU windows: setup and the origin side
 *     ps_rma_stage_rx.c staging's target side
 *     ps_rma_stream.c   staging streams: extra endpoints, each with a thread
 *                       that posts staged writes and reads its completions
 *   7 ps_rma_post.c     the one place writes, reads, atomics and messages are
 *                       handed to the endpoint (or to a test plugin's model
 *                       NIC, ps_model_nic.h)
 *   8 ps_rma_peer.c     failing the comm, region lookup, per-peer accounting
 *     ps_rma_ident.c    who sent a peer's message or write, against the rank
 *                       it claims
 * Below the engine: ps_ep.c, ps_seqwin.c, ps_hist.c, ps_clock.c, ps_log.c. */
#ifndef PS_RMA_INT_H
#define PS_RMA_INT_H

#define PS_COLD __attribute__((cold)) /* off the hot path: stats, refusals */

#include <rdma/fi_atomic.h>
#include <rdma/fi_rma.h>

#include "ps_clock.h"
#include "ps_cuda.h"
#include "ps_ep.h"
#include "ps_gin_abi.h"
#include "ps_handle.h"
#include "ps_hist.h"
#include "ps_lock.h"
#include "ps_model_nic.h"
#include "ps_rma.h"
#include "ps_seqwin.h"

#define PS_RMA_SIG_SLOTS 64          /* signal receives kept posted */
#define PS_RMA_NACK_SLOTS 4          /* receives kept posted for peers' refusals (and notices) */
#define PS_RMA_REQ_CHUNK 1024        /* requests are allocated (and registered) this many at a time */
#define PS_RMA_MAX_REQS (1u << 20)   /* at least this many outstanding per comm are allowed (ps_rma_req.c) */
#define PS_RMA_MAX_WINDOW (1u << 22) /* a peer's writes can be this far ahead of its oldest missing one */

/* Tags of the engine's own messages (bit 63: control, as in ps_wire.h). */
#define PS_TAG_RMA_SIG (PS_TAG_CTRL | 0x20)
/* A target's refusal of one of our signals or staged puts: a signal message
 * (ps_sig_msg_t) sent back, src_rank naming the target, `covers` why
 * (PS_NACK_*, ps_wire.h). */
#define PS_TAG_RMA_NACK (PS_TAG_CTRL | 0x21)
#define PS_TAG_RMA_STREAMS (PS_TAG_CTRL | 0x22) /* ps_streams_msg_t, once per comm */
/* An empty message no one receives: sent to a peer a closing comm still
 * waits for, so that a peer that is gone shows as a send error at once
 * instead of after PERSEUS_PEER_TIMEOUT_MS. */
#define PS_TAG_RMA_PROBE (PS_TAG_CTRL | 0x23)
#define PS_TAG_RMA_REG(id) (PS_TAG_CTRL | 0x100000000ULL | (uint64_t)(id))

#define PS_CACHE_LINE 64

typedef struct ps_rma_comm ps_rma_comm_t;
typedef struct ps_rma_streams ps_rma_streams_t;

/* A write handed to a staging stream: `wire` is what its endpoint completes
 * (on the stream's thread), `target` the engine's operation whose callback
 * the engine then runs. */
typedef struct {
  ps_op_t wire; /* first */
  ps_op_t *target;
  void *stream;
} ps_rma_sop_t;

/* What NCCL holds of a window, a request or a listenComm is a handle of
 * these tables (ps_handle.h), never a pointer: a stale (deregistered,
 * reported done, closed) or foreign one is refused without touching the
 * memory it once named, however that memory was reused since. */
extern ps_htab_t ps_rma_win_tab, ps_rma_req_tab;

typedef struct {
  uint32_t id; /* same on every rank: registrations are collective, in order */
  uint32_t slot; /* in ps_rma_win_tab */
  void *handle;  /* what regMrSym handed out */
  ps_rma_comm_t *comm;
  char *base;
  size_t size;
  struct fid_mr *mr;
  void *desc;
  uint64_t *raddr, *rkey, *rsize; /* per rank: target address (or 0), key, size */
  int staged; /* GPU memory the provider cannot reach: staged (same on every rank) */
  int gpu;    /* GPU memory (staged, or registered with the provider): signals into it
               * go through the copy stream (ps_stage_signal) */
  /* per rank: it deregistered its part and told us (PS_SIG_OP_CLOSED); calls
   * into that part are refused. Set by the engine, read by NCCL's calls. */
  uint8_t *rclosed;
  /* Operations naming it (either side, or its signal) and not yet let go
   * (ps_rma_local_done): busy_named - busy_freed. NCCL's calls count the
   * first, the engine the second, a cache line apart, so that neither
   * thread's count takes the other's line (or the fields above) away. */
  uint32_t busy_named;
  char apart[64];
  uint32_t busy_freed;
} ps_rma_region_t;

static inline uint32_t ps_rma_region_busy(const ps_rma_region_t *g) {
  return __atomic_load_n(&g->busy_named, __ATOMIC_RELAXED) -
         __atomic_load_n(&g->busy_freed, __ATOMIC_RELAXED);
}

enum { PS_STAGE_NONE = 0, PS_STAGE_QUEUED, PS_STAGE_POSTED, PS_STAGE_DONE };

/* A request's two owners: NCCL until test() reported it, the engine until
 * its data and signal completed (settled). A staged put is reported once its
 * bytes left the source, which may be long before its write completes. */
enum { PS_REQ_REPORTED = 1, PS_REQ_SETTLED = 2 };

/* PERSEUS_STATS: when a request reached each step (ps_now_ns), 0 where it
 * did not. Stats off: never written, cleared or read. */
typedef struct {
  uint64_t call;       /* NCCL called iput/iget/iputSignal */
  uint64_t copy_start; /* staged, GPU source: its first chunk's copy out of the GPU issued */
  uint64_t copy_done;  /* ... its last chunk's copy seen finished (the copies run in order) */
  uint64_t posted;     /* its data (first chunk) taken: the provider's post call returned */
  uint64_t data_done;  /* its data (last chunk) completed */
  uint64_t sig_posted, sig_done;
  uint64_t local_done; /* test() may report it (ps_rma_local_done) */
} ps_rma_stamps_t;

typedef struct ps_rma_req {
  uint32_t slot; /* in ps_rma_req_tab: kept across reuse, like chunk_desc */
  uint8_t is_get;
  uint8_t data_stage, sig_stage; /* PS_STAGE_*: the put/get, and the signal */
  uint32_t peer;
  uint64_t seq;  /* of its put's first chunk, from 1 per peer (0: no put) */
  uint64_t need; /* its signal covers every put to the peer with seq < need */
  /* the data operation, kept until posted */
  struct iovec iov;
  struct fi_rma_iov rma;
  void *desc;
  /* the signal: a message (ps_sig_msg_t) or, for fence, an atomic add */
  ps_sig_msg_t sig;
  uint64_t operand;     /* atomic add operand */
  struct fi_rma_ioc sig_rma;
  void *chunk_desc;     /* local registration of this request's memory, or NULL */
  /* staging: a put with GPU memory on either side moves in chunks through
   * send slots; chunk i has put sequence seq + i */
  uint8_t staged, src_gpu, dst_staged;
  uint8_t sig_rides;        /* its signal goes as a record in its last chunk's staged write */
  uint32_t nchunks, prepared, posted_chunks, done_chunks;
  uint32_t copied;          /* staged: records whose bytes left the source (their slot's copies done) */
  const char *src;          /* source bytes (device or host address) */
  uint32_t dst_region;      /* destination window id, and offset in it */
  uint64_t dst_off;
  uint64_t tested_pass;     /* the progress pass in which test() last saw it not done */
  uint64_t tested_calls;    /* and NCCL's progress calls by then (c->progress_calls) */
  uint32_t uses[3];         /* ids of the windows it counts in (busy) until it completes */
  uint8_t nuses, settled;
  uint8_t early;            /* locally complete before it settled (counted in early_open) */
  uint8_t has_data, has_sig; /* what the engine queues when it takes the request */
  struct ps_rma_req *next_in; /* the inbox */
  ps_op_t data_op, sig_op;
  ps_rma_comm_t *comm;
  void *handle;                 /* what NCCL tests: bound while the request is live */
  struct ps_rma_req *next;      /* free list / the peer's data queue */
  struct ps_rma_req *next_sig;  /* the peer's signal queue */
  /* What NCCL's test() polls, a cache line of its own: the engine writes it
   * once or twice, so polling does not miss on each of its other writes. */
  _Alignas(PS_CACHE_LINE) int done; /* atomic: locally complete, test() may report it (ps_rma_local_done) */
  ncclResult_t status;
  int life;                 /* atomic: PS_REQ_REPORTED | PS_REQ_SETTLED; back to the pool at both */
  int taken;                /* atomic: the engine queued it (drain waits for that) */
  _Alignas(PS_CACHE_LINE) ps_rma_stamps_t ts; /* last: set (and cleared) only when PERSEUS_STATS is on */
} ps_rma_req_t;

typedef struct ps_rma_req_chunk {
  struct ps_rma_req_chunk *next;
  struct fid_mr *mr;
  uint32_t first_slot; /* its requests' slots in ps_rma_req_tab, one block */
  ps_rma_req_t reqs[PS_RMA_REQ_CHUNK];
} ps_rma_req_chunk_t;

#include "ps_rma_stage_types.h"
#include "ps_rma_ident.h"

/* PERSEUS_STATS, per peer: where its operations' time went (from the
 * stamps: the engine's steps once it let go of each, NCCL's when test()
 * reported it) and why posting to it stopped. */
enum {
  PS_IV_QUEUED,  /* call -> its data handed over (the provider's post call returned) */
  PS_IV_COPY,    /* staged, GPU source: first chunk's copy issued -> last chunk's seen done */
  PS_IV_POST,    /* per post call (data, chunk or signal, taken or refused): inside the provider */
  PS_IV_WIRE,    /* data handed over -> its (last chunk's) completion */
  PS_IV_SIGWAIT, /* call -> its signal handed over */
  PS_IV_LAG,     /* locally complete (staged: copied out; else its last completion) -> reported */
  PS_IV_TOTAL,   /* call -> test() reported it done */
  PS_IV_SETTLED, /* call -> its data and signal completed (a staged put's write may outlive its report) */
  PS_IV_N
};
/* Why a pass over the peer's queues stopped with something still queued.
 * Counted twice: every pass that stopped (grows with how often progress
 * polls), and stops: runs of such passes for one reason with nothing posted
 * to the peer in between. */
enum {
  PS_HELD_PROVIDER, /* the provider refused (-FI_EAGAIN after its retries) */
  PS_HELD_INFLIGHT, /* PERSEUS_RMA_INFLIGHT operations posted */
  PS_HELD_SLOT,     /* staged: the next chunk has no send slot, none is free */
  PS_HELD_UNFILLED, /* staged: ... a slot is free, the next fill pass takes it */
  PS_HELD_COPY,     /* staged: the chunk's copy out of the GPU is not finished */
  PS_HELD_CREDIT,   /* staged: the peer has not freed the receive slot it needs */
  PS_HELD_N
};
typedef struct {
  ps_hist_t iv[PS_IV_N];  /* ns */
  uint64_t held[PS_HELD_N], held_passes[PS_HELD_N];
  int stuck;              /* 1 + the reason the last pass stopped for; 0 after a post */
  ps_hist_small_t depth;  /* operations posted and not completed, at each post */
} ps_rma_opstats_t;

/* PERSEUS_STATS: NCCL's calls as the engine sees them while work is
 * outstanding (busy: a request handed out and not yet reported done), to
 * tell a slow engine from a caller that hands it work slowly: the time each
 * kind of call spent inside perseus, the spacing of data calls, and whether
 * progress calls brought new work. Idle polling (setup, between kernels) is
 * left out. */
enum { PS_CALL_DATA, PS_CALL_TEST, PS_CALL_PROGRESS, PS_CALL_N };
/* A progress pass's steps, timed: the completion queue, the target's side
 * (staged writes in, refusals out), posting what is queued, the copies and
 * marks handed to the driver. */
enum { PS_PASS_CQ, PS_PASS_TARGET, PS_PASS_POST, PS_PASS_COPIES, PS_PASS_N };
typedef struct {
  uint64_t n[PS_CALL_N], ns[PS_CALL_N]; /* calls while busy, and their time inside */
  uint64_t busy_ns, last_ns;            /* busy wall time; the last call's begin or end */
  uint64_t last_data_ns;                /* the last data call's begin, while busy */
  uint64_t progress_new;                /* progress calls with a data call since the previous */
  int data_since_progress, was_busy;
  int depth;                            /* entries nested (drain progresses inside a call) */
  ps_hist_t data_gap;                   /* begin to begin of successive data calls, while busy */
  uint64_t passes, pass_ns[PS_PASS_N];  /* passes that began while busy, and their steps */
} ps_rma_callstats_t;

/* Signals that arrived before what they cover (ps_rma_held.c): a min-heap
 * on the writes (staged: the staged writes) they wait for, and a queue of
 * those whose GPU word could not be tracked yet. */
typedef struct {
  ps_sig_msg_t *v;
  uint32_t n, cap;
  int staged; /* keyed by covers_staged, else by covers */
} ps_rma_held_heap_t;
typedef struct {
  ps_sig_msg_t *v;
  uint32_t head, n, cap;
} ps_rma_held_fifo_t;

typedef struct {
  /* origin side: operations to this peer */
  uint64_t next_seq;     /* sequence of the next put (from 1) */
  uint64_t posted_below; /* every put with seq < posted_below has been posted */
  ps_seqwin_t done;      /* puts completed: every seq < done.below */
  ps_rma_req_t *dq_head, *dq_tail; /* puts/gets not posted yet, in call order */
  ps_rma_req_t *sq_head, *sq_tail; /* signals not posted yet, in call order */
  uint64_t outstanding;  /* posted operations not completed yet */
  uint64_t active_ns;    /* last completion (or start of activity) while outstanding > 0 */
  ps_rma_peer_stats_t st;
  ps_rma_opstats_t *ops;  /* PERSEUS_STATS, else NULL */
  /* target side: what this peer sent us. Its writes carry their sequence
   * number (remote CQ data) and arrive in any order on an unordered NIC. */
  ps_seqwin_t arrived;    /* its writes that arrived: every seq < arrived.below */
  ps_rma_held_heap_t held_writes;    /* waiting for writes (target) */
  ps_rma_held_heap_t held_in;        /* for staged writes enqueued into the GPU (a GPU word) */
  ps_rma_held_heap_t held_done;      /* for staged writes copied (any other word) */
  ps_rma_held_fifo_t held_ready;     /* covered; their GPU word had no tracking room */
  uint32_t nheld;                    /* in all four */
  /* staging, origin side: staged writes to this peer, numbered from 1 */
  uint64_t stage_sent;    /* every staged write below this was posted (the next one's sequence) */
  uint64_t stage_chunks;  /* chunks those writes carried (PERSEUS_STATS) */
  uint64_t stage_sigs;    /* signals that rode in them */
  uint64_t atomic_sigs;   /* signals posted as atomic adds (the NIC applies them) */
  uint64_t stage_freed;   /* the peer consumed every one below this (its credit) */
  ps_stage_slot_t *prep_head, *prep_tail; /* slots filled for queued chunks, in order */
  struct ps_rma_req *prep_req;            /* next request with chunks to prepare */
  /* staging, target side: its staged writes */
  ps_seqwin_t stage_in;   /* whose copy into the GPU is enqueued */
  ps_seqwin_t stage_done; /* whose copy finished: the slot is free */
  uint64_t credit_sent;   /* stage_done.below we last reported */
  int credit_busy;
  ps_op_t probe_op;       /* closing: PS_TAG_RMA_PROBE in flight while probing */
  int probing;
  uint64_t probe_refused_ns; /* closing: since when the provider refuses probes to it, or 0 */
} ps_rma_peer_t;

/* Operations of ours to p queued or posted and not completed (a chunk in a
 * prepared slot belongs to a request still queued): what liveness, the
 * engine thread's naps and a closing comm's probes look at. */
static inline int ps_rma_peer_busy(const ps_rma_peer_t *p) {
  return p->outstanding || p->dq_head || p->sq_head;
}

typedef struct {
  ps_sig_msg_t msg;
  ps_op_t op;
  ps_rma_comm_t *comm;
} ps_rma_sig_slot_t;

/* Our refusal of a peer's signal or staged put, on its way back to it (one
 * at a time per peer: the first one already fails the peer's comm). */
enum { PS_NACK_IDLE = 0, PS_NACK_QUEUED, PS_NACK_SENT };
typedef struct {
  ps_sig_msg_t msg; /* registered (nacks_mr) */
  ps_op_t op;
  int state;
} ps_rma_nack_t;

/* Our notices to a peer that we deregistered windows (PS_SIG_OP_CLOSED, on
 * the refusal tag): one on its way at a time, the rest queued by window id. */
typedef struct {
  ps_sig_msg_t msg; /* registered (notes_mr) */
  ps_op_t op;
  int busy;
  int gone; /* a notice could not be delivered: the peer closed; nothing more goes */
  uint32_t *queue, nq, cap;
} ps_rma_notice_t;

/* Laid out in sections a cache line apart (the comm is allocated aligned):
 * with an engine thread, NCCL's calls and the engine's passes each write
 * their own section, so that neither thread's writes take away the lines
 * the other reads on every call. */
struct ps_rma_comm {
  /* -- set at connect (or registration, under win_lock), read by every call -- */
  _Alignas(PS_CACHE_LINE) int threaded; /* PERSEUS_PROGRESS_THREAD: an engine thread runs the
   * progress passes and takes NCCL's operations from an inbox, so that NCCL's
   * proxy thread only checks arguments and queues (ps_rma_thread.c). Then NCCL's
   * data and test() calls take no `lock`: windows are read under `win_lock`,
   * requests come from the free list under `reqs_lock`. */
  int stop;                  /* atomic: the engine thread ends */
  ncclResult_t error;        /* atomic: the comm failed (ps_rma_fail) */
  int rank, nranks;
  ps_ordering_t ordering;
  int sig_atomic; /* signals go as atomic adds (ps_order_sig_atomic; ordered: until staging) */
  int gpu_direct; /* GPU windows registered with the provider (FI_HMEM), not staged */
  const char *staged_why; /* why they are staged, where they are */
  ps_rma_region_t **regions;
  uint32_t nregions, cap_regions;
  ps_stage_t *stage;    /* NULL until a GPU window is staged */
  size_t stage_chunk;   /* stage->chunk, for NCCL's calls */
  ps_rma_opstats_t *opstats; /* PERSEUS_STATS (read at connect): per peer; NULL when off */
  ps_rma_callstats_t *calls; /* PERSEUS_STATS: NCCL's calls; NULL when off */
  uint64_t pass_interval_ns; /* PERSEUS_PROGRESS_INTERVAL_US */
  uint64_t timeout_ns;  /* PERSEUS_PEER_TIMEOUT_MS */
  uint64_t max_posted;  /* per peer, posted and not completed (PERSEUS_RMA_INFLIGHT); 0 = no bound */
  pthread_t thread;

  /* -- written by NCCL's calls -- */
  _Alignas(PS_CACHE_LINE) pthread_rwlock_t win_lock; /* written by regMrSym/deregMrSym, read by NCCL's data calls */
  pthread_mutex_t reqs_lock; /* free_reqs, chunks, nreqs */
  ps_rma_req_t *free_reqs;
  ps_rma_req_chunk_t *chunks;
  uint32_t nreqs;
  uint64_t live_reqs; /* atomic: requests handed out and not yet reported done */
  uint64_t progress_calls; /* atomic: NCCL's progress entries, passes or not */

  /* -- where both meet: NCCL pushes, the engine takes -- */
  /* atomic: operations the engine has not taken, newest first. NCCL's call
   * pushes with a compare-and-swap; the engine takes the whole list. */
  _Alignas(PS_CACHE_LINE) ps_rma_req_t *inbox_top;
  int lock_waiters;          /* atomic: callers waiting for `lock`; the thread yields to them */
  /* atomic: requests the engine let go of after test() reported them,
   * newest first; NCCL's thread takes the whole list when its own is empty */
  _Alignas(PS_CACHE_LINE) ps_rma_req_t *returned;

  /* -- the engine's: its passes write these -- */
  _Alignas(PS_CACHE_LINE) ps_lock_t lock; /* recursive; taken by every entry point (the engine thread's, if any) */
  int backlog;          /* something is queued: progress must try to post it */
  int nack_pending;     /* a refusal is queued: progress sends it */
  int note_pending;     /* a notice is queued: progress sends it */
  uint64_t now_ns;      /* clock of the current progress pass */
  uint64_t passes;      /* progress passes run (from 1) */
  uint64_t own_waits;   /* passes of the engine's own waits (drain, registration) */
  uint64_t early_open;  /* requests locally complete whose writes or signals are still to complete */
  uint64_t last_pass_ns;
  uint64_t next_check_ns;
  ps_ep_t ep;
  struct fid_ep **lanes; /* fence: one transmit endpoint per peer (see ps_ep_open_lane) */
  fi_addr_t *addr;
  ps_rma_peer_t *peers;
  /* signal receives, then PS_RMA_NACK_SLOTS receives of refusals */
  ps_rma_sig_slot_t sig_slots[PS_RMA_SIG_SLOTS + PS_RMA_NACK_SLOTS];
  struct fid_mr *sig_slots_mr;
  void *sig_slots_desc;
  ps_rma_nack_t *nacks; /* per peer */
  struct fid_mr *nacks_mr;
  void *nacks_desc;
  ps_rma_notice_t *notes; /* per peer */
  struct fid_mr *notes_mr;
  void *notes_desc;
  ps_rma_streams_t *streams; /* staged writes' extra endpoints; NULL: the comm's endpoint */
  ps_model_t *model;     /* a test plugin's model NIC; NULL in the shipped plugin */
  char error_msg[384];
};

/* The peer has as many operations posted as PERSEUS_RMA_INFLIGHT allows:
 * the rest wait in its queues for a completion. */
static inline int ps_rma_peer_full(const ps_rma_comm_t *c, const ps_rma_peer_t *p) {
  return c->max_posted && p->outstanding >= c->max_posted;
}

/* The engine's comm comes from gin_abi.c, which looked the caller's handle
 * up in its table: it is live, so only NULL is checked here. */
static inline ps_rma_comm_t *ps_rma_live(void *coll) { return coll; }

/* The window handle mh names, when it is a live one of comm c; NULL
 * otherwise, without a message (ps_rma_window_refused says why). The data
 * path's cost: the table lookup and one compare. */
static inline ps_rma_region_t *ps_rma_window(ps_rma_comm_t *c, void *mh) {
  ps_rma_region_t *r = ps_htab_get(&ps_rma_win_tab, mh);
  return r && r->comm == c ? r : NULL;
}

/* Entry points take the comm's lock: NCCL's progress thread (test,
 * ginProgress, puts) and the user's thread (window registration) may call at
 * the same time. Recursive, since drain and registration progress inside. */
#define PS_RMA_LOCKED(coll, call) PS_RMA_LOCKED_CALL(coll, PS_CALL_N, call)
/* The same for NCCL's calls that PERSEUS_STATS times (kind: PS_CALL_*),
 * which take no lock when an engine thread runs the passes. */
#define PS_RMA_LOCKED_CALL(coll, kind, call)                                       \
  do {                                                                             \
    ps_rma_comm_t *c_ = ps_rma_live(coll);                                         \
    if (!c_) {                                                                     \
      PS_WARN("one-sided call on a NULL engine comm");                             \
      return ncclInvalidArgument;                                                  \
    }                                                                              \
    int locked_ = (kind) == PS_CALL_N || !c_->threaded;                            \
    if (locked_) ps_rma_lock(c_);                                                  \
    uint64_t t0_ = (kind) < PS_CALL_N && c_->calls ? ps_rma_call_begins(c_) : 0; \
    ncclResult_t rc_ = (call);                                                     \
    if (t0_) ps_rma_call_ends(c_, (kind), t0_);                                    \
    if (locked_) ps_lock_give(&c_->lock);                                          \
    return rc_;                                                                    \
  } while (0)

/* NCCL's data calls read the windows under win_lock where an engine thread
 * runs; without one they hold c->lock, which registration holds too. The
 * same for the request pool's reqs_lock. */
static inline void ps_rma_lock_if_threaded(const ps_rma_comm_t *c, pthread_mutex_t *m) {
  if (c->threaded) pthread_mutex_lock(m);
}
static inline void ps_rma_unlock_if_threaded(const ps_rma_comm_t *c, pthread_mutex_t *m) {
  if (c->threaded) pthread_mutex_unlock(m);
}
static inline void ps_rma_windows_read(ps_rma_comm_t *c) {
  if (c->threaded) pthread_rwlock_rdlock(&c->win_lock);
}
static inline void ps_rma_windows_done(ps_rma_comm_t *c) {
  if (c->threaded) pthread_rwlock_unlock(&c->win_lock);
}

/* Takes c->lock, ahead of the engine thread's next pass. */
static inline void ps_rma_lock(ps_rma_comm_t *c) {
  if (!c->threaded) { /* no engine thread to hold it off */
    ps_lock_take(&c->lock);
    return;
  }
  __atomic_add_fetch(&c->lock_waiters, 1, __ATOMIC_ACQ_REL);
  ps_lock_take(&c->lock);
  __atomic_sub_fetch(&c->lock_waiters, 1, __ATOMIC_ACQ_REL);
}

/* The comm's error, read from any thread. */
static inline ncclResult_t ps_rma_error(const ps_rma_comm_t *c) {
  return __atomic_load_n(&c->error, __ATOMIC_ACQUIRE);
}

/* --- floor 2, ps_rma_thread.c: PERSEUS_PROGRESS_THREAD --- */
/* Starts c's engine thread and sets c->threaded (connect's last step,
 * where PERSEUS_PROGRESS_THREAD asks for one). */
ncclResult_t ps_rma_thread_start(ps_rma_comm_t *c);
/* Ends it (before the comm closes); a no-op without one. */
void ps_rma_thread_stop(ps_rma_comm_t *c);
/* NCCL's thread: r goes to the engine thread's inbox. */
void ps_rma_inbox_push(ps_rma_comm_t *c, ps_rma_req_t *r);

/* --- floor 3, ps_rma_req.c: requests and the handle tables --- */
void ps_rma_free_reqs(ps_rma_comm_t *c);
/* A request to rank `peer`, its handle bound (NCCL's thread). */
ncclResult_t ps_rma_req_get(ps_rma_comm_t *c, uint32_t peer, ps_rma_req_t **out);
/* A refused call's r goes back to the free list; its handle goes stale. */
void ps_rma_req_put(ps_rma_comm_t *c, ps_rma_req_t *r);
/* test() reported r done: its handle goes stale, and r goes back once the
 * engine settled it too. */
void ps_rma_req_reported(ps_rma_comm_t *c, ps_rma_req_t *r);
/* Logs why test() refused `request`, never reading what a stale one named. */
void ps_rma_req_refused(ps_rma_comm_t *c, const void *request) PS_COLD;

/* --- floor 3, ps_rma_ops.c --- */
/* One progress pass, under c->lock: completions, the target's side, posting
 * what waits, the copies handed to the driver. Returns the completions it
 * read. The engine's own waits (registration, drain) make passes with it:
 * with an engine thread, NCCL's progress call makes none. */
int ps_rma_progress_pass(ps_rma_comm_t *c);
/* Blocking allgather of region r's {address, size, key} among the comm's
 * ranks (ps_rma_reg.c); fails the comm when a rank sends no part in time. */
ncclResult_t ps_rma_allgather_region(ps_rma_comm_t *c, ps_rma_region_t *r);
/* The engine thread, under c->lock: takes the requests of its inbox into
 * the queues, in call order, then makes a progress pass. Returns whether
 * anything was taken or completed. */
int ps_rma_engine_pass(ps_rma_comm_t *c);
/* Logs why mh is not a window of c that `call` can use as its `role`. */
void ps_rma_window_refused(ps_rma_comm_t *c, const char *call, const char *role, void *mh);

/* --- floor 4, ps_rma_order.c: the strategies --- */
ncclResult_t ps_order_choose(const ps_device_t *d, ps_ordering_t *out);
/* 1 when r's signal may be posted now (every put it covers posted, and
 * delivered where the strategy waits for that). */
int ps_order_sig_ready(const ps_rma_comm_t *c, const ps_rma_peer_t *p, const ps_rma_req_t *r);
/* Posts r's signal: a message, or for fence an atomic add. */
ncclResult_t ps_order_post_sig(ps_rma_comm_t *c, ps_rma_req_t *r, int *posted);
/* 1 when a signal may go as a record of a staged write. */
int ps_order_sig_may_ride(const ps_rma_comm_t *c);
/* 1 when a staged write with a riding signal must go on the comm's endpoint. */
int ps_order_rider_on_comm_ep(const ps_rma_comm_t *c);
/* Whether strategy s on d posts signals as atomic adds the NIC applies. */
int ps_order_sig_atomic(const ps_device_t *d, ps_ordering_t s);
/* Counts a queued signal's fence or the one it avoided; 1 when the caller
 * must block until the puts it covers are delivered (drain). */
int ps_order_count_fence(ps_rma_comm_t *c, ps_rma_peer_t *p, uint64_t need);

/* --- floor 5, ps_rma_target.c: the target side --- */
/* The signal receives and the refusal path (both directions). */
ncclResult_t ps_rma_post_sig_slots(ps_rma_comm_t *c);
/* Sends the refusals queued since the last pass (c->nack_pending). */
void ps_rma_send_nacks(ps_rma_comm_t *c);
/* Tells every peer we deregistered window `id` (so that their calls into
 * our part are refused, not dropped), and sends the notices queued
 * (c->note_pending). */
void ps_rma_notice_closed(ps_rma_comm_t *c, uint32_t id);
void ps_rma_send_notices(ps_rma_comm_t *c);
/* Staging's part of a progress pass, and the signals and credits it frees. */
void ps_rma_target_progress(ps_rma_comm_t *c);
int ps_rma_apply_signal(ps_rma_comm_t *c, const ps_sig_msg_t *m);
/* ps_rma_held.c: signals held until what they cover is there */
void ps_rma_held_init(ps_rma_peer_t *p);
void ps_rma_held_take(ps_rma_comm_t *c, ps_rma_peer_t *p, const ps_sig_msg_t *m);
void ps_rma_held_release(ps_rma_comm_t *c, ps_rma_peer_t *p);
void ps_rma_held_free(ps_rma_peer_t *p);

/* --- floor 6, ps_rma_stage.c: staging setup and the origin side --- */
/* What a window's registration allows (ps_rma_comm.c, and the FI_HMEM probe). */
#define PS_RMA_WINDOW_ACCESS \
  (FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV)

/* Sets up c->stage for GPU memory like gpu_ptr: checks, pools allocated.
 * Where c->gpu_direct, first registers [gpu_ptr, +size) with the provider
 * (by `dmabuf` where not NULL): that registration goes to *direct_mr, or,
 * where the provider cannot, c->gpu_direct is cleared (auto) or it fails
 * (never). */
ncclResult_t ps_stage_init(ps_rma_comm_t *c, const void *gpu_ptr, size_t size,
                           const ps_dmabuf_t *dmabuf, struct fid_mr **direct_mr);
/* Takes rx, the receive pools registered as a symmetric region, checking
 * they are the same size on every rank; when not, the caller deregisters rx
 * and then frees the staging. */
ncclResult_t ps_stage_attach_rx(ps_rma_comm_t *c, ps_rma_region_t *rx);
void ps_stage_free(ps_rma_comm_t *c);
void ps_stage_prepare(ps_rma_comm_t *c, ps_rma_peer_t *p);
/* 1 when a record queued to p now could still join a staged write. */
int ps_stage_open_to(const ps_rma_comm_t *c, const ps_rma_peer_t *p);
void ps_stage_fill(ps_rma_comm_t *c);
void ps_stage_dump(ps_rma_comm_t *c); /* INFO: where staging stands, for a stall report */
/* End of a pass: what the pass enqueued goes to the GPU, with the marks
 * its tickets name (fails the comm when the driver refuses). */
void ps_stage_flush(ps_rma_comm_t *c);
/* Posts what it can of r's chunks; *all = 1 once every chunk is posted. */
ncclResult_t ps_stage_post(ps_rma_comm_t *c, ps_rma_peer_t *p, ps_rma_req_t *r, int *all,
                           int *refused);
void ps_stage_credit(ps_rma_comm_t *c, uint32_t src, uint64_t freed_below);

/* --- floor 6, ps_rma_stage_rx.c: staging's target side --- */
/* A staged write landed in our receive slot: every record checked and each
 * chunk's copy into the GPU enqueued. Its chunks' put sequences go to seqs[]
 * (*nseq), its signals to sigs[] (*nsig), PS_STAGE_MAX_RECS at most in all,
 * for the caller to apply once covered. Chunks into a window we deregistered
 * are dropped, their slot freed all the same: *ndropped of them, the first
 * in *dropped, for the caller to tell the origin. 0 when refused (the comm
 * failed). */
int ps_stage_arrived(ps_rma_comm_t *c, uint32_t src, uint32_t slot, uint64_t *seqs, uint32_t *nseq,
                     ps_sig_msg_t *sigs, uint32_t *nsig, ps_stage_hdr_t *dropped,
                     uint32_t *ndropped);
/* 0: applied (or queued behind the copies); 1: no room now, try later */
int ps_stage_signal(ps_rma_comm_t *c, char *addr, uint64_t add);
/* Polls copies and signal words: 1 when arrivals, copies or words moved
 * since the last pass (held signals may apply, credits may go). */
int ps_stage_progress(ps_rma_comm_t *c);
void ps_stage_send_credits(ps_rma_comm_t *c);
/* wait (PS_STAGE_QUIESCE_NS at most) until no copy or signal write is in flight: 0, else -1 */
#define PS_STAGE_QUIESCE_NS (10ULL * 1000000000ULL)
int ps_stage_quiesce(ps_rma_comm_t *c);

/* --- floor 6, ps_rma_stream.c: staging streams (PERSEUS_NSTREAMS) --- */
/* Collective, where staging is set up: opens PERSEUS_NSTREAMS - 1 extra
 * endpoints (none on a provider that cannot stripe; a test plugin's model
 * NIC holds plain writes only, staged ones pass it on a stream), swaps their addresses with every rank, keeps as many
 * as every rank has and starts their threads. Staged writes then go over
 * them (target and ordering as ps_rma_stream.c says). */
ncclResult_t ps_rma_streams_open(ps_rma_comm_t *c);
/* Stops the threads and closes the endpoints (their writes die with them). */
void ps_rma_streams_close(ps_rma_comm_t *c);
/* A staged write on the next stream: *posted = 0 when every stream's queue
 * is full (the caller retries in a later pass). */
void ps_rma_stream_post(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_rma *m,
                        uint64_t flags, ps_rma_sop_t *sop, int *posted);
/* The engine's part of a pass: the completions and arrivals the streams'
 * threads read since the last one, handled here (callbacks, remote writes).
 * Returns how many; fails the comm when a stream failed. */
int ps_rma_streams_poll(ps_rma_comm_t *c);
/* ps_rma_reg.c: every rank's streams message (all[rank]), ours included. */
ncclResult_t ps_rma_allgather_streams(ps_rma_comm_t *c, const ps_streams_msg_t *mine,
                                      ps_streams_msg_t *all);

/* --- floor 7, ps_rma_post.c: everything that reaches the provider's data path --- */
/* A test plugin's model NIC for this comm (a bad test variable fails
 * connect); in progress, what it held that may go now. */
ncclResult_t ps_rma_model_open(ps_rma_comm_t *c);
void ps_rma_model_close(ps_rma_comm_t *c);
void ps_rma_release_held(ps_rma_comm_t *c);
/* A put's write (or a chunk of it into a host window) with put sequence seq,
 * flagged as the strategy needs: delivery completion (deferred, drain), or
 * rank << 32 | seq32 as remote CQ data (target). */
ncclResult_t ps_rma_post_put(ps_rma_comm_t *c, uint32_t peer, struct fi_msg_rma *m, uint64_t seq,
                             int *posted);
/* A staged write into the peer's receive slot, which its remote CQ data
 * names: on a staging stream where the comm has them (sop carries it), but
 * for one with a signal riding under ordered (has_sig). */
ncclResult_t ps_rma_post_staged(ps_rma_comm_t *c, uint32_t peer, struct fi_msg_rma *m, uint32_t slot,
                                ps_rma_sop_t *sop, int has_sig, int *posted);
ncclResult_t ps_rma_post_read(ps_rma_comm_t *c, const struct fi_msg_rma *m, int *posted);
ncclResult_t ps_rma_post_atomic(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_atomic *m,
                                uint64_t flags, int *posted);
ncclResult_t ps_rma_post_sig_send(ps_rma_comm_t *c, uint32_t peer, void *buf, size_t len,
                                  void *desc, uint64_t tag, ps_op_t *op, int *posted);
ncclResult_t ps_rma_post_credit(ps_rma_comm_t *c, uint32_t peer, void *buf, size_t len, void *desc,
                                ps_op_t *op, int *posted);
/* Closing: an empty message (PS_TAG_RMA_PROBE) to every peer that still
 * has operations of ours queued or in flight and no probe in flight; a
 * failed probe, or probes the provider refuses for a second, fail the
 * comm naming the peer. */
void ps_rma_probe_waited_peers(ps_rma_comm_t *c, uint64_t now);

/* Counters and flags that NCCL's calls and the engine both change. Without
 * an engine thread every access is under c->lock and a plain
 * read-modify-write does: a locked one would first wait for every store
 * before it to leave the core, among them the descriptor just posted into a
 * line the NIC (or a model NIC's thread) last read. */
#define PS_RMA_SHARED_ADD(c, lv, d)                                                    \
  do {                                                                               \
    if ((c)->threaded)                                                               \
      __atomic_add_fetch(&(lv), (d), __ATOMIC_RELAXED);                              \
    else                                                                             \
      __atomic_store_n(&(lv), __atomic_load_n(&(lv), __ATOMIC_RELAXED) + (d), __ATOMIC_RELAXED); \
  } while (0)
/* Sets bit in r->life; returns the bits set before. */
static inline int ps_rma_life_mark(const ps_rma_comm_t *c, ps_rma_req_t *r, int bit) {
  if (c->threaded) return __atomic_fetch_or(&r->life, bit, __ATOMIC_ACQ_REL);
  int was = r->life;
  r->life = was | bit;
  return was;
}

/* --- floor 8, ps_rma_peer.c: the lowest --- */
void ps_rma_fail(ps_rma_comm_t *c, ncclResult_t rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void ps_rma_op_started(ps_rma_comm_t *c, ps_rma_peer_t *p);
void ps_rma_op_finished(ps_rma_comm_t *c, ps_rma_peer_t *p);
void ps_rma_wake(ps_rma_peer_t *p);
/* The engine lets go of r: its windows stop counting it. */
void ps_rma_unuse_windows(ps_rma_comm_t *c, ps_rma_req_t *r);
/* r names window g (NCCL's call): g counts it as busy until the engine lets
 * go of r, or the call is refused (ps_rma_unuse_refused). */
static inline void ps_rma_use_window(ps_rma_req_t *r, ps_rma_region_t *g) {
  PS_RMA_SHARED_ADD(r->comm, g->busy_named, 1);
  r->uses[r->nuses++] = g->id;
}
void ps_rma_unuse_refused(ps_rma_comm_t *c, ps_rma_req_t *r);
/* The engine hands r back to the pool (its handle already stale). */
void ps_rma_req_return(ps_rma_comm_t *c, ps_rma_req_t *r);
/* r is locally complete: test() may report it (and NCCL reuse its source). */
void ps_rma_local_done(ps_rma_comm_t *c, ps_rma_req_t *r);
/* A staged request r whose records are all out of their source (r->copied)
 * and whose signal rides or was handed over is locally complete: called
 * when either changes. */
void ps_rma_staged_check(ps_rma_comm_t *c, ps_rma_req_t *r);
void ps_rma_put_done(ps_rma_req_t *r, uint64_t seq, int err, const char *errstr);
/* r's signal completed (a message, an atomic or a staged write). */
void ps_rma_sig_done(ps_rma_req_t *r, int err, const char *errstr);

/* --- floor 8, ps_rma_peer.c: PERSEUS_STATS. With stats off (c->opstats and
 * every p->ops NULL) each step costs a test and a branch: the work is out of
 * line and cold, so the compiler keeps it off the path. --- */
/* NCCL's call: r's stamps start (the caller checks c->opstats). */
void ps_rma_note_call(ps_rma_req_t *r) PS_COLD;
/* ps_now_ns() for a stamp (the caller checks p->ops). */
uint64_t ps_rma_stats_now(void) PS_COLD;
/* When a post call to the provider begins; 0 when off. */
static inline uint64_t ps_rma_post_begins(const ps_rma_peer_t *p) {
  return p->ops ? ps_rma_stats_now() : 0;
}
/* The post call that began at t0 returned (the caller checks p->ops).
 * Taken: *first, a request's stamp, is set unless it was already; refused:
 * counted as held back by the provider. */
void ps_rma_note_post(ps_rma_peer_t *p, uint64_t t0, int posted, uint64_t *first) PS_COLD;
/* A pass over p's queues stopped for `why` (PS_HELD_*). */
void ps_rma_note_stop(ps_rma_peer_t *p, int why) PS_COLD;
static inline void ps_rma_note_held(ps_rma_peer_t *p, int why) {
  if (p->ops) ps_rma_note_stop(p, why);
}
/* r's intervals go into its peer's histograms: the engine's once it settled,
 * NCCL's (report lag, total) when test() reported it (the caller checks
 * that stats are on). */
void ps_rma_note_settled(ps_rma_comm_t *c, const ps_rma_req_t *r) PS_COLD;
void ps_rma_note_reported(ps_rma_comm_t *c, const ps_rma_req_t *r) PS_COLD;
/* An entry point timed for c->calls begins (returns its clock, never 0) and
 * ends. */
uint64_t ps_rma_call_begins(ps_rma_comm_t *c) PS_COLD;
/* A pass's step `which` (PS_PASS_*) ended: its time since *t goes into
 * step[which], and *t moves to now. */
void ps_rma_note_step(uint64_t *step, int which, uint64_t *t) PS_COLD;
void ps_rma_call_ends(ps_rma_comm_t *c, int kind, uint64_t t0) PS_COLD;

#endif
