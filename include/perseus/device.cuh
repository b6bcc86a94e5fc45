/* perseus device library, umbrella header: tile puts with batched per-peer
 * signaling for megakernels, on NCCL's device API (NCCL >= 2.28).
 * docs/device.md has the guide and a complete example. */
#ifndef PERSEUS_DEVICE_CUH
#define PERSEUS_DEVICE_CUH

#include "perseus/device/tile.cuh"
#include "perseus/device/wait.cuh"
#include "perseus/device/batch.cuh"

#endif
