/* The exported ncclNetPlugin_v8..v12 tables. Each entry only translates its
 * version's argument list into the version-neutral engine (ps_net.h). */
#include <stdlib.h>
#include <string.h>

#include "ps_abi.h"
#include "ps_handle.h"
#include "ps_log.h"
#include "ps_nccl_abi.h"
#include "ps_net.h"

/* Property translation: the fields every version shares. */
#define PS_FILL_COMMON(out, p)                 \
  do {                                         \
    (out)->name = (p).name;                    \
    (out)->pciPath = (p).pci_path;             \
    (out)->guid = (p).guid;                    \
    (out)->ptrSupport = (p).ptr_support;       \
    (out)->regIsGlobal = (p).reg_is_global;    \
    (out)->speed = (p).speed;                  \
    (out)->port = (p).port;                    \
    (out)->latency = (p).latency;              \
    (out)->maxComms = (p).max_comms;           \
    (out)->maxRecvs = (p).max_recvs;           \
    (out)->netDeviceType = NCCL_NET_DEVICE_HOST; \
    (out)->netDeviceVersion = 0;               \
  } while (0)

#define PS_FILL_V9(out, p, dev)                \
  do {                                         \
    PS_FILL_COMMON(out, p);                    \
    (out)->forceFlush = 0;                     \
    (out)->vProps.ndevs = 1;                   \
    (out)->vProps.devs[0] = (dev);             \
    (out)->maxP2pBytes = (p).max_p2p_bytes;    \
    (out)->maxCollBytes = (p).max_coll_bytes;  \
  } while (0)

/* NCCL hands a properties struct to fill; NULL is a caller bug, not a crash. */
#define PS_PROPS_OUT(out)                                          \
  do {                                                             \
    if (!(out)) {                                                  \
      PS_WARN("getProperties(%d): NULL properties pointer", dev); \
      return ncclInvalidArgument;                                  \
    }                                                              \
  } while (0)

static ncclResult_t props_v8(int dev, ps_props_v8_t *out) {
  ps_props_t p;
  PS_PROPS_OUT(out);
  PS_CHECK(ps_net_get_properties(dev, &p));
  memset(out, 0, sizeof *out);
  PS_FILL_COMMON(out, p);
  return ncclSuccess;
}

static ncclResult_t props_v9(int dev, ps_props_v9_t *out) {
  ps_props_t p;
  PS_PROPS_OUT(out);
  PS_CHECK(ps_net_get_properties(dev, &p));
  memset(out, 0, sizeof *out);
  PS_FILL_V9(out, p, dev);
  return ncclSuccess;
}

ncclResult_t ps_abi_props_v11(int dev, ps_props_v11_t *out) {
  ps_props_t p;
  PS_PROPS_OUT(out);
  PS_CHECK(ps_net_get_properties(dev, &p));
  memset(out, 0, sizeof *out);
  PS_FILL_V9(out, p, dev);
  out->maxMultiRequestSize = 1;
  return ncclSuccess;
}

ncclResult_t ps_abi_props_v12(int dev, ps_props_v12_t *out) {
  ps_props_t p;
  PS_PROPS_OUT(out);
  PS_CHECK(ps_net_get_properties(dev, &p));
  memset(out, 0, sizeof *out);
  PS_FILL_V9(out, p, dev);
  out->maxMultiRequestSize = 1;
  out->railId = PS_NCCL_ID_UNDEF;
  out->planeId = PS_NCCL_ID_UNDEF;
  return ncclSuccess;
}

/* --- init flavours --- */
static ncclResult_t init_v8(ncclDebugLogger_t log) { return ps_net_init(log); }
static ncclResult_t init_v10(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  (void)prof;
  return ps_net_init(log);
}

/* v11+: one context per NCCL communicator; we keep its id for logs, and it
 * owns the connects it starts (closed at finalize if never completed). */
typedef struct {
  uint64_t comm_id;
  int traffic_class;
  uint32_t slot; /* in ctx_tab */
} ps_ctx_t;

/* What NCCL holds of a context is a handle of this table (ps_handle.h): a
 * second finalize is refused instead of freeing twice. The handle's value
 * also names the connects the context starts (ps_net_connect's owner). */
static ps_htab_t ctx_tab = PS_HTAB_INIT(0x4e, "net context", "finalized");

ncclResult_t ps_abi_init_ctx(void **ctx, uint64_t comm_id, ps_comm_config_t *config,
                             ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  (void)prof;
  PS_CHECK(ps_net_init(log));
  if (!ctx) {
    PS_WARN("init: NULL context pointer");
    return ncclInvalidArgument;
  }
  ps_ctx_t *c = calloc(1, sizeof *c);
  if (!c) return ncclSystemError;
  ncclResult_t rc = ps_htab_reserve(&ctx_tab, 1, &c->slot);
  if (rc != ncclSuccess) {
    free(c);
    return rc;
  }
  c->comm_id = comm_id;
  c->traffic_class = config ? config->trafficClass : -1;
  PS_TRACE("context for comm 0x%llx (traffic class %d)", (unsigned long long)comm_id,
           c->traffic_class);
  *ctx = ps_htab_bind(&ctx_tab, c->slot, c);
  return ncclSuccess;
}

ncclResult_t ps_abi_finalize_ctx(void *ctx) {
  ps_ctx_t *c = ps_htab_lookup(&ctx_tab, ctx, "finalize");
  if (!c) return ncclInvalidArgument;
  ps_htab_release(&ctx_tab, c->slot, 1); /* stale first: a second finalize is refused */
  ps_net_forget_connects((uintptr_t)ctx);
  free(c);
  return ncclSuccess;
}

/* A context handed back by NCCL must be one init made and finalize did not
 * end (a stale one's connects would outlive their finalize). */
static int live_ctx(void *ctx, const char *call) { return ps_htab_lookup(&ctx_tab, ctx, call) != NULL; }

static ncclResult_t set_net_attr(void *ctx, ps_net_attr_t *attr) {
  if (!live_ctx(ctx, "setNetAttr")) return ncclInvalidArgument;
  if (attr)
    PS_TRACE("setNetAttr: op %u algo %u proto %u (no tuning applied)", attr->op, attr->algo,
             attr->proto);
  return ncclSuccess;
}

/* --- connection setup --- */
static ncclResult_t listen_v11(void *ctx, int dev, void *handle, void **lc) {
  return live_ctx(ctx, "listen") ? ps_net_listen(dev, handle, lc) : ncclInvalidArgument;
}
static ncclResult_t connect_v8(int dev, void *handle, void **sc, ps_nccl_dev_handle_t **sdev) {
  if (sdev) *sdev = NULL; /* no device offload */
  return ps_net_connect(dev, handle, sc, 0);
}
static ncclResult_t connect_v10(int dev, ps_comm_config_t *cfg, void *handle, void **sc,
                                ps_nccl_dev_handle_t **sdev) {
  (void)cfg;
  return connect_v8(dev, handle, sc, sdev);
}
static ncclResult_t connect_v11(void *ctx, int dev, void *handle, void **sc,
                                ps_nccl_dev_handle_t **sdev) {
  if (sdev) *sdev = NULL;
  if (!live_ctx(ctx, "connect")) return ncclInvalidArgument;
  /* the context's address names the connect's owner (finalize ends them) */
  return ps_net_connect(dev, handle, sc, (uintptr_t)ctx);
}
static ncclResult_t accept_any(void *lc, void **rc, ps_nccl_dev_handle_t **rdev) {
  if (rdev) *rdev = NULL;
  return ps_net_accept(lc, rc);
}

/* --- data path --- */
static ncclResult_t isend_v8(void *sc, void *data, int size, int tag, void *mh, void **req) {
  if (size < 0) {
    PS_WARN("isend: negative size %d", size);
    return ncclInvalidArgument;
  }
  return ps_net_isend(sc, data, (size_t)size, tag, mh, req);
}
static ncclResult_t isend_v9(void *sc, void *data, size_t size, int tag, void *mh, void **req) {
  return ps_net_isend(sc, data, size, tag, mh, req);
}
static ncclResult_t isend_v10(void *sc, void *data, size_t size, int tag, void *mh, void *ph,
                              void **req) {
  (void)ph;
  return ps_net_isend(sc, data, size, tag, mh, req);
}
static ncclResult_t irecv_v8(void *rc, int n, void **data, int *sizes, int *tags, void **mhs,
                             void **req) {
  size_t s[8];
  if (n < 1 || n > 8 || !sizes) {
    if (!sizes)
      PS_WARN("irecv: NULL sizes array");
    else
      PS_WARN("irecv: %d grouped receives, expected 1..8", n);
    return ncclInvalidArgument;
  }
  for (int i = 0; i < n; i++) {
    if (sizes[i] < 0) {
      PS_WARN("irecv: negative size %d", sizes[i]);
      return ncclInvalidArgument;
    }
    s[i] = (size_t)sizes[i];
  }
  return ps_net_irecv(rc, n, data, s, tags, mhs, req);
}
static ncclResult_t irecv_v9(void *rc, int n, void **data, size_t *sizes, int *tags, void **mhs,
                             void **req) {
  return ps_net_irecv(rc, n, data, sizes, tags, mhs, req);
}
static ncclResult_t irecv_v10(void *rc, int n, void **data, size_t *sizes, int *tags, void **mhs,
                              void **phs, void **req) {
  (void)phs;
  return ps_net_irecv(rc, n, data, sizes, tags, mhs, req);
}

/* ndevs from 1 to the table's array (max) */
static ncclResult_t vdev_check(const void *p, int ndevs, int max) {
  if (!p) PS_WARN("makeVDevice: NULL properties pointer");
  else if (ndevs < 1 || ndevs > max)
    PS_WARN("makeVDevice: ndevs %d (expected 1 to %d)", ndevs, max);
  return p && ndevs >= 1 && ndevs <= max ? ncclSuccess : ncclInvalidArgument;
}
static ncclResult_t vdev_v9(int *d, ps_vprops_v9_t *p) {
  PS_CHECK(vdev_check(p, p ? p->ndevs : 0, PS_VDEV_MAX_V11));
  return ps_net_make_vdevice(d, p->ndevs, p->devs);
}
static ncclResult_t vdev_v12(int *d, ps_vprops_v12_t *p) {
  PS_CHECK(vdev_check(p, p ? p->ndevs : 0, PS_VDEV_MAX_V12));
  return ps_net_make_vdevice(d, p->ndevs, p->devs);
}

#define PS_COMMON_TAIL                                                             \
  .regMr = ps_net_reg_mr, .regMrDmaBuf = ps_net_reg_mr_dmabuf,                     \
  .deregMr = ps_net_dereg_mr, .iflush = ps_net_iflush, .test = ps_net_test,        \
  .closeSend = ps_net_close_send, .closeRecv = ps_net_close_recv,                  \
  .closeListen = ps_net_close_listen, .getDeviceMr = NULL, .irecvConsumed = NULL

PS_EXPORT const ncclNet_v8_t ncclNetPlugin_v8 = {
    .name = PS_PLUGIN_NAME, .init = init_v8, .devices = ps_net_devices,
    .getProperties = props_v8, .listen = ps_net_listen, .connect = connect_v8,
    .accept = accept_any, .isend = isend_v8, .irecv = irecv_v8, PS_COMMON_TAIL};

PS_EXPORT const ncclNet_v9_t ncclNetPlugin_v9 = {
    .name = PS_PLUGIN_NAME, .init = init_v8, .devices = ps_net_devices,
    .getProperties = props_v9, .listen = ps_net_listen, .connect = connect_v8,
    .accept = accept_any, .isend = isend_v9, .irecv = irecv_v9, .makeVDevice = vdev_v9,
    PS_COMMON_TAIL};

PS_EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {
    .name = PS_PLUGIN_NAME, .init = init_v10, .devices = ps_net_devices,
    .getProperties = props_v9, .listen = ps_net_listen, .connect = connect_v10,
    .accept = accept_any, .isend = isend_v10, .irecv = irecv_v10, .makeVDevice = vdev_v9,
    PS_COMMON_TAIL};

PS_EXPORT const ncclNet_v11_t ncclNetPlugin_v11 = {
    .name = PS_PLUGIN_NAME, .init = ps_abi_init_ctx, .devices = ps_net_devices,
    .getProperties = ps_abi_props_v11, .listen = listen_v11, .connect = connect_v11,
    .accept = accept_any, .isend = isend_v10, .irecv = irecv_v10, .makeVDevice = vdev_v9,
    .finalize = ps_abi_finalize_ctx, .setNetAttr = set_net_attr, PS_COMMON_TAIL};

PS_EXPORT const ncclNet_v12_t ncclNetPlugin_v12 = {
    .name = PS_PLUGIN_NAME, .init = ps_abi_init_ctx, .devices = ps_net_devices,
    .getProperties = ps_abi_props_v12, .listen = listen_v11, .connect = connect_v11,
    .accept = accept_any, .isend = isend_v10, .irecv = irecv_v10, .makeVDevice = vdev_v12,
    .finalize = ps_abi_finalize_ctx, .setNetAttr = set_net_attr, PS_COMMON_TAIL};
