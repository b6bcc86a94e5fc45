/* Drives libnccl-net-perseus.so the way NCCL does: dlopen, dlsym of one
 * ncclNetPlugin_vN table, and the call sequence of NCCL's net transport,
 * from N forked rank processes on one host. Shared by tests and benches. */
#ifndef PS_DRIVER_H
#define PS_DRIVER_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ps_nccl_abi.h"

/* The most ranks drv_run forks: a program bounds -r by it and may keep a
 * slot per peer. */
#define DRV_MAX_RANKS 32

typedef struct {
  char name[128];
  int ptr_support, max_recvs, speed, max_comms, reg_is_global;
  size_t max_p2p_bytes; /* v9+; 1 GiB cap for v8 */
} drv_props_t;

/* One ABI version's table, behind a version-neutral call list. */
typedef struct {
  int version;
  const char *name;
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*get_props)(int dev, drv_props_t *p);
  ncclResult_t (*listen)(int dev, void *handle, void **lc);
  ncclResult_t (*connect)(int dev, void *handle, void **sc);
  ncclResult_t (*accept)(void *lc, void **rc);
  ncclResult_t (*reg_mr)(void *comm, void *data, size_t size, int type, void **mh);
  /* regMrDmaBuf: the buffer as a dma-buf fd, `offset` its place in it */
  ncclResult_t (*reg_mr_dmabuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                                int fd, void **mh);
  ncclResult_t (*dereg_mr)(void *comm, void *mh);
  ncclResult_t (*isend)(void *sc, void *data, size_t size, int tag, void *mh, void **req);
  ncclResult_t (*irecv)(void *rc, int n, void **data, size_t *sizes, int *tags, void **mhs,
                        void **req);
  ncclResult_t (*test)(void *req, int *done, int *sizes);
  ncclResult_t (*close_send)(void *sc);
  ncclResult_t (*close_recv)(void *rc);
  ncclResult_t (*close_listen)(void *lc);
  ncclResult_t (*finalize)(void);
} drv_net_t;

/* dlopen `path` (PERSEUS_PLUGIN_PATH or the build's plugin when NULL) and
 * init table `version`. Returns 0 or prints why and returns -1. */
int drv_load(const char *path, int version, drv_net_t *out);
const char *drv_default_plugin(void);

typedef struct drv_shared drv_shared_t;

typedef struct {
  int rank, nranks, dev;
  drv_net_t net;
  drv_shared_t *sh;
  void **send;   /* [nranks]: send comm to each peer (NULL for self) */
  void **recv;   /* [nranks]: recv comm from each peer */
  void **listen; /* [nranks]: listen comm each peer connected to */
  void *user;    /* the shared scratch area (drv_run's shared_bytes) */
} drv_rank_t;

typedef struct {
  int nranks, version;
  const char *plugin;      /* NULL: default */
  size_t shared_bytes;     /* scratch shared by all ranks (user) */
  int timeout_s;           /* whole run; ranks are killed after it */
  int no_mesh;             /* 1: the rank function connects by itself */
  void *collect;           /* if set: receives the shared scratch area after the run */
  int no_load;             /* 1: ranks call the engine directly (tests linking it) */
} drv_opts_t;

typedef int (*drv_rank_fn)(drv_rank_t *r, void *arg);

/* Forks nranks processes, each loads the plugin, builds the full mesh (unless
 * no_mesh) and runs fn. Returns 0 when every rank returned 0 in time. */
int drv_run(const drv_opts_t *o, drv_rank_fn fn, void *arg);

/* Barrier over all ranks; gives up (returns -1) after timeout_s. */
int drv_barrier(drv_rank_t *r, int timeout_s);
/* The same, calling poll(arg) while it waits (a plugin that needs the
 * target's progress keeps moving); poll's non-zero return fails it. */
int drv_barrier_poll(drv_rank_t *r, int timeout_s, int (*poll)(void *), void *arg);
/* Whether another rank already failed (so this one can stop waiting). */
int drv_peer_failed(drv_rank_t *r);
/* pid of another rank (for fault tests). */
int drv_pid(drv_rank_t *r, int rank);
/* Lets the parent accept that `rank` dies of a signal (fault tests). */
void drv_mark_killable(drv_rank_t *r, int rank);
/* Connect to / accept from every peer; -1 on error or after timeout_s. */
int drv_mesh(drv_rank_t *r, int timeout_s);
void drv_close_mesh(drv_rank_t *r);
/* Polls test() until done; -1 on error or timeout (the ncclResult_t in *rc). */
int drv_wait(drv_rank_t *r, void *req, int *sizes, double timeout_s, ncclResult_t *rc);

double drv_now(void);
/* Command-line values for the benchmarks: a size with optional K/M/G suffix,
 * or an integer, within [lo, hi]; otherwise print what `flag` expected and
 * exit(2). */
size_t drv_parse_size(const char *flag, const char *s, size_t lo, size_t hi);
int drv_parse_int(const char *flag, const char *s, int lo, int hi);
/* A size sweep's growth factor: above 1, at most hi, finite. */
double drv_parse_factor(const char *flag, const char *s, double hi);
/* A plugin file: any non-empty string (dlopen would take "" as the program
 * itself and fail later, in every rank). */
const char *drv_parse_plugin(const char *flag, const char *s);
/* The benchmarks' embedded default fabric: PERSEUS_PROVIDER tcp;ofi_rxm and
 * PERSEUS_IFACE lo (shm on shm) where unset or empty (the plugin would take
 * an empty one as "choose", not as this default). */
void drv_default_fabric(void);
/* "<host> (<cores> cores, <cpu model>), <date>": the machine line benchmarks print. */
void drv_describe_host(char *out, size_t n);
/* Deterministic pattern of message `id` (fill and verify; verify returns the
 * first wrong offset or -1). */
void drv_fill(void *buf, size_t n, uint64_t id);
long drv_verify(const void *buf, size_t n, uint64_t id);
/* Number of bytes that differ from the pattern. */
long drv_count_wrong(const void *buf, size_t n, uint64_t id);
/* Zeroed memory that peers' writes land in: a shared mapping of a /dev/shm
 * file named "pm_<pid>_w<n>", which the model fabric (test/model) maps in
 * the writer to copy at memory speed (a file a crash leaves is removed by
 * the next model domain opened). Any provider treats it as plain memory.
 * NULL (printed why) on failure; drv_shared_free takes the same size. */
void *drv_shared_alloc(size_t size);
void drv_shared_free(void *p, size_t size);

/* In a rank function: on failure print where and why, and return 1. */
#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stderr, "rank %d: ", r->rank);                    \
      fprintf(stderr, __VA_ARGS__);                             \
      fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);        \
      return 1;                                                 \
    }                                                           \
  } while (0)

#endif
