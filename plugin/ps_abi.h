/* Shared by the exported tables (net_abi.c, gin_abi.c): the export
 * attribute and the init/properties translations both families reuse. */
#ifndef PS_ABI_H
#define PS_ABI_H

#include "ps_nccl_abi.h"

/* The library is built with hidden visibility: only what carries this is
 * visible to dlsym(). */
#define PS_EXPORT __attribute__((visibility("default")))
#define PS_PLUGIN_NAME "Perseus"

/* init/finalize of a per-communicator context (net v11+, every GIN/RMA table). */
ncclResult_t ps_abi_init_ctx(void **ctx, uint64_t comm_id, ps_comm_config_t *config,
                             ncclDebugLogger_t log, ncclProfilerCallback_t prof);
ncclResult_t ps_abi_finalize_ctx(void *ctx);
/* Net properties in the v11 and v12 layouts (netDeviceType HOST). */
ncclResult_t ps_abi_props_v11(int dev, ps_props_v11_t *out);
ncclResult_t ps_abi_props_v12(int dev, ps_props_v12_t *out);

#endif
