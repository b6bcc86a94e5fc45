/* One-sided engine: the engine thread (PERSEUS_PROGRESS_THREAD).
 *
 * Without it, NCCL's proxy thread makes perseus' progress passes inside its
 * own calls, one after another with its rounds: a pass (completion read,
 * posts, copies handed to the driver) finds about one new operation, and
 * the proxy thread spends most of its time in them. With it, NCCL's data
 * calls only check their arguments and queue the request in the inbox;
 * test() reads a flag; progress returns at once. The engine thread makes
 * passes back to back, each taking whatever arrived during the last one,
 * so that one write, one copy batch and one completion read serve many
 * operations. Everything the engine does runs on this thread, under the
 * comm's lock, in NCCL's call order, as it would under NCCL's calls. */
#include <sched.h>
#include <string.h>
#include <time.h>

#include "ps_log.h"
#include "ps_rma_int.h"

/* Passes in a row that found nothing while nothing was outstanding before
 * the thread starts napping, and the nap: a peer's first write or NCCL's
 * next call after a quiet spell waits at most that long. */
#define PS_IDLE_PASSES 2000
#define PS_IDLE_NAP_NS 20000

/* Whether the comm waits for something a pass will see: a request NCCL has
 * not yet been told is done, an operation queued or in flight (a staged put
 * is reported before its write completes), a staged copy into the GPU or a
 * signal word behind one, a signal held for its data. A pass that finds
 * nothing new then is not idle: napping would delay each copy's or write's
 * completion by up to a nap. */
static int waiting(ps_rma_comm_t *c) {
  if (__atomic_load_n(&c->live_reqs, __ATOMIC_RELAXED)) return 1;
  if (c->stage && (c->stage->ncopies || c->stage->nwords)) return 1;
  for (int i = 0; i < c->nranks; i++) {
    const ps_rma_peer_t *p = &c->peers[i];
    if (p->nheld || ps_rma_peer_busy(p)) return 1;
  }
  return 0;
}

void ps_rma_inbox_push(ps_rma_comm_t *c, ps_rma_req_t *r) {
  r->next_in = __atomic_load_n(&c->inbox_top, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(&c->inbox_top, &r->next_in, r, 1, __ATOMIC_RELEASE,
                                      __ATOMIC_RELAXED))
    ;
}

static void *engine_main(void *arg) {
  ps_rma_comm_t *c = arg;
  unsigned idle = 0;
  while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
    ps_lock_take(&c->lock);
    int work = c->error ? 0 : ps_rma_engine_pass(c);
    int failed = c->error != ncclSuccess;
    if (!work && !failed) work = waiting(c);
    ps_lock_give(&c->lock);
    /* registration, close and the stats take the lock between passes */
    while (__atomic_load_n(&c->lock_waiters, __ATOMIC_ACQUIRE)) sched_yield();
    idle = work ? 0 : idle + 1;
    if (failed || idle > PS_IDLE_PASSES) {
      struct timespec nap = {0, failed ? 1000000 : PS_IDLE_NAP_NS};
      nanosleep(&nap, NULL);
    }
  }
  return NULL;
}

ncclResult_t ps_rma_thread_start(ps_rma_comm_t *c) {
  int rc = pthread_create(&c->thread, NULL, engine_main, c);
  if (rc) {
    PS_WARN("one-sided comm: could not start its engine thread (PERSEUS_PROGRESS_THREAD): %s",
            strerror(rc));
    return ncclSystemError;
  }
  /* named, so that top -H and profilers tell it from NCCL's threads */
  (void)pthread_setname_np(c->thread, "perseus-engine");
  c->threaded = 1; /* before the comm is handed out: every call sees it */
  return ncclSuccess;
}

void ps_rma_thread_stop(ps_rma_comm_t *c) {
  if (!c->threaded || __atomic_exchange_n(&c->stop, 1, __ATOMIC_ACQ_REL)) return;
  pthread_join(c->thread, NULL);
}
