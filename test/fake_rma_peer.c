/* A fake one-sided rank (fake_rma_peer.h): raw libfabric, the engine's
 * wire format from ps_wire.h and its tags from ps_rma_int.h. One receive
 * stays posted for every control tag; the parts of collective exchanges it
 * takes are sent back as ours, anything else is read and dropped. */
#include "fake_rma_peer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#include "ps_rma_int.h"
#include "ps_wire.h"

#define FAKE_BUF 1024 /* the largest part it echoes (ps_streams_msg_t) fits */

struct fake_peer {
  struct fi_info *list, *info;
  struct fid_fabric *fabric;
  struct fid_domain *domain;
  struct fid_cq *cq;
  struct fid_av *av;
  struct fid_ep *ep;
  struct fid_mr *mr;
  void *desc;
  fi_addr_t real;
  uint32_t rank, claim; /* claim: the rank its echoed parts name */
  uint64_t win_addr, win_key; /* the real rank's part of the last window echoed */
  struct fi_context2 rx_ctx, tx_ctx, wr_ctx;
  int tx_busy, wr_busy;
  size_t reply_len; /* an echo waiting for the send buffer, or 0 */
  uint64_t reply_tag;
  char rx[FAKE_BUF], tx[FAKE_BUF], reply[FAKE_BUF]; /* rx and tx registered */
};

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

fake_peer_t *fake_open(void) {
  fake_peer_t *f = calloc(1, sizeof *f);
  struct fi_info *h = fi_allocinfo();
  const char *prov = getenv("PERSEUS_PROVIDER");
  if (!f || !h) {
    fprintf(stderr, "fake peer: out of memory\n");
    free(f), fi_freeinfo(h);
    return NULL;
  }
  /* what the engine asks its endpoints for (ps_fabric.c), so that both
   * ends of the provider's connections are alike */
  h->caps = FI_TAGGED | FI_MSG | FI_RMA;
  h->mode = FI_CONTEXT | FI_CONTEXT2;
  h->ep_attr->type = FI_EP_RDM;
  h->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  h->tx_attr->msg_order = h->rx_attr->msg_order = FI_ORDER_SAS;
  h->fabric_attr->prov_name = strdup(prov ? prov : "tcp;ofi_rxm");
  int rc = fi_getinfo(FI_VERSION(1, 14), NULL, NULL, 0, h, &f->list);
  fi_freeinfo(h);
  if (rc) {
    fprintf(stderr, "fake peer: fi_getinfo(%s): %s\n", prov ? prov : "tcp;ofi_rxm", fi_strerror(-rc));
    free(f);
    return NULL;
  }
  return f;
}

void fake_close(fake_peer_t *f) {
  if (!f) return;
  if (f->ep) fi_close(&f->ep->fid);
  if (f->mr) fi_close(&f->mr->fid);
  if (f->av) fi_close(&f->av->fid);
  if (f->cq) fi_close(&f->cq->fid);
  if (f->domain) fi_close(&f->domain->fid);
  if (f->fabric) fi_close(&f->fabric->fid);
  fi_freeinfo(f->list);
  free(f);
}

/* The entry on PERSEUS_IFACE's domain whose addresses are of the real
 * rank's family (a socket provider lists IPv4 and IPv6 alike). */
static struct fi_info *pick(fake_peer_t *f, const ps_handle_t *real) {
  const char *iface = getenv("PERSEUS_IFACE");
  for (struct fi_info *fi = f->list; fi; fi = fi->next) {
    if (iface && strcmp(fi->domain_attr->name, iface)) continue;
    int sock = fi->addr_format == FI_SOCKADDR_IN || fi->addr_format == FI_SOCKADDR_IN6 ||
               fi->addr_format == FI_SOCKADDR;
    if (sock && (!fi->src_addr || fi->src_addrlen < sizeof(sa_family_t) ||
                 real->addrlen < sizeof(sa_family_t) ||
                 ((const struct sockaddr *)fi->src_addr)->sa_family !=
                     ((const struct sockaddr *)(const void *)real->addr)->sa_family))
      continue;
    return fi;
  }
  fprintf(stderr, "fake peer: no endpoint of the real rank's kind on domain %s\n", iface ? iface : "(any)");
  return NULL;
}

/* The one receive, for every control tag. -FI_EAGAIN: the provider wants
 * progress first, which a read of no entries makes. */
static int post_rx(fake_peer_t *f) {
  int rc;
  for (double end = now_s() + 10;;) {
    rc = (int)fi_trecv(f->ep, f->rx, sizeof f->rx, f->desc, FI_ADDR_UNSPEC, PS_TAG_CTRL,
                       ~PS_TAG_CTRL, &f->rx_ctx);
    if (rc != -FI_EAGAIN || now_s() > end) break;
    (void)fi_cq_read(f->cq, NULL, 0);
  }
  if (rc) fprintf(stderr, "fake peer: fi_trecv: %s\n", fi_strerror(-rc));
  return rc ? -1 : 0;
}

static int open_ep(fake_peer_t *f, struct fi_info *fi) {
  struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_NONE};
  struct fi_av_attr ava = {.type = fi->domain_attr->av_type == FI_AV_UNSPEC ? FI_AV_TABLE
                                                                          : fi->domain_attr->av_type};
  const char *step = "fi_fabric";
  int rc = fi_fabric(fi->fabric_attr, &f->fabric, NULL);
  if (!rc) step = "fi_domain", rc = fi_domain(f->fabric, fi, &f->domain, NULL);
  if (!rc) step = "fi_cq_open", rc = fi_cq_open(f->domain, &cqa, &f->cq, NULL);
  if (!rc) step = "fi_av_open", rc = fi_av_open(f->domain, &ava, &f->av, NULL);
  if (!rc) step = "fi_endpoint", rc = fi_endpoint(f->domain, fi, &f->ep, NULL);
  if (!rc) step = "fi_ep_bind", rc = fi_ep_bind(f->ep, &f->cq->fid, FI_TRANSMIT | FI_RECV);
  if (!rc) rc = fi_ep_bind(f->ep, &f->av->fid, 0);
  if (!rc) step = "fi_enable", rc = fi_enable(f->ep);
  if (!rc && (fi->domain_attr->mr_mode & FI_MR_LOCAL)) {
    /* rx and tx, adjacent: one registration */
    step = "fi_mr_reg";
    rc = fi_mr_reg(f->domain, f->rx, 2 * FAKE_BUF, FI_SEND | FI_RECV | FI_WRITE, 0, 0,
                   (fi->domain_attr->mr_mode & FI_MR_ENDPOINT) ? FI_MR_ENDPOINT : 0, &f->mr, NULL);
    if (!rc && (fi->domain_attr->mr_mode & FI_MR_ENDPOINT)) {
      rc = fi_mr_bind(f->mr, &f->ep->fid, 0);
      if (!rc) rc = fi_mr_enable(f->mr);
    }
    if (!rc) f->desc = fi_mr_desc(f->mr);
  }
  if (rc) fprintf(stderr, "fake peer: %s: %s\n", step, fi_strerror(-rc));
  return rc ? -1 : 0;
}

int fake_handle(fake_peer_t *f, uint32_t rank, const void *real, void *out) {
  ps_handle_t h, mine = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION};
  memcpy(&h, real, sizeof h);
  if (h.magic != PS_WIRE_MAGIC || !h.addrlen || h.addrlen > PS_HANDLE_ADDR_MAX) {
    fprintf(stderr, "fake peer: the real rank's handle is not a perseus handle\n");
    return -1;
  }
  f->rank = f->claim = rank;
  f->info = pick(f, &h);
  if (!f->info || open_ep(f, f->info)) return -1;
  size_t len = sizeof mine.addr;
  int rc = fi_getname(&f->ep->fid, mine.addr, &len);
  if (!rc && fi_av_insert(f->av, h.addr, 1, &f->real, 0, NULL) != 1) rc = -FI_EINVAL;
  if (rc) {
    fprintf(stderr, "fake peer: fi_getname/fi_av_insert: %s\n", fi_strerror(-rc));
    return -1;
  }
  mine.addrlen = (uint16_t)len, mine.wire_hash = h.wire_hash, mine.dev = h.dev;
  mine.listen_id = h.listen_id ^ 0x5a5a5a5a5a5a5a5aULL;
  memcpy(out, &mine, sizeof mine);
  return post_rx(f);
}

static int start_send(fake_peer_t *f, uint64_t tag, const void *msg, size_t len) {
  memcpy(f->tx, msg, len);
  for (double end = now_s() + 10;;) {
    int rc = (int)fi_tsend(f->ep, f->tx, len, f->desc, f->real, tag, &f->tx_ctx);
    if (!rc) return f->tx_busy = 1, 0;
    if (rc != -FI_EAGAIN || now_s() > end) {
      fprintf(stderr, "fake peer: fi_tsend: %s\n", fi_strerror(-rc));
      return -1;
    }
    (void)fi_cq_read(f->cq, NULL, 0);
  }
}

/* A part of the real rank's collective exchange, sent back as ours. Told
 * apart by size, not tag: tcp's completions leave the tag out. */
static void take_part(fake_peer_t *f, size_t len) {
  uint64_t tag;
  if (len == sizeof(ps_reg_msg_t)) {
    ps_reg_msg_t m;
    memcpy(&m, f->rx, sizeof m);
    f->win_addr = m.addr, f->win_key = m.key;
    m.rank = f->claim;
    memcpy(f->reply, &m, sizeof m);
    tag = PS_TAG_RMA_REG(m.region_id);
  } else if (len == sizeof(ps_streams_msg_t)) {
    ps_streams_msg_t m;
    memcpy(&m, f->rx, sizeof m);
    m.rank = f->claim, m.nstreams = 0, m.addrlen = 0;
    memset(m.addr, 0, sizeof m.addr);
    memcpy(f->reply, &m, sizeof m);
    tag = PS_TAG_RMA_STREAMS;
  } else {
    return; /* notices, credits, probes: read and dropped */
  }
  f->reply_tag = tag, f->reply_len = len;
}

/* Reads the completion queue: sends done, parts taken. */
static int progress(fake_peer_t *f) {
  struct fi_cq_tagged_entry e[8];
  ssize_t n = fi_cq_read(f->cq, e, 8);
  if (n == -FI_EAVAIL) {
    struct fi_cq_err_entry err = {0};
    (void)fi_cq_readerr(f->cq, &err, 0);
    fprintf(stderr, "fake peer: an operation failed: %s\n", fi_strerror(err.err));
    return -1;
  }
  for (ssize_t i = 0; i < n; i++) {
    if (e[i].op_context == &f->tx_ctx) {
      f->tx_busy = 0;
    } else if (e[i].op_context == &f->wr_ctx) {
      f->wr_busy = 0;
    } else if (e[i].op_context == &f->rx_ctx) {
      take_part(f, e[i].len);
      if (post_rx(f)) return -1;
    }
  }
  if (f->reply_len && !f->tx_busy) {
    size_t len = f->reply_len;
    f->reply_len = 0;
    return start_send(f, f->reply_tag, f->reply, len);
  }
  return 0;
}

int fake_send(fake_peer_t *f, uint64_t tag, const void *msg, size_t len) {
  if (len > FAKE_BUF) return -1;
  double end = now_s() + 10;
  while (f->tx_busy || f->reply_len)
    if (progress(f) || now_s() > end) return -1;
  if (start_send(f, tag, msg, len)) return -1;
  while (f->tx_busy)
    if (progress(f) || now_s() > end) {
      fprintf(stderr, "fake peer: a send did not complete\n");
      return -1;
    }
  return 0;
}

int fake_serve(fake_peer_t *f, const int *stop, double timeout_s) {
  for (double end = now_s() + timeout_s; !__atomic_load_n(stop, __ATOMIC_ACQUIRE);) {
    if (progress(f)) return -1;
    if (now_s() > end) {
      fprintf(stderr, "fake peer: the real rank did not finish its exchange in %.0f s\n", timeout_s);
      return -1;
    }
  }
  return 0;
}

void fake_claim(fake_peer_t *f, uint32_t rank) { f->claim = rank; }

int fake_write(fake_peer_t *f, uint64_t data) {
  double end = now_s() + 10;
  int rc;
  while (f->tx_busy || f->reply_len) /* the write's bytes come from the send buffer */
    if (progress(f) || now_s() > end) return -1;
  memset(f->tx, 0x5a, 8);
  struct iovec iov = {f->tx, 8};
  struct fi_rma_iov rma = {.addr = f->win_addr, .len = 8, .key = f->win_key};
  struct fi_msg_rma m = {.msg_iov = &iov, .desc = &f->desc, .iov_count = 1, .addr = f->real,
                         .rma_iov = &rma, .rma_iov_count = 1, .context = &f->wr_ctx, .data = data};
  while ((rc = (int)fi_writemsg(f->ep, &m, FI_REMOTE_CQ_DATA)) == -FI_EAGAIN && now_s() < end)
    if (progress(f)) return -1;
  if (rc) {
    fprintf(stderr, "fake peer: fi_writemsg: %s\n", fi_strerror(-rc));
    return -1;
  }
  for (f->wr_busy = 1; f->wr_busy;)
    if (progress(f) || now_s() > end) {
      fprintf(stderr, "fake peer: a write did not complete\n");
      return -1;
    }
  return 0;
}
