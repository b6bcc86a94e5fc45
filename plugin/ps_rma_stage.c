/* Staging for GPU windows the provider cannot register (no FI_HMEM): setup,
 * and the origin side.
 *
 * A put with GPU memory on either side moves in chunks of at most
 * PERSEUS_STAGING_CHUNK bytes through send slots in pinned host memory.
 * prepare() fills a slot for a queued chunk: a copy out of the GPU on the
 * copy engine (out stream, tracked by its mark; the proxy never waits on
 * it) or a memcpy from host memory; copies a pass enqueues reach the GPU
 * together at the end of the pass (ps_stage_flush). Chunks bound for GPU
 * memory are records (header + payload) packed into slots, with a riding
 * signal as one more record. post() sends a filled slot once its copies are
 * done: its one chunk straight into a host window, or its records into one
 * of the target's receive slots, with remote CQ data naming the slot. The
 * target copies the records into the window (ps_rma_stage_rx.c) and hands
 * the slot back with a credit.
 *
 * Bounded: a peer keeps per_peer receive slots for us; the staged write with
 * sequence s uses slot s % per_peer and goes only once the peer freed every
 * earlier user of that slot (back-pressure, never growth). Slots are
 * prepared in each peer's call order, so a chunk holding a send slot only
 * waits for chunks that already hold one: no deadlock, however few slots. */
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ps_log.h"
#include "ps_rma_int.h"

#define PS_STAGE_HDR sizeof(ps_stage_hdr_t)

/* Bytes of the largest record: a full chunk's header and payload, padded as
 * rec_bytes counts it. A slot holds one. */
static size_t full_rec_bytes(size_t chunk) { return PS_STAGE_HDR + ps_stage_padded(chunk); }

/* A quarter of PERSEUS_STAGING_BYTES for send slots, the rest split evenly
 * into receive slots per origin rank (at least 2 each: one filling while
 * one copies); the chunk shrinks when many ranks share the budget. */
static ncclResult_t size_pools(ps_stage_t *st, int nranks) {
  const ps_config_t *cfg = ps_fabric_config();
  size_t total = (size_t)cfg->staging_bytes, send = total / 4, rx = total - send;
  size_t chunk = (size_t)cfg->staging_chunk;
  size_t fit = rx / ((size_t)nranks * 2);
  if (fit < 4096 + PS_STAGE_HDR) {
    PS_WARN("PERSEUS_STAGING_BYTES=%zu is too small for %d ranks: GPU windows need at least %zu",
            total, nranks, (size_t)nranks * 2 * (4096 + PS_STAGE_HDR) * 4 / 3 + 4096);
    return ncclInvalidUsage;
  }
  /* shrunk to whole 4 KiB (at least one: fit holds that), so still a
   * multiple of PS_STAGING_CHUNK_ALIGN, which a full chunk's record fills
   * without padding */
  if (full_rec_bytes(chunk) > fit) chunk = (fit - PS_STAGE_HDR) & ~(size_t)4095;
  st->chunk = chunk;
  st->slot_bytes = full_rec_bytes(chunk);
  st->coalesce_ns = (uint64_t)cfg->staging_coalesce_us * 1000;
  st->per_peer = (uint32_t)(rx / ((size_t)nranks * st->slot_bytes));
  st->nsend = (uint32_t)(send / st->slot_bytes);
  if (st->nsend < 2) st->nsend = 2;
  st->rx_bytes = (size_t)nranks * st->per_peer * st->slot_bytes;
  return ncclSuccess;
}

/* What staging GPU windows needs of the provider and the strategy. */
static ncclResult_t staging_refused(ps_rma_comm_t *c) {
  const ps_device_t *d = c->ep.dev;
  if (c->ordering == PS_ORD_FENCE) {
    PS_WARN("GPU windows on %s are staged (no FI_HMEM, or PERSEUS_STAGING=always), and the fence "
            "strategy cannot keep a signal behind staged data: its fenced atomic lands before the "
            "target has copied the payload into the GPU. Use PERSEUS_ORDERING=auto, ordered, "
            "target, deferred or drain", d->name);
    return ncclInvalidUsage;
  }
  if (d->cq_data_size < 8) {
    PS_WARN("GPU windows on %s need staging, which needs 8 bytes of remote CQ data per write "
            "(the provider has %zu)", d->name, d->cq_data_size);
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

/* A provider may list FI_HMEM and still not register CUDA memory (libfabric
 * built without CUDA: shm in Debian's 1.17 does so). The first GPU window's
 * registration tells: where it fails, auto stages, never is an error. */
static ncclResult_t check_direct(ps_rma_comm_t *c, void *gpu_ptr, size_t size,
                                 const ps_dmabuf_t *dmabuf, struct fid_mr **mr) {
  int rc = ps_ep_try_reg(&c->ep, gpu_ptr, size, PS_RMA_WINDOW_ACCESS,
                         ps_cuda_ordinal(c->stage->cu), dmabuf, mr);
  if (!rc) return ncclSuccess;
  if (dmabuf) { /* the provider took a dma-buf when asked (ps_gpumem_dmabuf): this one is bad */
    PS_WARN("regMrSymDmaBuf: %s refused GPU window %p (%zu B) by dma-buf fd %d at offset %llu: %s",
            c->ep.dev->name, gpu_ptr, size, dmabuf->fd, (unsigned long long)dmabuf->offset,
            fi_strerror(-rc));
    return ncclInvalidArgument;
  }
  if (ps_fabric_config()->staging == PS_STAGING_NEVER) {
    PS_WARN("PERSEUS_STAGING=never: %s lists FI_HMEM but cannot register CUDA memory (%s): it "
            "was built without CUDA support", c->ep.dev->name, fi_strerror(-rc));
    return ncclInvalidUsage;
  }
  PS_INFO(NCCL_INIT | NCCL_NET, "one-sided comm: %s lists FI_HMEM but cannot register CUDA memory "
          "(%s): GPU windows are staged", c->ep.dev->name, fi_strerror(-rc));
  c->gpu_direct = 0;
  c->staged_why = "the provider lists FI_HMEM but refused a GPU window";
  return ncclSuccess;
}

static ncclResult_t need_cuda(void) {
  if (!ps_cuda_available()) {
    PS_WARN("a GPU window was registered, but the CUDA driver (libcuda.so.1) cannot be loaded "
            "or sees no GPU");
    return ncclSystemError;
  }
  /* With lazy module loading, a kernel launched (and so loaded) behind one
   * that waits for GIN signals stalls every copy and signal write staging
   * enqueues: the waiting kernel never sees its signal. */
  const char *ml = getenv("CUDA_MODULE_LOADING");
  if (!ml || strcasecmp(ml, "EAGER"))
    PS_WARN("GPU windows are in use with CUDA_MODULE_LOADING=%s: lazy module loading can deadlock "
            "a kernel that waits for GIN signals; set CUDA_MODULE_LOADING=EAGER before CUDA starts",
            ml ? ml : "(unset: lazy)");
  return ncclSuccess;
}

static ncclResult_t alloc_pools(ps_rma_comm_t *c, ps_stage_t *st) {
  size_t P = (size_t)c->nranks;
  PS_CHECK(ps_cuda_host_alloc(st->cu, (size_t)st->nsend * st->slot_bytes, (void **)&st->send_pool));
  PS_CHECK(ps_ep_reg_local(&c->ep, st->send_pool, (size_t)st->nsend * st->slot_bytes, &st->send_mr));
  st->send_desc = st->send_mr ? fi_mr_desc(st->send_mr) : NULL;
  PS_CHECK(ps_cuda_host_alloc(st->cu, st->rx_bytes, (void **)&st->rx_pool));
  PS_CHECK(ps_cuda_host_alloc(st->cu, PS_STAGE_MAX_WORDS * sizeof(uint64_t), (void **)&st->cells));
  st->slots = calloc(st->nsend, sizeof *st->slots);
  st->copies = calloc(P * st->per_peer, sizeof *st->copies);
  st->words = calloc(PS_STAGE_MAX_WORDS, sizeof *st->words);
  st->free_cells = calloc(PS_STAGE_MAX_WORDS, sizeof *st->free_cells);
  st->credit = calloc(P, sizeof *st->credit);
  st->credit_op = calloc(P, sizeof *st->credit_op);
  if (!st->slots || !st->copies || !st->words || !st->free_cells || !st->credit || !st->credit_op)
    return ncclSystemError;
  PS_CHECK(ps_ep_reg_local(&c->ep, st->credit, P * sizeof *st->credit, &st->credit_mr));
  st->credit_desc = st->credit_mr ? fi_mr_desc(st->credit_mr) : NULL;
  for (uint32_t i = st->nsend; i-- > 0;) {
    st->slots[i].hdr = (ps_stage_hdr_t *)(st->send_pool + (size_t)i * st->slot_bytes);
    st->slots[i].next = st->free_slots;
    st->free_slots = &st->slots[i];
  }
  for (uint32_t i = 0; i < PS_STAGE_MAX_WORDS; i++) st->free_cells[i] = &st->cells[i];
  return ncclSuccess;
}

ncclResult_t ps_stage_init(ps_rma_comm_t *c, const void *gpu_ptr, size_t size,
                           const ps_dmabuf_t *dmabuf, struct fid_mr **direct_mr) {
  *direct_mr = NULL;
  PS_CHECK(need_cuda());
  ps_stage_t *st = calloc(1, sizeof *st);
  if (!st) return ncclSystemError;
  c->stage = st;
  ncclResult_t rc = ps_cuda_open(gpu_ptr, &st->cu);
  if (rc == ncclSuccess && c->gpu_direct)
    rc = check_direct(c, (void *)gpu_ptr, size ? size : 1, dmabuf, direct_mr);
  if (rc == ncclSuccess && !c->gpu_direct) rc = staging_refused(c);
  if (rc == ncclSuccess) rc = size_pools(st, c->nranks);
  if (rc == ncclSuccess) rc = alloc_pools(c, st);
  c->stage_chunk = st->chunk;
  if (rc != ncclSuccess) {
    if (*direct_mr) fi_close(&(*direct_mr)->fid);
    *direct_mr = NULL;
    ps_stage_free(c);
  }
  return rc;
}

ncclResult_t ps_stage_attach_rx(ps_rma_comm_t *c, ps_rma_region_t *rx) {
  ps_stage_t *st = c->stage;
  ncclResult_t rc = ncclSuccess;
  st->rx = rx;
  for (int p = 0; rc == ncclSuccess && p < c->nranks; p++) {
    if (st->rx->rsize[p] != st->rx_bytes) {
      PS_WARN("rank %d stages with %llu bytes of receive slots, this rank with %zu: "
              "PERSEUS_STAGING_BYTES and PERSEUS_STAGING_CHUNK must match on every rank", p,
              (unsigned long long)st->rx->rsize[p], st->rx_bytes);
      rc = ncclInvalidUsage;
    }
  }
  if (rc != ncclSuccess) {
    st->rx = NULL; /* the caller deregisters it, then frees the set-up */
    return rc;
  }
  if (c->gpu_direct)
    PS_INFO(NCCL_INIT | NCCL_NET, "one-sided comm: GPU windows registered with %s (FI_HMEM); the "
            "staging set-up carries signal updates into GPU memory only", c->ep.dev->name);
  else
    PS_INFO(NCCL_INIT | NCCL_NET, "one-sided comm: GPU windows staged through pinned host memory "
            "(%s: %s): chunks of %zu B, %u receive slots per peer, %u send slots, %.1f MiB",
            c->ep.dev->name, c->staged_why ? c->staged_why : "?", st->chunk, st->per_peer, st->nsend,
            (double)((size_t)st->nsend * st->slot_bytes + st->rx_bytes) / (1 << 20));
  return ncclSuccess;
}

void ps_stage_free(ps_rma_comm_t *c) {
  ps_stage_t *st = c->stage;
  if (!st) return;
  /* the copy engines must stop touching the pinned memory freed below */
  if (st->cu) (void)ps_cuda_quiesce(st->cu, PS_STAGE_QUIESCE_NS);
  /* st->rx belongs to the comm's region list, which frees it */
  if (st->send_mr) fi_close(&st->send_mr->fid);
  if (st->credit_mr) fi_close(&st->credit_mr->fid);
  if (st->cu) {
    if (st->send_pool) ps_cuda_host_free(st->cu, st->send_pool);
    if (st->rx_pool) ps_cuda_host_free(st->cu, st->rx_pool);
    if (st->cells) ps_cuda_host_free(st->cu, st->cells);
    ps_cuda_close(st->cu);
  }
  free(st->slots), free(st->copies), free(st->words), free(st->free_cells);
  free(st->credit), free(st->credit_op);
  free(st);
  c->stage = NULL;
}

static size_t chunk_len(const ps_stage_t *st, const ps_rma_req_t *r, uint32_t i) {
  size_t off = (size_t)i * st->chunk, size = r->iov.iov_len;
  return size - off < st->chunk ? size - off : st->chunk;
}

/* Records a request has: its chunks, and its riding signal. */
static uint32_t nrecs(const ps_rma_req_t *r) { return r->nchunks + r->sig_rides; }

/* Bytes record i of r takes in a slot: header and payload, to the next
 * 64-byte boundary (the signal: a header); a chunk into a host window goes
 * bare. */
static size_t rec_bytes(const ps_stage_t *st, const ps_rma_req_t *r, uint32_t i) {
  if (i == r->nchunks) return PS_STAGE_HDR;
  size_t n = chunk_len(st, r, i);
  return r->dst_staged ? PS_STAGE_HDR + ps_stage_padded(n) : n;
}

/* Payload bytes in slot s, after its first header (a bare chunk has no
 * header of its own). */
static size_t paid(const ps_stage_slot_t *s) {
  return s->bare ? s->used : s->used - s->nrec * PS_STAGE_HDR;
}

/* Whether a record of `bytes` can join slot s (not posted yet: the last
 * prepared for the peer): a staged write with room left, opened in this pass
 * or still copying out of the GPU, for at most PERSEUS_STAGING_COALESCE_US.
 * A slot that could go already takes nothing more; one that waits for its
 * copies anyway takes the chunks queued meanwhile, so under load a write
 * carries several. */
static int open_to(const ps_rma_comm_t *c, const ps_stage_slot_t *s, size_t bytes) {
  const ps_stage_t *st = c->stage;
  if (!s || s->bare || s->sealed || s->nrec == PS_STAGE_MAX_RECS || s->used + bytes > st->slot_bytes)
    return 0;
  return s->pass == c->passes || (s->ticket && c->now_ns - s->opened_ns < st->coalesce_ns);
}

static int joins(const ps_rma_comm_t *c, const ps_stage_slot_t *s, const ps_rma_req_t *r, uint32_t i) {
  return r->dst_staged && open_to(c, s, rec_bytes(c->stage, r, i));
}

int ps_stage_open_to(const ps_rma_comm_t *c, const ps_rma_peer_t *p) {
  if (!c->stage) return 0;
  /* with chunks still to prepare, the signal's record follows them */
  return p->prep_req || open_to(c, p->prep_tail, PS_STAGE_HDR);
}

/* Whether record i of r fits an empty slot (a bare chunk starts past the
 * header it does not use). size_pools sizes slots for the largest record:
 * one that does not fit would spill into the next slot at the target, so
 * the comm fails instead of writing it. */
static int fits_fresh(ps_rma_comm_t *c, const ps_rma_req_t *r, uint32_t i) {
  const ps_stage_t *st = c->stage;
  size_t need = rec_bytes(st, r, i) + (r->dst_staged ? 0 : PS_STAGE_HDR);
  if (need <= st->slot_bytes) return 1;
  ps_rma_fail(c, ncclInternalError, "staging: record %u of a put to rank %u needs %zu B of a "
              "%zu B slot (chunks of %zu B): not written past the slot", i, r->peer, need,
              st->slot_bytes, st->chunk);
  return 0;
}

/* Prepares this peer's queued chunks, in order, each into the last slot
 * prepared for the peer where it joins, else into a free slot (at most
 * `limit` of them); returns how many free slots it took. */
static int prepare(ps_rma_comm_t *c, ps_rma_peer_t *p, int limit) {
  ps_stage_t *st = c->stage;
  int taken = 0;
  while (p->prep_req && !c->error) {
    ps_rma_req_t *r = p->prep_req;
    if (!r->staged || r->prepared == nrecs(r)) {
      /* A slot goes out when the put of its first record heads the queue:
       * a later record joining it across a put that is not staged would
       * pass that put (and a riding signal would overtake its data). */
      if (!r->staged && p->prep_tail) p->prep_tail->sealed = 1;
      p->prep_req = r->next;
      continue;
    }
    uint32_t i = r->prepared;
    ps_stage_slot_t *s = p->prep_tail;
    if (!joins(c, s, r, i)) {
      if (!fits_fresh(c, r, i)) return taken;
      if (taken == limit || !(s = st->free_slots)) break;
      st->free_slots = s->next;
      s->ticket = 0, s->pass = c->passes, s->opened_ns = c->now_ns, s->used = 0, s->nrec = 0;
      s->ncopied = 0, s->sealed = 0;
      s->bare = !r->dst_staged;
      s->next = NULL;
      if (p->prep_tail) p->prep_tail->next = s;
      else p->prep_head = s;
      p->prep_tail = s;
      taken++;
    }
    size_t n = i == r->nchunks ? 0 : chunk_len(st, r, i);
    char *payload = (char *)(s->hdr + 1) + paid(s);
    const char *from = n ? r->src + (size_t)i * st->chunk : NULL;
    if (r->src_gpu && n) {
      if (!i && p->ops) r->ts.copy_start = ps_rma_stats_now();
      if (ps_cuda_d2h(st->cu, PS_CUDA_OUT_STREAM, payload, from, n, &s->ticket) != ncclSuccess) {
        ps_rma_fail(c, ncclSystemError, "copying a put to rank %u out of the GPU failed", r->peer);
        return taken;
      }
    } else if (n) {
      memcpy(payload, from, n);
    }
    s->rec[s->nrec++] = (ps_stage_rec_t){.req = r, .chunk = i == r->nchunks ? PS_STAGE_SIG_REC : i};
    s->used += rec_bytes(st, r, i);
    r->prepared++;
  }
  return taken;
}

/* Whatever this peer has queued, into at most one more slot, so that a new
 * call's chunks do not wait a round. */
void ps_stage_prepare(ps_rma_comm_t *c, ps_rma_peer_t *p) { prepare(c, p, 1); }

/* Free slots go round-robin over the peers with chunks waiting, starting
 * one further each pass: a peer with a long queue cannot starve the others
 * (its chunks may hold slots while they wait for its credits). */
void ps_stage_fill(ps_rma_comm_t *c) {
  ps_stage_t *st = c->stage;
  int P = c->nranks, any = 1;
  st->rr = (st->rr + 1) % P;
  while (any && st->free_slots && !c->error) {
    any = 0;
    for (int k = 0; k < P && st->free_slots; k++) any |= prepare(c, &c->peers[(st->rr + k) % P], 1);
  }
}

/* The staged write completed: every chunk and signal in it did. */
static void slot_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_stage_slot_t *s = op->owner;
  ps_stage_t *st = s->rec[0].req->comm->stage;
  ps_rma_comm_t *c = s->rec[0].req->comm;
  (void)e;
  for (uint32_t k = 0; k < s->nrec; k++) {
    ps_rma_req_t *r = s->rec[k].req;
    if (s->rec[k].chunk == PS_STAGE_SIG_REC) ps_rma_sig_done(r, err, errstr);
    else ps_rma_put_done(r, r->seq + s->rec[k].chunk, err, errstr);
  }
  s->nrec = 0;
  s->next = st->free_slots;
  st->free_slots = s;
  c->backlog = 1; /* a free slot: the next chunks can be prepared */
}

/* PERSEUS_STATS: when a put's last chunk was seen copied out of the GPU. */
static void PS_COLD stamp_copied(ps_stage_slot_t *s) {
  for (uint32_t k = s->ncopied; k < s->nrec; k++) {
    ps_rma_req_t *r = s->rec[k].req;
    if (s->rec[k].chunk == r->nchunks - 1 && !r->ts.copy_done) r->ts.copy_done = ps_rma_stats_now();
  }
}

/* The records of slot s not yet counted, whose copies finished: their
 * requests are that much nearer local completion. */
static void count_copied(ps_rma_comm_t *c, ps_stage_slot_t *s) {
  if (c->peers[s->rec[0].req->peer].ops) stamp_copied(s);
  for (; s->ncopied < s->nrec; s->ncopied++) {
    ps_rma_req_t *r = s->rec[s->ncopied].req;
    r->copied++;
    ps_rma_staged_check(c, r);
  }
}

/* The slots prepared for p whose copies out of the GPU finished, looked at
 * each time perseus tries to post to p: their puts may be reported done
 * before their writes go (the send slots bound how many). Copies finish in
 * the order they were issued: the first one still running ends the look. */
static ncclResult_t look_at_copies(ps_rma_comm_t *c, ps_rma_peer_t *p) {
  for (ps_stage_slot_t *s = p->prep_head; s; s = s->next) {
    if (s->ticket) {
      int done = ps_cuda_passed(c->stage->cu, PS_CUDA_OUT_STREAM, s->ticket);
      if (done <= 0) return done < 0 ? ncclSystemError : ncclSuccess;
      s->ticket = 0;
    }
    count_copied(c, s);
  }
  return ncclSuccess;
}

/* Posts slot s: a staged write into the peer's receive slot for sequence
 * sseq (each record's header written now), or its one bare chunk. */
static ncclResult_t post_slot(ps_rma_comm_t *c, ps_stage_slot_t *s, uint64_t sseq, int *posted) {
  ps_stage_t *st = c->stage;
  ps_rma_req_t *r = s->rec[0].req;
  struct iovec iov;
  struct fi_rma_iov rma;
  void *desc = st->send_desc;
  struct fi_msg_rma m = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = c->addr[r->peer],
                         .rma_iov = &rma, .rma_iov_count = 1, .context = &s->op};
  s->op = (ps_op_t){.cb = slot_done, .owner = s};
  if (s->bare) {
    size_t off = (size_t)s->rec[0].chunk * st->chunk;
    iov = (struct iovec){.iov_base = s->hdr + 1, .iov_len = s->used};
    rma = (struct fi_rma_iov){.addr = r->rma.addr + off, .len = s->used, .key = r->rma.key};
    return ps_rma_post_put(c, r->peer, &m, r->seq + s->rec[0].chunk, posted);
  }
  size_t hdrs_off = PS_STAGE_HDR + paid(s);
  int has_sig = 0;
  for (uint32_t k = 0; k < s->nrec; k++) {
    ps_rma_req_t *q = s->rec[k].req;
    uint32_t i = s->rec[k].chunk;
    ps_stage_hdr_t *h = (ps_stage_hdr_t *)((char *)s->hdr + (k ? hdrs_off + (k - 1) * PS_STAGE_HDR : 0));
    *h = (ps_stage_hdr_t){.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                          .more = (uint16_t)(k + 1 < s->nrec), .src_rank = (uint32_t)c->rank,
                          .stage_seq = sseq, .hdrs_off = k ? 0 : (uint32_t)hdrs_off};
    if (i == PS_STAGE_SIG_REC) {
      has_sig = 1;
      h->region_id = q->sig.region_id, h->offset = q->sig.offset, h->seq = q->sig.covers;
      h->sig_op = q->sig.op, h->sig_value = q->sig.value;
    } else {
      h->region_id = q->dst_region, h->offset = q->dst_off + (size_t)i * st->chunk;
      h->len = chunk_len(st, q, i), h->seq = q->seq + i;
    }
  }
  uint32_t slot = (uint32_t)(sseq % st->per_peer);
  iov = (struct iovec){.iov_base = s->hdr, .iov_len = s->used};
  rma = (struct fi_rma_iov){
      .addr = st->rx->raddr[r->peer] + ((uint64_t)c->rank * st->per_peer + slot) * st->slot_bytes,
      .len = s->used, .key = st->rx->rkey[r->peer]};
  return ps_rma_post_staged(c, r->peer, &m, slot, &s->sop, has_sig, posted);
}

ncclResult_t ps_stage_post(ps_rma_comm_t *c, ps_rma_peer_t *p, ps_rma_req_t *r, int *all,
                           int *refused) {
  ps_stage_t *st = c->stage;
  *all = 0, *refused = 0;
  PS_CHECK(look_at_copies(c, p));
  while (r->posted_chunks < nrecs(r)) {
    if (ps_rma_peer_full(c, p)) { /* waits for a completion */
      ps_rma_note_held(p, PS_HELD_INFLIGHT);
      return ncclSuccess;
    }
    ps_stage_slot_t *s = p->prep_head;
    if (!s || s->rec[0].req != r) { /* waits for a send slot */
      ps_rma_note_held(p, st->free_slots ? PS_HELD_UNFILLED : PS_HELD_SLOT);
      return ncclSuccess;
    }
    if (s->ticket) { /* still copying out of the GPU (look_at_copies looked) */
      ps_rma_note_held(p, PS_HELD_COPY);
      return ncclSuccess;
    }
    count_copied(c, s); /* records that joined since the look */
    uint64_t sseq = p->stage_sent;
    if (!s->bare && sseq >= p->stage_freed + st->per_peer) { /* no credit yet */
      ps_rma_note_held(p, PS_HELD_CREDIT);
      return ncclSuccess;
    }
    int posted = 0;
    uint64_t t0 = ps_rma_post_begins(p);
    PS_CHECK(post_slot(c, s, sseq, &posted));
    if (p->ops) ps_rma_note_post(p, t0, posted, &r->ts.posted);
    if (!posted) {
      *refused = 1;
      return ncclSuccess;
    }
    p->prep_head = s->next;
    if (!p->prep_head) p->prep_tail = NULL;
    if (!s->bare) p->stage_sent = sseq + 1;
    for (uint32_t k = 0; k < s->nrec; k++) {
      ps_rma_req_t *q = s->rec[k].req;
      q->posted_chunks++;
      if (s->rec[k].chunk == PS_STAGE_SIG_REC) {
        q->sig_stage = PS_STAGE_POSTED;
        p->st.signals++, p->stage_sigs++;
        if (p->ops) q->ts.sig_posted = ps_rma_stats_now();
      } else {
        p->posted_below = q->seq + s->rec[k].chunk + 1;
        p->stage_chunks += !s->bare;
        if (p->ops && !q->ts.posted) q->ts.posted = ps_rma_stats_now();
      }
      ps_rma_op_started(c, p);
    }
  }
  *all = 1;
  return ncclSuccess;
}

/* A peer consumed our staged writes below `freed_below`: their slots are free. */
void ps_stage_credit(ps_rma_comm_t *c, uint32_t src, uint64_t freed_below) {
  ps_rma_peer_t *p = &c->peers[src];
  if (!c->stage || freed_below < p->stage_freed || freed_below > p->stage_sent) {
    ps_rma_fail(c, ncclRemoteError, "rank %u returned staging slots below %llu, but %llu were "
                "returned and %llu sent", src, (unsigned long long)freed_below,
                (unsigned long long)p->stage_freed, (unsigned long long)p->stage_sent);
    return;
  }
  /* only a credit that frees something shows the peer alive: one repeated
   * (an honest peer never sends one twice) must not hold off the timeout of
   * a staged put that waits for slots */
  if (freed_below > p->stage_freed) p->active_ns = c->now_ns;
  p->stage_freed = freed_below;
  c->backlog = 1;
}

void ps_stage_flush(ps_rma_comm_t *c) {
  if (c->stage && !c->error && ps_cuda_flush_lazy(c->stage->cu) != ncclSuccess)
    ps_rma_fail(c, ncclSystemError, "handing staging copies and signal writes to the GPU failed");
}

void ps_stage_dump(ps_rma_comm_t *c) {
  ps_stage_t *st = c->stage;
  uint32_t free_slots = 0;
  for (ps_stage_slot_t *s = st->free_slots; s; s = s->next) free_slots++;
  PS_INFO(NCCL_NET, "staging on rank %d: %u of %u send slots free, %u copies in flight, %u signal "
          "words", c->rank, free_slots, st->nsend, st->ncopies, st->nwords);
  for (int i = 0; i < c->nranks; i++) {
    ps_rma_peer_t *p = &c->peers[i];
    uint32_t prepared = 0;
    for (ps_stage_slot_t *s = p->prep_head; s; s = s->next) prepared++;
    PS_INFO(NCCL_NET, "  to rank %d: staged writes sent below %llu, freed below %llu, %u slots "
            "prepared; from it: copies enqueued below %llu, done below %llu, credit sent %llu%s, "
            "%u signals held", i, (unsigned long long)p->stage_sent,
            (unsigned long long)p->stage_freed, prepared,
            (unsigned long long)p->stage_in.below, (unsigned long long)p->stage_done.below,
            (unsigned long long)p->credit_sent, p->credit_busy ? " (in flight)" : "", p->nheld);
  }
}
