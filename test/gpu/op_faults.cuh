/* What a fused operator (decode, AG+GEMM) must survive, each case on a
 * fresh operator (every rank creates and destroys it: both are collective):
 *   - a stream capturing a CUDA graph: step refuses it by name;
 *   - a bad timeout variable on the last rank only: create fails on every
 *     rank (none waits in a collective the others left), the last naming
 *     the variable, the others pointing at another rank;
 *   - from 2 ranks, where the test gives a big operator: the last rank out
 *     of device memory at create (it holds all but half of what the big
 *     operator's window needs): create fails on every rank, the others
 *     pointing at another rank, none waiting in the window's registration;
 *   - from 2 ranks: the last rank holding every byte of device memory at
 *     create, the same (none waits in the set-up's agreements either);
 * and, from 2 ranks, a step the last rank never runs: the waits of every
 * other rank end, the operator says which rank it waited for and refuses
 * the next step:
 *   - timeout: the operator's timeout variable at 300 ms: the step ends
 *     after it, not before, and within a few seconds;
 *   - abort: the variable at 0 (wait forever): the step is still running
 *     after 300 ms, and ends once another thread aborts it.
 * Returns the failed checks of this rank. */
#ifndef PS_TEST_OP_FAULTS_CUH
#define PS_TEST_OP_FAULTS_CUH

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gin_proc.h"
#include "tile_comm.cuh"

struct op_fault_ops {
  const char *name;        /* for messages: "decode_fused_test" */
  const char *timeout_var; /* PERSEUS_DECODE_TIMEOUT_MS */
  void *ctx;               /* the test's inputs, passed to create and step */
  void *(*create)(gc_world *w, void *ctx);                /* the operator, or NULL */
  int (*step)(void *op, void *ctx, cudaStream_t st);      /* 0 or -1 */
  int (*check)(void *op);
  void (*abort)(void *op);
  const char *(*last_error)(void);
  void (*destroy)(void *op);
  void *(*create_big)(gc_world *w, void *ctx); /* an operator whose window needs big_bytes; NULL: none */
  size_t big_bytes;
};

struct op_aborter {
  const op_fault_ops *o;
  void *op;
  int running; /* the stream was still busy when the abort came */
  gc_world *w;
};

static void *op_abort_later(void *arg)
{
  op_aborter *a = (op_aborter *)arg;
  usleep(300 * 1000);
  a->running = cudaStreamQuery(a->w->stream) == cudaErrorNotReady;
  a->o->abort(a->op);
  return NULL;
}

static int op_fault_case(const op_fault_ops &o, gc_world *w, int rank, int R, int abort)
{
  const int skipper = R - 1;
  const char *was = getenv(o.timeout_var);
  char keep[64];
  snprintf(keep, sizeof keep, "%s", was ? was : "");
  setenv(o.timeout_var, abort ? "0" : "300", 1);
  void *op = o.create(w, o.ctx);
  if (was) setenv(o.timeout_var, keep, 1);
  else unsetenv(o.timeout_var);
  if (!op) gc_die(__FILE__, __LINE__, "%s: create: %s", o.name, o.last_error());
  int bad = 0;
  char why[512] = "-", want[64];
  if (rank != skipper) {
    const double t0 = gp_now();
    if (o.step(op, o.ctx, w->stream)) gc_die(__FILE__, __LINE__, "%s: step: %s", o.name, o.last_error());
    pthread_t th;
    op_aborter ab = {&o, op, 0, w};
    if (abort && pthread_create(&th, NULL, op_abort_later, &ab)) gc_die(__FILE__, __LINE__, "pthread_create");
    gc_wait_stream(w, abort ? "a step to abort" : "a step whose peer never runs it", NULL, NULL);
    if (abort) pthread_join(th, NULL);
    const double took = gp_now() - t0;
    const int rc = o.check(op);
    snprintf(why, sizeof why, "%s", o.last_error());
    if (abort) snprintf(want, sizeof want, "aborted");
    else snprintf(want, sizeof want, "rank %d's", skipper);
    const int refused = o.step(op, o.ctx, w->stream) == -1 && strstr(o.last_error(), "earlier step failed");
    bad = rc != -1 || !strstr(why, want) || (!abort && !strstr(why, o.timeout_var)) || !refused ||
          took < 0.28 || took > 20 || (abort && !ab.running);
    printf("%s: rank %d, %s: %s after %.2f s (check: %s; next step %s)\n", o.name, rank,
           abort ? "abort" : "timeout", bad ? "FAILED" : "ok", took, why, refused ? "refused" : "NOT refused");
  } else if (o.check(op) != 0) {
    printf("%s: rank %d (skipped the step): check failed: %s\n", o.name, rank, o.last_error());
    bad = 1;
  }
  /* the others' puts into the skipper's window land before any window goes */
  if (gp_barrier(R)) _exit(1);
  usleep(200 * 1000);
  GC_CUDA(cudaDeviceSynchronize(), "%s, rank %d", o.name, rank);
  o.destroy(op);
  return bad;
}

static int op_refuses_capture(const op_fault_ops &o, gc_world *w, int rank)
{
  void *op = o.create(w, o.ctx);
  if (!op) gc_die(__FILE__, __LINE__, "%s: create: %s", o.name, o.last_error());
  cudaStream_t s;
  GC_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "capture stream");
  GC_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), "begin capture");
  const int rc = o.step(op, o.ctx, s);
  char why[512];
  snprintf(why, sizeof why, "%s", o.last_error());
  cudaGraph_t g = NULL;
  GC_CUDA(cudaStreamEndCapture(s, &g), "end capture");
  if (g) cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  const int bad = rc != -1 || !strstr(why, "capturing");
  printf("%s: rank %d, a step on a capturing stream: %s (%s)\n", o.name, rank, bad ? "FAILED" : "refused", why);
  o.destroy(op);
  return bad;
}

static int op_disagrees(const op_fault_ops &o, gc_world *w, int rank, int R)
{
  const char *was = getenv(o.timeout_var);
  char keep[64];
  snprintf(keep, sizeof keep, "%s", was ? was : "");
  if (rank == R - 1) setenv(o.timeout_var, "soon", 1);
  void *op = o.create(w, o.ctx);
  if (was) setenv(o.timeout_var, keep, 1);
  else unsetenv(o.timeout_var);
  const char *want = rank == R - 1 ? o.timeout_var : "another rank";
  const int bad = op != NULL || !strstr(o.last_error(), want);
  printf("%s: rank %d, %s=soon on rank %d: create %s (%s)\n", o.name, rank, o.timeout_var, R - 1,
         op ? "SUCCEEDED" : "refused", o.last_error());
  if (op) o.destroy(op);
  return bad;
}

/* The verdict of a create the last rank could not set up (`what` it had
 * done): refused on every rank, the last naming its own failure (why), the
 * others another rank's. */
static int op_refused_by_all(const op_fault_ops &o, int rank, int R, void *op, const char *why, const char *what)
{
  const int other = strstr(why, "another rank could not set up") != NULL;
  const int bad = op != NULL || (rank == R - 1 ? other || !why[0] : !other);
  printf("%s: rank %d, rank %d %s: %s (%s)\n", o.name, rank, R - 1, what, bad ? "FAILED" : "refused",
         op ? "created" : why);
  if (op) o.destroy(op);
  return bad;
}

static int op_out_of_memory(const op_fault_ops &o, gc_world *w, int rank, int R)
{
  void *hog = NULL;
  size_t free_b = 0, total_b = 0, take = 0;
  if (rank == R - 1) {
    GC_CUDA(cudaMemGetInfo(&free_b, &total_b), "device memory");
    if (free_b < o.big_bytes) gc_die(__FILE__, __LINE__, "%s: %zu bytes free, the case needs %zu", o.name, free_b,
                                     o.big_bytes);
    take = free_b - o.big_bytes / 2;
    GC_CUDA(cudaMalloc(&hog, take), "holding %zu of %zu free bytes", take, free_b);
  }
  void *op = o.create_big(w, o.ctx);
  char why[512];
  snprintf(why, sizeof why, "%s", o.last_error());
  if (hog) cudaFree(hog);
  return op_refused_by_all(o, rank, R, op, why, "out of device memory at create");
}

/* The last rank holds every byte of device memory cudaMalloc still gives
 * (big pieces, then ever smaller ones) and creates the small operator: its
 * set-up cannot allocate even the word of an all-reduce, yet every rank's
 * create must fail (the others pointing at another rank), none waiting in a
 * collective for it. */
static int op_memory_exhausted(const op_fault_ops &o, gc_world *w, int rank, int R)
{
  enum { kMaxPieces = 4096 };
  static void *held[kMaxPieces];
  int n = 0;
  size_t bytes = 0;
  if (rank == R - 1) {
    size_t free_b = 0, total_b = 0;
    GC_CUDA(cudaMemGetInfo(&free_b, &total_b), "device memory");
    for (size_t piece = free_b; piece >= 256 && n < kMaxPieces;) {
      if (cudaMalloc(&held[n], piece) == cudaSuccess) {
        bytes += piece, n++;
      } else {
        (void)cudaGetLastError();
        piece /= 2;
      }
    }
  }
  void *op = o.create(w, o.ctx);
  char why[512], what[96];
  snprintf(why, sizeof why, "%s", o.last_error());
  for (int i = 0; i < n; i++) cudaFree(held[i]);
  snprintf(what, sizeof what, "holding all device memory at create (%d pieces, %zu B here)", n, bytes);
  return op_refused_by_all(o, rank, R, op, why, what);
}

static int op_faults(const op_fault_ops &o, gc_world *w, int rank, int R)
{
  int bad = op_refuses_capture(o, w, rank) + op_disagrees(o, w, rank, R);
  if (R < 2) return bad;
  if (o.create_big) bad += op_out_of_memory(o, w, rank, R);
  bad += op_memory_exhausted(o, w, rank, R);
  return bad + op_fault_case(o, w, rank, R, 0) + op_fault_case(o, w, rank, R, 1);
}

#endif
