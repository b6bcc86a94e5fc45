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
 * that does not wait for an operation's mark before relying on it is caught. */
#ifndef PS_CUDA_H
#define PS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "ps_nccl_abi.h"

/* One GPU (the device of the windows registered on a comm), its retained
 * primary context and PS_CUDA_NSTREAMS streams. Every call below makes the context
 * current for its own duration and restores the caller's afterwards. */
typedef struct ps_cuda_dev ps_cuda_dev_t;

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
/* A thread with no current context gets d's, for the rest of its life
 * (under its later push/pop pairs); one with a context keeps it. A provider
 * that copies GPU memory through the CUDA runtime (FI_HMEM; shm does) does
 * so on the calling thread's current context, and a thread with none would
 * copy through GPU 0's in every process. Cheap after the first call on a
 * thread. */
ncclResult_t ps_cuda_bind_thread(ps_cuda_dev_t *d);
/* The device ordinal of d (for FI_HMEM registration). */
int ps_cuda_ordinal(const ps_cuda_dev_t *d);
/* Whether `ptr` .. ptr+size-1 is device memory of d's GPU (0/1). */
int ps_cuda_owns(ps_cuda_dev_t *d, const void *ptr, size_t size);

/* The GPU that owns device memory at ptr, or -1 (host memory, not CUDA's,
 * or no driver). */
int ps_cuda_ptr_ordinal(const void *ptr);
/* A small device allocation on the calling thread's current GPU (*ordinal),
 * to ask a provider whether it registers CUDA memory. Fails (logged at INFO)
 * without a driver, a GPU or a current context. */
ncclResult_t ps_cuda_probe_alloc(size_t size, int *ordinal, void **out);
void ps_cuda_probe_free(int ordinal, void *p);
/* GPU `ordinal`'s major compute capability (9: Hopper), or -1. */
int ps_cuda_compute_major(int ordinal);
/* A dma-buf file descriptor for device memory [ptr, ptr + size) of GPU
 * `ordinal`, exported as NCCL exports one for regMrDmaBuf: the range widened
 * to whole host pages, *offset the distance of ptr from its start. The
 * caller closes *fd. Fails (logged at INFO) where the driver, the GPU or the
 * kernel cannot. */
ncclResult_t ps_cuda_dmabuf_export(int ordinal, const void *ptr, size_t size, int *fd,
                                   uint64_t *offset);

/* Page-locked host memory the copy engines can reach (cuMemHostAlloc). */
ncclResult_t ps_cuda_host_alloc(ps_cuda_dev_t *d, size_t size, void **out);
void ps_cuda_host_free(ps_cuda_dev_t *d, void *p);

/* Enqueue on stream `s` (PS_CUDA_*_STREAM), in call order. Copies may be
 * held and handed to the driver together (one cuMemcpyBatchAsync where the
 * driver has it) at the stream's next write or flush; copies handed over
 * together run in any order among themselves, so a copy that overlaps a held
 * one (either side) hands the held ones over first. *ticket: the mark after
 * which the operation has finished (ps_cuda_passed); the mark itself goes on
 * the stream at the next ps_cuda_flush. */
ncclResult_t ps_cuda_d2h(ps_cuda_dev_t *d, int s, void *host_dst, const void *dev_src, size_t n,
                         uint64_t *ticket);
ncclResult_t ps_cuda_h2d(ps_cuda_dev_t *d, int s, void *dev_dst, const void *host_src, size_t n,
                         uint64_t *ticket);
/* An 8-byte write of `value` to GPU memory, after everything enqueued on s
 * before it is visible (a stream memory operation with its barrier). */
ncclResult_t ps_cuda_write64(ps_cuda_dev_t *d, int s, void *dev_dst, uint64_t value,
                             uint64_t *ticket);

/* Hands every held operation to the driver and, on each stream with
 * operations since its last mark, enqueues the mark their tickets name: the
 * stream writes the mark's number into pinned host memory once everything
 * before it finished. Call it at the end of every pass that enqueued work;
 * until then no ticket of that work can pass. */
ncclResult_t ps_cuda_flush(ps_cuda_dev_t *d);
/* ps_cuda_flush, but only where the driver calls of everything handed over
 * before were made; otherwise what is held waits for a later call and then
 * goes in fewer, larger driver calls. A progress pass, made again and again
 * while anything is in flight, calls this; a caller that waits for a ticket
 * calls ps_cuda_flush. */
ncclResult_t ps_cuda_flush_lazy(ps_cuda_dev_t *d);
/* 1: the mark `ticket` of stream s was reached, so the operations it covers
 * finished and their bytes are visible to the CPU; 0: not yet (or not
 * flushed); -1: the stream failed (logged). Reads pinned host memory: no
 * driver call, except that while it waits it asks the driver for the
 * stream's status at most once a millisecond, to see a failure. */
int ps_cuda_passed(ps_cuda_dev_t *d, int s, uint64_t ticket);
/* The ticket of the last mark enqueued on stream s (0: none yet). */
uint64_t ps_cuda_last_mark(const ps_cuda_dev_t *d, int s);
/* Flushes and waits, up to timeout_ns, until every stream reached its last
 * mark: nothing enqueued so far still touches memory. Logs and fails on a
 * stream failure or the timeout. */
ncclResult_t ps_cuda_quiesce(ps_cuda_dev_t *d, uint64_t timeout_ns);

#endif
