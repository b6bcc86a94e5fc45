/* perseus one-sided statistics, for benchmarks and tools that drive
 * libnccl-net-perseus.so's ncclGin/ncclRma tables themselves (NCCL does not
 * call these). Resolve them with dlsym() on the plugin handle. */
#ifndef PERSEUS_RMA_H
#define PERSEUS_RMA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Per destination rank, since the communicator was connected. */
typedef struct {
  uint64_t puts;           /* RMA writes posted */
  uint64_t signals;        /* signals posted */
  uint64_t fences_posted;  /* signals that had to wait for (or fence behind) earlier puts */
  uint64_t fences_avoided; /* signals that needed no wait: ordering came for free */
  uint64_t blocked_ns;     /* time the calling thread was blocked (drain only) */
  uint64_t inflight_max;   /* most operations (puts, signals) posted and not completed at once */
} perseus_rma_peer_stats_t;

/* `comm`: a collective comm (ncclGin v11/v12 connect) or a context
 * (v13/v14 createContext). `size`: sizeof(perseus_rma_peer_stats_t) as the
 * caller knows it. Returns 0, or -1 for a bad comm, rank or size. */
int perseus_rma_peer_stats(void *comm, uint32_t rank, perseus_rma_peer_stats_t *out, size_t size);
typedef int (*perseus_rma_peer_stats_fn)(void *, uint32_t, perseus_rma_peer_stats_t *, size_t);

/* The ordering strategy the comm uses ("fence", "target", ...), or NULL. */
const char *perseus_rma_ordering(void *comm);
typedef const char *(*perseus_rma_ordering_fn)(void *);

/* Sums over every comm this process has connected (closed ones included),
 * per rank summed over destinations, for programs that let NCCL drive the
 * plugin (NCCL keeps the comms to itself). Returns 0, or -1 for a bad size. */
int perseus_rma_process_stats(perseus_rma_peer_stats_t *out, size_t size);
typedef int (*perseus_rma_process_stats_fn)(perseus_rma_peer_stats_t *, size_t);

#ifdef __cplusplus
}
#endif
#endif
