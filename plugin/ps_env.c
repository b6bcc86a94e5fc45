#include "ps_env.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ps_log.h"
#include "ps_wire.h"

const char *ps_env_str(const char *name) {
  const char *v = getenv(name);
  return (v && *v) ? v : NULL;
}

/* Plain decimal only: an optional '-', then digits, no leading zero. strtoll
 * alone would take "010" as octal 8, "0x10" as 16, " 8" and "+8" as 8. */
static int plain_decimal(const char *v) {
  const char *d = v + (*v == '-');
  if (*d < '0' || *d > '9' || (d[0] == '0' && d[1])) return 0;
  for (; *d; d++)
    if (*d < '0' || *d > '9') return 0;
  return 1;
}

ncclResult_t ps_env_int(const char *name, int64_t def, int64_t lo, int64_t hi, int64_t *out) {
  const char *v = ps_env_str(name);
  if (!v) {
    *out = def;
    return ncclSuccess;
  }
  char *end = NULL;
  errno = 0;
  long long x = plain_decimal(v) ? strtoll(v, &end, 10) : 0;
  if (!end || errno || *end != '\0' || x < lo || x > hi || (x == 0 && *v == '-')) {
    char dflt[48] = "the provider's"; /* a default below lo stands for "unset" */
    if (def >= lo) snprintf(dflt, sizeof dflt, "%lld", (long long)def);
    PS_WARN("%s='%s' is invalid: expected a decimal integer in [%lld, %lld] (default %s)", name,
            v, (long long)lo, (long long)hi, dflt);
    return ncclInvalidArgument;
  }
  *out = x;
  return ncclSuccess;
}

ncclResult_t ps_env_bool(const char *name, int def, int *out) {
  static const char *const yes[] = {"1", "true", "yes", "on", NULL};
  static const char *const no[] = {"0", "false", "no", "off", NULL};
  const char *v = ps_env_str(name);
  *out = def;
  if (!v) return ncclSuccess;
  for (int i = 0; yes[i]; i++)
    if (!strcasecmp(v, yes[i])) return (*out = 1), ncclSuccess;
  for (int i = 0; no[i]; i++)
    if (!strcasecmp(v, no[i])) return (*out = 0), ncclSuccess;
  PS_WARN("%s='%s' is invalid: expected 0/1, true/false, yes/no or on/off", name, v);
  return ncclInvalidArgument;
}

ncclResult_t ps_env_enum(const char *name, const char *const *choices, int def, int *out) {
  const char *v = ps_env_str(name);
  *out = def;
  if (!v) return ncclSuccess;
  char list[256] = "";
  for (int i = 0; choices[i]; i++) {
    if (!strcasecmp(v, choices[i])) return (*out = i), ncclSuccess;
    strncat(list, i ? "|" : "", sizeof list - strlen(list) - 1);
    strncat(list, choices[i], sizeof list - strlen(list) - 1);
  }
  PS_WARN("%s='%s' is invalid: expected one of %s", name, v, list);
  return ncclInvalidArgument;
}

int ps_iface_match(const char *rule, const char *name) {
  int exclude = 0, exact = 0;
  if (*rule == '^') exclude = 1, rule++;
  if (*rule == '=') exact = 1, rule++;
  int hit = 0;
  size_t n = strlen(name);
  for (const char *p = rule; *p && !hit;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    hit = len > 0 && (exact ? len == n && !strncmp(p, name, n) : len <= n && !strncmp(p, name, len));
    p = e ? e + 1 : p + len;
  }
  return exclude ? !hit : hit;
}

/* An interface rule names at least one interface after its '^' and '='
 * prefixes, each given once: "^" alone would exclude nothing, and "^^lo"
 * would exclude an interface named "^lo". NULL when it does, else why not. */
static const char *iface_rule_flaw(const char *rule) {
  if (*rule == '^') rule++;
  if (*rule == '=') rule++;
  if (*rule == '^' || *rule == '=') return "a '^' or '=' given twice (the prefixes are '^', then '=')";
  for (const char *p = rule; *p; p++)
    if (*p != ',') return NULL;
  return "no interface name after the '^' and '=' prefixes";
}

ncclResult_t ps_config_load(ps_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->provider = ps_env_str("PERSEUS_PROVIDER");
  if (!cfg->provider) cfg->provider = ps_env_str("FI_PROVIDER");
  cfg->iface = ps_env_str("PERSEUS_IFACE");
  if (!cfg->iface) cfg->iface_from_nccl = !!(cfg->iface = ps_env_str("NCCL_SOCKET_IFNAME"));
  const char *flaw = cfg->iface ? iface_rule_flaw(cfg->iface) : NULL;
  if (flaw && !cfg->iface_from_nccl) {
    PS_WARN("PERSEUS_IFACE='%s': %s; expected a list of interface name prefixes, '=' before it "
            "for exact names, '^' to exclude them", cfg->iface, flaw);
    return ncclInvalidUsage;
  }
  if (flaw) { /* NCCL's own variable: NCCL decides what it means to NCCL */
    PS_INFO(NCCL_INIT | NCCL_NET, "NCCL_SOCKET_IFNAME='%s' ignored (%s): perseus uses its default "
            "interfaces", cfg->iface, flaw);
    cfg->iface = NULL, cfg->iface_from_nccl = 0;
  }
  PS_CHECK(ps_env_int("PERSEUS_NET_REQUESTS", 64, 1, 4096, &cfg->net_requests));
  PS_CHECK(ps_env_int("PERSEUS_MAX_RECVS", 8, 1, 8, &cfg->max_recvs));
  PS_CHECK(ps_env_int("PERSEUS_KEEPALIVE_MS", 1000, 10, 3600000, &cfg->keepalive_ms));
  PS_CHECK(ps_env_int("PERSEUS_PEER_TIMEOUT_MS", 5000, 10, 3600000, &cfg->peer_timeout_ms));
  PS_CHECK(ps_env_int("PERSEUS_EAGAIN_RETRIES", 64, 0, 1000000, &cfg->eagain_retries));
  /* unset: -1, the provider's default (ps_stripe_default) */
  PS_CHECK(ps_env_int("PERSEUS_NSTREAMS", -1, 1, PS_MAX_STREAMS, &cfg->nstreams));
  PS_CHECK(ps_env_int("PERSEUS_STRIPE_MIN", 128 << 10, 1024, 1LL << 30, &cfg->stripe_min));
  PS_CHECK(ps_env_bool("PERSEUS_TCP_PASSTHRU", 1, &cfg->tcp_passthru));
  PS_CHECK(ps_env_bool("PERSEUS_STATS", 0, &cfg->stats));
  PS_CHECK(ps_env_int("PERSEUS_STAGING_BYTES", 64 << 20, 64 << 10, 1LL << 36, &cfg->staging_bytes));
  PS_CHECK(ps_env_int("PERSEUS_STAGING_CHUNK", 512 << 10, 4096, 64 << 20, &cfg->staging_chunk));
  if (cfg->staging_chunk % PS_STAGING_CHUNK_ALIGN) {
    PS_WARN("PERSEUS_STAGING_CHUNK='%lld' is invalid: expected a multiple of %d from 4096 to "
            "67108864 (a staged write pads each chunk's payload to a multiple of %d bytes)",
            (long long)cfg->staging_chunk, PS_STAGING_CHUNK_ALIGN, PS_STAGING_CHUNK_ALIGN);
    return ncclInvalidArgument;
  }
  PS_CHECK(ps_env_int("PERSEUS_STAGING_COALESCE_US", 20, 0, 10000, &cfg->staging_coalesce_us));
  PS_CHECK(ps_env_int("PERSEUS_PROGRESS_INTERVAL_US", 4, 0, 1000, &cfg->progress_interval_us));
  static const char *const thread_choices[] = {"0", "1", "auto", NULL};
  PS_CHECK(ps_env_enum("PERSEUS_PROGRESS_THREAD", thread_choices, 2, &cfg->progress_thread));
  static const char *const staging_choices[] = {"auto", "always", "never", NULL};
  PS_CHECK(ps_env_enum("PERSEUS_STAGING", staging_choices, PS_STAGING_AUTO, &cfg->staging));
  PS_CHECK(ps_env_int("PERSEUS_RMA_INFLIGHT", -1, 0, 65536, &cfg->rma_inflight));
  PS_CHECK(ps_env_int("PERSEUS_PROXY_QUEUE", 1024, 32, 16384, &cfg->proxy_queue));
  if (cfg->proxy_queue & (cfg->proxy_queue - 1)) {
    PS_WARN("PERSEUS_PROXY_QUEUE='%lld' is invalid: expected a power of two from 32 to 16384 (NCCL "
            "indexes its proxy queue with a mask)", (long long)cfg->proxy_queue);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}
