/* A model NIC: test-only behaviour that a test plugin puts between us and
 * the provider (ps_model_nic.c, compiled into the test plugins only, sets
 * ps_model_nic when it loads). In the shipped plugin ps_model_nic is NULL and
 * every caller goes straight to the endpoint. A hook left NULL means the
 * model does nothing there. */
#ifndef PS_MODEL_NIC_H
#define PS_MODEL_NIC_H

#include "ps_ep.h"

typedef struct ps_model ps_model_t; /* per one-sided comm, owned by ps_model_nic.c */

typedef struct {
  /* The state of one one-sided comm of `rank`; fails connect on a bad test
   * variable. */
  ncclResult_t (*open)(int rank, ps_model_t **out);
  void (*close)(ps_model_t *m);
  /* What ordering strategy `strategy` (a ps_ordering_t) lacks on this NIC,
   * given what it lacks on the provider (NULL: nothing). */
  const char *(*missing_for)(int strategy, const char *provider_lacks);
  /* An engine RMA write or signal message the model takes instead of the
   * provider (*posted = 1 once it holds it). */
  ncclResult_t (*write)(ps_model_t *m, const struct fi_msg_rma *msg, uint64_t flags, int *posted);
  ncclResult_t (*send)(ps_model_t *m, void *buf, size_t len, void *desc, fi_addr_t dest,
                       uint64_t tag, ps_op_t *op, int *posted);
  /* Hands the held operations whose time has come to ep; on failure *what
   * names what could not be handed over. */
  ncclResult_t (*release)(ps_model_t *m, ps_ep_t *ep, const char **what);
  /* A two-sided liveness probe completed with err (0 or a negative fi
   * errno), queued behind our own sends (behind) after `failures` failed
   * tries of `tries`: the error to act on, and its text in *errstr. */
  int (*probe_done)(int err, int behind, int failures, int tries, const char **errstr);
} ps_model_nic_t;

extern const ps_model_nic_t *ps_model_nic;

#endif
