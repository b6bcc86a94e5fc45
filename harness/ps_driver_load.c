/* dlopen + per-version adapters: the harness sees one call list whatever
 * table it loaded, exactly as NCCL's own version shims do. */
#include <dlfcn.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "ps_driver.h"
#include "ps_driver_int.h"

static void *tbl; /* the loaded ncclNetPlugin_vN */
static void *ctx; /* v11+ per-communicator context */

void drv_logger(ncclDebugLogLevel lvl, unsigned long flags, const char *file, int line,
                const char *fmt, ...) {
  (void)flags;
  static int level = -1;
  if (level < 0) {
    const char *v = getenv("NCCL_DEBUG");
    level = !v ? NCCL_LOG_WARN : !strcasecmp(v, "INFO") ? NCCL_LOG_INFO
                               : !strcasecmp(v, "TRACE") ? NCCL_LOG_TRACE
                                                         : NCCL_LOG_WARN;
  }
  if ((int)lvl > level) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "[pid %d] %s %s:%d %s\n", (int)getpid(), lvl == NCCL_LOG_WARN ? "WARN" : "INFO",
          file, line, msg);
}

#define T(v) ((const ncclNet_v##v##_t *)tbl)

static void props_common(drv_props_t *p, const char *name, int ptr, int recvs, int speed, int comms,
                         int global) {
  snprintf(p->name, sizeof p->name, "%s", name ? name : "?");
  p->ptr_support = ptr, p->max_recvs = recvs, p->speed = speed, p->max_comms = comms;
  p->reg_is_global = global;
}
#define PROPS_FN(v, type, maxp2p)                                                         \
  static ncclResult_t props_v##v(int dev, drv_props_t *p) {                               \
    type q;                                                                               \
    memset(&q, 0xa5, sizeof q); /* unset fields would show as garbage */                  \
    ncclResult_t rc = T(v)->getProperties(dev, &q);                                       \
    if (rc) return rc;                                                                    \
    props_common(p, q.name, q.ptrSupport, q.maxRecvs, q.speed, q.maxComms, q.regIsGlobal); \
    p->max_p2p_bytes = (maxp2p);                                                          \
    return ncclSuccess;                                                                   \
  }
PROPS_FN(8, ps_props_v8_t, (size_t)1 << 30)
PROPS_FN(9, ps_props_v9_t, q.maxP2pBytes)
PROPS_FN(10, ps_props_v9_t, q.maxP2pBytes)
PROPS_FN(11, ps_props_v11_t, q.maxP2pBytes)
PROPS_FN(12, ps_props_v12_t, q.maxP2pBytes)

/* Fields that did not change shape between versions. */
#define SAME_FNS(v)                                                                        \
  static ncclResult_t devices_v##v(int *n) { return T(v)->devices(n); }                   \
  static ncclResult_t accept_v##v(void *lc, void **rc) {                                  \
    ps_nccl_dev_handle_t *dh = NULL;                                                      \
    return T(v)->accept(lc, rc, &dh);                                                     \
  }                                                                                       \
  static ncclResult_t regmr_v##v(void *c, void *d, size_t s, int t, void **mh) {          \
    return T(v)->regMr(c, d, s, t, mh);                                                   \
  }                                                                                       \
  static ncclResult_t regmrdb_v##v(void *c, void *d, size_t s, int t, uint64_t o, int fd,  \
                                   void **mh) {                                            \
    return T(v)->regMrDmaBuf(c, d, s, t, o, fd, mh);                                      \
  }                                                                                       \
  static ncclResult_t deregmr_v##v(void *c, void *mh) { return T(v)->deregMr(c, mh); }    \
  static ncclResult_t test_v##v(void *r, int *d, int *s) { return T(v)->test(r, d, s); }  \
  static ncclResult_t closes_v##v(void *c) { return T(v)->closeSend(c); }                 \
  static ncclResult_t closer_v##v(void *c) { return T(v)->closeRecv(c); }                 \
  static ncclResult_t closel_v##v(void *c) { return T(v)->closeListen(c); }
SAME_FNS(8)
SAME_FNS(9)
SAME_FNS(10)
SAME_FNS(11)
SAME_FNS(12)

/* listen/connect: v8-v10 without context; v10 adds a config; v11+ a context. */
static ncclResult_t listen_v8(int d, void *h, void **lc) { return T(8)->listen(d, h, lc); }
static ncclResult_t listen_v9(int d, void *h, void **lc) { return T(9)->listen(d, h, lc); }
static ncclResult_t listen_v10(int d, void *h, void **lc) { return T(10)->listen(d, h, lc); }
static ncclResult_t listen_v11(int d, void *h, void **lc) { return T(11)->listen(ctx, d, h, lc); }
static ncclResult_t listen_v12(int d, void *h, void **lc) { return T(12)->listen(ctx, d, h, lc); }
static ps_nccl_dev_handle_t *no_dev;
static ncclResult_t connect_v8(int d, void *h, void **sc) { return T(8)->connect(d, h, sc, &no_dev); }
static ncclResult_t connect_v9(int d, void *h, void **sc) { return T(9)->connect(d, h, sc, &no_dev); }
static ncclResult_t connect_v10(int d, void *h, void **sc) {
  ps_comm_config_t cfg = {.trafficClass = -1};
  return T(10)->connect(d, &cfg, h, sc, &no_dev);
}
static ncclResult_t connect_v11(int d, void *h, void **sc) { return T(11)->connect(ctx, d, h, sc, &no_dev); }
static ncclResult_t connect_v12(int d, void *h, void **sc) { return T(12)->connect(ctx, d, h, sc, &no_dev); }

/* isend/irecv: v8 int sizes; v9 size_t; v10+ add profiler handles. */
static ncclResult_t isend_v8(void *sc, void *d, size_t s, int tag, void *mh, void **r) {
  if (s > INT_MAX) { /* v8 sizes are ints: what the plugin cannot be asked */
    if (r) *r = NULL;
    return ncclInvalidArgument;
  }
  return T(8)->isend(sc, d, (int)s, tag, mh, r);
}
static ncclResult_t isend_v9(void *sc, void *d, size_t s, int tag, void *mh, void **r) {
  return T(9)->isend(sc, d, s, tag, mh, r);
}
#define ISEND_PH(v)                                                                        \
  static ncclResult_t isend_v##v(void *sc, void *d, size_t s, int tag, void *mh, void **r) { \
    return T(v)->isend(sc, d, s, tag, mh, NULL, r);                                        \
  }                                                                                        \
  static ncclResult_t irecv_v##v(void *rc, int n, void **d, size_t *s, int *t, void **m, void **r) { \
    void *ph[8] = {0};                                                                     \
    return T(v)->irecv(rc, n, d, s, t, m, ph, r);                                          \
  }
ISEND_PH(10)
ISEND_PH(11)
ISEND_PH(12)
static ncclResult_t irecv_v8(void *rc, int n, void **d, size_t *s, int *t, void **m, void **r) {
  int si[8];
  for (int i = 0; i < n && i < 8; i++) {
    if (s[i] > INT_MAX) { /* as isend_v8 */
      if (r) *r = NULL;
      return ncclInvalidArgument;
    }
    si[i] = (int)s[i];
  }
  return T(8)->irecv(rc, n, d, si, t, m, r);
}
static ncclResult_t irecv_v9(void *rc, int n, void **d, size_t *s, int *t, void **m, void **r) {
  return T(9)->irecv(rc, n, d, s, t, m, r);
}

static ncclResult_t fin_none(void) { return ncclSuccess; }
static ncclResult_t fin_v11(void) { return T(11)->finalize(ctx); }
static ncclResult_t fin_v12(void) { return T(12)->finalize(ctx); }

#define FILL(v, fin)                                                                      \
  do {                                                                                    \
    out->name = T(v)->name, out->devices = devices_v##v, out->get_props = props_v##v;     \
    out->listen = listen_v##v, out->connect = connect_v##v, out->accept = accept_v##v;    \
    out->reg_mr = regmr_v##v, out->dereg_mr = deregmr_v##v, out->isend = isend_v##v;      \
    out->reg_mr_dmabuf = regmrdb_v##v;                                                    \
    out->irecv = irecv_v##v, out->test = test_v##v, out->close_send = closes_v##v;        \
    out->close_recv = closer_v##v, out->close_listen = closel_v##v, out->finalize = fin;  \
  } while (0)

/* PERSEUS_PLUGIN_PATH (set and not empty: dlopen("") would name the
 * program itself); else the plugin of the build tree this program runs
 * from (<build>/{test,bench}/prog -> <build>/plugin/); else the loader's
 * search by name, as NCCL does for an installed plugin. */
const char *drv_default_plugin(void) {
  const char *p = getenv("PERSEUS_PLUGIN_PATH");
  if (p && *p) return p;
  static char path[4200];
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash) {
      *slash = '\0';
      snprintf(path, sizeof path, "%s/../plugin/libnccl-net-perseus.so", exe);
      if (access(path, R_OK) == 0) return path;
    }
  }
  return "libnccl-net-perseus.so";
}

void *drv_open_plugin(const char *path, const char **used) {
  if (!path) path = drv_default_plugin();
  if (used) *used = path;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) fprintf(stderr, "dlopen(%s): %s\n", path, dlerror());
  return lib;
}

int drv_load(const char *path, int version, drv_net_t *out) {
  void *lib = drv_open_plugin(path, &path);
  if (!lib) return -1;
  char sym[32];
  snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", version);
  tbl = dlsym(lib, sym);
  if (!tbl) {
    fprintf(stderr, "%s does not export %s\n", path, sym);
    return -1;
  }
  memset(out, 0, sizeof *out);
  out->version = version;
  ncclResult_t rc;
  switch (version) {
    case 8: FILL(8, fin_none); rc = T(8)->init(drv_logger); break;
    case 9: FILL(9, fin_none); rc = T(9)->init(drv_logger); break;
    case 10: FILL(10, fin_none); rc = T(10)->init(drv_logger, NULL); break;
    case 11: FILL(11, fin_v11); rc = T(11)->init(&ctx, 0x1234, NULL, drv_logger, NULL); break;
    case 12: FILL(12, fin_v12); rc = T(12)->init(&ctx, 0x1234, NULL, drv_logger, NULL); break;
    default: fprintf(stderr, "no ABI version %d\n", version); return -1;
  }
  if (rc != ncclSuccess) {
    fprintf(stderr, "%s init failed: %d\n", sym, rc);
    return -1;
  }
  return 0;
}
