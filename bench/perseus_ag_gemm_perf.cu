/* perseus_ag_gemm_perf: AllGather+GEMM, A's M rows split over the GPUs,
 * B (K x N, stored [N][K]) on every one, C = A x B on every one. The
 * baseline is the bulk-synchronous way: ncclAllGather of the shards (padded
 * to equal rows) and one cuBLAS GEMM. Against it the fused operator
 * (<perseus/ag_gemm.h>), one kernel a step, pushing the rows into the
 * peers' windows or (NVLink) leaving them for the peers to pull. Columns,
 * per shape: cuBLAS alone on the gathered A (no communication: the floor
 * the baseline's GEMM sets), the baseline, push, pull, baseline over the
 * faster fused, TFLOP/s of cuBLAS alone and of the faster fused, and #wrong
 * of push/pull against the baseline's C (bf16 tolerance). Times are per
 * step, -n steps back to back after a host barrier, rank 0's median over -r
 * reps. One forked process per GPU; -p lsa: NCCL over NVLink; -p gin: P2P
 * off, the all-gather and the pushes cross perseus. Exit: 0 ran, 1 failure,
 * 77 no GPU. */
#include <algorithm>
#include <math.h>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include "opts.h"
#include "place_hash.cuh"
#include <perseus/ag_gemm.h>

#include "ps_ag_gemm.h"
#include "ps_moe_ref.h" /* ps_bf16_to_float */
#include "tile_comm.cuh"

#define AP_MAX 8

struct ap_cfg {
  int ngpus, iters, warmup, reps, path, watchdog_s;
  int nm, m[AP_MAX], nk, k[AP_MAX];
  uint64_t seed;
};

static double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/* rows x cols bf16 in [-1, 1) from a hash of (what, first_row + row, col). */
__global__ void ap_fill(__nv_bfloat16 *p, uint64_t seed, int what, size_t first_row, size_t rows, size_t cols)
{
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * cols; i += (size_t)gridDim.x * blockDim.x) {
    p[i] = __float2bfloat16(ps_place_value(seed ^ ((uint64_t)what << 62) ^ ((first_row + i / cols) << 24) ^ (i % cols)));
  }
}

/* Elements of `got` ([M][N]) off the baseline's C (row i of C at row
 * owner * P + (i - owner's start) of `base`) by more than two bf16 steps of
 * the larger plus 1/64: two fp32-accumulated results differ by their
 * summation order only, far below that; a wrong or missing row is off by
 * the size of C's elements. */
static long long ap_wrong(const std::vector<uint16_t> &got, const std::vector<uint16_t> &base, int M, int N, int R,
                          int P)
{
  long long bad = 0;
  for (int r = 0; r < R; r++) {
    int s, e;
    ps_ag_gemm_shard(M, R, r, &s, &e);
    for (int i = s; i < e; i++)
      for (int j = 0; j < N; j++) {
        const float x = ps_bf16_to_float(got[(size_t)i * N + j]);
        const float y = ps_bf16_to_float(base[((size_t)r * P + i - s) * N + j]);
        if (!(fabsf(x - y) <= ldexpf(fmaxf(fabsf(x), fabsf(y)), -7) + 1.f / 64)) bad++;
      }
  }
  return bad;
}

enum { AP_BLAS, AP_BASE, AP_PUSH, AP_PULL, AP_N };

static int ap_child(int rank, void *arg)
{
  const ap_cfg &c = *(const ap_cfg *)arg;
  const int R = c.ngpus;
  gc_world w;
  if (gc_world_init(&w, rank, R) != ncclSuccess) return GP_EXIT_REFUSED;
  cublasHandle_t blas;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(blas, w.stream) != CUBLAS_STATUS_SUCCESS)
    gc_die(__FILE__, __LINE__, "rank %d: cublasCreate/cublasSetStream failed", rank);
  cudaEvent_t e0, e1;
  GC_CUDA(cudaEventCreate(&e0), "rank %d", rank);
  GC_CUDA(cudaEventCreate(&e1), "rank %d", rank);
  const bool pull = c.path == TT_LSA;
  for (int ki = 0; ki < c.nk; ki++)
    for (int mi = 0; mi < c.nm; mi++) {
      const ps_ag_gemm_shape_t s = {c.m[mi], c.k[ki], c.k[ki]};
      const perseus_ag_gemm_shape_t ps = {s.m, s.n, s.k};
      const size_t M = s.m, N = s.n, K = s.k, P = (M + R - 1) / R;
      int r0, r1;
      ps_ag_gemm_shard(s.m, R, rank, &r0, &r1);
      gp_progress("ag_gemm", -1, "M %zu N %zu K %zu: the fused operators", M, N, K);
      perseus_ag_gemm_t *fused[2] = {NULL, NULL};
      for (int m = 0; m < (pull ? 2 : 1); m++)
        if (perseus_ag_gemm_create(w.comm, &ps, m, &fused[m]))
          gc_die(__FILE__, __LINE__, "fused %s: %s", m ? "pull" : "push", perseus_ag_gemm_last_error());
      __nv_bfloat16 *a, *all, *bt, *out[AP_N];
      GC_CUDA(cudaMalloc(&a, P * K * 2), "a");
      GC_CUDA(cudaMalloc(&all, R * P * K * 2), "gathered a");
      GC_CUDA(cudaMalloc(&bt, N * K * 2), "b");
      for (int x = 0; x < AP_N; x++) GC_CUDA(cudaMalloc(&out[x], R * P * N * 2), "c");
      GC_CUDA(cudaMemsetAsync(a, 0, P * K * 2, w.stream), "a");
      if (r1 > r0) ap_fill<<<1024, 256, 0, w.stream>>>(a, c.seed, 0, r0, r1 - r0, K);
      ap_fill<<<1024, 256, 0, w.stream>>>(bt, c.seed, 1, 0, N, K);
      GC_CUDA(cudaGetLastError(), "filling the inputs");
      GC_NCCL(ncclAllGather(a, all, P * K, ncclBfloat16, w.comm, w.stream), "the gathered A for cuBLAS alone");
      const float one = 1.f, zero = 0.f;
      auto gemm = [&](__nv_bfloat16 *cc) {
        const cublasStatus_t st = cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)(R * P), (int)K, &one,
                                               bt, CUDA_R_16BF, (int)K, all, CUDA_R_16BF, (int)K, &zero, cc,
                                               CUDA_R_16BF, (int)N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (st != CUBLAS_STATUS_SUCCESS)
          gc_die(__FILE__, __LINE__, "cublasGemmEx (M %zu N %zu K %zu): %s", R * P, N, K, cublasGetStatusString(st));
      };
      auto step = [&](int x) {
        if (x == AP_PUSH || x == AP_PULL) {
          if (perseus_ag_gemm_step(fused[x - AP_PUSH], (const uint16_t *)a, (const uint16_t *)bt,
                                    (uint16_t *)out[x], w.stream))
            gc_die(__FILE__, __LINE__, "fused step: %s", perseus_ag_gemm_last_error());
          return;
        }
        if (x == AP_BASE) GC_NCCL(ncclAllGather(a, all, P * K, ncclBfloat16, w.comm, w.stream), "%zu rows", P);
        gemm(out[x]);
      };
      std::vector<double> us[AP_N];
      for (int x = 0; x < (pull ? AP_N : AP_PULL); x++)
        for (int rep = -1; rep < c.reps; rep++) { /* rep -1: the warmup steps */
          gp_progress("ag_gemm", rep, "M %zu K %zu, variant %d", M, K, x);
          GC_CUDA(cudaStreamSynchronize(w.stream), "rank %d", rank);
          if (gp_barrier(R)) return 1;
          GC_CUDA(cudaEventRecord(e0, w.stream), "rank %d", rank);
          for (int i = 0; i < (rep < 0 ? c.warmup : c.iters); i++) step(x);
          GC_CUDA(cudaEventRecord(e1, w.stream), "rank %d", rank);
          GC_CUDA(cudaEventSynchronize(e1), "rank %d", rank);
          float ms = 0;
          GC_CUDA(cudaEventElapsedTime(&ms, e0, e1), "rank %d", rank);
          if (rep >= 0) us[x].push_back(ms * 1e3 / c.iters);
        }
      if (rank == 0) {
        std::vector<uint16_t> base(R * P * N), got(M * N);
        GC_CUDA(cudaMemcpy(base.data(), out[AP_BASE], base.size() * 2, cudaMemcpyDeviceToHost), "c");
        long long bad[2] = {-1, -1};
        for (int m = 0; m < (pull ? 2 : 1); m++) {
          GC_CUDA(cudaMemcpy(got.data(), out[AP_PUSH + m], got.size() * 2, cudaMemcpyDeviceToHost), "c");
          bad[m] = ap_wrong(got, base, s.m, s.n, R, (int)P);
        }
        const double bl = median(us[AP_BLAS]), bs = median(us[AP_BASE]), ph = median(us[AP_PUSH]);
        const double pl = pull ? median(us[AP_PULL]) : 0, best = pull && pl < ph ? pl : ph;
        const double flop = 2.0 * M * N * K;
        char pull_col[16] = "-", wrong[40];
        if (pull) snprintf(pull_col, sizeof pull_col, "%.1f", pl);
        if (pull) snprintf(wrong, sizeof wrong, "%lld/%lld", bad[0], bad[1]);
        else snprintf(wrong, sizeof wrong, "%lld/-", bad[0]);
        printf("%6zu %6zu %6zu %5d %9.1f %9.1f %9.1f %9s %7.2f %7.1f %7.1f %10s\n", M, N, K, R, bl, bs, ph, pull_col,
               bs / best, flop / bl * 1e-6, flop / best * 1e-6, wrong);
        fflush(stdout);
      }
      for (int m = 0; m < 2; m++) perseus_ag_gemm_destroy(fused[m]);
      cudaFree(a), cudaFree(all), cudaFree(bt);
      for (int x = 0; x < AP_N; x++) cudaFree(out[x]);
    }
  cublasDestroy(blas);
  gc_world_destroy(&w);
  return 0;
}

static void ap_usage(FILE *f)
{
  fprintf(f,
          "usage: perseus_ag_gemm_perf [-g GPUS] [-p lsa|gin] [-m ROWS] [-k SIZES] [-n STEPS] [-w WARMUP] [-r REPS]\n"
          "         [-s SEED] [-W SECS]\n"
          "  -g GPUs, one process each (0: every visible one; at least 1)\n"
          "  -p lsa: NCCL over NVLink; gin: P2P off, NCCL and the pushes through perseus\n"
          "  -m comma-separated M (rows of A over all ranks, 1..65536)\n"
          "  -k comma-separated K = N (multiples of 64, 64..65536)\n"
          "  -n steps back to back per timed rep (default 10), -w warmup steps, -r timed reps (median)\n");
}

int main(int argc, char **argv)
{
  static ap_cfg c;
  const char *mlist = NULL, *klist = NULL;
  static const char *const paths[] = {"lsa", "gin"};
  static const int path_values[] = {TT_LSA, TT_GIN};
  const ps_opt_t opts[] = {
      PS_OPT_INT('g', &c.ngpus, "0", 0, GP_MAX_RANKS),
      PS_OPT_NAME('p', &c.path, "lsa", paths, path_values, 2),
      PS_OPT_STR('m', &mlist, "32,128,512,2048,8192"),
      PS_OPT_STR('k', &klist, "4096,8192"),
      PS_OPT_INT('n', &c.iters, "10", 1, 1 << 20),
      PS_OPT_INT('w', &c.warmup, "3", 0, 1 << 20),
      PS_OPT_INT('r', &c.reps, "5", 1, 1000),
      PS_OPT_SEED('s', &c.seed, "1"),
      PS_OPT_INT('W', &c.watchdog_s, "120", 1, 86400),
  };
  ps_opts_parse(argc, argv, "perseus_ag_gemm_perf", opts, PS_OPTS_N(opts), ap_usage, 1);
  c.nm = gp_parse_int_list(mlist, 1, 65536, c.m, AP_MAX);
  c.nk = gp_parse_int_list(klist, 64, 65536, c.k, AP_MAX);
  if (c.nm < 1 || c.nk < 1) {
    fprintf(stderr, "perseus_ag_gemm_perf: bad -%c '%s': expected up to %d comma-separated numbers in %s\n",
            c.nm < 1 ? 'm' : 'k', c.nm < 1 ? mlist : klist, AP_MAX, c.nm < 1 ? "1..65536" : "64..65536");
    return 2;
  }
  for (int i = 0; i < c.nk; i++)
    if (c.k[i] % 64) {
      fprintf(stderr, "perseus_ag_gemm_perf: -k %d: expected a multiple of 64\n", c.k[i]);
      return 2;
    }
  if (gp_init("perseus_ag_gemm_perf")) return 1;
  int rc = tt_start(c.path, 0, 1, &c.ngpus, c.watchdog_s, 1);
  if (rc >= 0) return rc;
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  printf("# machine: host %s, %d GPUs:", host, c.ngpus);
  gc_print_rank_gpus(c.ngpus);
  printf("\n# path %s, %d reps of %d steps back to back (+%d warmup steps), seed %llu; us per step, rank 0's\n"
         "# median rep. cublas: the GEMM alone on the gathered A; baseline: ncclAllGather + cuBLAS; push/pull:\n"
         "# the fused operator; speedup: baseline / the faster fused; #wrong: push/pull against the baseline\n",
         tt_path_names[c.path], c.reps, c.iters, c.warmup, (unsigned long long)c.seed);
  printf("# %4s %6s %6s %5s %9s %9s %9s %9s %7s %7s %7s %10s\n", "M", "N", "K", "ranks", "cublas", "baseline",
         "push", "pull", "speedup", "TF/cub", "TF/fus", "#wrong");
  int codes[GP_MAX_RANKS];
  return gp_run(c.ngpus, 0, ap_child, &c, c.watchdog_s, "ag_gemm perf", NULL, NULL, codes) ? 1 : 0;
}
