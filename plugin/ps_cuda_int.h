/* Private to the CUDA driver files (ps_cuda.c: the driver, devices and
 * memory; ps_cuda_stream.c: the streams): the driver slice they load, and
 * the device's state. Never included by the engine (ps_cuda.h is its API). */
#ifndef PS_CUDA_INT_H
#define PS_CUDA_INT_H

#include <pthread.h>
#include <stdint.h>

#include "ps_cuda.h"

/* Our own spelling of the few driver types and values used, so no cuda.h is
 * needed to build; every value is checked against cuda.h (CUDA 13.0). */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct ps_cu_ctx_st *CUcontext;
typedef struct ps_cu_stream_st *CUstream;
typedef unsigned long long cu_u64;
typedef struct {
  int type, id; /* CUmemLocationType, ordinal */
} cu_location_t;
typedef struct {
  int src_access_order; /* CUmemcpySrcAccessOrder */
  cu_location_t src_hint, dst_hint;
  unsigned int flags;
} cu_copy_attr_t; /* CUmemcpyAttributes */
typedef union {
  int operation;
  struct {
    int operation;
    CUdeviceptr address;
    cu_u64 value64;
    unsigned int flags;
    CUdeviceptr alias;
  } write_value;
  cu_u64 pad[6];
} cu_memop_t; /* CUstreamBatchMemOpParams */

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_NOT_READY = 600,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  CU_MEMORYTYPE_DEVICE = 2,
  CU_STREAM_NON_BLOCKING = 1,
  CU_MEMHOSTALLOC_PORTABLE = 1,
  CU_MEMHOSTALLOC_DEVICEMAP = 2,
  CU_STREAM_MEM_OP_WRITE_VALUE_64 = 5,
  CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_LOCATION_TYPE_HOST = 2,
  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  /* with its memory barrier: earlier writes of the stream are visible first */
  CU_STREAM_WRITE_VALUE_DEFAULT = 0,
};

/* Exact (versioned) driver symbols: cuda.h maps the plain names onto these
 * with #define, which a dlsym by name does not see. */
typedef struct {
  CUresult (*init)(unsigned int);
  CUresult (*get_error_string)(CUresult, const char **);
  CUresult (*device_get_count)(int *);
  CUresult (*device_get)(CUdevice *, int);
  CUresult (*device_get_attribute)(int *, int, CUdevice);
  CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
  CUresult (*primary_ctx_release)(CUdevice);
  CUresult (*ctx_push)(CUcontext);
  CUresult (*ctx_pop)(CUcontext *);
  CUresult (*pointer_get_attribute)(void *, int, CUdeviceptr);
  CUresult (*mem_host_alloc)(void **, size_t, unsigned int);
  CUresult (*mem_free_host)(void *);
  CUresult (*ctx_get_device)(CUdevice *);
  CUresult (*mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*stream_create)(CUstream *, unsigned int);
  CUresult (*stream_synchronize)(CUstream);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*stream_query)(CUstream);
  CUresult (*host_get_device_pointer)(CUdeviceptr *, void *, unsigned int);
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*batch_memop)(CUstream, unsigned int, cu_memop_t *, unsigned int);
  /* optional (CUDA 12.8+): 13.0's signature, or 12.8's with failIdx */
  CUresult (*copy_batch_v2)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, cu_copy_attr_t *,
                            size_t *, size_t, CUstream);
  CUresult (*copy_batch_v1)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, cu_copy_attr_t *,
                            size_t *, size_t, size_t *, CUstream);
  /* optional (CUDA 11.7+): cuMemGetHandleForAddressRange, for dma-buf fds */
  CUresult (*range_handle)(void *, CUdeviceptr, size_t, int, unsigned long long);
} ps_cu_api_t;
extern ps_cu_api_t ps_cu;


#define PS_CUDA_HELD 64 /* operations a stream holds before handing them over */

/* An operation not yet handed to the driver. */
typedef struct {
  int kind; /* HELD_D2H, HELD_H2D, HELD_WRITE */
  CUdeviceptr dst, src;
  size_t n;
  uint64_t value;
} held_t;
enum { HELD_D2H, HELD_H2D, HELD_WRITE };

/* One hand-over, queued for its stream's thread: the stream's held
 * operations, then its mark when `mark` is not 0. */
typedef struct {
  uint32_t n;
  uint64_t mark;
  uint64_t queued_ns; /* when the pass handed it over */
  held_t op[PS_CUDA_HELD];
} job_t;

/* A stream thread's account (its own writes; read once it stopped):
 * reported at NCCL_DEBUG=INFO when the device closes. */
typedef struct {
  uint64_t jobs, ops, wait_ns, call_ns, wait_max_ns, call_max_ns;
} job_stats_t;

#define PS_CUDA_JOBS 32 /* hand-overs queued on a stream at most; the caller waits beyond */

typedef struct {
  CUstream st;
  volatile uint64_t *reached; /* pinned: the last mark the stream reached */
  CUdeviceptr reached_dev;
  uint64_t marks;             /* marks enqueued */
  int unmarked;               /* operations handed over since the last mark */
  held_t held[PS_CUDA_HELD];
  uint32_t nheld;
  uint64_t next_query_ns;     /* a waiting ps_cuda_passed asks the driver then */
  int failed;                 /* atomic: a hand-over failed: its operations' tickets never pass */
  uint64_t first_held_ns;     /* when the oldest operation held now was held */
  uint64_t held_ns, held_max_ns; /* summed over hand-overs: how long their oldest waited to go */
  /* The stream's own thread makes its driver calls (one to three
   * microseconds a copy), so a progress pass only queues them and the
   * streams' calls run side by side. Single producer (the engine, under
   * its comm's lock), single consumer. */
  struct ps_cuda_dev *dev;
  job_t *jobs;
  uint64_t jobs_tail; /* atomic: queued */
  char apart[64];
  uint64_t jobs_head; /* atomic: handed to the driver */
  job_stats_t js;
  pthread_t submitter;
  int started, sleeping; /* atomic */
  pthread_mutex_t wake_lock;
  pthread_cond_t wake;
} stream_t;

struct ps_cuda_dev {
  int ordinal;
  CUdevice dev;
  CUcontext ctx;
  stream_t s[PS_CUDA_NSTREAMS];
  uint64_t *marks_mem; /* pinned, one cache line per stream */
  int stop;            /* atomic: the streams' threads end once their queues are empty */
};

const char *ps_cu_err(CUresult rc);
/* Makes d's context current for the caller's call (pushed), and back. */
ncclResult_t ps_cu_ctx_push(ps_cuda_dev_t *d, const char *op);
void ps_cu_ctx_pop(const char *op);
static inline CUdeviceptr ps_cu_dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }
/* The streams of d, their mark words and their submitting threads (with
 * d's context current); and their end: what is held or queued runs, the
 * streams drain, and the threads stop. */
ncclResult_t ps_cuda_streams_start(ps_cuda_dev_t *d);
void ps_cuda_streams_stop(ps_cuda_dev_t *d);

#endif
