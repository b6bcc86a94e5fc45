/* Provider selection and the devices NCCL sees: one per usable libfabric
 * domain, opened once per process and shared by every communicator. */
#ifndef PS_FABRIC_H
#define PS_FABRIC_H

#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include "ps_env.h"
#include "ps_nccl_abi.h"

/* The libfabric API version asked for: 1.20 where the library is that new
 * and the provider is a NIC (providers read a dma-buf registration only
 * from 1.20 callers), else 1.14. */
uint32_t ps_fabric_api_version(void);

#include "ps_fi_dmabuf.h"

/* A GPU buffer NCCL exported as a dma-buf (regMrDmaBuf, regMrSymDmaBuf):
 * its fd, and the buffer's offset in the dma-buf. */
typedef struct ps_dmabuf {
  int fd;
  uint64_t offset;
} ps_dmabuf_t;
#define PS_MAX_DEVICES 32

typedef struct {
  char name[96];        /* "<provider>/<domain>", for logs and props.name */
  char domain_name[64];
  char *pci_path;       /* realpath of the device in /sys, or NULL */
  uint64_t guid;
  int speed_mbps;
  struct fi_info *info; /* owned */
  struct fid_fabric *fabric;
  struct fid_domain *domain;
  pthread_mutex_t lock; /* serializes domain-level calls (MR registration) */
  int mr_local, mr_endpoint, mr_prov_key, mr_virt_addr;
  int manual_progress;
  size_t max_msg_size;
  size_t max_eps;
  int rma; /* endpoints carry FI_RMA (the one-sided engine's devices) */
  /* why a delivery-complete RMA write may not be in the target's memory yet;
   * NULL when the provider keeps FI_DELIVERY_COMPLETE's promise */
  const char *rma_delivery_broken;
  /* What the ordering strategies can build on (one-sided devices only): */
  int rma_fence;          /* native FI_ATOMIC with FI_FENCE */
  uint64_t rma_msg_order; /* FI_ORDER_* both tx and rx keep */
  size_t cq_data_size;    /* remote CQ data bytes a write can carry */
  uint32_t rma_inflight;  /* default bound on posted one-sided ops per peer, 0 = none */
  int hmem;               /* registers CUDA memory itself (FI_HMEM, FI_MR_HMEM) */
  /* Who sent what an endpoint receives (FI_SOURCE, one-sided devices):
   * src_msgs, the senders of messages; src_writes, also the writers of
   * remote CQ data (only providers seen to name them right) */
  int src_msgs, src_writes;
  int cuda_reg;           /* 1 a CUDA buffer registered, -1 not, 0 not asked yet */
  int dmabuf_reg;         /* the same for a CUDA buffer registered by its dma-buf */
} ps_device_t;

/* Opens the devices on first use; later calls return the cached result. */
ncclResult_t ps_fabric_init(void);
int ps_fabric_ndev(void);
ps_device_t *ps_fabric_dev(int dev); /* NULL when dev is out of range */
/* The same device with FI_RMA endpoints, opened on first use; NULL if the
 * provider has no RMA there (the reason is logged). */
ps_device_t *ps_fabric_rma_dev(int dev);
const ps_config_t *ps_fabric_config(void);
/* Identifies provider + wire format + PERSEUS_ORDERING (ps_wire.h); peers
 * whose hash differs are refused. */
uint32_t ps_fabric_wire_hash(void);
const char *ps_fabric_provider(void);
uint64_t ps_fabric_next_key(void);

/* shm endpoint names (= their /dev/shm file names), which say whose they
 * are; init removes those of dead processes. ps_fabric_shm_owner: 1 with
 * *pid when `name` is an endpoint's name of ours or one of its message
 * files, made in this pid namespace; 0 otherwise. */
void ps_fabric_shm_name(char *out, size_t n);
int ps_fabric_shm_owner(const char *name, pid_t *pid);

/* Provider preference when neither PERSEUS_PROVIDER nor FI_PROVIDER is set. */
extern const char *const ps_provider_preference[];

#endif
