/* libfabric 1.20's dma-buf registration (fi_mr_regattr with FI_MR_DMABUF,
 * fi_mr_attr's iov pointer naming one of these instead), declared here so a
 * build against older headers still offers it where the library loaded at
 * run time has it. The model fabric (test/model) takes it too. */
#ifndef PS_FI_DMABUF_H
#define PS_FI_DMABUF_H

#include <stddef.h>
#include <stdint.h>
#include <rdma/fi_domain.h>

#define PS_FI_MR_DMABUF (1ULL << 40)
typedef struct {
  int fd;
  uint64_t offset;  /* where the registration begins in the dma-buf */
  size_t len;
  void *base_addr;  /* the virtual address of the dma-buf's first byte */
} ps_fi_mr_dmabuf_t;
#ifdef FI_MR_DMABUF
_Static_assert(FI_MR_DMABUF == PS_FI_MR_DMABUF, "FI_MR_DMABUF");
_Static_assert(sizeof(struct fi_mr_dmabuf) == sizeof(ps_fi_mr_dmabuf_t) &&
               offsetof(struct fi_mr_dmabuf, base_addr) == offsetof(ps_fi_mr_dmabuf_t, base_addr),
               "struct fi_mr_dmabuf");
#endif

#endif
