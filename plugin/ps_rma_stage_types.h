/* The staging set-up's types (GPU windows through pinned host memory,
 * ps_rma_stage*.c): send slots and their records, the target's copies and
 * GPU signal words. Part of ps_rma_int.h, which includes it where the
 * request and stream types it names are declared; include that instead. */
#ifndef PS_RMA_STAGE_TYPES_H
#define PS_RMA_STAGE_TYPES_H

#define PS_STAGE_MAX_RECS 64 /* chunks packed into one staged write */

#define PS_STAGE_SIG_REC UINT32_MAX /* ps_stage_rec_t.chunk of a request's signal */

/* One chunk of a put in a send slot, or (chunk PS_STAGE_SIG_REC) the signal
 * riding behind the request's last chunk. */
typedef struct {
  struct ps_rma_req *req;
  uint32_t chunk;
} ps_stage_rec_t;

/* A send slot in pinned memory: the chunks, each a record (header +
 * payload, laid out as ps_wire.h says), that go to one peer in one staged write. Consecutive chunks
 * queued to the peer in one progress pass share a slot while they fit: one
 * write, one completion, one receive slot at the peer. A chunk into a host
 * window goes alone and bare (its payload after the first header's room). */
typedef struct ps_stage_slot {
  ps_stage_hdr_t *hdr;        /* the first record */
  uint64_t ticket;            /* the copies out of the GPU (out stream's mark), 0 once done */
  uint64_t pass;              /* the progress pass it was opened in */
  uint64_t opened_ns;
  size_t used;                /* bytes of records */
  uint32_t nrec;
  uint32_t ncopied;           /* records counted as out of their source (ps_stage_copied) */
  int bare;                   /* one chunk into a host window */
  int sealed;                 /* a put that is not staged came after it: nothing more joins */
  ps_stage_rec_t rec[PS_STAGE_MAX_RECS];
  ps_op_t op;
  ps_rma_sop_t sop;           /* its write on a staging stream */
  struct ps_stage_slot *next; /* free list, or the peer's list of prepared slots */
} ps_stage_slot_t;

/* A receive slot's copy into the GPU, in flight on the copy stream. */
typedef struct {
  uint64_t ticket;
  uint32_t src;
  uint64_t stage_seq;
} ps_stage_copy_t;

/* A signal word in GPU memory with adds in flight: its value is read (on the
 * read stream), then value + adds written on the copy stream behind every
 * payload copy enqueued so far; while our write is in flight further adds
 * write on top of it. The GPU may reset the word only while no add is in
 * flight (NCCL's contract for resetSignal), so a fresh read sees the reset. */
typedef struct {
  char *addr;
  uint64_t accum, last;
  uint64_t *cell;             /* pinned: where the read lands */
  uint64_t ticket;            /* the read's (read stream) or our last write's (copy stream) mark */
  int writing;
} ps_stage_word_t;

#define PS_STAGE_MAX_WORDS 1024 /* GPU signal words with adds in flight at once */

/* Staging for GPU windows (ps_rma_stage*.c), set up by the first one. */
typedef struct {
  ps_cuda_dev_t *cu;
  size_t chunk, slot_bytes;   /* payload per slot; header + payload */
  uint64_t coalesce_ns;       /* PERSEUS_STAGING_COALESCE_US */
  uint32_t nsend, per_peer;   /* send slots; receive slots per origin */
  char *send_pool;
  struct fid_mr *send_mr;
  void *send_desc;
  ps_stage_slot_t *slots, *free_slots;
  char *rx_pool;              /* per origin rank, per_peer slots */
  size_t rx_bytes;
  ps_rma_region_t *rx;        /* the receive pools, as a symmetric region */
  ps_stage_copy_t *copies;    /* ring, nranks * per_peer */
  uint32_t copy_head, ncopies;
  ps_stage_word_t *words;
  uint32_t nwords;
  uint64_t *cells, **free_cells; /* a stack: PS_STAGE_MAX_WORDS - nwords cells are free */
  ps_sig_msg_t *credit;       /* per peer: the credit message in flight */
  ps_op_t *credit_op;
  struct fid_mr *credit_mr;
  void *credit_desc;
  int changed;                /* arrivals, copies or words moved: recheck held signals */
  int rr;                     /* where the round-robin of free send slots starts */
} ps_stage_t;

#endif
