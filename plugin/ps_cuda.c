/* The CUDA driver slice of ps_cuda.h, loaded with dlopen so the plugin still
 * loads (and serves host memory) where libcuda.so.1 is absent: the driver,
 * devices and memory (the streams are ps_cuda_stream.c's). */
#include "ps_cuda_int.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_clock.h"
#include "ps_log.h"

ps_cu_api_t ps_cu;

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_ndev;       /* devices cuInit found; 0 when the driver is unusable */
static char cu_why[256];  /* why it is unusable */

const char *ps_cu_err(CUresult rc) {
  static _Thread_local char num[40];
  const char *s = NULL;
  if (ps_cu.get_error_string && ps_cu.get_error_string(rc, &s) == CUDA_SUCCESS && s) return s;
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
  _Static_assert(sizeof(void *) == sizeof(ps_cu.init), "function pointers must fit a void *");
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *e = dlerror();
    snprintf(cu_why, sizeof cu_why, "dlopen(libcuda.so.1) failed: %s", e ? e : "?");
    PS_INFO(NCCL_INIT, "CUDA staging unavailable: %s", cu_why);
    return;
  }
  if (cu_sym(lib, "cuInit", &ps_cu.init) || cu_sym(lib, "cuGetErrorString", &ps_cu.get_error_string) ||
      cu_sym(lib, "cuDeviceGetCount", &ps_cu.device_get_count) || cu_sym(lib, "cuDeviceGet", &ps_cu.device_get) ||
      cu_sym(lib, "cuDeviceGetAttribute", &ps_cu.device_get_attribute) ||
      cu_sym(lib, "cuDevicePrimaryCtxRetain", &ps_cu.primary_ctx_retain) ||
      cu_sym(lib, "cuDevicePrimaryCtxRelease_v2", &ps_cu.primary_ctx_release) ||
      cu_sym(lib, "cuCtxPushCurrent_v2", &ps_cu.ctx_push) || cu_sym(lib, "cuCtxPopCurrent_v2", &ps_cu.ctx_pop) ||
      cu_sym(lib, "cuPointerGetAttribute", &ps_cu.pointer_get_attribute) ||
      cu_sym(lib, "cuMemHostAlloc", &ps_cu.mem_host_alloc) || cu_sym(lib, "cuMemFreeHost", &ps_cu.mem_free_host) ||
      cu_sym(lib, "cuCtxGetDevice", &ps_cu.ctx_get_device) || cu_sym(lib, "cuMemAlloc_v2", &ps_cu.mem_alloc) || cu_sym(lib, "cuMemFree_v2", &ps_cu.mem_free) ||
      cu_sym(lib, "cuStreamCreate", &ps_cu.stream_create) ||
      cu_sym(lib, "cuStreamSynchronize", &ps_cu.stream_synchronize) ||
      cu_sym(lib, "cuStreamDestroy_v2", &ps_cu.stream_destroy) ||
      cu_sym(lib, "cuStreamQuery", &ps_cu.stream_query) ||
      cu_sym(lib, "cuMemHostGetDevicePointer_v2", &ps_cu.host_get_device_pointer) ||
      cu_sym(lib, "cuMemcpyAsync", &ps_cu.memcpy_async) ||
      cu_sym(lib, "cuStreamBatchMemOp_v2", &ps_cu.batch_memop)) {
    memset(&ps_cu, 0, sizeof ps_cu);
    dlclose(lib);
    PS_INFO(NCCL_INIT, "CUDA staging unavailable: %s", cu_why);
    return;
  }
  void *p = dlsym(lib, "cuMemcpyBatchAsync_v2");
  if (p) memcpy(&ps_cu.copy_batch_v2, &p, sizeof p);
  else if ((p = dlsym(lib, "cuMemcpyBatchAsync"))) memcpy(&ps_cu.copy_batch_v1, &p, sizeof p);
  if ((p = dlsym(lib, "cuMemGetHandleForAddressRange"))) memcpy(&ps_cu.range_handle, &p, sizeof p);
  /* From here on the library stays loaded for the life of the process: the
   * driver may have started threads that still run its code. */
  CUresult rc = ps_cu.init(0);
  int n = 0;
  if (rc != CUDA_SUCCESS)
    snprintf(cu_why, sizeof cu_why, "cuInit failed: %s", ps_cu_err(rc));
  else if ((rc = ps_cu.device_get_count(&n)) != CUDA_SUCCESS)
    snprintf(cu_why, sizeof cu_why, "cuDeviceGetCount failed: %s", ps_cu_err(rc));
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
ncclResult_t ps_cu_ctx_push(ps_cuda_dev_t *d, const char *op) {
  CUresult rc = ps_cu.ctx_push(d->ctx);
  if (rc == CUDA_SUCCESS) return ncclSuccess;
  PS_WARN("%s: cuCtxPushCurrent_v2 (GPU %d) failed: %s", op, d->ordinal, ps_cu_err(rc));
  return ncclUnhandledCudaError;
}

ncclResult_t ps_cuda_bind_thread(ps_cuda_dev_t *d) {
  static __thread const ps_cuda_dev_t *bound; /* checked already on this thread */
  if (bound == d) return ncclSuccess;
  CUdevice dev;
  ncclResult_t rc = ncclSuccess;
  if (ps_cu.ctx_get_device(&dev) != CUDA_SUCCESS) rc = ps_cu_ctx_push(d, "binding a thread to its GPU");
  if (rc == ncclSuccess) bound = d; /* a caller's own context stays */
  return rc;
}

void ps_cu_ctx_pop(const char *op) {
  CUcontext c;
  CUresult rc = ps_cu.ctx_pop(&c);
  if (rc != CUDA_SUCCESS) PS_WARN("%s: cuCtxPopCurrent_v2 failed: %s", op, ps_cu_err(rc));
}

/* Drains the streams first: the caller frees the host buffers they copy into
 * right after close. */
static void dev_destroy(ps_cuda_dev_t *d, int have_ctx) {
  if (d->ctx && ps_cu_ctx_push(d, "ps_cuda_close") == ncclSuccess) {
    ps_cuda_streams_stop(d);
    ps_cu_ctx_pop("ps_cuda_close");
  }
  if (have_ctx) {
    CUresult rc = ps_cu.primary_ctx_release(d->dev);
    if (rc != CUDA_SUCCESS) PS_WARN("cuDevicePrimaryCtxRelease_v2 (GPU %d) failed: %s", d->ordinal, ps_cu_err(rc));
  }
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
  CUresult rc = ps_cu.pointer_get_attribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ps_cu_dptr(dev_ptr));
  if (rc != CUDA_SUCCESS) {
    PS_WARN("%p is not CUDA memory: cuPointerGetAttribute(MEMORY_TYPE) failed: %s", dev_ptr, ps_cu_err(rc));
    return ncclInvalidArgument;
  }
  if (mtype != CU_MEMORYTYPE_DEVICE) {
    PS_WARN("%p is not device memory (CUmemorytype %u)", dev_ptr, mtype);
    return ncclInvalidArgument;
  }
  rc = ps_cu.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ps_cu_dptr(dev_ptr));
  if (rc != CUDA_SUCCESS) {
    PS_WARN("cuPointerGetAttribute(DEVICE_ORDINAL) of %p failed: %s", dev_ptr, ps_cu_err(rc));
    return ncclUnhandledCudaError;
  }
  ps_cuda_dev_t *d = calloc(1, sizeof *d);
  if (!d) {
    PS_WARN("ps_cuda_open: out of memory");
    return ncclSystemError;
  }
  d->ordinal = ordinal;
  if ((rc = ps_cu.device_get(&d->dev, ordinal)) != CUDA_SUCCESS) {
    PS_WARN("cuDeviceGet(%d) failed: %s", ordinal, ps_cu_err(rc));
    dev_destroy(d, 0);
    return ncclUnhandledCudaError;
  }
  if ((rc = ps_cu.primary_ctx_retain(&d->ctx, d->dev)) != CUDA_SUCCESS) {
    PS_WARN("cuDevicePrimaryCtxRetain (GPU %d) failed: %s", ordinal, ps_cu_err(rc));
    d->ctx = NULL;
    dev_destroy(d, 0);
    return ncclUnhandledCudaError;
  }
  ncclResult_t r = ps_cu_ctx_push(d, "ps_cuda_open");
  if (r != ncclSuccess) {
    d->ctx = NULL; /* nothing to destroy in it */
    dev_destroy(d, 1);
    return r;
  }
  r = ps_cuda_streams_start(d);
  ps_cu_ctx_pop("ps_cuda_open");
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
  return ps_cu.pointer_get_attribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) == CUDA_SUCCESS &&
         mtype == CU_MEMORYTYPE_DEVICE &&
         ps_cu.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) == CUDA_SUCCESS &&
         ordinal == d->ordinal;
}

/* First and last byte: a window NCCL maps from several cuMem chunks spans
 * allocations, so one allocation's range would refuse it. */
int ps_cuda_owns(ps_cuda_dev_t *d, const void *ptr, size_t size) {
  if (!d || !ptr || !size || ps_cu_ctx_push(d, "ps_cuda_owns") != ncclSuccess) return 0;
  CUdeviceptr p = ps_cu_dptr(ptr);
  /* Failures just mean "not ours" (a host pointer fails the first query). */
  int ok = p + size > p && byte_owned(d, p) && byte_owned(d, p + size - 1);
  ps_cu_ctx_pop("ps_cuda_owns");
  return ok;
}

int ps_cuda_ptr_ordinal(const void *ptr) {
  unsigned int mtype = 0;
  int ordinal = -1;
  if (!ptr || !ps_cuda_available()) return -1;
  return ps_cu.pointer_get_attribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ps_cu_dptr(ptr)) == CUDA_SUCCESS &&
                 mtype == CU_MEMORYTYPE_DEVICE &&
                 ps_cu.pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ps_cu_dptr(ptr)) ==
                     CUDA_SUCCESS
             ? ordinal
             : -1;
}

/* In GPU `ordinal`'s primary context, retained for the call's duration:
 * allocate (size > 0), free (size 0, fd NULL), or export [*p, + page) as a
 * dma-buf into *fd. */
static CUresult in_primary(int ordinal, CUdeviceptr *p, size_t size, int *fd) {
  CUdevice dev;
  CUcontext ctx, prev;
  CUresult rc = ps_cu.device_get(&dev, ordinal);
  if (rc != CUDA_SUCCESS || (rc = ps_cu.primary_ctx_retain(&ctx, dev)) != CUDA_SUCCESS) return rc;
  if ((rc = ps_cu.ctx_push(ctx)) == CUDA_SUCCESS) {
    if (fd)
      rc = ps_cu.range_handle(fd, *p, size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    else
      rc = size ? ps_cu.mem_alloc(p, size) : ps_cu.mem_free(*p);
    ps_cu.ctx_pop(&prev);
  }
  ps_cu.primary_ctx_release(dev); /* an allocation keeps its context alive */
  return rc;
}

/* The caller's current GPU only: touching another would create a context
 * there (hundreds of MiB) for a probe. */
ncclResult_t ps_cuda_probe_alloc(size_t size, int *ordinal, void **out) {
  CUdeviceptr p = 0;
  CUdevice dev = -1;
  *out = NULL, *ordinal = -1;
  if (!ps_cuda_available() || !size) return ncclInvalidUsage;
  CUresult rc = ps_cu.ctx_get_device(&dev);
  if (rc != CUDA_SUCCESS) {
    PS_INFO(NCCL_INIT | NCCL_NET, "no current CUDA context to probe with (%s)", ps_cu_err(rc));
    return ncclInvalidUsage;
  }
  if ((rc = in_primary((int)dev, &p, size, NULL)) != CUDA_SUCCESS) {
    PS_INFO(NCCL_INIT | NCCL_NET, "cuMemAlloc of %zu bytes on GPU %d failed: %s", size, (int)dev,
            ps_cu_err(rc));
    return ncclUnhandledCudaError;
  }
  *out = (void *)(uintptr_t)p, *ordinal = (int)dev;
  return ncclSuccess;
}

void ps_cuda_probe_free(int ordinal, void *ptr) {
  CUdeviceptr p = ps_cu_dptr(ptr);
  CUresult rc = ptr ? in_primary(ordinal, &p, 0, NULL) : CUDA_SUCCESS;
  if (rc != CUDA_SUCCESS) PS_WARN("cuMemFree(%p) on GPU %d failed: %s", ptr, ordinal, ps_cu_err(rc));
}

int ps_cuda_compute_major(int ordinal) {
  CUdevice dev;
  int major = -1;
  if (!ps_cuda_available() || ps_cu.device_get(&dev, ordinal) != CUDA_SUCCESS ||
      ps_cu.device_get_attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) !=
          CUDA_SUCCESS)
    return -1;
  return major;
}

ncclResult_t ps_cuda_dmabuf_export(int ordinal, const void *ptr, size_t size, int *fd,
                                   uint64_t *offset) {
  *fd = -1, *offset = 0;
  if (!ps_cuda_available() || !ps_cu.range_handle) {
    PS_INFO(NCCL_INIT | NCCL_NET, "no dma-buf export: the CUDA driver lacks cuMemGetHandleForAddressRange");
    return ncclInvalidUsage;
  }
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), start = (uintptr_t)ptr & ~(page - 1);
  size_t len = ((uintptr_t)ptr + size - start + page - 1) & ~(page - 1);
  CUdeviceptr p = (CUdeviceptr)start;
  CUresult rc = in_primary(ordinal, &p, len, fd);
  if (rc != CUDA_SUCCESS) {
    PS_INFO(NCCL_INIT | NCCL_NET, "no dma-buf for %p (%zu B) on GPU %d: %s", ptr, size, ordinal,
            ps_cu_err(rc));
    *fd = -1;
    return ncclUnhandledCudaError;
  }
  *offset = (uintptr_t)ptr - start;
  return ncclSuccess;
}

ncclResult_t ps_cuda_host_alloc(ps_cuda_dev_t *d, size_t size, void **out) {
  if (!d || !out || !size) {
    PS_WARN("ps_cuda_host_alloc: bad arguments (device %p, %zu bytes)", (void *)d, size);
    return ncclInvalidArgument;
  }
  *out = NULL;
  PS_CHECK(ps_cu_ctx_push(d, "ps_cuda_host_alloc"));
  void *p = NULL;
  /* Portable: pinned for every context, not just the one current here. */
  CUresult rc = ps_cu.mem_host_alloc(&p, size, CU_MEMHOSTALLOC_PORTABLE);
  ps_cu_ctx_pop("ps_cuda_host_alloc");
  if (rc != CUDA_SUCCESS) {
    PS_WARN("cuMemHostAlloc of %zu bytes (GPU %d) failed: %s", size, d->ordinal, ps_cu_err(rc));
    return ncclUnhandledCudaError;
  }
  memset(p, 0, size); /* as the fake does, so tests cannot rely on more */
  *out = p;
  return ncclSuccess;
}

void ps_cuda_host_free(ps_cuda_dev_t *d, void *p) {
  if (!d || !p || ps_cu_ctx_push(d, "ps_cuda_host_free") != ncclSuccess) return;
  CUresult rc = ps_cu.mem_free_host(p);
  ps_cu_ctx_pop("ps_cuda_host_free");
  if (rc != CUDA_SUCCESS) PS_WARN("cuMemFreeHost(%p) failed: %s", p, ps_cu_err(rc));
}

