/* Drives the one-sided tables of libnccl-net-perseus.so (ncclGinPlugin_v11,
 * v12, v13, ncclRmaPlugin_v13, v14) the way NCCL's GIN proxy does, behind
 * one version-neutral call list. Shared by tests and benchmarks. */
#ifndef PS_DRIVER_GIN_H
#define PS_DRIVER_GIN_H

#include <stdbool.h>

#include "perseus/perseus_rma.h"
#include "ps_driver.h"

/* Which table: "gin11", "gin12", "gin13", "rma13", "rma14". */
typedef struct {
  char abi[8];
  const char *name;    /* the table's name */
  int net_device_type; /* getProperties' netDeviceType */
  int ptr_support;     /* getProperties' ptrSupport */
  int max_recvs;       /* getProperties' maxRecvs: NCCL's proxy queue is 32 x this per peer */
  /* `coll` below is the collective comm for v11/v12 and the context made by
   * createContext for v13/v14: the adapter hides the difference. */
  ncclResult_t (*reg_sym)(void *coll, void *data, size_t size, int type, uint64_t flags, void **mh);
  /* regMrSymDmaBuf: the buffer as a dma-buf fd, `offset` its place in it */
  ncclResult_t (*reg_sym_dmabuf)(void *coll, void *data, size_t size, int type, uint64_t offset,
                                 int fd, uint64_t flags, void **mh);
  ncclResult_t (*dereg_sym)(void *coll, void *mh);
  ncclResult_t (*iput)(void *coll, uint64_t src_off, void *src_mh, size_t size, uint64_t dst_off,
                       void *dst_mh, uint32_t rank, void **req);
  ncclResult_t (*iput_signal)(void *coll, uint64_t src_off, void *src_mh, size_t size,
                              uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t sig_off,
                              void *sig_mh, uint64_t value, uint32_t op, void **req);
  /* NULL on tables without them (v11, v12) */
  ncclResult_t (*iget)(void *coll, uint64_t remote_off, void *remote_mh, size_t size,
                       uint64_t local_off, void *local_mh, uint32_t rank, void **req);
  ncclResult_t (*iflush)(void *coll, void *mh, uint32_t rank, void **req);
  ncclResult_t (*test)(void *coll, void *req, int *done);
  ncclResult_t (*progress)(void *coll);
  ncclResult_t (*last_error)(void *coll, bool *has_error);
  /* perseus extensions (include/perseus/perseus_rma.h), dlsym'd; may be NULL */
  perseus_rma_peer_stats_fn peer_stats;
  perseus_rma_ordering_fn ordering;
} drv_gin_t;

/* The options every test of the one-sided tables takes, in its getopt loop:
 * -a ABI (gin11 .. rma14), -p PLUGIN, -s SCENARIO (the argument itself) and
 * -r RANKS (1..32). Returns 1 when opt is one of them (its value stored),
 * else 0; a bad -a or -r exits 2, naming it. */
int drv_gin_opt(int opt, const char *arg, const char **abi, const char **plugin,
                const char **scenario, int *nranks);
/* -a's value when it names a table drv_gin_load knows; otherwise exits 2,
 * naming it and the tables there are. */
const char *drv_gin_parse_abi(const char *arg);

/* Loads the plugin (`path`, else PERSEUS_PLUGIN_PATH, else the build's) and
 * the table named `abi`; init + devices (> 0) + getProperties. 0, or prints
 * why and -1. */
int drv_gin_load(const char *path, const char *abi, drv_gin_t *out);

/* In a rank of drv_run (no_load = 1, no_mesh = 1, shared_bytes >=
 * drv_gin_shared_bytes(nranks)): listen, allgather the handles through the
 * shared area, connect (and createContext for v13/v14). *coll is what the
 * calls above take. Returns the plugin's result (a refusal shows here). */
size_t drv_gin_shared_bytes(int nranks);
ncclResult_t drv_gin_connect(drv_rank_t *r, drv_gin_t *g, void **coll);
/* drv_gin_connect asks for this many connections (v12) or contexts
 * (v13/v14); later calls pass connectionId / context index `index` (0
 * unless a test sets another, e.g. an invalid one). */
#define DRV_GIN_NCONN 2
void drv_gin_set_index(int index);
/* Closes everything drv_gin_connect made, then finalize. */
ncclResult_t drv_gin_close(drv_gin_t *g, void *coll);

/* drv_barrier that keeps calling progress(coll) while it waits, as NCCL's
 * proxy thread keeps progressing while the host waits: a peer's iget or
 * signal may need this rank's progress to complete. */
int drv_gin_barrier(drv_rank_t *r, drv_gin_t *g, void *coll, int timeout_s);

/* Polls test() (which progresses) until done or timeout_s: 0, or -1 with the
 * plugin's result in *rc (ncclSuccess on a timeout). */
int drv_gin_wait(drv_gin_t *g, void *coll, void *req, double timeout_s, ncclResult_t *rc);

#endif
