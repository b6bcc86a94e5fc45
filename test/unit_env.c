/* Unit tests of the typed PERSEUS_* configuration (ps_env.c): defaults when
 * unset, accepted spellings, and every invalid value refused with
 * ncclInvalidArgument and a warning that names the variable.
 * Exit: 0 pass, 1 fail. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_env.h"
#include "ps_log.h"
#include "ps_stripe.h"

#include "unit_check.h"

#include "unit_capture.h" /* capture_begin/capture_end around what writes to stderr */

/* --- ps_env_int --- */
static ncclResult_t env_int(const char *value, int64_t def, int64_t lo, int64_t hi, int64_t *out) {
  if (value) setenv("PS_TEST_INT", value, 1);
  else unsetenv("PS_TEST_INT");
  return ps_env_int("PS_TEST_INT", def, lo, hi, out);
}

static void test_int(void) {
  int64_t v = -1;
  EXPECT(env_int(NULL, 7, 0, 10, &v) == ncclSuccess && v == 7, "unset: default 7, got %lld", (long long)v);
  EXPECT(env_int("", 7, 0, 10, &v) == ncclSuccess && v == 7, "empty: default 7, got %lld", (long long)v);
  EXPECT(env_int("3", 7, 0, 10, &v) == ncclSuccess && v == 3, "'3' gave %lld", (long long)v);
  EXPECT(env_int("0", 7, 0, 10, &v) == ncclSuccess && v == 0, "lower bound '0' gave %lld", (long long)v);
  EXPECT(env_int("10", 7, 0, 10, &v) == ncclSuccess && v == 10, "upper bound '10' gave %lld", (long long)v);
  EXPECT(env_int("-5", 0, -10, 10, &v) == ncclSuccess && v == -5, "'-5' gave %lld", (long long)v);
  EXPECT(env_int("3600000", 0, 10, 3600000, &v) == ncclSuccess && v == 3600000, "3600000 gave %lld",
         (long long)v);
  EXPECT(env_int("9223372036854775807", 0, INT64_MIN, INT64_MAX, &v) == ncclSuccess && v == INT64_MAX,
         "INT64_MAX gave %lld", (long long)v);

  /* plain decimal only: no octal, hex, sign or blanks that strtoll would take */
  static const char *const bad[] = {"abc", "12abc", "1.5", "12 ", "0x", "--1", "+", "1e3",
                                    "99999999999999999999", "-99999999999999999999", "11", "-1",
                                    "010", "08", "0x10", "0X1", " 8", "+8", "\t8", "8\n", "00",
                                    "-0", "- 1", "0b1", NULL};
  for (int i = 0; bad[i]; i++) {
    v = 1234;
    ncclResult_t rc = env_int(bad[i], 7, 0, 10, &v);
    EXPECT(rc == ncclInvalidArgument, "PS_TEST_INT='%s' in [0,10]: rc %d, expected ncclInvalidArgument",
           bad[i], rc);
  }
  /* The warning names the variable and the offending value. */
  capture_begin();
  ncclResult_t rc = env_int("12abc", 7, 0, 10, &v);
  const char *log = capture_end();
  EXPECT(rc == ncclInvalidArgument, "'12abc' accepted");
  EXPECT(strstr(log, "PS_TEST_INT") != NULL, "the warning does not name the variable: '%s'", log);
  EXPECT(strstr(log, "12abc") != NULL, "the warning does not show the value: '%s'", log);
  EXPECT(strstr(log, "WARN") != NULL, "not a warning: '%s'", log);
  /* A valid or unset value is silent. */
  capture_begin();
  env_int("5", 7, 0, 10, &v);
  env_int(NULL, 7, 0, 10, &v);
  log = capture_end();
  EXPECT(log[0] == '\0', "a valid value logged: '%s'", log);
  unsetenv("PS_TEST_INT");
}

/* Every value of bad is refused with ncclInvalidArgument (fn sets var to it
 * and reads it with default def), and refusing `warned` writes a warning
 * that names the variable and the value; returns that warning. */
static const char *expect_refused(ncclResult_t (*fn)(const char *, int, int *), const char *var,
                                  const char *const *bad, int def, const char *warned) {
  int v = -1;
  for (int i = 0; bad[i]; i++) {
    ncclResult_t rc = fn(bad[i], def, &v);
    EXPECT(rc == ncclInvalidArgument, "%s='%s': rc %d, expected ncclInvalidArgument", var, bad[i], rc);
  }
  capture_begin();
  ncclResult_t rc = fn(warned, def, &v);
  const char *log = capture_end();
  EXPECT(rc == ncclInvalidArgument, "'%s' accepted", warned);
  EXPECT(strstr(log, var) && strstr(log, warned),
         "the warning does not name the variable and value: '%s'", log);
  return log;
}

/* --- ps_env_bool --- */
static ncclResult_t env_bool(const char *value, int def, int *out) {
  if (value) setenv("PS_TEST_BOOL", value, 1);
  else unsetenv("PS_TEST_BOOL");
  return ps_env_bool("PS_TEST_BOOL", def, out);
}

static void test_bool(void) {
  int v = -1;
  EXPECT(env_bool(NULL, 1, &v) == ncclSuccess && v == 1, "unset: default 1, got %d", v);
  EXPECT(env_bool(NULL, 0, &v) == ncclSuccess && v == 0, "unset: default 0, got %d", v);
  EXPECT(env_bool("", 1, &v) == ncclSuccess && v == 1, "empty: default 1, got %d", v);
  static const char *const yes[] = {"1", "true", "TRUE", "yes", "Yes", "on", "ON", NULL};
  static const char *const no[] = {"0", "false", "False", "no", "NO", "off", "Off", NULL};
  for (int i = 0; yes[i]; i++) {
    v = -1;
    EXPECT(env_bool(yes[i], 0, &v) == ncclSuccess && v == 1, "'%s' gave %d", yes[i], v);
  }
  for (int i = 0; no[i]; i++) {
    v = -1;
    EXPECT(env_bool(no[i], 1, &v) == ncclSuccess && v == 0, "'%s' gave %d", no[i], v);
  }
  static const char *const bad[] = {"2", "-1", "maybe", "tru", "yess", "1 ", " 0", "o", "10", NULL};
  expect_refused(env_bool, "PS_TEST_BOOL", bad, 1, "maybe");
  unsetenv("PS_TEST_BOOL");
}

/* --- ps_env_enum --- */
static ncclResult_t env_enum(const char *value, int def, int *out) {
  static const char *const choices[] = {"alpha", "beta", "gamma", NULL};
  if (value) setenv("PS_TEST_ENUM", value, 1);
  else unsetenv("PS_TEST_ENUM");
  return ps_env_enum("PS_TEST_ENUM", choices, def, out);
}

static void test_enum(void) {
  int v = -1;
  EXPECT(env_enum(NULL, 2, &v) == ncclSuccess && v == 2, "unset: default 2, got %d", v);
  EXPECT(env_enum("", 1, &v) == ncclSuccess && v == 1, "empty: default 1, got %d", v);
  EXPECT(env_enum("alpha", 2, &v) == ncclSuccess && v == 0, "'alpha' gave %d", v);
  EXPECT(env_enum("BETA", 2, &v) == ncclSuccess && v == 1, "'BETA' gave %d", v);
  EXPECT(env_enum("Gamma", 0, &v) == ncclSuccess && v == 2, "'Gamma' gave %d", v);
  static const char *const bad[] = {"delta", "alph", "alphaa", "1", "beta ", NULL};
  const char *log = expect_refused(env_enum, "PS_TEST_ENUM", bad, 0, "delta");
  EXPECT(strstr(log, "alpha") && strstr(log, "beta") && strstr(log, "gamma"),
         "the warning does not list the choices: '%s'", log);
  unsetenv("PS_TEST_ENUM");
}

/* --- ps_config_load --- */
static const char *const config_vars[] = {
    "PERSEUS_PROVIDER", "FI_PROVIDER", "PERSEUS_IFACE", "PERSEUS_NET_REQUESTS", "PERSEUS_MAX_RECVS",
    "PERSEUS_KEEPALIVE_MS", "PERSEUS_PEER_TIMEOUT_MS", "PERSEUS_EAGAIN_RETRIES", "PERSEUS_RMA_INFLIGHT",
    "PERSEUS_NSTREAMS", "PERSEUS_STRIPE_MIN", "PERSEUS_PROXY_QUEUE", "NCCL_SOCKET_IFNAME", NULL};

static void clear_config_env(void) {
  for (int i = 0; config_vars[i]; i++) unsetenv(config_vars[i]);
}

static void test_config(void) {
  ps_config_t c;
  clear_config_env();
  memset(&c, 0xa5, sizeof c);
  EXPECT(ps_config_load(&c) == ncclSuccess, "defaults: load failed");
  EXPECT(c.provider == NULL && c.iface == NULL, "defaults: provider/iface not NULL");
  EXPECT(c.net_requests == 64, "default PERSEUS_NET_REQUESTS %lld", (long long)c.net_requests);
  EXPECT(c.max_recvs == 8, "default PERSEUS_MAX_RECVS %lld", (long long)c.max_recvs);
  EXPECT(c.keepalive_ms == 1000, "default PERSEUS_KEEPALIVE_MS %lld", (long long)c.keepalive_ms);
  EXPECT(c.peer_timeout_ms == 5000, "default PERSEUS_PEER_TIMEOUT_MS %lld", (long long)c.peer_timeout_ms);
  EXPECT(c.eagain_retries == 64, "default PERSEUS_EAGAIN_RETRIES %lld", (long long)c.eagain_retries);
  EXPECT(c.rma_inflight == -1, "PERSEUS_RMA_INFLIGHT unset must leave the bound to the provider, got %lld",
         (long long)c.rma_inflight);
  EXPECT(c.nstreams == -1, "PERSEUS_NSTREAMS unset must leave the count to the provider, got %lld",
         (long long)c.nstreams);
  EXPECT(c.stripe_min == 128 << 10, "default PERSEUS_STRIPE_MIN %lld", (long long)c.stripe_min);
  EXPECT(c.proxy_queue == 1024, "default PERSEUS_PROXY_QUEUE %lld", (long long)c.proxy_queue);

  setenv("FI_PROVIDER", "sockets", 1);
  EXPECT(ps_config_load(&c) == ncclSuccess && c.provider && !strcmp(c.provider, "sockets"),
         "FI_PROVIDER is not the fallback provider");
  setenv("PERSEUS_PROVIDER", "tcp;ofi_rxm", 1);
  EXPECT(ps_config_load(&c) == ncclSuccess && c.provider && !strcmp(c.provider, "tcp;ofi_rxm"),
         "PERSEUS_PROVIDER does not take precedence over FI_PROVIDER");
  setenv("PERSEUS_PROVIDER", "", 1);
  EXPECT(ps_config_load(&c) == ncclSuccess && c.provider && !strcmp(c.provider, "sockets"),
         "an empty PERSEUS_PROVIDER should fall back to FI_PROVIDER");
  clear_config_env();

  setenv("PERSEUS_IFACE", "lo,eth0", 1);
  setenv("PERSEUS_NET_REQUESTS", "4096", 1);
  setenv("PERSEUS_MAX_RECVS", "1", 1);
  setenv("PERSEUS_KEEPALIVE_MS", "10", 1);
  setenv("PERSEUS_PEER_TIMEOUT_MS", "3600000", 1);
  setenv("PERSEUS_EAGAIN_RETRIES", "0", 1);
  setenv("PERSEUS_RMA_INFLIGHT", "0", 1);
  setenv("PERSEUS_PROXY_QUEUE", "32", 1);
  EXPECT(ps_config_load(&c) == ncclSuccess, "valid values: load failed");
  EXPECT(c.proxy_queue == 32, "PERSEUS_PROXY_QUEUE=32 not taken: %lld", (long long)c.proxy_queue);
  EXPECT(c.rma_inflight == 0, "PERSEUS_RMA_INFLIGHT=0 (no bound) not taken: %lld", (long long)c.rma_inflight);
  EXPECT(c.iface && !strcmp(c.iface, "lo,eth0"), "PERSEUS_IFACE");
  EXPECT(c.net_requests == 4096 && c.max_recvs == 1 && c.keepalive_ms == 10 &&
             c.peer_timeout_ms == 3600000 && c.eagain_retries == 0,
         "valid values not taken: %lld %lld %lld %lld %lld", (long long)c.net_requests,
         (long long)c.max_recvs, (long long)c.keepalive_ms, (long long)c.peer_timeout_ms,
         (long long)c.eagain_retries);
  clear_config_env();

  /* Each invalid value: load fails and the warning names that variable. */
  static const struct {
    const char *var, *value;
  } bad[] = {
      {"PERSEUS_NET_REQUESTS", "0"},      {"PERSEUS_NET_REQUESTS", "4097"},
      {"PERSEUS_NET_REQUESTS", "many"},   {"PERSEUS_MAX_RECVS", "9"},
      {"PERSEUS_MAX_RECVS", "0"},         {"PERSEUS_MAX_RECVS", "8x"},
      {"PERSEUS_KEEPALIVE_MS", "9"},      {"PERSEUS_KEEPALIVE_MS", "1s"},
      {"PERSEUS_KEEPALIVE_MS", "3600001"}, {"PERSEUS_PEER_TIMEOUT_MS", "abc"},
      {"PERSEUS_PEER_TIMEOUT_MS", "-1"},  {"PERSEUS_PEER_TIMEOUT_MS", "5000.0"},
      {"PERSEUS_EAGAIN_RETRIES", "-1"},   {"PERSEUS_EAGAIN_RETRIES", "1000001"},
      {"PERSEUS_EAGAIN_RETRIES", "1O"},    {"PERSEUS_RMA_INFLIGHT", "-1"},
      {"PERSEUS_RMA_INFLIGHT", "65537"},  {"PERSEUS_RMA_INFLIGHT", "8 ops"},
      {"PERSEUS_NSTREAMS", "0"},          {"PERSEUS_NSTREAMS", "9"},
      {"PERSEUS_NSTREAMS", "auto"},       {"PERSEUS_STRIPE_MIN", "1023"},
      {"PERSEUS_PROXY_QUEUE", "1000"},    {"PERSEUS_PROXY_QUEUE", "16"},
      {"PERSEUS_PROXY_QUEUE", "32768"},   {"PERSEUS_PROXY_QUEUE", "deep"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    clear_config_env();
    setenv(bad[i].var, bad[i].value, 1);
    capture_begin();
    ncclResult_t rc = ps_config_load(&c);
    const char *log = capture_end();
    EXPECT(rc == ncclInvalidArgument, "%s='%s': ps_config_load rc %d, expected ncclInvalidArgument",
           bad[i].var, bad[i].value, rc);
    EXPECT(strstr(log, bad[i].var) != NULL, "%s='%s': the warning does not name it: '%s'", bad[i].var,
           bad[i].value, log);
  }
  clear_config_env();
}

/* --- PERSEUS_NSTREAMS unset: the provider's count (ps_stripe_default) --- */
static void test_stripe_default(void) {
  static const struct {
    const char *prov;
    long cpus;
    int want;
  } cases[] = {
      {"tcp;ofi_rxm", 16, 4}, {"tcp", 64, 4},     {"tcp;ofi_rxm", 15, 1}, {"tcp", 2, 1},
      {"sockets", 64, 1},     {"shm", 64, 1},     {"verbs;ofi_rxm", 64, 1}, {"tcpx", 64, 1},
      {"udp;ofi_rxd", 64, 1}, {NULL, 64, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int got = ps_stripe_default(cases[i].prov, cases[i].cpus);
    EXPECT(got == cases[i].want, "provider %s on %ld CPUs: %d endpoints per comm, expected %d",
           cases[i].prov ? cases[i].prov : "(none)", cases[i].cpus, got, cases[i].want);
  }
}

/* --- interface rules (NCCL_SOCKET_IFNAME's syntax) --- */
static void test_iface(void) {
  static const struct {
    const char *rule, *name;
    int want;
  } cases[] = {
      {"eth", "eth0", 1},       {"eth", "eth10", 1},      {"eth", "veth0", 0},
      {"eth0", "eth0", 1},      {"eth0", "eth01", 1},     {"=eth0", "eth01", 0},
      {"=eth0", "eth0", 1},     {"=eth", "eth0", 0},      {"lo,eth", "lo", 1},
      {"lo,eth", "eth3", 1},    {"lo,eth", "ib0", 0},     {"^docker,lo", "docker0", 0},
      {"^docker,lo", "lo", 0},  {"^docker,lo", "eth0", 1}, {"^=lo", "lo", 0},
      {"^=lo", "lo2", 1},       {"^lo", "lo2", 0},        {"", "eth0", 0},
      {",", "eth0", 0},         {"^", "eth0", 1},         {"eth0,", "eth0", 1},
      {"toolongname", "too", 0}, {"=", "eth0", 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    EXPECT(ps_iface_match(cases[i].rule, cases[i].name) == cases[i].want,
           "rule '%s' on '%s': expected %s", cases[i].rule, cases[i].name,
           cases[i].want ? "a match" : "no match");
  /* PERSEUS_IFACE first, NCCL_SOCKET_IFNAME (NCCL's own) when it is unset */
  ps_config_t c;
  clear_config_env();
  setenv("NCCL_SOCKET_IFNAME", "^docker", 1);
  EXPECT(ps_config_load(&c) == ncclSuccess && c.iface && !strcmp(c.iface, "^docker") &&
             c.iface_from_nccl,
         "NCCL_SOCKET_IFNAME is not the fallback interface rule");
  setenv("PERSEUS_IFACE", "=eth1", 1);
  EXPECT(ps_config_load(&c) == ncclSuccess && c.iface && !strcmp(c.iface, "=eth1") &&
             !c.iface_from_nccl,
         "PERSEUS_IFACE does not take precedence over NCCL_SOCKET_IFNAME");
  /* a rule that names nothing, or doubles a prefix, is refused by name */
  static const char *flawed[] = {"^", "=", "^=", ",", "^,,", "^^lo", "==eth0", "^=^lo"};
  for (size_t i = 0; i < sizeof flawed / sizeof *flawed; i++) {
    setenv("PERSEUS_IFACE", flawed[i], 1);
    EXPECT(ps_config_load(&c) == ncclInvalidUsage, "PERSEUS_IFACE='%s' was accepted", flawed[i]);
  }
  /* NCCL's own variable is NCCL's to judge: a flawed one is ignored */
  unsetenv("PERSEUS_IFACE");
  setenv("NCCL_SOCKET_IFNAME", "^", 1);
  EXPECT(ps_config_load(&c) == ncclSuccess && !c.iface && !c.iface_from_nccl,
         "NCCL_SOCKET_IFNAME='^' was not ignored");
  clear_config_env();
}

int main(void) {
  /* ps_log reads NCCL_DEBUG once: the default level (WARN) must be in force
   * so that the warnings can be checked. */
  unsetenv("NCCL_DEBUG");
  test_int();
  test_bool();
  test_enum();
  test_config();
  test_stripe_default();
  test_iface();
  return unit_report("unit_env");
}
