/* perseus_net_perf: send/recv bandwidth and latency through the plugin's
 * NCCL ABI, ranks forked on one host (nccl-tests conventions).
 *
 * sendrecv: every rank sends `size` bytes to rank+1 and receives from rank-1
 *   per iteration, cut into chunks with up to -W in flight, as NCCL's proxy
 *   pipelines a transfer through its staging slots.
 * pingpong: rank 0 and 1 bounce one message; time is half the round trip. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "opts.h"
#include "ps_driver.h"

typedef struct {
  size_t minb, maxb, chunk;
  double factor;
  int iters, warmup, check, window, mode; /* mode: 1 sendrecv, 2 pingpong, 3 both */
} opts_t;

#define MAX_ROWS 64
typedef struct {
  size_t size;
  double us;
  long wrong;
} row_t;
typedef struct {
  int nrows[2];
  row_t rows[2][MAX_ROWS];
  int failed;
} results_t;

static void *reg(drv_rank_t *r, void *comm, void *buf, size_t n) {
  void *mh = NULL;
  if (r->net.reg_mr(comm, buf, n, NCCL_PTR_HOST, &mh) != ncclSuccess) {
    fprintf(stderr, "rank %d: regMr failed\n", r->rank);
    exit(1);
  }
  return mh;
}

/* Moves `size` bytes from sbuf to `to` and into rbuf from `from`, chunked,
 * with at most `window` chunks in flight per direction. */
static int transfer(drv_rank_t *r, int to, int from, char *sbuf, void *smh, char *rbuf, void *rmh,
                    size_t size, const opts_t *o) {
  size_t chunk = o->chunk < size ? o->chunk : (size ? size : 0);
  size_t nchunks = size ? (size + chunk - 1) / chunk : 1;
  void *sreq[64] = {0}, *rreq[64] = {0};
  size_t sent = 0, posted = 0, sdone = 0, rdone = 0;
  int W = o->window;
  double end = drv_now() + 120;
  while (sdone < (to >= 0 ? nchunks : 0) || rdone < (from >= 0 ? nchunks : 0)) {
    if (drv_now() > end) {
      fprintf(stderr, "rank %d: transfer of %zu B stalled\n", r->rank, size);
      return -1;
    }
    while (from >= 0 && posted < nchunks && posted - rdone < (size_t)W) {
      int s = (int)(posted % (size_t)W), tag = (int)(posted % (size_t)W);
      size_t off = posted * chunk, n = size ? (size - off < chunk ? size - off : chunk) : 0;
      void *d = rbuf + off;
      if (r->net.irecv(r->recv[from], 1, &d, &n, &tag, &rmh, &rreq[s]))
        return fprintf(stderr, "rank %d: irecv of %zu B from rank %d failed\n", r->rank, n, from), -1;
      if (!rreq[s]) break;
      posted++;
    }
    while (to >= 0 && sent < nchunks && sent - sdone < (size_t)W) {
      int s = (int)(sent % (size_t)W), tag = (int)(sent % (size_t)W);
      size_t off = sent * chunk, n = size ? (size - off < chunk ? size - off : chunk) : 0;
      if (r->net.isend(r->send[to], sbuf + off, n, tag, smh, &sreq[s]))
        return fprintf(stderr, "rank %d: isend of %zu B to rank %d failed\n", r->rank, n, to), -1;
      if (!sreq[s]) break;
      sent++;
    }
    /* complete in order, as NCCL's proxy consumes its slots */
    int done = 0;
    if (to >= 0 && sdone < sent) {
      if (r->net.test(sreq[sdone % (size_t)W], &done, NULL))
        return fprintf(stderr, "rank %d: a send of %zu B to rank %d failed\n", r->rank, size, to), -1;
      if (done) sdone++;
    }
    if (from >= 0 && rdone < posted) {
      if (r->net.test(rreq[rdone % (size_t)W], &done, NULL))
        return fprintf(stderr, "rank %d: a receive of %zu B from rank %d failed\n", r->rank, size, from), -1;
      if (done) rdone++;
    }
  }
  return 0;
}

typedef struct {
  int to, from;
  char *sbuf, *rbuf;
  void *smh, *rmh;           /* ring: send to `to`, receive from `from` */
  void *smh_back, *rmh_back; /* pingpong: rank 1 echoes rbuf back to rank 0 */
} bufs_t;

/* One iteration: mode 0 the ring exchange; mode 1 a round trip 0 -> 1 -> 0. */
static int one_iter(drv_rank_t *r, int mode, const bufs_t *b, size_t n, const opts_t *o) {
  if (mode == 0) return transfer(r, b->to, b->from, b->sbuf, b->smh, b->rbuf, b->rmh, n, o);
  if (r->rank == 0)
    return transfer(r, 1, -1, b->sbuf, b->smh, NULL, NULL, n, o) ||
           transfer(r, -1, 1, NULL, NULL, b->rbuf, b->rmh_back, n, o);
  if (r->rank == 1)
    return transfer(r, -1, 0, NULL, NULL, b->rbuf, b->rmh, n, o) ||
           transfer(r, 0, -1, b->rbuf, b->smh_back, NULL, NULL, n, o);
  return 0;
}

static int run_rank(drv_rank_t *r, void *arg) {
  const opts_t *o = arg;
  results_t *res = r->user;
  int P = r->nranks, me = r->rank;
  size_t cap = o->maxb + 1;
  bufs_t b = {.to = (me + 1) % P, .from = (me + P - 1) % P, .sbuf = malloc(cap), .rbuf = malloc(cap)};
  if (!b.sbuf || !b.rbuf) {
    fprintf(stderr, "rank %d: out of memory for 2 x %zu B of buffers (-e %zu)\n", me, cap, o->maxb);
    return 1;
  }
  b.smh = reg(r, r->send[b.to], b.sbuf, cap);
  b.rmh = reg(r, r->recv[b.from], b.rbuf, cap);
  if (me == 1) b.smh_back = reg(r, r->send[0], b.rbuf, cap);
  if (me == 0) b.rmh_back = reg(r, r->recv[1], b.rbuf, cap);
  for (int mode = 0; mode < 2; mode++) {
    if (!(o->mode & (1 << mode))) continue;
    int row = 0;
    for (size_t n = o->minb; n <= o->maxb && row < MAX_ROWS; row++) {
      long wrong = 0;
      if (o->check) { /* one verified transfer first, untimed */
        drv_fill(b.sbuf, n, (uint64_t)n ^ (uint64_t)me << 40);
        memset(b.rbuf, 0, n);
        if (one_iter(r, mode, &b, n, o)) return 1;
        /* ring: the data came from `from`; pingpong: rank 0 gets its own back */
        uint64_t id = (uint64_t)n ^ (uint64_t)(mode == 0 ? b.from : me) << 40;
        if (mode == 0 || me == 0) wrong = drv_count_wrong(b.rbuf, n, id);
      }
      if (drv_barrier(r, 60)) return 1;
      double t0 = 0;
      for (int it = -o->warmup; it < o->iters; it++) {
        if (it == 0) t0 = drv_now();
        if (one_iter(r, mode, &b, n, o)) return 1;
      }
      double us = (drv_now() - t0) * 1e6 / o->iters / (mode == 1 ? 2 : 1);
      if (me == 0) res->rows[mode][row] = (row_t){.size = n, .us = us, .wrong = wrong};
      if (drv_barrier(r, 60)) return 1;
      size_t next = (size_t)((double)n * o->factor);
      n = next > n ? next : n + 1;
    }
    if (me == 0) res->nrows[mode] = row;
  }
  return 0;
}

static void print_header(const opts_t *o, int nranks, int version) {
  char host[512];
  drv_describe_host(host, sizeof host);
  printf("# perseus_net_perf: %d ranks on %s\n", nranks, host);
  printf("# plugin ABI v%d, provider %s, iface %s, chunk %zu B, window %d, iters %d, warmup %d\n",
         version, getenv("PERSEUS_PROVIDER"), getenv("PERSEUS_IFACE"), o->chunk, o->window, o->iters,
         o->warmup);
}

/* Every rank's send and receive buffers of -e + 1 bytes must fit the host's
 * memory: past it ranks connect and then fail, or are killed touching
 * memory malloc promised. Below 2^47 within the options' bounds. */
static int check_memory(const opts_t *o, int nranks) {
  size_t total = 2 * (size_t)nranks * (o->maxb + 1);
  size_t mem = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
  if (total <= mem) return 0;
  fprintf(stderr, "-e/-r: buffers of %zu bytes in all (%d ranks x 2 x %zu B), more than this "
          "host's %zu bytes of memory: lower -e or -r\n", total, nranks, o->maxb + 1, mem);
  return -1;
}

static void usage(FILE *f, const char *argv0) {
  fprintf(f, "usage: %s [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-c 0|1] [-r RANKS]\n"
         "          [-t sendrecv|pingpong|all] [-C CHUNK] [-W WINDOW] [-v ABI] [-P PLUGIN]\n"
         "Defaults: -b 8 -e 64M -f 2 -n 20 -w 5 -c 1 -r 2 -t all -C 512K -W 8 -v 12;\n"
         "provider tcp;ofi_rxm on interface lo unless PERSEUS_PROVIDER/PERSEUS_IFACE say otherwise.\n",
         argv0);
}

int main(int argc, char **argv) {
  opts_t o = {.minb = 8, .maxb = 64u << 20, .chunk = 512u << 10, .factor = 2, .iters = 20,
              .warmup = 5, .check = 1, .window = 8, .mode = 3};
  drv_opts_t d = {.nranks = 2, .version = 12, .timeout_s = 3600};
  int c;
  while ((c = getopt_long(argc, argv, "b:e:f:n:w:c:r:t:C:W:v:P:h", ps_help_longopts, NULL)) != -1) {
    switch (c) {
      case 'b': o.minb = drv_parse_size("-b", optarg, 0, (size_t)1 << 40); break;
      case 'e': o.maxb = drv_parse_size("-e", optarg, 0, (size_t)1 << 40); break;
      case 'f': o.factor = drv_parse_factor("-f", optarg, 1024); break;
      case 'n': o.iters = drv_parse_int("-n", optarg, 1, 1 << 24); break;
      case 'w': o.warmup = drv_parse_int("-w", optarg, 0, 1 << 24); break;
      case 'c': o.check = drv_parse_int("-c", optarg, 0, 1); break;
      case 'r': d.nranks = drv_parse_int("-r", optarg, 2, 32); break;
      case 'C': o.chunk = drv_parse_size("-C", optarg, 1, (size_t)1 << 30); break; /* a message's most */
      case 'W': o.window = drv_parse_int("-W", optarg, 1, 64); break;
      case 'v': d.version = drv_parse_int("-v", optarg, 8, 12); break;
      case 'P': d.plugin = drv_parse_plugin("-P", optarg); break;
      case 't':
        o.mode = !strcmp(optarg, "sendrecv") ? 1 : !strcmp(optarg, "pingpong") ? 2
               : !strcmp(optarg, "all") ? 3 : 0;
        if (!o.mode) {
          fprintf(stderr, "-t '%s': expected sendrecv, pingpong or all\n", optarg);
          return 2;
        }
        break;
      case 'h': usage(stdout, argv[0]); return 0;
      default: usage(stderr, argv[0]); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "unexpected argument '%s' (see -h)\n", argv[optind]);
    return 2;
  }
  if (o.minb > o.maxb) {
    fprintf(stderr, "-b %zu is larger than -e %zu (expected -b <= -e)\n", o.minb, o.maxb);
    return 2;
  }
  int sizes = 0; /* the sweep must fit the table: no size dropped unsaid */
  for (size_t n = o.minb; n <= o.maxb; sizes++) {
    size_t next = (size_t)((double)n * o.factor);
    n = next > n ? next : n + 1;
  }
  if (sizes > MAX_ROWS) {
    fprintf(stderr, "-b %zu -e %zu -f %.10g give %d sizes, at most %d: raise -f or narrow -b..-e\n",
            o.minb, o.maxb, o.factor, sizes, MAX_ROWS);
    return 2;
  }
  if (check_memory(&o, d.nranks)) return 2;
  drv_default_fabric(); /* the embedded default: loopback TCP */
  d.shared_bytes = sizeof(results_t);
  print_header(&o, d.nranks, d.version);
  results_t *res = calloc(1, sizeof *res); /* rank 0 fills the shared copy */
  d.collect = res;
  int rc = res ? drv_run(&d, run_rank, &o) : -1;
  if (rc) {
    fprintf(stderr, "perseus_net_perf: a rank failed\n");
    return 1;
  }
  const char *names[2] = {"sendrecv (ring, every rank sends and receives)",
                          "pingpong (rank 0 <-> 1, half round trip)"};
  double bw_sum = 0;
  int bw_n = 0;
  long wrong_total = 0;
  for (int mode = 0; mode < 2; mode++) {
    if (!(o.mode & (1 << mode))) continue;
    printf("#\n# %s\n", names[mode]);
    printf("# %12s %12s %6s %10s %10s %10s %8s\n", "size", "count", "type", "time(us)", "algbw(GB/s)",
           "busbw(GB/s)", "#wrong");
    for (int i = 0; i < res->nrows[mode]; i++) {
      row_t *w = &res->rows[mode][i];
      double algbw = w->us > 0 ? (double)w->size / w->us / 1e3 : 0;
      char wrong[24] = "N/A";
      if (o.check) snprintf(wrong, sizeof wrong, "%ld", w->wrong);
      printf("  %12zu %12zu %6s %10.2f %10.3f %10.3f %8s\n", w->size, w->size, "int8", w->us, algbw,
             algbw, wrong);
      if (mode == 0) bw_sum += algbw, bw_n++;
      wrong_total += w->wrong;
    }
  }
  if (bw_n) printf("# Out of bounds values : %ld %s\n# Avg bus bandwidth    : %.3f\n#\n", wrong_total,
                   wrong_total ? "FAILED" : "OK", bw_sum / bw_n);
  free(res);
  return wrong_total ? 1 : 0;
}
