/* Bounded-time mutation fuzzer of the wire decoders, ps_handle_decode,
 * ps_ctrl_decode, ps_sig_decode and ps_reg_decode: the bytes a peer (or
 * NCCL's bootstrap) hands us.
 *
 *   perseus_fuzz_wire [-t SECONDS] [-n ITERATIONS] [-s SEED] [-v]
 *
 * Plain C, no libFuzzer needed: inputs are mutated from valid encodings (bit
 * flips, byte sets, interesting header values, truncation and extension) and
 * handed over in heap blocks of exactly their length, so a build with
 * -Db_sanitize=address catches any read past the end. Checks that a decoder
 * either refuses (ncclInvalidArgument) or accepts a message that really is
 * valid: right magic, version, wire hash and type, address length within
 * bounds, the buffer long enough. Stops after -t seconds (default 5; checked
 * every 1024 iterations, so at least 1024 run whatever -t) or -n
 * iterations, whichever comes first.
 *
 * With clang -fsanitize=fuzzer -DPS_LIBFUZZER, LLVMFuzzerTestOneInput takes
 * the place of main (first input byte: which decoder and type). */
#include <ctype.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ps_wire.h"
#include "size_parse.h"

#define HASH 0x5eed1e55u
#define MAX_INPUT 1600 /* > 2 * sizeof(ps_ctrl_msg_t): room for overlong inputs */

static void die(const char *what, const void *buf, size_t len) {
  fprintf(stderr, "fuzz_wire: invariant broken: %s (input of %zu bytes:", what, len);
  for (size_t i = 0; i < len && i < 64; i++) fprintf(stderr, " %02x", ((const unsigned char *)buf)[i]);
  fprintf(stderr, "%s)\n", len > 64 ? " ..." : "");
  abort();
}

/* What a successful decode must imply. */
static void check_handle(const void *buf, size_t len, ncclResult_t rc, const ps_handle_t *out) {
  if (rc != ncclSuccess) {
    if (rc != ncclInvalidArgument) die("handle decode failed with something else than InvalidArgument", buf, len);
    return;
  }
  if (!buf || len < sizeof *out) die("handle accepted from a short buffer", buf, len);
  if (out->addrlen < 1 || out->addrlen > PS_HANDLE_ADDR_MAX) die("handle accepted with addrlen out of bounds", buf, len);
  if (out->magic != PS_WIRE_MAGIC || out->version != PS_WIRE_VERSION || out->wire_hash != HASH)
    die("handle accepted with a wrong header", buf, len);
  if (memcmp(out, buf, sizeof *out)) die("decoded handle differs from its bytes", buf, len);
}

static void check_ctrl(const void *buf, size_t len, uint16_t type, ncclResult_t rc,
                       const ps_ctrl_msg_t *out) {
  if (rc != ncclSuccess) {
    if (rc != ncclInvalidArgument) die("ctrl decode failed with something else than InvalidArgument", buf, len);
    return;
  }
  if (!buf || len != sizeof *out) die("control message accepted with a wrong length", buf, len);
  if (out->addrlen < 1 || out->addrlen > PS_CTRL_ADDR_MAX) die("control message accepted with addrlen out of bounds", buf, len);
  if (out->magic != PS_WIRE_MAGIC || out->version != PS_WIRE_VERSION || out->wire_hash != HASH ||
      out->type != type)
    die("control message accepted with a wrong header or type", buf, len);
  if (memcmp(out, buf, sizeof *out)) die("decoded control message differs from its bytes", buf, len);
}

/* Decodes `len` bytes held in a heap block of exactly that size. */
static int run_handle(const unsigned char *data, size_t len) {
  unsigned char *b = malloc(len ? len : 1);
  if (!b) abort();
  memcpy(b, data, len);
  ps_handle_t out;
  memset(&out, 0, sizeof out);
  ncclResult_t rc = ps_handle_decode(len ? b : NULL, len, HASH, &out);
  check_handle(len ? b : NULL, len, rc, &out);
  free(b);
  return rc == ncclSuccess;
}

static int run_ctrl(const unsigned char *data, size_t len, uint16_t type) {
  unsigned char *b = malloc(len ? len : 1);
  if (!b) abort();
  memcpy(b, data, len);
  ps_ctrl_msg_t out;
  memset(&out, 0, sizeof out);
  ncclResult_t rc = ps_ctrl_decode(len ? b : NULL, len, type, HASH, &out);
  check_ctrl(len ? b : NULL, len, type, rc, &out);
  free(b);
  return rc == ncclSuccess;
}

/* The one-sided engine's peer messages: a signal to apply (or credit), a
 * rank's part of a symmetric registration, a staged write's header.
 * Accepted means every field is in range. */
#define OS_RANKS 4u
#define OS_REGION 3u
#define OS_SRC 1u
#define OS_MAXLEN 4096u
static int run_onesided(const unsigned char *data, size_t len) {
  unsigned char *b = malloc(len ? len : 1);
  if (!b) abort();
  memcpy(b, data, len);
  ps_sig_msg_t sm;
  ps_reg_msg_t rm;
  ps_stage_hdr_t hm;
  ps_streams_msg_t tm;
  int ok = 0;
  if (ps_sig_decode(len ? b : NULL, len, OS_RANKS, &sm) == ncclSuccess) {
    if (len != sizeof sm || sm.magic != PS_WIRE_MAGIC || sm.src_rank >= OS_RANKS ||
        (sm.op != 1 && sm.op != 2 && sm.op != PS_SIG_OP_CREDIT && sm.op != PS_SIG_OP_CLOSED))
      die("signal message accepted with a field out of range", b, len);
    ok++;
  }
  if (ps_reg_decode(len ? b : NULL, len, OS_RANKS, OS_REGION, &rm) == ncclSuccess) {
    if (len != sizeof rm || rm.magic != PS_WIRE_MAGIC || rm.rank >= OS_RANKS || rm.region_id != OS_REGION)
      die("registration message accepted with a field out of range", b, len);
    ok++;
  }
  if (ps_streams_decode(len ? b : NULL, len, OS_RANKS, &tm) == ncclSuccess) {
    if (len != sizeof tm || tm.magic != PS_WIRE_MAGIC || tm.rank >= OS_RANKS ||
        tm.nstreams > PS_MAX_STREAMS - 1 || (tm.nstreams && (!tm.addrlen || tm.addrlen > PS_STREAM_ADDR_MAX)))
      die("staging streams message accepted with a field out of range", b, len);
    ok++;
  }
  if (ps_stage_decode(len ? b : NULL, len, OS_SRC, OS_MAXLEN, &hm) == ncclSuccess) {
    if (len != sizeof hm || hm.magic != PS_WIRE_MAGIC || hm.src_rank != OS_SRC ||
        hm.len > OS_MAXLEN || !hm.stage_seq)
      die("staged write header accepted with a field out of range", b, len);
    ok++;
  }
  free(b);
  return ok;
}

/* Random byte-level mutations of valid one-sided messages. */
static long long fuzz_onesided(long long iters, uint64_t (*rand64)(void)) {
  ps_sig_msg_t sig = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .op = 2, .src_rank = 1,
                      .region_id = 2, .offset = 8, .value = 5};
  ps_reg_msg_t reg = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .rank = 2,
                      .region_id = OS_REGION, .addr = 0x1000, .size = 4096, .key = 7};
  ps_stage_hdr_t hdr = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .src_rank = OS_SRC,
                        .region_id = 2, .offset = 64, .len = 100, .seq = 9, .stage_seq = 3};
  ps_streams_msg_t streams = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .rank = 1,
                             .nstreams = 3, .addrlen = 16};
  const void *valid[] = {&sig, &reg, &hdr, &streams};
  const size_t sizes[] = {sizeof sig, sizeof reg, sizeof hdr, sizeof streams};
  for (int k = 0; k < 4; k++)
    if (run_onesided(valid[k], sizes[k]) != 1) die("a valid one-sided message was refused", valid[k], sizes[k]);
  long long accepted = 0;
  for (long long i = 0; i < iters; i++) {
    unsigned char buf[sizeof(ps_streams_msg_t)];
    int k = (int)(rand64() % 4);
    size_t len = sizes[k];
    memcpy(buf, valid[k], len);
    for (int k = (int)(rand64() % 4); k >= 0; k--) buf[rand64() % len] ^= (unsigned char)(1u << (rand64() % 8));
    if (rand64() % 16 == 0) len = (size_t)(rand64() % sizeof buf); /* wrong lengths too */
    accepted += run_onesided(buf, len);
  }
  return accepted;
}

/* Staged writes as a whole (ps_stage_layout): a valid one, laid out as a
 * sender does, must come back record for record; mutated ones may be
 * refused, and what is accepted must keep every header and payload in the
 * slot, the payloads back to back from byte 64 and before the headers. */
#define LAY_SLOT 8192u
#define LAY_MAX 8u
static void check_layout(const unsigned char *slot, uint32_t n, const ps_stage_hdr_t *h, const size_t *doff) {
  if (!n) return;
  if (n > LAY_MAX) die("staged write: more records than allowed", slot, LAY_SLOT);
  size_t want = sizeof *h, hdrs_end = n > 1 ? h[0].hdrs_off + (n - 1) * sizeof *h : LAY_SLOT;
  for (uint32_t i = 0; i < n; i++) {
    if (doff[i] != want || h[i].len > LAY_SLOT || doff[i] + h[i].len > (n > 1 ? h[0].hdrs_off : LAY_SLOT) ||
        h[i].stage_seq != h[0].stage_seq || h[i].more != (i + 1 < n))
      die("staged write accepted with a record out of place", slot, LAY_SLOT);
    want += (h[i].len + 63) & ~(uint64_t)63;
  }
  if (hdrs_end > LAY_SLOT) die("staged write accepted with a header past the slot", slot, LAY_SLOT);
}

static long long fuzz_layout(long long iters, uint64_t (*rand64)(void)) {
  unsigned char *slot = malloc(LAY_SLOT); /* heap: ASan sees a read past it */
  if (!slot) abort();
  long long accepted = 0;
  for (long long it = 0; it < iters; it++) {
    memset(slot, 0, LAY_SLOT);
    uint32_t n = 1 + (uint32_t)(rand64() % LAY_MAX), lens[LAY_MAX];
    size_t paid = 0;
    for (uint32_t i = 0; i < n; i++) {
      lens[i] = (uint32_t)(rand64() % 5 == 0 ? 0 : rand64() % 700);
      paid += (lens[i] + 63) & ~(size_t)63;
    }
    size_t hdrs = sizeof(ps_stage_hdr_t) + paid;
    if (hdrs + (n - 1) * sizeof(ps_stage_hdr_t) > LAY_SLOT) continue;
    for (uint32_t i = 0; i < n; i++) {
      ps_stage_hdr_t h = {.magic = PS_WIRE_MAGIC, .version = PS_WIRE_VERSION, .more = (uint16_t)(i + 1 < n),
                          .src_rank = OS_SRC, .region_id = 1, .len = lens[i], .seq = i + 1, .stage_seq = 7,
                          .sig_op = lens[i] ? 0 : 2, .hdrs_off = i ? 0 : (uint32_t)hdrs};
      memcpy(slot + (i ? hdrs + (i - 1) * sizeof h : 0), &h, sizeof h);
    }
    ps_stage_hdr_t out[LAY_MAX];
    size_t doff[LAY_MAX];
    uint32_t got = ps_stage_layout(slot, LAY_SLOT, OS_SRC, LAY_MAX, out, doff);
    if (got != n) die("a valid staged write was refused or miscounted", slot, LAY_SLOT);
    check_layout(slot, got, out, doff);
    /* then flip bits in the headers (where the checks are) or set a field */
    size_t where[LAY_MAX];
    for (uint32_t i = 0; i < n; i++) where[i] = i ? hdrs + (i - 1) * sizeof(ps_stage_hdr_t) : 0;
    for (int k = (int)(rand64() % 4); k >= 0; k--) {
      size_t at = where[rand64() % n] + rand64() % sizeof(ps_stage_hdr_t);
      slot[at] ^= (unsigned char)(1u << (rand64() % 8));
    }
    if (rand64() % 4 == 0) { /* hdrs_off anywhere, also past the slot */
      uint32_t v = (uint32_t)(rand64() % (LAY_SLOT + 256));
      memcpy(slot + offsetof(ps_stage_hdr_t, hdrs_off), &v, sizeof v);
    }
    got = ps_stage_layout(slot, LAY_SLOT, OS_SRC, rand64() % 2 ? LAY_MAX : n, out, doff);
    check_layout(slot, got, out, doff);
    accepted += got != 0;
  }
  free(slot);
  return accepted;
}

#ifdef PS_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int quiet;
  if (!quiet) setenv("NCCL_DEBUG", "NONE", 1), quiet = 1;
  if (size < 1) return 0;
  uint8_t sel = data[0];
  if (sel & 1) run_handle(data + 1, size - 1);
  else if (sel & 8) run_onesided(data + 1, size - 1);
  else run_ctrl(data + 1, size - 1, (uint16_t)((sel >> 1) & 3));
  return 0;
}
#else

/* xorshift64*: reproducible from -s. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static uint64_t rnd(void) {
  uint64_t x = rng_state;
  x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
  rng_state = x;
  return x * 0x2545F4914F6CDD1DULL;
}
static size_t below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
  unsigned char b[MAX_INPUT];
  size_t len;
} input_t;

enum { NSEEDS = 12 };
static input_t seeds[2][NSEEDS]; /* [0] handles, [1] control messages */
static uint16_t seed_type[NSEEDS];

static void make_seeds(void) {
  static const size_t hlens[NSEEDS] = {1, 2, 4, 16, 16, 28, 28, 32, 64, 95, 96, 96};
  static const size_t clens[NSEEDS] = {1, 4, 16, 16, 28, 28, 64, 96, 128, 200, 223, 224};
  for (int i = 0; i < NSEEDS; i++) {
    uint8_t addr[PS_CTRL_ADDR_MAX];
    for (size_t k = 0; k < sizeof addr; k++) addr[k] = (uint8_t)rnd();
    ps_handle_t h;
    if (ps_handle_encode(&h, HASH, (uint32_t)below(4), rnd(), addr, hlens[i]) != ncclSuccess) abort();
    /* NCCL passes the 128-byte handle area; the tail is whatever was there. */
    memset(seeds[0][i].b, 0, NCCL_NET_HANDLE_MAXSIZE);
    memcpy(seeds[0][i].b, &h, sizeof h);
    seeds[0][i].len = (i & 1) ? sizeof h : NCCL_NET_HANDLE_MAXSIZE;
    ps_ctrl_msg_t m;
    seed_type[i] = (i & 1) ? PS_CTRL_ACCEPT : PS_CTRL_CONNECT;
    if (ps_ctrl_encode(&m, seed_type[i], HASH, rnd(), rnd(), addr, clens[i], (uint16_t)rnd()) != ncclSuccess) abort();
    memcpy(seeds[1][i].b, &m, sizeof m);
    seeds[1][i].len = sizeof m;
  }
}

/* Header fields worth hitting exactly: both structs start magic, version. */
static void set_field(input_t *in, size_t off, size_t width, uint64_t v) {
  if (off + width > in->len) return;
  memcpy(in->b + off, &v, width); /* little endian host */
}

static uint64_t interesting(size_t width, size_t addrmax) {
  static const uint64_t vals[] = {0, 1, 2, 0x7f, 0x80, 0xff, 0x100, 0x7fff, 0x8000, 0xffff,
                                  0x10000, 0x7fffffff, 0x80000000u, 0xffffffffu};
  uint64_t v;
  switch (below(4)) {
    case 0: v = addrmax + below(3) - 1; break; /* the bound and either side of it */
    case 1: v = vals[below(sizeof vals / sizeof vals[0])]; break;
    case 2: v = rnd(); break;
    default: v = below(addrmax + 2); break;
  }
  return width == 2 ? (uint16_t)v : width == 4 ? (uint32_t)v : v;
}

static void mutate(input_t *in, int is_ctrl) {
  size_t addrmax = is_ctrl ? PS_CTRL_ADDR_MAX : PS_HANDLE_ADDR_MAX;
  size_t addrlen_off = is_ctrl ? offsetof(ps_ctrl_msg_t, addrlen) : offsetof(ps_handle_t, addrlen);
  size_t addrlen_w = is_ctrl ? 4 : 2;
  int n = 1 + (int)below(6);
  for (int k = 0; k < n; k++) {
    switch (below(10)) {
      case 0: /* bit flip */
      case 1:
        if (in->len) in->b[below(in->len)] ^= (unsigned char)(1u << below(8));
        break;
      case 2: /* byte set */
        if (in->len) in->b[below(in->len)] = (unsigned char)rnd();
        break;
      case 3: /* header bytes are where the checks live: hit them more */
        if (in->len) in->b[below(in->len < 24 ? in->len : 24)] = (unsigned char)interesting(2, addrmax);
        break;
      case 4:
      case 5: /* the address length: the field that bounds a copy */
        set_field(in, addrlen_off, addrlen_w, interesting(addrlen_w, addrmax));
        break;
      case 6: /* the type of a control message */
        if (is_ctrl) set_field(in, offsetof(ps_ctrl_msg_t, type), 2, below(5));
        break;
      case 7: /* truncate: a few bytes off the end, or to any size down to 0 */
        if (below(4)) in->len -= below((in->len < 8 ? in->len : 8) + 1);
        else in->len = below(in->len + 1);
        break;
      case 8: { /* extend with random bytes */
        size_t add = 1 + below(below(2) ? 8 : 200);
        for (size_t i = 0; i < add && in->len < MAX_INPUT; i++) in->b[in->len++] = (unsigned char)rnd();
        break;
      }
      default: /* repair the header so that the deeper checks are reached */
        set_field(in, 0, 4, PS_WIRE_MAGIC);
        set_field(in, 4, 2, PS_WIRE_VERSION);
        set_field(in, is_ctrl ? offsetof(ps_ctrl_msg_t, wire_hash) : offsetof(ps_handle_t, wire_hash), 4, HASH);
        break;
    }
  }
}

/* -t: a decimal number of seconds in (0, 86400]: digits first, no hex, inf
 * or nan (strtod takes all three). */
static int parse_seconds(const char *s, double *out) {
  char *end;
  if (!isdigit((unsigned char)s[0]) || strspn(s, "0123456789.eE+-") != strlen(s)) return -1;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || *end || !(v > 0 && v <= 86400)) return -1;
  *out = v;
  return 0;
}

int main(int argc, char **argv) {
  double seconds = 5;
  long long max_iter = -1;
  uint64_t seed = 0, n = 0;
  int seed_given = 0; /* -s 0 is a seed like any other, not "pick one" */
  int verbose = 0, c;
  while ((c = getopt(argc, argv, "t:n:s:vh")) != -1) {
    switch (c) {
      case 't':
        if (parse_seconds(optarg, &seconds)) {
          fprintf(stderr, "-t '%s': expected seconds, a decimal number above 0 and at most 86400\n", optarg);
          return 2;
        }
        break;
      case 'n':
        if (sp_parse_u64(optarg, &n) || strspn(optarg, "0123456789") != strlen(optarg) || n < 1 ||
            n > INT64_MAX) { /* decimal */
          fprintf(stderr, "-n '%s': expected a number of iterations, a decimal integer from 1 to 2^63 - 1\n",
                  optarg);
          return 2;
        }
        max_iter = (long long)n;
        break;
      case 's':
        if (sp_parse_u64(optarg, &seed)) {
          fprintf(stderr, "-s '%s': expected an unsigned 64-bit seed (decimal, 0x hex or 0 octal)\n", optarg);
          return 2;
        }
        seed_given = 1;
        break;
      case 'v': verbose = 1; break;
      default:
        fprintf(stderr, "usage: %s [-t SECONDS] [-n ITERATIONS] [-s SEED] [-v]\n", argv[0]);
        return c == 'h' ? 0 : 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  /* Every refusal WARNs: silence ps_log's stderr before its first use. */
  if (!verbose) setenv("NCCL_DEBUG", "NONE", 1);
  if (!seed_given) seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
  rng_state = seed | 1;
  printf("fuzz_wire: seed 0x%llx, %.1f s%s\n", (unsigned long long)seed, seconds,
         max_iter >= 0 ? " or the given iterations" : "");
  fflush(stdout);
  make_seeds();

  /* The seeds themselves must decode. */
  for (int i = 0; i < NSEEDS; i++) {
    if (!run_handle(seeds[0][i].b, seeds[0][i].len)) die("a valid handle was refused", seeds[0][i].b, seeds[0][i].len);
    if (!run_ctrl(seeds[1][i].b, seeds[1][i].len, seed_type[i]))
      die("a valid control message was refused", seeds[1][i].b, seeds[1][i].len);
  }
  /* Every length from 0 up, of valid bytes: the short-buffer paths. */
  for (size_t len = 0; len <= MAX_INPUT / 2; len++) {
    unsigned char tmp[MAX_INPUT] = {0};
    memcpy(tmp, seeds[1][3].b, sizeof(ps_ctrl_msg_t));
    run_handle(tmp, len);
    run_ctrl(tmp, len, seed_type[3]);
  }

  long long iters = 0, accepted[2] = {0, 0}, null_calls = 0;
  double end = now_s() + seconds;
  input_t in;
  for (;;) {
    if (max_iter >= 0 && iters >= max_iter) break;
    /* not before the first iteration: a -t shorter than the set-up above
     * would otherwise fuzz nothing and still say ok */
    if (iters && (iters & 1023) == 0 && now_s() >= end) break;
    int is_ctrl = (int)(rnd() & 1);
    int s = (int)below(NSEEDS);
    in = seeds[is_ctrl][s];
    mutate(&in, is_ctrl);
    if (below(64) == 0) { /* NULL with a plausible length */
      ps_handle_t ho;
      ps_ctrl_msg_t co;
      ncclResult_t rc = ps_handle_decode(NULL, in.len, HASH, &ho);
      if (rc != ncclInvalidArgument) die("handle decode of NULL not refused", NULL, 0);
      rc = ps_ctrl_decode(NULL, sizeof co, PS_CTRL_CONNECT, HASH, &co);
      if (rc != ncclInvalidArgument) die("ctrl decode of NULL not refused", NULL, 0);
      null_calls++;
    }
    if (is_ctrl) {
      /* usually the seed's own type, sometimes another one */
      uint16_t type = below(8) ? seed_type[s] : (uint16_t)below(4);
      accepted[1] += run_ctrl(in.b, in.len, type);
      /* The same bytes offered as a handle: cross-format confusion. */
      if (below(4) == 0) accepted[0] += run_handle(in.b, in.len);
    } else {
      accepted[0] += run_handle(in.b, in.len);
      if (below(4) == 0) accepted[1] += run_ctrl(in.b, in.len, PS_CTRL_CONNECT);
    }
    iters++;
  }
  long long os_accepted = fuzz_onesided(iters / 4 + 1, rnd);
  long long lay_accepted = fuzz_layout(iters / 64 + 1, rnd);
  printf("fuzz_wire: %lld iterations, %lld handles and %lld control messages accepted, "
         "%lld NULL probes, %lld one-sided messages accepted of %lld, %lld mutated staged writes "
         "of %lld: ok\n", iters, accepted[0], accepted[1], null_calls, os_accepted, iters / 4 + 1,
         lay_accepted, iters / 64 + 1);
  return 0;
}
#endif
