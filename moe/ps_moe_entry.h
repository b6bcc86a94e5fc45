/* ps_moe_entry.h: what the entry points of the fused layer (moe.cu) and of
 * the bulk-synchronous baseline (moe_baseline.cu) share: the end of create
 * and the argument check of load_weights. C++ host code. */
#ifndef PS_MOE_ENTRY_H
#define PS_MOE_ENTRY_H

#include <stdint.h>
#include <stdio.h>

#include <nccl.h>

#include "perseus/moe_config.h"
#include "ps_moe_ref.h"

/* The end of a create whose setup of obj returned rc: on success *out =
 * obj; on failure obj is destroyed (destroy(obj) frees what the setup got)
 * and rc returned, perseus_moe_last_error() still the setup's reason, not
 * one the cleanup sets. */
template <typename T, typename Destroy>
inline ncclResult_t ps_moe_create_end(ncclResult_t rc, T *obj, Destroy destroy, T **out)
{
  if (rc != ncclSuccess) {
    char why[512];
    snprintf(why, sizeof(why), "%s", perseus_moe_last_error());
    destroy(obj);
    ps_moe_set_error("%s", why);
    return rc;
  }
  *out = obj;
  return ncclSuccess;
}

/* load_weights' arguments: true when the layer (`what` names it in the
 * error) and every weight are there; else false, the error set. */
inline bool ps_moe_weights_args_ok(const char *fn, const char *what, const void *obj, const uint16_t *gate,
                                   const uint16_t *w1, const uint16_t *w3, const uint16_t *w2)
{
  if (obj && gate && w1 && w3 && w2) return true;
  ps_moe_set_error("%s: a NULL argument (%s %p, gate %p, w1 %p, w3 %p, w2 %p)", fn, what, obj,
                   (const void *)gate, (const void *)w1, (const void *)w3, (const void *)w2);
  return false;
}

#endif
