/* One-sided engine, setup: the collective communicator (one endpoint per
 * rank, every peer's address in its AV) and symmetric registration (each
 * rank registers its part; address, size and key are allgathered). */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "ps_clock.h"
#include "ps_gpumem.h"
#include "ps_log.h"
#include "ps_rma_int.h"

static void print_stats(ps_rma_comm_t *c);
static void close_comm(ps_rma_comm_t *c, int report);
static int want_thread(void);
static void dereg_region(ps_rma_comm_t *c, ps_rma_region_t *r);
static ncclResult_t choose_staging(ps_device_t *dev, int *direct, const char **why);

/* Tag (ps_handle.h): distinct from the net tables', gin_abi.c's and the
 * engine's others (ps_rma_ops.c). */
static ps_htab_t listen_tab = PS_HTAB_INIT(0x6c, "one-sided listenComm", "closed");

/* A listenComm: the endpoint connect takes over. */
typedef struct {
  ps_ep_t ep;
  uint32_t slot;
} rma_listen_t;

/* Process-wide totals (perseus_rma_process_stats): live comms are summed
 * on demand, closed ones were folded in when they closed. */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static ps_rma_comm_t **live;
static int nlive, cap_live;
static ps_rma_peer_stats_t closed_total;

static void add_stats(ps_rma_peer_stats_t *sum, const ps_rma_comm_t *c) {
  for (int p = 0; c->peers && p < c->nranks; p++) {
    const ps_rma_peer_stats_t *s = &c->peers[p].st;
    sum->puts += s->puts, sum->signals += s->signals;
    sum->fences_posted += s->fences_posted, sum->fences_avoided += s->fences_avoided;
    sum->blocked_ns += s->blocked_ns;
    if (s->inflight_max > sum->inflight_max) sum->inflight_max = s->inflight_max;
  }
}

static ncclResult_t live_add(ps_rma_comm_t *c) {
  pthread_mutex_lock(&live_lock);
  if (nlive == cap_live) {
    int cap = cap_live ? 2 * cap_live : 8;
    ps_rma_comm_t **n = realloc(live, (size_t)cap * sizeof *n);
    if (!n) {
      pthread_mutex_unlock(&live_lock);
      return ncclSystemError;
    }
    live = n, cap_live = cap;
  }
  live[nlive++] = c;
  pthread_mutex_unlock(&live_lock);
  return ncclSuccess;
}

static void live_remove(ps_rma_comm_t *c) {
  pthread_mutex_lock(&live_lock);
  for (int i = 0; i < nlive; i++) {
    if (live[i] != c) continue;
    live[i] = live[--nlive];
    add_stats(&closed_total, c);
    break;
  }
  pthread_mutex_unlock(&live_lock);
}

void ps_rma_process_stats(ps_rma_peer_stats_t *out) {
  pthread_mutex_lock(&live_lock);
  *out = closed_total;
  for (int i = 0; i < nlive; i++) {
    ps_rma_lock(live[i]);
    add_stats(out, live[i]);
    ps_lock_give(&live[i]->lock);
  }
  pthread_mutex_unlock(&live_lock);
}

ncclResult_t ps_rma_listen(int dev, void *handle, void **listen_comm) {
  if (!handle || !listen_comm) return ncclInvalidArgument;
  *listen_comm = NULL;
  ps_device_t *d = ps_fabric_rma_dev(dev);
  if (!d) {
    PS_WARN("one-sided listen: device %d has no RMA-capable endpoint", dev);
    return ncclInvalidArgument;
  }
  rma_listen_t *l = calloc(1, sizeof *l);
  if (!l) {
    PS_WARN("one-sided listen: out of memory");
    return ncclSystemError;
  }
  ncclResult_t rc = ps_htab_reserve(&listen_tab, 1, &l->slot);
  if (rc != ncclSuccess) {
    free(l);
    return rc;
  }
  rc = ps_ep_open(d, (int)ps_fabric_config()->eagain_retries, &l->ep);
  if (rc == ncclSuccess)
    rc = ps_handle_encode(handle, ps_fabric_wire_hash(), (uint32_t)dev, ps_random64(), l->ep.addr,
                          l->ep.addrlen);
  if (rc != ncclSuccess) {
    ps_ep_close(&l->ep);
    ps_htab_release(&listen_tab, l->slot, 1);
    free(l);
    return rc;
  }
  *listen_comm = ps_htab_bind(&listen_tab, l->slot, l);
  return ncclSuccess;
}

static rma_listen_t *listen_of(void *listen_comm, const char *call) {
  return ps_htab_lookup(&listen_tab, listen_comm, call);
}

ncclResult_t ps_rma_close_listen(void *listen_comm) {
  rma_listen_t *l = listen_of(listen_comm, "one-sided closeListen");
  if (!l) return ncclInvalidArgument;
  ps_htab_release(&listen_tab, l->slot, 1); /* stale first: a second close is refused */
  ps_ep_close(&l->ep); /* a no-op once connect took the endpoint over */
  free(l);
  return ncclSuccess;
}

ncclResult_t ps_rma_connect(void *handles[], int nranks, int rank, void *listen_comm,
                            void **coll_comm) {
  rma_listen_t *l = listen_of(listen_comm, "one-sided connect");
  if (!l) return ncclInvalidArgument;
  ps_ep_t *lep = &l->ep;
  if (!lep->ep) {
    PS_WARN("one-sided connect: listenComm %p was already connected (one connect per listen)",
            listen_comm);
    return ncclInvalidArgument;
  }
  if (!handles || !coll_comm || nranks < 1 || rank < 0 || rank >= nranks) {
    PS_WARN("one-sided connect: bad arguments (rank %d of %d)", rank, nranks);
    return ncclInvalidArgument;
  }
  *coll_comm = NULL;
  /* What the caller or the environment got wrong (handles, PERSEUS_ORDERING,
   * PERSEUS_STAGING) is refused before the listen endpoint is taken over, so
   * that a corrected call can still use it. */
  ps_ordering_t ordering;
  int gpu_direct;
  const char *staged_why;
  PS_CHECK(ps_order_choose(lep->dev, &ordering));
  PS_CHECK(choose_staging(lep->dev, &gpu_direct, &staged_why));
  for (int p = 0; p < nranks; p++) {
    ps_handle_t h;
    if (ps_handle_decode(handles[p], NCCL_NET_HANDLE_MAXSIZE, ps_fabric_wire_hash(), &h) != ncclSuccess) {
      PS_WARN("one-sided connect: rank %d's handle is not a perseus handle of this provider", p);
      return ncclInvalidArgument;
    }
  }
  /* aligned: its sections a cache line apart (ps_rma_int.h) */
  size_t bytes = (sizeof(ps_rma_comm_t) + PS_CACHE_LINE - 1) / PS_CACHE_LINE * PS_CACHE_LINE;
  ps_rma_comm_t *c = aligned_alloc(PS_CACHE_LINE, bytes);
  if (!c) return ncclSystemError;
  memset(c, 0, bytes);
  pthread_rwlock_init(&c->win_lock, NULL);
  pthread_mutex_init(&c->reqs_lock, NULL);
  c->rank = rank, c->nranks = nranks;
  c->ep = *lep;            /* the endpoint listen opened becomes the comm's */
  memset(lep, 0, sizeof *lep);
  c->addr = calloc((size_t)nranks, sizeof *c->addr);
  c->peers = calloc((size_t)nranks, sizeof *c->peers);
  for (int p = 0; c->peers && p < nranks; p++) ps_rma_held_init(&c->peers[p]);
  c->timeout_ns = (uint64_t)ps_fabric_config()->peer_timeout_ms * 1000000ULL;
  c->pass_interval_ns = (uint64_t)ps_fabric_config()->progress_interval_us * 1000;
  if (ps_fabric_config()->stats) {
    c->opstats = calloc((size_t)nranks, sizeof *c->opstats);
    c->calls = calloc(1, sizeof *c->calls);
  }
  ncclResult_t rc = (c->addr && c->peers && (c->opstats || !ps_fabric_config()->stats) &&
                     (c->calls || !ps_fabric_config()->stats))
                        ? ncclSuccess : ncclSystemError;
  c->ordering = ordering;
  c->gpu_direct = gpu_direct, c->staged_why = staged_why;
  if (rc == ncclSuccess) c->sig_atomic = ps_order_sig_atomic(c->ep.dev, c->ordering);
  if (rc == ncclSuccess) rc = ps_rma_model_open(c);
  int64_t inflight = ps_fabric_config()->rma_inflight; /* -1: unset, the provider's default */
  c->max_posted = inflight >= 0 ? (uint64_t)inflight : c->ep.dev->rma_inflight;
  for (int p = 0; rc == ncclSuccess && p < nranks; p++) {
    ps_handle_t h;
    rc = ps_handle_decode(handles[p], NCCL_NET_HANDLE_MAXSIZE, ps_fabric_wire_hash(), &h);
    if (rc == ncclSuccess) rc = ps_ep_insert(&c->ep, h.addr, &c->addr[p]);
    ps_rma_peer_t *pp = &c->peers[p];
    pp->ops = c->opstats ? &c->opstats[p] : NULL;
    pp->next_seq = pp->posted_below = pp->done.below = pp->arrived.below = 1;
    pp->stage_sent = pp->stage_freed = 1;
    pp->stage_in.below = pp->stage_done.below = pp->credit_sent = 1;
  }
  if (rc == ncclSuccess && c->ordering == PS_ORD_FENCE) {
    c->lanes = calloc((size_t)nranks, sizeof *c->lanes);
    rc = c->lanes ? ncclSuccess : ncclSystemError;
    for (int p = 0; rc == ncclSuccess && p < nranks; p++) rc = ps_ep_open_lane(&c->ep, &c->lanes[p]);
  }
  if (rc == ncclSuccess) rc = ps_rma_post_sig_slots(c);
  if (rc == ncclSuccess) rc = live_add(c);
  if (rc == ncclSuccess && want_thread()) rc = ps_rma_thread_start(c); /* last: no undo */
  if (rc != ncclSuccess) {
    close_comm(c, 0); /* never handed out: nothing to report */
    return rc;
  }
  char bound[24] = "no bound";
  if (c->max_posted) snprintf(bound, sizeof bound, "%llu", (unsigned long long)c->max_posted);
  PS_INFO(NCCL_INIT | NCCL_NET, "one-sided comm: rank %d of %d on %s, ordering %s, posted operations per peer: %s, "
          "engine thread %s, GPU windows %s; %s", rank, nranks, c->ep.dev->name,
          ps_ordering_names[c->ordering], bound, c->threaded ? "on" : "off",
          c->gpu_direct ? "to the provider, which lists FI_HMEM (the first one checks it)"
                        : "staged through host memory", ps_rma_sender_note(c));
  *coll_comm = c;
  return ncclSuccess;
}

/* gin_abi.c made its handle stale first: nothing reaches c once this starts. */
ncclResult_t ps_rma_close_coll(void *coll) {
  ps_rma_comm_t *c = coll;
  if (!c) return ncclInvalidArgument;
  close_comm(c, 1);
  return ncclSuccess;
}

/* PERSEUS_PROGRESS_THREAD: auto runs an engine thread where there are CPUs
 * to spare for it (it spins while work is outstanding), at least 8. */
static int want_thread(void) {
  int v = ps_fabric_config()->progress_thread;
  return v == 2 ? sysconf(_SC_NPROCESSORS_ONLN) >= 8 : v;
}

/* A staged put is reported once its bytes left the source, before its write
 * completes: NCCL may close right after the last report, and the writes and
 * signals it was told are done must still go out. Passes until they
 * completed, the comm failed (a dead peer fails it after
 * PERSEUS_PEER_TIMEOUT_MS) or that timeout passed. While none completes,
 * the peers still waited for are probed every PS_CLOSE_PROBE_NS: a peer
 * that is gone (its process exited) is found then, where its staging slots
 * would otherwise be waited for until the timeout. */
#define PS_CLOSE_PROBE_NS 100000000ULL

static void finish_reported(ps_rma_comm_t *c) {
  uint64_t now = ps_now_ns(), end = now + c->timeout_ns, probe_at = now + PS_CLOSE_PROBE_NS;
  uint64_t left = c->early_open;
  while (c->early_open && !c->error && now < end) {
    c->backlog = 1;
    ps_rma_progress_pass(c);
    sched_yield();
    now = ps_now_ns();
    if (c->early_open != left) left = c->early_open, probe_at = now + PS_CLOSE_PROBE_NS;
    else if (now >= probe_at) ps_rma_probe_waited_peers(c, now), probe_at = now + PS_CLOSE_PROBE_NS;
  }
  if (c->early_open && !c->error)
    PS_WARN("one-sided comm rank %d closes with %llu reported operations still in flight", c->rank,
            (unsigned long long)c->early_open);
  /* a probe still in flight completes into the endpoint, which close discards unread */
}

/* NCCL deregisters its windows before it closes a comm: those still
 * registered (an abort, or a caller that forgot them) are named as they
 * go. The staging receive slots are the comm's own. */
static void say_left_registered(const ps_rma_comm_t *c) {
  char ids[160] = "";
  size_t len = 0;
  uint32_t n = 0;
  for (uint32_t i = 0; i < c->nregions; i++) {
    const ps_rma_region_t *r = c->regions[i];
    if (!r || (c->stage && r == c->stage->rx)) continue;
    if (len < sizeof ids) len += (size_t)snprintf(ids + len, sizeof ids - len, " %u", r->id);
    n++;
  }
  if (n)
    PS_INFO(NCCL_NET, "one-sided comm rank %d closes with %u window%s still registered (id%s%s%s): "
            "deregistered now", c->rank, n, n == 1 ? "" : "s", n == 1 ? "" : "s", ids,
            len < sizeof ids ? "" : "...");
}

/* report: PERSEUS_STATS for a comm that connected */
static void close_comm(ps_rma_comm_t *c, int report) {
  ps_rma_thread_stop(c); /* first: nothing else runs passes over what is freed below */
  if (report) finish_reported(c);
  if (report && ps_fabric_config()->stats) print_stats(c);
  live_remove(c);
  ps_rma_streams_close(c); /* their writes read the send slots freed below */
  for (int p = 0; c->lanes && p < c->nranks; p++) /* lanes first: they use ep's CQ and AV */
    if (c->lanes[p]) fi_close(&c->lanes[p]->fid);
  free(c->lanes);
  ps_ep_close(&c->ep); /* first: nothing completes into freed memory */
  if (report) say_left_registered(c);
  for (uint32_t i = 0; i < c->nregions; i++)
    if (c->regions[i]) dereg_region(c, c->regions[i]);
  ps_stage_free(c); /* after the endpoint: nothing lands in its slots any more */
  for (int p = 0; c->peers && p < c->nranks; p++) {
    ps_rma_peer_t *pp = &c->peers[p];
    ps_seqwin_free(&pp->done), ps_seqwin_free(&pp->arrived);
    ps_seqwin_free(&pp->stage_in), ps_seqwin_free(&pp->stage_done);
    ps_rma_held_free(pp);
  }
  ps_rma_model_close(c);
  ps_rma_free_reqs(c);
  if (c->sig_slots_mr) fi_close(&c->sig_slots_mr->fid);
  if (c->nacks_mr) fi_close(&c->nacks_mr->fid);
  if (c->notes_mr) fi_close(&c->notes_mr->fid);
  for (int p = 0; c->notes && p < c->nranks; p++) free(c->notes[p].queue);
  free(c->nacks), free(c->notes);
  free(c->regions), free(c->addr), free(c->peers), free(c->opstats), free(c->calls);
  pthread_rwlock_destroy(&c->win_lock);
  pthread_mutex_destroy(&c->reqs_lock);
  free(c);
}

/* A region whose exchange failed: the caller is told the registration
 * failed and may free the memory at once, while a peer may hold its key (a
 * peer whose own exchange went through, or a hostile one) or have staged
 * writes into it copying. The key is revoked and the copies end before
 * returning; its id stays taken (ids are never reused) and names no region. */
static void drop_failed_region(ps_rma_comm_t *c, ps_rma_region_t *r) {
  if (r->gpu && c->stage) (void)ps_cuda_quiesce(c->stage->cu, PS_STAGE_QUIESCE_NS);
  PS_INFO(NCCL_INIT | NCCL_NET, "one-sided comm rank %d: window %u (%p, %zu B) deregistered: its "
          "registration exchange failed", c->rank, r->id, (void *)r->base, r->size);
  dereg_region(c, r);
}

/* Collective: registers this rank's part (host memory with the provider;
 * staged GPU memory needs no provider registration; `mr`, where not NULL,
 * is its registration made already, which the region takes over) and
 * allgathers it. */
static ncclResult_t reg_region(ps_rma_comm_t *c, void *data, size_t size, int staged,
                               int cuda_device, const ps_dmabuf_t *dmabuf, struct fid_mr *mr,
                               ps_rma_region_t **out) {
  ps_rma_region_t *r = NULL;
  size_t P = (size_t)c->nranks;
  if (c->nregions == c->cap_regions) {
    uint32_t cap = c->cap_regions ? 2 * c->cap_regions : 16;
    ps_rma_region_t **n = realloc(c->regions, cap * sizeof *n);
    if (n) c->regions = n, c->cap_regions = cap;
  }
  if (c->nregions == c->cap_regions || !(r = calloc(1, sizeof *r)) || !(r->raddr = calloc(P, 8)) ||
      !(r->rkey = calloc(P, 8)) || !(r->rsize = calloc(P, 8)) || !(r->rclosed = calloc(P, 1)) || ps_htab_reserve(&ps_rma_win_tab, 1, &r->slot) != ncclSuccess) {
    PS_WARN("regMrSym: out of memory or window handles");
    if (r) free(r->raddr), free(r->rkey), free(r->rsize), free(r->rclosed);
    free(r);
    if (mr) fi_close(&mr->fid);
    return ncclSystemError;
  }
  *r = (ps_rma_region_t){.id = c->nregions, .slot = r->slot, .comm = c, .base = data,
                         .size = size, .mr = mr, .raddr = r->raddr, .rkey = r->rkey,
                         .rsize = r->rsize, .rclosed = r->rclosed, .staged = staged,
                         .gpu = cuda_device >= 0};
  r->handle = ps_htab_bind(&ps_rma_win_tab, r->slot, r);
  if (!staged && !r->mr &&
      ps_ep_reg_dev(&c->ep, data, size ? size : 1, PS_RMA_WINDOW_ACCESS, cuda_device, dmabuf,
                    &r->mr) !=
          ncclSuccess) {
    dereg_region(c, r);
    return ncclSystemError;
  }
  r->desc = r->mr ? fi_mr_desc(r->mr) : NULL;
  c->regions[c->nregions++] = r;
  ncclResult_t rc = ps_rma_allgather_region(c, r);
  if (rc != ncclSuccess) {
    drop_failed_region(c, r);
    return rc;
  }
  *out = r;
  return ncclSuccess;
}

/* PERSEUS_STAGING: GPU windows go straight to the provider where it
 * registers CUDA memory (FI_HMEM), unless staging is asked for; never
 * staging on a provider that cannot is an error naming it. */
static ncclResult_t choose_staging(ps_device_t *dev, int *direct, const char **why) {
  *direct = ps_gpumem_direct(dev, why);
  if (!*direct && ps_fabric_config()->staging == PS_STAGING_NEVER) {
    PS_WARN("PERSEUS_STAGING=never is not possible on %s: %s; use auto or always", dev->name, *why);
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

/* Staging, set up by the first GPU window: the pools, then (collective, like
 * the window being registered) every rank's receive slots become a symmetric
 * region the origins write into. */
static ncclResult_t stage_setup(ps_rma_comm_t *c, const void *gpu_ptr, size_t size,
                               const ps_dmabuf_t *dmabuf, struct fid_mr **direct_mr) {
  PS_CHECK(ps_stage_init(c, gpu_ptr, size, dmabuf, direct_mr));
  ps_rma_region_t *rx;
  /* the slots' memory goes below on failure: first no peer may write it,
   * nor a signal name the region (a failed reg_region deregistered it) */
  ncclResult_t rc = reg_region(c, c->stage->rx_pool, c->stage->rx_bytes, 0, -1, NULL, NULL, &rx);
  if (rc == ncclSuccess) {
    rc = ps_stage_attach_rx(c, rx);
    if (rc != ncclSuccess) dereg_region(c, rx);
  }
  if (rc != ncclSuccess) ps_stage_free(c);
  /* collective too (every rank stages or none): the streams' addresses */
  if (rc == ncclSuccess && !c->gpu_direct) rc = ps_rma_streams_open(c);
  if (rc != ncclSuccess && *direct_mr) {
    fi_close(&(*direct_mr)->fid);
    *direct_mr = NULL;
  }
  return rc;
}

static ncclResult_t reg_sym_body(void *coll, void *data, size_t size, int type, uint64_t mr_flags,
                                 const ps_dmabuf_t *dmabuf, void **mh) {
  ps_rma_comm_t *c = coll;
  if (!c || !mh) return ncclInvalidArgument; /* gin_abi.c logged it */
  /* A failed comm closed its endpoint (a failed exchange does): nothing
   * collective can run on it any more. */
  ncclResult_t err = ps_rma_error(c);
  if (err) {
    PS_WARN("regMrSym: the comm failed earlier (error %d, logged then): no window can be "
            "registered on it; close it", err);
    return err;
  }
  PS_CHECK(ps_ep_check_buffer("regMrSym", data, size));
  /* FORCE_SO marks signal words: host ones take CPU atomics; staged GPU
   * ones are written in copy-stream order behind their data anyway. Either
   * way an 8-byte word must be 8-byte aligned (an offset checks only the
   * distance from the base): a split atomic is a bus lock on x86 and a fault
   * elsewhere. */
  if ((mr_flags & NCCL_NET_MR_FLAG_FORCE_SO) && (uintptr_t)data % 8) {
    PS_WARN("regMrSym: signal window %p (NCCL_NET_MR_FLAG_FORCE_SO) is not 8-byte aligned", data);
    return ncclInvalidArgument;
  }
  /* flags of a newer NCCL are hints perseus does not know: said once */
  uint64_t unknown = mr_flags & ~(uint64_t)(NCCL_NET_MR_FLAG_FORCE_SO | NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET);
  static int unknown_said;
  if (unknown && !__atomic_exchange_n(&unknown_said, 1, __ATOMIC_RELAXED))
    PS_INFO(NCCL_INIT | NCCL_NET, "regMrSym: mrFlags bits 0x%llx are not known to perseus; ignored",
            (unsigned long long)unknown);
  if (type != NCCL_PTR_HOST && type != NCCL_PTR_CUDA) {
    PS_WARN("regMrSym: pointer type %d is not supported (expected %d host or %d CUDA)", type,
            NCCL_PTR_HOST, NCCL_PTR_CUDA);
    return ncclInvalidArgument;
  }
  /* GPU windows need the staging set-up either way: a staged one for its
   * data, a direct one for the signals into it (the copy stream). */
  int gpu = type == NCCL_PTR_CUDA;
  /* A dma-buf is used where the window goes to a provider that takes one;
   * elsewhere (host memory, staging) the address is all that is needed. */
  if (dmabuf && !(gpu && ps_gpumem_dmabuf(c->ep.dev))) dmabuf = NULL;
  if (dmabuf && (dmabuf->fd < 0 || dmabuf->offset > (uintptr_t)data)) {
    PS_WARN("regMrSymDmaBuf: dma-buf fd %d at offset %llu does not describe %p (expected an open "
            "fd and an offset no larger than the address)", dmabuf->fd,
            (unsigned long long)dmabuf->offset, data);
    return ncclInvalidArgument;
  }
  struct fid_mr *mr = NULL; /* the first direct GPU window's, made while checking the provider */
  if (gpu && !c->stage) PS_CHECK(stage_setup(c, data, size, dmabuf, &mr)); /* settles c->gpu_direct */
  int staged = gpu && !c->gpu_direct;
  if (gpu && size && !ps_cuda_owns(c->stage->cu, data, size)) {
    PS_WARN("regMrSym: %p + %zu B is not device memory of the GPU this comm stages for (GPU %d)",
            data, size, ps_cuda_ordinal(c->stage->cu));
    if (mr) fi_close(&mr->fid);
    return ncclInvalidArgument;
  }
  ps_rma_region_t *r;
  PS_CHECK(reg_region(c, data, size, staged, gpu ? ps_cuda_ordinal(c->stage->cu) : -1,
                      staged ? NULL : dmabuf, mr, &r));
  *mh = r->handle;
  return ncclSuccess;
}

static void dereg_region(ps_rma_comm_t *c, ps_rma_region_t *r) {
  ps_htab_release(&ps_rma_win_tab, r->slot, 1); /* its handle is stale from here on */
  if (r->id < c->nregions && c->regions[r->id] == r) c->regions[r->id] = NULL;
  if (r->mr) fi_close(&r->mr->fid);
  free(r->raddr), free(r->rkey), free(r->rsize), free(r->rclosed);
  free(r);
}

static ncclResult_t dereg_sym_body(void *coll, void *mh) {
  ps_rma_comm_t *c = coll;
  ps_rma_region_t *r = ps_rma_window(c, mh);
  if (!r) {
    ps_rma_window_refused(c, "deregMrSym", "the", mh);
    return ncclInvalidArgument;
  }
  /* Operations still moving bytes through it would write freed memory or
   * be dropped unseen: the window stays until they completed (test() them
   * first). A failed comm completes nothing more, so then it goes. */
  uint32_t busy = ps_rma_region_busy(r);
  if (busy && !c->error) {
    PS_WARN("deregMrSym: window %u is named by %u operations not yet completed; it stays "
            "registered (deregister it once test() reported them done)", r->id, busy);
    return ncclInvalidUsage;
  }
  /* the GPU memory may be unmapped right after, failed comm or not */
  if (r->gpu && ps_stage_quiesce(c)) {
    PS_WARN("deregMrSym: window %u stays registered: copies into it may still be running; free "
            "its memory only once a later deregMrSym succeeds", r->id);
    return ncclUnhandledCudaError;
  }
  uint32_t id = r->id;
  dereg_region(c, r);
  if (!c->error) ps_rma_notice_closed(c, id);
  return ncclSuccess;
}

/* Registration changes the windows (and the staging set-up) that NCCL's
 * data calls read without the comm's lock when an engine thread runs:
 * both hold win_lock for writing. */
static ncclResult_t reg_sym_locked(void *coll, void *data, size_t size, int type,
                                   uint64_t mr_flags, const ps_dmabuf_t *dmabuf, void **mh) {
  ps_rma_comm_t *c = coll;
  pthread_rwlock_wrlock(&c->win_lock);
  ncclResult_t rc = reg_sym_body(coll, data, size, type, mr_flags, dmabuf, mh);
  pthread_rwlock_unlock(&c->win_lock);
  return rc;
}

static ncclResult_t dereg_sym_locked(void *coll, void *mh) {
  ps_rma_comm_t *c = coll;
  pthread_rwlock_wrlock(&c->win_lock);
  ncclResult_t rc = dereg_sym_body(coll, mh);
  pthread_rwlock_unlock(&c->win_lock);
  return rc;
}

ps_ordering_t ps_rma_ordering(void *coll) { return ((ps_rma_comm_t *)coll)->ordering; }

/* A duration in microseconds, short: one decimal below 10 us. */
static void fmt_us(char *out, size_t n, uint64_t ns) {
  snprintf(out, n, ns < 9950 ? "%.1f" : "%.0f", (double)ns / 1e3);
}

/* " queued 3/8/20/41 mean 4", or " copy -" when no operation took that step. */
static int print_interval(char *out, size_t n, const char *name, const ps_hist_t *h) {
  if (!h->n) return snprintf(out, n, " %s -", name);
  char v[5][24];
  fmt_us(v[0], sizeof v[0], ps_hist_pct(h, 50)), fmt_us(v[1], sizeof v[1], ps_hist_pct(h, 90));
  fmt_us(v[2], sizeof v[2], ps_hist_pct(h, 99)), fmt_us(v[3], sizeof v[3], h->max);
  fmt_us(v[4], sizeof v[4], h->sum / h->n);
  return snprintf(out, n, " %s %s/%s/%s/%s mean %s", name, v[0], v[1], v[2], v[3], v[4]);
}

/* The per-operation lines: where the time of the operations to peer p went
 * and why posting to it stopped. */
static void print_opstats(ps_rma_comm_t *c, int p) {
  static const char *const iv_name[PS_IV_N] = {"queued", "copy", "post call", "wire",
                                                "signal wait", "report lag", "total", "settled"};
  static const char *const held_name[PS_HELD_N] = {"provider", "inflight bound", "send slot",
                                                    "unfilled", "copy", "credit"};
  const ps_rma_opstats_t *o = &c->opstats[p];
  uint64_t held = 0;
  for (int i = 0; i < PS_HELD_N; i++) held += o->held[i];
  if (!o->iv[PS_IV_TOTAL].n && !held) return;
  char line[1024];
  int len = 0;
  for (int i = 0; i < PS_IV_N && len < (int)sizeof line; i++)
    len += print_interval(line + len, sizeof line - (size_t)len, iv_name[i], &o->iv[i]);
  fprintf(stderr, "perseus stats: rank %d -> %d times of %llu ops (us p50/p90/p99/max):%s\n",
          c->rank, p, (unsigned long long)o->iv[PS_IV_TOTAL].n, line);
  len = 0;
  for (int i = 0; i < PS_HELD_N && len < (int)sizeof line; i++)
    len += snprintf(line + len, sizeof line - (size_t)len, "%s %s %llu/%llu", i ? "," : "",
                    held_name[i], (unsigned long long)o->held[i],
                    (unsigned long long)o->held_passes[i]);
  fprintf(stderr, "perseus stats: rank %d -> %d held back (stops/passes):%s; depth at post p50 %llu "
          "max %llu\n", c->rank, p, line, (unsigned long long)ps_hist_small_pct(&o->depth, 50),
          (unsigned long long)o->depth.max);
}

/* The calls line: how NCCL's calls were spaced and what they cost inside
 * perseus while work was outstanding. */
static void print_calls(const ps_rma_comm_t *c) {
  const ps_rma_callstats_t *s = c->calls;
  static const char *const name[PS_CALL_N] = {"data", "test", "progress"};
  char line[512], gap[160];
  int len = 0;
  uint64_t inside = 0;
  for (int k = 0; k < PS_CALL_N; k++) {
    inside += s->ns[k];
    len += snprintf(line + len, sizeof line - (size_t)len, "%s %s %llu (%.2f us each)",
                    k ? "," : "", name[k], (unsigned long long)s->n[k],
                    s->n[k] ? (double)s->ns[k] / (double)s->n[k] / 1e3 : 0.0);
  }
  print_interval(gap, sizeof gap, "gap between data calls", &s->data_gap);
  char steps[200];
  double np = s->passes ? (double)s->passes : 1.0;
  snprintf(steps, sizeof steps, "%llu passes (us each: completions %.2f, target %.2f, posts %.2f, "
           "copies %.2f)", (unsigned long long)s->passes, (double)s->pass_ns[PS_PASS_CQ] / np / 1e3,
           (double)s->pass_ns[PS_PASS_TARGET] / np / 1e3, (double)s->pass_ns[PS_PASS_POST] / np / 1e3,
           (double)s->pass_ns[PS_PASS_COPIES] / np / 1e3);
  fprintf(stderr, "perseus stats: rank %d: NCCL's calls while work was outstanding (%.1f ms, %.0f%% "
          "of it inside perseus):%s; %llu progress calls came after a new data call; %s;%s "
          "(us p50/p90/p99/max)\n", c->rank, (double)s->busy_ns / 1e6,
          s->busy_ns ? 100.0 * (double)inside / (double)s->busy_ns : 0.0, line,
          (unsigned long long)s->progress_new, steps, gap);
}

/* PERSEUS_STATS=1: what each peer cost, when the comm closes. Written to
 * stderr, not the logger: the user asked for it whatever NCCL_DEBUG says. */
static void print_stats(ps_rma_comm_t *c) {
  int used = c->calls && c->calls->n[PS_CALL_DATA];
  for (int p = 0; p < c->nranks && !used; p++) used = c->peers[p].st.puts || c->peers[p].st.signals;
  if (!used) { /* NCCL opens more comms (contexts) than a program may use */
    fprintf(stderr, "perseus stats: rank %d: a comm closed without puts or signals\n", c->rank);
    return;
  }
  fprintf(stderr, "perseus stats: rank %d: %llu progress calls, %llu passes (%s)\n", c->rank,
          (unsigned long long)(c->progress_calls + c->own_waits), (unsigned long long)c->passes,
          c->threaded ? "made by the engine thread" : "PERSEUS_PROGRESS_INTERVAL_US apart at least");
  if (c->calls) print_calls(c);
  for (int p = 0; p < c->nranks; p++) {
    const ps_rma_peer_stats_t *s = &c->peers[p].st;
    if (p == c->rank && !s->puts && !s->signals) continue;
    char staged[112] = "";
    if (c->stage) /* chunks packed into staged writes: fewer writes than puts */
      snprintf(staged, sizeof staged, "; staged writes %llu of %llu chunks and %llu signals",
               (unsigned long long)c->peers[p].stage_sent - 1,
               (unsigned long long)c->peers[p].stage_chunks,
               (unsigned long long)c->peers[p].stage_sigs);
    fprintf(stderr,
            "perseus stats: rank %d -> %d (%s, %s): puts %llu signals %llu (%llu as atomics) fences "
            "posted %llu avoided %llu blocked %.3f ms max in flight %llu; from it: %llu writes in "
            "sequence%s\n",
            c->rank, p, c->ep.dev->name, ps_ordering_names[c->ordering],
            (unsigned long long)s->puts, (unsigned long long)s->signals,
            (unsigned long long)c->peers[p].atomic_sigs,
            (unsigned long long)s->fences_posted, (unsigned long long)s->fences_avoided,
            (double)s->blocked_ns / 1e6, (unsigned long long)s->inflight_max,
            (unsigned long long)c->peers[p].arrived.below - 1, staged);
    if (c->opstats) print_opstats(c, p);
  }
}

ncclResult_t ps_rma_reg_sym(void *coll, void *data, size_t size, int type, uint64_t mr_flags,
                            const ps_dmabuf_t *dmabuf, void **mh) {
  PS_RMA_LOCKED(coll, reg_sym_locked(coll, data, size, type, mr_flags, dmabuf, mh));
}
ncclResult_t ps_rma_dereg_sym(void *coll, void *mh) {
  PS_RMA_LOCKED(coll, dereg_sym_locked(coll, mh));
}
