#!/usr/bin/env bash
# Fused AllGather+GEMM (aggemm/) on a GPU host: perseus_ag_gemm_test (the
# fused operator against the fp64 product: push and pull over NVLink on 1
# and 2 GPUs, and 4 where there are 4; push through perseus with P2P off on
# 2) and perseus_ag_gemm_example (the C API through libperseus_ag_gemm.so,
# every GPU), then perseus_ag_gemm_perf over NVLink, alone on one GPU (the GEMM
# without the exchange) and through perseus. The programs set each path's
# NCCL variables themselves (-p). Run from the repository root of a tree
# built elsewhere and carried over:
#
#   scripts/gpu-aggemm.sh [LOGDIR [BUILDDIR]]  (defaults: ./ag_gemm-logs, $PERSEUS_BUILD_DIR or build)
#
# Environment (optional): PERSEUS_NCCL_LIB, PYTHON, PERSEUS_PROVIDER,
# PERSEUS_IFACE as for gpu-gin.sh; AG_PERF_ARGS (default "-m
# 8,16,32,64,128,512,2048,8192" over NVLink and on one GPU),
# AG_GIN_PERF_ARGS (default "-m 32,512,2048 -k 4096 -n 5 -r 3" through
# perseus), AG_RUN_TIMEOUT (default 1800 s).
# Exit status: 0 every run passed (or was skipped), 1 a run failed, 77 fewer
# than 2 GPUs.
set -uo pipefail

# shellcheck source=scripts/gpu-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu-common.sh" || exit 1
gpu_paths ag_gemm "$@"
RUN_TIMEOUT=${AG_RUN_TIMEOUT:-1800} RUN_NAME_WIDTH=32 GPU_ENV_FABRIC=0
RUN_GREP='wrong|FAIL|watchdog|failed|error|refused'

EXAMPLE_BIN=$BUILD/device/perseus_ag_gemm_example # the C API through libperseus_ag_gemm.so
gpu_need_built "" "$TEST_BIN" "$PERF_BIN" "$EXAMPLE_BIN"
gpu_export_env
unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE # the programs choose per path (-p)
gpu_start

gpu_counts="1 2"
[ "$ngpus" -ge 4 ] && gpu_counts="1 2 4"
for g in $gpu_counts; do
  run "ag_gemm_test-g$g-lsa" "$TEST_BIN" -p lsa -g "$g"
done
run ag_gemm_test-g2-gin "$TEST_BIN" -p gin -g 2
run ag_gemm_example-push "$EXAMPLE_BIN" 1000 1024 push # every visible GPU
run ag_gemm_example-pull "$EXAMPLE_BIN" 1000 1024 pull
# shellcheck disable=SC2086  # the ARGS are lists of options
run ag_gemm_perf-lsa "$PERF_BIN" -g 2 -p lsa ${AG_PERF_ARGS:--m 8,16,32,64,128,512,2048,8192}
# shellcheck disable=SC2086
run ag_gemm_perf-g1 "$PERF_BIN" -g 1 -p lsa ${AG_PERF_ARGS:--m 8,16,32,64,128,512,2048,8192}
# shellcheck disable=SC2086
run ag_gemm_perf-gin "$PERF_BIN" -g 2 -p gin ${AG_GIN_PERF_ARGS:--m 32,512,2048 -k 4096 -n 5 -r 3}
for p in lsa g1 gin; do
  sed -n '/^# machine/p;/#    M/,$p' "$LOGDIR/ag_gemm_perf-$p.log" 2>/dev/null
done

gpu_finish
