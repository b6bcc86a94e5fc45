/* The model NICs of the test plugins (never the shipped one): plugin/
 * meson.build compiles this file into a test plugin with -DPS_MODEL_NIC=
 *   1  an "unordered NIC" (reorder plugins): holds each RMA write 0-2 ms and
 *      hands the held ones to the provider in random order, so a signal that
 *      does not really wait for its data overtakes it. Signal messages are
 *      not held. It keeps no order and has no fence, unless
 *      PERSEUS_TEST_NIC_CLAIMS_ORDER=1 makes it claim order (a lie), so
 *      `ordered` is accepted and the invariant test must catch it (plain
 *      writes are then held 10 ms longer than staged ones, so it does);
 *   2  a "distant NIC" (latency plugin): hands every write and signal message
 *      to the provider PERSEUS_TEST_LATENCY_US (default 50) after it was
 *      posted, in order: fabric latency on loopback, where a drain must wait
 *      it out once per batch and the NIC-ordered strategies pipeline past it;
 *   3  a probe-fault NIC (probefault plugin): a two-sided liveness probe
 *      queued behind our own sends fails as often in a row as a live peer's
 *      may (ps_comm.c tolerates PS_PROBE_TRIES - 1 failures in a row).
 * Held operations go to the provider through the endpoint layer. */
#include <stdlib.h>
#include <string.h>

#include "ps_clock.h"
#include "ps_env.h"
#include "ps_log.h"
#include "ps_model_nic.h"
#include "ps_rma.h"
#include "ps_wire.h"

#if !defined(PS_MODEL_NIC) || PS_MODEL_NIC < 1 || PS_MODEL_NIC > 3
#error "ps_model_nic.c is for test plugins: compile it with -DPS_MODEL_NIC=1 (unordered), 2 (distant) or 3 (probe fault)"
#endif

typedef struct {
  int is_send; /* a signal message (tagged send), else an RMA write */
  struct iovec iov;
  struct fi_rma_iov rma;
  void *desc, *context;
  fi_addr_t addr;
  uint64_t flags, data, tag;
  uint64_t release_ns;
} held_op_t;

struct ps_model {
  held_op_t *held; /* not handed to the provider yet */
  int nheld, cap_held, held_head;
  uint64_t rng;        /* unordered NIC */
  int lies;            /* unordered NIC: PERSEUS_TEST_NIC_CLAIMS_ORDER */
  uint64_t latency_ns; /* distant NIC: PERSEUS_TEST_LATENCY_US */
};

static ncclResult_t model_alloc(ps_model_t **out) {
  *out = calloc(1, sizeof **out);
  return *out ? ncclSuccess : ncclSystemError;
}

static void model_close(ps_model_t *m) {
  free(m->held);
  free(m);
}

/* Appends op to the held queue (grown as needed); *posted = 1. */
static ncclResult_t hold(ps_model_t *m, const held_op_t *op, int *posted) {
  *posted = 0;
  if (m->held_head > 0 && m->nheld == m->cap_held) { /* room at the front: close the gap */
    memmove(m->held, m->held + m->held_head, (size_t)(m->nheld - m->held_head) * sizeof *m->held);
    m->nheld -= m->held_head, m->held_head = 0;
  }
  if (m->nheld == m->cap_held) {
    int cap = m->cap_held ? 2 * m->cap_held : 256;
    held_op_t *n = realloc(m->held, (size_t)cap * sizeof *n);
    if (!n) return ncclSystemError;
    m->held = n, m->cap_held = cap;
  }
  m->held[m->nheld++] = *op;
  *posted = 1;
  return ncclSuccess;
}

/* Writes go on the main endpoint, never a lane: fence is refused on both
 * NICs that hold them. */
static ncclResult_t send_held(ps_ep_t *ep, const held_op_t *h, int *posted) {
  if (h->is_send)
    return ps_ep_tsend(ep, h->iov.iov_base, h->iov.iov_len, h->desc, h->addr, h->tag,
                       (ps_op_t *)h->context, posted);
  void *desc = h->desc;
  struct fi_msg_rma m = {.msg_iov = &h->iov, .desc = &desc, .iov_count = 1, .addr = h->addr,
                         .rma_iov = &h->rma, .rma_iov_count = 1, .context = h->context,
                         .data = h->data};
  return ps_ep_writemsg(ep, ep->ep, &m, h->flags, posted);
}

/* An RMA write as the model NIC holds it (release time set by the caller). */
static held_op_t held_write(const struct fi_msg_rma *m, uint64_t flags) {
  return (held_op_t){.iov = m->msg_iov[0], .rma = m->rma_iov[0], .desc = m->desc[0],
                     .context = m->context, .addr = m->addr, .flags = flags, .data = m->data};
}

/* --- 1: the unordered NIC --- */

static ncclResult_t unordered_open(int rank, ps_model_t **out) {
  PS_CHECK(model_alloc(out));
  (*out)->rng = 0x9e3779b97f4a7c15ULL ^ (uint64_t)rank;
  if (ps_env_bool("PERSEUS_TEST_NIC_CLAIMS_ORDER", 0, &(*out)->lies) != ncclSuccess) (*out)->lies = 0;
  return ncclSuccess;
}

static uint64_t next_rand(ps_model_t *m) {
  m->rng = m->rng * 6364136223846793005ULL + 1442695040888963407ULL;
  return m->rng >> 17;
}

/* It keeps no order and has no fence; claiming order is the lie the
 * invariant test must catch. A bad PERSEUS_TEST_NIC_CLAIMS_ORDER refuses
 * every strategy, so connect fails. */
static const char *unordered_missing_for(int s, const char *provider_lacks) {
  int claims = 0;
  if (ps_env_bool("PERSEUS_TEST_NIC_CLAIMS_ORDER", 0, &claims) != ncclSuccess)
    return "a valid PERSEUS_TEST_NIC_CLAIMS_ORDER";
  if (s == PS_ORD_ORDERED && claims) return NULL;
  if (s == PS_ORD_ORDERED || s == PS_ORD_FENCE) return "ordering (the test's unordered NIC has none)";
  return provider_lacks;
}

static ncclResult_t unordered_write(ps_model_t *m, const struct fi_msg_rma *msg, uint64_t flags,
                                    int *posted) {
  held_op_t op = held_write(msg, flags);
  op.release_ns = ps_now_ns() + next_rand(m) % 2000000;
  /* Claiming order, it lies for certain: a plain write falls 10 ms behind
   * the staged writes posted after it, so that a signal riding in one of
   * them (which ordered sends there trusting the claimed order) is applied
   * before the write lands, however late the target's copies run. */
  if (m->lies && !((flags & FI_REMOTE_CQ_DATA) && (msg->data & PS_STAGED_DATA)))
    op.release_ns += 10000000;
  return hold(m, &op, posted);
}

static ncclResult_t unordered_release(ps_model_t *m, ps_ep_t *ep, const char **what) {
  uint64_t now = ps_now_ns();
  *what = "held write";
  for (int tries = m->nheld; tries > 0 && m->nheld > 0; tries--) {
    int i = (int)(next_rand(m) % (uint64_t)m->nheld);
    held_op_t *h = &m->held[i];
    if (h->release_ns > now) continue;
    int posted = 0;
    PS_CHECK(send_held(ep, h, &posted));
    if (!posted) return ncclSuccess;
    m->held[i] = m->held[--m->nheld];
  }
  return ncclSuccess;
}

/* --- 2: the distant NIC --- */

static ncclResult_t distant_open(int rank, ps_model_t **out) {
  int64_t us = 0;
  (void)rank;
  PS_CHECK(ps_env_int("PERSEUS_TEST_LATENCY_US", 50, 0, 10000000, &us));
  PS_CHECK(model_alloc(out));
  (*out)->latency_ns = (uint64_t)us * 1000;
  return ncclSuccess;
}

/* It delays writes and messages, not atomics. */
static const char *distant_missing_for(int s, const char *provider_lacks) {
  if (s == PS_ORD_FENCE) return "fenced atomics (the test's distant NIC holds none)";
  return provider_lacks;
}

static ncclResult_t hold_for_latency(ps_model_t *m, held_op_t *op, int *posted) {
  op->release_ns = ps_now_ns() + m->latency_ns;
  return hold(m, op, posted);
}

static ncclResult_t distant_write(ps_model_t *m, const struct fi_msg_rma *msg, uint64_t flags,
                                  int *posted) {
  held_op_t op = held_write(msg, flags);
  return hold_for_latency(m, &op, posted);
}

static ncclResult_t distant_send(ps_model_t *m, void *buf, size_t len, void *desc, fi_addr_t dest,
                                 uint64_t tag, ps_op_t *op, int *posted) {
  held_op_t h = {.is_send = 1, .iov = {.iov_base = buf, .iov_len = len}, .desc = desc,
                 .context = op, .addr = dest, .tag = tag};
  return hold_for_latency(m, &h, posted);
}

static ncclResult_t distant_release(ps_model_t *m, ps_ep_t *ep, const char **what) {
  uint64_t now = ps_now_ns();
  *what = "held operation";
  while (m->held_head < m->nheld && m->held[m->held_head].release_ns <= now) {
    int posted = 0;
    PS_CHECK(send_held(ep, &m->held[m->held_head], &posted));
    if (!posted) return ncclSuccess; /* in order: nothing overtakes the refused one */
    m->held_head++;
  }
  if (m->held_head == m->nheld) m->held_head = m->nheld = 0;
  return ncclSuccess;
}

/* --- 3: the probe-fault NIC --- */

/* What sockets did: a probe behind our own sends fails, one try short of a
 * dead peer. */
static int probe_fault(int err, int behind, int failures, int tries, const char **errstr) {
  if (err || !behind || failures >= tries - 1) return err;
  *errstr = "Input/output error (injected by the probe-fault model NIC)";
  PS_WARN("test: liveness probe failure injected behind our own sends");
  return -FI_EIO;
}

static const ps_model_nic_t models[3] = {
    {.open = unordered_open, .close = model_close, .missing_for = unordered_missing_for,
     .write = unordered_write, .release = unordered_release},
    {.open = distant_open, .close = model_close, .missing_for = distant_missing_for,
     .write = distant_write, .send = distant_send, .release = distant_release},
    {.probe_done = probe_fault},
};

__attribute__((constructor)) static void install(void) { ps_model_nic = &models[PS_MODEL_NIC - 1]; }
