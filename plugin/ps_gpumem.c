/* ps_gpumem.h: the direct-or-staged rule for GPU buffers and the probes that
 * learn what a provider registers. */
#include "ps_gpumem.h"

#include <string.h>
#include <unistd.h>

#include "ps_cuda.h"
#include "ps_ep.h"
#include "ps_log.h"

/* Providers that list FI_HMEM but move device memory with the CPU: a
 * synchronous cudaMemcpy per message on the thread that posts or makes
 * progress. perseus' staging batches its copies on the GPU's copy engines
 * instead, and was measured faster at every size (docs/results.md), so
 * `auto` stages there. A NIC that reaches GPU memory by DMA (verbs, efa,
 * cxi, ...) gets the buffers. Layered names ("tcp;ofi_rxm") go by their core. */
const char *ps_gpumem_host_copier(const char *prov) {
  static const char *const copiers[] = {"shm", "sm2", "tcp", "net", "sockets", "udp", NULL};
  size_t core = strcspn(prov, ";");
  for (int i = 0; copiers[i]; i++)
    if (strlen(copiers[i]) == core && !strncmp(prov, copiers[i], core)) return copiers[i];
  return NULL;
}

int ps_gpumem_direct(const ps_device_t *d, const char **why) {
  int mode = ps_fabric_config()->staging;
  *why = NULL;
  if (mode == PS_STAGING_ALWAYS)
    *why = "PERSEUS_STAGING=always";
  else if (!d->hmem)
    *why = "the provider does not register CUDA memory (no FI_HMEM with FI_MR_HMEM)";
  else if (mode == PS_STAGING_AUTO && ps_gpumem_host_copier(d->info->fabric_attr->prov_name))
    *why = "PERSEUS_STAGING=auto on a provider that copies GPU memory with the CPU, one synchronous "
           "copy per message (staging batches them on the copy engines; never sends them directly)";
  return !*why;
}

/* A probe allocation on the caller's current GPU, or 0 (no GPU, no
 * context: ask again later). */
static int probe_alloc(void **buf, int *ordinal) {
  return ps_cuda_probe_alloc(2 * 65536, ordinal, buf) == ncclSuccess;
}

/* 1 yes, -1 no, 0 unknown yet; *state caches a definite answer. */
static int cached(int *state) { return __atomic_load_n(state, __ATOMIC_ACQUIRE); }
static void settle(int *state, int yes) { __atomic_store_n(state, yes ? 1 : -1, __ATOMIC_RELEASE); }

int ps_gpumem_registers_cuda(ps_device_t *d) {
  const char *why;
  if (!ps_gpumem_direct(d, &why)) return 0;
  int known = cached(&d->cuda_reg);
  if (known) return known > 0;
  void *buf;
  int ordinal;
  if (!probe_alloc(&buf, &ordinal)) return 0;
  /* Before Hopper NCCL follows a receive into GPU memory with iflush, to
   * make a NIC's PCIe writes visible to the GPU; perseus' two-sided iflush
   * reads nothing back, so NCCL gets host buffers there instead. A provider
   * that copies with cudaMemcpy needs no flush. */
  int major = ps_cuda_compute_major(ordinal);
  if (!d->rma && major >= 0 && major < 9 && !ps_gpumem_host_copier(d->info->fabric_attr->prov_name)) {
    ps_cuda_probe_free(ordinal, buf);
    settle(&d->cuda_reg, 0);
    PS_INFO(NCCL_INIT | NCCL_NET, "net device %s: GPU %d is compute capability %d.x, whose "
            "receives NCCL flushes, and perseus' iflush makes no flush: NCCL stages through host "
            "buffers", d->name, ordinal, major);
    return 0;
  }
  struct fid_mr *mr;
  int rc = ps_dev_try_reg(d, NULL, buf, 4096, FI_SEND | FI_RECV, ordinal, NULL, &mr);
  if (mr) fi_close(&mr->fid);
  ps_cuda_probe_free(ordinal, buf);
  settle(&d->cuda_reg, !rc);
  if (rc && ps_fabric_config()->staging == PS_STAGING_NEVER)
    PS_WARN("PERSEUS_STAGING=never: %s lists FI_HMEM but does not register CUDA memory (%s): GPU "
            "buffers are staged", d->name, fi_strerror(-rc));
  else if (rc)
    PS_INFO(NCCL_INIT | NCCL_NET, "%s lists FI_HMEM but does not register CUDA memory (%s): GPU "
            "buffers are staged", d->name, fi_strerror(-rc));
  else
    PS_INFO(NCCL_INIT | NCCL_NET, "%s device %s registers CUDA memory (FI_HMEM): GPU buffers go to "
            "it directly", d->rma ? "one-sided" : "net", d->name);
  return !rc;
}

/* Whether a dma-buf registration can reach the provider at all: only at
 * API 1.20 (ps_fabric_api_version) do providers read the dma-buf
 * description rather than an iovec. The test build also trusts the model
 * fabric, which is ours and takes the fake CUDA's dma-bufs on any library. */
static const char *dmabuf_unknown(const ps_device_t *d) {
  if (ps_fabric_api_version() >= FI_VERSION(1, 20)) return NULL;
#ifdef PS_FAKE_CUDA
  if (!strcmp(d->info->fabric_attr->prov_name, "model")) return NULL;
#else
  (void)d;
#endif
  return fi_version() < FI_VERSION(1, 20)
             ? "libfabric before 1.20 has no dma-buf registration"
             : "the provider copies GPU memory with the CPU: a dma-buf gains nothing there";
}

int ps_gpumem_dmabuf(ps_device_t *d) {
  if (!ps_gpumem_registers_cuda(d)) return 0;
  int known = cached(&d->dmabuf_reg);
  if (known) return known > 0;
  const char *why = dmabuf_unknown(d);
  if (why) {
    PS_INFO(NCCL_INIT | NCCL_NET, "%s device %s: GPU buffers register by address (%s)",
            d->rma ? "one-sided" : "net", d->name, why);
    settle(&d->dmabuf_reg, 0);
    return 0;
  }
  void *buf;
  int ordinal;
  if (!probe_alloc(&buf, &ordinal)) return 0;
  /* one page inside the allocation, exported as NCCL exports its buffers */
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  void *at = (void *)(((uintptr_t)buf + page - 1) & ~(page - 1));
  ps_dmabuf_t db = {.fd = -1};
  int rc = -FI_ENOSYS;
  if (ps_cuda_dmabuf_export(ordinal, at, 4096, &db.fd, &db.offset) == ncclSuccess) {
    struct fid_mr *mr;
    rc = ps_dev_try_reg(d, NULL, at, 4096, FI_SEND | FI_RECV, ordinal, &db, &mr);
    if (mr) fi_close(&mr->fid);
    close(db.fd);
  }
  ps_cuda_probe_free(ordinal, buf);
  settle(&d->dmabuf_reg, !rc);
  PS_INFO(NCCL_INIT | NCCL_NET, "%s device %s: %s", d->rma ? "one-sided" : "net", d->name,
          rc ? "GPU buffers register by address (no dma-buf: the driver could not export one, or "
               "the provider refused it)"
             : "GPU buffers register by their dma-buf where NCCL exports one (ptrSupport DMABUF)");
  return !rc;
}
