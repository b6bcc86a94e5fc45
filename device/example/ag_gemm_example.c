/* perseus fused AllGather+GEMM from C (<perseus/ag_gemm.h>, libperseus_ag_gemm.so).
 *
 * Every GPU gets a process (forked here) and a rank. Each rank holds its
 * shard of A's M rows (perseus_ag_gemm_shard) and all of B, and computes all
 * of C = A x B in one kernel a step, gathering the other ranks' rows over
 * NVLink (or, with P2P off, through a GIN plugin such as perseus). The
 * example checks sampled elements of every rank's C against a host dot
 * product.
 *
 *   nvcc -I<perseus>/include ag_gemm_example.c -L<libdir> -lperseus_ag_gemm -lnccl \
 *        -o ag_gemm_example
 *   ./ag_gemm_example [M [K [push|pull]]]      (defaults 512, 1024, push; N = K)
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
#include "perseus/ag_gemm.h"

#define CHECK(call) EXAMPLE_CHECK(call, perseus_ag_gemm_last_error())

typedef struct {
  int m, k, mode;
} args_t;

static int run(int rank, int n, const ncclUniqueId *id, void *arg) {
  const int m = ((args_t *)arg)->m, k = ((args_t *)arg)->k, mode = ((args_t *)arg)->mode;
  const perseus_ag_gemm_shape_t shape = {m, k, k}; /* N = K */
  const size_t N = (size_t)k, K = (size_t)k;
  int r0, r1;
  perseus_ag_gemm_shard(m, n, rank, &r0, &r1);
  uint16_t *ha = malloc(((size_t)(r1 - r0) + 1) * K * 2), *hb = malloc(N * K * 2), *hc = malloc((size_t)m * N * 2);
  if (!ha || !hb || !hc) return 1;
  for (size_t i = 0; i < (size_t)(r1 - r0) * K; i++) ha[i] = example_value(1, (size_t)r0 * K + i); /* A [M][K] */
  for (size_t i = 0; i < N * K; i++) hb[i] = example_value(2, i);                                      /* B as [N][K] */

  ncclComm_t comm;
  cudaStream_t st;
  void *a, *b, *c;
  perseus_ag_gemm_t *op;
  CHECK(cudaSetDevice(rank));
  CHECK(ncclCommInitRank(&comm, n, *id, rank));
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CHECK(cudaMalloc(&a, ((size_t)(r1 - r0) + 1) * K * 2));
  CHECK(cudaMalloc(&b, N * K * 2));
  CHECK(cudaMalloc(&c, (size_t)m * N * 2));
  CHECK(cudaMemcpy(a, ha, (size_t)(r1 - r0) * K * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(b, hb, N * K * 2, cudaMemcpyHostToDevice));
  CHECK(perseus_ag_gemm_create(comm, &shape, mode, &op));
  for (int step = 0; step < 3; step++) CHECK(perseus_ag_gemm_step(op, a, b, c, st));
  CHECK(cudaStreamSynchronize(st));
  CHECK(cudaMemcpy(hc, c, (size_t)m * N * 2, cudaMemcpyDeviceToHost));

  /* 256 sampled elements against a host dot product (bf16 output rounding
   * and fp32 sums in another order: a relative bound) */
  int bad = 0;
  for (int s = 0; s < 256; s++) {
    const size_t i = (size_t)((s * 7919u + (unsigned)rank * 104729u) % (unsigned)m), j = (size_t)((s * 31u) % N);
    double want = 0, mag = 0;
    for (size_t x = 0; x < K; x++) {
      const double p = (double)example_from_bf16(example_value(1, i * K + x)) * example_from_bf16(hb[j * K + x]);
      want += p, mag += fabs(p);
    }
    const double got = example_from_bf16(hc[i * N + j]);
    if (fabs(got - want) > fabs(want) / 128 + mag * (double)K * 6e-8 + 1e-6) {
      if (bad++ < 5) fprintf(stderr, "rank %d: C[%zu][%zu] = %g, expected %g\n", rank, i, j, got, want);
    }
  }
  printf("rank %d: rows [%d, %d) of %d, C = A x B (%d x %d x %d, %s): %d of 256 sampled elements wrong\n", rank,
         r0, r1, m, m, k, k, mode == PERSEUS_AG_GEMM_PULL ? "pull" : "push", bad);
  perseus_ag_gemm_destroy(op);
  CHECK(ncclCommDestroy(comm));
  return bad != 0;
}

int main(int argc, char **argv) {
  args_t args = {argc > 1 ? atoi(argv[1]) : 512, argc > 2 ? atoi(argv[2]) : 1024,
                 argc > 3 && !strcmp(argv[3], "pull") ? PERSEUS_AG_GEMM_PULL : PERSEUS_AG_GEMM_PUSH};
  const int n = example_gpus();
  if (n < 1) {
    fprintf(stderr, "no GPU found\n");
    return 77;
  }
  if (args.m < 1 || args.k < 64) {
    fprintf(stderr, "M %d, K %d: expected M >= 1 and K >= 64 (a multiple of 64)\n", args.m, args.k);
    return 2;
  }
  return example_ranks(n, run, &args);
}
