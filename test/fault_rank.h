/* fault_rank.h: what the ranks of perseus_fault_test share (fault_rank.c):
 * the page the ranks and the parent see, a pipeline of large messages on one
 * comm, and the victim / survivor halves of a kill scenario. The scenarios
 * themselves are in fault_test.c. */
#ifndef PS_FAULT_RANK_H
#define PS_FAULT_RANK_H

#include <stdatomic.h>

#include "ps_driver.h"

#define MSG_BYTES ((size_t)8 << 20) /* one streamed message */
#define DEPTH 4                      /* messages in flight per direction */
#define DETECT_LIMIT_S 10.0          /* a dead peer must show within this */
#define GIVE_UP_S 15.0               /* stop waiting for an error after this */
#define VICTIM_LIFE_S 25.0           /* a victim never killed gives up after this */
#define STREAM_TAG 11

/* A MAP_SHARED page made before the ranks fork: seen by them and the parent. */
typedef struct {
  atomic_int progress;   /* messages the victim received (kill_send) */
  double detect_s;       /* kill -> first failing test() */
  int detect_rc;         /* what test() returned */
  int after_msgs;        /* messages the survivor completed before the kill */
  char note[160];
} fault_shared_t;

/* A pipeline of DEPTH large buffers on one comm. */
typedef struct {
  void *comm;
  int is_send;
  char *buf[DEPTH];
  void *mh;
  char *base;
  void *req[DEPTH];
  long posted, completed;
  long slot_msg[DEPTH];
} fault_pipe_t;

void fault_nap_us(long us);
/* NCCL registers every buffer before it transfers from/to it. */
int fault_reg(drv_rank_t *r, void *comm, void *buf, size_t n, void **mh);
int fault_pipe_open(drv_rank_t *r, fault_pipe_t *p, void *comm, int is_send);
void fault_pipe_close(drv_rank_t *r, fault_pipe_t *p);
/* Posts message after message, each into slot k % DEPTH, while that slot is
 * free. Returns the first error of isend/irecv. */
ncclResult_t fault_pipe_post(drv_rank_t *r, fault_pipe_t *p);
/* Tests every outstanding request once. *bad: a completed receive whose
 * bytes are wrong. Returns the first error test() reported. */
ncclResult_t fault_pipe_test(drv_rank_t *r, fault_pipe_t *p, int verify, int *bad);
/* The victim streams (or drains) until it is killed. Returning at all is a
 * failure: the survivor never killed it. */
int fault_victim_stream(drv_rank_t *r, fault_shared_t *fs, void *comm, int is_send);
/* SIGKILL to rank `peer`, which the driver then expects to die. */
int fault_kill_peer(drv_rank_t *r, int peer);
/* Stops rank `peer` (SIGSTOP) and marks it killable: 0, or 1 with the reason. */
int fault_stop_peer(drv_rank_t *r, int peer);
/* The survivor keeps posting and testing after the kill until test() fails. */
int fault_survivor_detect(drv_rank_t *r, fault_shared_t *fs, fault_pipe_t *p, double t_kill);

#endif
