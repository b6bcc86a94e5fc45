/* Test builds only: the fake CUDA's dma-buf. Where "device memory" is host
 * memory (ps_cuda_fake.c), a dma-buf is a memfd holding one record that
 * names the memory it stands for. The model fabric (test/model) resolves an
 * fd to memory through it, as a NIC driver resolves a real dma-buf to pages:
 * a registration with the wrong offset then reaches the wrong bytes, and an
 * fd that is not a dma-buf is refused. The test programs export their
 * buffers with it, as NCCL does with cuMemGetHandleForAddressRange. */
#ifndef PS_FAKE_DMABUF_H
#define PS_FAKE_DMABUF_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define PS_FAKE_DMABUF_MAGIC 0x667562616d646170ULL

typedef struct {
  uint64_t magic;
  uint64_t base; /* the first byte the fd stands for */
  uint64_t len;  /* how many */
} ps_fake_dmabuf_t;

/* An fd standing for [base, base + len), or -1 with errno set. */
static inline int ps_fake_dmabuf_create(const void *base, size_t len) {
  int fd = memfd_create("perseus-fake-dmabuf", MFD_CLOEXEC);
  if (fd < 0) return -1;
  ps_fake_dmabuf_t r = {PS_FAKE_DMABUF_MAGIC, (uint64_t)(uintptr_t)base, (uint64_t)len};
  if (pwrite(fd, &r, sizeof r, 0) != (ssize_t)sizeof r) {
    int e = errno ? errno : EIO;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

/* [ptr, ptr + size) exported as the CUDA driver exports a buffer for NCCL:
 * the range widened to whole pages, *offset the distance of ptr from its
 * start. The fd, or -1 with errno set. */
static inline int ps_fake_dmabuf_export(const void *ptr, size_t size, uint64_t *offset) {
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), start = (uintptr_t)ptr & ~(page - 1);
  *offset = (uintptr_t)ptr - start;
  return ps_fake_dmabuf_create((const void *)start,
                               ((uintptr_t)ptr + size - start + page - 1) & ~(page - 1));
}

/* 0 with *out, or a negative errno: EBADF not an open fd, EINVAL an fd that
 * is not a fake dma-buf. */
static inline int ps_fake_dmabuf_read(int fd, ps_fake_dmabuf_t *out) {
  if (fd < 0) return -EBADF;
  ssize_t n = pread(fd, out, sizeof *out, 0);
  if (n < 0) return errno == EBADF ? -EBADF : -EINVAL;
  return n == (ssize_t)sizeof *out && out->magic == PS_FAKE_DMABUF_MAGIC ? 0 : -EINVAL;
}

#endif
