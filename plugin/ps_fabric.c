#include "ps_fabric.h"
#include "ps_gpumem.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_clock.h"
#include "ps_log.h"
#include "ps_rma.h"
#include "ps_wire.h"

/* Fastest hardware providers first; tcp;ofi_rxm is the portable floor. shm
 * and sockets are never picked implicitly (single-node / test providers). */
const char *const ps_provider_preference[] = {
    "cxi", "efa", "verbs;ofi_rxm", "psm3", "opx", "ucx", "tcp;ofi_rxm", NULL};

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static int init_done;
static ncclResult_t init_result;
static ps_config_t config;
static ps_device_t devices[PS_MAX_DEVICES];
static int ndevices;
static char provider[64];
static uint32_t api_version = FI_VERSION(1, 14); /* ps_fabric_api_version */
static uint32_t wire_hash;
static atomic_uint_fast64_t next_key = 1;

static uint64_t fnv1a(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

/* Providers known not to keep FI_DELIVERY_COMPLETE for RMA writes. */
static const char *rma_delivery_quirk(const char *prov) {
  /* libfabric 1.17 smr_rma.c completes an inline write once it is queued to
   * the peer, before the peer copies it in; perseus_rma_test caught signals
   * overtaking data there under load. */
  if (!strcmp(prov, "shm")) return "shm completes inline RMA writes before the peer has the data";
  return NULL;
}

/* Default bound on one-sided operations posted and not completed per peer.
 * libfabric 1.17's sockets provider runs every connection of a domain
 * through one table of 128 progress entries: each write it sends holds an
 * entry until the target acknowledges it, and each write it receives holds
 * one until its acknowledgement is sent, which waits for the connection's
 * outgoing side. Two ranks writing to each other by the hundred filled both
 * tables and neither read again (perseus_rma_test, 3 ranks: 4 of 310 runs
 * stalled without a bound, 0 of 950 with 16 per peer). */
/* Providers whose completions name the sender under FI_SOURCE, as
 * libfabric 1.17 was seen to: a provider that names the wrong one fails a
 * healthy comm. sockets lists FI_SOURCE but named another rank as a
 * signal's sender in a healthy 3-rank run (rma-invariant-target-sockets);
 * rxm (its own protocol) names senders of messages, but address 0 for every
 * write. */
static int names_senders(const char *prov) {
  return !strcmp(prov, "shm") || !strcmp(prov, "model") || !strcmp(prov, "tcp;ofi_rxm");
}
static int names_writers(const char *prov) { return !strcmp(prov, "shm") || !strcmp(prov, "model"); }

static uint32_t rma_inflight_quirk(const char *prov) {
  return !strcmp(prov, "sockets") ? 16 : 0;
}

static int pref_rank(const char *prov) {
  for (int i = 0; ps_provider_preference[i]; i++)
    if (!strcmp(prov, ps_provider_preference[i])) return i;
  return -1;
}

static int is_loopback(const struct fi_info *fi) {
  if (!strcmp(fi->domain_attr->name, "lo")) return 1;
  if (fi->src_addr && fi->addr_format == FI_SOCKADDR_IN) {
    const struct sockaddr_in *s = fi->src_addr;
    return (ntohl(s->sin_addr.s_addr) >> 24) == 127;
  }
  if (fi->src_addr && fi->addr_format == FI_SOCKADDR_IN6) {
    const struct sockaddr_in6 *s = fi->src_addr;
    return IN6_IS_ADDR_LOOPBACK(&s->sin6_addr);
  }
  return 0;
}


static struct fi_info *make_hints(const char *prov, uint64_t caps) {
  struct fi_info *h = fi_allocinfo();
  if (!h) return NULL;
  h->caps = caps;
  h->mode = FI_CONTEXT | FI_CONTEXT2;
  h->ep_attr->type = FI_EP_RDM;
  h->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT |
      ((caps & FI_HMEM) ? FI_MR_HMEM : 0);
  h->domain_attr->threading = FI_THREAD_SAFE;
  h->tx_attr->msg_order = FI_ORDER_SAS; /* same-tag messages match in order */
  h->rx_attr->msg_order = FI_ORDER_SAS;
  if (prov) h->fabric_attr->prov_name = strdup(prov);
  return h;
}

static void read_sysfs_facts(ps_device_t *d, const struct fi_info *fi) {
  char path[PATH_MAX], real[PATH_MAX];
  d->speed_mbps = 0;
  if (fi->nic && fi->nic->link_attr && fi->nic->link_attr->speed)
    d->speed_mbps = (int)(fi->nic->link_attr->speed / 1000000ULL);
  snprintf(path, sizeof path, "/sys/class/net/%s/speed", d->domain_name);
  FILE *f = d->speed_mbps ? NULL : fopen(path, "r");
  if (f) {
    int s = 0;
    if (fscanf(f, "%d", &s) == 1 && s > 0) d->speed_mbps = s;
    fclose(f);
  }
  /* Unknown (loopback, virtual NICs): report 10 Gb/s as NCCL's socket transport does. */
  if (d->speed_mbps <= 0) d->speed_mbps = 10000;
  const char *classes[] = {"net", "infiniband", NULL};
  for (int i = 0; classes[i] && !d->pci_path; i++) {
    snprintf(path, sizeof path, "/sys/class/%s/%s/device", classes[i], d->domain_name);
    if (realpath(path, real)) d->pci_path = strdup(real);
  }
}

static ncclResult_t open_device(ps_device_t *d, int index, const struct fi_info *fi) {
  int rc;
  memset(d, 0, sizeof *d);
  d->info = fi_dupinfo(fi);
  if (!d->info) return ncclSystemError;
  snprintf(d->domain_name, sizeof d->domain_name, "%s", fi->domain_attr->name);
  snprintf(d->name, sizeof d->name, "%s/%s", fi->fabric_attr->prov_name, fi->domain_attr->name);
  d->guid = fnv1a(d->name, strlen(d->name), 0xcbf29ce484222325ULL);
  uint64_t mm = (uint64_t)fi->domain_attr->mr_mode;
  d->mr_local = !!(mm & FI_MR_LOCAL);
  d->mr_endpoint = !!(mm & FI_MR_ENDPOINT);
  d->mr_prov_key = !!(mm & FI_MR_PROV_KEY);
  d->mr_virt_addr = !!(mm & FI_MR_VIRT_ADDR);
  d->manual_progress = fi->domain_attr->data_progress == FI_PROGRESS_MANUAL;
  d->max_msg_size = fi->ep_attr->max_msg_size;
  d->max_eps = fi->domain_attr->ep_cnt;
  d->rma = !!(fi->caps & FI_RMA);
  d->rma_delivery_broken = rma_delivery_quirk(fi->fabric_attr->prov_name);
  d->rma_fence = (fi->caps & (FI_ATOMIC | FI_FENCE)) == (FI_ATOMIC | FI_FENCE);
  d->rma_msg_order = fi->tx_attr->msg_order & fi->rx_attr->msg_order;
  d->cq_data_size = fi->domain_attr->cq_data_size;
  d->rma_inflight = rma_inflight_quirk(fi->fabric_attr->prov_name);
  d->hmem = (fi->caps & FI_HMEM) && (mm & FI_MR_HMEM);
  d->src_msgs = d->rma && (fi->caps & FI_SOURCE) && names_senders(fi->fabric_attr->prov_name);
  d->src_writes = d->src_msgs && names_writers(fi->fabric_attr->prov_name);
  pthread_mutex_init(&d->lock, NULL);
  read_sysfs_facts(d, fi);
  const char *step = "fi_fabric";
  if ((rc = fi_fabric(fi->fabric_attr, &d->fabric, NULL)) ||
      (step = "fi_domain", rc = fi_domain(d->fabric, d->info, &d->domain, NULL))) {
    PS_WARN("%s(%s) failed: %s", step, d->name, fi_strerror(-rc));
    if (d->fabric) fi_close(&d->fabric->fid);
    fi_freeinfo(d->info);
    free(d->pci_path);
    pthread_mutex_destroy(&d->lock);
    memset(d, 0, sizeof *d);
    return ncclSystemError;
  }
  PS_INFO(NCCL_INIT | NCCL_NET,
          "%s device %d: %s speed %d Mb/s mr_mode 0x%llx progress %s max_msg %zu pci %s%s",
          d->rma ? "one-sided" : "net", index, d->name, d->speed_mbps, (unsigned long long)mm,
          d->manual_progress ? "manual" : "auto", d->max_msg_size,
          d->pci_path ? d->pci_path : "-", d->hmem ? ", lists FI_HMEM" : "");
  return ncclSuccess;
}

/* From one provider's fi_info list, open one device per selected domain. */
/* An IPv6 link-local source address names no interface by itself (a peer
 * would need our scope id) and may still be tentative: a handle carrying it
 * is one the peer cannot reach. The domain's other addresses are used. */
static int link_local(const struct fi_info *fi) {
  if (!fi->src_addr || fi->addr_format != FI_SOCKADDR_IN6) return 0;
  const struct sockaddr_in6 *s = fi->src_addr;
  return IN6_IS_ADDR_LINKLOCAL(&s->sin6_addr);
}

/* The provider's entries asked for with FI_HMEM as well (NULL: none, or
 * PERSEUS_STAGING=always): a device opens from its twin there, so that it
 * can register CUDA memory where the provider does (ps_net.c asks it). */
static struct fi_info *hmem_list;

/* The same provider, domain and source address. */
static int same_place(const struct fi_info *a, const struct fi_info *b) {
  return !strcmp(a->fabric_attr->prov_name, b->fabric_attr->prov_name) &&
         !strcmp(a->domain_attr->name, b->domain_attr->name) && a->addr_format == b->addr_format &&
         a->src_addrlen == b->src_addrlen &&
         (!b->src_addrlen || !memcmp(a->src_addr, b->src_addr, b->src_addrlen));
}

static const struct fi_info *hmem_twin(const struct fi_info *fi) {
  for (const struct fi_info *h = hmem_list; h; h = h->next)
    if (same_place(h, fi)) return h;
  return fi;
}

/* Opens prov's domains that pass `rule` (NULL: all). A list of names to
 * take opens every match; otherwise (no rule, or one that excludes) the
 * non-loopback domains, and loopback only when there is nothing else. */
static ncclResult_t open_matching(struct fi_info *list, const char *prov, const char *rule) {
  int listed = rule && *rule != '^';
  for (int pass = 0; pass < 2 && ndevices == 0; pass++) {
    for (struct fi_info *fi = list; fi && ndevices < PS_MAX_DEVICES; fi = fi->next) {
      if (strcmp(fi->fabric_attr->prov_name, prov)) continue;
      const char *dn = fi->domain_attr->name;
      if (rule && !ps_iface_match(rule, dn)) continue;
      if (!listed && is_loopback(fi) != pass) continue;
      if (link_local(fi)) continue;
      int dup = 0;
      for (int i = 0; i < ndevices; i++) dup |= !strcmp(devices[i].domain_name, dn);
      if (dup) continue;
      PS_CHECK(open_device(&devices[ndevices], ndevices, hmem_twin(fi)));
      ndevices++;
    }
    if (listed) break;
  }
  return ncclSuccess;
}

/* The domains of prov, comma-separated, each once, for messages. */
static void domain_names(struct fi_info *list, const char *prov, char *buf, size_t len) {
  buf[0] = 0;
  for (struct fi_info *fi = list; fi; fi = fi->next) {
    if (strcmp(fi->fabric_attr->prov_name, prov)) continue;
    int seen = 0;
    for (struct fi_info *g = list; g != fi && !seen; g = g->next)
      seen = !strcmp(g->fabric_attr->prov_name, prov) &&
             !strcmp(g->domain_attr->name, fi->domain_attr->name);
    if (seen) continue;
    size_t at = strlen(buf);
    snprintf(buf + at, len - at, "%s%s", at ? ", " : "", fi->domain_attr->name);
  }
}

/* PERSEUS_IFACE must match: a typo is an error naming it. NCCL_SOCKET_IFNAME
 * is NCCL's own choice of interface, taken as ours where it names domains of
 * this provider (tcp, sockets: interfaces), else left to NCCL (shm's domain
 * is no interface). */
static ncclResult_t open_domains(struct fi_info *list, const char *prov) {
  char names[512];
  PS_CHECK(open_matching(list, prov, config.iface));
  if (ndevices || !config.iface) return ncclSuccess;
  domain_names(list, prov, names, sizeof names);
  if (!config.iface_from_nccl) {
    PS_WARN("provider %s has no domain matching PERSEUS_IFACE='%s' (its domains: %s; a list of "
            "name prefixes, '=' for exact names, '^' to exclude)", prov, config.iface, names);
    return ncclInvalidUsage;
  }
  PS_INFO(NCCL_INIT | NCCL_NET, "NCCL_SOCKET_IFNAME='%s' matches no domain of %s (%s): using its "
          "default domains", config.iface, prov, names);
  return open_matching(list, prov, NULL);
}

/* rxm's own protocol over tcp adds bounce-buffer segmentation and rendezvous
 * round trips to every large message; its passthru mode hands tagged calls
 * straight to the tcp provider.
 * libfabric reads the variable when it first loads its providers, so it must
 * be set before our first fi_getinfo; a value the user set is kept. */
static void apply_tcp_passthru(void) {
  const char *v = getenv("FI_OFI_RXM_ENABLE_PASSTHRU");
  /* Passthru is known good on 1.17. On 1.22 its tagged path crashes in the
   * tcp provider (xnet_handle_tag, on rxm's connection thread), so other
   * versions keep rxm's own protocol unless the user sets the variable. */
  uint32_t ver = fi_version();
  int known = FI_MAJOR(ver) == 1 && FI_MINOR(ver) <= 17;
  if (config.tcp_passthru && !v && !known)
    PS_INFO(NCCL_INIT | NCCL_NET, "rxm passthru left off on libfabric %u.%u (tested on 1.17 only; "
            "its plain tcp provider is an RDM provider there: PERSEUS_PROVIDER=tcp)",
            FI_MAJOR(ver), FI_MINOR(ver));
  if (config.tcp_passthru && !v && known) setenv("FI_OFI_RXM_ENABLE_PASSTHRU", "1", 0);
  v = getenv("FI_OFI_RXM_ENABLE_PASSTHRU");
  PS_INFO(NCCL_INIT | NCCL_NET, "rxm passthru over tcp: %s (FI_OFI_RXM_ENABLE_PASSTHRU=%s)",
          v && strcmp(v, "0") ? "on" : "off", v ? v : "unset");
}

/* --- shm segments ---
 * An shm endpoint is a file in /dev/shm named after the endpoint (16 MiB in
 * libfabric 1.17), and while a large message crosses, "<name>_<message id>"
 * too. A process killed before it closed its endpoints leaves them behind,
 * and nothing removes them. Our names say whose they are:
 * "perseus_<pid namespace>_<pid>_<16 hex>", so a later init can remove those
 * of dead owners. The namespace keeps a process from judging the pids of
 * another (containers sharing /dev/shm see different pids). */
#define PS_SHM_DIR "/dev/shm"
#define PS_SHM_PREFIX "perseus_"

/* The inode of this process's pid namespace; 0 when /proc cannot say. */
static unsigned long long pid_ns(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) ? 0 : (unsigned long long)st.st_ino;
}

void ps_fabric_shm_name(char *out, size_t n) {
  snprintf(out, n, PS_SHM_PREFIX "%llu_%d_%016llx", pid_ns(), (int)getpid(),
           (unsigned long long)ps_random64());
}

/* Reads 1 to `max` digits of `base` (lower-case hex) at *s; 0 if none. */
static int take_num(const char **s, int base, int max, unsigned long long *v) {
  const char *p = *s;
  unsigned long long x = 0;
  int n = 0;
  for (; n < max; n++, p++) {
    int d = *p >= '0' && *p <= '9' ? *p - '0' : base == 16 && *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
    if (d < 0) break;
    x = x * (unsigned)base + (unsigned)d;
  }
  *s = p, *v = x;
  return n;
}

int ps_fabric_shm_owner(const char *name, pid_t *pid) {
  unsigned long long ns = 0, p = 0, rnd = 0, msg = 0;
  const char *s = name;
  if (strncmp(s, PS_SHM_PREFIX, strlen(PS_SHM_PREFIX))) return 0;
  s += strlen(PS_SHM_PREFIX);
  if (!take_num(&s, 10, 20, &ns) || *s++ != '_' || !take_num(&s, 10, 10, &p) || *s++ != '_' ||
      take_num(&s, 16, 16, &rnd) != 16)
    return 0;
  if (*s == '_') { /* a message's file: "_<message id>" (libfabric prints it signed) */
    s += 1 + (s[1] == '-');
    if (!take_num(&s, 10, 20, &msg)) return 0;
  }
  if (*s || !ns || ns != pid_ns() || !p || p > INT_MAX) return 0;
  *pid = (pid_t)p;
  return 1;
}

/* Removes the /dev/shm files of ours whose owner is dead: only names of our
 * format from this pid namespace, regular files of this user, and only when
 * the pid named is gone (a live pid, even another program that took it
 * since, keeps its file). */
static void shm_reap_stale(void) {
  DIR *d = opendir(PS_SHM_DIR);
  if (!d) {
    PS_INFO(NCCL_INIT | NCCL_NET, "shm: cannot read %s (%s): stale segments not looked for",
            PS_SHM_DIR, strerror(errno));
    return;
  }
  int removed = 0;
  unsigned long long bytes = 0;
  for (struct dirent *e; (e = readdir(d));) {
    pid_t pid;
    struct stat st;
    if (!ps_fabric_shm_owner(e->d_name, &pid)) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue; /* alive (EPERM: someone else's) */
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode) ||
        st.st_uid != getuid())
      continue;
    if (unlinkat(dirfd(d), e->d_name, 0)) {
      PS_INFO(NCCL_INIT | NCCL_NET, "shm: cannot remove stale %s/%s: %s", PS_SHM_DIR, e->d_name,
              strerror(errno));
      continue;
    }
    removed++;
    bytes += (unsigned long long)st.st_size;
  }
  closedir(d);
  if (removed)
    PS_INFO(NCCL_INIT | NCCL_NET, "shm: removed %d segment(s) of dead processes from %s (%llu MiB)",
            removed, PS_SHM_DIR, bytes >> 20);
}

/* 1.20 (dma-buf registration) where the library has it and the provider
 * could use it; a provider that copies GPU memory with the CPU gains nothing
 * from a dma-buf and keeps the API version every test has run at. */
static uint32_t api_version_for(const char *prov) {
  return fi_version() >= FI_VERSION(1, 20) && !ps_gpumem_host_copier(prov) ? FI_VERSION(1, 20)
                                                                            : FI_VERSION(1, 14);
}

static ncclResult_t do_init(void) {
  PS_CHECK(ps_config_load(&config));
  apply_tcp_passthru();
  struct fi_info *hints = make_hints(config.provider, FI_TAGGED | FI_MSG), *list = NULL;
  if (!hints) return ncclSystemError;
  int rc = fi_getinfo(ps_fabric_api_version(), NULL, NULL, 0, hints, &list);
  fi_freeinfo(hints);
  if (rc || !list) {
    PS_WARN("no libfabric provider offers tagged RDM endpoints%s%s: %s", config.provider ? " for " : "",
            config.provider ? config.provider : "", fi_strerror(-rc));
    return ncclSystemError;
  }
  const char *chosen = NULL;
  int best = INT_MAX;
  for (struct fi_info *fi = list; fi; fi = fi->next) {
    const char *p = fi->fabric_attr->prov_name;
    int r = config.provider ? 0 : pref_rank(p);
    if (r >= 0 && r < best) best = r, chosen = p;
  }
  if (!chosen) {
    PS_WARN("no preferred provider found (set PERSEUS_PROVIDER to one of those fi_info lists)");
    fi_freeinfo(list);
    return ncclSystemError;
  }
  snprintf(provider, sizeof provider, "%s", chosen);
  if (!strcmp(provider, "shm")) shm_reap_stale();
  if (api_version_for(provider) != api_version) { /* the provider's entries again, at that version */
    api_version = api_version_for(provider);
    fi_freeinfo(list);
    list = NULL;
    hints = make_hints(provider, FI_TAGGED | FI_MSG);
    rc = hints ? fi_getinfo(api_version, NULL, NULL, 0, hints, &list) : -FI_ENOMEM;
    fi_freeinfo(hints);
    if (rc || !list) {
      PS_WARN("provider %s offers no tagged RDM endpoint at libfabric API %u.%u: %s", provider,
              FI_MAJOR(api_version), FI_MINOR(api_version), fi_strerror(-rc));
      return ncclSystemError;
    }
  }
  hints = config.staging == PS_STAGING_ALWAYS ? NULL
                                               : make_hints(provider, FI_TAGGED | FI_MSG | FI_HMEM);
  if (hints && fi_getinfo(ps_fabric_api_version(), NULL, NULL, 0, hints, &hmem_list)) hmem_list = NULL;
  fi_freeinfo(hints);
  ncclResult_t res = open_domains(list, provider);
  fi_freeinfo(list);
  fi_freeinfo(hmem_list);
  hmem_list = NULL;
  if (res != ncclSuccess) return res;
  if (ndevices == 0) {
    PS_WARN("provider %s has no usable domain", provider);
    return ncclSystemError;
  }
  char w[160];
  snprintf(w, sizeof w, "perseus-wire-1/%s", provider);
  wire_hash = (uint32_t)fnv1a(w, strlen(w), 0xcbf29ce484222325ULL);
  PS_INFO(NCCL_INIT | NCCL_NET, "libfabric %u.%u (API %u.%u), provider %s, %d device(s)",
          FI_MAJOR(fi_version()), FI_MINOR(fi_version()), FI_MAJOR(api_version),
          FI_MINOR(api_version), provider, ndevices);
  return ncclSuccess;
}

ncclResult_t ps_fabric_init(void) {
  pthread_mutex_lock(&init_lock);
  if (!init_done) {
    init_result = do_init();
    init_done = 1;
  }
  pthread_mutex_unlock(&init_lock);
  return init_result;
}

/* fi (asked for with caps) asked for again with FI_SOURCE, so that the
 * one-sided engine can check who sent what it takes: where the provider
 * offers that on the same protocol, order, registration modes and CQ data.
 * rxm's passthru to tcp (libfabric 1.17's default there) names no sender,
 * and asking would trade it for rxm's own protocol: there, and on providers
 * without FI_SOURCE, NULL. *twins: the list to free. */
static struct fi_info *source_twin(const struct fi_info *fi, uint64_t caps, struct fi_info **twins) {
  struct fi_info *hints = make_hints(provider, caps | FI_SOURCE);
  *twins = NULL;
  if (hints && fi_getinfo(ps_fabric_api_version(), NULL, NULL, 0, hints, twins)) *twins = NULL;
  fi_freeinfo(hints);
  for (struct fi_info *t = *twins; t; t = t->next)
    if (same_place(t, fi) && (t->caps & FI_SOURCE) && t->ep_attr->protocol == fi->ep_attr->protocol &&
        t->tx_attr->msg_order == fi->tx_attr->msg_order &&
        t->rx_attr->msg_order == fi->rx_attr->msg_order &&
        t->domain_attr->mr_mode == fi->domain_attr->mr_mode &&
        t->domain_attr->cq_data_size == fi->domain_attr->cq_data_size)
      return t;
  return NULL;
}

/* The one-sided engine needs FI_RMA on its endpoints: a second fabric and
 * domain per device, opened on first use, same provider and domain name. */
static ps_device_t rma_devices[PS_MAX_DEVICES];
static int rma_opened[PS_MAX_DEVICES]; /* 1 open, -1 could not (logged once), 0 not tried */

ps_device_t *ps_fabric_rma_dev(int dev) {
  if (dev < 0 || dev >= ndevices) return NULL;
  pthread_mutex_lock(&init_lock);
  if (!rma_opened[dev]) {
    /* Native fenced atomics first (the fence strategy); a provider that only
     * emulates atomics (rxm) refuses FI_FENCE, and asking it for atomics
     * alone would cost its write/send ordering, so the next try is plain.
     * Each with FI_HMEM first (GPU windows without staging) unless
     * PERSEUS_STAGING=always leaves it unused. */
    const uint64_t base = FI_TAGGED | FI_MSG | FI_RMA, hmem = FI_HMEM,
                   wants[] = {base | FI_ATOMIC | FI_FENCE | hmem, base | FI_ATOMIC | FI_FENCE,
                              base | hmem, base};
    struct fi_info *list = NULL, *fi = NULL, *twins = NULL, *twin = NULL;
    int rc = 0;
    uint64_t got = 0;
    for (int w = 0; w < 4 && !fi; w++) {
      if ((wants[w] & FI_HMEM) && config.staging == PS_STAGING_ALWAYS) continue;
      struct fi_info *hints = make_hints(provider, wants[w]);
      fi_freeinfo(list);
      list = NULL;
      rc = hints ? fi_getinfo(ps_fabric_api_version(), NULL, NULL, 0, hints, &list) : -FI_ENOMEM;
      fi_freeinfo(hints);
      for (fi = list; fi && (strcmp(fi->domain_attr->name, devices[dev].domain_name) || link_local(fi));)
        fi = fi->next;
      got = wants[w];
    }
    if (!fi)
      PS_WARN("provider %s offers no RMA endpoint on %s: %s", provider, devices[dev].domain_name,
              rc ? fi_strerror(-rc) : "domain not listed");
    else
      twin = source_twin(fi, got, &twins);
    rma_opened[dev] = fi && open_device(&rma_devices[dev], dev, twin ? twin : fi) == ncclSuccess ? 1 : -1;
    fi_freeinfo(list);
    fi_freeinfo(twins);
  }
  pthread_mutex_unlock(&init_lock);
  return rma_opened[dev] > 0 ? &rma_devices[dev] : NULL;
}

uint32_t ps_fabric_api_version(void) { return api_version; }


int ps_fabric_ndev(void) { return ndevices; }
ps_device_t *ps_fabric_dev(int dev) {
  return (dev >= 0 && dev < ndevices) ? &devices[dev] : NULL;
}
const ps_config_t *ps_fabric_config(void) { return &config; }
/* PERSEUS_ORDERING as a wire hash carries it (ps_wire.h). Read at each call,
 * as the one-sided connect reads it (ps_order_choose): a process may set it
 * anew before each comm (perseus_put_signal_perf does). A bad value is
 * connect's to refuse, naming it; here it only has to differ. */
static uint32_t ordering_setting(void) {
  const char *v = ps_env_str("PERSEUS_ORDERING");
  if (!v) return PS_ORD_AUTO;
  for (uint32_t i = 0; ps_ordering_names[i]; i++)
    if (!strcasecmp(v, ps_ordering_names[i])) return i;
  return PS_WIRE_ORDERING_INVALID;
}

uint32_t ps_fabric_wire_hash(void) {
  return (wire_hash & ~PS_WIRE_ORDERING_MASK) | ordering_setting();
}
const char *ps_fabric_provider(void) { return provider; }
uint64_t ps_fabric_next_key(void) { return atomic_fetch_add(&next_key, 1); }
