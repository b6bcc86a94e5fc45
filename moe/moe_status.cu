/* moe_status.cu: the host side of perseus' fused MoE layer that is about
 * its health and what it reports: the config's agreement across ranks, the
 * kernel's faults (moe_peers.cuh) and the host's abort, the profile and the
 * routing of the last forward. */
#include "ps_op_host.h"
#include "ps_moe_layer.h"

/* Every rank's config valid and the same (ps_moe_agree_check), before any
 * collective whose sizes come from it: ranks that disagree would register
 * windows of different sizes and compute offsets in each other's windows
 * from different layouts. A rank whose config is refused still takes part,
 * so that every rank returns instead of waiting in a collective (unless
 * CUDA fails here before the all-reduce: then the others wait in it). */
ncclResult_t ps_moe_agree(perseus_moe *m)
{
  long long ms = 0; /* the environment counts as config: a bad value fails every rank */
  const int valid = perseus_moe_check_config(&m->cfg, m->nranks) == 0 &&
                    ps_moe_env_tile_rows(&m->tile_rows) == 0 && ps_moe_env_timeout_ms(&ms) == 0;
  m->args.timeout_ns = (unsigned long long)ms * 1000000ull;
  char why[512];
  snprintf(why, sizeof(why), "%s", perseus_moe_last_error());
  int64_t v[2 * PS_MOE_AGREE_FIELDS];
  ps_moe_agree_pack(&m->cfg, valid, v);
  char err[512];
  if (ps_agree_reduce(m->comm, v, 2 * PS_MOE_AGREE_FIELDS, err, sizeof err)) {
    ps_moe_set_error("%s", err);
    return ncclUnhandledCudaError;
  }
  if (!valid) {
    ps_moe_set_error("%s", why);
    return ncclInvalidArgument;
  }
  return ps_moe_agree_check(&m->cfg, m->nranks, v) ? ncclInvalidUsage : ncclSuccess;
}

ncclResult_t ps_moe_ctl_create(perseus_moe *m)
{
  PS_MOE_CUDA(cudaHostAlloc((void **)&m->ctl, sizeof(ps_moe_ctl), cudaHostAllocMapped),
              "rank %d: %zu bytes of mapped host memory", m->rank, sizeof(ps_moe_ctl));
  memset((void *)m->ctl, 0, sizeof(ps_moe_ctl));
  PS_MOE_CUDA(cudaHostGetDevicePointer((void **)&m->args.ctl, m->ctl, 0), "rank %d", m->rank);
  /* the test hooks off (ps_moe_test_header, ps_moe_test_rows) */
  m->args.test_hdr_j = -1, m->args.test_hdr_skip = -1, m->args.test_rows_skip = -1;
  return ncclSuccess;
}

ncclResult_t ps_moe_fault_check(const perseus_moe *m)
{
  ps_moe_ctl *ctl = m->ctl;
  if (!ctl) return ncclSuccess;
  /* acquire: the fields the kernel wrote before `set` */
  const int set = __atomic_load_n(&ctl->set, __ATOMIC_ACQUIRE);
  if (!set && !__atomic_load_n(&ctl->abort, __ATOMIC_ACQUIRE)) return ncclSuccess;
  if (!set) { /* aborted while no forward waited */
    ps_moe_set_error("rank %d: the layer was aborted (perseus_moe_abort) and cannot run further "
                     "forwards: destroy it", m->rank);
    return ncclRemoteError;
  }
  const ps_moe_fault_t f = ctl->f;
  char text[480];
  ps_moe_fault_text(text, sizeof(text), m->rank, &f, m->args.timeout_ns / 1000000ull);
  ps_moe_set_error("%s", text);
  return ncclRemoteError;
}

extern "C" ncclResult_t perseus_moe_abort(perseus_moe_t *m)
{
  ps_moe_clear_error();
  if (!m || !m->ctl) {
    ps_moe_set_error("perseus_moe_abort: the layer is NULL or was not created");
    return ncclInvalidArgument;
  }
  __atomic_store_n(&m->ctl->abort, 1, __ATOMIC_RELEASE);
  return ncclSuccess;
}

/* Tests only (not exported from libperseus_moe.so): the header this rank
 * sends every destination announces `count` rows for local expert j (-1:
 * none), and is withheld from rank `skip` (-1: from none, -2: from all). */
extern "C" void ps_moe_test_header(perseus_moe_t *m, int j, int count, int skip)
{
  m->args.test_hdr_j = j, m->args.test_hdr_count = count, m->args.test_hdr_skip = skip;
}

/* Tests only: this rank's routed rows for rank `skip` are not sent (-1: all
 * are), its header still is. */
extern "C" void ps_moe_test_rows(perseus_moe_t *m, int skip) { m->args.test_rows_skip = skip; }

extern "C" ncclResult_t perseus_moe_last_profile(perseus_moe_t *m, perseus_moe_profile_t *out)
{
  ps_moe_clear_error();
  if (!m || !out) {
    ps_moe_set_error("perseus_moe_last_profile: a NULL argument");
    return ncclInvalidArgument;
  }
  memset(out, 0, sizeof(*out));
  PS_MOE_CUDA(cudaEventSynchronize(m->done), "the last forward");
  unsigned long long fwd = 0; /* forwards completed, replays of a graph included */
  PS_MOE_CUDA(cudaMemcpy(&fwd, m->args.st.fwd, sizeof(fwd), cudaMemcpyDeviceToHost), "the count");
  if (fwd == 0) return ncclSuccess;
  const int RL = m->nranks * m->L;
  unsigned long long prof[3 * PS_PROF_N]; /* both halves and the sums, in one copy */
  const unsigned long long *t = prof + ((fwd - 1) & 1) * PS_PROF_N, *sums = prof + PS_PROF_SUMS;
  int *cnt = (int *)malloc(2 * (size_t)RL * sizeof(int));
  if (!cnt) {
    ps_moe_set_error("perseus_moe_last_profile: out of host memory");
    return ncclSystemError;
  }
  cudaError_t e = cudaMemcpy(prof, m->args.prof, sizeof(prof), cudaMemcpyDeviceToHost);
  if (e == cudaSuccess)
    e = cudaMemcpy(cnt, m->args.st.rcnt, RL * sizeof(int), cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) /* what we sent: the headers we wrote */
    e = cudaMemcpy(cnt + RL, (char *)m->win_ptr + m->args.off_hdr_out, RL * sizeof(int),
                   cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    free(cnt);
    PS_MOE_CUDA(e, "reading the profile");
  }
  auto us = [&](int a, int b) { return t[b] > t[a] ? (double)(t[b] - t[a]) / 1e3 : 0.0; };
  out->total_us = us(PS_PROF_START, PS_PROF_COMBINE);
  out->route_us = us(PS_PROF_START, PS_PROF_ROUTE);
  out->dispatch_us = us(PS_PROF_ROUTE, PS_PROF_DISPATCH);
  out->wait_us = us(PS_PROF_DISPATCH, PS_PROF_HEADERS);
  out->experts_us = us(PS_PROF_HEADERS, PS_PROF_EXPERTS);
  out->combine_us = us(PS_PROF_EXPERTS, PS_PROF_COMBINE);
  const int grid = t[PS_PROF_GRID] ? (int)t[PS_PROF_GRID] : 1, tokens = (int)t[PS_PROF_TOKENS];
  out->wait_rows_us = (double)sums[PS_PROF_WAIT_ROWS] / 1e3 / grid;
  out->wait_gemm1_us = (double)sums[PS_PROF_WAIT_GEMM1] / 1e3 / grid;
  out->wait_combine_us = tokens ? (double)sums[PS_PROF_WAIT_COMBINE] / 1e3 / tokens : 0;
  out->run_gemm1_us = (double)sums[PS_PROF_RUN_GEMM1] / 1e3 / grid;
  out->run_gemm2_us = (double)sums[PS_PROF_RUN_GEMM2] / 1e3 / grid;
  out->experts_end_us = (double)sums[PS_PROF_EXPERTS_END] / 1e3 / grid;
  out->grid = grid;
  out->tile_rows = (int)t[PS_PROF_TILE_ROWS];
  out->wgmma = t[PS_PROF_WGMMA] == 2;
  for (int j = 0; j < m->L; j++) {
    long long rows = 0;
    for (int s = 0; s < m->nranks; s++) rows += cnt[s * m->L + j];
    out->rows_in += rows;
    out->active_experts += rows > 0;
  }
  for (int i = 0; i < RL; i++) out->rows_out += cnt[RL + i];
  out->gemm_flops = 2.0 * (double)out->rows_in * 3.0 * m->cfg.hidden * m->cfg.ffn;
  free(cnt);
  return ps_moe_fault_check(m);
}

extern "C" ncclResult_t perseus_moe_routing(perseus_moe_t *m, const int32_t **expert,
                                            const float **weight)
{
  ps_moe_clear_error();
  if (!m || !expert || !weight) {
    ps_moe_set_error("perseus_moe_routing: a NULL argument");
    return ncclInvalidArgument;
  }
  *expert = m->args.st.topk_idx, *weight = m->args.st.topk_w;
  return ncclSuccess;
}

