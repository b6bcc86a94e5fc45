/* fault_rank.c: the rank helpers of perseus_fault_test (see fault_rank.h). */
#include "fault_rank.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void fault_nap_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

int fault_reg(drv_rank_t *r, void *comm, void *buf, size_t n, void **mh) {
  return r->net.reg_mr(comm, buf, n ? n : 1, NCCL_PTR_HOST, mh) == ncclSuccess ? 0 : -1;
}

int fault_pipe_open(drv_rank_t *r, fault_pipe_t *p, void *comm, int is_send) {
  memset(p, 0, sizeof *p);
  p->comm = comm;
  p->is_send = is_send;
  p->base = malloc(DEPTH * MSG_BYTES);
  CHECK(p->base, "out of memory");
  for (int s = 0; s < DEPTH; s++) {
    p->buf[s] = p->base + (size_t)s * MSG_BYTES;
    if (is_send) drv_fill(p->buf[s], MSG_BYTES, (uint64_t)s);
  }
  CHECK(!fault_reg(r, comm, p->base, DEPTH * MSG_BYTES, &p->mh), "regMr");
  return 0;
}

void fault_pipe_close(drv_rank_t *r, fault_pipe_t *p) {
  if (p->mh) r->net.dereg_mr(p->comm, p->mh);
  free(p->base);
  memset(p, 0, sizeof *p);
}

ncclResult_t fault_pipe_post(drv_rank_t *r, fault_pipe_t *p) {
  for (;;) {
    int s = (int)(p->posted % DEPTH);
    if (p->req[s]) return ncclSuccess; /* the pipeline is full */
    ncclResult_t rc;
    if (p->is_send) {
      rc = r->net.isend(p->comm, p->buf[s], MSG_BYTES, STREAM_TAG, p->mh, &p->req[s]);
    } else {
      void *d = p->buf[s];
      size_t sz = MSG_BYTES;
      int tag = STREAM_TAG;
      rc = r->net.irecv(p->comm, 1, &d, &sz, &tag, &p->mh, &p->req[s]);
    }
    if (rc != ncclSuccess) return rc;
    if (!p->req[s]) return ncclSuccess; /* backpressure: later */
    p->slot_msg[s] = p->posted++;
  }
}

ncclResult_t fault_pipe_test(drv_rank_t *r, fault_pipe_t *p, int verify, int *bad) {
  for (int s = 0; s < DEPTH; s++) {
    if (!p->req[s]) continue;
    int done = 0, size = -1;
    ncclResult_t rc = r->net.test(p->req[s], &done, &size);
    if (rc != ncclSuccess) return rc;
    if (!done) continue;
    p->req[s] = NULL;
    p->completed++;
    if (!p->is_send && verify) {
      /* Same tag, ordered matching: message k was sent from slot k % DEPTH. */
      long k = p->slot_msg[s];
      if (size != (int)MSG_BYTES || drv_verify(p->buf[s], MSG_BYTES, (uint64_t)(k % DEPTH)) >= 0) {
        fprintf(stderr, "rank %d: message %ld: size %d or content wrong\n", r->rank, k, size);
        *bad = 1;
      }
    }
  }
  return ncclSuccess;
}

int fault_victim_stream(drv_rank_t *r, fault_shared_t *fs, void *comm, int is_send) {
  fault_pipe_t p;
  if (fault_pipe_open(r, &p, comm, is_send)) return 1;
  double end = drv_now() + VICTIM_LIFE_S;
  int bad = 0;
  while (drv_now() < end) {
    ncclResult_t rc = fault_pipe_post(r, &p);
    CHECK(rc == ncclSuccess, "victim: post failed (rc %d) before it was killed", rc);
    long before = p.completed;
    rc = fault_pipe_test(r, &p, 1, &bad);
    CHECK(rc == ncclSuccess, "victim: test failed (rc %d) before it was killed", rc);
    CHECK(!bad, "victim: corrupted message");
    if (!is_send && p.completed != before) atomic_store(&fs->progress, (int)p.completed);
  }
  fprintf(stderr, "rank %d: victim was never killed\n", r->rank);
  fault_pipe_close(r, &p);
  return 1;
}

int fault_kill_peer(drv_rank_t *r, int peer) {
  pid_t pid = 0;
  for (int i = 0; i < 1000 && (pid = drv_pid(r, peer)) <= 0; i++) fault_nap_us(1000);
  CHECK(pid > 0, "no pid for rank %d", peer);
  drv_mark_killable(r, peer);
  CHECK(kill(pid, SIGKILL) == 0, "kill(%d)", (int)pid);
  return 0;
}

int fault_stop_peer(drv_rank_t *r, int peer) {
  pid_t pid = 0;
  for (int i = 0; i < 1000 && (pid = drv_pid(r, peer)) <= 0; i++) fault_nap_us(1000);
  CHECK(pid > 0, "no pid for rank %d", peer);
  drv_mark_killable(r, peer); /* its end is a kill, after the scenario */
  CHECK(kill(pid, SIGSTOP) == 0, "kill(%d, SIGSTOP)", (int)pid);
  return 0;
}

int fault_survivor_detect(drv_rank_t *r, fault_shared_t *fs, fault_pipe_t *p, double t_kill) {
  int bad = 0, post_ok = 1;
  ncclResult_t post_rc = ncclSuccess;
  double post_err_t = 0;
  for (;;) {
    double now = drv_now();
    if (now - t_kill > GIVE_UP_S) {
      snprintf(fs->note, sizeof fs->note, "test() still succeeding %.0f s after the kill", GIVE_UP_S);
      fs->detect_s = -1;
      fprintf(stderr, "rank %d: %s (post error: rc %d)\n", r->rank, fs->note, post_rc);
      return 1;
    }
    if (post_ok) {
      post_rc = fault_pipe_post(r, p);
      if (post_rc != ncclSuccess) {
        post_ok = 0; /* stop posting; outstanding requests must report it */
        post_err_t = drv_now() - t_kill;
      }
    }
    int outstanding = 0;
    for (int s = 0; s < DEPTH; s++) outstanding += p->req[s] != NULL;
    CHECK(outstanding || post_ok, "%s failed (rc %d) %.2f s after the kill with no request left "
          "to test", p->is_send ? "isend" : "irecv", post_rc, post_err_t);
    ncclResult_t rc = fault_pipe_test(r, p, 0, &bad);
    if (rc != ncclSuccess) {
      fs->detect_s = drv_now() - t_kill;
      fs->detect_rc = rc;
      if (!post_ok)
        snprintf(fs->note, sizeof fs->note, "%s failed first (rc %d at %.3f s)",
                 p->is_send ? "isend" : "irecv", post_rc, post_err_t);
      break;
    }
  }
  CHECK(fs->detect_s <= DETECT_LIMIT_S, "dead peer detected after %.2f s (limit %.0f s)",
        fs->detect_s, DETECT_LIMIT_S);
  return 0;
}
