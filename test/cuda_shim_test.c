/* GPU test of the real ps_cuda.c, linked directly: ownership checks, copies
 * both ways, write64 ordered after the copy before it, events that are done
 * only after their work, pools that do not grow, and every call from a
 * thread with no (or another) context current. Exits 77 without a GPU. */
#ifndef _GNU_SOURCE /* meson passes it; a bare -std=c11 compile needs POSIX */
#define _POSIX_C_SOURCE 200809L
#endif
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ps_cuda.h"
#include "unit_check.h"

/* The driver calls the test itself needs: allocations and contexts. */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct cu_ctx_st *CUcontext;
typedef struct {
  int type, id; /* CUmemLocationType (DEVICE = 1), ordinal */
} cu_mem_location_t;
typedef struct {
  int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requested_handle_types; /* CU_MEM_HANDLE_TYPE_NONE = 0 */
  cu_mem_location_t location;
  void *win32_meta;
  unsigned char compression, gdr_capable;
  unsigned short usage;
  unsigned char reserved[4];
} cu_mem_prop_t; /* CUmemAllocationProp */
typedef struct {
  cu_mem_location_t location;
  int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} cu_mem_access_t; /* CUmemAccessDesc */

static struct {
  CUresult (*init)(unsigned int);
  CUresult (*device_get_count)(int *);
  CUresult (*device_get)(int *, int);
  CUresult (*primary_ctx_retain)(CUcontext *, int);
  CUresult (*primary_ctx_release)(int);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*ctx_get_current)(CUcontext *);
  CUresult (*mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*granularity)(size_t *, const cu_mem_prop_t *, int);
  CUresult (*mem_create)(unsigned long long *, size_t, const cu_mem_prop_t *, unsigned long long);
  CUresult (*mem_release)(unsigned long long);
  CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
  CUresult (*mem_unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const cu_mem_access_t *, size_t);
} cu;

static char why[256];

static int sym(void *lib, const char *name, void *slot) {
  void *p = dlsym(lib, name);
  if (!p) snprintf(why, sizeof why, "libcuda.so.1 lacks %s", name);
  else memcpy(slot, &p, sizeof p);
  return !p;
}

static int load_driver(int *ndev) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(why, sizeof why, "dlopen(libcuda.so.1): %s", dlerror());
    return -1;
  }
  if (sym(lib, "cuInit", &cu.init) || sym(lib, "cuDeviceGetCount", &cu.device_get_count) ||
      sym(lib, "cuDeviceGet", &cu.device_get) || sym(lib, "cuDevicePrimaryCtxRetain", &cu.primary_ctx_retain) ||
      sym(lib, "cuDevicePrimaryCtxRelease_v2", &cu.primary_ctx_release) ||
      sym(lib, "cuCtxSetCurrent", &cu.ctx_set_current) || sym(lib, "cuCtxGetCurrent", &cu.ctx_get_current) ||
      sym(lib, "cuMemAlloc_v2", &cu.mem_alloc) || sym(lib, "cuMemFree_v2", &cu.mem_free) ||
      sym(lib, "cuMemGetAllocationGranularity", &cu.granularity) || sym(lib, "cuMemCreate", &cu.mem_create) ||
      sym(lib, "cuMemRelease", &cu.mem_release) || sym(lib, "cuMemAddressReserve", &cu.address_reserve) ||
      sym(lib, "cuMemAddressFree", &cu.address_free) || sym(lib, "cuMemMap", &cu.mem_map) ||
      sym(lib, "cuMemUnmap", &cu.mem_unmap) || sym(lib, "cuMemSetAccess", &cu.set_access))
    return -1;
  int rc = cu.init(0);
  if (rc || (rc = cu.device_get_count(ndev)) || *ndev < 1) {
    snprintf(why, sizeof why, "cuInit/cuDeviceGetCount: CUresult %d, %d devices", rc, *ndev);
    return -1;
  }
  return 0;
}

#define MIB (1024u * 1024u)
#define DEV_BYTES (8 * MIB)
#define DATA_BYTES (4 * MIB)

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint64_t rnd(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return rng;
}

static void *at(CUdeviceptr p, size_t off) { return (void *)(uintptr_t)(p + off); }

/* Polls for up to 20 s: event_done's last answer. */
static int wait_done(ps_cuda_dev_t *d, ps_cuda_event_t *ev) {
  int r = 0;
  struct timespec ts = {0, 10000};
  for (long i = 0; i < 2000000 && (r = ps_cuda_event_done(d, ev)) == 0; i++) nanosleep(&ts, NULL);
  return r;
}

/* Enqueues an event on s, waits for it, releases it: 1 when it completed. */
static int sync_stream(ps_cuda_dev_t *d, int s) {
  ps_cuda_event_t *ev = NULL;
  if (ps_cuda_event_record(d, s, &ev) != ncclSuccess) return 0;
  int r = wait_done(d, ev);
  ps_cuda_event_release(d, ev);
  return r == 1;
}

/* h2d then d2h of random sizes and offsets, through pinned buffers. */
static void round_trips(ps_cuda_dev_t *d, CUdeviceptr dev, size_t dev_bytes, int iters, const char *what) {
  unsigned char *src = NULL, *dst = NULL;
  EXPECT(ps_cuda_host_alloc(d, DATA_BYTES, (void **)&src) == ncclSuccess &&
         ps_cuda_host_alloc(d, DATA_BYTES, (void **)&dst) == ncclSuccess, "%s: host_alloc failed", what);
  if (!src || !dst) goto out;
  int bad = 0;
  for (int it = 0; it < iters && !bad; it++) {
    size_t n = (size_t)1 << (rnd() % 23); /* log-uniform 1 B .. 4 MiB */
    n = n + rnd() % n;
    if (n > DATA_BYTES) n = DATA_BYTES;
    size_t off = (size_t)(rnd() % (dev_bytes - n + 1));
    for (size_t i = 0; i < n; i++) src[i] = (unsigned char)rnd();
    memset(dst, 0, n);
    int s = (int)(rnd() % PS_CUDA_NSTREAMS);
    if (ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, at(dev, off), src, n) != ncclSuccess || !sync_stream(d, PS_CUDA_COPY_STREAM) ||
        ps_cuda_d2h(d, s, dst, at(dev, off), n) != ncclSuccess || !sync_stream(d, s) || memcmp(src, dst, n)) {
      bad = 1;
      EXPECT(0, "%s: round trip %d of %zu bytes at offset %zu differs or failed", what, it, n, off);
    }
  }
  EXPECT(!bad, "%s: %d round trips", what, iters);
out:
  ps_cuda_host_free(d, src);
  ps_cuda_host_free(d, dst);
}

/* A 4 MiB copy then write64(flag, k) on the copy stream, while the read
 * stream keeps reading the flag and then the copy's last bytes: whenever it
 * sees k the bytes must be round k's. */
static void write64_ordering(ps_cuda_dev_t *d, CUdeviceptr dev) {
  unsigned char *src = NULL, *tail = NULL;
  uint64_t *flag = NULL;
  if (ps_cuda_host_alloc(d, DATA_BYTES, (void **)&src) != ncclSuccess ||
      ps_cuda_host_alloc(d, 64, (void **)&tail) != ncclSuccess ||
      ps_cuda_host_alloc(d, 8, (void **)&flag) != ncclSuccess) {
    EXPECT(0, "write64: host_alloc failed");
    goto out;
  }
  void *dflag = at(dev, DEV_BYTES - 8);
  EXPECT(ps_cuda_write64(d, PS_CUDA_COPY_STREAM, dflag, 0) == ncclSuccess && sync_stream(d, PS_CUDA_COPY_STREAM),
         "write64 of 0 failed");
  int seen = 0, wrong = 0, errors = 0;
  for (unsigned k = 1; k <= 20; k++) {
    memset(src, (int)k, DATA_BYTES);
    ps_cuda_event_t *ev = NULL;
    errors += ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, at(dev, 0), src, DATA_BYTES) != ncclSuccess;
    errors += ps_cuda_write64(d, PS_CUDA_COPY_STREAM, dflag, k) != ncclSuccess;
    errors += ps_cuda_event_record(d, PS_CUDA_COPY_STREAM, &ev) != ncclSuccess;
    for (int done = 0, polls = 0; !errors && polls < 100000; polls++) {
      errors += ps_cuda_d2h(d, PS_CUDA_READ_STREAM, flag, dflag, 8) != ncclSuccess;
      errors += ps_cuda_d2h(d, PS_CUDA_READ_STREAM, tail, at(dev, DATA_BYTES - 64), 64) != ncclSuccess;
      errors += !sync_stream(d, PS_CUDA_READ_STREAM);
      if (*flag == k) {
        seen++;
        for (int i = 0; i < 64; i++) wrong += tail[i] != (unsigned char)k;
        break;
      }
      if (done) break; /* the copy stream finished but the flag never came */
      done = ps_cuda_event_done(d, ev) == 1;
    }
    errors += !ev || wait_done(d, ev) != 1; /* src is reused next round */
    ps_cuda_event_release(d, ev);
  }
  EXPECT(errors == 0, "write64: %d calls failed", errors);
  EXPECT(seen == 20, "write64: the flag was read back in %d of 20 rounds", seen);
  EXPECT(wrong == 0, "write64: %d bytes of the copy not there when the flag after it was", wrong);
out:
  ps_cuda_host_free(d, src);
  ps_cuda_host_free(d, tail);
  ps_cuda_host_free(d, flag);
}

/* 128 copies of 4 MiB take milliseconds; enqueueing them, microseconds. */
static void events_after_work(ps_cuda_dev_t *d, CUdeviceptr dev) {
  unsigned char *src = NULL, *back = NULL;
  if (ps_cuda_host_alloc(d, DATA_BYTES, (void **)&src) != ncclSuccess ||
      ps_cuda_host_alloc(d, 64, (void **)&back) != ncclSuccess) {
    EXPECT(0, "events: host_alloc failed");
    goto out;
  }
  memset(src, 0x5A, DATA_BYTES);
  int errors = 0;
  for (int i = 0; i < 128; i++) errors += ps_cuda_h2d(d, PS_CUDA_COPY_STREAM, at(dev, 0), src, DATA_BYTES) != ncclSuccess;
  ps_cuda_event_t *ev = NULL;
  errors += ps_cuda_event_record(d, PS_CUDA_COPY_STREAM, &ev) != ncclSuccess;
  EXPECT(errors == 0, "events: %d enqueues failed", errors);
  if (ev) {
    EXPECT(ps_cuda_event_done(d, ev) == 0, "event done right after 512 MiB of copies were enqueued");
    EXPECT(wait_done(d, ev) == 1, "event after 512 MiB of copies never done");
    ps_cuda_event_release(d, ev);
  }
  EXPECT(ps_cuda_d2h(d, PS_CUDA_READ_STREAM, back, at(dev, DATA_BYTES - 64), 64) == ncclSuccess &&
         sync_stream(d, PS_CUDA_READ_STREAM) && back[0] == 0x5A && back[63] == 0x5A, "copied bytes not there");
  EXPECT(sync_stream(d, PS_CUDA_READ_STREAM), "event on an idle stream not done");
out:
  ps_cuda_host_free(d, src);
  ps_cuda_host_free(d, back);
}

static long vm_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "VmSize:", 7)) kib = strtol(line + 7, NULL, 10);
  if (f) fclose(f);
  return kib;
}

/* The event pool stays at the events held at once; host_alloc/free cycles
 * leave the address space as it was. */
static void no_growth(ps_cuda_dev_t *d) {
  enum { HOLD = 4 };
  ps_cuda_event_t *held[HOLD] = {0}, *seen[64];
  int nseen = 0, errors = 0;
  for (int i = 0; i < 10000; i++) {
    ps_cuda_event_t **slot = &held[i % HOLD];
    if (*slot) {
      errors += wait_done(d, *slot) != 1;
      ps_cuda_event_release(d, *slot);
      *slot = NULL;
    }
    errors += ps_cuda_event_record(d, i % PS_CUDA_NSTREAMS, slot) != ncclSuccess;
    int known = 0;
    for (int j = 0; j < nseen; j++) known |= seen[j] == *slot;
    if (!known && nseen < 64) seen[nseen++] = *slot;
  }
  for (int i = 0; i < HOLD; i++) ps_cuda_event_release(d, held[i]);
  EXPECT(errors == 0, "event cycles: %d failures", errors);
  EXPECT(nseen <= HOLD + 1, "10000 record/release cycles holding %d made %d distinct events", HOLD, nseen);

  void *p = NULL;
  for (int i = 0; i < 10; i++) { /* warm the driver's own pools */
    errors += ps_cuda_host_alloc(d, MIB, &p) != ncclSuccess;
    ps_cuda_host_free(d, p);
  }
  long before = vm_kib();
  for (int i = 0; i < 1000; i++) {
    p = NULL;
    errors += ps_cuda_host_alloc(d, MIB, &p) != ncclSuccess;
    ps_cuda_host_free(d, p);
  }
  long grew = vm_kib() - before;
  EXPECT(errors == 0, "host_alloc cycles: %d failures", errors);
  EXPECT(before > 0 && grew < 128 * 1024, "1000 host_alloc/free cycles of 1 MiB grew VmSize by %ld KiB", grew);
}

typedef struct {
  ps_cuda_dev_t *d;
  CUdeviceptr dev;
  int ordinal;
} thread_arg_t;

/* A thread that never made a context current: every call works and leaves
 * it without one, and a cuMem (VMM) allocation opens to the right GPU. */
static void *no_context_thread(void *p) {
  thread_arg_t *a = p;
  CUcontext cur = (CUcontext)1;
  EXPECT(cu.ctx_get_current(&cur) == 0 && !cur, "new thread already has a context");
  EXPECT(ps_cuda_owns(a->d, at(a->dev, 0), DEV_BYTES) == 1, "owns() false from a thread without a context");
  round_trips(a->d, a->dev, DEV_BYTES, 20, "no-context thread");
  cur = (CUcontext)1;
  EXPECT(cu.ctx_get_current(&cur) == 0 && !cur, "ps_cuda left a context current in the thread");

  cu_mem_prop_t prop = {.type = 1, .location = {.type = 1, .id = a->ordinal}};
  size_t gran = 0, size;
  CUdeviceptr va = 0;
  unsigned long long h = 0;
  if (cu.granularity(&gran, &prop, 0) || !gran) {
    EXPECT(0, "cuMemGetAllocationGranularity failed");
    return NULL;
  }
  size = (DEV_BYTES + gran - 1) / gran * gran;
  cu_mem_access_t acc = {.location = {.type = 1, .id = a->ordinal}, .flags = 3};
  int rc = cu.mem_create(&h, size, &prop, 0);
  if (!rc && (rc = cu.address_reserve(&va, size, 0, 0, 0))) va = 0;
  if (!rc) rc = cu.mem_map(va, size, 0, h, 0);
  if (!rc) rc = cu.set_access(va, size, &acc, 1);
  EXPECT(rc == 0, "cuMem allocation of %zu bytes: CUresult %d", size, rc);
  ps_cuda_dev_t *vd = NULL;
  if (!rc) {
    EXPECT(ps_cuda_open(at(va, 0), &vd) == ncclSuccess && vd, "open of a cuMem allocation failed");
    if (vd) {
      EXPECT(ps_cuda_ordinal(vd) == a->ordinal, "cuMem allocation on GPU %d opened as %d", a->ordinal,
             ps_cuda_ordinal(vd));
      EXPECT(ps_cuda_owns(vd, at(va, 0), size) == 1, "owns() false for a whole cuMem allocation");
      EXPECT(ps_cuda_owns(vd, at(va, 8), size) == 0, "owns() true past a cuMem allocation");
      round_trips(vd, va, size, 20, "cuMem allocation");
      ps_cuda_close(vd);
    }
    cu.mem_unmap(va, size);
  }
  if (va) cu.address_free(va, size);
  if (h) cu.mem_release(h);
  return NULL;
}

int main(void) {
  int ndev = 0;
  if (!ps_cuda_available()) {
    if (load_driver(&ndev) == 0) { /* a driver and a GPU that ps_cuda.c missed */
      printf("cuda_shim_test: FAIL: ps_cuda_available() is 0 with %d GPUs (NCCL_DEBUG=INFO says why)\n", ndev);
      return 1;
    }
    printf("cuda_shim_test: skipped: %s\n", why);
    return 77;
  }
  if (load_driver(&ndev)) {
    printf("cuda_shim_test: ps_cuda_available() is 1 but %s\n", why);
    return 1;
  }
  /* The last GPU, so that a multi-GPU host checks the ordinal is found. */
  int ordinal = ndev - 1, cudev = 0, dev0 = 0;
  CUcontext ctx = NULL, other = NULL;
  CUdeviceptr dev = 0;
  if (cu.device_get(&cudev, ordinal) || cu.primary_ctx_retain(&ctx, cudev) || cu.ctx_set_current(ctx) ||
      cu.mem_alloc(&dev, DEV_BYTES)) {
    printf("cuda_shim_test: could not allocate %u bytes on GPU %d\n", DEV_BYTES, ordinal);
    return 1;
  }
  ps_cuda_dev_t *d = NULL;
  EXPECT(ps_cuda_open(at(dev, 0), &d) == ncclSuccess && d, "open failed");
  if (!d) return 1;
  EXPECT(ps_cuda_ordinal(d) == ordinal, "ordinal %d, allocated on %d", ps_cuda_ordinal(d), ordinal);

  void *host = malloc(4096), *pinned = NULL;
  EXPECT(ps_cuda_owns(d, at(dev, 0), DEV_BYTES) == 1, "owns() false for the whole allocation");
  EXPECT(ps_cuda_owns(d, at(dev, 4096), 1) == 1, "owns() false inside the allocation");
  EXPECT(ps_cuda_owns(d, host, 4096) == 0, "owns() true for malloc memory");
  EXPECT(ps_cuda_host_alloc(d, 4096, &pinned) == ncclSuccess && ps_cuda_owns(d, pinned, 4096) == 0,
         "owns() true for pinned host memory");
  EXPECT(ps_cuda_write64(d, PS_CUDA_COPY_STREAM, at(dev, 4), 1) != ncclSuccess, "unaligned write64 accepted");
  EXPECT(ps_cuda_h2d(d, PS_CUDA_NSTREAMS, at(dev, 0), pinned, 8) != ncclSuccess, "stream %d accepted", PS_CUDA_NSTREAMS);
  ps_cuda_dev_t *bad = NULL;
  EXPECT(ps_cuda_open(host, &bad) != ncclSuccess && !bad, "open of malloc memory accepted");
  ps_cuda_host_free(d, pinned);
  free(host);

  round_trips(d, dev, DEV_BYTES, 200, "main thread");
  write64_ordering(d, dev);
  events_after_work(d, dev);
  no_growth(d);
  CUcontext cur = NULL;
  EXPECT(cu.ctx_get_current(&cur) == 0 && cur == ctx, "the caller's context was not restored");

  /* Another GPU's context current in the caller: ours is used, theirs kept. */
  if (ndev > 1) {
    if (!cu.device_get(&dev0, 0) && !cu.primary_ctx_retain(&other, dev0) && !cu.ctx_set_current(other)) {
      round_trips(d, dev, DEV_BYTES, 20, "another GPU's context current");
      EXPECT(cu.ctx_get_current(&cur) == 0 && cur == other, "GPU 0's context was not restored");
    }
  }
  cu.ctx_set_current(NULL);
  thread_arg_t arg = {d, dev, ordinal};
  pthread_t t;
  if (pthread_create(&t, NULL, no_context_thread, &arg) == 0) pthread_join(t, NULL);
  else EXPECT(0, "pthread_create failed");

  ps_cuda_close(d);
  cu.ctx_set_current(ctx);
  cu.mem_free(dev);
  cu.ctx_set_current(NULL);
  if (other) cu.primary_ctx_release(dev0);
  cu.primary_ctx_release(cudev);
  if (failures) {
    printf("cuda_shim_test: %d of %d checks failed\n", failures, checks);
    return 1;
  }
  printf("cuda_shim_test: %d checks passed\n", checks);
  return 0;
}
