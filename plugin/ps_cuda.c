/* The CUDA driver slice of ps_cuda.h, loaded with dlopen so the plugin still
 * loads (and serves host memory) where libcuda.so.1 is absent. */
#include "ps_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_clock.h"
#include "ps_log.h"

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
  /* with its memory barrier: earlier writes of the stream are visible first */
  CU_STREAM_WRITE_VALUE_DEFAULT = 0,
};

/* Exact (versioned) driver symbols: cuda.h maps the plain names onto these
 * with #define, which a dlsym by name does not see. */
static struct {
  CUresult (*init)(unsigned int);
  CUresult (*get_error_string)(CUresult, const char **);
  CUresult (*device_get_count)(int *);
  CUresult (*device_get)(CUdevice *, int);
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
} cu;

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_ndev;       /* devices cuInit found; 0 when the driver is unusable */
static char cu_why[256];  /* why it is unusable */

#define PS_CUDA_HELD 64 /* operations a stream holds before handing them over */

/* An operation not yet handed to the driver. */
typedef struct {
  int kind; /* HELD_D2H, HELD_H2D, HELD_WRITE */
  CUdeviceptr dst, src;
  size_t n;
  uint64_t value;
} held_t;
enum { HELD_D2H, HELD_H2D, HELD_WRITE };

typedef struct {
  CUstream st;
  volatile uint64_t *reached; /* pinned: the last mark the stream reached */
  CUdeviceptr reached_dev;
  uint64_t marks;             /* marks enqueued */
  int unmarked;               /* operations handed over since the last mark */
  held_t held[PS_CUDA_HELD];
  uint32_t nheld;
  uint64_t next_query_ns;     /* a waiting ps_cuda_passed asks the driver then */
  int failed;                 /* a hand-over failed: its operations' tickets never pass */
} stream_t;

struct ps_cuda_dev {
  int ordinal;
  CUdevice dev;
  CUcontext ctx;
  stream_t s[PS_CUDA_NSTREAMS];
  uint64_t *marks_mem; /* pinned, one cache line per stream */
};

static const char *cu_err(CUresult rc) {
  static _Thread_local char num[40];
  const char *s = NULL;
  if (cu.get_error_string && cu.get_error_string(rc, &s) == CUDA_SUCCESS && s) return s;
  snprintf(num, sizeof num, "CUresult %d", rc); /* a code the driver cannot name */
  return num;
}

static int cu_sym(void *lib, const char *name, void *slot) {
  void *p = dlsym(lib, name);
  if (!p) {
    snprintf(cu_why, sizeof cu_why, "libcuda.so.1 lacks %s (driver too old?)", name);
    return -1;
  }
  /* POSIX guarantees a function pointer round-trips through void *. */
  memcpy(slot, &p, sizeof p);
  return 0;
}

static void cu_load(void) {
  _Static_assert(sizeof(void *) == sizeof(cu.init), "function pointers must fit a void *");
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *e = dlerror();
    snprintf(cu_why, sizeof cu_why, "dlopen(libcuda.so.1) failed: %s", e ? e : "?");
    PS_INFO(NCCL_INIT, "CUDA staging unavailable: %s", cu_why);
    return;
  }
  if (cu_sym(lib, "cuInit", &cu.init) || cu_sym(lib, "cuGetErrorString", &cu.get_error_string) ||
      cu_sym(lib, "cuDeviceGetCount", &cu.device_get_count) || cu_sym(lib, "cuDeviceGet", &cu.device_get) ||
      cu_sym(lib, "cuDevicePrimaryCtxRetain", &cu.primary_ctx_retain) ||
      cu_sym(lib, "cuDevicePrimaryCtxRelease_v2", &cu.primary_ctx_release) ||
      cu_sym(lib, "cuCtxPushCurrent_v2", &cu.ctx_push) || cu_sym(lib, "cuCtxPopCurrent_v2", &cu.ctx_pop) ||
      cu_sym(lib, "cuPointerGetAttribute", &cu.pointer_get_attribute) ||
      cu_sym(lib, "cuMemHostAlloc", &cu.mem_host_alloc) || cu_sym(lib, "cuMemFreeHost", &cu.mem_free_host) ||
      cu_sym(lib, "cuCtxGetDevice", &cu.ctx_get_device) || cu_sym(lib, "cuMemAlloc_v2", &cu.mem_alloc) || cu_sym(lib, "cuMemFree_v2", &cu.mem_free) ||
      cu_sym(lib, "cuStreamCreate", &cu.stream_create) ||
      cu_sym(lib, "cuStreamSynchronize", &cu.stream_synchronize) ||
      cu_sym(lib, "cuStreamDestroy_v2", &cu.stream_destroy) ||
      cu_sym(lib, "cuStreamQuery", &cu.stream_query) ||
      cu_sym(lib, "cuMemHostGetDevicePointer_v2", &cu.host_get_device_pointer) ||
      cu_sym(lib, "cuMemcpyAsync", &cu.memcpy_async) ||
      cu_sym(lib, "cuStreamBatchMemOp_v2", &cu.batch_memop)) {
    memset(&cu, 0, sizeof cu);
    dlclose(lib);
    PS_INFO(NCCL_INIT, "CUDA staging unavailable: %s", cu_why);
    return;
  }
  void *p = dlsym(lib, "cuMemcpyBatchAsync_v2");
  if (p) memcpy(&cu.copy_batch_v2, &p, sizeof p);
  else if ((p = dlsym(lib, "cuMemcpyBatchAsync"))) memcpy(&cu.copy_batch_v1, &p, sizeof p);
  /* From here on the library stays loaded for the life of the process: the
   * driver may have started threads that still run its code. */
  CUresult rc = cu.init(0);
  int n = 0;
  if (rc != CUDA_SUCCESS)
    snprintf(cu_why, sizeof cu_why, "cuInit failed: %s", cu_err(rc));
  else if ((rc = cu.device_get_count(&n)) != CUDA_SUCCESS)
    snprintf(cu_why, sizeof cu_why, "cuDeviceGetCount failed: %s", cu_err(rc));
  else if (n <= 0)
    snprintf(cu_why, sizeof cu_why, "no CUDA device");
  cu_ndev = rc == CUDA_SUCCESS && n > 0 ? n : 0;
  if (!cu_ndev) PS_INFO(NCCL_INIT, "CUDA staging unavailable: %s", cu_why);
}

int ps_cuda_available(void) {
  pthread_once(&cu_once, cu_load);
  return cu_ndev > 0;
}

/* The caller's thread may have a context of its own current (or none): every
 * entry point makes d's current only for its own duration. */
static ncclResult_t ctx_push(ps_cuda_dev_t *d, const char *op) {
  CUresult rc = cu.ctx_push(d->ctx);
  if (rc == CUDA_SUCCESS) return ncclSuccess;
  PS_WARN("%s: cuCtxPushCurrent_v2 (GPU %d) failed: %s", op, d->ordinal, cu_err(rc));
  return ncclUnhandledCudaError;
}

ncclResult_t ps_cuda_bind_thread(ps_cuda_dev_t *d) {
  static __thread const ps_cuda_dev_t *bound; /* checked already on this thread */
  if (bound == d) return ncclSuccess;
  CUdevice dev;
  ncclResult_t rc = ncclSuccess;
  if (cu.ctx_get_device(&dev) != CUDA_SUCCESS) rc = ctx_push(d, "binding a thread to its GPU");
  if (rc == ncclSuccess) bound = d; /* a caller's own context stays */
  return rc;
}

static void ctx_pop(const char *op) {
  CUcontext c;
  CUresult rc = cu.ctx_pop(&c);
  if (rc != CUDA_SUCCESS) PS_WARN("%s: cuCtxPopCurrent_v2 failed: %s", op, cu_err(rc));
}

static ncclResult_t stream_of(ps_cuda_dev_t *d, int s, const char *op, stream_t **out) {
  if (!d || s < 0 || s >= PS_CUDA_NSTREAMS) {
    PS_WARN("%s: bad device %p or stream %d", op, (void *)d, s);
    return ncclInvalidArgument;
  }
  *out = &d->s[s];
  return ncclSuccess;
}

static CUdeviceptr dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

/* Drains the streams first: the caller frees the host buffers they copy into
 * right after close. */
static ncclResult_t hand_over(ps_cuda_dev_t *d, stream_t *x, int mark);

static void dev_destroy(ps_cuda_dev_t *d, int have_ctx) {
  if (d->ctx && ctx_push(d, "ps_cuda_close") == ncclSuccess) {
    for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
      if (!d->s[s].st) continue;
      if (d->s[s].nheld) (void)hand_over(d, &d->s[s], 0); /* as the fake runs them */
      CUresult rc = cu.stream_synchronize(d->s[s].st);
      if (rc != CUDA_SUCCESS) PS_WARN("cuStreamSynchronize (GPU %d) failed: %s", d->ordinal, cu_err(rc));
      rc = cu.stream_destroy(d->s[s].st);
      if (rc != CUDA_SUCCESS) PS_WARN("cuStreamDestroy_v2 (GPU %d) failed: %s", d->ordinal, cu_err(rc));
    }
    if (d->marks_mem) {
      CUresult rc = cu.mem_free_host(d->marks_mem);
      if (rc != CUDA_SUCCESS) PS_WARN("cuMemFreeHost (GPU %d) failed: %s", d->ordinal, cu_err(rc));
    }
    ctx_pop("ps_cuda_close");
  }
  if (have_ctx) {
    CUresult rc = cu.primary_ctx_release(d->dev);
    if (rc != CUDA_SUCCESS) PS_WARN("cuDevicePrimaryCtxRelease_v2 (GPU %d) failed: %s", d->ordinal, cu_err(rc));
  }
  free(d);
}

/* Streams, and the pinned words their marks land in (mapped for the GPU). */
static ncclResult_t make_streams(ps_cuda_dev_t *d) {
  CUresult rc = cu.mem_host_alloc((void **)&d->marks_mem, PS_CUDA_NSTREAMS * 64,
                                  CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
  if (rc != CUDA_SUCCESS) {
    PS_WARN("cuMemHostAlloc (GPU %d, mapped) failed: %s", d->ordinal, cu_err(rc));
    d->marks_mem = NULL;
    return ncclUnhandledCudaError;
  }
  memset(d->marks_mem, 0, PS_CUDA_NSTREAMS * 64);
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
    stream_t *x = &d->s[s];
    x->reached = d->marks_mem + s * 8;
    if ((rc = cu.host_get_device_pointer(&x->reached_dev, (void *)x->reached, 0)) != CUDA_SUCCESS) {
      PS_WARN("cuMemHostGetDevicePointer_v2 (GPU %d) failed: %s", d->ordinal, cu_err(rc));
      return ncclUnhandledCudaError;
    }
    /* Non-blocking: legacy stream 0 work (NCCL's own or the user's) must
     * never hold up a staging copy. */
    if ((rc = cu.stream_create(&x->st, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
      PS_WARN("cuStreamCreate (GPU %d) failed: %s", d->ordinal, cu_err(rc));
      x->st = NULL;
      return ncclUnhandledCudaError;
    }
  }
  return ncclSuccess;
}

ncclResult_t ps_cuda_open(const void *dev_ptr, ps_cuda_dev_t **out) {
  if (!out || !dev_ptr) {
    PS_WARN("ps_cuda_open: NULL %s", out ? "device pointer" : "out");
    return ncclInvalidArgument;
  }
  *out = NULL;
  if (!ps_cuda_available()) {
    PS_WARN("cannot stage through the GPU of %p: %s", dev_ptr, cu_why);
    return ncclSystemError;
  }
  /* Pointer attributes need no current context, so this also finds the GPU
   * of a cuMem (VMM) allocation in a thread that never made one current. */
  unsigned int mtype = 0;
  int ordinal = -1;
  CUresult rc = cu.pointer_get_attribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dptr(dev_ptr));
  if (rc != CUDA_SUCCESS) {
    PS_WARN("%p is not CUDA memory: cuPointerGetAttribute(MEMORY_TYPE) failed: %s", dev_ptr, cu_err(rc));
    return ncclInvalidArgument;
  }
  if (mtype != CU_MEMORYTYPE_DEVICE) {
    PS_WARN("%p is not device memory (CUmemorytype %u)", dev_ptr, mtype);
    return ncclInvalidArgument;
  }
  rc = cu.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dptr(dev_ptr));
  if (rc != CUDA_SUCCESS) {
    PS_WARN("cuPointerGetAttribute(DEVICE_ORDINAL) of %p failed: %s", dev_ptr, cu_err(rc));
    return ncclUnhandledCudaError;
  }
  ps_cuda_dev_t *d = calloc(1, sizeof *d);
  if (!d) {
    PS_WARN("ps_cuda_open: out of memory");
    return ncclSystemError;
  }
  d->ordinal = ordinal;
  if ((rc = cu.device_get(&d->dev, ordinal)) != CUDA_SUCCESS) {
    PS_WARN("cuDeviceGet(%d) failed: %s", ordinal, cu_err(rc));
    dev_destroy(d, 0);
    return ncclUnhandledCudaError;
  }
  if ((rc = cu.primary_ctx_retain(&d->ctx, d->dev)) != CUDA_SUCCESS) {
    PS_WARN("cuDevicePrimaryCtxRetain (GPU %d) failed: %s", ordinal, cu_err(rc));
    d->ctx = NULL;
    dev_destroy(d, 0);
    return ncclUnhandledCudaError;
  }
  ncclResult_t r = ctx_push(d, "ps_cuda_open");
  if (r != ncclSuccess) {
    d->ctx = NULL; /* nothing to destroy in it */
    dev_destroy(d, 1);
    return r;
  }
  r = make_streams(d);
  ctx_pop("ps_cuda_open");
  if (r != ncclSuccess) {
    dev_destroy(d, 1);
    return r;
  }
  PS_INFO(NCCL_INIT, "CUDA staging on GPU %d", ordinal);
  *out = d;
  return ncclSuccess;
}

void ps_cuda_close(ps_cuda_dev_t *d) {
  if (d) dev_destroy(d, 1);
}

int ps_cuda_ordinal(const ps_cuda_dev_t *d) { return d ? d->ordinal : -1; }

/* One byte is device memory of d's GPU. */
static int byte_owned(ps_cuda_dev_t *d, CUdeviceptr p) {
  unsigned int mtype = 0;
  int ordinal = -1;
  return cu.pointer_get_attribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) == CUDA_SUCCESS &&
         mtype == CU_MEMORYTYPE_DEVICE &&
         cu.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) == CUDA_SUCCESS &&
         ordinal == d->ordinal;
}

/* First and last byte: a window NCCL maps from several cuMem chunks spans
 * allocations, so one allocation's range would refuse it. */
int ps_cuda_owns(ps_cuda_dev_t *d, const void *ptr, size_t size) {
  if (!d || !ptr || !size || ctx_push(d, "ps_cuda_owns") != ncclSuccess) return 0;
  CUdeviceptr p = dptr(ptr);
  /* Failures just mean "not ours" (a host pointer fails the first query). */
  int ok = p + size > p && byte_owned(d, p) && byte_owned(d, p + size - 1);
  ctx_pop("ps_cuda_owns");
  return ok;
}

int ps_cuda_ptr_ordinal(const void *ptr) {
  unsigned int mtype = 0;
  int ordinal = -1;
  if (!ptr || !ps_cuda_available()) return -1;
  return cu.pointer_get_attribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dptr(ptr)) == CUDA_SUCCESS &&
                 mtype == CU_MEMORYTYPE_DEVICE &&
                 cu.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dptr(ptr)) ==
                     CUDA_SUCCESS
             ? ordinal
             : -1;
}

/* In GPU `ordinal`'s primary context, retained for the call's duration. */
static CUresult in_primary(int ordinal, CUdeviceptr *p, size_t size) {
  CUdevice dev;
  CUcontext ctx, prev;
  CUresult rc = cu.device_get(&dev, ordinal);
  if (rc != CUDA_SUCCESS || (rc = cu.primary_ctx_retain(&ctx, dev)) != CUDA_SUCCESS) return rc;
  if ((rc = cu.ctx_push(ctx)) == CUDA_SUCCESS) {
    rc = size ? cu.mem_alloc(p, size) : cu.mem_free(*p);
    cu.ctx_pop(&prev);
  }
  cu.primary_ctx_release(dev); /* an allocation keeps its context alive */
  return rc;
}

/* The caller's current GPU only: touching another would create a context
 * there (hundreds of MiB) for a probe. */
ncclResult_t ps_cuda_probe_alloc(size_t size, int *ordinal, void **out) {
  CUdeviceptr p = 0;
  CUdevice dev = -1;
  *out = NULL, *ordinal = -1;
  if (!ps_cuda_available() || !size) return ncclInvalidUsage;
  CUresult rc = cu.ctx_get_device(&dev);
  if (rc != CUDA_SUCCESS) {
    PS_INFO(NCCL_INIT | NCCL_NET, "no current CUDA context to probe with (%s)", cu_err(rc));
    return ncclInvalidUsage;
  }
  if ((rc = in_primary((int)dev, &p, size)) != CUDA_SUCCESS) {
    PS_INFO(NCCL_INIT | NCCL_NET, "cuMemAlloc of %zu bytes on GPU %d failed: %s", size, (int)dev,
            cu_err(rc));
    return ncclUnhandledCudaError;
  }
  *out = (void *)(uintptr_t)p, *ordinal = (int)dev;
  return ncclSuccess;
}

void ps_cuda_probe_free(int ordinal, void *ptr) {
  CUdeviceptr p = dptr(ptr);
  CUresult rc = ptr ? in_primary(ordinal, &p, 0) : CUDA_SUCCESS;
  if (rc != CUDA_SUCCESS) PS_WARN("cuMemFree(%p) on GPU %d failed: %s", ptr, ordinal, cu_err(rc));
}

ncclResult_t ps_cuda_host_alloc(ps_cuda_dev_t *d, size_t size, void **out) {
  if (!d || !out || !size) {
    PS_WARN("ps_cuda_host_alloc: bad arguments (device %p, %zu bytes)", (void *)d, size);
    return ncclInvalidArgument;
  }
  *out = NULL;
  PS_CHECK(ctx_push(d, "ps_cuda_host_alloc"));
  void *p = NULL;
  /* Portable: pinned for every context, not just the one current here. */
  CUresult rc = cu.mem_host_alloc(&p, size, CU_MEMHOSTALLOC_PORTABLE);
  ctx_pop("ps_cuda_host_alloc");
  if (rc != CUDA_SUCCESS) {
    PS_WARN("cuMemHostAlloc of %zu bytes (GPU %d) failed: %s", size, d->ordinal, cu_err(rc));
    return ncclUnhandledCudaError;
  }
  memset(p, 0, size); /* as the fake does, so tests cannot rely on more */
  *out = p;
  return ncclSuccess;
}

void ps_cuda_host_free(ps_cuda_dev_t *d, void *p) {
  if (!d || !p || ctx_push(d, "ps_cuda_host_free") != ncclSuccess) return;
  CUresult rc = cu.mem_free_host(p);
  ctx_pop("ps_cuda_host_free");
  if (rc != CUDA_SUCCESS) PS_WARN("cuMemFreeHost(%p) failed: %s", p, cu_err(rc));
}

/* --- held operations, handed to the driver in runs --- */

static void copy_attr(int kind, int ordinal, cu_copy_attr_t *a) {
  cu_location_t dev = {CU_MEM_LOCATION_TYPE_DEVICE, ordinal}, host = {CU_MEM_LOCATION_TYPE_HOST, 0};
  *a = (cu_copy_attr_t){.src_access_order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                        .src_hint = kind == HELD_D2H ? dev : host,
                        .dst_hint = kind == HELD_D2H ? host : dev};
}

/* Copies h[0..n) (one direction) in one driver call where it can batch. */
static CUresult hand_copies(ps_cuda_dev_t *d, stream_t *x, const held_t *h, uint32_t n) {
  if (n > 1 && (cu.copy_batch_v2 || cu.copy_batch_v1)) {
    CUdeviceptr dst[PS_CUDA_HELD], src[PS_CUDA_HELD];
    size_t len[PS_CUDA_HELD], first = 0, fail = 0;
    cu_copy_attr_t attr;
    copy_attr(h[0].kind, d->ordinal, &attr);
    for (uint32_t i = 0; i < n; i++) dst[i] = h[i].dst, src[i] = h[i].src, len[i] = h[i].n;
    return cu.copy_batch_v2 ? cu.copy_batch_v2(dst, src, len, n, &attr, &first, 1, x->st)
                            : cu.copy_batch_v1(dst, src, len, n, &attr, &first, 1, &fail, x->st);
  }
  CUresult rc = CUDA_SUCCESS;
  for (uint32_t i = 0; i < n && rc == CUDA_SUCCESS; i++) rc = cu.memcpy_async(h[i].dst, h[i].src, h[i].n, x->st);
  return rc;
}

/* Writes h[0..n), and the stream's next mark when `mark`, in one call. */
static CUresult hand_writes(stream_t *x, const held_t *h, uint32_t n, int mark) {
  cu_memop_t op[PS_CUDA_HELD + 1];
  for (uint32_t i = 0; i < n; i++) {
    memset(&op[i], 0, sizeof op[i]);
    op[i].write_value.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op[i].write_value.address = h[i].dst;
    op[i].write_value.value64 = h[i].value;
    op[i].write_value.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  if (mark) {
    memset(&op[n], 0, sizeof op[n]);
    op[n].write_value.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op[n].write_value.address = x->reached_dev;
    op[n].write_value.value64 = x->marks + 1;
    op[n].write_value.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  return cu.batch_memop(x->st, n + (mark ? 1u : 0u), op, 0);
}

/* Hands stream x's held operations over, in runs of one kind, and its mark
 * when `mark` (and anything was handed over since the last). Called with d's
 * context current. */
static ncclResult_t hand_over(ps_cuda_dev_t *d, stream_t *x, int mark) {
  uint32_t i = 0;
  mark = mark && (x->unmarked || x->nheld);
  while (i < x->nheld || mark) {
    uint32_t j = i;
    while (j < x->nheld && x->held[j].kind == x->held[i].kind) j++;
    const char *what = "cuStreamBatchMemOp_v2";
    int marking = 0;
    CUresult rc;
    if (i < x->nheld && x->held[i].kind != HELD_WRITE) {
      what = cu.copy_batch_v2 || cu.copy_batch_v1 ? "cuMemcpyBatchAsync" : "cuMemcpyAsync";
      rc = hand_copies(d, x, &x->held[i], j - i);
    } else {
      marking = mark && j == x->nheld;
      rc = hand_writes(x, &x->held[i], j - i, marking);
    }
    if (rc != CUDA_SUCCESS) {
      PS_WARN("%s (GPU %d, %u operations) failed: %s", what, d->ordinal, j - i, cu_err(rc));
      x->nheld = 0;
      x->failed = 1;
      return ncclUnhandledCudaError;
    }
    if (j > i) x->unmarked = 1;
    if (marking) x->marks++, x->unmarked = 0, mark = 0;
    i = j;
  }
  x->nheld = 0;
  return ncclSuccess;
}

static int overlaps(CUdeviceptr a, size_t an, CUdeviceptr b, size_t bn) {
  return a < b + bn && b < a + an;
}

/* Holds op on stream s; hands the held ones over first where op could not
 * join them (another kind of copy, an overlap, no room). */
static ncclResult_t hold(ps_cuda_dev_t *d, int s, const held_t *op, const char *what,
                         uint64_t *ticket) {
  stream_t *x;
  PS_CHECK(stream_of(d, s, what, &x));
  if (!ticket) {
    PS_WARN("%s: NULL ticket", what);
    return ncclInvalidArgument;
  }
  int flush = x->nheld == PS_CUDA_HELD;
  if (op->kind != HELD_WRITE && x->nheld && x->held[x->nheld - 1].kind == op->kind) {
    for (uint32_t i = x->nheld; i-- > 0 && x->held[i].kind == op->kind && !flush;)
      flush = overlaps(op->dst, op->n, x->held[i].dst, x->held[i].n) ||
              overlaps(op->dst, op->n, x->held[i].src, x->held[i].n) ||
              overlaps(op->src, op->n, x->held[i].dst, x->held[i].n);
  }
  if (flush) {
    PS_CHECK(ctx_push(d, what));
    ncclResult_t r = hand_over(d, x, 0);
    ctx_pop(what);
    PS_CHECK(r);
  }
  held_t *last = x->nheld ? &x->held[x->nheld - 1] : NULL;
  if (last && op->kind != HELD_WRITE && last->kind == op->kind && last->src + last->n == op->src &&
      last->dst + last->n == op->dst) {
    last->n += op->n; /* the driver's cost is per copy: adjacent chunks go as one */
  } else {
    x->held[x->nheld++] = *op;
  }
  *ticket = x->marks + 1;
  return ncclSuccess;
}

ncclResult_t ps_cuda_d2h(ps_cuda_dev_t *d, int s, void *host_dst, const void *dev_src, size_t n,
                         uint64_t *ticket) {
  held_t op = {.kind = HELD_D2H, .dst = dptr(host_dst), .src = dptr(dev_src), .n = n};
  return hold(d, s, &op, "ps_cuda_d2h", ticket);
}

ncclResult_t ps_cuda_h2d(ps_cuda_dev_t *d, int s, void *dev_dst, const void *host_src, size_t n,
                         uint64_t *ticket) {
  held_t op = {.kind = HELD_H2D, .dst = dptr(dev_dst), .src = dptr(host_src), .n = n};
  return hold(d, s, &op, "ps_cuda_h2d", ticket);
}

ncclResult_t ps_cuda_write64(ps_cuda_dev_t *d, int s, void *dev_dst, uint64_t value,
                             uint64_t *ticket) {
  if ((uintptr_t)dev_dst % 8) {
    PS_WARN("ps_cuda_write64: %p is not 8-byte aligned", dev_dst);
    return ncclInvalidArgument;
  }
  held_t op = {.kind = HELD_WRITE, .dst = dptr(dev_dst), .value = value};
  return hold(d, s, &op, "ps_cuda_write64", ticket);
}

ncclResult_t ps_cuda_flush(ps_cuda_dev_t *d) {
  if (!d) {
    PS_WARN("ps_cuda_flush: NULL device");
    return ncclInvalidArgument;
  }
  int any = 0;
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) any |= d->s[s].nheld || d->s[s].unmarked;
  if (!any) return ncclSuccess;
  PS_CHECK(ctx_push(d, "ps_cuda_flush"));
  ncclResult_t r = ncclSuccess;
  for (int s = 0; s < PS_CUDA_NSTREAMS && r == ncclSuccess; s++) r = hand_over(d, &d->s[s], 1);
  ctx_pop("ps_cuda_flush");
  return r;
}

int ps_cuda_passed(ps_cuda_dev_t *d, int s, uint64_t ticket) {
  stream_t *x;
  if (stream_of(d, s, "ps_cuda_passed", &x) != ncclSuccess || x->failed) return -1;
  if (__atomic_load_n(x->reached, __ATOMIC_ACQUIRE) >= ticket) return 1;
  if (ticket > x->marks) return 0; /* its mark is not on the stream yet */
  uint64_t now = ps_now_ns();
  if (now < x->next_query_ns) return 0;
  x->next_query_ns = now + 1000000;
  if (ctx_push(d, "ps_cuda_passed") != ncclSuccess) return -1;
  CUresult rc = cu.stream_query(x->st);
  ctx_pop("ps_cuda_passed");
  if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_NOT_READY) {
    PS_WARN("cuStreamQuery (GPU %d, stream %d) failed: %s", d->ordinal, s, cu_err(rc));
    return -1;
  }
  return __atomic_load_n(x->reached, __ATOMIC_ACQUIRE) >= ticket;
}

uint64_t ps_cuda_last_mark(const ps_cuda_dev_t *d, int s) {
  return d && s >= 0 && s < PS_CUDA_NSTREAMS ? d->s[s].marks : 0;
}
