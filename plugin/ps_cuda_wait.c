/* ps_cuda_quiesce, on top of either ps_cuda.c or the test build's
 * ps_cuda_fake.c. */
#include <sched.h>

#include "ps_clock.h"
#include "ps_cuda.h"
#include "ps_log.h"

ncclResult_t ps_cuda_quiesce(ps_cuda_dev_t *d, uint64_t timeout_ns) {
  PS_CHECK(ps_cuda_flush(d));
  uint64_t deadline = ps_now_ns() + timeout_ns;
  for (int s = 0; s < PS_CUDA_NSTREAMS; s++) {
    int r;
    uint64_t last = ps_cuda_last_mark(d, s);
    while ((r = ps_cuda_passed(d, s, last)) == 0 && ps_now_ns() < deadline) sched_yield();
    if (r != 1) {
      PS_WARN("GPU stream %d still busy after %llu ms%s", s,
              (unsigned long long)(timeout_ns / 1000000), r < 0 ? " (it failed)" : "");
      return ncclUnhandledCudaError;
    }
  }
  return ncclSuccess;
}
