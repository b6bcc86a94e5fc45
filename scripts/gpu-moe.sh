#!/usr/bin/env bash
# perseus' fused MoE layer (docs/moe.md) on a GPU host: perseus_moe_test
# against the fp64 CPU reference on 1, 2 and 4 GPUs (as many as there are)
# over the LSA path (NVLink) and, from 2 GPUs, the GIN path through the
# perseus plugin (2 and 4 ranks over GIN also where the GPUs are fewer,
# ranks sharing them; from 2 GPUs, two pretend hosts of all the GPUs: NVLink
# within a host, GIN across), plus a larger shape with a fixed batch; then
# perseus_moe_perf (fused against the NCCL + cuBLAS baseline, every preset,
# decode and prefill; from 2 GPUs also over GIN). The GIN tests put rows
# per destination (the default) and, in one more 4-rank run, per
# (destination, expert) segment (-S 1). Two more runs mix launched forwards
# with forwards replayed from CUDA graphs (-G 1): over LSA on every GPU, and
# 2 ranks over GIN. The LSA runs, the shared-GPU GIN runs and the 2-host
# run start with what the layer must refuse without hanging (-f all: ranks
# that disagree on the config, a corrupt header from a peer, a peer's
# withheld header or rows ended by PERSEUS_MOE_TIMEOUT_MS, and
# perseus_moe_abort). Run from the repository root of a tree built
# elsewhere and carried over:
#
#   scripts/gpu-moe.sh [LOGDIR [BUILDDIR]]     (defaults: ./moe-logs, $PERSEUS_BUILD_DIR or build)
#
# Environment (optional): PERSEUS_NCCL_LIB, PYTHON, PERSEUS_PROVIDER,
# PERSEUS_IFACE as for gpu-gin.sh; PERSEUS_CUBLAS_LIB (the directory holding
# libcublas.so.13; default: the PyTorch environment's nvidia/cu13/lib or
# nvidia/cublas/lib); MOE_TEST_ARGS (e.g. "-n 20"), MOE_PERF_ARGS (e.g.
# "-t decode -n 20"; "none" skips the benchmark), MOE_PERF_GIN_ARGS (from 2 GPUs,
# the benchmark again over GIN; default "-t decode", "none" skips it),
# MOE_RUN_TIMEOUT (default 900 s).
# Exit status: 0 every run passed (or was skipped), 1 a run failed, 77 no GPU.
set -uo pipefail

# shellcheck source=scripts/gpu-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu-common.sh" || exit 1
gpu_paths moe "$@"
RUN_TIMEOUT=${MOE_RUN_TIMEOUT:-900} RUN_NAME_WIDTH=36 GPU_ENV_FABRIC=0 GPU_MIN=1
RUN_GREP='mismatch|routing|outputs off|watchdog|failed|error|where each rank'

gpu_need_built "" "$TEST_BIN"
gpu_export_env
unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE # the programs choose per path (-p)
cublas=${PERSEUS_CUBLAS_LIB:-}
if [ -z "$cublas" ]; then
  site=$("$PYTHON" -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null) || site=""
  for d in "$site/cu13/lib" "$site/cublas/lib"; do
    if [ -n "$site" ] && [ -e "$d/libcublas.so.13" ]; then cublas=$d; break; fi
  done
fi
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$cublas"
gpu_start

counts="1"
[ "$ngpus" -ge 2 ] && counts="$counts 2"
[ "$ngpus" -ge 4 ] && counts="$counts 4"
for g in $counts; do
  # shellcheck disable=SC2086  # MOE_TEST_ARGS is a list of options
  run "moe_test-g$g-lsa" "$TEST_BIN" -g "$g" -p lsa -f all ${MOE_TEST_ARGS:-}
  if [ "$g" -ge 2 ]; then
    # shellcheck disable=SC2086
    run "moe_test-g$g-gin" "$TEST_BIN" -g "$g" -p gin ${MOE_TEST_ARGS:-}
  fi
done
# Fewer GPUs than 2 or 4 ranks: those rank counts over GIN anyway, each rank
# a pretend host of its own, sharing the GPUs (PERSEUS_TEST_HOSTS)
for g in 2 4; do
  if [ "$ngpus" -lt "$g" ]; then
    # shellcheck disable=SC2086
    PERSEUS_TEST_HOSTS=$g run "moe_test-g$g-gin-shared" "$TEST_BIN" -g "$g" -p gin -f all \
      ${MOE_TEST_ARGS:-}
  fi
done
# From 2 GPUs: 2 pretend hosts of ngpus ranks each (NVLink within a host, GIN
# across), the multi-node layout, faults included (a failed peer told over
# NVLink and over GIN in one run)
if [ "$ngpus" -ge 2 ]; then
  # shellcheck disable=SC2086
  PERSEUS_TEST_HOSTS=2 run "moe_test-g$((2 * ngpus))-2hosts" "$TEST_BIN" -g $((2 * ngpus)) \
    -p lsa -f all ${MOE_TEST_ARGS:-}
fi
# GIN rows per (destination, expert) segment (-S 1) instead of per destination:
# 4 ranks over GIN, 32 experts, chunks of 3 rows
# shellcheck disable=SC2086
PERSEUS_TEST_HOSTS=4 run "moe_test-g4-gin-per-expert" "$TEST_BIN" -g 4 -p gin -S 1 -H 576 -F 256 \
  -E 32 -k 8 -T 128 -B 3 ${MOE_TEST_ARGS:-}
g=${counts##* }
# shellcheck disable=SC2086
# hidden 576: not a multiple of 256 (the combine's 8 columns x 32 lanes); 64 rows per
# expert on average, so 128-row GEMM tiles (the default shape: 64-row ones)
run "moe_test-g$g-lsa-large" "$TEST_BIN" -g "$g" -p lsa -H 576 -F 256 -E 32 -k 8 -T 256 -B 3 \
  ${MOE_TEST_ARGS:-}
# the top-k's paths by expert count: each lane holds 1, 2, 4 or 8 logits up to 32, 64,
# 128 or 256 experts (16 and 32 above), and reads them from memory past 256
for e in 48 100 256 600; do
  # shellcheck disable=SC2086
  run "moe_test-g$g-lsa-experts$e" "$TEST_BIN" -g "$g" -p lsa -H 128 -F 64 -E $e -k 6 -T 96 \
    ${MOE_TEST_ARGS:-}
done
# forwards replayed from CUDA graphs, between launched ones (each layer's count
# of forwards lives on the GPU, so a replay is a forward of its own)
# shellcheck disable=SC2086
run "moe_test-g$g-lsa-graphs" "$TEST_BIN" -g "$g" -p lsa -G 1 ${MOE_TEST_ARGS:-}
# shellcheck disable=SC2086
PERSEUS_TEST_HOSTS=2 run "moe_test-g2-gin-graphs" "$TEST_BIN" -g 2 -p gin -G 1 ${MOE_TEST_ARGS:-}

if [ "${MOE_PERF_ARGS:-}" != none ]; then
  if [ ! -e "$PERF_BIN" ]; then
    echo "gpu-moe.sh: $PERF_BIN not built (no libcublas.so where it was built): benchmark skipped"
  else
    # shellcheck disable=SC2086
    run "moe_perf-g$ngpus" "$PERF_BIN" -g "$ngpus" ${MOE_PERF_ARGS:-}
    sed -n '/^# HBM/,$p' "$LOGDIR/moe_perf-g$ngpus.log" 2>/dev/null
    if [ "$ngpus" -ge 2 ] && [ "${MOE_PERF_GIN_ARGS:-}" != none ]; then
      # every peer through GIN and the plugin, as across nodes
      # shellcheck disable=SC2086
      run "moe_perf-g$ngpus-gin" "$PERF_BIN" -g "$ngpus" -p gin ${MOE_PERF_GIN_ARGS:--t decode}
      sed -n '/^# HBM/,$p' "$LOGDIR/moe_perf-g$ngpus-gin.log" 2>/dev/null
    fi
  fi
fi

gpu_finish
