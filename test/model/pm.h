/* The model fabric: a libfabric provider ("model") for tests and benchmarks
 * only, never installed. It behaves like an RDMA NIC with a configurable
 * one-way latency and per-link bandwidth, between processes of one host:
 *
 * - Each process runs PERSEUS_MODEL_NIC_THREADS NIC threads (default 1), the
 *   links shared out among them. A post only queues the operation; the NIC
 *   thread puts it on its link (origin endpoint -> destination) as a NIC
 *   queue would: it starts when the link is free, occupies it for len /
 *   bandwidth, and arrives one latency later. Then the NIC thread performs
 *   it: an RMA write or read straight into (out of) the target's memory,
 *   checked against the target's registrations, with memcpy where that
 *   memory is a shared /dev/shm mapping (mapped here too: pm_win.c), else
 *   with process_vm_writev/readv; a tagged send, an atomic or a write's remote
 *   CQ data as a message into the target endpoint's inbox, where the target's
 *   NIC thread matches, pulls and applies it. Completions come one latency
 *   after arrival (an acknowledgement's trip), so waiting for them costs what
 *   a real NIC's round trip does; nobody's CPU in the target process is needed
 *   for a write.
 * - Links deliver in order (FI_ORDER_SAW/WAW/...: the ordered strategy's
 *   premise) unless PERSEUS_MODEL_ORDER=0, which claims no order and swaps
 *   neighbouring operations on purpose; 2 claims order and swaps anyway (a
 *   NIC that lies: what the invariant tests must catch). Native uint64
 *   atomic add with FI_FENCE.
 *
 * Shared memory: an endpoint is a segment in /dev/shm, "pm_<pid>_<hex>"
 * (its address), holding its inbox; a process's registrations are in its
 * domain's segment, named in each endpoint's header. */
#ifndef PM_H
#define PM_H

#include <pthread.h>
#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#define PM_NAME_LEN 32 /* an endpoint's address: its segment's name, NUL-padded */
#define PM_MAX_MR 4096
#define PM_INBOX 1024 /* messages an endpoint's inbox holds */
#define PM_RCQ 4096   /* remote CQ data entries an endpoint's notice ring holds */
#define PM_MAGIC 0x504d4f44454c3031ULL
/* Sends up to this size travel inside the message (eager, as NICs inline
 * them); larger ones are pulled from the sender once matched, and the sender
 * must keep them until they complete. */
#define PM_INLINE 64

enum { PM_MSG_TSEND = 1, PM_MSG_ACK, PM_MSG_ATOMIC };

typedef struct {
  _Atomic uint64_t seq; /* ring position protocol (bounded MPMC queue) */
  uint32_t type, status;   /* status: ACK's fi errno, 0 = done */
  int32_t src_pid;
  uint32_t has_data; /* TSEND: `data` is remote CQ data (fi_tsenddata) */
  uint64_t tag, len, addr, key, data, ctx, not_before_ns;
  char src[PM_NAME_LEN]; /* the sender endpoint's name, for the answer */
  uint8_t inl[PM_INLINE]; /* a small send's bytes, copied when it left */
} pm_msg_t;

typedef struct {
  _Atomic uint64_t key; /* 0 = free */
  uint64_t addr, len, access;
  /* Registered memory that lies in a shared mapping of /dev/shm/<shm>, at
   * byte shm_off of the file: peers map the file and copy at memory speed
   * (else the NIC thread moves the bytes with process_vm_writev/readv). */
  char shm[PM_NAME_LEN];
  uint64_t shm_off;
} pm_mr_slot_t;

typedef struct {
  uint64_t magic;
  int32_t pid;
  uint32_t pad;
  pm_mr_slot_t mr[PM_MAX_MR];
} pm_dom_seg_t;

typedef struct {
  uint64_t magic;
  int32_t pid;
  uint32_t pad;
  char dom[PM_NAME_LEN]; /* the segment of its process's registrations */
  _Atomic uint64_t head, tail;
  pm_msg_t ring[PM_INBOX];
  /* A write's remote CQ data, put here by the origin's NIC thread once the
   * bytes are in and read by the target's fi_cq_read, as a NIC writes the
   * completion entry into host memory: no thread of the target handles it
   * on the way. Same ring protocol as the inbox. With it, the writing
   * endpoint's name: its source, for fi_cq_readfrom. */
  _Atomic uint64_t rcq_head, rcq_tail;
  struct {
    _Atomic uint64_t seq;
    uint64_t data;
    char src[PM_NAME_LEN];
  } rcq[PM_RCQ];
} pm_ep_seg_t;

/* Model parameters (PERSEUS_MODEL_*), read once. */
typedef struct {
  uint64_t latency_ns;
  double ns_per_byte; /* 1 / bandwidth */
  int ordered;        /* links say they deliver in order */
  int reorder;        /* links swap neighbouring operations */
  int atomics;        /* native atomics with FI_FENCE offered */
  int hmem;           /* FI_HMEM offered: "CUDA" memory registered as host memory,
                       * which it is under the plugin's fake CUDA driver */
  int dmabuf;         /* with hmem: "CUDA" memory by its fake dma-buf too */
  int mr_endpoint;    /* FI_MR_ENDPOINT: registrations bound and enabled before use */
  int nic_threads;    /* NIC threads per process: links are shared out among them */
} pm_params_t;
#define PM_MAX_NIC_THREADS 16
const pm_params_t *pm_params(void);
uint64_t pm_now_ns(void);

/* A mapped segment of another endpoint or domain (cached per process). */
void *pm_map(const char *name, size_t size);
/* Our registration of [buf, buf + len): the /dev/shm file it lies in
 * (shared mapping) and its offset there, or shm[0] = 0 (pm_win.c). */
void pm_window_find(const void *buf, size_t len, char shm[PM_NAME_LEN], uint64_t *off);
/* Moves an RMA operation's bytes between `buf` and the peer's memory at
 * raddr (a write, or a read with `is_read`): through a mapping of its window
 * file where it has one, else process_vm_writev/readv; NULL, or why it
 * failed (pm_win.c). The registration was checked. */
const char *pm_move(const pm_mr_slot_t *s, pid_t pid, int is_read, void *buf, uint64_t raddr,
                    size_t len, char *why, size_t why_len);
/* Where a peer's registration `s` (checked for [addr, addr + len)) is
 * mapped here, or NULL when it lies in no shared file (pm_win.c). */
void *pm_window_at(const pm_mr_slot_t *s, uint64_t addr, size_t len);
/* A fresh segment of ours: its name in `name`. */
void *pm_create(char *name, size_t size);
void pm_unlink(const char *name, void *seg, size_t size);

/* Inbox: non-blocking; -FI_EAGAIN when full. */
int pm_inbox_put(pm_ep_seg_t *s, const pm_msg_t *m);
int pm_inbox_get(pm_ep_seg_t *s, pm_msg_t *out);

/* A write's remote CQ data, from the endpoint named `src`, into the target
 * endpoint's notice ring; -FI_EAGAIN when full. */
int pm_rcq_put(pm_ep_seg_t *s, uint64_t data, const char *src);

struct pm_av;

/* Completion queue (pm_cq.c, with the inbox and the notice ring above). */
typedef struct pm_cq pm_cq_t;
int pm_cq_open(struct fid_domain *d, struct fi_cq_attr *attr, struct fid_cq **out, void *ctx);
/* The notice ring of an endpoint bound to the CQ: fi_cq_read returns its
 * entries (attach when the endpoint is enabled, detach before it closes),
 * fi_cq_readfrom their writers as indexes of the endpoint's `av`. */
int pm_cq_attach(pm_cq_t *cq, pm_ep_seg_t *seg, struct pm_av *av);
void pm_cq_detach(pm_cq_t *cq, pm_ep_seg_t *seg);
/* Entries from NIC thread `pm_nic_tid` go into that thread's own ring of
 * the CQ; other threads (-1) share one. */
extern _Thread_local int pm_nic_tid;
/* src: a received message's sender (FI_SOURCE), else FI_ADDR_NOTAVAIL. */
void pm_cq_push(pm_cq_t *cq, const struct fi_cq_tagged_entry *e, fi_addr_t src);
void pm_cq_push_err(pm_cq_t *cq, void *ctx, uint64_t flags, int err, size_t olen, const char *why);

/* Domain (pm_prov.c): its registrations' segment. */
typedef struct {
  struct fid_domain dom;
  char seg_name[PM_NAME_LEN];
  pm_dom_seg_t *seg;
  pthread_mutex_t lock;
} pm_domain_t;

/* Address vector: fi_addr_t is an index. Entries live in blocks that never
 * move, so the NIC threads and posts look them up without a lock (a NIC's
 * address table is read by its hardware, not under the driver's lock). */
typedef struct {
  char name[PM_NAME_LEN];
  _Atomic(pm_ep_seg_t *) seg; /* NULL: removed */
  pm_dom_seg_t *dom;
  pid_t pid;
} pm_peer_t;

#define PM_AV_BLOCK 256
#define PM_AV_BLOCKS 256 /* addresses an AV holds: PM_AV_BLOCK * PM_AV_BLOCKS */
#define PM_AV_INDEX 1024 /* slots of the name index (a power of 2) */
#define PM_AV_PROBES 16
typedef struct pm_av {
  struct fid_av av;
  pthread_mutex_t lock; /* inserts and removals */
  pm_peer_t *block[PM_AV_BLOCKS];
  _Atomic size_t n;     /* entries published */
  /* name -> address, for FI_SOURCE on every arrival: open addressing, each
   * slot the name's hash (high half) and address + 1 (low half), 0 empty.
   * Slots are never emptied (a removed entry's is skipped), so readers need
   * no lock; a name whose probes find no room is found by a scan. */
  _Atomic uint64_t index[PM_AV_INDEX];
} pm_av_t;
const pm_peer_t *pm_av_get(pm_av_t *av, fi_addr_t a);
/* The address of the endpoint named `name` (FI_SOURCE): FI_ADDR_NOTAVAIL
 * when it is not in av. */
fi_addr_t pm_av_find(pm_av_t *av, const char *name);

int pm_ep_open(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
void pm_nic_stop(void);

#endif
