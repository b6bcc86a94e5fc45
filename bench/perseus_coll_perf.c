/* perseus_coll_perf: nccl-tests-style benchmark of NCCL collectives; this file
 * holds main, the options, the sweep order and the tables. One invocation runs
 * the whole sweep twice on the same GPUs and link: once with NCCL loading the
 * perseus net plugin (NCCL_NET=Perseus), once with NCCL's built-in Socket
 * transport (NCCL_NET=Socket), each in freshly forked children (one process per
 * GPU, rank i on device i, see coll_ops.c and coll_proc.c), then prints both
 * side by side with the ratio of bus bandwidths. P2P, SHM and NVLS are always
 * off and every byte goes over the loopback interface. The parent never calls
 * CUDA: a probe child counts the GPUs. Children talk to the parent through one
 * shared anonymous mapping (coll_shm) made here before any fork. */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nccl.h>

#include "coll_perf.h"
#include "dl_find.h"
#include "proc.h"
#include "size_parse.h"

#ifndef PS_DEFAULT_PLUGIN_PATH
#define PS_DEFAULT_PLUGIN_PATH "libnccl-net-perseus.so"
#endif
#ifndef PS_INSTALLED_PLUGIN_PATH
#define PS_INSTALLED_PLUGIN_PATH "/usr/local/lib/libnccl-net-perseus.so"
#endif
#ifndef PS_VERSION
#define PS_VERSION "unknown"
#endif

#define PS_BIG_BYTES ((size_t)64 << 20)    /* ratio average from here up */

const char *const coll_sweep_names[SW_N] = {"perseus", "socket"};
const char *const coll_names[C_N] = {"all_reduce", "all_gather", "reduce_scatter",
                                     "alltoall", "broadcast"};
static const char *const coll_ops[C_N] = {"sum", "none", "sum", "none", "none"};

struct ps_cfg coll_cfg;
struct ps_shared *coll_shm;
volatile sig_atomic_t coll_signal;

static int set_colls(const char *arg)
{
  char t[32];
  int r;
  memset(coll_cfg.coll_on, 0, sizeof(coll_cfg.coll_on));
  while ((r = sp_list_next(&arg, t, sizeof(t))) > 0) {
    int found = 0;
    for (int c = 0; c < C_N; c++) {
      /* all_reduce, allreduce and all-reduce all name the same collective */
      const char *a = t, *b = coll_names[c];
      while (*a || *b) {
        if (*a == '_' || *a == '-') { a++; continue; }
        if (*b == '_') { b++; continue; }
        if (tolower((unsigned char)*a) != *b) break;
        a++, b++;
      }
      if (!*a && !*b) coll_cfg.coll_on[c] = found = 1;
    }
    if (!strcmp(t, "all")) {
      for (int c = 0; c < C_N; c++) coll_cfg.coll_on[c] = 1;
      found = 1;
    }
    if (!found) return -1;
  }
  if (r < 0) return -1; /* an empty entry (all_reduce,,broadcast) or one no name is that long */
  for (int c = 0; c < C_N; c++)
    if (coll_cfg.coll_on[c]) return 0;
  return -1; /* no collective named: a run would measure nothing */
}

static int find_plugin(const char *arg)
{
  char exe[PATH_MAX], cand[3][PATH_MAX + 64];
  const char *base = strrchr(PS_DEFAULT_PLUGIN_PATH, '/');
  base = base ? base + 1 : PS_DEFAULT_PLUGIN_PATH;
  int nc = 0;
  if (arg) {
    snprintf(cand[nc++], sizeof(cand[0]), "%s", arg);
  } else {
    ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (len > 0) {
      exe[len] = '\0';
      char *slash = strrchr(exe, '/');
      if (slash) *slash = '\0';
      /* the build tree: build/bench/<exe> next to build/plugin/<plugin> */
      snprintf(cand[nc++], sizeof(cand[0]), "%s/../plugin/%s", exe, base);
    }
    snprintf(cand[nc++], sizeof(cand[0]), "%s", PS_DEFAULT_PLUGIN_PATH);
    snprintf(cand[nc++], sizeof(cand[0]), "%s", PS_INSTALLED_PLUGIN_PATH);
  }
  for (int i = 0; i < nc; i++)
    if (access(cand[i], R_OK) == 0 && realpath(cand[i], coll_cfg.plugin)) return 0;
  fprintf(stderr, "perseus_coll_perf: perseus plugin not found (tried:");
  for (int i = 0; i < nc; i++) fprintf(stderr, " %s", cand[i]);
  fprintf(stderr, "); pass -P PATH or -m socket\n");
  return -1;
}

static void usage(FILE *f)
{
  fprintf(f,
    "usage: perseus_coll_perf [options]\n"
    "NCCL collectives, nccl-tests style: NCCL with the perseus net plugin vs NCCL's\n"
    "built-in Socket transport, in one run, one forked process per GPU, over loopback.\n"
    "  -g N      number of GPUs/ranks (default: all visible GPUs)\n"
    "  -b SIZE   min bytes (default 1M; suffixes K, M, G, T)\n"
    "  -e SIZE   max bytes (default 1G)\n"
    "  -f N      multiplication factor between sizes (default 2)\n"
    "  -n N      timed iterations per size (default 20)\n"
    "  -w N      warmup iterations per size (default 5)\n"
    "  -c 0|1    check results (default 1)\n"
    "  -a 0..3   time reported: 0 rank 0, 1 average over ranks, 2 min, 3 max (default 1)\n"
    "  -o LIST   all_reduce, all_gather, reduce_scatter, alltoall, broadcast, all\n"
    "            or a comma-separated list (default all_reduce)\n"
    "  -m MODE   both, perseus or socket (default both)\n"
    "  -P PATH   perseus plugin (default: the built libnccl-net-perseus.so)\n"
    "  -I IFACE  interface for NCCL_SOCKET_IFNAME and PERSEUS_IFACE (default lo)\n"
    "  -T SEC    overall timeout in seconds (default 900)\n"
    "  -h, --help  this text\n"
    "Always set: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0;\n"
    "PERSEUS_PROVIDER defaults to \"tcp;ofi_rxm\" unless already set.\n"
    "Exit status: 0 all good; 1 error, timeout or wrong results; 2 usage.\n");
}

#define PS_STR_(x) #x
#define PS_STR(x) PS_STR_(x)
/* What option opt takes, for its refusal. */
static const char *expected(int opt)
{
  switch (opt) {
  case 'g': return "an integer from 1 to " PS_STR(PS_MAX_GPUS);
  case 'b': case 'e': return "a size from 1 byte, digits with an optional K, M, G or T";
  case 'f': return "an integer from 1 to 1048576";
  case 'n': return "an integer from 1 to 16777216";
  case 'w': return "an integer from 0 to 16777216";
  case 'c': return "0 or 1";
  case 'a': return "0, 1, 2 or 3";
  case 'o': return "a comma list of all_reduce, all_gather, reduce_scatter, alltoall, broadcast, all";
  case 'm': return "both, perseus or socket";
  case 'I': return "an interface name";
  case 'T': return "seconds from 1 to 604800";
  default: return "see -h";
  }
}

static int parse_args(int argc, char **argv)
{
  static const struct option longopts[] = {{"help", no_argument, NULL, 'h'}, {0, 0, 0, 0}};
  const char *plugin_arg = NULL;
  int opt, v;
  coll_cfg.min_bytes = 1 << 20;
  coll_cfg.max_bytes = 1 << 30;
  coll_cfg.factor = 2;
  coll_cfg.iters = 20;
  coll_cfg.warmup = 5;
  coll_cfg.check = 1;
  coll_cfg.avg_mode = 1;
  coll_cfg.timeout_s = 900;
  coll_cfg.iface = "lo";
  coll_cfg.coll_on[C_ALL_REDUCE] = 1;
  coll_cfg.sweep_on[SW_PERSEUS] = coll_cfg.sweep_on[SW_SOCKET] = 1;
  while ((opt = getopt_long(argc, argv, "g:b:e:f:n:w:c:a:o:m:P:I:T:h", longopts, NULL)) != -1) {
    int bad = 0;
    switch (opt) {
    case 'g': bad = sp_parse_int(optarg, 1, PS_MAX_GPUS, &coll_cfg.ngpus); break;
    case 'b': bad = sp_parse_size(optarg, 1, &coll_cfg.min_bytes) || coll_cfg.min_bytes == 0; break;
    case 'e': bad = sp_parse_size(optarg, 1, &coll_cfg.max_bytes) || coll_cfg.max_bytes == 0; break;
    case 'f': bad = sp_parse_int(optarg, 1, 1 << 20, &v); coll_cfg.factor = (size_t)v; break;
    case 'n': bad = sp_parse_int(optarg, 1, 1 << 24, &coll_cfg.iters); break;
    case 'w': bad = sp_parse_int(optarg, 0, 1 << 24, &coll_cfg.warmup); break;
    case 'c': bad = sp_parse_int(optarg, 0, 1, &coll_cfg.check); break;
    case 'a': bad = sp_parse_int(optarg, 0, 3, &coll_cfg.avg_mode); break;
    case 'o': bad = set_colls(optarg); break;
    case 'm':
      coll_cfg.sweep_on[SW_PERSEUS] = !strcmp(optarg, "both") || !strcmp(optarg, "perseus");
      coll_cfg.sweep_on[SW_SOCKET] = !strcmp(optarg, "both") || !strcmp(optarg, "socket");
      bad = !coll_cfg.sweep_on[SW_PERSEUS] && !coll_cfg.sweep_on[SW_SOCKET];
      break;
    case 'P': plugin_arg = optarg; break;
    case 'I': coll_cfg.iface = optarg, bad = !*optarg; break; /* empty: no interface named */
    case 'T': bad = sp_parse_int(optarg, 1, 7 * 24 * 3600, &coll_cfg.timeout_s); break;
    case 'h': usage(stdout); exit(0);
    default: usage(stderr); return -1;
    }
    if (bad) {
      fprintf(stderr, "perseus_coll_perf: bad value for -%c: '%s' (expected %s)\n", opt, optarg,
              expected(opt));
      return -1;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "perseus_coll_perf: unexpected argument '%s'\n", argv[optind]);
    return -1;
  }
  if (coll_cfg.min_bytes > coll_cfg.max_bytes ||
      (coll_cfg.factor < 2 && coll_cfg.min_bytes != coll_cfg.max_bytes)) {
    fprintf(stderr, "perseus_coll_perf: need -b <= -e and -f >= 2 (unless -b == -e)\n");
    return -1;
  }
  for (size_t s = coll_cfg.min_bytes; s <= coll_cfg.max_bytes; s *= coll_cfg.factor) {
    if (coll_cfg.nsizes == PS_MAX_SIZES) {
      fprintf(stderr, "perseus_coll_perf: more than %d sizes; raise -f\n", PS_MAX_SIZES);
      return -1;
    }
    coll_cfg.sizes[coll_cfg.nsizes++] = s;
    if (coll_cfg.factor < 2 || s > SIZE_MAX / coll_cfg.factor) break;
  }
  const char *prov = getenv("PERSEUS_PROVIDER");
  coll_cfg.provider = prov && *prov ? prov : "tcp;ofi_rxm";
  if (coll_cfg.sweep_on[SW_PERSEUS] && find_plugin(plugin_arg)) return -1;
  return 0;
}

static void print_cell(const struct ps_result *r)
{
  if (r->state == 1 && coll_cfg.check)
    printf("  %10.1f %7.2f %7.2f %7lld", r->time_us, r->algbw, r->busbw, r->wrong);
  else if (r->state == 1)
    printf("  %10.1f %7.2f %7.2f %7s", r->time_us, r->algbw, r->busbw, "N/A");
  else
    printf("  %10s %7s %7s %7s", "-", "-", "-", "-");
}

static void print_table(int c, long long *wrong_total)
{
  int n = coll_cfg.ngpus, cnt[SW_N] = {0}, nratio = 0;
  double sum[SW_N] = {0}, ratio_sum = 0;
  printf("\n# %s (op %s), float, out-of-place, %d ranks, %d iters, %d warmup\n",
         coll_names[c], coll_ops[c], n, coll_cfg.iters, coll_cfg.warmup);
  printf("# %32s  %s  %s\n", "", "------------ perseus: ------------",
         "------------ socket: -------------");
  printf("# %10s %12s %8s  %10s %7s %7s %7s  %10s %7s %7s %7s  %8s\n", "size", "count", "type",
         "time(us)", "algbw", "busbw", "#wrong", "time(us)", "algbw", "busbw", "#wrong", "ratio");
  printf("# %10s %12s %8s  %10s %7s %7s %7s  %10s %7s %7s %7s  %8s\n", "(B)", "(elements)", "",
         "", "(GB/s)", "(GB/s)", "", "", "(GB/s)", "(GB/s)", "", "busbw p/s");
  for (int i = 0; i < coll_cfg.nsizes; i++) {
    struct ps_counts k;
    if (!coll_counts(c, coll_cfg.sizes[i], n, &k)) { /* said, not dropped unseen */
      printf("  %10zu  (below one element per rank for %d ranks: not measured)\n", coll_cfg.sizes[i], n);
      continue;
    }
    const struct ps_result *r[SW_N];
    for (int s = 0; s < SW_N; s++) {
      r[s] = &coll_shm->res[s][c][i];
      if (r[s]->state == 1) {
        sum[s] += r[s]->busbw;
        cnt[s]++;
        if (coll_cfg.check) *wrong_total += r[s]->wrong;
      }
    }
    printf("  %10zu %12zu %8s", k.size_col, k.param, "float");
    print_cell(r[SW_PERSEUS]);
    print_cell(r[SW_SOCKET]);
    if (r[0]->state == 1 && r[1]->state == 1 && r[1]->busbw > 0) {
      double ratio = r[0]->busbw / r[1]->busbw;
      printf("  %8.3f\n", ratio);
      if (k.size_col >= PS_BIG_BYTES) ratio_sum += ratio, nratio++;
    } else {
      printf("  %8s\n", "-");
    }
  }
  char avg[SW_N][32], rat[32] = "n/a";
  for (int s = 0; s < SW_N; s++) {
    snprintf(avg[s], sizeof(avg[s]), "n/a");
    if (cnt[s]) snprintf(avg[s], sizeof(avg[s]), "%.3f GB/s", sum[s] / cnt[s]);
  }
  if (nratio) snprintf(rat, sizeof(rat), "%.3f (%d sizes)", ratio_sum / nratio, nratio);
  printf("# Avg bus bandwidth perseus: %s, socket: %s; avg ratio perseus/socket for sizes "
         ">= 64 MiB: %s\n", avg[SW_PERSEUS], avg[SW_SOCKET], rat);
}

static void on_signal(int sig)
{
  coll_signal = sig;
}

int main(int argc, char **argv)
{
  if (parse_args(argc, argv)) return 2;
  coll_shm = ps_proc_shared_map(sizeof(*coll_shm));
  if (!coll_shm) {
    fprintf(stderr, "perseus_coll_perf: mmap: %s\n", strerror(errno));
    return 1;
  }
  ps_proc_catch_signals(on_signal);

  double t0 = coll_now_s(), deadline = t0 + coll_cfg.timeout_s;
  char date[64], host[256] = "?", ncclpath[PATH_MAX] = "?";
  time_t tt = time(NULL);
  strftime(date, sizeof(date), "%Y-%m-%d %H:%M:%S %Z", localtime(&tt));
  gethostname(host, sizeof(host) - 1);
  ps_dl_find("libnccl.so", ncclpath, sizeof(ncclpath));
  printf("# perseus_coll_perf %s: NCCL with the perseus plugin vs NCCL's Socket transport\n",
         PS_VERSION);
  printf("# date %s, host %s\n", date, host);

  int timed_out = 0;
  if (coll_spawn(-1, 1, deadline, &timed_out)) {
    fprintf(stderr, "perseus_coll_perf: cannot use the GPUs (see above)\n");
    return 1;
  }
  if (coll_shm->ndev < 1) {
    fprintf(stderr, "perseus_coll_perf: no CUDA GPU visible\n");
    return 1;
  }
  if (coll_cfg.ngpus == 0)
    coll_cfg.ngpus = coll_shm->ndev < PS_MAX_GPUS ? coll_shm->ndev : PS_MAX_GPUS;
  if (coll_cfg.ngpus > coll_shm->ndev) {
    fprintf(stderr, "perseus_coll_perf: -g %d but only %d GPU(s) visible\n", coll_cfg.ngpus,
            coll_shm->ndev);
    return 1;
  }
  int nv = coll_shm->nccl_ver, rv = coll_shm->runtime_ver, dv = coll_shm->driver_ver;
  printf("# NCCL %d.%d.%d (%s; built against %d.%d.%d), CUDA runtime %d.%d, driver %d.%d\n",
         nv / 10000, nv / 100 % 100, nv % 100, ncclpath, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH,
         rv / 1000, rv % 1000 / 10, dv / 1000, dv % 1000 / 10);
  for (int d = 0; d < coll_cfg.ngpus; d++)
    printf("# rank %d: GPU %d %s (sm_%d%d, %.0f GiB)\n", d, d, coll_shm->gpu_name[d],
           coll_shm->gpu_major[d], coll_shm->gpu_minor[d],
           coll_shm->gpu_mem[d] / (double)(1 << 30));
  if (getenv("CUDA_VISIBLE_DEVICES"))
    printf("# CUDA_VISIBLE_DEVICES=%s\n", getenv("CUDA_VISIBLE_DEVICES"));
  static const char *const avg_names[4] = {"rank 0 only", "average over ranks",
                                           "min over ranks", "max over ranks"};
  printf("# nGpus %d, minBytes %zu, maxBytes %zu, step factor %zu, iters %d, warmup %d, "
         "check %d, timeout %d s; time per iteration from cudaEvents, %s\n",
         coll_cfg.ngpus, coll_cfg.min_bytes, coll_cfg.max_bytes, coll_cfg.factor, coll_cfg.iters,
         coll_cfg.warmup, coll_cfg.check, coll_cfg.timeout_s, avg_names[coll_cfg.avg_mode]);
  printf("# env (both): NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 "
         "NCCL_SOCKET_IFNAME=%s PERSEUS_IFACE=%s PERSEUS_PROVIDER=%s\n",
         coll_cfg.iface, coll_cfg.iface, coll_cfg.provider);
  if (coll_cfg.sweep_on[SW_PERSEUS])
    printf("# env (perseus): NCCL_NET=Perseus NCCL_NET_PLUGIN=%s\n", coll_cfg.plugin);
  if (coll_cfg.sweep_on[SW_SOCKET])
    printf("# env (socket): NCCL_NET=Socket NCCL_NET_PLUGIN=none\n");
  if (coll_cfg.ngpus == 1) printf("# note: 1 rank moves no data over the network; busbw is 0\n");

  int failed = 0;
  for (int sw = 0; sw < SW_N; sw++) {
    if (!coll_cfg.sweep_on[sw]) continue;
    if (timed_out || coll_signal) {
      fprintf(stderr, "perseus_coll_perf: sweep %s not run\n", coll_sweep_names[sw]);
      break;
    }
    fflush(stdout);
    fprintf(stderr, "# sweep %s: %d ranks\n", coll_sweep_names[sw], coll_cfg.ngpus);
    if (coll_spawn(sw, coll_cfg.ngpus, deadline, &timed_out)) {
      fprintf(stderr, "perseus_coll_perf: sweep %s failed; its results are incomplete\n",
              coll_sweep_names[sw]);
      failed = 1;
    }
  }

  long long wrong = 0;
  for (int c = 0; c < C_N; c++)
    if (coll_cfg.coll_on[c]) print_table(c, &wrong);
  printf("#\n# Out of bounds values : %lld %s\n", wrong,
         !coll_cfg.check ? "(not checked)" : wrong ? "FAILED" : "OK");
  printf("# total time %.1f s%s\n", coll_now_s() - t0,
         failed ? "; ERROR: a sweep failed or timed out, see stderr" : "");
  fflush(stdout);
  return failed || wrong ? 1 : 0;
}
