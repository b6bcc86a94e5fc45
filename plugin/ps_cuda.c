/* The CUDA driver slice of ps_cuda.h, loaded with dlopen so the plugin still
 * loads (and serves host memory) where libcuda.so.1 is absent. */
#include "ps_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_log.h"

/* Our own spelling of the few driver types and values used, so no cuda.h is
 * needed to build; every value is checked against cuda.h (CUDA 13.0). */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct ps_cu_ctx_st *CUcontext;
typedef struct ps_cu_stream_st *CUstream;
typedef struct ps_cu_event_st *CUevent;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_NOT_READY = 600,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  CU_MEMORYTYPE_DEVICE = 2,
  CU_STREAM_NON_BLOCKING = 1,
  CU_EVENT_DISABLE_TIMING = 2,
  CU_MEMHOSTALLOC_PORTABLE = 1,
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
  CUresult (*stream_create)(CUstream *, unsigned int);
  CUresult (*stream_synchronize)(CUstream);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*memcpy_dtoh_async)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*stream_write_value64)(CUstream, CUdeviceptr, uint64_t, unsigned int);
  CUresult (*event_create)(CUevent *, unsigned int);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_query)(CUevent);
  CUresult (*event_destroy)(CUevent);
} cu;

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_ndev;       /* devices cuInit found; 0 when the driver is unusable */
static char cu_why[256];  /* why it is unusable */

struct ps_cuda_event {
  CUevent ev;
  struct ps_cuda_event *next;     /* free list */
  struct ps_cuda_event *all_next; /* every event of the device, for close */
};

struct ps_cuda_dev {
  int ordinal;
  CUdevice dev;
  CUcontext ctx;
  CUstream stream[PS_CUDA_NSTREAMS];
  pthread_mutex_t lock; /* the event pool */
  ps_cuda_event_t *free_ev, *all_ev;
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
      cu_sym(lib, "cuStreamCreate", &cu.stream_create) ||
      cu_sym(lib, "cuStreamSynchronize", &cu.stream_synchronize) ||
      cu_sym(lib, "cuStreamDestroy_v2", &cu.stream_destroy) ||
      cu_sym(lib, "cuMemcpyHtoDAsync_v2", &cu.memcpy_htod_async) ||
      cu_sym(lib, "cuMemcpyDtoHAsync_v2", &cu.memcpy_dtoh_async) ||
      cu_sym(lib, "cuStreamWriteValue64_v2", &cu.stream_write_value64) ||
      cu_sym(lib, "cuEventCreate", &cu.event_create) || cu_sym(lib, "cuEventRecord", &cu.event_record) ||
      cu_sym(lib, "cuEventQuery", &cu.event_query) || cu_sym(lib, "cuEventDestroy_v2", &cu.event_destroy)) {
    memset(&cu, 0, sizeof cu);
    dlclose(lib);
    PS_INFO(NCCL_INIT, "CUDA staging unavailable: %s", cu_why);
    return;
  }
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

static void ctx_pop(const char *op) {
  CUcontext c;
  CUresult rc = cu.ctx_pop(&c);
  if (rc != CUDA_SUCCESS) PS_WARN("%s: cuCtxPopCurrent_v2 failed: %s", op, cu_err(rc));
}

static ncclResult_t stream_of(ps_cuda_dev_t *d, int s, const char *op, CUstream *out) {
  if (!d || s < 0 || s >= PS_CUDA_NSTREAMS) {
    PS_WARN("%s: bad device %p or stream %d", op, (void *)d, s);
    return ncclInvalidArgument;
  }
  *out = d->stream[s];
  return ncclSuccess;
}

static CUdeviceptr dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

/* Drains the streams first: the caller frees the host buffers they copy into
 * right after close. */
static void dev_destroy(ps_cuda_dev_t *d, int have_ctx) {
  if (d->ctx && ctx_push(d, "ps_cuda_close") == ncclSuccess) {
    for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
      if (!d->stream[s]) continue;
      CUresult rc = cu.stream_synchronize(d->stream[s]);
      if (rc != CUDA_SUCCESS) PS_WARN("cuStreamSynchronize (GPU %d) failed: %s", d->ordinal, cu_err(rc));
      rc = cu.stream_destroy(d->stream[s]);
      if (rc != CUDA_SUCCESS) PS_WARN("cuStreamDestroy_v2 (GPU %d) failed: %s", d->ordinal, cu_err(rc));
    }
    for (ps_cuda_event_t *e = d->all_ev, *n; e; e = n) {
      n = e->all_next;
      CUresult rc = cu.event_destroy(e->ev);
      if (rc != CUDA_SUCCESS) PS_WARN("cuEventDestroy_v2 (GPU %d) failed: %s", d->ordinal, cu_err(rc));
      free(e);
    }
    d->all_ev = NULL;
    ctx_pop("ps_cuda_close");
  }
  for (ps_cuda_event_t *e = d->all_ev, *n; e; e = n) { /* only when the push failed */
    n = e->all_next;
    free(e);
  }
  if (have_ctx) {
    CUresult rc = cu.primary_ctx_release(d->dev);
    if (rc != CUDA_SUCCESS) PS_WARN("cuDevicePrimaryCtxRelease_v2 (GPU %d) failed: %s", d->ordinal, cu_err(rc));
  }
  pthread_mutex_destroy(&d->lock);
  free(d);
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
  if (pthread_mutex_init(&d->lock, NULL)) {
    PS_WARN("ps_cuda_open: pthread_mutex_init failed");
    free(d);
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
  for (int s = 0; s < PS_CUDA_NSTREAMS && r == ncclSuccess; s++) {
    /* Non-blocking: legacy stream 0 work (NCCL's own or the user's) must
     * never hold up a staging copy. */
    if ((rc = cu.stream_create(&d->stream[s], CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
      PS_WARN("cuStreamCreate (GPU %d) failed: %s", ordinal, cu_err(rc));
      d->stream[s] = NULL;
      r = ncclUnhandledCudaError;
    }
  }
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

ncclResult_t ps_cuda_d2h(ps_cuda_dev_t *d, int s, void *host_dst, const void *dev_src, size_t n) {
  CUstream st;
  PS_CHECK(stream_of(d, s, "ps_cuda_d2h", &st));
  PS_CHECK(ctx_push(d, "ps_cuda_d2h"));
  CUresult rc = cu.memcpy_dtoh_async(host_dst, dptr(dev_src), n, st);
  ctx_pop("ps_cuda_d2h");
  if (rc == CUDA_SUCCESS) return ncclSuccess;
  PS_WARN("cuMemcpyDtoHAsync_v2 of %zu bytes %p -> %p (GPU %d) failed: %s", n, dev_src, host_dst, d->ordinal,
          cu_err(rc));
  return ncclUnhandledCudaError;
}

ncclResult_t ps_cuda_h2d(ps_cuda_dev_t *d, int s, void *dev_dst, const void *host_src, size_t n) {
  CUstream st;
  PS_CHECK(stream_of(d, s, "ps_cuda_h2d", &st));
  PS_CHECK(ctx_push(d, "ps_cuda_h2d"));
  CUresult rc = cu.memcpy_htod_async(dptr(dev_dst), host_src, n, st);
  ctx_pop("ps_cuda_h2d");
  if (rc == CUDA_SUCCESS) return ncclSuccess;
  PS_WARN("cuMemcpyHtoDAsync_v2 of %zu bytes %p -> %p (GPU %d) failed: %s", n, host_src, dev_dst, d->ordinal,
          cu_err(rc));
  return ncclUnhandledCudaError;
}

ncclResult_t ps_cuda_write64(ps_cuda_dev_t *d, int s, void *dev_dst, uint64_t value) {
  CUstream st;
  PS_CHECK(stream_of(d, s, "ps_cuda_write64", &st));
  if ((uintptr_t)dev_dst % 8) {
    PS_WARN("ps_cuda_write64: %p is not 8-byte aligned", dev_dst);
    return ncclInvalidArgument;
  }
  PS_CHECK(ctx_push(d, "ps_cuda_write64"));
  CUresult rc = cu.stream_write_value64(st, dptr(dev_dst), value, CU_STREAM_WRITE_VALUE_DEFAULT);
  ctx_pop("ps_cuda_write64");
  if (rc == CUDA_SUCCESS) return ncclSuccess;
  PS_WARN("cuStreamWriteValue64_v2 to %p (GPU %d) failed: %s", dev_dst, d->ordinal, cu_err(rc));
  return ncclUnhandledCudaError;
}

/* Called with d's context current. */
static ncclResult_t event_get(ps_cuda_dev_t *d, ps_cuda_event_t **out) {
  pthread_mutex_lock(&d->lock);
  ps_cuda_event_t *e = d->free_ev;
  if (e) d->free_ev = e->next;
  pthread_mutex_unlock(&d->lock);
  if (!e) {
    if (!(e = calloc(1, sizeof *e))) {
      PS_WARN("ps_cuda_event_record: out of memory");
      return ncclSystemError;
    }
    /* no timing: cheaper to record and query */
    CUresult rc = cu.event_create(&e->ev, CU_EVENT_DISABLE_TIMING);
    if (rc != CUDA_SUCCESS) {
      PS_WARN("cuEventCreate (GPU %d) failed: %s", d->ordinal, cu_err(rc));
      free(e);
      return ncclUnhandledCudaError;
    }
    pthread_mutex_lock(&d->lock);
    e->all_next = d->all_ev;
    d->all_ev = e;
    pthread_mutex_unlock(&d->lock);
  }
  *out = e;
  return ncclSuccess;
}

void ps_cuda_event_release(ps_cuda_dev_t *d, ps_cuda_event_t *ev) {
  if (!d || !ev) return;
  pthread_mutex_lock(&d->lock);
  ev->next = d->free_ev;
  d->free_ev = ev;
  pthread_mutex_unlock(&d->lock);
}

ncclResult_t ps_cuda_event_record(ps_cuda_dev_t *d, int s, ps_cuda_event_t **out) {
  CUstream st;
  PS_CHECK(stream_of(d, s, "ps_cuda_event_record", &st));
  if (!out) {
    PS_WARN("ps_cuda_event_record: NULL out");
    return ncclInvalidArgument;
  }
  *out = NULL;
  PS_CHECK(ctx_push(d, "ps_cuda_event_record"));
  ps_cuda_event_t *e = NULL;
  ncclResult_t r = event_get(d, &e);
  if (r == ncclSuccess) {
    CUresult rc = cu.event_record(e->ev, st);
    if (rc != CUDA_SUCCESS) {
      PS_WARN("cuEventRecord (GPU %d, stream %d) failed: %s", d->ordinal, s, cu_err(rc));
      ps_cuda_event_release(d, e);
      r = ncclUnhandledCudaError;
    }
  }
  ctx_pop("ps_cuda_event_record");
  if (r == ncclSuccess) *out = e;
  return r;
}

int ps_cuda_event_done(ps_cuda_dev_t *d, ps_cuda_event_t *ev) {
  if (!d || !ev) {
    PS_WARN("ps_cuda_event_done: NULL %s", d ? "event" : "device");
    return -1;
  }
  if (ctx_push(d, "ps_cuda_event_done") != ncclSuccess) return -1;
  CUresult rc = cu.event_query(ev->ev);
  ctx_pop("ps_cuda_event_done");
  if (rc == CUDA_SUCCESS) return 1;
  if (rc == CUDA_ERROR_NOT_READY) return 0;
  PS_WARN("cuEventQuery (GPU %d) failed: %s", d->ordinal, cu_err(rc));
  return -1;
}
