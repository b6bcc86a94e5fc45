/* The slice of the CUDA driver API the staging path needs, loaded at run
 * time (dlopen libcuda.so.1), so the plugin loads on hosts with no GPU.
 *
 * Everything here is asynchronous and never touches an SM: copies run on the
 * copy engines and cuStreamWriteValue64 is a stream memory operation, so a
 * persistent kernel occupying every SM cannot starve the proxy.
 *
 * Test builds compiled with -DPS_FAKE_CUDA link ps_cuda_fake.c instead of
 * ps_cuda.c: "device memory" is host memory and every stream is a worker
 * thread that runs its operations in order after random delays, so a caller
 * that does not wait for an event before relying on an operation is caught. */
#ifndef PS_CUDA_H
#define PS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "ps_nccl_abi.h"

/* One GPU (the device of the windows registered on a comm), its retained
 * primary context and PS_CUDA_NSTREAMS streams. Every call below makes the context
 * current for its own duration and restores the caller's afterwards. */
typedef struct ps_cuda_dev ps_cuda_dev_t;
typedef struct ps_cuda_event ps_cuda_event_t;

enum {
  PS_CUDA_COPY_STREAM = 0, /* payload copies and signal writes, in order */
  PS_CUDA_READ_STREAM = 1, /* signal reads, so they need not queue behind payload */
  PS_CUDA_OUT_STREAM = 2,  /* origin: copies out of the GPU, overlapping the inbound ones */
  PS_CUDA_NSTREAMS = 3
};

/* 1 when the driver API can be loaded and has a device; 0 otherwise. */
int ps_cuda_available(void);

/* Opens the GPU that owns `dev_ptr` (an allocation from cudaMalloc/cuMem*).
 * Fails with a logged reason when the driver is missing or the pointer is not
 * device memory. */
ncclResult_t ps_cuda_open(const void *dev_ptr, ps_cuda_dev_t **out);
void ps_cuda_close(ps_cuda_dev_t *d);
/* The device ordinal of d (for FI_HMEM registration). */
int ps_cuda_ordinal(const ps_cuda_dev_t *d);
/* Whether `ptr` .. ptr+size-1 is device memory of d's GPU (0/1). */
int ps_cuda_owns(ps_cuda_dev_t *d, const void *ptr, size_t size);

/* Page-locked host memory the copy engines can reach (cuMemHostAlloc). */
ncclResult_t ps_cuda_host_alloc(ps_cuda_dev_t *d, size_t size, void **out);
void ps_cuda_host_free(ps_cuda_dev_t *d, void *p);

/* Enqueue on stream `s` (PS_CUDA_*_STREAM). */
ncclResult_t ps_cuda_d2h(ps_cuda_dev_t *d, int s, void *host_dst, const void *dev_src, size_t n);
ncclResult_t ps_cuda_h2d(ps_cuda_dev_t *d, int s, void *dev_dst, const void *host_src, size_t n);
ncclResult_t ps_cuda_write64(ps_cuda_dev_t *d, int s, void *dev_dst, uint64_t value);

/* Events come from a pool in d and go back with ps_cuda_event_release. */
ncclResult_t ps_cuda_event_record(ps_cuda_dev_t *d, int s, ps_cuda_event_t **out);
/* 1: everything enqueued before the record has finished; 0: not yet;
 * -1: the stream failed (logged). Never blocks. */
int ps_cuda_event_done(ps_cuda_dev_t *d, ps_cuda_event_t *ev);
void ps_cuda_event_release(ps_cuda_dev_t *d, ps_cuda_event_t *ev);

#endif
