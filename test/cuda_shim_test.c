/* GPU test of the real ps_cuda.c, linked directly: ownership checks, copies
 * both ways, write64 ordered after the copy before it; marks that pass only
 * after ps_cuda_flush and their work, a busy stream's not at once while an
 * idle one's does, and close waits for flushed work; 200 small copies
 * flushed together (the batch path; apart, or adjacent, where they join
 * into one) all landing, and copies that depend on
 * each other before a flush (overlapping ones, a read of what a write
 * before it wrote) in call order; tickets one up per mark and no growth
 * over 10000 cycles; bad arguments refused; every call from a thread with no
 * (or another) context current; the compute capability, and a dma-buf export
 * where the host has one. Exits 77 without a GPU. */
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
#include <unistd.h>

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

enum { COPY = PS_CUDA_COPY_STREAM, READ = PS_CUDA_READ_STREAM, OUT = PS_CUDA_OUT_STREAM };

/* Polls for up to 20 s: ps_cuda_passed's last answer. */
static int wait_passed(ps_cuda_dev_t *d, int s, uint64_t t) {
  int r = 0;
  struct timespec ts = {0, 10000};
  for (long i = 0; i < 2000000 && (r = ps_cuda_passed(d, s, t)) == 0; i++) nanosleep(&ts, NULL);
  return r;
}

/* Flushes and waits for ticket t of stream s: 1 when it passed. */
static int settle(ps_cuda_dev_t *d, int s, uint64_t t) {
  return ps_cuda_flush(d) == ncclSuccess && wait_passed(d, s, t) == 1;
}

static void *pin(ps_cuda_dev_t *d, size_t n, const char *what) {
  void *p = NULL;
  EXPECT(ps_cuda_host_alloc(d, n, &p) == ncclSuccess && p, "%s: host_alloc of %zu bytes failed",
         what, n);
  return p;
}

/* h2d then d2h of random sizes and offsets, through pinned buffers. */
static void round_trips(ps_cuda_dev_t *d, CUdeviceptr dev, size_t dev_bytes, int iters, const char *what) {
  unsigned char *src = pin(d, DATA_BYTES, what), *dst = pin(d, DATA_BYTES, what);
  int bad = !src || !dst;
  for (int it = 0; it < iters && !bad; it++) {
    size_t n = (size_t)1 << (rnd() % 23); /* log-uniform 1 B .. 4 MiB */
    n = n + rnd() % n;
    if (n > DATA_BYTES) n = DATA_BYTES;
    size_t off = (size_t)(rnd() % (dev_bytes - n + 1));
    for (size_t i = 0; i < n; i++) src[i] = (unsigned char)rnd();
    memset(dst, 0, n);
    int s = (int)(rnd() % PS_CUDA_NSTREAMS);
    uint64_t t = 0;
    if (ps_cuda_h2d(d, COPY, at(dev, off), src, n, &t) != ncclSuccess || !settle(d, COPY, t) ||
        ps_cuda_d2h(d, s, dst, at(dev, off), n, &t) != ncclSuccess || !settle(d, s, t) ||
        memcmp(src, dst, n)) {
      bad = 1;
      EXPECT(0, "%s: round trip %d of %zu bytes at offset %zu differs or failed", what, it, n, off);
    }
  }
  EXPECT(!bad, "%s: %d round trips", what, iters);
  ps_cuda_host_free(d, src);
  ps_cuda_host_free(d, dst);
}

/* A 4 MiB copy then write64(flag, k) on the copy stream, while the read
 * stream keeps reading the flag and, once it is k, the copy's last bytes:
 * they must be round k's. */
static void write64_ordering(ps_cuda_dev_t *d, CUdeviceptr dev) {
  unsigned char *src = pin(d, DATA_BYTES, "write64"), *tail = pin(d, 64, "write64");
  uint64_t *flag = pin(d, 8, "write64"), tc = 0, tr = 0;
  void *dflag = at(dev, DEV_BYTES - 8);
  int seen = 0, wrong = 0, errors = !src || !tail || !flag;
  errors = errors || ps_cuda_write64(d, COPY, dflag, 0, &tc) != ncclSuccess || !settle(d, COPY, tc);
  for (unsigned k = 1; k <= 20 && !errors; k++) {
    memset(src, (int)k, DATA_BYTES);
    errors += ps_cuda_h2d(d, COPY, at(dev, 0), src, DATA_BYTES, &tc) != ncclSuccess;
    errors += ps_cuda_write64(d, COPY, dflag, k, &tc) != ncclSuccess;
    errors += ps_cuda_flush(d) != ncclSuccess;
    for (int done = 0, polls = 0; !errors && polls < 100000; polls++) {
      /* The tail is read only after the flag's read passed: two reads
       * handed over together may run in either order. */
      errors += ps_cuda_d2h(d, READ, flag, dflag, 8, &tr) != ncclSuccess || !settle(d, READ, tr);
      if (*flag == k) {
        seen++;
        errors += ps_cuda_d2h(d, READ, tail, at(dev, DATA_BYTES - 64), 64, &tr) != ncclSuccess ||
                  !settle(d, READ, tr);
        for (int i = 0; i < 64; i++) wrong += tail[i] != (unsigned char)k;
        break;
      }
      if (done) break; /* the copy stream finished but the flag never came */
      done = ps_cuda_passed(d, COPY, tc) == 1;
    }
    errors += wait_passed(d, COPY, tc) != 1; /* src is reused next round */
  }
  EXPECT(errors == 0, "write64: %d calls failed", errors);
  EXPECT(seen == 20, "write64: the flag was read back in %d of 20 rounds", seen);
  EXPECT(wrong == 0, "write64: %d bytes of the copy not there when the flag after it was", wrong);
  ps_cuda_host_free(d, src);
  ps_cuda_host_free(d, tail);
  ps_cuda_host_free(d, flag);
}

/* 128 copies of 4 MiB take milliseconds; enqueueing them, microseconds: the
 * mark after them does not pass at once, an idle stream's mark does not wait
 * for it, and close (of a second handle) waits for them all, the last one's
 * bytes (0xA5, the rest 0x5A) included: its caller frees their source next. */
static void marks_and_close(ps_cuda_dev_t *d, CUdeviceptr dev) {
  unsigned char *src = pin(d, 2 * DATA_BYTES, "marks"), *back = pin(d, 64, "marks");
  ps_cuda_dev_t *c = NULL;
  uint64_t tc = 0, tr = 0;
  int errors = !src || !back || ps_cuda_open(at(dev, 0), &c) != ncclSuccess;
  if (errors) goto out;
  memset(src, 0x5A, DATA_BYTES);
  memset(src + DATA_BYTES, 0xA5, DATA_BYTES);
  for (size_t i = 0; i < 128; i++)
    errors += ps_cuda_h2d(c, COPY, at(dev, 0), src + (i == 127) * DATA_BYTES, DATA_BYTES, &tc) !=
              ncclSuccess;
  errors += ps_cuda_flush(c) != ncclSuccess;
  EXPECT(ps_cuda_passed(c, COPY, tc) == 0,
         "mark passed right after 512 MiB of copies were flushed");
  errors += ps_cuda_d2h(c, READ, back, at(dev, DEV_BYTES - 64), 64, &tr) != ncclSuccess;
  EXPECT(settle(c, READ, tr) && ps_cuda_passed(c, COPY, tc) == 0,
         "64 bytes on an idle stream did not pass before 512 MiB on the copy stream");
  ps_cuda_close(c);
  c = NULL;
  memset(back, 0, 64);
  errors += ps_cuda_d2h(d, READ, back, at(dev, DATA_BYTES - 64), 64, &tr) != ncclSuccess ||
            !settle(d, READ, tr);
out:
  EXPECT(errors == 0 && back[0] == 0xA5 && back[63] == 0xA5,
         "marks: %d calls failed or close returned before the last copy (%#x)", errors,
         back ? back[0] : 0);
  ps_cuda_close(c);
  ps_cuda_host_free(d, src);
  ps_cuda_host_free(d, back);
}

/* 200 small copies each way and one flush (held, handed over in batches);
 * then copies that depend on each other before one flush, which must keep
 * call order: h2d copies that overlap, d2h copies of what they wrote, and
 * d2h copies that overlap. */
static void batches_and_order(ps_cuda_dev_t *d, CUdeviceptr dev) {
  enum { NB = 200, B = 4096, R = 16, H = B / 2 };
  unsigned char *pat = pin(d, NB * B, "batches"), *back = pin(d, NB * B, "batches");
  uint64_t t = 0, t0 = 0;
  if (!pat || !back) goto out;
  for (size_t i = 0; i < NB * B; i++) pat[i] = (unsigned char)rnd();
  for (int v = 0; v < 4; v++) { /* h2d to the blocks, then d2h back from them */
    /* out of order (7 is prime to NB: every block once), then in order,
     * where each copy extends the one before it */
    int d2h = v & 1, in_order = v >> 1;
    int s = d2h ? OUT : COPY, errors = 0, other = 0;
    memset(back, 0, NB * B);
    for (int i = 0; i < NB; i++) {
      size_t j = (size_t)(in_order ? i : i * 7 % NB) * B;
      errors += (d2h ? ps_cuda_d2h(d, s, back + j, at(dev, j), B, &t)
                     : ps_cuda_h2d(d, s, at(dev, j), pat + j, B, &t)) != ncclSuccess;
      if (!i) t0 = t;
      other += t != t0;
    }
    errors += !settle(d, s, t);
    if (!d2h)
      errors +=
          ps_cuda_d2h(d, READ, back, at(dev, 0), NB * B, &t) != ncclSuccess || !settle(d, READ, t);
    EXPECT(errors == 0 && other == 0 && !memcmp(back, pat, NB * B),
           "%d x %d B %s %s, one flush: %d failures, %d tickets not the first's, or bytes differ",
           NB, B, d2h ? "d2h" : "h2d", in_order ? "adjacent" : "apart", errors, other);
  }

  /* A big copy, then copies that each overlap it and the one before by
   * half: the later one's bytes must win. Each way: h2d to the device, then
   * d2h of every half to one host place (over a big d2h), where the last
   * must win. */
  size_t y = DEV_BYTES / 2, big = NB * B, rest = big - (R + 2) * H;
  unsigned char *one = back + big - H;
  int errors = 0;
  memset(back, 0, big);
  errors += ps_cuda_h2d(d, COPY, at(dev, y), pat, big, &t) != ncclSuccess;
  for (int k = 0; k < R; k++)
    errors += ps_cuda_h2d(d, COPY, at(dev, y + k * H), pat + k * B, B, &t) != ncclSuccess;
  errors += ps_cuda_d2h(d, COPY, back, at(dev, 0), big, &t) != ncclSuccess;
  for (int k = 0; k <= R; k++)
    errors += ps_cuda_d2h(d, COPY, one, at(dev, y + k * H), H, &t) != ncclSuccess;
  errors +=
      ps_cuda_d2h(d, COPY, back, at(dev, y), (R + 1) * H, &t) != ncclSuccess || !settle(d, COPY, t);
  int wrong = memcmp(back + R * H, pat + (R - 1) * B + H, H) != 0;
  for (int m = 0; m < R; m++) wrong += memcmp(back + m * H, pat + m * B, H) != 0;
  wrong += memcmp(one, pat + (R - 1) * B + H, H) != 0;
  wrong += memcmp(back + (R + 1) * H, pat + (R + 1) * H, rest) != 0;
  EXPECT(errors == 0 && wrong == 0,
         "overlapping copies: %d failures, %d of %d parts out of call order", errors, wrong, R + 3);
out:
  ps_cuda_host_free(d, pat);
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

/* Enqueue/flush/wait cycles, each a batch of two reads then a write with the
 * mark: tickets go up by one per mark on their own stream and the address
 * space stays as it was; host_alloc/free cycles leave it as it was too. */
static void no_growth(ps_cuda_dev_t *d, CUdeviceptr dev) {
  uint64_t *buf = pin(d, 64, "cycles"), last[PS_CUDA_NSTREAMS] = {0}, t = 0;
  size_t base = DEV_BYTES - 4096;
  long before = 0;
  int errors = !buf, skipped = 0;
  for (int i = 0; i < 10300 && buf; i++) {
    if (i == 300) before = vm_kib(); /* after warming the driver's own pools */
    int s = i % PS_CUDA_NSTREAMS;
    errors += ps_cuda_d2h(d, s, &buf[0], at(dev, base), 8, &t) != ncclSuccess;
    errors += ps_cuda_d2h(d, s, &buf[1], at(dev, base + 8), 8, &t) != ncclSuccess;
    errors +=
        ps_cuda_write64(d, s, at(dev, base + 64 + 8 * (size_t)s), (uint64_t)i, &t) != ncclSuccess;
    errors += !settle(d, s, t);
    skipped += last[s] && t != last[s] + 1;
    last[s] = t;
  }
  long grew = vm_kib() - before;
  errors += !buf || ps_cuda_d2h(d, READ, &buf[2], at(dev, base + 64), 24, &t) != ncclSuccess ||
            !settle(d, READ, t);
  EXPECT(errors == 0 && skipped == 0, "mark cycles: %d failures, %d tickets not one past the last",
         errors, skipped);
  EXPECT(buf && buf[2] == 10299 && buf[3] == 10297 && buf[4] == 10298,
         "a stream's last write64 is not there");
  EXPECT(before > 0 && grew < 64 * 1024, "10000 enqueue/flush/wait cycles grew VmSize by %ld KiB",
         grew);
  ps_cuda_host_free(d, buf);

  void *p = NULL;
  errors = 0;
  for (int i = 0; i < 1010; i++, p = NULL) {
    if (i == 10) before = vm_kib(); /* after warming the driver's own pools */
    errors += ps_cuda_host_alloc(d, MIB, &p) != ncclSuccess;
    ps_cuda_host_free(d, p);
  }
  grew = vm_kib() - before;
  EXPECT(errors == 0 && before > 0 && grew < 128 * 1024,
         "1000 host_alloc/free cycles of 1 MiB: %d failures, VmSize grew by %ld KiB", errors, grew);
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
  uint64_t t = 0;
  EXPECT(ps_cuda_write64(d, COPY, at(dev, 4), 1, &t) != ncclSuccess, "unaligned write64 accepted");
  EXPECT(ps_cuda_h2d(d, PS_CUDA_NSTREAMS, at(dev, 0), pinned, 8, &t) != ncclSuccess &&
             ps_cuda_d2h(d, -1, pinned, at(dev, 0), 8, &t) != ncclSuccess &&
             ps_cuda_flush(NULL) != ncclSuccess,
         "a bad stream or device accepted");
  EXPECT(ps_cuda_h2d(d, COPY, at(dev, 0), pinned, 8, NULL) != ncclSuccess &&
             ps_cuda_d2h(d, READ, pinned, at(dev, 0), 8, NULL) != ncclSuccess &&
             ps_cuda_write64(d, OUT, at(dev, 0), 1, NULL) != ncclSuccess,
         "an operation with a NULL ticket accepted");
  EXPECT(ps_cuda_passed(d, PS_CUDA_NSTREAMS, 1) == -1 && ps_cuda_passed(d, -1, 1) == -1 &&
             ps_cuda_passed(NULL, COPY, 1) == -1,
         "passed() on a bad stream or device is not -1");
  /* Long enough for the write to be done had it been handed over at once. */
  EXPECT(ps_cuda_write64(d, OUT, at(dev, 0), 1, &t) == ncclSuccess, "write64 failed");
  nanosleep(&(struct timespec){0, 20000000}, NULL);
  EXPECT(ps_cuda_passed(d, OUT, t) == 0, "a ticket passed before ps_cuda_flush");
  EXPECT(settle(d, OUT, t), "a ticket never passed after the flush");
  EXPECT(ps_cuda_passed(d, OUT, t + 1) == 0, "a ticket not handed out yet passed");
  ps_cuda_dev_t *bad = NULL;
  EXPECT(ps_cuda_open(host, &bad) != ncclSuccess && !bad, "open of malloc memory accepted");
  ps_cuda_host_free(d, pinned);
  free(host);
  EXPECT(ps_cuda_compute_major(ordinal) >= 7 && ps_cuda_compute_major(ndev) == -1,
         "compute capability %d of GPU %d, %d of a GPU that does not exist",
         ps_cuda_compute_major(ordinal), ordinal, ps_cuda_compute_major(ndev));
  /* a dma-buf where the driver, GPU and kernel export one; a page inside,
   * at an offset (the allocation is page-aligned) */
  int fd = -1;
  uint64_t off = 0;
  if (ps_cuda_dmabuf_export(ordinal, at(dev, 4096 + 100), 200, &fd, &off) == ncclSuccess) {
    EXPECT(fd >= 0 && off == 100, "dma-buf fd %d at offset %llu, expected 100", fd, (unsigned long long)off);
    if (fd >= 0) close(fd);
  } else {
    EXPECT(fd == -1, "a failed dma-buf export returned fd %d", fd);
    printf("cuda_shim_test: no dma-buf export here (NCCL_DEBUG=INFO says why)\n");
  }

  round_trips(d, dev, DEV_BYTES, 200, "main thread");
  write64_ordering(d, dev);
  marks_and_close(d, dev);
  batches_and_order(d, dev);
  no_growth(d, dev);
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
  pthread_t th;
  if (pthread_create(&th, NULL, no_context_thread, &arg) == 0)
    pthread_join(th, NULL);
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
