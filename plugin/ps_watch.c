#include "ps_watch.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ps_clock.h"
#include "ps_log.h"

#define PS_WATCH_LOOK_NS 50000000ULL /* how often one watch's socket is looked at */
#define PS_WATCH_MAX_ACCEPTED 4096 /* peers' watches of us held at most; more are closed */

enum { W_CONNECTING, W_UP, W_NEVER, W_BROKEN };

struct ps_watch {
  struct ps_watch *next;
  int refs, fd, state;
  struct sockaddr_storage peer;
  socklen_t peer_len;
  uint64_t looked_ns;
  char why[192];
};

typedef struct {
  ps_device_t *dev;
  int fd, tried;
  uint16_t port;
} ps_watch_listener_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static ps_watch_listener_t listeners[PS_MAX_DEVICES];
static int nlisteners;
static ps_watch_t *watches;
static int *accepted; /* peers' watches of us: read only to see them close */
static int naccepted, cap_accepted;
static uint64_t serviced_ns;

/* The device's own IP address (port 0), where its provider speaks IP. */
static int device_ip(const ps_device_t *d, struct sockaddr_storage *out, socklen_t *len) {
  const struct fi_info *fi = d->info;
  if (!fi || !fi->src_addr) return 0;
  if (fi->addr_format != FI_SOCKADDR && fi->addr_format != FI_SOCKADDR_IN &&
      fi->addr_format != FI_SOCKADDR_IN6)
    return 0;
  const struct sockaddr *sa = fi->src_addr;
  size_t need = sa->sa_family == AF_INET    ? sizeof(struct sockaddr_in)
                : sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                            : 0;
  if (!need || fi->src_addrlen < need) return 0;
  memset(out, 0, sizeof *out);
  memcpy(out, sa, need);
  if (sa->sa_family == AF_INET) ((struct sockaddr_in *)out)->sin_port = 0;
  else ((struct sockaddr_in6 *)out)->sin6_port = 0;
  *len = (socklen_t)need;
  return 1;
}

static void addr_str(const struct sockaddr_storage *a, char *out, size_t n) {
  char ip[64] = "?";
  int port = 0;
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *s = (const void *)a;
    inet_ntop(AF_INET, &s->sin_addr, ip, sizeof ip);
    port = ntohs(s->sin_port);
  } else if (a->ss_family == AF_INET6) {
    const struct sockaddr_in6 *s = (const void *)a;
    inet_ntop(AF_INET6, &s->sin6_addr, ip, sizeof ip);
    port = ntohs(s->sin6_port);
  }
  snprintf(out, n, a->ss_family == AF_INET6 ? "[%s]:%d" : "%s:%d", ip, port);
}

static int set_int(int fd, int level, int name, int v) {
  return setsockopt(fd, level, name, &v, sizeof v);
}

/* Keepalive every second after PERSEUS_KEEPALIVE_MS idle, and the socket
 * given up once nothing was acknowledged for PERSEUS_PEER_TIMEOUT_MS. */
static int keep_alive(int fd) {
  const ps_config_t *cfg = ps_fabric_config();
  long long idle_s = cfg->keepalive_ms / 1000 > 0 ? cfg->keepalive_ms / 1000 : 1;
  long long timeout_ms = cfg->peer_timeout_ms < 0x7fffffff ? cfg->peer_timeout_ms : 0x7fffffff;
  return set_int(fd, SOL_SOCKET, SO_KEEPALIVE, 1) ||
         set_int(fd, IPPROTO_TCP, TCP_KEEPIDLE, (int)idle_s) ||
         set_int(fd, IPPROTO_TCP, TCP_KEEPINTVL, 1) ||
         set_int(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, (int)timeout_ms);
}

/* Takes the peers' new watches of us, and closes those whose peer closed
 * them (under lock, at most every PS_WATCH_LOOK_NS). */
static void service(uint64_t now) {
  if (now - serviced_ns < PS_WATCH_LOOK_NS) return;
  serviced_ns = now;
  for (int i = 0; i < nlisteners; i++) {
    for (int fd; listeners[i].fd >= 0 &&
                 (fd = accept4(listeners[i].fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0;) {
      /* the other end's host may die without closing: keepalive and a
       * user timeout end the socket then, as on the watching side */
      if (naccepted == PS_WATCH_MAX_ACCEPTED || keep_alive(fd)) {
        close(fd); /* the peer's watch sees us close it: it stops counting on it */
        continue;
      }
      if (naccepted == cap_accepted) {
        int cap = cap_accepted ? 2 * cap_accepted : 16, *n = realloc(accepted, cap * sizeof *n);
        if (!n) {
          close(fd);
          break;
        }
        accepted = n, cap_accepted = cap;
      }
      accepted[naccepted++] = fd;
    }
  }
  char buf[64];
  for (int i = 0; i < naccepted;) {
    ssize_t r = recv(accepted[i], buf, sizeof buf, MSG_DONTWAIT);
    if (r > 0 || (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) {
      i++;
      continue;
    }
    close(accepted[i]);
    accepted[i] = accepted[--naccepted];
  }
}

static ps_watch_listener_t *listener_of(ps_device_t *d) {
  for (int i = 0; i < nlisteners; i++)
    if (listeners[i].dev == d) return &listeners[i];
  if (nlisteners == PS_MAX_DEVICES) return NULL;
  listeners[nlisteners] = (ps_watch_listener_t){.dev = d, .fd = -1};
  return &listeners[nlisteners++];
}

static void open_listener(ps_watch_listener_t *l) {
  struct sockaddr_storage a;
  socklen_t len;
  l->tried = 1;
  if (!device_ip(l->dev, &a, &len)) return;
  char where[96];
  addr_str(&a, where, sizeof where);
  int fd = socket(a.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, len) || listen(fd, SOMAXCONN) ||
      getsockname(fd, (struct sockaddr *)&a, &len)) {
    PS_INFO(NCCL_INIT | NCCL_NET, "link watch: no listener on %s (%s): peers cannot watch the "
            "link to us", where, strerror(errno));
    if (fd >= 0) close(fd);
    return;
  }
  l->fd = fd;
  l->port = ntohs(a.ss_family == AF_INET ? ((struct sockaddr_in *)&a)->sin_port
                                         : ((struct sockaddr_in6 *)&a)->sin6_port);
  PS_INFO(NCCL_INIT | NCCL_NET, "link watch: listening on %s port %u", l->dev->name, l->port);
}

uint16_t ps_watch_port(ps_device_t *d) {
  pthread_mutex_lock(&lock);
  ps_watch_listener_t *l = d ? listener_of(d) : NULL;
  if (l && !l->tried) open_listener(l);
  uint16_t port = l ? l->port : 0;
  pthread_mutex_unlock(&lock);
  return port;
}

/* A fresh watch: a non-blocking connect from our device's address, kept
 * alive (keep_alive). */
static ps_watch_t *watch_new(ps_device_t *d, const struct sockaddr_storage *peer, socklen_t plen) {
  struct sockaddr_storage src;
  socklen_t slen;
  ps_watch_t *w = calloc(1, sizeof *w);
  if (!w || !device_ip(d, &src, &slen)) {
    free(w);
    return NULL;
  }
  w->peer = *peer, w->peer_len = plen, w->refs = 1, w->state = W_CONNECTING;
  char where[96];
  addr_str(peer, where, sizeof where);
  w->fd = socket(peer->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (w->fd < 0 || keep_alive(w->fd) || bind(w->fd, (struct sockaddr *)&src, slen) ||
      (connect(w->fd, (const struct sockaddr *)peer, plen) && errno != EINPROGRESS)) {
    PS_INFO(NCCL_NET, "link watch of %s not started (%s): a cut link to it is seen only when "
            "the provider reports it", where, strerror(errno));
    if (w->fd >= 0) close(w->fd);
    free(w);
    return NULL;
  }
  w->next = watches;
  watches = w;
  return w;
}

ps_watch_t *ps_watch_attach(ps_device_t *d, const void *addr, size_t addrlen, uint16_t port) {
  struct sockaddr_storage own, peer;
  socklen_t len;
  if (!port || !d || !device_ip(d, &own, &len) || addrlen < len || !addr) return NULL;
  memset(&peer, 0, sizeof peer);
  memcpy(&peer, addr, len); /* the peer's fabric address: its IP, in our family */
  if (peer.ss_family != own.ss_family) return NULL;
  if (own.ss_family == AF_INET) ((struct sockaddr_in *)&peer)->sin_port = htons(port);
  else ((struct sockaddr_in6 *)&peer)->sin6_port = htons(port);
  pthread_mutex_lock(&lock);
  ps_watch_t *w = watches;
  while (w && (w->state == W_BROKEN || w->peer_len != len || memcmp(&w->peer, &peer, len)))
    w = w->next;
  if (w) w->refs++;
  else w = watch_new(d, &peer, len);
  service(ps_now_ns());
  pthread_mutex_unlock(&lock);
  return w;
}

void ps_watch_detach(ps_watch_t *w) {
  if (!w) return;
  pthread_mutex_lock(&lock);
  if (--w->refs == 0) {
    for (ps_watch_t **p = &watches; *p; p = &(*p)->next)
      if (*p == w) {
        *p = w->next;
        break;
      }
    close(w->fd);
    free(w);
  }
  pthread_mutex_unlock(&lock);
}

/* Under lock: moves a watch on from what its socket says now. */
static void look(ps_watch_t *w) {
  const ps_config_t *cfg = ps_fabric_config();
  char where[96];
  struct pollfd p = {.fd = w->fd, .events = w->state == W_CONNECTING ? POLLOUT : POLLIN};
  if (poll(&p, 1, 0) <= 0) return;
  int err = 0;
  socklen_t elen = sizeof err;
  if (getsockopt(w->fd, SOL_SOCKET, SO_ERROR, &err, &elen)) err = errno;
  addr_str(&w->peer, where, sizeof where);
  if (w->state == W_CONNECTING) {
    if (!err) {
      __atomic_store_n(&w->state, W_UP, __ATOMIC_RELAXED);
      return;
    }
    /* A port a firewall refuses or drops says nothing about the link. */
    __atomic_store_n(&w->state, W_NEVER, __ATOMIC_RELAXED);
    PS_INFO(NCCL_NET, "link watch of %s did not come up (%s): a cut link to it is seen only "
            "when the provider reports it", where, strerror(err));
    return;
  }
  char b[64];
  ssize_t r = err ? -1 : recv(w->fd, b, sizeof b, MSG_DONTWAIT);
  if (r > 0 || (r < 0 && !err && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)))
    return; /* nothing is sent on a watch; what came is dropped */
  if (!err && r < 0) err = errno;
  if (err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH || err == EHOSTDOWN) {
    snprintf(w->why, sizeof w->why, "the link to its host %s is down: nothing acknowledged for "
             "%lld ms (PERSEUS_PEER_TIMEOUT_MS)", where, (long long)cfg->peer_timeout_ms);
    __atomic_store_n(&w->state, W_BROKEN, __ATOMIC_RELEASE); /* its why is written */
    return;
  }
  /* The peer's process closed it: it exited, maybe after its last sends,
   * whose bytes may still be on their way to us. Not a failure by itself;
   * from here on the probes watch that peer. */
  __atomic_store_n(&w->state, W_NEVER, __ATOMIC_RELAXED);
  PS_INFO(NCCL_NET, "link watch of %s ended (%s): its process closed it", where,
          r == 0 ? "end of stream" : strerror(err));
}

const char *ps_watch_broken(ps_watch_t *w, uint64_t now) {
  if (!w) return NULL;
  if (now - __atomic_load_n(&w->looked_ns, __ATOMIC_RELAXED) < PS_WATCH_LOOK_NS)
    return __atomic_load_n(&w->state, __ATOMIC_ACQUIRE) == W_BROKEN ? w->why : NULL;
  pthread_mutex_lock(&lock);
  __atomic_store_n(&w->looked_ns, now, __ATOMIC_RELAXED);
  service(now);
  if (w->state == W_CONNECTING || w->state == W_UP) look(w);
  const char *why = w->state == W_BROKEN ? w->why : NULL;
  pthread_mutex_unlock(&lock);
  return why;
}
