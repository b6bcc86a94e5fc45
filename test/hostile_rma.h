/* Shared by hostile_rma.c (harness and most scenarios) and
 * hostile_rma_bounds.c (bounds, bad setup calls): the windows, the valid
 * put+signal ring, refusals checked against the log, and the raw table. */
#ifndef HOSTILE_RMA_H
#define HOSTILE_RMA_H

#include <stdint.h>

#include "ps_driver_gin.h"
#include "ps_gin_abi.h"

#define SZ 4096
#define HOST NCCL_PTR_HOST
#define INC NCCL_NET_SIGNAL_OP_INC
#define ADD NCCL_NET_SIGNAL_OP_ADD
#define RAW_OPENS 2 /* handle areas for comms opened on the raw table */

typedef struct {
  const char *abi, *plugin, *scenario;
  int ver, idx; /* version; index in abis[] */
} args_t;

typedef struct {
  drv_gin_t *g;
  void *reg, *ops; /* what registration takes (collComm), what operations take */
  unsigned char *src, *dst;
  uint64_t *sig;
  void *src_mh, *dst_mh, *sig_mh;
  uint64_t rounds;
} win_t;

/* What this rank logged since the last read (echoed to the real stderr). */
const char *capture_read(void);
int has_warn(const char *log, const char *sub);
/* 0 when rc is an error and the log has a warning containing sub; else
 * says why and returns 1 (0 with -k, counting the failure). */
int refused(drv_rank_t *r, ncclResult_t rc, const char *sub, const char *what);

/* `call` must fail and log a warning containing `sub`. */
#define REFUSED(call, sub, ...)                                                            \
  do {                                                                                     \
    char what_[200];                                                                       \
    capture_read();                                                                        \
    ncclResult_t rc_ = (call);                                                             \
    if (snprintf(what_, sizeof what_, __VA_ARGS__), refused(r, rc_, sub, what_)) return 1; \
  } while (0)

/* One valid put+signal round among ranks lo..; the others keep the barrier. */
int ring(drv_rank_t *r, win_t *w, int lo);

/* The table under test, for the calls the driver does not make. listen,
 * closeListen, destroyContext and closeColl sit at one place in every
 * version (T11); createContext, connect and finalize do not. */
extern const void *tbl;
#define T11 ((const ncclGin_v11_t *)tbl)
#define T12 ((const ncclGin_v12_t *)tbl)
#define T13 ((const ncclGin_v13_t *)tbl)
#define T14 ((const ncclRma_v14_t *)tbl)

typedef struct {
  void *lc, *cc, *ctx;
} raw_t;

ncclResult_t raw_ctx(int ver, void *cc, int n, void **ctx);
ncclResult_t raw_connect(int ver, void **hp, int P, int me, void *lc, void **cc);
/* A second comm, as drv_gin_connect makes one, on the raw table, through
 * handle area k of the shared scratch (its listenComm left open; hp gets
 * the handles). */
int raw_open(drv_rank_t *r, const args_t *a, int k, raw_t *x, void **hp);

int bounds(drv_rank_t *r, const args_t *a, win_t *w);

#endif
