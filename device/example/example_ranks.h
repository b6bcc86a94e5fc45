/* What the examples share: one process per GPU, forked before CUDA is
 * initialised, each with its rank and NCCL's unique id; and, for the two C
 * examples, bf16 conversions and the inputs every rank derives alike. C11
 * and CUDA C++ alike. */
#ifndef PERSEUS_EXAMPLE_RANKS_H
#define PERSEUS_EXAMPLE_RANKS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nccl.h>

/* Exits the rank when `call` returns non-zero (a cudaError_t, ncclResult_t
 * or -1), naming it, its line and `why` (the library's reason); `rank` in scope. */
#define EXAMPLE_CHECK(call, why)                                                                  \
  do {                                                                                            \
    long long e_ = (long long)(call);                                                             \
    if (e_) {                                                                                     \
      fprintf(stderr, "rank %d: %s failed (%lld) at line %d: %s\n", rank, #call, e_, __LINE__, why); \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

/* GPUs visible, counted without initialising CUDA (the ranks fork after). */
static inline int example_gpus(void) {
  int n = 0;
  FILE *f = popen("nvidia-smi -L 2>/dev/null | grep -c ^GPU", "r");
  if (!f || fscanf(f, "%d", &n) != 1) n = 0;
  if (f) pclose(f);
  return n;
}

/* Forks n ranks; rank r calls run(r, n, id, arg), rank 0 having made the
 * id. Prints PASSED or FAILED; returns 0 when every rank returned 0. */
static inline int example_ranks(int n, int (*run)(int rank, int n, const ncclUniqueId *id, void *arg), void *arg) {
  ncclUniqueId *id = (ncclUniqueId *)mmap(NULL, sizeof *id + sizeof(int), PROT_READ | PROT_WRITE,
                                          MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (id == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  volatile int *ready = (volatile int *)(id + 1);
  for (int r = 0; r < n; r++) {
    if (fork() == 0) {
      if (r == 0) {
        ncclResult_t rc = ncclGetUniqueId(id);
        if (rc != ncclSuccess) {
          fprintf(stderr, "rank 0: ncclGetUniqueId failed: %s\n", ncclGetErrorString(rc));
          exit(1);
        }
        __sync_synchronize();
        *ready = 1;
      }
      while (!*ready) usleep(1000);
      exit(run(r, n, id, arg)); /* exit, not _exit: what the rank printed is flushed */
    }
  }
  int failed = 0, status;
  pid_t p;
  while ((p = wait(&status)) > 0) {
    const int bad = !WIFEXITED(status) || WEXITSTATUS(status);
    if (bad && WIFSIGNALED(status)) fprintf(stderr, "process %d killed by signal %d\n", (int)p, WTERMSIG(status));
    failed |= bad;
  }
  printf("%s\n", failed ? "FAILED" : "PASSED");
  return failed;
}

static inline uint16_t example_to_bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float example_from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Element i of an input seeded s, in [-1, 1), the same on every rank. */
static inline uint16_t example_value(uint32_t s, size_t i) {
  uint32_t x = (uint32_t)(i * 2654435761u) ^ (s * 0x9e3779b9u);
  x ^= x >> 15, x *= 0x2c1b3c6du, x ^= x >> 12;
  return example_to_bf16((float)(x % 2048) / 1024.f - 1.f);
}

#endif
