/* Bytes that cross process boundaries: the listen handle NCCL exchanges and
 * the control messages of the connection handshake. Decoders treat their
 * input as untrusted and validate every field. */
#ifndef PS_WIRE_H
#define PS_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "ps_nccl_abi.h"

#define PS_WIRE_MAGIC 0x50535553u /* "PSUS" */
#define PS_WIRE_VERSION 9
#define PS_HANDLE_ADDR_MAX 96
#define PS_CTRL_ADDR_MAX 224
#define PS_MAX_STREAMS 8       /* endpoints of one comm (PERSEUS_NSTREAMS) */
#define PS_STREAM_ADDR_MAX 64  /* a provider with longer addresses does not stripe */

/* Tags: NCCL's tag in the low 32 bits; bit 63 marks our control traffic. */
#define PS_TAG_CTRL (1ULL << 63)
#define PS_TAG_CONNECT (PS_TAG_CTRL | 1)
#define PS_TAG_ACCEPT (PS_TAG_CTRL | 2)
#define PS_TAG_PROBE (PS_TAG_CTRL | 3)
/* Part `part` (1..) of striped message `seq` (ps_stripe.h), on its stream. */
#define PS_TAG_STRIPE(seq, part) ((1ULL << 62) | ((uint64_t)(seq) << 8) | (uint64_t)(part))
/* On a striped comm every message on the comm's own endpoint carries remote
 * CQ data: PS_STRIPE_VALID, its total size, and for the first part of a
 * striped message PS_STRIPE_FIRST and the message's stripe number. */
#define PS_STRIPE_VALID (1ULL << 63)
#define PS_STRIPE_FIRST (1ULL << 62)
#define PS_STRIPE_SIZE_BITS 40
#define PS_STRIPE_SEQ_MASK 0x3fffffu

/* A wire hash (in handles and handshake messages) hashes the provider and
 * wire format, its low bits replaced by the sender's PERSEUS_ORDERING
 * setting: its index in ps_ordering_names (0: auto, or unset), or
 * PS_WIRE_ORDERING_INVALID for a value that names no strategy. Ranks whose
 * settings differ refuse each other's handles, naming both: one strategy's
 * signal means something else to another (a `target` origin's signal waits
 * for write counts an `ordered` target never keeps). */
#define PS_WIRE_ORDERING_MASK 0x7u
#define PS_WIRE_ORDERING_INVALID 0x7u

typedef struct {
  uint32_t magic;
  uint16_t version;
  uint16_t addrlen;
  uint32_t wire_hash; /* provider + wire format + PERSEUS_ORDERING of the listener */
  uint32_t dev;
  uint64_t listen_id;
  uint8_t addr[PS_HANDLE_ADDR_MAX];
} ps_handle_t;
_Static_assert(sizeof(ps_handle_t) <= NCCL_NET_HANDLE_MAXSIZE, "handle exceeds NCCL's 128 bytes");

enum { PS_CTRL_CONNECT = 1, PS_CTRL_ACCEPT = 2 };

typedef struct {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t wire_hash;
  uint32_t addrlen;
  uint64_t listen_id; /* CONNECT: the listener addressed; ACCEPT: echoed */
  uint64_t conn_id;   /* the connecting side's nonce; echoed in ACCEPT */
  uint8_t addr[PS_CTRL_ADDR_MAX];
  uint16_t watch_port; /* the sender's link-watch listener (ps_watch.h), 0 = none */
  uint16_t pad[3];
  /* the sender's extra endpoints (ps_stripe.h): CONNECT offers, ACCEPT takes
   * at most as many */
  uint8_t nstreams, stream_addrlen;
  uint8_t pad8[6];
  uint8_t stream_addr[PS_MAX_STREAMS - 1][PS_STREAM_ADDR_MAX];
} ps_ctrl_msg_t;
/* The conn_id of an ACCEPT that refuses a CONNECT its listener took but
 * could not accept (ps_conn.c); a wrong listen id's refusal echoes conn_id
 * under the listener's own id instead. */
#define PS_CONN_DROPPED(conn_id) (~(uint64_t)(conn_id))

ncclResult_t ps_handle_encode(ps_handle_t *h, uint32_t wire_hash, uint32_t dev, uint64_t listen_id,
                              const void *addr, size_t addrlen);
/* Validates a handle from a peer; never reads past `len` bytes. */
ncclResult_t ps_handle_decode(const void *buf, size_t len, uint32_t wire_hash, ps_handle_t *out);

ncclResult_t ps_ctrl_encode(ps_ctrl_msg_t *m, uint16_t type, uint32_t wire_hash, uint64_t listen_id,
                            uint64_t conn_id, const void *addr, size_t addrlen, uint16_t watch_port);
/* Validates a received control message of `len` bytes expecting `type`. */
ncclResult_t ps_ctrl_decode(const void *buf, size_t len, uint16_t type, uint32_t wire_hash,
                            ps_ctrl_msg_t *out);

/* One-sided engine: a signal to apply at the target (or, with op
 * PS_SIG_OP_CREDIT, staging slots handed back to the origin), one rank's part
 * of a symmetric registration (allgathered), and the header of a staged
 * write (in front of the payload in a staging slot). */
#define PS_SIG_OP_CREDIT 0x100 /* value: every staged write with sequence < value was consumed */
#define PS_SIG_OP_CLOSED 0x101 /* region_id: the sender deregistered its part of that window */

/* A target's refusal (PS_TAG_RMA_NACK in ps_rma_int.h) is a signal message
 * sent back, src_rank naming the target and `covers` why: */
enum {
  PS_NACK_DEREGISTERED = 1, /* a signal into a window it deregistered */
  PS_NACK_MISALIGNED = 2,   /* a signal into a word it registered misaligned */
  /* a staged put into a GPU window it deregistered, its bytes dropped:
   * region_id and offset name its first chunk dropped, value that chunk's
   * bytes (op is ADD, unused) */
  PS_NACK_PUT_DEREGISTERED = 3,
};

typedef struct {
  uint32_t magic;
  uint16_t version;
  uint16_t op; /* NCCL_NET_SIGNAL_OP_INC or _ADD, PS_SIG_OP_CREDIT or PS_SIG_OP_CLOSED */
  uint32_t src_rank;
  uint32_t region_id;
  uint64_t offset;
  uint64_t value;
  /* target strategy: apply only once this many of src_rank's writes have
   * arrived (counted from their remote CQ data); 0 = apply on receipt */
  uint64_t covers;
  /* staging: apply only after the copies of src_rank's first covers_staged
   * staged writes into GPU memory */
  uint64_t covers_staged;
} ps_sig_msg_t;

#define PS_REG_STAGED 1 /* ps_reg_msg_t.flags: the region is GPU memory reached by staging */

typedef struct {
  uint32_t magic;
  uint16_t version;
  uint16_t flags; /* PS_REG_* */
  uint32_t rank;
  uint32_t region_id;
  uint64_t addr; /* target address of the region (0 when the provider wants offsets) */
  uint64_t size;
  uint64_t key;
} ps_reg_msg_t;

/* Remote CQ data of a staged write: this bit, the source rank in bits
 * 62..32 and the receive slot in the low 32 (a plain write under the target
 * strategy carries rank << 32 | seq32). */
#define PS_STAGED_DATA (1ULL << 63)

/* A one-sided rank's staging streams (PERSEUS_NSTREAMS - 1 extra endpoints
 * for staged writes), sent to every peer once, when staging is set up:
 * every rank uses the fewest any rank offers. */
typedef struct {
  uint32_t magic;
  uint16_t version;
  uint8_t nstreams, addrlen;
  uint32_t rank;
  uint32_t chunk; /* its staging chunk in bytes, as sized: every rank's must match, since a
                   * receive slot holds one full chunk's record */
  uint8_t addr[PS_MAX_STREAMS - 1][PS_STREAM_ADDR_MAX];
} ps_streams_msg_t;

/* A staged write is one or more records, each this header and its payload.
 * The first header is at byte 0; the payloads follow it back to back, each
 * padded to 64 bytes, so that chunks adjacent in a GPU window copy in and
 * out as one; the headers of records 2.. come after the payloads, from byte
 * `hdrs_off` of the first header, one after another. A
 * record with sig_op set is a signal instead (no payload): an add to the
 * 8-byte word at region_id/offset, applied once the writes it covers (every
 * staged write up to this one; under the target strategy also `seq` writes)
 * are in. */
typedef struct {
  uint32_t magic;
  uint16_t version;
  uint16_t more;      /* 1: another record follows this one */
  uint32_t src_rank;
  uint32_t region_id; /* destination window (signal: the signal's region) */
  uint64_t offset;    /* in it */
  uint64_t len;       /* payload bytes after the header (signal: 0) */
  uint64_t seq;       /* the origin's put sequence of this chunk (signal: the writes it covers) */
  uint64_t stage_seq; /* the origin's staged-write sequence towards us, from 1 (same for every record) */
  uint64_t sig_value; /* signal: the operand of NCCL_NET_SIGNAL_OP_ADD */
  uint16_t sig_op;    /* 0: a chunk; NCCL_NET_SIGNAL_OP_INC or _ADD: a signal */
  uint16_t pad16;
  uint32_t hdrs_off;  /* first record: where the second record's header is */
} ps_stage_hdr_t;
_Static_assert(sizeof(ps_stage_hdr_t) == 64, "staged write header is one cache line");

/* All check magic/version and rank < nranks; the signal's op must be INC,
 * ADD or CREDIT. Offsets are checked later against the region they name. */
ncclResult_t ps_sig_decode(const void *buf, size_t len, uint32_t nranks, ps_sig_msg_t *out);
ncclResult_t ps_reg_decode(const void *buf, size_t len, uint32_t nranks, uint32_t region_id,
                           ps_reg_msg_t *out);
/* Also: at most PS_MAX_STREAMS - 1 streams, addresses of 1..PS_STREAM_ADDR_MAX
 * bytes where there are any. */
ncclResult_t ps_streams_decode(const void *buf, size_t len, uint32_t nranks, ps_streams_msg_t *out);
/* The bytes a staged record's payload takes in its slot: the next payload
 * starts 64-byte aligned. Sender and target must agree. */
static inline uint64_t ps_stage_padded(uint64_t len) { return (len + 63) & ~(uint64_t)63; }
/* A staged header must also name `src_rank` (whom the slot belongs to),
 * carry at most `max_len` payload bytes, say 0 or 1 in `more`, and be a
 * chunk or a signal (INC or ADD, no payload). */
ncclResult_t ps_stage_decode(const void *buf, size_t len, uint32_t src_rank, uint64_t max_len,
                             ps_stage_hdr_t *out);
/* The records of a staged write from `src_rank` in a receive slot of
 * `slot_bytes` (at least two headers): at most `max` headers decoded into
 * hdrs[], each record's payload at byte doffs[] of the slot. Every header
 * lies in the slot and names the first one's staged write; the payloads lie
 * back to back from byte 64, before the other headers. Returns how many
 * records (>= 1), or 0 for a malformed write (logged). */
uint32_t ps_stage_layout(const void *slot, size_t slot_bytes, uint32_t src_rank, uint32_t max,
                         ps_stage_hdr_t *hdrs, size_t *doffs);

#endif
