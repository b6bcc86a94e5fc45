/* Shared by the driver's loaders (ps_driver_load.c: net tables,
 * ps_driver_gin.c: one-sided tables). */
#ifndef PS_DRIVER_INT_H
#define PS_DRIVER_INT_H

#include "ps_nccl_abi.h"

/* dlopen(path), or drv_default_plugin() when path is NULL; on failure prints
 * why and returns NULL. *used (if set) receives the path tried. */
void *drv_open_plugin(const char *path, const char **used);

/* NCCL's logger signature; prints WARNs (and INFO with NCCL_DEBUG=INFO). */
void drv_logger(ncclDebugLogLevel lvl, unsigned long flags, const char *file, int line,
                const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#endif
