/* check_call.h: a CUDA runtime or NCCL call checked in a rank process (C or
 * CUDA C++; the caller includes cuda_runtime_api.h and nccl.h). On failure
 * die(__FILE__, __LINE__, fmt, ...) says
 *   "<text><detail> failed: <cudaGetErrorName>: <cudaGetErrorString>"
 *   "<text><detail> failed: <ncclGetErrorString> (last error: <ncclGetLastError(comm)>)"
 * with text the call as written (#call, taken by the caller's own macro so
 * that the names in it stay unexpanded) and detail a format literal ("" for
 * none) whose values follow. die must not return. */
#ifndef PS_HARNESS_CHECK_CALL_H
#define PS_HARNESS_CHECK_CALL_H

#define PS_CHECK_CUDA(die, call, text, detail, ...) do {                            \
    cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess)                                                          \
      die(__FILE__, __LINE__, "%s" detail " failed: %s: %s", text, ##__VA_ARGS__,   \
          cudaGetErrorName(e_), cudaGetErrorString(e_));                            \
  } while (0)

#define PS_CHECK_NCCL(die, comm, call, text, detail, ...) do {                      \
    ncclResult_t r_ = (call);                                                       \
    if (r_ != ncclSuccess)                                                          \
      die(__FILE__, __LINE__, "%s" detail " failed: %s (last error: %s)", text,     \
          ##__VA_ARGS__, ncclGetErrorString(r_), ncclGetLastError(comm));           \
  } while (0)

#endif
