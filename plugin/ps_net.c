/* Data path of the two-sided plugin: memory registration, isend/irecv,
 * test, and the device properties NCCL plans with. */
#include "ps_net.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "ps_comm.h"
#include "ps_cuda.h"
#include "ps_fabric.h"
#include "ps_gpumem.h"
#include "ps_log.h"
#include "ps_stripe.h"
#include "ps_version.h"

/* NCCL holds memory handles by handle (ps_handle.h): a deregistered or
 * foreign one is refused without reading freed memory. */
static ps_htab_t mr_tab = PS_HTAB_INIT(0x4d, "memory handle", "deregistered");

typedef struct {
  uint32_t slot; /* in mr_tab */
  int type;
  char *base;
  size_t size;
  struct fid_mr *mr; /* NULL when the provider needs no registration */
  const ps_device_t *dev;  /* the domain it is registered in */
  const struct fid_ep *ep; /* the endpoint it is bound to (FI_MR_ENDPOINT), else NULL */
} ps_mr_t;

ncclResult_t ps_net_init(ncclDebugLogger_t log) {
  ps_log_set(log);
  static int announced;
  if (!__atomic_exchange_n(&announced, 1, __ATOMIC_RELAXED))
    PS_INFO(NCCL_INIT | NCCL_NET, "perseus %s (%s) initializing", PERSEUS_VERSION, PERSEUS_GIT_REV);
  return ps_fabric_init();
}

ncclResult_t ps_net_devices(int *ndev) {
  if (!ndev) {
    PS_WARN("devices: NULL count pointer");
    return ncclInvalidArgument;
  }
  *ndev = ps_fabric_ndev();
  return ncclSuccess;
}

/* The most one send or receive may carry (getProperties' maxP2pBytes). */
static size_t max_p2p_bytes(const ps_device_t *d) {
  size_t cap = d->max_msg_size ? d->max_msg_size : SIZE_MAX;
  return cap < (1UL << 30) ? cap : (1UL << 30);
}

ncclResult_t ps_net_get_properties(int dev, ps_props_t *p) {
  ps_device_t *d = ps_fabric_dev(dev);
  if (!d || !p) {
    PS_WARN("getProperties: device %d does not exist (this plugin has %d)", dev, ps_fabric_ndev());
    return ncclInvalidArgument;
  }
  const ps_config_t *cfg = ps_fabric_config();
  memset(p, 0, sizeof *p);
  p->name = d->name;
  p->pci_path = d->pci_path;
  p->guid = d->guid;
  p->ptr_support = NCCL_PTR_HOST | (ps_gpumem_registers_cuda(d) ? NCCL_PTR_CUDA : 0) |
                   (ps_gpumem_dmabuf(d) ? NCCL_PTR_DMABUF : 0);
  p->reg_is_global = !d->mr_endpoint;
  p->speed = d->speed_mbps;
  p->port = 0;
  p->latency = 0; /* unknown: NCCL then uses its own default */
  /* a send or recv comm is one endpoint; leave headroom for listeners */
  size_t eps = d->max_eps ? d->max_eps : 65536;
  p->max_comms = (int)(eps > INT_MAX ? INT_MAX : eps) / 2;
  p->max_recvs = (int)cfg->max_recvs;
  p->max_p2p_bytes = p->max_coll_bytes = max_p2p_bytes(d);
  return ncclSuccess;
}

/* A CUDA buffer registers by its dma-buf where NCCL exported one and the
 * provider takes them (ptrSupport DMABUF), by address otherwise. */
static ncclResult_t reg_mr(void *comm, void *data, size_t size, int type,
                           const ps_dmabuf_t *dmabuf, void **mh) {
  ps_comm_t *c = ps_comm_get(comm, PS_COMM_SEND | PS_COMM_RECV);
  const char *fn = dmabuf ? "regMrDmaBuf" : "regMr";
  if (!c || !mh) {
    if (c)
      PS_WARN("%s: NULL memory handle pointer", fn);
    else
      ps_comm_refused(fn, comm, PS_COMM_SEND | PS_COMM_RECV);
    return ncclInvalidArgument;
  }
  int cuda_ok = type == NCCL_PTR_CUDA && ps_gpumem_registers_cuda(c->ep.dev);
  int cuda = type == NCCL_PTR_CUDA && cuda_ok ? ps_cuda_ptr_ordinal(data) : -1;
  if (type != NCCL_PTR_HOST && !(type == NCCL_PTR_CUDA && cuda_ok)) {
    PS_WARN("%s: pointer type %d not supported on %s (ptrSupport %s)", fn, type, c->ep.dev->name,
            ps_gpumem_registers_cuda(c->ep.dev) ? "HOST|CUDA" : "HOST");
    return ncclInvalidArgument;
  }
  if (type == NCCL_PTR_CUDA && cuda < 0) {
    PS_WARN("%s: %p (%zu B) was registered as CUDA memory but is not device memory", fn, data, size);
    return ncclInvalidArgument;
  }
  PS_CHECK(ps_ep_check_buffer(fn, data, size));
  /* host memory, and GPU memory where the provider takes no dma-buf,
   * registers by address (the fd is not needed then) */
  if (dmabuf && !(cuda >= 0 && ps_gpumem_dmabuf(c->ep.dev))) dmabuf = NULL;
  if (dmabuf && (dmabuf->fd < 0 || dmabuf->offset > (uintptr_t)data)) {
    PS_WARN("%s: dma-buf fd %d at offset %llu does not describe %p (expected an open fd and an "
            "offset no larger than the address)", fn, dmabuf->fd,
            (unsigned long long)dmabuf->offset, data);
    return ncclInvalidArgument;
  }
  ps_mr_t *m = calloc(1, sizeof *m);
  if (!m) {
    PS_WARN("%s: out of memory", fn);
    return ncclSystemError;
  }
  *m = (ps_mr_t){.type = type, .base = data, .size = size, .dev = c->ep.dev,
                 .ep = c->ep.dev->mr_endpoint ? c->ep.ep : NULL};
  ncclResult_t rc = ps_htab_reserve(&mr_tab, 1, &m->slot);
  if (rc != ncclSuccess) {
    free(m);
    return rc;
  }
  /* CUDA buffers always carry a registration (FI_MR_HMEM), host ones where
   * the provider asks for it */
  rc = cuda >= 0 ? ps_ep_reg_dev(&c->ep, data, size, FI_SEND | FI_RECV, cuda, dmabuf, &m->mr)
                 : ps_ep_reg_local(&c->ep, data, size, &m->mr);
  if (rc != ncclSuccess) {
    ps_htab_release(&mr_tab, m->slot, 1);
    free(m);
    return rc;
  }
  *mh = ps_htab_bind(&mr_tab, m->slot, m);
  return ncclSuccess;
}

ncclResult_t ps_net_reg_mr(void *comm, void *data, size_t size, int type, void **mh) {
  return reg_mr(comm, data, size, type, NULL, mh);
}

ncclResult_t ps_net_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset,
                                  int fd, void **mh) {
  ps_dmabuf_t db = {.fd = fd, .offset = offset};
  return reg_mr(comm, data, size, type, &db, mh);
}

/* A handle works on the device it was registered on (regIsGlobal), and
 * where the provider binds registrations to an endpoint, on that comm only:
 * another's descriptor would reach the provider unchecked. Logs why not. */
static int mr_usable(const ps_mr_t *m, const ps_comm_t *c, const char *fn, const void *mh) {
  if (m->dev == c->ep.dev && (!m->ep || m->ep == c->ep.ep)) return 1;
  PS_WARN("%s: memory handle %p was registered %s%s, not for this comm on %s", fn, mh,
          m->dev != c->ep.dev ? "on " : "with another comm of ", m->dev->name, c->ep.dev->name);
  return 0;
}

/* The handle names what is freed; the comm only where it was used. A comm
 * already closed (or none) is logged, and the handle still deregistered, so
 * that a teardown in any order frees it; a live comm of another device or
 * endpoint is a caller's mix-up, refused. */
ncclResult_t ps_net_dereg_mr(void *comm, void *mh) {
  ps_mr_t *m = ps_htab_get(&mr_tab, mh);
  if (!m) {
    ps_htab_refused(&mr_tab, mh, "deregMr");
    return ncclInvalidArgument;
  }
  ps_comm_t *c = ps_comm_get(comm, PS_COMM_SEND | PS_COMM_RECV);
  if (!c) {
    PS_WARN("deregMr: %p is not a live perseus send or recv comm; memory handle %p is "
            "deregistered anyway", comm, mh);
  } else if (!mr_usable(m, c, "deregMr", mh)) {
    return ncclInvalidArgument;
  }
  ps_htab_release(&mr_tab, m->slot, 1);
  if (m->mr) fi_close(&m->mr->fid);
  free(m);
  return ncclSuccess;
}

/* A buffer of `size` bytes must lie inside the registration it names (NCCL
 * registers every buffer it sends from or receives into) and fit one
 * message (maxP2pBytes). */
static ncclResult_t mr_desc(const ps_comm_t *c, void *mh, const void *data, size_t size,
                            void **desc) {
  ps_mr_t *m = mh ? ps_htab_get(&mr_tab, mh) : NULL;
  *desc = NULL;
  if (size > max_p2p_bytes(c->ep.dev)) {
    PS_WARN("buffer %p of %zu B is over the %zu B one message may carry (maxP2pBytes)", data, size,
            max_p2p_bytes(c->ep.dev));
    return ncclInvalidArgument;
  }
  if (mh && !m) {
    ps_htab_refused(&mr_tab, mh, c->kind == PS_COMM_SEND ? "isend" : "irecv");
    return ncclInvalidArgument;
  }
  if (m && !mr_usable(m, c, c->kind == PS_COMM_SEND ? "isend" : "irecv", mh))
    return ncclInvalidArgument;
  if (!size) return ncclSuccess;
  if (!m || !data) {
    PS_WARN("buffer %p (%zu B) has no %s", data, size, m ? "address" : "memory handle from regMr");
    return ncclInvalidArgument;
  }
  const char *p = data;
  if (p < m->base || size > m->size || (size_t)(p - m->base) > m->size - size) {
    PS_WARN("buffer [%p, +%zu) outside its registration [%p, +%zu)", data, size, (void *)m->base,
            m->size);
    return ncclInvalidArgument;
  }
  *desc = m->mr ? fi_mr_desc(m->mr) : NULL;
  return ncclSuccess;
}

/* Part done: the sub-request completes with its last part. */
static void part_finished(ps_req_t *r, int i) {
  if (!__atomic_sub_fetch(&r->parts_left[i], 1, __ATOMIC_ACQ_REL))
    __atomic_add_fetch(&r->ncomplete, 1, __ATOMIC_RELEASE);
}

static void set_status(ps_req_t *r, ncclResult_t rc) {
  ncclResult_t none = ncclSuccess;
  __atomic_compare_exchange_n(&r->status, &none, rc, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* A part on an extra endpoint (its thread): nothing here touches the comm. */
static void part_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_req_t *r = op->owner;
  int i = op->idx / PS_MAX_STREAMS, part = op->idx % PS_MAX_STREAMS;
  if (!err && e && r->type == PS_REQ_RECV && e->len != r->part_len[i][part - 1]) {
    PS_WARN("part %d of a striped message from %s carried %zu bytes, %llu expected", part,
            r->comm->peer_str, e->len, (unsigned long long)r->part_len[i][part - 1]);
    err = -FI_EIO, errstr = "a part of a striped message had the wrong size";
  }
  if (err) {
    if (err == -FI_ECANCELED) return;
    PS_WARN("part %d of %s %d to/from %s failed: %s", part,
            r->type == PS_REQ_SEND ? "send" : "receive", i, r->comm->peer_str, errstr);
    set_status(r, err == -FI_ETRUNC ? ncclInvalidUsage : ncclRemoteError);
    return;
  }
  part_finished(r, i);
}

/* Posts parts 1.. of sub-request i (a message of n bytes, stripe number seq)
 * on the extra endpoints: the sender's parts, or the receiver's once part 0
 * said n and seq. */
static ncclResult_t post_parts(ps_req_t *r, int i, uint64_t n, uint32_t seq) {
  ps_comm_t *c = r->comm;
  int parts = ps_stripe_count(c->stripe) + 1;
  for (int p = 1; p < parts; p++) {
    uint64_t off, len;
    ps_stripe_part(n, parts, p, &off, &len);
    r->part_len[i][p - 1] = len;
    if (!len) continue;
    __atomic_add_fetch(&r->parts_left[i], 1, __ATOMIC_ACQ_REL);
    ps_op_t *op = &r->part_ops[i][p - 1];
    *op = (ps_op_t){.cb = part_done, .owner = r, .idx = i * PS_MAX_STREAMS + p};
    PS_CHECK(ps_stripe_post(c->stripe, p, r->type == PS_REQ_SEND, (char *)r->data[i] + off,
                            (size_t)len, r->desc[i], PS_TAG_STRIPE(seq, p), op));
  }
  return ncclSuccess;
}

/* A message on a striped comm's own endpoint arrived: its CQ data says
 * whether it is whole or the first part of a striped one (then the other
 * parts are posted). sockets (libfabric 1.17) delivers the data without
 * FI_REMOTE_CQ_DATA in the flags when the message came before its receive,
 * hence PS_STRIPE_VALID; a provider that lost the data fails the receive
 * rather than report a part as the message. A peer's numbers are untrusted. */
static ncclResult_t striped_arrival(ps_req_t *r, int i, const struct fi_cq_tagged_entry *e) {
  uint64_t d = e->data, n = d & ((1ULL << PS_STRIPE_SIZE_BITS) - 1), off, len0 = n;
  uint32_t seq = (uint32_t)(d >> PS_STRIPE_SIZE_BITS) & PS_STRIPE_SEQ_MASK;
  if (!(d & PS_STRIPE_VALID)) {
    PS_WARN("receive %d from %s: a message without its remote CQ data on a striped comm (flags "
            "0x%llx): the provider lost it", i, r->comm->peer_str, (unsigned long long)e->flags);
    return ncclSystemError;
  }
  if (d & PS_STRIPE_FIRST) ps_stripe_part(n, ps_stripe_count(r->comm->stripe) + 1, 0, &off, &len0);
  if (n > r->cap[i]) {
    PS_WARN("receive %d from %s: a message of %llu bytes, larger than the posted receive (%zu "
            "bytes)", i, r->comm->peer_str, (unsigned long long)n, r->cap[i]);
    return ncclInvalidUsage;
  }
  if (e->len != len0) {
    PS_WARN("receive %d from %s: %s of %llu bytes carried %zu, %llu expected", i,
            r->comm->peer_str, d & PS_STRIPE_FIRST ? "the first part of a message" : "a message",
            (unsigned long long)n, e->len, (unsigned long long)len0);
    return ncclRemoteError;
  }
  r->sizes[i] = n;
  return d & PS_STRIPE_FIRST ? post_parts(r, i, n, seq) : ncclSuccess;
}

static void req_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_req_t *r = op->owner;
  int i = op->idx;
  if (r->type == PS_REQ_SEND) r->comm->tx_finished++;
  if (!err && r->type == PS_REQ_RECV && r->comm->stripe) {
    ncclResult_t rc = striped_arrival(r, i, e);
    if (rc != ncclSuccess) {
      set_status(r, rc);
      err = -FI_EIO, errstr = "a message on a striped comm was refused";
    }
  } else if (!err) {
    r->sizes[i] = r->type == PS_REQ_RECV ? e->len : r->cap[i];
  }
  if (err) {
    if (err == -FI_ECANCELED) return;
    set_status(r, err == -FI_ETRUNC ? ncclInvalidUsage : ncclRemoteError);
    PS_WARN("%s %d of %d to/from %s failed: %s", r->type == PS_REQ_SEND ? "send" : "receive",
            i, r->n, r->comm->peer_str, errstr);
    if (!r->comm->failed) r->comm->failed = __atomic_load_n(&r->status, __ATOMIC_ACQUIRE);
    return;
  }
  part_finished(r, i);
}

static uint32_t req_slot(const ps_req_t *r) {
  return r->comm->req_slots + (uint32_t)(r - r->comm->reqs);
}

static ps_req_t *req_get(ps_comm_t *c, int type, int n) {
  if (c->nfree == 0) return NULL;
  ps_req_t *r = c->free_reqs[--c->nfree];
  memset(r, 0, sizeof *r);
  r->comm = c;
  r->handle = ps_htab_bind(&ps_req_tab, req_slot(r), r);
  r->type = type;
  r->n = n;
  for (int i = 0; i < n; i++) {
    r->ops[i] = (ps_op_t){.cb = req_done, .owner = r, .idx = i};
    r->parts_left[i] = 1;
  }
  return r;
}

/* The request's handle goes stale: a later test() of it is refused, even
 * once the slot serves a new request. */
static void req_put(ps_req_t *r) {
  ps_comm_t *c = r->comm;
  ps_htab_unbind(&ps_req_tab, req_slot(r));
  r->comm = NULL;
  c->free_reqs[c->nfree++] = r;
}

/* The comm of an isend/irecv, with *req cleared; NULL (logged) for a handle
 * that is not a live comm of that kind or a NULL request pointer. */
static ps_comm_t *data_call_comm(const char *call, void *h, int kind, void **req) {
  ps_comm_t *c = ps_comm_get(h, kind);
  if (!c) {
    ps_comm_refused(call, h, kind);
    return NULL;
  }
  if (!req) {
    PS_WARN("%s: NULL request pointer", call);
    return NULL;
  }
  *req = NULL;
  return c;
}

ncclResult_t ps_net_isend(void *send_comm, void *data, size_t size, int tag, void *mh, void **req) {
  ps_comm_t *c = data_call_comm("isend", send_comm, PS_COMM_SEND, req);
  if (!c) return ncclInvalidArgument;
  void *desc;
  PS_CHECK(mr_desc(c, mh, data, size, &desc));
  if (c->failed) return c->failed; /* completions are read by test(), not here */
  ps_req_t *r = req_get(c, PS_REQ_SEND, 1);
  if (!r) return ncclSuccess; /* pool exhausted: NCCL retries later */
  r->cap[0] = size, r->data[0] = data, r->desc[0] = desc;
  int posted = 0, parts = ps_stripe_count(c->stripe) + 1;
  int striped = parts > 1 && size >= (size_t)c->cfg->stripe_min;
  uint32_t seq = c->stripe_seq & PS_STRIPE_SEQ_MASK;
  ncclResult_t rc;
  if (parts == 1) {
    rc = ps_ep_tsend(&c->ep, data, size, desc, c->peer, (uint32_t)tag, &r->ops[0], &posted);
  } else { /* a striped comm: every message says its size (ps_wire.h) */
    uint64_t off, len = size, cq_data = PS_STRIPE_VALID | (uint64_t)size;
    if (striped) {
      ps_stripe_part(size, parts, 0, &off, &len);
      cq_data |= PS_STRIPE_FIRST | ((uint64_t)seq << PS_STRIPE_SIZE_BITS);
      /* the first part holds the sub-request open until the others are posted */
      __atomic_add_fetch(&r->parts_left[0], 1, __ATOMIC_ACQ_REL);
    }
    rc = ps_ep_tsenddata(&c->ep, data, (size_t)len, desc, cq_data, c->peer, (uint32_t)tag,
                         &r->ops[0], &posted);
  }
  if (rc != ncclSuccess || !posted) {
    req_put(r);
    return rc;
  }
  r->posted = 1;
  c->tx_posted++;
  if (striped) {
    c->stripe_seq++;
    rc = post_parts(r, 0, size, seq);
    part_finished(r, 0);
    if (rc != ncclSuccess) { /* part 0 is on its way: the comm cannot go on */
      set_status(r, rc);
      c->failed = rc;
    }
  }
  *req = r->handle;
  return ncclSuccess;
}

ncclResult_t ps_net_irecv(void *recv_comm, int n, void **data, const size_t *sizes, const int *tags,
                          void **mhs, void **req) {
  ps_comm_t *c = data_call_comm("irecv", recv_comm, PS_COMM_RECV, req);
  if (!c) return ncclInvalidArgument;
  if (n < 1 || n > c->cfg->max_recvs) {
    PS_WARN("irecv: %d grouped receives, this device takes 1..%lld", n,
            (long long)c->cfg->max_recvs);
    return ncclInvalidArgument;
  }
  if (!data || !sizes || !tags) {
    PS_WARN("irecv: NULL %s array", !data ? "data" : !sizes ? "sizes" : "tags");
    return ncclInvalidArgument;
  }
  PS_CHECK(ps_comm_flush_pending(c));
  if (c->pending) return ncclSuccess; /* an earlier receive still waiting to post: keep order */
  ps_req_t *r = req_get(c, PS_REQ_RECV, n);
  if (!r) return ncclSuccess;
  for (int i = 0; i < n; i++) {
    r->data[i] = data[i];
    r->cap[i] = sizes[i];
    r->tag[i] = (uint32_t)tags[i];
    ncclResult_t rc = mr_desc(c, mhs ? mhs[i] : NULL, data[i], sizes[i], &r->desc[i]);
    if (rc != ncclSuccess) {
      req_put(r);
      return rc;
    }
  }
  for (; r->posted < n; r->posted++) {
    int i = r->posted, ok = 0;
    ncclResult_t rc = ps_comm_post_recv(c, r, i, &ok);
    if (rc != ncclSuccess) {
      /* Sub-receives already posted would still write NCCL's buffers:
       * failing the comm closes its endpoints, which discards them, and
       * then the request can go back. */
      if (r->posted) rc = ps_comm_fail(c, rc, "irecv: a grouped receive could not be posted whole");
      req_put(r);
      return rc;
    }
    if (ok) continue;
    if (r->posted == 0) { /* nothing posted yet: plain backpressure */
      req_put(r);
      return ncclSuccess;
    }
    c->pending = r; /* the rest is posted later, in order */
    break;
  }
  *req = r->handle;
  return ncclSuccess;
}

ncclResult_t ps_net_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhs, void **req) {
  (void)n, (void)data, (void)sizes, (void)mhs;
  if (!req || !ps_comm_get(recv_comm, PS_COMM_RECV)) {
    if (req)
      ps_comm_refused("iflush", recv_comm, PS_COMM_RECV);
    else
      PS_WARN("iflush: NULL request pointer");
    return ncclInvalidArgument;
  }
  *req = NULL; /* host memory only: nothing to flush */
  return ncclSuccess;
}

ncclResult_t ps_net_test(void *request, int *done, int *sizes) {
  ps_req_t *r = ps_htab_lookup(&ps_req_tab, request, "test");
  if (!r) return ncclInvalidArgument;
  if (!done) {
    PS_WARN("test: NULL done pointer");
    return ncclInvalidArgument;
  }
  *done = 0;
  ps_comm_t *c = r->comm;
  ncclResult_t rc = ps_comm_progress(c);
  ncclResult_t st = __atomic_load_n(&r->status, __ATOMIC_ACQUIRE);
  if (st) { /* the comm goes with it, before the caller may free the buffers */
    ps_comm_fail(c, st, "a request failed");
    return st;
  }
  if (rc != ncclSuccess) return rc;
  if (__atomic_load_n(&r->ncomplete, __ATOMIC_ACQUIRE) < r->n) return ncclSuccess;
  if (sizes)
    for (int i = 0; i < r->n; i++) sizes[i] = r->sizes[i] > INT_MAX ? INT_MAX : (int)r->sizes[i];
  *done = 1;
  req_put(r);
  return ncclSuccess;
}

ncclResult_t ps_net_make_vdevice(int *d, int ndevs, const int *devs) {
  if (!d || !devs || ndevs < 1) {
    PS_WARN("makeVDevice: %s", !d ? "NULL device pointer" : !devs ? "NULL device list"
                                                               : "no devices to merge");
    return ncclInvalidArgument;
  }
  for (int i = 0; i < ndevs; i++)
    if (!ps_fabric_dev(devs[i])) {
      PS_WARN("makeVDevice: device %d does not exist (this plugin has %d)", devs[i], ps_fabric_ndev());
      return ncclInvalidArgument;
    }
  if (ndevs == 1) {
    *d = devs[0]; /* a virtual device of one NIC is that NIC */
    return ncclSuccess;
  }
  PS_WARN("makeVDevice: merging %d NICs into one virtual device is not supported by perseus yet; "
          "set NCCL_NET_MERGE_LEVEL=LOC to keep NICs separate", ndevs);
  return ncclInvalidUsage;
}
