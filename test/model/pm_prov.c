/* The model fabric's provider objects: fi_getinfo, fabric, domain,
 * registrations, address vector, completion queue (pm.h says what it is). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <rdma/providers/fi_prov.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "pm.h"
#include "ps_fake_dmabuf.h"
#include "ps_fi_dmabuf.h"

uint64_t pm_now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static pm_params_t params;
static int params_bad;

/* A bad value is an error: fi_getinfo then offers nothing (libfabric passes
 * no reason on), and stderr names the variable. */
static double env_num(const char *name, double def, double lo, double hi) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  char *end;
  double x = strtod(v, &end);
  /* a plain decimal number: strtod also takes spaces, signs, hex, exponents, "nan" and "inf" */
  if (v[strspn(v, "0123456789.")] || *end || !isfinite(x) || x < lo || x > hi) {
    fprintf(stderr, "model fabric: %s='%s' is invalid: expected a number in [%g, %g] (default %g)\n",
            name, v, lo, hi, def);
    params_bad = 1;
    return def;
  }
  return x;
}

/* A switch: exactly 0 or 1. */
static int env_flag(const char *name, int def) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  if ((v[0] == '0' || v[0] == '1') && !v[1]) return v[0] == '1';
  fprintf(stderr, "model fabric: %s='%s' is invalid: expected 0 or 1 (default %d)\n", name, v, def);
  params_bad = 1;
  return def;
}

static pthread_once_t params_once = PTHREAD_ONCE_INIT;
static _Atomic(const pm_params_t *) params_ready; /* set once loaded: the NIC threads' fast path */
static void params_load(void) {
  params.latency_ns = (uint64_t)(env_num("PERSEUS_MODEL_LATENCY_US", 2, 0, 1e6) * 1000);
  params.ns_per_byte = 1.0 / env_num("PERSEUS_MODEL_GBPS", 12.5, 0.01, 1000);
  double order = env_num("PERSEUS_MODEL_ORDER", 1, 0, 2);
  if (order != (int)order) {
    fprintf(stderr, "model fabric: PERSEUS_MODEL_ORDER=%g is invalid: expected 0, 1 or 2\n", order);
    params_bad = 1, order = 1;
  }
  params.ordered = order != 0, params.reorder = order != 1;
  params.atomics = env_flag("PERSEUS_MODEL_ATOMICS", 1);
  params.hmem = env_flag("PERSEUS_MODEL_HMEM", 0);
  params.dmabuf = params.hmem && env_flag("PERSEUS_MODEL_DMABUF", 1);
  params.mr_endpoint = env_flag("PERSEUS_MODEL_MR_ENDPOINT", 0);
  double nt = env_num("PERSEUS_MODEL_NIC_THREADS", 1, 1, PM_MAX_NIC_THREADS);
  if (nt != (int)nt) {
    fprintf(stderr, "model fabric: PERSEUS_MODEL_NIC_THREADS=%g is invalid: expected an integer\n", nt);
    params_bad = 1, nt = 1;
  }
  params.nic_threads = (int)nt;
}
const pm_params_t *pm_params(void) {
  const pm_params_t *p = atomic_load_explicit(&params_ready, memory_order_acquire);
  if (p) return p;
  pthread_once(&params_once, params_load);
  atomic_store_explicit(&params_ready, &params, memory_order_release);
  return &params;
}

/* --- segments --- */
/* Ours not yet unlinked: libfabric's cleanup (fi_fini) unlinks what nobody
 * closed (perseus keeps its domains for the process's life). A process that
 * ends without it (_exit, a crash) leaves its files, which the next domain
 * opened on this host removes (reap_dead). */
typedef struct pm_own {
  struct pm_own *next;
  char name[PM_NAME_LEN];
} pm_own_t;
static pm_own_t *owned;
static pthread_mutex_t owned_lock = PTHREAD_MUTEX_INITIALIZER;

void *pm_create(char *name, size_t size) {
  static _Atomic unsigned n;
  snprintf(name, PM_NAME_LEN, "pm_%d_%08x%04x", (int)getpid(), (unsigned)pm_now_ns(),
           atomic_fetch_add(&n, 1) & 0xffff);
  pm_own_t *o = calloc(1, sizeof *o);
  int fd = o ? shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600) : -1;
  void *p = fd < 0 || ftruncate(fd, (off_t)size)
                ? MAP_FAILED
                : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (fd >= 0) close(fd);
  if (p == MAP_FAILED) {
    if (fd >= 0) shm_unlink(name);
    free(o);
    return NULL;
  }
  snprintf(o->name, sizeof o->name, "%s", name);
  pthread_mutex_lock(&owned_lock);
  o->next = owned, owned = o;
  pthread_mutex_unlock(&owned_lock);
  return p;
}

static void forget(const char *name, int unlink_it) {
  pthread_mutex_lock(&owned_lock);
  for (pm_own_t **p = &owned; *p;) {
    pm_own_t *o = *p;
    if (name && strcmp(o->name, name)) {
      p = &o->next;
      continue;
    }
    if (unlink_it) shm_unlink(o->name);
    *p = o->next;
    free(o);
  }
  pthread_mutex_unlock(&owned_lock);
}

void pm_unlink(const char *name, void *seg, size_t size) {
  forget(name, 1);
  munmap(seg, size);
}

/* Mapped once per process and kept: a peer's segment outlives nothing of
 * ours that matters, and a closed one stays mapped (its file is gone). */
typedef struct pm_map_ent {
  struct pm_map_ent *next;
  char name[PM_NAME_LEN];
  void *p;
} pm_map_ent_t;
static pm_map_ent_t *maps;
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;

void *pm_map(const char *name, size_t size) {
  if (strnlen(name, PM_NAME_LEN) == PM_NAME_LEN || strncmp(name, "pm_", 3) || strchr(name, '/'))
    return NULL;
  pthread_mutex_lock(&maps_lock);
  pm_map_ent_t *e = maps;
  while (e && strcmp(e->name, name)) e = e->next;
  void *p = e ? e->p : NULL;
  if (!e) {
    int fd = shm_open(name, O_RDWR, 0);
    if (fd >= 0) {
      off_t have = lseek(fd, 0, SEEK_END);
      p = have >= (off_t)size ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
      close(fd);
      if (p == MAP_FAILED) p = NULL;
    }
    if (p && (*(uint64_t *)p != PM_MAGIC || !(e = calloc(1, sizeof *e)))) {
      munmap(p, size);
      p = NULL;
    }
    if (p) {
      snprintf(e->name, sizeof e->name, "%s", name);
      e->p = p, e->next = maps, maps = e;
    }
  }
  pthread_mutex_unlock(&maps_lock);
  return p;
}

/* --- address vector --- */
const pm_peer_t *pm_av_get(pm_av_t *av, fi_addr_t a) {
  if (a >= atomic_load_explicit(&av->n, memory_order_acquire)) return NULL;
  const pm_peer_t *p = &av->block[a / PM_AV_BLOCK][a % PM_AV_BLOCK];
  return atomic_load_explicit(&p->seg, memory_order_acquire) ? p : NULL;
}

static uint32_t name_hash(const char *name) {
  uint32_t h = 2166136261u; /* FNV-1a */
  for (size_t i = 0; i < PM_NAME_LEN && name[i]; i++) h = (h ^ (uint8_t)name[i]) * 16777619u;
  return h;
}

static int names_peer(const pm_peer_t *p, const char *name) {
  return atomic_load_explicit(&p->seg, memory_order_acquire) && !strncmp(p->name, name, PM_NAME_LEN);
}

/* Under av->lock: a is name's address from now on. */
static void index_add(pm_av_t *av, const char *name, size_t a) {
  uint32_t h = name_hash(name);
  for (uint32_t i = 0; i < PM_AV_PROBES; i++) {
    _Atomic uint64_t *slot = &av->index[(h + i) % PM_AV_INDEX];
    if (!atomic_load_explicit(slot, memory_order_relaxed)) {
      atomic_store_explicit(slot, (uint64_t)h << 32 | (a + 1), memory_order_release);
      return;
    }
  }
}

fi_addr_t pm_av_find(pm_av_t *av, const char *name) {
  uint32_t h = name_hash(name);
  for (uint32_t i = 0; i < PM_AV_PROBES; i++) {
    uint64_t v = atomic_load_explicit(&av->index[(h + i) % PM_AV_INDEX], memory_order_acquire);
    if (!v) break;
    size_t a = (uint32_t)v - 1;
    if ((uint32_t)(v >> 32) == h && names_peer(&av->block[a / PM_AV_BLOCK][a % PM_AV_BLOCK], name))
      return a;
  }
  size_t n = atomic_load_explicit(&av->n, memory_order_acquire);
  for (size_t a = 0; a < n; a++) {
    if (names_peer(&av->block[a / PM_AV_BLOCK][a % PM_AV_BLOCK], name)) return a;
  }
  return FI_ADDR_NOTAVAIL;
}

static int av_insert(struct fid_av *fid, const void *addr, size_t count, fi_addr_t *out,
                     uint64_t flags, void *ctx) {
  pm_av_t *av = (pm_av_t *)fid;
  int ok = 0;
  (void)flags, (void)ctx;
  for (size_t i = 0; i < count; i++) {
    char name[PM_NAME_LEN];
    memcpy(name, (const char *)addr + i * PM_NAME_LEN, PM_NAME_LEN);
    pm_ep_seg_t *seg = memchr(name, 0, PM_NAME_LEN) ? pm_map(name, sizeof(pm_ep_seg_t)) : NULL;
    pm_dom_seg_t *dom = seg ? pm_map(seg->dom, sizeof(pm_dom_seg_t)) : NULL;
    if (!dom) {
      if (out) out[i] = FI_ADDR_NOTAVAIL;
      continue;
    }
    pthread_mutex_lock(&av->lock);
    size_t n = atomic_load_explicit(&av->n, memory_order_relaxed), b = n / PM_AV_BLOCK;
    if (b == PM_AV_BLOCKS || (!av->block[b] && !(av->block[b] = calloc(PM_AV_BLOCK, sizeof(pm_peer_t))))) {
      pthread_mutex_unlock(&av->lock);
      return ok ? ok : -FI_ENOMEM;
    }
    pm_peer_t *p = &av->block[b][n % PM_AV_BLOCK];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->dom = dom, p->pid = seg->pid;
    atomic_store_explicit(&p->seg, seg, memory_order_relaxed);
    if (out) out[i] = n;
    atomic_store_explicit(&av->n, n + 1, memory_order_release);
    index_add(av, p->name, n);
    pthread_mutex_unlock(&av->lock);
    ok++;
  }
  return ok;
}

static int av_remove(struct fid_av *fid, fi_addr_t *a, size_t count, uint64_t flags) {
  pm_av_t *av = (pm_av_t *)fid;
  (void)flags;
  pthread_mutex_lock(&av->lock);
  for (size_t i = 0; i < count; i++)
    if (a[i] < atomic_load(&av->n))
      atomic_store_explicit(&av->block[a[i] / PM_AV_BLOCK][a[i] % PM_AV_BLOCK].seg, NULL,
                            memory_order_release);
  pthread_mutex_unlock(&av->lock);
  return 0;
}

static const char *av_straddr(struct fid_av *fid, const void *addr, char *buf, size_t *len) {
  char name[PM_NAME_LEN + 1] = {0};
  (void)fid;
  memcpy(name, addr, PM_NAME_LEN);
  int n = snprintf(buf, *len, "model://%s", name);
  *len = (size_t)n + 1;
  return buf;
}

static int av_close(struct fid *fid) {
  pm_av_t *av = (pm_av_t *)fid;
  pthread_mutex_destroy(&av->lock);
  for (int b = 0; b < PM_AV_BLOCKS; b++) free(av->block[b]);
  free(av);
  return 0;
}

static struct fi_ops av_fi_ops = {.size = sizeof(struct fi_ops), .close = av_close};
static struct fi_ops_av av_ops = {.size = sizeof(struct fi_ops_av), .insert = av_insert,
                                  .remove = av_remove, .straddr = av_straddr};

static int av_open(struct fid_domain *d, struct fi_av_attr *attr, struct fid_av **out, void *ctx) {
  pm_av_t *av = calloc(1, sizeof *av);
  (void)d, (void)attr;
  if (!av) return -FI_ENOMEM;
  pthread_mutex_init(&av->lock, NULL);
  av->av = (struct fid_av){.fid = {.fclass = FI_CLASS_AV, .context = ctx, .ops = &av_fi_ops},
                           .ops = &av_ops};
  *out = &av->av;
  return 0;
}

/* --- registrations: kept in the domain's segment, where origins check them --- */
typedef struct {
  struct fid_mr mr;
  pm_domain_t *d;
  int slot;
  struct fid *ep; /* PERSEUS_MODEL_MR_ENDPOINT: the endpoint it is bound to */
} pm_mr_t;

/* Under FI_MR_ENDPOINT a registration is bound to an endpoint and enabled
 * before any peer may use its key: until then its slot holds the key with
 * this bit flipped, so an origin that wrote with it early is refused. */
#define PM_KEY_DISABLED (1ULL << 47)

static int mr_close(struct fid *fid) {
  pm_mr_t *m = (pm_mr_t *)fid;
  atomic_store(&m->d->seg->mr[m->slot].key, 0);
  free(m);
  return 0;
}
static int mr_bind(struct fid *fid, struct fid *bfid, uint64_t flags) {
  pm_mr_t *m = (pm_mr_t *)fid;
  (void)flags;
  if (!pm_params()->mr_endpoint || !bfid || bfid->fclass != FI_CLASS_EP || m->ep) return -FI_EINVAL;
  m->ep = bfid;
  return 0;
}

static int mr_control(struct fid *fid, int command, void *arg) {
  pm_mr_t *m = (pm_mr_t *)fid;
  (void)arg;
  if (command != FI_ENABLE) return -FI_ENOSYS;
  if (!pm_params()->mr_endpoint) return 0;
  if (!m->ep) return -FI_ENOKEY; /* enable before bind */
  atomic_store(&m->d->seg->mr[m->slot].key, m->mr.key);
  return 0;
}
static struct fi_ops mr_fi_ops = {.size = sizeof(struct fi_ops), .close = mr_close, .bind = mr_bind,
                                  .control = mr_control};

static int mr_reg(struct fid *fid, const void *buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t requested_key, uint64_t flags, struct fid_mr **out, void *ctx) {
  pm_domain_t *d = (pm_domain_t *)fid;
  static _Atomic uint64_t next_key = 1;
  (void)offset, (void)requested_key, (void)flags;
  pm_mr_t *m = calloc(1, sizeof *m);
  if (!m) return -FI_ENOMEM;
  pthread_mutex_lock(&d->lock);
  int slot = 0;
  while (slot < PM_MAX_MR && atomic_load(&d->seg->mr[slot].key)) slot++;
  if (slot == PM_MAX_MR) {
    pthread_mutex_unlock(&d->lock);
    free(m);
    return -FI_ENOSPC;
  }
  uint64_t key = (uint64_t)slot << 48 | (atomic_fetch_add(&next_key, 1) & 0xffffffffffffULL);
  pm_mr_slot_t *s = &d->seg->mr[slot];
  s->addr = (uint64_t)(uintptr_t)buf, s->len = len, s->access = access;
  pm_window_find(buf, len, s->shm, &s->shm_off);
  atomic_store(&s->key, pm_params()->mr_endpoint ? key ^ PM_KEY_DISABLED : key);
  pthread_mutex_unlock(&d->lock);
  m->d = d, m->slot = slot;
  m->mr = (struct fid_mr){.fid = {.fclass = FI_CLASS_MR, .context = ctx, .ops = &mr_fi_ops},
                          .mem_desc = NULL, .key = key};
  *out = &m->mr;
  return 0;
}

/* Host memory, and with PERSEUS_MODEL_HMEM=1 "CUDA" memory too (the fake
 * CUDA driver's device memory is host memory; a real GPU's is not, and
 * writes into it then fail with an error completion). With
 * PERSEUS_MODEL_DMABUF (on by default with HMEM) CUDA memory also by its
 * dma-buf (FI_MR_DMABUF): the fd is resolved to the memory it stands for
 * (ps_fake_dmabuf.h), as a NIC driver resolves a real one to pages, so a
 * wrong offset registers the wrong bytes and a stray fd is refused. */
static int mr_regattr(struct fid *fid, const struct fi_mr_attr *attr, uint64_t flags,
                      struct fid_mr **out) {
  if (attr->iov_count != 1) return -FI_EINVAL;
  if (attr->iface != FI_HMEM_SYSTEM && !(attr->iface == FI_HMEM_CUDA && pm_params()->hmem))
    return -FI_ENOSYS;
  if (!(flags & PS_FI_MR_DMABUF))
    return mr_reg(fid, attr->mr_iov[0].iov_base, attr->mr_iov[0].iov_len, attr->access,
                  attr->offset, attr->requested_key, flags, out, attr->context);
  if (attr->iface != FI_HMEM_CUDA || !pm_params()->dmabuf) return -FI_ENOSYS;
  const ps_fi_mr_dmabuf_t *db = (const void *)attr->mr_iov;
  ps_fake_dmabuf_t rec;
  int rc = ps_fake_dmabuf_read(db->fd, &rec);
  if (rc) return rc == -EBADF ? -FI_EBADF : -FI_EINVAL;
  if (db->offset > rec.len || db->len > rec.len - db->offset ||
      (db->base_addr && (uintptr_t)db->base_addr != rec.base))
    return -FI_EINVAL;
  return mr_reg(fid, (const void *)(uintptr_t)(rec.base + db->offset), db->len, attr->access,
                attr->offset, attr->requested_key, flags & ~PS_FI_MR_DMABUF, out, attr->context);
}

static struct fi_ops_mr mr_ops = {.size = sizeof(struct fi_ops_mr), .reg = mr_reg,
                                  .regattr = mr_regattr};

/* Segments of processes that died without closing them (a failed test). */
static void reap_dead(void) {
  DIR *dir = opendir("/dev/shm");
  if (!dir) return;
  for (struct dirent *de; (de = readdir(dir));) {
    int pid;
    if (sscanf(de->d_name, "pm_%d_", &pid) == 1 && pid > 0 && kill(pid, 0) && errno == ESRCH)
      shm_unlink(de->d_name);
  }
  closedir(dir);
}

/* --- domain, fabric --- */
static int domain_close(struct fid *fid) {
  pm_domain_t *d = (pm_domain_t *)fid;
  pm_unlink(d->seg_name, d->seg, sizeof *d->seg);
  free(d);
  return 0;
}
static struct fi_ops domain_fi_ops = {.size = sizeof(struct fi_ops), .close = domain_close};
static struct fi_ops_domain domain_ops = {.size = sizeof(struct fi_ops_domain), .av_open = av_open,
                                          .cq_open = pm_cq_open, .endpoint = pm_ep_open};

static int domain_open(struct fid_fabric *f, struct fi_info *info, struct fid_domain **out, void *ctx) {
  (void)f, (void)info;
  pm_domain_t *d = calloc(1, sizeof *d);
  if (!d) return -FI_ENOMEM;
  reap_dead();
  d->seg = pm_create(d->seg_name, sizeof *d->seg);
  if (!d->seg) {
    free(d);
    return -FI_ENOMEM;
  }
  d->seg->magic = PM_MAGIC, d->seg->pid = getpid();
  pthread_mutex_init(&d->lock, NULL);
  d->dom = (struct fid_domain){.fid = {.fclass = FI_CLASS_DOMAIN, .context = ctx, .ops = &domain_fi_ops},
                               .ops = &domain_ops, .mr = &mr_ops};
  *out = &d->dom;
  return 0;
}

static int fabric_close(struct fid *fid) {
  free(fid);
  return 0;
}
static struct fi_ops fabric_fi_ops = {.size = sizeof(struct fi_ops), .close = fabric_close};
static struct fi_ops_fabric fabric_ops = {.size = sizeof(struct fi_ops_fabric), .domain = domain_open};

static int fabric_open(struct fi_fabric_attr *attr, struct fid_fabric **out, void *ctx) {
  (void)attr;
  struct fid_fabric *f = calloc(1, sizeof *f);
  if (!f) return -FI_ENOMEM;
  *f = (struct fid_fabric){.fid = {.fclass = FI_CLASS_FABRIC, .context = ctx, .ops = &fabric_fi_ops},
                           .ops = &fabric_ops};
  *out = f;
  return 0;
}

/* --- getinfo --- */
static uint64_t offered_caps(void) {
  uint64_t c = FI_MSG | FI_TAGGED | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE |
               FI_SEND | FI_RECV | FI_SOURCE;
  if (pm_params()->atomics) c |= FI_ATOMIC | FI_FENCE;
  if (pm_params()->hmem) c |= FI_HMEM;
  return c;
}

static int getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                   const struct fi_info *hints, struct fi_info **info) {
  (void)version, (void)node, (void)service, (void)flags;
  const pm_params_t *p = pm_params();
  if (params_bad) return -FI_EINVAL;
  if (hints && hints->caps & ~offered_caps()) return -FI_ENODATA;
  if (hints && hints->ep_attr && hints->ep_attr->type != FI_EP_UNSPEC &&
      hints->ep_attr->type != FI_EP_RDM)
    return -FI_ENODATA;
  struct fi_info *fi = fi_allocinfo();
  if (!fi) return -FI_ENOMEM;
  fi->caps = hints && hints->caps ? hints->caps : offered_caps();
  fi->mode = 0;
  fi->addr_format = FI_ADDR_STR;
  fi->ep_attr->type = FI_EP_RDM;
  fi->ep_attr->protocol = FI_PROTO_UNSPEC;
  fi->ep_attr->max_msg_size = 1ULL << 40;
  fi->ep_attr->msg_prefix_size = 0;
  fi->ep_attr->max_order_raw_size = fi->ep_attr->max_order_war_size =
      fi->ep_attr->max_order_waw_size = p->ordered ? (size_t)-1 : 0;
  fi->ep_attr->mem_tag_format = ~0ULL; /* every bit of a tag matches */
  fi->ep_attr->tx_ctx_cnt = fi->ep_attr->rx_ctx_cnt = 1;
  uint64_t order = FI_ORDER_SAS | (p->ordered ? FI_ORDER_RAR | FI_ORDER_RAW | FI_ORDER_RAS |
                                                    FI_ORDER_WAR | FI_ORDER_WAW | FI_ORDER_WAS |
                                                    FI_ORDER_SAR | FI_ORDER_SAW
                                              : 0);
  fi->tx_attr->caps = fi->rx_attr->caps = fi->caps;
  fi->tx_attr->msg_order = fi->rx_attr->msg_order = order;
  fi->tx_attr->comp_order = FI_ORDER_NONE;
  fi->tx_attr->inject_size = 0;
  fi->tx_attr->size = fi->rx_attr->size = 1 << 16;
  fi->tx_attr->iov_limit = fi->rx_attr->iov_limit = 1;
  fi->tx_attr->rma_iov_limit = 1;
  fi->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  fi->domain_attr->name = strdup("model0");
  fi->domain_attr->threading = FI_THREAD_SAFE;
  fi->domain_attr->control_progress = FI_PROGRESS_AUTO;
  fi->domain_attr->data_progress = FI_PROGRESS_AUTO;
  fi->domain_attr->resource_mgmt = FI_RM_ENABLED;
  fi->domain_attr->av_type = FI_AV_TABLE;
  fi->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                             ((fi->caps & FI_HMEM) ? FI_MR_HMEM : 0) |
                             (pm_params()->mr_endpoint ? FI_MR_ENDPOINT : 0);
  fi->domain_attr->mr_key_size = 8;
  fi->domain_attr->cq_data_size = 8;
  fi->domain_attr->ep_cnt = 1 << 16;
  fi->domain_attr->tx_ctx_cnt = fi->domain_attr->rx_ctx_cnt = 1 << 16;
  fi->domain_attr->max_ep_tx_ctx = fi->domain_attr->max_ep_rx_ctx = 1;
  fi->domain_attr->mr_cnt = PM_MAX_MR;
  fi->fabric_attr->name = strdup("model");
  /* prov_name is left to libfabric, which names us (a name set here reads as a layered provider's) */
  fi->fabric_attr->prov_version = FI_VERSION(1, 0);
  if (!fi->domain_attr->name || !fi->fabric_attr->name) {
    fi_freeinfo(fi);
    return -FI_ENOMEM;
  }
  *info = fi;
  return 0;
}

/* libfabric calls it before it unloads us: the NIC thread must be gone by then. */
static void cleanup(void) {
  pm_nic_stop();
  forget(NULL, 1);
}

static struct fi_provider model_prov = {
    .version = FI_VERSION(1, 0),
    .fi_version = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION),
    .name = "model",
    .getinfo = getinfo,
    .fabric = fabric_open,
    .cleanup = cleanup,
};

FI_EXT_INI { return &model_prov; }
