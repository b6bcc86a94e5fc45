/* Unit tests of the bytes that cross process boundaries (ps_wire.c): the
 * listen handle and the handshake control messages. Round trips, and every
 * path by which a decoder refuses its input. Buffers handed to the decoders
 * are heap blocks of exactly the stated length, so ASan sees any over-read.
 * Exit: 0 pass, 1 fail. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_wire.h"

#include "unit_check.h"

#define HASH 0x1badcafeu
#define OTHER_HASH 0x1badcaffu

/* A heap block of exactly n bytes: srclen bytes of src, zero padded. */
static void *exact(const void *src, size_t srclen, size_t n) {
  unsigned char *p = malloc(n ? n : 1);
  if (!p) abort();
  memset(p, 0, n);
  memcpy(p, src, srclen < n ? srclen : n);
  return p;
}

static void fill_addr(uint8_t *a, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) a[i] = (uint8_t)(seed * 31 + i * 7 + 1);
}

static ncclResult_t decode_handle_bytes(const void *src, size_t n, uint32_t hash, ps_handle_t *out) {
  void *b = exact(src, n < sizeof(ps_handle_t) ? n : sizeof(ps_handle_t), n);
  ncclResult_t rc = ps_handle_decode(b, n, hash, out);
  free(b);
  return rc;
}

static ncclResult_t decode_ctrl_bytes(const void *src, size_t n, uint16_t type, uint32_t hash,
                                      ps_ctrl_msg_t *out) {
  void *b = exact(src, n < sizeof(ps_ctrl_msg_t) ? n : sizeof(ps_ctrl_msg_t), n);
  ncclResult_t rc = ps_ctrl_decode(b, n, type, hash, out);
  free(b);
  return rc;
}

static void test_handle_roundtrip(void) {
  const size_t lens[] = {1, 2, 16, 28, 95, PS_HANDLE_ADDR_MAX};
  for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
    uint8_t addr[PS_HANDLE_ADDR_MAX];
    fill_addr(addr, lens[k], (unsigned)k);
    ps_handle_t h, out;
    memset(&h, 0xcc, sizeof h);
    EXPECT(ps_handle_encode(&h, HASH, 3, 0x0123456789abcdefULL, addr, lens[k]) == ncclSuccess,
           "encode addrlen %zu", lens[k]);
    /* Unused address bytes are zeroed: no stack garbage crosses the wire. */
    int clean = 1;
    for (size_t i = lens[k]; i < PS_HANDLE_ADDR_MAX; i++) clean &= h.addr[i] == 0;
    EXPECT(clean, "encode addrlen %zu left garbage past the address", lens[k]);
    /* As NCCL hands it over: a 128-byte handle. */
    unsigned char nccl[NCCL_NET_HANDLE_MAXSIZE] = {0};
    memcpy(nccl, &h, sizeof h);
    memset(&out, 0, sizeof out);
    EXPECT(decode_handle_bytes(nccl, sizeof nccl, HASH, &out) == ncclSuccess, "decode addrlen %zu",
           lens[k]);
    EXPECT(out.magic == PS_WIRE_MAGIC && out.version == PS_WIRE_VERSION && out.wire_hash == HASH &&
               out.dev == 3 && out.listen_id == 0x0123456789abcdefULL && out.addrlen == lens[k] &&
               !memcmp(out.addr, addr, lens[k]),
           "round trip of addrlen %zu changed the handle", lens[k]);
    /* Exactly sizeof(ps_handle_t) is enough. */
    EXPECT(decode_handle_bytes(&h, sizeof h, HASH, &out) == ncclSuccess,
           "decode of exactly %zu bytes", sizeof h);
  }
  ps_handle_t h;
  uint8_t addr[PS_HANDLE_ADDR_MAX + 1] = {1};
  EXPECT(ps_handle_encode(&h, HASH, 0, 1, addr, 0) != ncclSuccess, "encode accepted addrlen 0");
  EXPECT(ps_handle_encode(&h, HASH, 0, 1, addr, PS_HANDLE_ADDR_MAX + 1) != ncclSuccess,
         "encode accepted addrlen %d", PS_HANDLE_ADDR_MAX + 1);
}

static void test_handle_rejects(void) {
  uint8_t addr[16];
  fill_addr(addr, sizeof addr, 9);
  ps_handle_t good, h, out;
  ps_handle_encode(&good, HASH, 0, 42, addr, sizeof addr);
  ncclResult_t rc;

  EXPECT((rc = ps_handle_decode(NULL, sizeof good, HASH, &out)) == ncclInvalidArgument, "NULL: rc %d", rc);
  EXPECT((rc = ps_handle_decode(NULL, 0, HASH, &out)) == ncclInvalidArgument, "NULL, 0: rc %d", rc);
  const size_t shorts[] = {0, 1, 4, 8, 23, sizeof good / 2, sizeof good - 1};
  for (size_t i = 0; i < sizeof shorts / sizeof shorts[0]; i++)
    EXPECT((rc = decode_handle_bytes(&good, shorts[i], HASH, &out)) == ncclInvalidArgument,
           "short buffer of %zu bytes: rc %d", shorts[i], rc);

  h = good, h.magic = 0;
  EXPECT((rc = decode_handle_bytes(&h, sizeof h, HASH, &out)) == ncclInvalidArgument, "magic 0: rc %d", rc);
  h = good, h.magic = __builtin_bswap32(PS_WIRE_MAGIC);
  EXPECT((rc = decode_handle_bytes(&h, sizeof h, HASH, &out)) == ncclInvalidArgument,
         "byte-swapped magic: rc %d", rc);
  h = good, h.magic ^= 0x80000000u;
  EXPECT((rc = decode_handle_bytes(&h, sizeof h, HASH, &out)) == ncclInvalidArgument, "magic bit: rc %d", rc);
  const uint16_t versions[] = {0, PS_WIRE_VERSION + 1, 0x0100, 0xffff};
  for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
    h = good, h.version = versions[i];
    EXPECT((rc = decode_handle_bytes(&h, sizeof h, HASH, &out)) == ncclInvalidArgument,
           "version %u: rc %d", versions[i], rc);
  }
  EXPECT((rc = decode_handle_bytes(&good, sizeof good, OTHER_HASH, &out)) == ncclInvalidArgument,
         "other wire hash: rc %d", rc);
  h = good, h.wire_hash = 0;
  EXPECT((rc = decode_handle_bytes(&h, sizeof h, HASH, &out)) == ncclInvalidArgument, "hash 0: rc %d", rc);
  const uint16_t lens[] = {0, PS_HANDLE_ADDR_MAX + 1, 200, 0x8000, 0xffff};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    h = good, h.addrlen = lens[i];
    EXPECT((rc = decode_handle_bytes(&h, sizeof h, HASH, &out)) == ncclInvalidArgument,
           "addrlen %u: rc %d", lens[i], rc);
  }
  h = good, h.addrlen = PS_HANDLE_ADDR_MAX;
  EXPECT(decode_handle_bytes(&h, sizeof h, HASH, &out) == ncclSuccess, "addrlen at the limit refused");
  h = good, h.addrlen = 1;
  EXPECT(decode_handle_bytes(&h, sizeof h, HASH, &out) == ncclSuccess, "addrlen 1 refused");
  /* The original is still good: the decoder kept no state. */
  EXPECT(decode_handle_bytes(&good, sizeof good, HASH, &out) == ncclSuccess, "good handle refused");
}

static void test_ctrl_roundtrip(void) {
  const size_t lens[] = {1, 16, 28, 96, 200, PS_CTRL_ADDR_MAX};
  const uint16_t types[] = {PS_CTRL_CONNECT, PS_CTRL_ACCEPT};
  for (size_t t = 0; t < 2; t++)
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
      uint8_t addr[PS_CTRL_ADDR_MAX];
      fill_addr(addr, lens[k], (unsigned)(k + 10 * t));
      ps_ctrl_msg_t m, out;
      memset(&m, 0xcc, sizeof m);
      EXPECT(ps_ctrl_encode(&m, types[t], HASH, 77, 0xfeedfacecafebeefULL, addr, lens[k], 40000 + (uint16_t)k) == ncclSuccess,
             "encode type %u addrlen %zu", types[t], lens[k]);
      int clean = 1;
      for (size_t i = lens[k]; i < PS_CTRL_ADDR_MAX; i++) clean &= m.addr[i] == 0;
      EXPECT(clean, "ctrl encode left garbage past the address");
      memset(&out, 0, sizeof out);
      EXPECT(decode_ctrl_bytes(&m, sizeof m, types[t], HASH, &out) == ncclSuccess,
             "decode type %u addrlen %zu", types[t], lens[k]);
      EXPECT(out.magic == PS_WIRE_MAGIC && out.version == PS_WIRE_VERSION && out.type == types[t] &&
                 out.wire_hash == HASH && out.addrlen == lens[k] && out.listen_id == 77 &&
                 out.conn_id == 0xfeedfacecafebeefULL && !memcmp(out.addr, addr, lens[k]) &&
                 out.watch_port == 40000 + k,
             "ctrl round trip type %u addrlen %zu changed the message", types[t], lens[k]);
    }
  ps_ctrl_msg_t m;
  uint8_t addr[PS_CTRL_ADDR_MAX + 1] = {1};
  EXPECT(ps_ctrl_encode(&m, PS_CTRL_CONNECT, HASH, 1, 1, addr, 0, 0) != ncclSuccess,
         "ctrl encode accepted addrlen 0");
  EXPECT(ps_ctrl_encode(&m, PS_CTRL_CONNECT, HASH, 1, 1, addr, PS_CTRL_ADDR_MAX + 1, 0) != ncclSuccess,
         "ctrl encode accepted addrlen %d", PS_CTRL_ADDR_MAX + 1);
}

static void test_ctrl_rejects(void) {
  uint8_t addr[24];
  fill_addr(addr, sizeof addr, 3);
  ps_ctrl_msg_t good, m, out;
  ps_ctrl_encode(&good, PS_CTRL_CONNECT, HASH, 5, 6, addr, sizeof addr, 1);
  ncclResult_t rc;
  const size_t n = sizeof good;

  EXPECT((rc = ps_ctrl_decode(NULL, n, PS_CTRL_CONNECT, HASH, &out)) == ncclInvalidArgument, "NULL: rc %d", rc);
  /* Wrong length, short and long: a control message has exactly one size. */
  const size_t wrong[] = {0, 1, 8, 40, n / 2, n - 1, n + 1, n + 8, 2 * n};
  for (size_t i = 0; i < sizeof wrong / sizeof wrong[0]; i++)
    EXPECT((rc = decode_ctrl_bytes(&good, wrong[i], PS_CTRL_CONNECT, HASH, &out)) == ncclInvalidArgument,
           "length %zu (expected %zu): rc %d", wrong[i], n, rc);

  EXPECT((rc = decode_ctrl_bytes(&good, n, PS_CTRL_ACCEPT, HASH, &out)) == ncclInvalidArgument,
         "CONNECT accepted as ACCEPT: rc %d", rc);
  const uint16_t types[] = {0, 3, 0x100, 0xffff};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
    m = good, m.type = types[i];
    EXPECT((rc = decode_ctrl_bytes(&m, n, PS_CTRL_CONNECT, HASH, &out)) == ncclInvalidArgument,
           "type %u: rc %d", types[i], rc);
  }
  m = good, m.magic = 0x53555350u;
  EXPECT((rc = decode_ctrl_bytes(&m, n, PS_CTRL_CONNECT, HASH, &out)) == ncclInvalidArgument, "magic: rc %d", rc);
  m = good, m.version = PS_WIRE_VERSION + 1;
  EXPECT((rc = decode_ctrl_bytes(&m, n, PS_CTRL_CONNECT, HASH, &out)) == ncclInvalidArgument, "version: rc %d", rc);
  m = good, m.version = 0;
  EXPECT((rc = decode_ctrl_bytes(&m, n, PS_CTRL_CONNECT, HASH, &out)) == ncclInvalidArgument, "version 0: rc %d", rc);
  EXPECT((rc = decode_ctrl_bytes(&good, n, PS_CTRL_CONNECT, OTHER_HASH, &out)) == ncclInvalidArgument,
         "other wire hash: rc %d", rc);
  const uint32_t lens[] = {0, PS_CTRL_ADDR_MAX + 1, 0x10000, 0x80000000u, 0xffffffffu};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    m = good, m.addrlen = lens[i];
    EXPECT((rc = decode_ctrl_bytes(&m, n, PS_CTRL_CONNECT, HASH, &out)) == ncclInvalidArgument,
           "addrlen %u: rc %d", lens[i], rc);
  }
  m = good, m.addrlen = PS_CTRL_ADDR_MAX;
  EXPECT(decode_ctrl_bytes(&m, n, PS_CTRL_CONNECT, HASH, &out) == ncclSuccess, "addrlen at the limit refused");
  /* A handle is not a control message and vice versa. */
  ps_handle_t h;
  ps_handle_encode(&h, HASH, 0, 5, addr, sizeof addr);
  EXPECT(decode_ctrl_bytes(&h, sizeof h, PS_CTRL_CONNECT, HASH, &out) == ncclInvalidArgument,
         "a handle decoded as a control message");
  EXPECT(decode_ctrl_bytes(&good, n, PS_CTRL_CONNECT, HASH, &out) == ncclSuccess, "good message refused");
}

int main(void) {
  /* The rejections WARN by design; keep the output to the verdicts. Set
   * PS_UNIT_VERBOSE=1 to see them. */
  if (!getenv("PS_UNIT_VERBOSE")) setenv("NCCL_DEBUG", "NONE", 1);
  test_handle_roundtrip();
  test_handle_rejects();
  test_ctrl_roundtrip();
  test_ctrl_rejects();
  return unit_report("unit_wire");
}
