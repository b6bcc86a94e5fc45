/* Logging through the logger NCCL hands to init(); stderr (honouring
 * NCCL_DEBUG) when the plugin is driven without one. */
#ifndef PS_LOG_H
#define PS_LOG_H

#include "ps_nccl_abi.h"

void ps_log_set(ncclDebugLogger_t fn);
void ps_log(ncclDebugLogLevel lvl, unsigned long flags, const char *file, int line,
            const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#define PS_WARN(...) ps_log(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, "NET/Perseus: " __VA_ARGS__)
#define PS_INFO(flags, ...) ps_log(NCCL_LOG_INFO, (flags), __FILE__, __LINE__, "NET/Perseus: " __VA_ARGS__)
#define PS_TRACE(...) ps_log(NCCL_LOG_TRACE, NCCL_NET, __FILE__, __LINE__, "NET/Perseus: " __VA_ARGS__)

/* The first failure any of several threads reports (a helper thread's, for
 * the thread that owns the comm to act on): later ones are dropped, and the
 * message is readable once set. Zeroed: none yet. */
typedef struct {
  int claimed, set; /* atomic */
  char msg[600];
} ps_first_error_t;
void ps_first_error(ps_first_error_t *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Its message, or NULL while none was reported. */
const char *ps_first_error_get(ps_first_error_t *e);

/* Evaluate a call returning ncclResult_t; propagate failure. */
#define PS_CHECK(call)                                   \
  do {                                                   \
    ncclResult_t ps_rc_ = (call);                        \
    if (ps_rc_ != ncclSuccess) return ps_rc_;            \
  } while (0)

#endif
