#include "ps_wire.h"

#include <string.h>

#include "ps_log.h"
#include "ps_rma.h"

/* Here rather than with the strategies (ps_rma_order.c): a wire hash carries
 * the setting's index, and a refused handle names both settings, in the
 * parsers that tests link without the engine. */
const char *const ps_ordering_names[] = {"auto", "ordered", "fence", "target",
                                         "deferred", "drain", NULL};
_Static_assert(PS_ORD_DRAIN < PS_WIRE_ORDERING_INVALID,
               "a wire hash's ordering bits hold every strategy and the invalid mark");

/* The PERSEUS_ORDERING setting a wire hash's low bits carry, or NULL where
 * they carry none. */
static const char *setting_name(uint32_t bits) {
  if (bits == PS_WIRE_ORDERING_INVALID) return "a value that names no strategy";
  if (bits == PS_ORD_AUTO) return "auto (or unset)";
  return bits <= PS_ORD_DRAIN ? ps_ordering_names[bits] : NULL;
}

ncclResult_t ps_handle_encode(ps_handle_t *h, uint32_t wire_hash, uint32_t dev, uint64_t listen_id,
                              const void *addr, size_t addrlen) {
  if (addrlen == 0 || addrlen > PS_HANDLE_ADDR_MAX) {
    PS_WARN("endpoint address of %zu bytes does not fit the %d bytes of a handle", addrlen,
            PS_HANDLE_ADDR_MAX);
    return ncclInternalError;
  }
  memset(h, 0, sizeof *h);
  h->magic = PS_WIRE_MAGIC;
  h->version = PS_WIRE_VERSION;
  h->addrlen = (uint16_t)addrlen;
  h->wire_hash = wire_hash;
  h->dev = dev;
  h->listen_id = listen_id;
  memcpy(h->addr, addr, addrlen);
  return ncclSuccess;
}

/* Every message from a peer: exactly its size, copied out before it is read. */
static ncclResult_t take_exact(const char *what, const void *buf, size_t len, void *out,
                               size_t size) {
  if (!buf || len != size) {
    PS_WARN("%s rejected: %zu bytes, expected %zu", what, buf ? len : 0, size);
    return ncclInvalidArgument;
  }
  memcpy(out, buf, size);
  return ncclSuccess;
}

static ncclResult_t check_ident(const char *what, uint32_t magic, uint16_t version) {
  if (magic != PS_WIRE_MAGIC) {
    PS_WARN("%s rejected: bad magic 0x%08x (expected 0x%08x): not a perseus peer", what, magic,
            PS_WIRE_MAGIC);
    return ncclInvalidArgument;
  }
  if (version != PS_WIRE_VERSION) {
    PS_WARN("%s rejected: wire version %u, this plugin speaks %d", what, version, PS_WIRE_VERSION);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

/* The peer's wire hash against ours: where only the ordering bits differ,
 * the refusal names both PERSEUS_ORDERING settings. */
static ncclResult_t check_hash(const char *what, uint32_t hash, uint32_t want_hash) {
  if (hash == want_hash) return ncclSuccess;
  const char *theirs = setting_name(hash & PS_WIRE_ORDERING_MASK),
             *ours = setting_name(want_hash & PS_WIRE_ORDERING_MASK);
  if (!((hash ^ want_hash) & ~PS_WIRE_ORDERING_MASK) && theirs && ours)
    PS_WARN("%s rejected: the peer's PERSEUS_ORDERING is %s, this rank's is %s: every rank must "
            "set the same", what, theirs, ours);
  else
    PS_WARN("%s rejected: peer uses another provider (wire hash 0x%08x, ours 0x%08x)", what, hash,
            want_hash);
  return ncclInvalidArgument;
}

/* Handles and handshake messages also name the provider and an address. */
static ncclResult_t check_header(const char *what, uint32_t magic, uint16_t version, uint32_t hash,
                                 uint32_t want_hash, size_t addrlen, size_t addrmax) {
  PS_CHECK(check_ident(what, magic, version));
  PS_CHECK(check_hash(what, hash, want_hash));
  if (addrlen == 0 || addrlen > addrmax) {
    PS_WARN("%s rejected: address length %zu outside [1, %zu]", what, addrlen, addrmax);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t ps_handle_decode(const void *buf, size_t len, uint32_t wire_hash, ps_handle_t *out) {
  if (!buf || len < sizeof *out) {
    PS_WARN("handle rejected: %zu bytes, need %zu", buf ? len : 0, sizeof *out);
    return ncclInvalidArgument;
  }
  memcpy(out, buf, sizeof *out);
  return check_header("handle", out->magic, out->version, out->wire_hash, wire_hash, out->addrlen,
                      PS_HANDLE_ADDR_MAX);
}

ncclResult_t ps_ctrl_encode(ps_ctrl_msg_t *m, uint16_t type, uint32_t wire_hash, uint64_t listen_id,
                            uint64_t conn_id, const void *addr, size_t addrlen, uint16_t watch_port) {
  if (addrlen == 0 || addrlen > PS_CTRL_ADDR_MAX) {
    PS_WARN("endpoint address of %zu bytes exceeds %d", addrlen, PS_CTRL_ADDR_MAX);
    return ncclInternalError;
  }
  memset(m, 0, sizeof *m);
  m->magic = PS_WIRE_MAGIC;
  m->version = PS_WIRE_VERSION;
  m->type = type;
  m->wire_hash = wire_hash;
  m->addrlen = (uint32_t)addrlen;
  m->listen_id = listen_id;
  m->conn_id = conn_id;
  m->watch_port = watch_port;
  memcpy(m->addr, addr, addrlen);
  return ncclSuccess;
}

ncclResult_t ps_ctrl_decode(const void *buf, size_t len, uint16_t type, uint32_t wire_hash,
                            ps_ctrl_msg_t *out) {
  PS_CHECK(take_exact("control message", buf, len, out, sizeof *out));
  PS_CHECK(check_header("control message", out->magic, out->version, out->wire_hash, wire_hash,
                        out->addrlen, PS_CTRL_ADDR_MAX));
  if (out->type != type) {
    PS_WARN("control message rejected: type %u, expected %u", out->type, type);
    return ncclInvalidArgument;
  }
  if (out->nstreams > PS_MAX_STREAMS - 1 ||
      (out->nstreams && (!out->stream_addrlen || out->stream_addrlen > PS_STREAM_ADDR_MAX))) {
    PS_WARN("control message rejected: %u extra streams (at most %d) with %u-byte addresses "
            "(1..%d)", out->nstreams, PS_MAX_STREAMS - 1, out->stream_addrlen, PS_STREAM_ADDR_MAX);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t ps_sig_decode(const void *buf, size_t len, uint32_t nranks, ps_sig_msg_t *out) {
  PS_CHECK(take_exact("signal message", buf, len, out, sizeof *out));
  PS_CHECK(check_ident("signal message", out->magic, out->version));
  if (out->src_rank >= nranks ||
      (out->op != 1 && out->op != 2 && out->op != PS_SIG_OP_CREDIT && out->op != PS_SIG_OP_CLOSED)) {
    PS_WARN("signal message rejected: rank %u of %u, op %u (expected 1 INC, 2 ADD, 0x100 CREDIT "
            "or 0x101 CLOSED)",
            out->src_rank, nranks, out->op);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t ps_reg_decode(const void *buf, size_t len, uint32_t nranks, uint32_t region_id,
                           ps_reg_msg_t *out) {
  PS_CHECK(take_exact("registration message", buf, len, out, sizeof *out));
  PS_CHECK(check_ident("registration message", out->magic, out->version));
  if (out->rank >= nranks || out->region_id != region_id) {
    PS_WARN("registration message rejected: rank %u of %u, region %u (expected %u)", out->rank,
            nranks, out->region_id, region_id);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t ps_streams_decode(const void *buf, size_t len, uint32_t nranks, ps_streams_msg_t *out) {
  PS_CHECK(take_exact("staging streams message", buf, len, out, sizeof *out));
  PS_CHECK(check_ident("staging streams message", out->magic, out->version));
  if (out->rank >= nranks || out->nstreams > PS_MAX_STREAMS - 1 ||
      (out->nstreams && (!out->addrlen || out->addrlen > PS_STREAM_ADDR_MAX))) {
    PS_WARN("staging streams message rejected: rank %u of %u, %u streams (at most %d), addresses "
            "of %u bytes (1 to %d)", out->rank, nranks, out->nstreams, PS_MAX_STREAMS - 1,
            out->addrlen, PS_STREAM_ADDR_MAX);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t ps_stage_decode(const void *buf, size_t len, uint32_t src_rank, uint64_t max_len,
                             ps_stage_hdr_t *out) {
  PS_CHECK(take_exact("staged write header", buf, len, out, sizeof *out));
  PS_CHECK(check_ident("staged write header", out->magic, out->version));
  /* 1 INC, 2 ADD: NCCL_NET_SIGNAL_OP_*, as for signal messages */
  int sig_ok = !out->sig_op || ((out->sig_op == 1 || out->sig_op == 2) && !out->len);
  if (out->src_rank != src_rank || out->len > max_len || out->stage_seq == 0 || out->more > 1 ||
      !sig_ok) {
    PS_WARN("staged write header rejected: from rank %u in rank %u's slot, %llu bytes (at most "
            "%llu), staged sequence %llu, more %u, signal op %u", out->src_rank, src_rank,
            (unsigned long long)out->len, (unsigned long long)max_len,
            (unsigned long long)out->stage_seq, out->more, out->sig_op);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

uint32_t ps_stage_layout(const void *slot, size_t slot_bytes, uint32_t src_rank, uint32_t max,
                         ps_stage_hdr_t *hdrs, size_t *doffs) {
  const size_t H = sizeof *hdrs;
  const char *b = slot;
  if (!b || !hdrs || !doffs || !max || slot_bytes < 2 * H) return 0;
  if (ps_stage_decode(b, H, src_rank, slot_bytes - H, &hdrs[0]) != ncclSuccess) return 0;
  doffs[0] = H;
  size_t doff = H + ps_stage_padded(hdrs[0].len), hdrs_at = hdrs[0].hdrs_off;
  if (hdrs[0].more && (hdrs_at < doff || hdrs_at > slot_bytes)) {
    PS_WARN("staged write %llu from rank %u puts its headers at byte %zu, inside its first payload "
            "or past the slot (%zu B)", (unsigned long long)hdrs[0].stage_seq, src_rank, hdrs_at,
            slot_bytes);
    return 0;
  }
  uint32_t n = 1;
  for (; hdrs[n - 1].more; n++) {
    size_t hoff = hdrs_at + (n - 1) * H;
    if (n == max || hoff > slot_bytes - H || doff > hdrs_at) {
      PS_WARN("staged write %llu from rank %u: record %u %s", (unsigned long long)hdrs[0].stage_seq,
              src_rank, n, n == max ? "is one too many" : "lies outside the slot");
      return 0;
    }
    if (ps_stage_decode(b + hoff, H, src_rank, hdrs_at - doff, &hdrs[n]) != ncclSuccess) return 0;
    if (hdrs[n].stage_seq != hdrs[0].stage_seq) {
      PS_WARN("staged write %llu from rank %u holds a record of staged write %llu",
              (unsigned long long)hdrs[0].stage_seq, src_rank, (unsigned long long)hdrs[n].stage_seq);
      return 0;
    }
    doffs[n] = doff;
    doff += ps_stage_padded(hdrs[n].len);
  }
  return n;
}
