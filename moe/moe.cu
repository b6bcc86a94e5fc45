/* moe.cu: the host side of perseus' fused MoE layer (include/perseus/moe.h):
 * windows, device communicator, weights, and the cooperative launch of the
 * persistent forward kernel (moe_kernel.cuh). */
#include "moe_kernel.cuh"
#include "ps_moe_entry.h"
#include "ps_moe_layer.h"
#include "ps_op_host.h"

/* The dispatch's segment table (2 x R x L = 2 x E ints) lives in the
 * kernel's dynamic shared memory. */
static_assert(2 * PS_MOE_MAX_EXPERTS * sizeof(int) <= PS_MOE_SMEM(64), "segment table fits");

/* The forward kernel with 64-row (i = 0) or 128-row (1) GEMM tiles. */
static const void *ps_moe_kernel(int i)
{
  return i ? (const void *)ps_moe_forward_kernel<128> : (const void *)ps_moe_forward_kernel<64>;
}
static int ps_moe_smem(int i) { return i ? PS_MOE_SMEM(128) : PS_MOE_SMEM(64); }

static size_t ps_align(size_t v) { return (v + 255) & ~(size_t)255; }

/* Carves `bytes` (aligned) from a running offset. */
static size_t ps_take(size_t *at, size_t bytes)
{
  size_t o = *at;
  *at = ps_align(o + bytes);
  return o;
}

/* The window: receive, send, combine and output rows, headers. The send
 * and output (y) rows serve GIN peers only (NVLink peers' rows are stored
 * straight into their windows): none without GIN. */
static void ps_moe_window_layout(perseus_moe *m, const ps_moe_layout_t *lay)
{
  ps_moe_args &a = m->args;
  size_t at = 0, hdr = (size_t)m->nranks * m->L * sizeof(int);
  a.off_recv = ps_take(&at, lay->recv_bytes);
  a.off_send = ps_take(&at, m->gin ? lay->send_bytes : 0);
  a.off_comb = ps_take(&at, lay->comb_bytes);
  a.off_y = ps_take(&at, m->gin ? lay->y_bytes : 0);
  a.off_hdr_out = ps_take(&at, hdr);
  a.off_hdr_in = ps_take(&at, hdr);
  a.off_done = ps_take(&at, (size_t)m->nranks * m->L * sizeof(uint64_t));
  m->win_bytes = at;
}

/* Batch handles besides the experts': control, combine, rows (ps_moe_devcomm). */
#define PS_MOE_SHARED_HANDLES 3

/* Plain device memory: state, weights, activation; one allocation. */
static ncclResult_t ps_moe_alloc_dev(perseus_moe *m, const ps_moe_layout_t *lay)
{
  const int R = m->nranks, L = m->L, E = m->cfg.experts, T = m->cfg.max_tokens, k = m->cfg.topk;
  size_t at = 0;
  size_t o_scnt = ps_take(&at, (size_t)R * L * sizeof(int)), o_soff = ps_take(&at, (size_t)R * L * sizeof(int));
  size_t o_sdone = ps_take(&at, (size_t)R * L * sizeof(int)), o_rcnt = ps_take(&at, (size_t)R * L * sizeof(int));
  size_t o_roff = ps_take(&at, (size_t)R * L * sizeof(int)), o_g1 = ps_take(&at, (size_t)L * sizeof(int));
  size_t o_g2 = ps_take(&at, (size_t)L * sizeof(int)), o_task = ps_take(&at, sizeof(int));
  size_t o_ready = ps_take(&at, sizeof(int)), o_fault = ps_take(&at, sizeof(int));
  size_t o_pfault = ps_take(&at, (size_t)R * sizeof(int)), o_abort = ps_take(&at, sizeof(int));
  size_t o_fwd = ps_take(&at, sizeof(unsigned long long));
  size_t o_aread = ps_take(&at, sizeof(unsigned long long));
  size_t o_tot = ps_take(&at, (size_t)L * R * sizeof(uint64_t)), o_totc = ps_take(&at, (size_t)R * sizeof(uint64_t));
  size_t o_totr = ps_take(&at, (size_t)R * sizeof(uint64_t)), o_dsent = ps_take(&at, (size_t)R * sizeof(int));
  size_t o_rsegs = ps_take(&at, (size_t)R * sizeof(int)), o_rdone = ps_take(&at, (size_t)R * sizeof(int));
  size_t o_logits = ps_take(&at, (size_t)T * E * sizeof(float));
  size_t o_idx = ps_take(&at, (size_t)T * k * sizeof(int32_t)), o_w = ps_take(&at, (size_t)T * k * sizeof(float));
  size_t o_slot = ps_take(&at, (size_t)T * k * sizeof(int32_t));
  size_t o_self = ps_take(&at, (size_t)m->P * sizeof(int32_t));
  /* every batch handle: the shared ones (ps_moe_devcomm), then the experts' */
  size_t o_hexp = ps_take(&at, (size_t)(PS_MOE_SHARED_HANDLES + L) * sizeof(perseus_batch_handle));
  size_t o_prof = ps_take(&at, 3 * PS_PROF_N * sizeof(unsigned long long));
  size_t o_gate = ps_take(&at, (size_t)E * m->cfg.hidden * sizeof(ps_bf16));
  size_t wexp = (size_t)L * m->cfg.ffn * m->cfg.hidden * sizeof(ps_bf16);
  size_t o_w1 = ps_take(&at, wexp), o_w3 = ps_take(&at, wexp), o_w2 = ps_take(&at, wexp);
  size_t o_act = ps_take(&at, lay->act_bytes);
  size_t free_b = 0, total_b = 0;
  PS_MOE_CUDA(cudaMemGetInfo(&free_b, &total_b), "rank %d", m->rank);
  if (at + m->win_bytes > free_b) {
    ps_moe_set_error("the layer needs %zu bytes of device memory (windows %zu, state, weights and "
                     "activation %zu), only %zu of %zu are free: lower max_tokens (%d) or use "
                     "more ranks", at + m->win_bytes, m->win_bytes, at, free_b, total_b,
                     m->cfg.max_tokens);
    return ncclInvalidArgument;
  }
  PS_MOE_CUDA(cudaMalloc(&m->dev, at), "%zu bytes", at);
  PS_MOE_CUDA(cudaMemset(m->dev, 0, at), "%zu bytes", at);
  char *d = (char *)m->dev;
  ps_moe_state &s = m->args.st;
  s.scnt = (int *)(d + o_scnt), s.soff = (int *)(d + o_soff), s.sdone = (int *)(d + o_sdone);
  s.rcnt = (int *)(d + o_rcnt), s.roff = (int *)(d + o_roff);
  s.g1done = (int *)(d + o_g1), s.g2done = (int *)(d + o_g2), s.task = (int *)(d + o_task);
  s.ready = (int *)(d + o_ready), s.fault = (int *)(d + o_fault);
  s.peer_fault = (int *)(d + o_pfault), s.aborted = (int *)(d + o_abort);
  s.tot = (uint64_t *)(d + o_tot), s.tot_c = (uint64_t *)(d + o_totc), s.tot_r = (uint64_t *)(d + o_totr);
  s.dsent = (int *)(d + o_dsent), s.rsegs = (int *)(d + o_rsegs), s.rdone = (int *)(d + o_rdone);
  s.logits = (float *)(d + o_logits), s.topk_idx = (int32_t *)(d + o_idx);
  s.topk_w = (float *)(d + o_w), s.slot = (int32_t *)(d + o_slot);
  s.self_tok = (int32_t *)(d + o_self), s.fwd = (unsigned long long *)(d + o_fwd);
  s.abort_read = (unsigned long long *)(d + o_aread);
  s.hexp = (perseus_batch_handle *)(d + o_hexp) + PS_MOE_SHARED_HANDLES;
  m->args.prof = (unsigned long long *)(d + o_prof);
  unsigned long long marks[PS_PROF_N] = {0}; /* the first forward's: min slots start high */
  marks[PS_PROF_START] = marks[PS_PROF_HEADERS] = ~0ull;
  PS_MOE_CUDA(cudaMemcpy(m->args.prof, marks, sizeof(marks), cudaMemcpyHostToDevice), "marks");
  m->args.gate = (const ps_bf16 *)(d + o_gate);
  m->args.w1 = (const ps_bf16 *)(d + o_w1), m->args.w3 = (const ps_bf16 *)(d + o_w3);
  m->args.w2 = (const ps_bf16 *)(d + o_w2);
  m->args.act = (ps_bf16 *)(d + o_act);
  return ncclSuccess;
}

/* The expert weights as 2-D tensors for TMA (ps_gemm_b): [rows][K] bf16,
 * boxes of PS_GEMM_N rows x PS_GEMM_K, the tile layout's 128-byte swizzle.
 * cuTensorMapEncodeTiled comes from the driver through the runtime, so
 * nothing links libcuda. */
static ncclResult_t ps_moe_tensor_maps(perseus_moe *m)
{
  typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void *fn = NULL;
  cudaDriverEntryPointQueryResult q;
  PS_MOE_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                               cudaEnableDefault, &q), "TMA descriptors");
  if (!fn || q != cudaDriverEntryPointSuccess) {
    ps_moe_set_error("the CUDA driver has no cuTensorMapEncodeTiled (query result %d): TMA "
                     "needs a driver of CUDA 12.0 or later", (int)q);
    return ncclSystemError;
  }
  ps_moe_args &a = m->args;
  const cuuint64_t H = (cuuint64_t)m->cfg.hidden, F = (cuuint64_t)m->cfg.ffn, L = (cuuint64_t)m->L;
  struct { CUtensorMap *map; const ps_bf16 *w; cuuint64_t k, rows; } t[3] = {
      {&a.tm_w1, a.w1, H, L * F}, {&a.tm_w3, a.w3, H, L * F}, {&a.tm_w2, a.w2, F, L * H}};
  for (int i = 0; i < 3; i++) {
    const cuuint64_t dim[2] = {t[i].k, t[i].rows}, stride[1] = {t[i].k * sizeof(ps_bf16)};
    const cuuint32_t box[2] = {PS_GEMM_K, PS_GEMM_N}, estride[2] = {1, 1};
    CUresult r = ((encode_fn)fn)(t[i].map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)t[i].w,
                                 dim, stride, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      ps_moe_set_error("cuTensorMapEncodeTiled failed (CUresult %d) for weights %d: %llu x %llu "
                       "bf16 at %p", (int)r, i, (unsigned long long)t[i].rows,
                       (unsigned long long)t[i].k, (const void *)t[i].w);
      return ncclSystemError;
    }
  }
  return ncclSuccess;
}

/* The devcomm: a control handle, a combine handle, a rows handle (a GIN
 * peer's rows in one put) and one handle per local expert, each a block of
 * nranks GIN signals (when any peer needs GIN) and per-peer counters. req
 * and h: room for m->L + PS_MOE_SHARED_HANDLES each (the caller's). */
static ncclResult_t ps_moe_devcomm(perseus_moe *m, ncclDevResourceRequirements_t *req, perseus_batch_handle *h)
{
  const int nh = m->L + PS_MOE_SHARED_HANDLES;
  ncclDevCommRequirements_t reqs;
  perseus_devcomm_requirements_init(&reqs);
  reqs.ginForceEnable = m->gin;
  reqs.ginContextCount = 1;
  ncclResult_t rc = ncclSuccess;
  for (int i = 0; i < nh && rc == ncclSuccess; i++)
    rc = perseus_batch_requirement(m->comm, 0, m->gin, &reqs, &h[i], &req[i]);
  if (rc == ncclSuccess) rc = ncclDevCommCreate(m->comm, &reqs, &m->dc);
  if (rc != ncclSuccess) {
    ps_moe_set_error("ncclDevCommCreate(%d batch handles, GIN %s) failed: %s (%s)", nh,
                     m->gin ? "forced" : "off", ncclGetErrorString(rc), ncclGetLastError(m->comm));
    return rc;
  }
  m->have_dc = 1;
  m->args.hctl = h[0], m->args.hcomb = h[1], m->args.hrows = h[2];
  /* all of them, for the reset kernel; the forward takes the shared ones as arguments */
  PS_MOE_CUDA(cudaMemcpy(m->args.st.hexp - PS_MOE_SHARED_HANDLES, h, (size_t)nh * sizeof(*h),
                         cudaMemcpyHostToDevice), "%d expert handles", m->L);
  /* a pageable copy may still be in flight on return; the reset kernel reads them */
  PS_MOE_CUDA(cudaStreamSynchronize(0), "%d expert handles", m->L);
  if (m->dc.lsaSize != m->nranks && m->dc.ginContextCount < 1) {
    ps_moe_set_error("%d of %d ranks are beyond NVLink but the devcomm has no GIN context",
                     m->nranks - m->dc.lsaSize, m->nranks);
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

/* One CTA per batch handle: this rank's counts and GIN signals back to 0
 * (perseus_batch_reset: a devcomm may get counts a destroyed one left). */
__global__ void ps_moe_reset_signals(ncclDevComm dc, const perseus_batch_handle *h)
{
  perseus_batch_reset(dc, h[blockIdx.x], threadIdx.x, blockDim.x);
}

/* The reset, then a barrier (a one-word all-reduce behind it): no peer adds
 * to our counts before they are 0. Collective, like perseus_moe_create; a
 * rank whose setup failed before (`prior`) takes part without resetting.
 * The barrier carries whether a rank failed (the maximum), so that every
 * rank fails together instead of some waiting in it. */
static ncclResult_t ps_moe_zero_signals(perseus_moe *m, ncclResult_t prior)
{
  int64_t failed = prior != ncclSuccess;
  cudaError_t ce = cudaSuccess;
  if (!failed) {
    cudaStream_t s = NULL;
    (void)cudaGetLastError(); /* an earlier, unrelated error is not the reset's */
    ce = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (ce == cudaSuccess) {
      ps_moe_reset_signals<<<m->L + PS_MOE_SHARED_HANDLES, 128, 0, s>>>(
          m->dc, m->args.st.hexp - PS_MOE_SHARED_HANDLES);
      ce = cudaGetLastError();
      if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
    failed = ce != cudaSuccess;
  }
  const int own = (int)failed;
  char err[512];
  const int reduce_failed =
      ps_reduce_max(m->comm, &failed, 1, "the barrier after resetting the GIN signals", err, sizeof err);
  if (prior != ncclSuccess) return prior; /* its own error stands */
  if (own) {
    ps_moe_set_error("resetting the counts of %d batch handles failed: %s", m->L + PS_MOE_SHARED_HANDLES,
                     cudaGetErrorString(ce));
    return ncclUnhandledCudaError;
  }
  if (reduce_failed) {
    ps_moe_set_error("%s", err);
    return ncclSystemError;
  }
  if (failed) {
    ps_moe_set_error("another rank could not register its window, create its devcomm or reset its batch counts "
                     "(its perseus_moe_last_error() says why)");
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

/* What setup does on this rank alone, after the agreement: the layout, the
 * device memory (the window's too, cleared), the fault record and the grid. */
static ncclResult_t ps_moe_setup_local(perseus_moe *m)
{
  ps_moe_layout_t lay;
  if (ps_moe_layout(&m->cfg, m->nranks, &lay)) return ncclInvalidArgument;
  m->L = lay.local_experts;
  m->P = (int)lay.rows_per_peer; /* at most max_tokens (2^20) x topk (16) */
  m->gin = ncclTeamLsa(m->comm).nRanks != m->nranks;
  ps_moe_window_layout(m, &lay);
  ncclResult_t rc = ps_moe_alloc_dev(m, &lay);
  if (rc == ncclSuccess) rc = ps_moe_tensor_maps(m);
  if (rc != ncclSuccess) return rc;
  PS_MOE_NCCL(ncclMemAlloc(&m->win_ptr, m->win_bytes), "%zu-byte window", m->win_bytes);
  PS_MOE_CUDA(cudaMemset(m->win_ptr, 0, m->win_bytes), "%zu-byte window", m->win_bytes);
  /* cudaMemset is asynchronous: done before the devcomm's barrier lets peers write */
  PS_MOE_CUDA(cudaStreamSynchronize(0), "%zu-byte window", m->win_bytes);
  PS_MOE_CUDA(cudaEventCreateWithFlags(&m->done, cudaEventDisableTiming), "rank %d", m->rank);
  if ((rc = ps_moe_ctl_create(m)) != ncclSuccess) return rc;
  int dev = 0, sms = 0;
  PS_MOE_CUDA(cudaGetDevice(&dev), "rank %d", m->rank);
  PS_MOE_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "device %d", dev);
  for (int i = 0; i < 2; i++) { /* the grid from the occupancy of each kernel */
    const void *kernel = ps_moe_kernel(i);
    int smem = ps_moe_smem(i), per_sm = 0;
    PS_MOE_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                "%d bytes", smem);
    PS_MOE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, PS_MOE_THREADS, smem),
                "%d threads, %d bytes of shared memory", PS_MOE_THREADS, smem);
    if (per_sm < 1) {
      ps_moe_set_error("the forward kernel does not fit on an SM of device %d (%d threads, %d bytes "
                       "of shared memory)", dev, PS_MOE_THREADS, smem);
      return ncclInvalidUsage;
    }
    m->grid[i] = per_sm * sms;
  }
  return ncclSuccess;
}

static ncclResult_t ps_moe_setup(perseus_moe *m)
{
  PS_MOE_NCCL(ncclCommCount(m->comm, &m->nranks), "comm %p", (void *)m->comm);
  PS_MOE_NCCL(ncclCommUserRank(m->comm, &m->rank), "comm %p", (void *)m->comm);
  if (ncclResult_t rc = ps_moe_agree(m)) return rc;
  ncclResult_t rc = ps_moe_setup_local(m);
  const int nh = m->L + PS_MOE_SHARED_HANDLES;
  ncclDevResourceRequirements_t *req = NULL;
  perseus_batch_handle *h = NULL;
  if (rc == ncclSuccess) {
    req = (ncclDevResourceRequirements_t *)calloc((size_t)nh, sizeof(*req));
    h = (perseus_batch_handle *)calloc((size_t)nh, sizeof(*h));
    if (!req || !h) {
      ps_moe_set_error("out of host memory for %d resource requirements", nh);
      rc = ncclSystemError;
    }
  }
  /* every rank set up before the collectives below, or none enters them */
  char why[512];
  if (ps_op_all_ready(m->comm, rc == ncclSuccess, "perseus_moe", why, sizeof why)) {
    free(req), free(h);
    if (rc != ncclSuccess) return rc;
    ps_moe_set_error("%s", why);
    return ncclInvalidUsage;
  }
  if (ps_op_window(m->comm, m->win_ptr, m->win_bytes, &m->win, "the layer's window", why, sizeof why)) {
    ps_moe_set_error("%s", why);
    rc = ncclInvalidUsage;
  } else {
    rc = ps_moe_devcomm(m, req, h);
  }
  free(req), free(h);
  /* its barrier carries every rank's outcome: all keep the layer or none */
  if ((rc = ps_moe_zero_signals(m, rc)) != ncclSuccess) return rc;
  ps_moe_args &a = m->args;
  a.dc = m->dc, a.win = m->win;
  a.H = m->cfg.hidden, a.F = m->cfg.ffn, a.E = m->cfg.experts, a.L = m->L, a.k = m->cfg.topk;
  a.R = m->nranks, a.P = m->P, a.renorm = m->cfg.renormalize, a.batch = m->cfg.batch;
  a.gin_per_expert = m->cfg.gin_per_expert;
  a.gate_kc = a.H;
  return ncclSuccess;
}

extern "C" ncclResult_t perseus_moe_create(ncclComm_t comm, const perseus_moe_config_t *cfg,
                                           perseus_moe_t **out)
{
  ps_moe_clear_error();
  if (!comm || !cfg || !out) {
    ps_moe_set_error("perseus_moe_create: comm %p, cfg %p, out %p: none may be NULL",
                     (void *)comm, (const void *)cfg, (void *)out);
    return ncclInvalidArgument;
  }
  *out = NULL;
  /* aligned as its tensor maps (CUtensorMap is 64-byte aligned) */
  perseus_moe *m = (perseus_moe *)aligned_alloc(alignof(perseus_moe), sizeof(perseus_moe));
  if (!m) {
    ps_moe_set_error("perseus_moe_create: out of host memory");
    return ncclSystemError;
  }
  memset((void *)m, 0, sizeof(*m));
  m->comm = comm, m->cfg = *cfg;
  return ps_moe_create_end(ps_moe_setup(m), m, perseus_moe_destroy, out);
}

extern "C" ncclResult_t perseus_moe_load_weights(perseus_moe_t *m, const uint16_t *gate,
                                                 const uint16_t *w1, const uint16_t *w3,
                                                 const uint16_t *w2)
{
  ps_moe_clear_error();
  if (!ps_moe_weights_args_ok("perseus_moe_load_weights", "m", m, gate, w1, w3, w2))
    return ncclInvalidArgument;
  size_t g = (size_t)m->cfg.experts * m->cfg.hidden * sizeof(uint16_t);
  size_t w = (size_t)m->L * m->cfg.ffn * m->cfg.hidden * sizeof(uint16_t);
  /* cudaMemcpyDefault: host or device pointers alike (unified addressing) */
  PS_MOE_CUDA(cudaMemcpy((void *)m->args.gate, gate, g, cudaMemcpyDefault), "gate, %zu bytes", g);
  PS_MOE_CUDA(cudaMemcpy((void *)m->args.w1, w1, w, cudaMemcpyDefault), "w1, %zu bytes", w);
  PS_MOE_CUDA(cudaMemcpy((void *)m->args.w3, w3, w, cudaMemcpyDefault), "w3, %zu bytes", w);
  PS_MOE_CUDA(cudaMemcpy((void *)m->args.w2, w2, w, cudaMemcpyDefault), "w2, %zu bytes", w);
  /* device-to-device copies return before they are done, and a forward on a
   * non-blocking stream does not wait for the legacy stream they run on */
  PS_MOE_CUDA(cudaStreamSynchronize(0), "the weight copies");
  m->have_weights = 1;
  return ncclSuccess;
}

extern "C" ncclResult_t perseus_moe_forward(perseus_moe_t *m, const void *x, void *out, int ntokens,
                                            cudaStream_t stream)
{
  ps_moe_clear_error();
  if (!m || (ntokens > 0 && (!x || !out))) {
    ps_moe_set_error("perseus_moe_forward: m %p, x %p, out %p with %d tokens", (void *)m, x, out,
                     ntokens);
    return ncclInvalidArgument;
  }
  if (ncclResult_t rc = ps_moe_fault_check(m)) return rc;
  if (!m->have_weights) { /* the zeroed weights would give zeros, silently */
    ps_moe_set_error("perseus_moe_forward: the layer has no weights yet: call "
                     "perseus_moe_load_weights first");
    return ncclInvalidUsage;
  }
  if (ntokens < 0 || ntokens > m->cfg.max_tokens) {
    ps_moe_set_error("perseus_moe_forward: ntokens %d is outside 0..%d (max_tokens)", ntokens,
                     m->cfg.max_tokens);
    return ncclInvalidArgument;
  }
  if (((uintptr_t)x | (uintptr_t)out) % 16) {
    ps_moe_set_error("perseus_moe_forward: x %p and out %p must be 16-byte aligned", x, out);
    return ncclInvalidArgument;
  }
  ps_moe_args a = m->args;
  a.x = (const ps_bf16 *)x, a.out = (ps_bf16 *)out, a.T = ntokens;
  /* under stream capture the forward becomes a graph's nodes: the kernel
   * reads its index from device memory, and the done event must be a node
   * too (an external record), or the profile would not wait for a replay */
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  PS_MOE_CUDA(cudaStreamIsCapturing(stream, &cap), "stream %p", (void *)stream);
  int bm = ps_moe_tile_rows(&m->cfg, m->nranks, ntokens, m->tile_rows);
  if (m->L > PS_MOE_TILED_MAX_L) bm = 64; /* the 128-row kernel's task table holds 512 experts */
  const int ki = bm == 128;
  const int grid = m->grid[ki], smem = ps_moe_smem(ki);
  { /* split the gate's K so that there are about two tasks per CTA, slices of >= 256 */
    int tiles = (ntokens + bm - 1) / bm * ((a.E + PS_GEMM_N - 1) / PS_GEMM_N);
    int splits = tiles ? (2 * grid + tiles - 1) / tiles : 1, most = a.H / 256;
    splits = splits < 1 ? 1 : splits > most ? (most > 0 ? most : 1) : splits;
    a.gate_kc = (a.H / splits + PS_GEMM_K - 1) / PS_GEMM_K * PS_GEMM_K;
  }
  void *params[] = {&a};
  PS_MOE_CUDA(cudaLaunchCooperativeKernel(ps_moe_kernel(ki), dim3(grid), dim3(PS_MOE_THREADS),
                                          params, smem, stream),
              "grid %d x %d threads, %d bytes of shared memory, %d-row tiles", grid, PS_MOE_THREADS,
              smem, bm);
  PS_MOE_CUDA(cap == cudaStreamCaptureStatusActive
                  ? cudaEventRecordWithFlags(m->done, stream, cudaEventRecordExternal)
                  : cudaEventRecord(m->done, stream),
              "%d tokens%s", ntokens, cap == cudaStreamCaptureStatusActive ? ", captured" : "");
  return ncclSuccess;
}

extern "C" ncclResult_t perseus_moe_destroy(perseus_moe_t *m)
{
  if (!m) return ncclSuccess;
  ncclResult_t rc = ncclSuccess, r;
  if (m->have_dc && (r = ncclDevCommDestroy(m->comm, &m->dc)) != ncclSuccess) {
    ps_moe_set_error("ncclDevCommDestroy failed: %s", ncclGetErrorString(r));
    rc = r;
  }
  if (m->win && (r = ncclCommWindowDeregister(m->comm, m->win)) != ncclSuccess) {
    ps_moe_set_error("ncclCommWindowDeregister failed: %s", ncclGetErrorString(r));
    rc = r;
  }
  if (m->win_ptr && (r = ncclMemFree(m->win_ptr)) != ncclSuccess) {
    ps_moe_set_error("ncclMemFree failed: %s", ncclGetErrorString(r));
    rc = r;
  }
  if (m->dev) cudaFree(m->dev);
  if (m->done) cudaEventDestroy(m->done);
  if (m->ctl) cudaFreeHost(m->ctl);
  free(m);
  return rc;
}
