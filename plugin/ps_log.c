#include "ps_log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <unistd.h>

static _Atomic(ncclDebugLogger_t) ps_logger;

void ps_log_set(ncclDebugLogger_t fn) {
  if (fn) atomic_store(&ps_logger, fn);
}

/* Without NCCL's logger we mimic its NCCL_DEBUG levels: unset means WARN. */
static ncclDebugLogLevel stderr_level(void) {
  static int level = -1;
  if (level < 0) {
    const char *v = getenv("NCCL_DEBUG");
    level = NCCL_LOG_WARN;
    if (v && !strcasecmp(v, "VERSION")) level = NCCL_LOG_VERSION;
    else if (v && !strcasecmp(v, "INFO")) level = NCCL_LOG_INFO;
    else if (v && !strcasecmp(v, "TRACE")) level = NCCL_LOG_TRACE;
    else if (v && !strcasecmp(v, "NONE")) level = NCCL_LOG_NONE;
  }
  return (ncclDebugLogLevel)level;
}

void ps_log(ncclDebugLogLevel lvl, unsigned long flags, const char *file, int line,
            const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  ncclDebugLogger_t fn = atomic_load(&ps_logger);
  if (fn) {
    fn(lvl, flags, file, line, "%s", msg);
    return;
  }
  if (lvl > stderr_level() || lvl == NCCL_LOG_NONE) return;
  const char *tag = lvl == NCCL_LOG_WARN ? "WARN" : lvl == NCCL_LOG_TRACE ? "TRACE" : "INFO";
  fprintf(stderr, "[%d] perseus %s %s\n", (int)getpid(), tag, msg);
}

void ps_first_error(ps_first_error_t *e, const char *fmt, ...) {
  int no = 0;
  if (!__atomic_compare_exchange_n(&e->claimed, &no, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
  __atomic_store_n(&e->set, 1, __ATOMIC_RELEASE);
}

const char *ps_first_error_get(ps_first_error_t *e) {
  return __atomic_load_n(&e->set, __ATOMIC_ACQUIRE) ? e->msg : NULL;
}
