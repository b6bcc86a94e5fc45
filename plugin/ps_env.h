/* Typed PERSEUS_* configuration. Every variable has a default; a value that
 * does not parse is an error naming the variable and what was expected. */
#ifndef PS_ENV_H
#define PS_ENV_H

#include <stdint.h>

#include "ps_nccl_abi.h"

/* Integer in [lo, hi]; unset or empty gives *out = def. */
ncclResult_t ps_env_int(const char *name, int64_t def, int64_t lo, int64_t hi, int64_t *out);
/* Boolean: 0/1, true/false, yes/no, on/off. */
ncclResult_t ps_env_bool(const char *name, int def, int *out);
/* One of a NULL-terminated list of names (case-insensitive); *out is the index. */
ncclResult_t ps_env_enum(const char *name, const char *const *choices, int def, int *out);
/* String (NULL when unset or empty). */
const char *ps_env_str(const char *name);

/* Whether interface (domain) `name` passes `rule`, written as NCCL users
 * write NCCL_SOCKET_IFNAME: a comma list of name prefixes; a leading '^'
 * makes it a list to exclude, and a '=' after it (or leading) asks for
 * exact names instead of prefixes ("eth", "=eth0", "^docker,lo", "^=lo").
 * Empty items match nothing. */
int ps_iface_match(const char *rule, const char *name);

/* The values the plugin uses, parsed once. */
typedef struct {
  const char *provider;  /* PERSEUS_PROVIDER, else FI_PROVIDER; NULL = automatic */
  const char *iface;     /* PERSEUS_IFACE (ps_iface_match rule); NULL = automatic */
  int iface_from_nccl;   /* iface is NCCL_SOCKET_IFNAME's (PERSEUS_IFACE unset) */
  int64_t net_requests;  /* PERSEUS_NET_REQUESTS: request pool per comm */
  int64_t max_recvs;     /* PERSEUS_MAX_RECVS: grouped receives */
  int64_t keepalive_ms;  /* PERSEUS_KEEPALIVE_MS: idle time before probing a peer */
  int64_t peer_timeout_ms; /* PERSEUS_PEER_TIMEOUT_MS: unanswered probe => peer dead */
  int64_t nstreams;        /* PERSEUS_NSTREAMS: endpoints (and threads) per two-sided comm; -1 unset */
  int64_t stripe_min;      /* PERSEUS_STRIPE_MIN: smallest message split across them */
  int64_t eagain_retries;  /* PERSEUS_EAGAIN_RETRIES: progress+retry before backpressure */
  int tcp_passthru;        /* PERSEUS_TCP_PASSTHRU: rxm hands tagged calls straight to tcp */
  int stats;               /* PERSEUS_STATS: one-sided per-peer statistics at close */
  int progress_thread;     /* PERSEUS_PROGRESS_THREAD: 0 off, 1 on, 2 auto (ps_rma_thread.c) */
  int staging;             /* PERSEUS_STAGING: PS_STAGING_AUTO, _ALWAYS or _NEVER */
  int64_t staging_bytes;   /* PERSEUS_STAGING_BYTES: pinned memory per comm for GPU windows */
  int64_t staging_chunk;   /* PERSEUS_STAGING_CHUNK: bytes a staged write carries at most, a
                            * multiple of PS_STAGING_CHUNK_ALIGN */
  int64_t staging_coalesce_us; /* PERSEUS_STAGING_COALESCE_US: how long a slot copying out of
                                * the GPU takes more chunks */
  int64_t progress_interval_us; /* PERSEUS_PROGRESS_INTERVAL_US: least time between two
                                 * one-sided progress passes */
  int64_t rma_inflight;    /* PERSEUS_RMA_INFLIGHT: posted one-sided ops per peer, 0 = no bound,
                            * -1 = unset (the provider's default, ps_fabric) */
  int64_t proxy_queue;     /* PERSEUS_PROXY_QUEUE: entries per peer of NCCL's GIN/RMA proxy
                            * queue (a power of two), told as maxRecvs * 32 */
} ps_config_t;

/* PERSEUS_STAGING: GPU windows through pinned host memory (always), registered
 * with the provider (never: FI_HMEM required), or direct where it can (auto). */
enum { PS_STAGING_AUTO = 0, PS_STAGING_ALWAYS = 1, PS_STAGING_NEVER = 2 };

/* PERSEUS_STAGING_CHUNK is a multiple of this: the padding of a staged
 * record's payload (ps_stage_padded, ps_wire.h), so that a full chunk fills
 * a receive slot exactly. */
#define PS_STAGING_CHUNK_ALIGN 64

ncclResult_t ps_config_load(ps_config_t *cfg);

#endif
