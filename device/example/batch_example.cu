/* perseus device library: a complete small example (docs/device.md).
 *
 * Every rank (one process per GPU, forked here) puts NTILES tiles of TILE
 * bytes to the next rank from several CTAs, one signal per BATCH tiles; the
 * next rank waits for the tile count and checks every byte. Peers in the same
 * NVLink domain get the tiles by stores, others through GIN (for that, run
 * with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_GIN_TYPE=2 and a GIN plugin,
 * e.g. NCCL_NET_PLUGIN=perseus).
 *
 *   nvcc -std=c++17 -arch=sm_90 -I<perseus>/include batch_example.cu -lnccl -o batch_example
 *   CUDA_MODULE_LOADING=EAGER ./batch_example [BATCH [gin|lsa]]   (lsa: no GIN at all)
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "example_ranks.h"
#include "perseus/device.cuh"

#define NTILES 64
#define TILE (64 << 10)
#define CTAS 8

#define CHECK(call)                                                                        \
  do {                                                                                     \
    long long e_ = (long long)(call);                                                      \
    if (e_) {                                                                              \
      fprintf(stderr, "rank %d: %s failed (%lld) at line %d\n", rank, #call, e_, __LINE__); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

__device__ unsigned char pattern(int src, int tile, size_t i) { return (unsigned char)(src * 31 + tile * 7 + i); }

/* CTAs fill their tiles and put them; the last CTA to finish flushes the
 * remainder (no put to the peer is in progress then). */
__global__ void produce(ncclDevComm dc, perseus_batch_handle h, ncclWindow_t win, int to,
                        unsigned batch, unsigned *done) {
  perseus_batch pb(dc, h, batch);
  char *send = (char *)ncclGetLocalPointer(win, 0);
  for (int t = blockIdx.x; t < NTILES; t += gridDim.x) {
    for (size_t i = threadIdx.x; i < TILE; i += blockDim.x) send[(size_t)t * TILE + i] = pattern(dc.rank, t, i);
    /* our tile t goes to the same offset in the receive half of `to`'s window */
    pb.put(ncclCoopCta{}, to, win, (size_t)(NTILES + t) * TILE, win, (size_t)t * TILE, TILE);
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(done, 1) == gridDim.x - 1) pb.flush(to);
  }
}

/* Waits for every tile from `from` (cumulative count), then checks them. */
__global__ void consume(ncclDevComm dc, perseus_batch_handle h, ncclWindow_t win, int from,
                        unsigned long long *bad) {
  perseus_recv rv(dc, h);
  if (threadIdx.x == 0) rv.wait(from, NTILES);
  __syncthreads();
  const unsigned char *recv = (const unsigned char *)ncclGetLocalPointer(win, (size_t)NTILES * TILE);
  for (size_t i = threadIdx.x; i < (size_t)NTILES * TILE; i += blockDim.x)
    if (recv[i] != pattern(from, (int)(i / TILE), i % TILE)) atomicAdd(bad, 1ULL);
}

struct args_t {
  unsigned batch;
  bool gin;
};

static int run(int rank, int n, const ncclUniqueId *id, void *arg) {
  const unsigned batch = ((args_t *)arg)->batch;
  const bool gin = ((args_t *)arg)->gin;
  ncclComm_t comm;
  ncclWindow_t win;
  void *buf;
  ncclDevComm dc;
  perseus_batch_handle h;
  ncclDevResourceRequirements_t req;
  ncclDevCommRequirements_t reqs;
  perseus_devcomm_requirements_init(&reqs); /* 2.29+: NCCL's initializer, which it checks */
  unsigned *done;
  unsigned long long *bad, nbad = 0;
  cudaStream_t ps, cs;
  CHECK(cudaSetDevice(rank));
  CHECK(ncclCommInitRank(&comm, n, *id, rank));
  size_t bytes = (size_t)2 * NTILES * TILE; /* send half, receive half */
  CHECK(ncclMemAlloc(&buf, bytes));
  CHECK(ncclCommWindowRegister(comm, buf, bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
  /* GIN for peers beyond NVLink: on one node NCCL connects it only when
   * asked. Without a GIN backend (no GIN plugin or NIC) it must not be asked
   * for: then every peer must be LSA-reachable. */
  reqs.ginForceEnable = gin;
  CHECK(perseus_batch_requirement(comm, 0, gin, &reqs, &h, &req));
  CHECK(ncclDevCommCreate(comm, &reqs, &dc));
  if (dc.lsaSize < n && dc.ginContextCount < 1) {
    fprintf(stderr, "rank %d: peers beyond NVLink and no GIN: nothing can reach them\n", rank);
    return 1;
  }
  CHECK(cudaMalloc(&done, sizeof *done));
  CHECK(cudaMalloc(&bad, sizeof *bad));
  CHECK(cudaMemset(done, 0, sizeof *done));
  CHECK(cudaMemset(bad, 0, sizeof *bad));
  CHECK(cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  /* producer and consumer run at the same time, on separate streams */
  consume<<<1, 256, 0, cs>>>(dc, h, win, (rank + n - 1) % n, bad);
  produce<<<CTAS, 256, 0, ps>>>(dc, h, win, (rank + 1) % n, batch, done);
  CHECK(cudaGetLastError());
  CHECK(cudaStreamSynchronize(ps));
  CHECK(cudaStreamSynchronize(cs));
  CHECK(cudaMemcpy(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost));
  printf("rank %d: %d tiles of %d B from rank %d, %u per signal: %llu bad bytes\n", rank, NTILES,
         TILE, (rank + n - 1) % n, batch, nbad);
  CHECK(ncclDevCommDestroy(comm, &dc));
  CHECK(ncclCommWindowDeregister(comm, win));
  CHECK(ncclMemFree(buf));
  CHECK(ncclCommDestroy(comm));
  return nbad != 0;
}

int main(int argc, char **argv) {
  args_t args = {argc > 1 ? (unsigned)atoi(argv[1]) : 8u,
                 !(argc > 2 && !strcmp(argv[2], "lsa"))}; /* "lsa": NVLink peers only, no GIN */
  const int n = example_gpus();
  if (n < 2 || args.batch < 1) {
    fprintf(stderr, "need 2 or more GPUs (found %d) and a batch >= 1\n", n);
    return 77;
  }
  return example_ranks(n, run, &args);
}
