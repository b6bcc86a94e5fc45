/* coll_perf.h: internal header of perseus_coll_perf, shared by its three files.
 *
 * Holds what the parent and the forked children agree on: the limits, the
 * sweep and collective numbering, the options (struct ps_cfg), the layout of
 * the shared anonymous mapping (struct ps_shared) the children report through,
 * and the entry points each file offers the others. perseus_coll_perf.c owns
 * the globals and main; coll_ops.c is what the children run (the only file that
 * calls CUDA); coll_proc.c forks, watches and reaps them. Not installed. */
#ifndef PS_COLL_PERF_H
#define PS_COLL_PERF_H

#include <limits.h>
#include <signal.h>
#include <stddef.h>
#include <sys/types.h>

#include <nccl.h>

#define PS_MAX_SIZES 64
#define PS_MAX_GPUS 64
#define PS_NAME_LEN 256

enum { SW_PERSEUS, SW_SOCKET, SW_N };
enum { C_ALL_REDUCE, C_ALL_GATHER, C_REDUCE_SCATTER, C_ALLTOALL, C_BROADCAST, C_N };

struct ps_result {
  int state;          /* 0 not measured, 1 measured, 2 skipped (0 elements) */
  double time_us, algbw, busbw;
  long long wrong;    /* summed over ranks */
};

struct ps_shared {
  /* filled by the probe child */
  int ndev, driver_ver, runtime_ver, nccl_ver;
  char gpu_name[PS_MAX_GPUS][PS_NAME_LEN];
  int gpu_major[PS_MAX_GPUS], gpu_minor[PS_MAX_GPUS];
  size_t gpu_mem[PS_MAX_GPUS];
  /* per-sweep control, reset by the parent before each fork */
  int id_ready, abort_flag, ranks_done;
  unsigned bar_count, bar_gen;
  double rank_us[PS_MAX_GPUS];  /* per-rank time of the current size */
  ncclUniqueId id;
  struct ps_result res[SW_N][C_N][PS_MAX_SIZES];
};

struct ps_cfg {
  int ngpus, iters, warmup, check, timeout_s, avg_mode;
  size_t min_bytes, max_bytes, factor;
  int coll_on[C_N], sweep_on[SW_N];
  char plugin[PATH_MAX];
  const char *iface, *provider;
  size_t sizes[PS_MAX_SIZES];
  int nsizes;
};

struct ps_counts { size_t send, recv, param, size_col, alg_bytes; };

/* perseus_coll_perf.c */
extern const char *const coll_sweep_names[SW_N];
extern const char *const coll_names[C_N];
extern struct ps_cfg coll_cfg;
extern struct ps_shared *coll_shm;
extern volatile sig_atomic_t coll_signal;

/* coll_ops.c: run in the forked children; the two *_main never return */
int coll_counts(int c, size_t bytes, int n, struct ps_counts *k);
void coll_child_main(int sw, int rank);
void coll_probe_main(void);

/* coll_proc.c: run in the parent */
double coll_now_s(void);
int coll_spawn(int sw, int nproc, double deadline, int *timed_out);

#endif
