/* Our own declarations of NCCL's one-sided plugin ABI: ncclGin_v11 (NCCL
 * 2.28), ncclGin_v12 (2.29), ncclGin_v13 == ncclRma_v13 and ncclRma_v14
 * (2.30). ABI facts only: member order and argument lists must match what
 * NCCL dlsym()s. Nothing here is exported until the engine behind it is
 * complete (issue 3). */
#ifndef PS_GIN_ABI_H
#define PS_GIN_ABI_H

#include <stdbool.h>

#include "ps_nccl_abi.h"

#define NCCL_NET_MR_FLAG_FORCE_SO (1 << 0)          /* region holds signals */
#define NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET (1 << 1) /* hint: signals only grow */
#define NCCL_NET_SIGNAL_OP_INC 0x1
#define NCCL_NET_SIGNAL_OP_ADD 0x2

typedef ncclResult_t (*ps_gin_init_fn)(void **ctx, uint64_t commId, ncclDebugLogger_t log);
typedef ncclResult_t (*ps_gin_listen_fn)(void *ctx, int dev, void *handle, void **listenComm);
typedef ncclResult_t (*ps_gin_regsym_fn)(void *collComm, void *data, size_t size, int type,
                                         uint64_t mrFlags, void **mhandle, void **ginHandle);
typedef ncclResult_t (*ps_gin_regsym_dmabuf_fn)(void *collComm, void *data, size_t size, int type,
                                                uint64_t offset, int fd, uint64_t mrFlags,
                                                void **mhandle, void **ginHandle);
typedef ncclResult_t (*ps_gin_test_fn)(void *collComm, void *request, int *done);

/* NCCL 2.28: proxy mode calls ginProgress(collComm); createContext unused. */
typedef struct {
  const char *name;
  ps_gin_init_fn init;
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ps_props_v11_t *props);
  ps_gin_listen_fn listen;
  ncclResult_t (*connect)(void *ctx, void *handles[], int nranks, int rank, void *listenComm,
                          void **collComm);
  ncclResult_t (*createContext)(void *collComm, int nSignals, int nCounters, void **ginCtx,
                                ps_nccl_dev_handle_t **devHandle);
  ps_gin_regsym_fn regMrSym;
  ps_gin_regsym_dmabuf_fn regMrSymDmaBuf;
  ncclResult_t (*deregMrSym)(void *collComm, void *mhandle);
  ncclResult_t (*destroyContext)(void *ginCtx);
  ncclResult_t (*closeColl)(void *collComm);
  ncclResult_t (*closeListen)(void *listenComm);
  ncclResult_t (*iput)(void *collComm, uint64_t srcOff, void *srcMh, size_t size, uint64_t dstOff,
                       void *dstMh, uint32_t rank, void **request);
  ncclResult_t (*iputSignal)(void *collComm, uint64_t srcOff, void *srcMh, size_t size,
                             uint64_t dstOff, void *dstMh, uint32_t rank, uint64_t signalOff,
                             void *signalMh, uint64_t signalValue, uint32_t signalOp,
                             void **request);
  ps_gin_test_fn test;
  ncclResult_t (*ginProgress)(void *collComm);
  ncclResult_t (*queryLastError)(void *ginCtx, bool *hasError);
  ncclResult_t (*finalize)(void *ctx);
} ncclGin_v11_t;

/* NCCL 2.29: connect gains (nConnections, queueDepth), createContext gains
 * nContexts, iput/iputSignal gain a connectionId before the request. */
typedef struct {
  const char *name;
  ps_gin_init_fn init;
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ps_props_v11_t *props);
  ps_gin_listen_fn listen;
  ncclResult_t (*connect)(void *ctx, void *handles[], int nranks, int rank, int nConnections,
                          int queueDepth, void *listenComm, void **collComm);
  ncclResult_t (*createContext)(void *collComm, int nSignals, int nCounters, int nContexts,
                                void **ginCtx, ps_nccl_dev_handle_t **devHandle);
  ps_gin_regsym_fn regMrSym;
  ps_gin_regsym_dmabuf_fn regMrSymDmaBuf;
  ncclResult_t (*deregMrSym)(void *collComm, void *mhandle);
  ncclResult_t (*destroyContext)(void *ginCtx);
  ncclResult_t (*closeColl)(void *collComm);
  ncclResult_t (*closeListen)(void *listenComm);
  ncclResult_t (*iput)(void *collComm, uint64_t srcOff, void *srcMh, size_t size, uint64_t dstOff,
                       void *dstMh, uint32_t rank, int connectionId, void **request);
  ncclResult_t (*iputSignal)(void *collComm, uint64_t srcOff, void *srcMh, size_t size,
                             uint64_t dstOff, void *dstMh, uint32_t rank, uint64_t signalOff,
                             void *signalMh, uint64_t signalValue, uint32_t signalOp,
                             int connectionId, void **request);
  ps_gin_test_fn test;
  ncclResult_t (*ginProgress)(void *collComm);
  ncclResult_t (*queryLastError)(void *ginCtx, bool *hasError);
  ncclResult_t (*finalize)(void *ctx);
} ncclGin_v12_t;

typedef struct {
  int nSignals, nCounters, nContexts, queueDepth, trafficClass;
} ps_gin_config_v13_t;

/* NCCL 2.30: operations address a context (and a context index inside it);
 * iget and iflush appear; ginProgress takes the context. ncclRma_v13 has
 * this same layout. */
typedef struct {
  const char *name;
  ps_gin_init_fn init;
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ps_props_v12_t *props);
  ps_gin_listen_fn listen;
  ncclResult_t (*connect)(void *ctx, void *handles[], int nranks, int rank, void *listenComm,
                          void **collComm);
  ncclResult_t (*createContext)(void *collComm, ps_gin_config_v13_t *config, void **ginCtx,
                                ps_nccl_dev_handle_t **devHandle);
  ps_gin_regsym_fn regMrSym;
  ps_gin_regsym_dmabuf_fn regMrSymDmaBuf;
  ncclResult_t (*deregMrSym)(void *collComm, void *mhandle);
  ncclResult_t (*destroyContext)(void *ginCtx);
  ncclResult_t (*closeColl)(void *collComm);
  ncclResult_t (*closeListen)(void *listenComm);
  ncclResult_t (*iput)(void *ginCtx, int context, uint64_t srcOff, void *srcMh, size_t size,
                       uint64_t dstOff, void *dstMh, uint32_t rank, void **request);
  ncclResult_t (*iputSignal)(void *ginCtx, int context, uint64_t srcOff, void *srcMh, size_t size,
                             uint64_t dstOff, void *dstMh, uint32_t rank, uint64_t signalOff,
                             void *signalMh, uint64_t signalValue, uint32_t signalOp,
                             void **request);
  ncclResult_t (*iget)(void *ginCtx, int context, uint64_t remoteOff, void *remoteMh, size_t size,
                       uint64_t localOff, void *localMh, uint32_t rank, void **request);
  ncclResult_t (*iflush)(void *ginCtx, int context, void *mhandle, uint32_t rank, void **request);
  ps_gin_test_fn test;
  ncclResult_t (*ginProgress)(void *ginCtx);
  ncclResult_t (*queryLastError)(void *ginCtx, bool *hasError);
  ncclResult_t (*finalize)(void *ctx);
} ncclGin_v13_t;
typedef ncclGin_v13_t ncclRma_v13_t;

typedef struct {
  int nContexts, trafficClass, rankStride;
} ps_rma_config_v14_t;

/* NCCL 2.30's RMA v14: no device handles; iputSignal says whether the signal
 * must be strongly ordered behind its data. */
typedef struct {
  const char *name;
  ps_gin_init_fn init;
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ps_props_v12_t *props);
  ps_gin_listen_fn listen;
  ncclResult_t (*connect)(void *ctx, void *handles[], int nranks, int rank, void *listenComm,
                          void **collComm);
  ncclResult_t (*createContext)(void *collComm, ps_rma_config_v14_t *config, void **rmaCtx);
  ncclResult_t (*regMrSym)(void *collComm, void *data, size_t size, int type, uint64_t mrFlags,
                           void **mhandle);
  ncclResult_t (*regMrSymDmaBuf)(void *collComm, void *data, size_t size, int type,
                                 uint64_t offset, int fd, uint64_t mrFlags, void **mhandle);
  ncclResult_t (*deregMrSym)(void *collComm, void *mhandle);
  ncclResult_t (*destroyContext)(void *rmaCtx);
  ncclResult_t (*closeColl)(void *collComm);
  ncclResult_t (*closeListen)(void *listenComm);
  ncclResult_t (*iput)(void *rmaCtx, int context, uint64_t srcOff, void *srcMh, size_t size,
                       uint64_t dstOff, void *dstMh, uint32_t rank, void **request);
  ncclResult_t (*iputSignal)(void *rmaCtx, int context, uint64_t srcOff, void *srcMh, size_t size,
                             uint64_t dstOff, void *dstMh, uint32_t rank, uint64_t signalOff,
                             void *signalMh, uint64_t signalValue, uint32_t signalOp,
                             bool isStrongSignal, void **request);
  ncclResult_t (*iget)(void *rmaCtx, int context, uint64_t remoteOff, void *remoteMh, size_t size,
                       uint64_t localOff, void *localMh, uint32_t rank, void **request);
  ncclResult_t (*iflush)(void *rmaCtx, int context, void *mhandle, uint32_t rank, void **request);
  ps_gin_test_fn test;
  ncclResult_t (*rmaProgress)(void *rmaCtx);
  ncclResult_t (*queryLastError)(void *rmaCtx, bool *hasError);
  ncclResult_t (*finalize)(void *ctx);
} ncclRma_v14_t;

#endif
