/* perseus_nosm_test: can the staging path's CUDA operations finish while a
 * persistent kernel occupies every SM? The plugin's target side copies
 * payload into GPU windows, reads and writes GPU signal words, and its origin
 * copies tiles out, all from the proxy thread on its own streams; a
 * megakernel that spins on a signal holds every SM meanwhile. Each operation
 * below runs against such a kernel (which only exits when the host releases
 * it) and must complete within 2 s:
 *   d2h 8 B and 1 MiB, h2d 1 MiB, cuStreamWriteValue64, on cudaMalloc memory
 *   and on cuMem (VMM) memory, the kind NCCL allocates windows and signals in;
 *   then the target's signal update itself: d2h of a word a kernel polls with
 *   system-scope acquire loads, and cuStreamWriteValue64 releasing it.
 *   perseus_nosm_test [EXTRA_STREAMS [HIGH_PRIORITY]] creates that many idle
 *   streams first and runs the copies on a high-priority stream.
 * What this does not cover: lazy module loading (CUDA_MODULE_LOADING=LAZY)
 * stalls these operations when a kernel is loaded behind a waiting one; the
 * GIN programs set EAGER (see harness/gin_proc.c).
 * Exit: 0 all completed, 1 one did not (printed), 77 no GPU. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(call)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)
#define CKD(call)                                                                    \
  do {                                                                               \
    CUresult r_ = (call);                                                            \
    if (r_ != CUDA_SUCCESS) {                                                        \
      const char *s_ = "?";                                                          \
      cuGetErrorString(r_, &s_);                                                     \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, s_);              \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

__global__ void spin(volatile int *release, int *started) {
  if (threadIdx.x == 0) atomicAdd_system(started, 1);
  while (*release == 0) __nanosleep(1000);
}

/* The GIN barrier's shape: one thread spins with system-scope acquire loads
 * on a signal word in device memory until it reaches `want`. */
__global__ void wait_word(unsigned long long *word, unsigned long long want, int *started) {
  if (threadIdx.x == 0) {
    atomicAdd_system(started, 1);
    unsigned long long v;
    do {
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(word) : "memory");
    } while (v < want);
  }
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Waits up to 2 s for the event; 1 done, 0 not. */
static int finished(cudaEvent_t ev) {
  double end = now() + 2;
  while (now() < end) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return 1;
    if (e != cudaErrorNotReady) {
      fprintf(stderr, "cudaEventQuery: %s\n", cudaGetErrorString(e));
      exit(1);
    }
  }
  return 0;
}

static void *vmm_alloc(size_t size, int dev) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  size_t gran = 0;
  CKD(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  size = (size + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h;
  CUdeviceptr p;
  CKD(cuMemCreate(&h, size, &prop, 0));
  CKD(cuMemAddressReserve(&p, size, gran, 0, 0));
  CKD(cuMemMap(p, size, 0, h, 0));
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CKD(cuMemSetAccess(p, size, &acc, 1));
  return (void *)p;
}

int main(int argc, char **argv) {
  int n = 0, extra = argc > 1 ? atoi(argv[1]) : 0, prio = argc > 2 ? atoi(argv[2]) : 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
    printf("no GPU: skipped\n");
    return 77;
  }
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, spin, 1024, 0));
  int blocks = per_sm * prop.multiProcessorCount;
  const size_t big = 1 << 20;
  int *release, *started;
  char *host;
  CK(cudaHostAlloc(&release, sizeof(int), cudaHostAllocMapped));
  CK(cudaHostAlloc(&host, 2 * big, cudaHostAllocDefault));
  CK(cudaHostAlloc(&started, sizeof(int), cudaHostAllocMapped));
  void *mems[2] = {NULL, vmm_alloc(2 * big, 0)};
  CK(cudaMalloc(&mems[0], 2 * big));
  const char *kinds[2] = {"cudaMalloc", "cuMem"};
  cudaStream_t ks, s;
  CK(cudaStreamCreateWithFlags(&ks, cudaStreamNonBlocking));
  for (int i = 0; i < extra; i++) { cudaStream_t x; CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking)); }
  int lo = 0, hi = 0;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  CK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, prio ? hi : lo));
  printf("# %d extra streams, copy stream priority %d (range %d..%d)\n", extra, prio ? hi : lo, lo, hi);
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  int failures = 0;
  printf("# %s, %d SMs, spin kernel %d blocks x 1024 threads (%d per SM)\n", prop.name,
         prop.multiProcessorCount, blocks, per_sm);
  for (int k = 0; k < 2; k++) {
    char *dev = (char *)mems[k];
    const char *names[] = {"d2h 8 B", "d2h 1 MiB", "h2d 1 MiB", "cuStreamWriteValue64"};
    for (int op = 0; op < 4; op++) {
      *(volatile int *)release = 0;
      *(volatile int *)started = 0;
      CK(cudaDeviceSynchronize());
      spin<<<blocks, 1024, 0, ks>>>(release, started);
      CK(cudaGetLastError());
      for (double end = now() + 5; *(volatile int *)started < blocks && now() < end;) continue;
      if (*(volatile int *)started < blocks) printf("# only %d of %d blocks resident\n", *(volatile int *)started, blocks);
      switch (op) {
      case 0: CK(cudaMemcpyAsync(host, dev, 8, cudaMemcpyDeviceToHost, s)); break;
      case 1: CK(cudaMemcpyAsync(host, dev, big, cudaMemcpyDeviceToHost, s)); break;
      case 2: CK(cudaMemcpyAsync(dev, host, big, cudaMemcpyHostToDevice, s)); break;
      case 3: CKD(cuStreamWriteValue64((CUstream)s, (CUdeviceptr)(dev + big), 42, 0)); break;
      }
      CK(cudaEventRecord(ev, s));
      int ok = finished(ev);
      printf("%-10s %-22s while every SM spins: %s\n", kinds[k], names[op],
             ok ? "completed" : "DID NOT COMPLETE in 2 s");
      failures += !ok;
      *(volatile int *)release = 1;
      CK(cudaDeviceSynchronize());
    }
  }
  /* read-modify-write of a word a kernel is polling, as the staging target
   * applies a signal: d2h the word, then write value + 1 behind it */
  for (int k = 0; k < 2; k++) {
    unsigned long long *word = (unsigned long long *)((char *)mems[k] + big);
    CK(cudaMemset(word, 0, 8));
    CK(cudaDeviceSynchronize());
    *(volatile int *)started = 0;
    wait_word<<<1, 32, 0, ks>>>(word, 1, started);
    CK(cudaGetLastError());
    for (double end = now() + 5; *(volatile int *)started < 1 && now() < end;) continue;
    CK(cudaMemcpyAsync(host, word, 8, cudaMemcpyDeviceToHost, s));
    CK(cudaEventRecord(ev, s));
    int ok = finished(ev);
    printf("%-10s d2h of a word a kernel polls (ld.acquire.sys): %s\n", kinds[k], ok ? "completed" : "DID NOT COMPLETE in 2 s");
    failures += !ok;
    CKD(cuStreamWriteValue64((CUstream)s, (CUdeviceptr)word, 1, 0));
    CK(cudaEventRecord(ev, s));
    ok = finished(ev) && cudaStreamQuery(ks) != cudaErrorNotReady;
    for (double end = now() + 2; !ok && now() < end;) ok = cudaStreamQuery(ks) == cudaSuccess;
    printf("%-10s cuStreamWriteValue64 releases the polling kernel: %s\n", kinds[k], ok ? "yes" : "NO (2 s)");
    failures += !ok;
    CK(cudaDeviceSynchronize());
  }
  printf("perseus_nosm_test: %d of 12 operations blocked by a running kernel\n", failures);
  return failures ? 1 : 0;
}
