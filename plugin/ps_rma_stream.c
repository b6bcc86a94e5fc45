/* One-sided engine: staging streams (PERSEUS_NSTREAMS).
 *
 * A staged write costs the engine's thread a socket write on tcp, and its
 * arrival at the target a socket read; with every operation's copies,
 * posts and completion reads on one thread, those calls bound how many
 * small puts a comm moves. Staging streams are extra endpoints of the same
 * domain, each connected to its twin on every rank and driven by a thread
 * of its own: the engine hands a staged write to the next stream's queue
 * and goes on; the stream's thread posts it and reads the stream's
 * completion queue, where both its own writes' completions and the staged
 * writes peers sent over its twin arrive. It queues what it read for the
 * engine, whose next pass runs the callbacks and takes the arrivals as if
 * its own endpoint had read them. The engine's state is touched by the
 * engine alone.
 *
 * Why this keeps every strategy's guarantee: staged writes on different
 * streams arrive in any order, and the target already takes them so: each
 * carries its staged sequence and receive slot, and a signal (riding in a
 * staged write or sent alone) says which staged writes it covers and is held
 * until every one of them is copied in (ps_rma_target.c). The one thing a
 * second endpoint breaks is ordered's riding signal, which relies on the
 * provider keeping the comm's plain writes ahead of it: the staged write it
 * rides in goes on the comm's endpoint (ps_order_rider_on_comm_ep). Plain writes,
 * signals, credits and refusals stay there too. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ps_log.h"
#include "ps_rma_int.h"
#include "ps_stripe.h"

#define PS_STREAM_RING 1024 /* staged writes queued, and events read, per stream */
/* Loops in a row that found nothing before the thread naps, and the nap:
 * a peer's first write after a quiet spell waits at most that long. */
#define PS_STREAM_IDLE 2000
#define PS_STREAM_NAP_NS 20000

typedef struct {
  ps_rma_sop_t *sop;
  struct iovec iov;
  struct fi_rma_iov rma;
  void *desc;
  uint32_t peer;
  uint64_t data, flags;
} stream_job_t;

/* What the thread read: a completion of op (with err), or (op NULL) a
 * peer's staged write that landed, its remote CQ data. */
typedef struct {
  ps_op_t *op;
  uint64_t data;
  size_t len;
  int err;
  int named;       /* a landed write: the provider named its writer, `writer` */
  fi_addr_t writer;
  char errstr[96];
} stream_event_t;

typedef struct {
  ps_rma_streams_t *owner;
  int index;
  ps_ep_t ep;
  int opened, started;
  pthread_t thread;
  fi_addr_t *addr; /* per rank, its twin */
  /* engine -> thread, one producer and one consumer each way */
  stream_job_t jobs[PS_STREAM_RING];
  uint64_t job_head, job_tail; /* atomic */
  stream_event_t ev[PS_STREAM_RING];
  uint64_t ev_head, ev_tail;   /* atomic */
  uint64_t posted, completed;  /* the thread's own writes */
} stream_t;

struct ps_rma_streams {
  int n, stop;      /* stop: atomic */
  unsigned next;    /* the stream the next write goes on */
  ps_first_error_t failed; /* a stream thread's, for the engine */
  stream_t *s;
};

/* The thread's side: an event for the engine. A full queue waits for the
 * engine's next pass (it drains every queue each pass); one that stays full
 * (a failed comm's engine drains nothing until close) waits in naps, not
 * on a core. */
static void push_event(stream_t *st, const stream_event_t *e) {
  uint64_t head = st->ev_head;
  for (unsigned spins = 0; head - __atomic_load_n(&st->ev_tail, __ATOMIC_ACQUIRE) == PS_STREAM_RING;
       spins++) {
    if (__atomic_load_n(&st->owner->stop, __ATOMIC_ACQUIRE)) return;
    if (spins < 1000) {
      sched_yield();
    } else {
      struct timespec nap = {0, 100000};
      nanosleep(&nap, NULL);
    }
  }
  st->ev[head % PS_STREAM_RING] = *e;
  __atomic_store_n(&st->ev_head, head + 1, __ATOMIC_RELEASE);
}

static void wire_done(ps_op_t *op, const struct fi_cq_tagged_entry *e, int err, const char *errstr) {
  ps_rma_sop_t *sop = (ps_rma_sop_t *)op;
  stream_t *st = sop->stream;
  stream_event_t ev = {.op = sop->target, .len = e ? e->len : 0, .err = err};
  if (err) snprintf(ev.errstr, sizeof ev.errstr, "%s", errstr ? errstr : "unknown error");
  st->completed++;
  push_event(st, &ev);
}

static void landed(void *owner, uint64_t data, int named, fi_addr_t writer) {
  push_event(owner, &(stream_event_t){.data = data, .named = named, .writer = writer});
}

/* Posts the queued writes in order until the provider refuses one. */
static int post_queued(stream_t *st) {
  int n = 0;
  uint64_t tail = st->job_tail;
  while (tail != __atomic_load_n(&st->job_head, __ATOMIC_ACQUIRE)) {
    stream_job_t *j = &st->jobs[tail % PS_STREAM_RING];
    j->sop->wire = (ps_op_t){.cb = wire_done, .owner = j->sop};
    j->sop->stream = st;
    struct fi_msg_rma m = {.msg_iov = &j->iov, .desc = &j->desc, .iov_count = 1,
                           .addr = st->addr[j->peer], .rma_iov = &j->rma, .rma_iov_count = 1,
                           .context = &j->sop->wire, .data = j->data};
    int posted = 0;
    if (ps_ep_writemsg(&st->ep, st->ep.ep, &m, j->flags, &posted) != ncclSuccess) {
      ps_first_error(&st->owner->failed, "staging stream %d: posting a staged write failed", st->index);
      wire_done(&j->sop->wire, NULL, -FI_EIO, "posting a staged write failed");
      posted = 1;
    }
    if (!posted) break; /* -FI_EAGAIN: after the completions below */
    __atomic_store_n(&st->job_tail, ++tail, __ATOMIC_RELEASE);
    st->posted++, n++;
  }
  return n;
}

static void *stream_main(void *arg) {
  stream_t *st = arg;
  ps_rma_streams_t *ss = st->owner;
  unsigned idle = 0;
  while (!__atomic_load_n(&ss->stop, __ATOMIC_ACQUIRE)) {
    int work = post_queued(st), handled = 0;
    if (ps_ep_progress(&st->ep, 64, &handled) != ncclSuccess) {
      ps_first_error(&ss->failed, "staging stream %d: %s", st->index, st->ep.fatal);
      break;
    }
    work += handled;
    idle = work || st->posted != st->completed ? 0 : idle + 1;
    if (idle > PS_STREAM_IDLE) {
      struct timespec nap = {0, PS_STREAM_NAP_NS};
      nanosleep(&nap, NULL);
    }
  }
  return NULL;
}

static void stream_close(stream_t *st) {
  if (st->started) pthread_join(st->thread, NULL);
  if (st->opened) ps_ep_close(&st->ep);
  st->started = st->opened = 0;
  free(st->addr);
  st->addr = NULL;
}

void ps_rma_streams_close(ps_rma_comm_t *c) {
  ps_rma_streams_t *ss = c->streams;
  if (!ss) return;
  __atomic_store_n(&ss->stop, 1, __ATOMIC_RELEASE);
  for (int i = 0; i < ss->n; i++) stream_close(&ss->s[i]);
  free(ss->s);
  free(ss);
  c->streams = NULL;
}

/* Opens `want` streams: their addresses go into *mine. Where that fails
 * (logged) the comm offers none, and staged writes take its endpoint. */
static void open_ours(ps_rma_comm_t *c, int want, ps_streams_msg_t *mine) {
  ps_rma_streams_t *ss = calloc(1, sizeof *ss);
  if (ss) ss->s = calloc((size_t)want, sizeof *ss->s);
  if (!ss || !ss->s) {
    free(ss);
    PS_WARN("one-sided comm: out of memory for %d staging streams; staged writes on the comm's "
            "endpoint", want);
    return;
  }
  c->streams = ss;
  for (; ss->n < want; ss->n++) {
    stream_t *st = &ss->s[ss->n];
    st->owner = ss, st->index = ss->n + 1;
    st->addr = calloc((size_t)c->nranks, sizeof *st->addr);
    st->opened = st->addr && ps_ep_open(c->ep.dev, (int)ps_fabric_config()->eagain_retries,
                                        &st->ep) == ncclSuccess;
    const char *why = !st->opened ? "an endpoint could not be opened"
                      : st->ep.addrlen > PS_STREAM_ADDR_MAX ? "its addresses are too long to send"
                                                            : NULL;
    if (why) {
      ss->n++; /* closed with the others */
      PS_INFO(NCCL_INIT | NCCL_NET, "staging streams on %s: %s; staged writes on the comm's endpoint",
              c->ep.dev->name, why);
      ps_rma_streams_close(c);
      return;
    }
    st->ep.remote_write = landed, st->ep.remote_owner = st;
    memcpy(mine->addr[ss->n], st->ep.addr, st->ep.addrlen);
    mine->addrlen = (uint8_t)st->ep.addrlen;
  }
  mine->nstreams = (uint8_t)ss->n;
}

ncclResult_t ps_rma_streams_open(ps_rma_comm_t *c) {
  int want = ps_stripe_wanted(c->ep.dev);
  ps_streams_msg_t mine = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION,
                           .rank = (uint32_t)c->rank, .chunk = (uint32_t)c->stage_chunk};
  ps_streams_msg_t *all = calloc((size_t)c->nranks, sizeof *all);
  if (!all) {
    ps_rma_fail(c, ncclSystemError, "staging streams: out of memory");
    return ncclSystemError;
  }
  if (want > 0) open_ours(c, want, &mine);
  /* every rank takes part, with none to offer too: the fewest offered wins */
  ncclResult_t rc = ps_rma_allgather_streams(c, &mine, all);
  for (int p = 0; p < c->nranks && rc == ncclSuccess; p++) {
    if (all[p].chunk == mine.chunk) continue;
    /* equal receive totals can hide it: the slots would be cut differently */
    rc = ncclInvalidUsage;
    ps_rma_fail(c, rc, "rank %d stages in chunks of %u B, this rank in chunks of %u B: "
                "PERSEUS_STAGING_BYTES and PERSEUS_STAGING_CHUNK must match on every rank",
                p, all[p].chunk, mine.chunk);
  }
  int n = rc == ncclSuccess ? mine.nstreams : 0;
  for (int p = 0; p < c->nranks && n; p++) {
    if (all[p].nstreams < n) n = all[p].nstreams;
    if (all[p].nstreams && all[p].addrlen != mine.addrlen) n = 0;
  }
  ps_rma_streams_t *ss = c->streams;
  if (!n) {
    if (rc == ncclSuccess && mine.nstreams)
      PS_INFO(NCCL_INIT | NCCL_NET, "one-sided comm: staged writes on the comm's endpoint (a rank "
              "offers no staging streams)");
    ps_rma_streams_close(c);
    free(all);
    return rc;
  }
  while (ss->n > n) stream_close(&ss->s[--ss->n]);
  for (int i = 0; i < n && rc == ncclSuccess; i++) {
    stream_t *st = &ss->s[i];
    for (int p = 0; p < c->nranks && rc == ncclSuccess; p++)
      rc = ps_ep_insert_len(&st->ep, all[p].addr[i], all[p].addrlen, &st->addr[p]);
    int e = rc == ncclSuccess ? pthread_create(&st->thread, NULL, stream_main, st) : 0;
    if (e) {
      PS_WARN("staging streams: could not start a thread: %s", strerror(e));
      rc = ncclSystemError;
    }
    st->started = rc == ncclSuccess;
    if (st->started) (void)pthread_setname_np(st->thread, "perseus-stream");
  }
  free(all);
  if (rc != ncclSuccess) {
    ps_rma_streams_close(c);
    ps_rma_fail(c, rc, "staging streams could not be connected");
    return rc;
  }
  PS_INFO(NCCL_INIT | NCCL_NET, "one-sided comm: staged writes over %d extra endpoint%s (PERSEUS_NSTREAMS%s; "
          "the fewest any rank offers)", n, n > 1 ? "s" : "",
          ps_stripe_unset_note());
  return ncclSuccess;
}

void ps_rma_stream_post(ps_rma_comm_t *c, uint32_t peer, const struct fi_msg_rma *m,
                        uint64_t flags, ps_rma_sop_t *sop, int *posted) {
  ps_rma_streams_t *ss = c->streams;
  *posted = 0;
  for (int tries = 0; tries < ss->n; tries++) {
    stream_t *st = &ss->s[ss->next++ % (unsigned)ss->n];
    uint64_t head = st->job_head;
    if (head - __atomic_load_n(&st->job_tail, __ATOMIC_ACQUIRE) == PS_STREAM_RING) continue;
    sop->target = m->context;
    st->jobs[head % PS_STREAM_RING] =
        (stream_job_t){.sop = sop, .iov = m->msg_iov[0], .rma = m->rma_iov[0], .desc = m->desc[0],
                       .peer = peer, .data = m->data, .flags = flags};
    __atomic_store_n(&st->job_head, head + 1, __ATOMIC_RELEASE);
    *posted = 1;
    return;
  }
}

int ps_rma_streams_poll(ps_rma_comm_t *c) {
  ps_rma_streams_t *ss = c->streams;
  int n = 0;
  for (int i = 0; i < ss->n && !c->error; i++) {
    stream_t *st = &ss->s[i];
    uint64_t tail = st->ev_tail, head = __atomic_load_n(&st->ev_head, __ATOMIC_ACQUIRE);
    for (; tail != head && !c->error; tail++, n++) {
      stream_event_t *e = &st->ev[tail % PS_STREAM_RING];
      if (!e->op) { /* its writer checked here, against the stream's addresses */
        if (ps_rma_writer_ok(c, e->data, st->addr, e->named, e->writer))
          c->ep.remote_write(c->ep.remote_owner, e->data, 0, FI_ADDR_NOTAVAIL);
      } else {
        struct fi_cq_tagged_entry ent = {.op_context = e->op, .len = e->len};
        e->op->cb(e->op, &ent, e->err, e->err ? e->errstr : NULL);
      }
      __atomic_store_n(&st->ev_tail, tail + 1, __ATOMIC_RELEASE);
    }
  }
  const char *failed = ps_first_error_get(&ss->failed);
  if (failed && !c->error) ps_rma_fail(c, ncclRemoteError, "%s", failed);
  return n;
}
