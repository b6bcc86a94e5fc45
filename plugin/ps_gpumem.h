/* GPU memory and the provider: whether GPU buffers go to it directly or
 * through perseus' staging (PERSEUS_STAGING), and what it registers (CUDA
 * memory by address, by dma-buf), each learned once per device by
 * registering a small allocation on the caller's GPU. */
#ifndef PS_GPUMEM_H
#define PS_GPUMEM_H

#include "ps_fabric.h"

/* The core provider's name (of "tcp;ofi_rxm": tcp) where it lists FI_HMEM
 * but moves device memory with the CPU, a synchronous cudaMemcpy per
 * message (shm, tcp, the other socket providers); NULL for the rest (NICs
 * that reach GPU memory by DMA). */
const char *ps_gpumem_host_copier(const char *prov_name);

/* 1: GPU buffers of device d go to the provider (it lists FI_HMEM, and
 * PERSEUS_STAGING is never, or auto on a provider that moves device memory
 * by DMA); 0: they are staged, *why says why (not NULL then). Registration
 * may still fail: ps_gpumem_registers_cuda asks. */
int ps_gpumem_direct(const ps_device_t *d, const char **why);

/* 1: a direct device whose provider registered a CUDA allocation (asked
 * once per device, with a current GPU; without one 0, asked again later). A
 * provider may list FI_HMEM and still refuse (a libfabric built without
 * CUDA), and NCCL must not learn that only at its first registration. */
int ps_gpumem_registers_cuda(ps_device_t *d);

/* 1: the same, and the provider also registered one by its dma-buf
 * (ptrSupport NCCL_PTR_DMABUF): libfabric 1.20 or newer, a driver that
 * exports dma-bufs, and a provider that takes them. */
int ps_gpumem_dmabuf(ps_device_t *d);

#endif
