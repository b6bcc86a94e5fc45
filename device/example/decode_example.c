/* perseus fused Flash-Decode from C (<perseus/decode.h>, libperseus_decode.so).
 *
 * Every GPU gets a process (forked here) and a rank. The KV cache of every
 * sequence is cut into one shard per rank (perseus_decode_shard); each rank
 * computes its shard's partial attention, the partials cross to every rank
 * (NVLink, or with P2P off a GIN plugin such as perseus) and every rank
 * combines them, all in one kernel a step. The example checks every rank's
 * whole output against attention over the whole sequences on the host.
 *
 *   nvcc -I<perseus>/include decode_example.c -L<libdir> -lperseus_decode -lnccl \
 *        -o decode_example
 *   ./decode_example [CONTEXT [push|pull]]      (defaults 3000 tokens, push)
 */
#define _DEFAULT_SOURCE /* popen, usleep, MAP_ANONYMOUS (example_ranks.h) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "example_ranks.h"
#include "perseus/decode.h"

#define B 2    /* sequences */
#define HQ 8   /* query heads */
#define HKV 2  /* KV heads: 4 query heads share one */
#define D 128  /* head dim */

#define CHECK(call) EXAMPLE_CHECK(call, perseus_decode_last_error())

/* Element d of token t's key (s = 2) or value (s = 3) of KV head h of sequence b. */
static uint16_t kv(uint32_t s, int b, int h, int t, int d) { return example_value(s, (((size_t)b * HKV + h) * 1000003u + t) * D + d); }

typedef struct {
  int len[B], mode;
} args_t;

static int run(int rank, int n, const ncclUniqueId *id, void *arg) {
  const int *len = ((args_t *)arg)->len, mode = ((args_t *)arg)->mode;
  const float scale = 1.f / sqrtf((float)D);
  int start[B], end[B], shard[B], stride = 1, max_len = 0;
  for (int b = 0; b < B; b++) {
    perseus_decode_shard(len[b], n, rank, &start[b], &end[b]);
    shard[b] = end[b] - start[b];
    if (shard[b] > stride) stride = shard[b];
    if (len[b] > max_len) max_len = len[b];
  }
  const size_t kv_elems = (size_t)B * HKV * stride * D, q_elems = (size_t)B * HQ * D;
  uint16_t *hq = malloc(q_elems * 2), *hk = calloc(kv_elems, 2), *hv = calloc(kv_elems, 2), *ho = malloc(q_elems * 2);
  if (!hq || !hk || !hv || !ho) return 1;
  for (size_t i = 0; i < q_elems; i++) hq[i] = example_value(1, i);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < HKV; h++)
      for (int t = 0; t < shard[b]; t++)
        for (int d = 0; d < D; d++) {
          const size_t at = (((size_t)b * HKV + h) * stride + t) * D + d;
          hk[at] = kv(2, b, h, start[b] + t, d), hv[at] = kv(3, b, h, start[b] + t, d);
        }

  const perseus_decode_config_t cfg = {B, HQ, HKV, D, max_len};
  ncclComm_t comm;
  cudaStream_t st;
  void *q, *k, *v, *o, *nt;
  perseus_decode_t *op;
  CHECK(cudaSetDevice(rank));
  CHECK(ncclCommInitRank(&comm, n, *id, rank));
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CHECK(cudaMalloc(&q, q_elems * 2));
  CHECK(cudaMalloc(&k, kv_elems * 2));
  CHECK(cudaMalloc(&v, kv_elems * 2));
  CHECK(cudaMalloc(&o, q_elems * 2));
  CHECK(cudaMalloc(&nt, sizeof shard));
  CHECK(cudaMemcpy(q, hq, q_elems * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(k, hk, kv_elems * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(v, hv, kv_elems * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(nt, shard, sizeof shard, cudaMemcpyHostToDevice));
  CHECK(perseus_decode_create(comm, &cfg, stride, 0, mode, &op));
  for (int step = 0; step < 3; step++) CHECK(perseus_decode_step(op, scale, q, k, v, (size_t)stride, nt, o, st));
  CHECK(cudaStreamSynchronize(st));
  CHECK(cudaMemcpy(ho, o, q_elems * 2, cudaMemcpyDeviceToHost));

  /* attention over each whole sequence, in double; the output is bf16 */
  int bad = 0;
  double *p = malloc((size_t)max_len * sizeof *p);
  if (!p) return 1;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < HQ; h++) {
      const int g = h / (HQ / HKV);
      double top = -INFINITY, sum = 0;
      for (int t = 0; t < len[b]; t++) {
        double s = 0;
        for (int d = 0; d < D; d++) s += (double)example_from_bf16(hq[((size_t)b * HQ + h) * D + d]) * example_from_bf16(kv(2, b, g, t, d));
        p[t] = s * scale;
        if (p[t] > top) top = p[t];
      }
      for (int t = 0; t < len[b]; t++) sum += p[t] = exp(p[t] - top);
      for (int d = 0; d < D; d++) {
        double want = 0;
        for (int t = 0; t < len[b]; t++) want += p[t] * example_from_bf16(kv(3, b, g, t, d));
        want /= sum;
        const double got = example_from_bf16(ho[((size_t)b * HQ + h) * D + d]);
        if (fabs(got - want) > fabs(want) / 64 + 2e-3 && bad++ < 5)
          fprintf(stderr, "rank %d: out[%d][%d][%d] = %g, expected %g\n", rank, b, h, d, got, want);
      }
    }
  printf("rank %d: %d sequences of %d and %d tokens (%d and %d here), %d query heads over %d KV heads, %s: "
         "%d of %d outputs wrong\n",
         rank, B, len[0], len[1], shard[0], shard[1], HQ, HKV, mode == PERSEUS_DECODE_PULL ? "pull" : "push", bad,
         B * HQ * D);
  perseus_decode_destroy(op);
  CHECK(ncclCommDestroy(comm));
  return bad != 0;
}

int main(int argc, char **argv) {
  const int ctx = argc > 1 ? atoi(argv[1]) : 3000;
  args_t args = {{ctx, ctx / 3 + 1}, /* sequences of different lengths */
                 argc > 2 && !strcmp(argv[2], "pull") ? PERSEUS_DECODE_PULL : PERSEUS_DECODE_PUSH};
  const int n = example_gpus();
  if (n < 1) {
    fprintf(stderr, "no GPU found\n");
    return 77;
  }
  if (ctx < 1) {
    fprintf(stderr, "context %d: expected at least 1 token\n", ctx);
    return 2;
  }
  return example_ranks(n, run, &args);
}
