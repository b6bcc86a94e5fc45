// The fused AllGather+GEMM kernel's arguments and entry points, shared by
// the kernel (ag_gemm_fused.cu) and the operator around it (ag_gemm_op.cu).
#ifndef PS_AG_GEMM_ARGS_CUH
#define PS_AG_GEMM_ARGS_CUH

#include <cuda.h>
#include <nccl.h>
#include <nccl_device.h>
#include <perseus/device.cuh>

#include "ag_gemm_tile.cuh"

namespace agk {

constexpr size_t kPieceBytes = 64 * 1024; // what one block shares at a time
constexpr int kMaxCommBlocks = 16;
constexpr int kTmaRanks = 8; // pulling from more ranks gathers every row by cp.async

struct ag_args {
  CUtensorMap bmap; // B as [N][K], boxes of ag::kBN rows x ag::kBK
  // A's rows by TMA, in boxes of ag::kBM rows x ag::kBK: amap this rank's
  // shard (the caller's a; set where the shard is not empty), wmap[0] the
  // own window (push) or wmap[s] rank s's (pull, up to kTmaRanks ranks),
  // both halves, [2M][K]. Tiles of rows from both (or, pulling, from two
  // ranks) gather their rows by cp.async instead.
  CUtensorMap amap, wmap[kTmaRanks];
  int wmaps;
  ncclDevComm dc;
  perseus_batch_handle h;
  ncclWindow_t win;
  const __nv_bfloat16 *a;
  __nv_bfloat16 *c;
  int M, N, K, mode, comm_blocks, piece_rows, half, gin_any;
  uint32_t batch;        // this rank's pieces per LSA signal
  uint64_t step1;        // steps so far, this one included
  unsigned long long *local_done; // this rank's pieces shared, over every step (GIN only)
  unsigned int *tickets; // [2]: the tiles handed out in the steps of each window half
  int splits;            // K splits a tile (1: none); more where tiles alone leave SMs idle
  float *ws;             // splits > 1: each split's sums in fp32, [splits][M][N]
  unsigned int *tile_done; // splits > 1: per tile and 64-row half, the splits done over every step
  perseus_wait_bound wb;   // every wait of the step
};

// What a step waits for (perseus_wait_fault::what).
enum { WAIT_ROWS = 1, WAIT_STEP_END = 2, WAIT_SPLITS = 3 };

static_assert(sizeof(ag_args) <= 4000, "the kernel's arguments exceed 4 KiB");

// The blocks an SM holds (after raising the kernel's shared-memory limit).
cudaError_t prepare(int *per_sm);

// One step, launched cooperatively: blocks wait for each other (split K)
// and for the peers, so all of them must be resident at once.
cudaError_t launch(const ag_args &a, int grid, cudaStream_t st);

} // namespace agk

#endif
