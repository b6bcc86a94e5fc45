#include "ps_ep.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_log.h"
#include "ps_model_nic.h"

/* NULL in the shipped plugin: a test plugin's ps_model_nic.c sets it at load. */
const ps_model_nic_t *ps_model_nic;

static int is_shm(const ps_ep_t *e) { return !strcmp(e->dev->info->fabric_attr->prov_name, "shm"); }

ncclResult_t ps_ep_open(ps_device_t *dev, int eagain_retries, ps_ep_t *e) {
  int rc;
  memset(e, 0, sizeof *e);
  e->dev = dev;
  e->eagain_retries = eagain_retries;
  e->src_msgs = dev->src_msgs, e->src_writes = dev->src_writes;
  struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_NONE};
  struct fi_av_attr ava = {.type = dev->info->domain_attr->av_type};
  if (ava.type == FI_AV_UNSPEC) ava.type = FI_AV_TABLE;
  const char *step = "fi_endpoint";
  if ((rc = fi_endpoint(dev->domain, dev->info, &e->ep, NULL))) goto fail;
  if (is_shm(e)) {
    /* shm names its segment "<pid>:<uid>:<n>": a process killed before it
     * closed leaves that file behind, and a later process given the same pid
     * then fails fi_enable (EBUSY). A random name cannot collide, and ours
     * name their owner, so init removes those of dead processes. */
    char name[64];
    ps_fabric_shm_name(name, sizeof name);
    step = "fi_setname";
    if ((rc = fi_setname(&e->ep->fid, name, strlen(name) + 1))) goto fail;
  }
  step = "fi_cq_open";
  if ((rc = fi_cq_open(dev->domain, &cqa, &e->cq, NULL))) goto fail;
  step = "fi_av_open";
  if ((rc = fi_av_open(dev->domain, &ava, &e->av, NULL))) goto fail;
  step = "fi_ep_bind(cq)";
  if ((rc = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV))) goto fail;
  step = "fi_ep_bind(av)";
  if ((rc = fi_ep_bind(e->ep, &e->av->fid, 0))) goto fail;
  step = "fi_enable";
  if ((rc = fi_enable(e->ep))) goto fail;
  e->addrlen = sizeof e->addr;
  step = "fi_getname";
  if ((rc = fi_getname(&e->ep->fid, e->addr, &e->addrlen))) goto fail;
  return ncclSuccess;
fail:
  PS_WARN("%s on %s failed: %s", step, dev->name, fi_strerror(-rc));
  ps_ep_close(e);
  return ncclSystemError;
}

void ps_ep_close(ps_ep_t *e) {
  /* The endpoint first: it discards every operation still posted. */
  if (e->ep) fi_close(&e->ep->fid);
  if (e->av) fi_close(&e->av->fid);
  if (e->cq) fi_close(&e->cq->fid);
  e->ep = NULL, e->av = NULL, e->cq = NULL;
}

/* An shm address is the peer endpoint's name, a C string that libfabric
 * 1.17 reads with strlen and inserts without checking that its segment
 * exists (a closed listener's handle crashed in the first send). So it must
 * be a printable name, NUL-terminated within its `len` bytes, without '/',
 * whose file is in /dev/shm; and, when it is one of ours, its process must
 * live (a SIGKILLed one's file stays, and shm completes sends into it). */
static ncclResult_t shm_addr_check(const ps_ep_t *e, const char *a, size_t len) {
  const char *nul = memchr(a, 0, len);
  size_t n = nul ? (size_t)(nul - a) : 0;
  int printable = n > 0;
  for (size_t i = 0; i < n; i++) printable &= a[i] > ' ' && a[i] < 0x7f && a[i] != '/';
  if (!printable) {
    PS_WARN("shm address rejected on %s: %s within its %zu bytes, not an endpoint name", e->dev->name,
            !nul ? "no NUL" : !n ? "empty" : "a byte that is not printable, or '/',", len);
    return ncclInvalidArgument;
  }
  const char *name = strstr(a, "://") ? strstr(a, "://") + 3 : a; /* libfabric drops a prefix */
  char path[PS_CTRL_ADDR_MAX + 16];
  struct stat st;
  pid_t pid;
  snprintf(path, sizeof path, "/dev/shm/%s", name);
  if (stat(path, &st)) {
    PS_WARN("shm address %s rejected on %s: no %s (%s): its endpoint was closed, or it is not an "
            "shm endpoint of this host", a, e->dev->name, path, strerror(errno));
    return ncclRemoteError;
  }
  if (ps_fabric_shm_owner(name, &pid) && kill(pid, 0) && errno == ESRCH) {
    PS_WARN("shm address %s rejected on %s: process %d, whose endpoint it is, is gone", a,
            e->dev->name, (int)pid);
    return ncclRemoteError;
  }
  return ncclSuccess;
}

int ps_ep_peer_gone(const ps_ep_t *e, const char *addr_str, int *pid) {
  pid_t p;
  if (!is_shm(e) || !ps_fabric_shm_owner(addr_str, &p) || !kill(p, 0) || errno != ESRCH) return 0;
  *pid = (int)p;
  return 1;
}

ncclResult_t ps_ep_insert(ps_ep_t *e, const void *addr, fi_addr_t *out) {
  return ps_ep_insert_len(e, addr, PS_HANDLE_ADDR_MAX, out);
}

ncclResult_t ps_ep_insert_len(ps_ep_t *e, const void *addr, size_t len, fi_addr_t *out) {
  if (is_shm(e)) PS_CHECK(shm_addr_check(e, addr, len));
  int rc = fi_av_insert(e->av, addr, 1, out, 0, NULL);
  if (rc != 1) {
    char s[128];
    ps_ep_addr_str(e, addr, s, sizeof s);
    PS_WARN("fi_av_insert(%s) on %s failed: %s", s, e->dev->name, fi_strerror(rc < 0 ? -rc : FI_EINVAL));
    return ncclSystemError;
  }
  return ncclSuccess;
}

void ps_ep_addr_str(ps_ep_t *e, const void *addr, char *out, size_t outlen) {
  size_t n = outlen;
  if (!fi_av_straddr(e->av, addr, out, &n)) snprintf(out, outlen, "?");
}

static void handle_error(ps_ep_t *e) {
  struct fi_cq_err_entry err = {0};
  int rc = fi_cq_readerr(e->cq, &err, 0);
  if (rc < 0) {
    snprintf(e->fatal, sizeof e->fatal, "fi_cq_readerr: %s", fi_strerror(-rc));
    return;
  }
  char buf[256];
  const char *prov = fi_cq_strerror(e->cq, err.prov_errno, err.err_data, buf, sizeof buf);
  char msg[384];
  if (err.err == FI_ETRUNC && err.olen)
    snprintf(msg, sizeof msg, "message larger than the posted receive by %zu bytes", err.olen);
  else if (err.err == FI_ETRUNC)
    snprintf(msg, sizeof msg, "message larger than the posted receive");
  else
    snprintf(msg, sizeof msg, "%s (provider: %s)", fi_strerror(err.err), prov ? prov : "-");
  ps_op_t *op = err.op_context;
  if (!op) {
    snprintf(e->fatal, sizeof e->fatal, "%s", msg);
    return;
  }
  op->cb(op, NULL, -(int)(err.err ? err.err : FI_EIO), msg);
}

ncclResult_t ps_ep_progress(ps_ep_t *e, int budget, int *handled) {
  struct fi_cq_tagged_entry ent[16];
  fi_addr_t src[16];
  int total = 0;
  if (handled) *handled = 0;
  if (!e->cq) {
    PS_WARN("progress on an endpoint that was closed");
    return ncclInternalError;
  }
  while (total < budget) {
    ssize_t n = e->src_msgs ? fi_cq_readfrom(e->cq, ent, 16, src) : fi_cq_read(e->cq, ent, 16);
    if (n == -FI_EAGAIN) break;
    if (n == -FI_EAVAIL) {
      handle_error(e);
      total++;
      continue;
    }
    if (n < 0) {
      snprintf(e->fatal, sizeof e->fatal, "fi_cq_read: %s", fi_strerror((int)-n));
      break;
    }
    for (ssize_t i = 0; i < n; i++) {
      /* A peer's write: op_context is not ours (shm puts the origin's
       * message id there), so dispatch on the flags, before the context. */
      if (ent[i].flags & FI_REMOTE_WRITE) {
        if ((ent[i].flags & FI_REMOTE_CQ_DATA) && e->remote_write)
          e->remote_write(e->remote_owner, ent[i].data, e->src_writes,
                          e->src_writes ? src[i] : FI_ADDR_NOTAVAIL);
        continue;
      }
      ps_op_t *op = ent[i].op_context;
      if (!op) continue;
      op->src_named = e->src_msgs; /* what a send's completion says is not read */
      op->src = e->src_msgs ? src[i] : FI_ADDR_NOTAVAIL;
      op->cb(op, &ent[i], 0, NULL);
    }
    total += (int)n;
  }
  if (handled) *handled = total;
  if (e->fatal[0]) {
    PS_WARN("endpoint on %s failed: %s", e->dev->name, e->fatal);
    return ncclRemoteError;
  }
  return ncclSuccess;
}

/* One retry loop for both directions: -FI_EAGAIN means "progress, then try again". */
#define PS_POST_RETRY(e, posted, what, call)                                            \
  do {                                                                                  \
    *(posted) = 0;                                                                      \
    for (int try_ = 0; try_ <= (e)->eagain_retries; try_++) {                           \
      ssize_t rc_ = (call);                                                             \
      if (rc_ == 0) return (*(posted) = 1), ncclSuccess;                                \
      if (rc_ != -FI_EAGAIN) {                                                          \
        PS_WARN("%s on %s failed: %s", what, (e)->dev->name, fi_strerror((int)-rc_));   \
        return ncclSystemError;                                                         \
      }                                                                                 \
      PS_CHECK(ps_ep_progress((e), 64, NULL));                                          \
    }                                                                                   \
    return ncclSuccess;                                                                 \
  } while (0)

ncclResult_t ps_ep_tsend(ps_ep_t *e, const void *buf, size_t len, void *desc, fi_addr_t dest,
                         uint64_t tag, ps_op_t *op, int *posted) {
  PS_POST_RETRY(e, posted, "fi_tsend", fi_tsend(e->ep, buf, len, desc, dest, tag, op));
}

ncclResult_t ps_ep_tsenddata(ps_ep_t *e, const void *buf, size_t len, void *desc, uint64_t data,
                             fi_addr_t dest, uint64_t tag, ps_op_t *op, int *posted) {
  PS_POST_RETRY(e, posted, "fi_tsenddata", fi_tsenddata(e->ep, buf, len, desc, data, dest, tag, op));
}

ncclResult_t ps_ep_trecv(ps_ep_t *e, void *buf, size_t len, void *desc, uint64_t tag, ps_op_t *op,
                         int *posted) {
  PS_POST_RETRY(e, posted, "fi_trecv", fi_trecv(e->ep, buf, len, desc, FI_ADDR_UNSPEC, tag, 0, op));
}

ncclResult_t ps_ep_writemsg(ps_ep_t *e, struct fid_ep *tx, const struct fi_msg_rma *msg,
                            uint64_t flags, int *posted) {
  PS_POST_RETRY(e, posted, "fi_writemsg", fi_writemsg(tx, msg, flags));
}

ncclResult_t ps_ep_readmsg(ps_ep_t *e, const struct fi_msg_rma *msg, uint64_t flags, int *posted) {
  PS_POST_RETRY(e, posted, "fi_readmsg", fi_readmsg(e->ep, msg, flags));
}

ncclResult_t ps_ep_atomicmsg(ps_ep_t *e, struct fid_ep *tx, const struct fi_msg_atomic *msg,
                             uint64_t flags, int *posted) {
  PS_POST_RETRY(e, posted, "fi_atomicmsg", fi_atomicmsg(tx, msg, flags));
}

ncclResult_t ps_ep_open_lane(ps_ep_t *e, struct fid_ep **lane) {
  int rc;
  const char *step = "fi_endpoint";
  *lane = NULL;
  if ((rc = fi_endpoint(e->dev->domain, e->dev->info, lane, NULL))) goto fail;
  step = "fi_ep_bind(cq)";
  if ((rc = fi_ep_bind(*lane, &e->cq->fid, FI_TRANSMIT | FI_RECV))) goto fail;
  step = "fi_ep_bind(av)";
  if ((rc = fi_ep_bind(*lane, &e->av->fid, 0))) goto fail;
  step = "fi_enable";
  if ((rc = fi_enable(*lane))) goto fail;
  return ncclSuccess;
fail:
  PS_WARN("lane endpoint: %s on %s failed: %s", step, e->dev->name, fi_strerror(-rc));
  if (*lane) fi_close(&(*lane)->fid);
  *lane = NULL;
  return ncclSystemError;
}

int ps_ep_try_reg(ps_ep_t *e, void *buf, size_t len, uint64_t access, int cuda_device,
                  const ps_dmabuf_t *dmabuf, struct fid_mr **mr) {
  return ps_dev_try_reg(e->dev, e->ep, buf, len, access, cuda_device, dmabuf, mr);
}

int ps_dev_try_reg(ps_device_t *d, struct fid_ep *ep, void *buf, size_t len, uint64_t access,
                   int cuda_device, const ps_dmabuf_t *dmabuf, struct fid_mr **mr) {
  *mr = NULL;
  pthread_mutex_lock(&d->lock);
  struct iovec iov = {buf, len};
  /* The dma-buf's first byte sits dmabuf->offset below buf (NCCL exports
   * the page-widened range around its buffer); the registration's virtual
   * addresses stay buf's. */
  ps_fi_mr_dmabuf_t db = {.fd = dmabuf ? dmabuf->fd : -1, .offset = dmabuf ? dmabuf->offset : 0,
                          .len = len, .base_addr = (char *)buf - (dmabuf ? dmabuf->offset : 0)};
  struct fi_mr_attr attr = {.mr_iov = dmabuf ? (const struct iovec *)(const void *)&db : &iov,
                            .iov_count = 1, .access = access,
                            .requested_key = d->mr_prov_key ? 0 : ps_fabric_next_key(),
                            .iface = cuda_device < 0 ? FI_HMEM_SYSTEM : FI_HMEM_CUDA};
  if (cuda_device >= 0) attr.device.cuda = cuda_device;
  int rc = fi_mr_regattr(d->domain, &attr, dmabuf ? PS_FI_MR_DMABUF : 0, mr);
  if (!rc && d->mr_endpoint && ep) {
    rc = fi_mr_bind(*mr, &ep->fid, 0);
    if (!rc) rc = fi_mr_enable(*mr);
  }
  pthread_mutex_unlock(&d->lock);
  if (rc && *mr) fi_close(&(*mr)->fid);
  if (rc) *mr = NULL;
  return rc;
}

ncclResult_t ps_ep_reg_dev(ps_ep_t *e, void *buf, size_t len, uint64_t access, int cuda_device,
                           const ps_dmabuf_t *dmabuf, struct fid_mr **mr) {
  int rc = ps_ep_try_reg(e, buf, len, access, cuda_device, dmabuf, mr);
  if (rc) {
    char by[64] = "";
    if (dmabuf)
      snprintf(by, sizeof by, ", by dma-buf fd %d at offset %llu", dmabuf->fd,
               (unsigned long long)dmabuf->offset);
    PS_WARN("fi_mr_regattr(%p, %zu%s%s) on %s failed: %s", buf, len,
            cuda_device < 0 ? "" : ", CUDA memory", by, e->dev->name, fi_strerror(-rc));
    return ncclSystemError;
  }
  return ncclSuccess;
}

ncclResult_t ps_ep_check_buffer(const char *fn, const void *buf, size_t len) {
  if (!buf && len) {
    PS_WARN("%s: NULL buffer of %zu bytes", fn, len);
    return ncclInvalidArgument;
  }
  if (len > UINTPTR_MAX - (uintptr_t)buf) {
    PS_WARN("%s: buffer %p of %zu bytes runs past the end of the address space", fn, buf, len);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t ps_ep_reg(ps_ep_t *e, void *buf, size_t len, uint64_t access, struct fid_mr **mr) {
  return ps_ep_reg_dev(e, buf, len, access, -1, NULL, mr);
}

ncclResult_t ps_ep_reg_local(ps_ep_t *e, void *buf, size_t len, struct fid_mr **mr) {
  *mr = NULL;
  if (!e->dev->mr_local && !e->dev->mr_endpoint) return ncclSuccess;
  return ps_ep_reg(e, buf, len, FI_SEND | FI_RECV, mr);
}
