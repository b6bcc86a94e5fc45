/* Our own declarations of NCCL's network-plugin ABI (net v8..v12).
 *
 * These are ABI facts: member order, types and sizes must match what NCCL
 * dlsym()s, version by version. Written from the published layout, no NCCL
 * header is needed to build the plugin. */
#ifndef PS_NCCL_ABI_H
#define PS_NCCL_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5,
} ncclDebugLogLevel;

enum { NCCL_INIT = 0x1, NCCL_NET = 0x10, NCCL_ENV = 0x80 };

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags,
                                  const char *file, int line, const char *fmt, ...);
typedef ncclResult_t (*ncclProfilerCallback_t)(void **eHandle, int type, void *pHandle,
                                               int64_t pluginId, void *extData);

#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
#define NCCL_NET_MAX_REQUESTS 32
#define PS_NCCL_MAX_NET_SIZE (1ULL << 40) /* NCCL's cap on maxP2pBytes/maxCollBytes */
#define PS_NCCL_V8_MAX_SIZE (1ULL << 30)  /* v8 passes int sizes */
#define PS_NCCL_ID_UNDEF (-1)

typedef enum {
  NCCL_NET_DEVICE_HOST = 0,
  NCCL_NET_DEVICE_UNPACK = 1,
  NCCL_NET_DEVICE_GIN_PROXY = 2,
} ncclNetDeviceType;

typedef struct {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void *handle;
  size_t size;
  int needsProxyProgress;
} ps_nccl_dev_handle_t; /* identical for v7..v12 */

#define PS_VDEV_MAX_V11 4 /* devs[] length for v9..v11 */
#define PS_VDEV_MAX_V12 8

typedef struct { int ndevs; int devs[PS_VDEV_MAX_V11]; } ps_vprops_v9_t;
typedef struct { int ndevs; int devs[PS_VDEV_MAX_V12]; } ps_vprops_v12_t;

typedef struct { int trafficClass; } ps_comm_config_t; /* v10..v12 */

typedef struct {
  int32_t maxConcurrentPeers, minConcurrentPeers, maxFlowsPerPeer, minFlowsPerPeer;
} ps_comm_attr_t;
typedef struct {
  ps_comm_attr_t sendCommAttr, recvCommAttr;
  uint32_t op, algo, proto;
} ps_net_attr_t; /* v11, v12 */

/* Properties: the common head, then per-version tails. */
#define PS_PROPS_HEAD                                        \
  char *name;                                                \
  char *pciPath;                                             \
  uint64_t guid;                                             \
  int ptrSupport;                                            \
  int regIsGlobal;

typedef struct {
  PS_PROPS_HEAD
  int speed, port;
  float latency;
  int maxComms, maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
} ps_props_v8_t;

#define PS_PROPS_V9_BODY                                     \
  PS_PROPS_HEAD                                              \
  int forceFlush;                                            \
  int speed, port;                                           \
  float latency;                                             \
  int maxComms, maxRecvs;                                    \
  ncclNetDeviceType netDeviceType;                           \
  int netDeviceVersion;

typedef struct {
  PS_PROPS_V9_BODY
  ps_vprops_v9_t vProps;
  size_t maxP2pBytes, maxCollBytes;
} ps_props_v9_t; /* also v10 */

typedef struct {
  PS_PROPS_V9_BODY
  ps_vprops_v9_t vProps;
  size_t maxP2pBytes, maxCollBytes;
  int maxMultiRequestSize;
} ps_props_v11_t;

typedef struct {
  PS_PROPS_V9_BODY
  ps_vprops_v12_t vProps;
  size_t maxP2pBytes, maxCollBytes;
  int maxMultiRequestSize;
  int16_t railId, planeId;
} ps_props_v12_t;

typedef ncclResult_t (*ps_regmr_fn)(void *comm, void *data, size_t size, int type, void **mh);
typedef ncclResult_t (*ps_regmr_dmabuf_fn)(void *comm, void *data, size_t size, int type,
                                           uint64_t offset, int fd, void **mh);
typedef ncclResult_t (*ps_iflush_fn)(void *rcomm, int n, void **data, int *sizes,
                                     void **mhandles, void **request);

typedef struct {
  const char *name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ps_props_v8_t *props);
  ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
  ncclResult_t (*connect)(int dev, void *handle, void **sendComm, ps_nccl_dev_handle_t **sdev);
  ncclResult_t (*accept)(void *listenComm, void **recvComm, ps_nccl_dev_handle_t **rdev);
  ps_regmr_fn regMr;
  ps_regmr_dmabuf_fn regMrDmaBuf;
  ncclResult_t (*deregMr)(void *comm, void *mhandle);
  ncclResult_t (*isend)(void *sendComm, void *data, int size, int tag, void *mh, void **req);
  ncclResult_t (*irecv)(void *recvComm, int n, void **data, int *sizes, int *tags, void **mhs,
                        void **req);
  ps_iflush_fn iflush;
  ncclResult_t (*test)(void *request, int *done, int *sizes);
  ncclResult_t (*closeSend)(void *sendComm);
  ncclResult_t (*closeRecv)(void *recvComm);
  ncclResult_t (*closeListen)(void *listenComm);
  ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);
} ncclNet_v8_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ps_props_v9_t *props);
  ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
  ncclResult_t (*connect)(int dev, void *handle, void **sendComm, ps_nccl_dev_handle_t **sdev);
  ncclResult_t (*accept)(void *listenComm, void **recvComm, ps_nccl_dev_handle_t **rdev);
  ps_regmr_fn regMr;
  ps_regmr_dmabuf_fn regMrDmaBuf;
  ncclResult_t (*deregMr)(void *comm, void *mhandle);
  ncclResult_t (*isend)(void *sendComm, void *data, size_t size, int tag, void *mh, void **req);
  ncclResult_t (*irecv)(void *recvComm, int n, void **data, size_t *sizes, int *tags,
                        void **mhs, void **req);
  ps_iflush_fn iflush;
  ncclResult_t (*test)(void *request, int *done, int *sizes);
  ncclResult_t (*closeSend)(void *sendComm);
  ncclResult_t (*closeRecv)(void *recvComm);
  ncclResult_t (*closeListen)(void *listenComm);
  ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);
  ncclResult_t (*makeVDevice)(int *d, ps_vprops_v9_t *props);
} ncclNet_v9_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction, ncclProfilerCallback_t prof);
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ps_props_v9_t *props);
  ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
  ncclResult_t (*connect)(int dev, ps_comm_config_t *config, void *handle, void **sendComm,
                          ps_nccl_dev_handle_t **sdev);
  ncclResult_t (*accept)(void *listenComm, void **recvComm, ps_nccl_dev_handle_t **rdev);
  ps_regmr_fn regMr;
  ps_regmr_dmabuf_fn regMrDmaBuf;
  ncclResult_t (*deregMr)(void *comm, void *mhandle);
  ncclResult_t (*isend)(void *sendComm, void *data, size_t size, int tag, void *mh, void *ph,
                        void **req);
  ncclResult_t (*irecv)(void *recvComm, int n, void **data, size_t *sizes, int *tags,
                        void **mhs, void **phs, void **req);
  ps_iflush_fn iflush;
  ncclResult_t (*test)(void *request, int *done, int *sizes);
  ncclResult_t (*closeSend)(void *sendComm);
  ncclResult_t (*closeRecv)(void *recvComm);
  ncclResult_t (*closeListen)(void *listenComm);
  ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);
  ncclResult_t (*makeVDevice)(int *d, ps_vprops_v9_t *props);
} ncclNet_v10_t;

/* v11 and v12 differ only in the properties and vProps types. */
#define PS_NET_V11_LIKE(PROPS, VPROPS)                                                    \
  struct {                                                                                \
    const char *name;                                                                     \
    ncclResult_t (*init)(void **ctx, uint64_t commId, ps_comm_config_t *config,           \
                         ncclDebugLogger_t logFunction, ncclProfilerCallback_t prof);     \
    ncclResult_t (*devices)(int *ndev);                                                   \
    ncclResult_t (*getProperties)(int dev, PROPS *props);                                 \
    ncclResult_t (*listen)(void *ctx, int dev, void *handle, void **listenComm);          \
    ncclResult_t (*connect)(void *ctx, int dev, void *handle, void **sendComm,            \
                            ps_nccl_dev_handle_t **sdev);                                 \
    ncclResult_t (*accept)(void *listenComm, void **recvComm, ps_nccl_dev_handle_t **rd); \
    ps_regmr_fn regMr;                                                                    \
    ps_regmr_dmabuf_fn regMrDmaBuf;                                                       \
    ncclResult_t (*deregMr)(void *comm, void *mhandle);                                   \
    ncclResult_t (*isend)(void *sendComm, void *data, size_t size, int tag, void *mh,     \
                          void *ph, void **req);                                          \
    ncclResult_t (*irecv)(void *recvComm, int n, void **data, size_t *sizes, int *tags,   \
                          void **mhs, void **phs, void **req);                            \
    ps_iflush_fn iflush;                                                                  \
    ncclResult_t (*test)(void *request, int *done, int *sizes);                           \
    ncclResult_t (*closeSend)(void *sendComm);                                            \
    ncclResult_t (*closeRecv)(void *recvComm);                                            \
    ncclResult_t (*closeListen)(void *listenComm);                                        \
    ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);          \
    ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);                  \
    ncclResult_t (*makeVDevice)(int *d, VPROPS *props);                                   \
    ncclResult_t (*finalize)(void *ctx);                                                  \
    ncclResult_t (*setNetAttr)(void *ctx, ps_net_attr_t *netAttr);                        \
  }

typedef PS_NET_V11_LIKE(ps_props_v11_t, ps_vprops_v9_t) ncclNet_v11_t;
typedef PS_NET_V11_LIKE(ps_props_v12_t, ps_vprops_v12_t) ncclNet_v12_t;

#endif
