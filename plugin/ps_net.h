/* The version-neutral two-sided engine. The per-ABI tables in net_abi.c
 * only translate argument lists into these calls. */
#ifndef PS_NET_H
#define PS_NET_H

#include <stddef.h>

#include "ps_nccl_abi.h"

typedef struct {
  char *name;
  char *pci_path;
  uint64_t guid;
  int ptr_support, reg_is_global, speed, port, max_comms, max_recvs;
  float latency;
  size_t max_p2p_bytes, max_coll_bytes;
} ps_props_t;

ncclResult_t ps_net_init(ncclDebugLogger_t log);
ncclResult_t ps_net_devices(int *ndev);
ncclResult_t ps_net_get_properties(int dev, ps_props_t *p);
ncclResult_t ps_net_listen(int dev, void *handle, void **listen_comm);
/* owner: the NCCL context (v11+) the connect belongs to, 0 without one. */
ncclResult_t ps_net_connect(int dev, void *handle, void **send_comm, uintptr_t owner);
/* The context `owner` ends: the connects it started that never completed
 * are closed (NCCL will not call connect for them again). */
void ps_net_forget_connects(uintptr_t owner);
ncclResult_t ps_net_accept(void *listen_comm, void **recv_comm);
ncclResult_t ps_net_reg_mr(void *comm, void *data, size_t size, int type, void **mh);
ncclResult_t ps_net_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset,
                                  int fd, void **mh);
ncclResult_t ps_net_dereg_mr(void *comm, void *mh);
ncclResult_t ps_net_isend(void *send_comm, void *data, size_t size, int tag, void *mh, void **req);
ncclResult_t ps_net_irecv(void *recv_comm, int n, void **data, const size_t *sizes, const int *tags,
                          void **mhs, void **req);
ncclResult_t ps_net_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhs, void **req);
ncclResult_t ps_net_test(void *req, int *done, int *sizes);
ncclResult_t ps_net_close_send(void *send_comm);
ncclResult_t ps_net_close_recv(void *recv_comm);
ncclResult_t ps_net_close_listen(void *listen_comm);
ncclResult_t ps_net_make_vdevice(int *d, int ndevs, const int *devs);

#endif
