/* nccl_compat.cuh: the device-API differences between NCCL 2.28, 2.29 and
 * 2.30 that the GIN programs meet, in one place, so that they build (and
 * ask NCCL for the same things) against each version's headers. Everything
 * here is decided at compile time by NCCL_VERSION_CODE: a program runs with
 * the NCCL it was built against (2.29 and later refuse a devcomm whose
 * requirements carry a newer version than the library's).
 * CUDA C++ only because nccl_device.h is. */
#ifndef PERSEUS_NCCL_COMPAT_CUH
#define PERSEUS_NCCL_COMPAT_CUH

#include <string.h>

#include <nccl.h>
#include <nccl_device.h>

/* 2.29 reworked the device API: versioned requirement structs, GIN
 * connections apart from contexts, a GIN barrier without epochs. */
#define PS_NCCL_DEVAPI_229 (NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0))

/* Fresh devcomm requirements. From 2.29 the struct starts with size, magic
 * and version, and ncclDevCommCreate refuses it unless the magic is NCCL's
 * (so a zeroed struct builds but fails at run time): NCCL's initializer,
 * which also sets 2.29's defaults (4 contexts; 2.30: strong and VA signals
 * required, which NCCL's GIN proxy provides). 2.28: all zero. */
static inline void ps_devcomm_reqs_init(ncclDevCommRequirements_t *reqs)
{
#if PS_NCCL_DEVAPI_229
  *reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  memset(reqs, 0, sizeof(*reqs));
#endif
}

/* The GIN contexts the programs ask for and spread peers over at most.
 * 2.28's NCCL_GIN_MAX_CONTEXTS; 2.29 dropped the constant (contexts are
 * then split over up to NCCL_GIN_MAX_CONNECTIONS connections and may be
 * more), so its value stays the limit and -C means the same everywhere. */
#if PS_NCCL_DEVAPI_229
#define PS_GIN_CONTEXTS 4
#else
#define PS_GIN_CONTEXTS NCCL_GIN_MAX_CONTEXTS
#endif

/* The GIN backend (NCCL_NET_DEVICE_GIN_*) of the devcomm's first GIN
 * connection: 2.28's ginTypes[] became ginNetDeviceTypes[] (one per
 * connection) in 2.29. */
static inline int ps_gin_backend(const ncclDevComm &dc)
{
#if PS_NCCL_DEVAPI_229
  return (int)dc.ginNetDeviceTypes[0];
#else
  return (int)dc.ginTypes[0];
#endif
}

/* One GIN barrier over `team`: NCCL's requirement (req, storage the caller
 * keeps until ncclDevCommCreate returns) linked at the head of
 * reqs->resourceRequirementsList, and the handle *h. *nsig is how many GIN
 * signals from h->signal0 the barrier uses.
 * NCCL (2.28.9 to 2.30.7) copies a linked requirement keeping only its
 * buffer fields (deepCopyDevCommRequirements, src/dev_runtime.cc), so GIN
 * signals asked for there are never allocated and h->signal0 is never
 * written: it stays 0.
 *   2.28: the barrier uses one signal (signal0 + index) and keeps its epochs
 *     in the resource buffer, which survives the copy; signal 0 is left to
 *     it (GC_SIG_FIRST), as it always was.
 *   2.29 on: no buffer, one signal per team rank (signal0 + index * nRanks
 *     + rank), matched against per-signal shadows. Left at 0 they would be
 *     the program's own signals, which it resets; so they are taken from the
 *     top-level (user) range instead, after the reqs->ginSignalCount signals
 *     declared so far: declare the program's own signals first. */
static inline ncclResult_t ps_gin_barrier_requirement(ncclComm_t comm, ncclTeam_t team,
                                                      ncclDevCommRequirements_t *reqs,
                                                      ncclGinBarrierHandle_t *h,
                                                      ncclDevResourceRequirements_t *req,
                                                      int *nsig)
{
  memset(h, 0, sizeof(*h));
  ncclResult_t r = ncclGinBarrierCreateRequirement(comm, team, 1, h, req);
  if (r != ncclSuccess) return r;
#if PS_NCCL_DEVAPI_229
  h->signal0 = (ncclGinSignal_t)reqs->ginSignalCount;
  *nsig = req->ginSignalCount;
  reqs->ginSignalCount += req->ginSignalCount;
  req->ginSignalCount = 0;
  req->outGinSignalStart = NULL;
#else
  *nsig = 1;
#endif
  req->next = reqs->resourceRequirementsList;
  reqs->resourceRequirementsList = req;
  return ncclSuccess;
}

/* The barrier's resource buffer: its epochs in 2.28; 2.29 on it has none
 * (its requirement asks for 0 bytes), so 0. */
static inline ncclDevResourceHandle_t ps_gin_barrier_buffer(const ncclGinBarrierHandle_t &h)
{
#if PS_NCCL_DEVAPI_229
  (void)h;
  return 0;
#else
  return h.bufHandle;
#endif
}

#endif
