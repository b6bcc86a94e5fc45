#!/usr/bin/env bash
# Flash-Decode (decode/) on a GPU host: perseus_decode_test (the kernels on
# one GPU against fp64), perseus_decode_fused_test (the fused operator, push
# and pull over NVLink, push through perseus with P2P off) on 2 GPUs, and on
# 4 where there are 4, perseus_decode_example (the C API through
# libperseus_decode.so, every GPU); then perseus_decode_perf over NVLink and through
# perseus. The programs set each path's NCCL variables themselves (-p). Run
# from the repository root of a tree built elsewhere and carried over:
#
#   scripts/gpu-decode.sh [LOGDIR [BUILDDIR]]  (defaults: ./decode-logs, $PERSEUS_BUILD_DIR or build)
#
# Environment (optional): PERSEUS_NCCL_LIB, PYTHON, PERSEUS_PROVIDER,
# PERSEUS_IFACE as for gpu-gin.sh; DECODE_PERF_ARGS (default "-b 1,8,64 -c
# 8192,32768,131072" over NVLink), DECODE_GIN_PERF_ARGS (default "-b 1,8 -c
# 8192" through perseus), DECODE_RUN_TIMEOUT (default 1800 s).
# Exit status: 0 every run passed (or was skipped), 1 a run failed, 77 fewer
# than 2 GPUs.
set -uo pipefail

# shellcheck source=scripts/gpu-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu-common.sh" || exit 1
gpu_paths decode "$@"
RUN_TIMEOUT=${DECODE_RUN_TIMEOUT:-1800} RUN_NAME_WIDTH=32 GPU_ENV_FABRIC=0
RUN_GREP='wrong|FAIL|watchdog|failed|error|refused'
FUSED_BIN=$BUILD/test/gpu/perseus_decode_fused_test

EXAMPLE_BIN=$BUILD/device/perseus_decode_example # the C API through libperseus_decode.so
gpu_need_built "" "$TEST_BIN" "$FUSED_BIN" "$PERF_BIN" "$EXAMPLE_BIN"
gpu_export_env
unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE # the programs choose per path (-p)
gpu_start

run decode_test "$TEST_BIN"
gpu_counts="2"
[ "$ngpus" -ge 4 ] && gpu_counts="2 4"
for g in $gpu_counts; do
  run "decode_fused_test-g$g-lsa" "$FUSED_BIN" -p lsa -g "$g"
  run "decode_fused_test-g$g-gin" "$FUSED_BIN" -p gin -g "$g"
done
# shellcheck disable=SC2086  # the ARGS are lists of options
run decode_example-push "$EXAMPLE_BIN" 3000 push # every visible GPU
run decode_example-pull "$EXAMPLE_BIN" 3000 pull
run decode_perf-lsa "$PERF_BIN" -g 2 -p lsa ${DECODE_PERF_ARGS:--b 1,8,64 -c 8192,32768,131072}
# shellcheck disable=SC2086
run decode_perf-gin "$PERF_BIN" -g 2 -p gin ${DECODE_GIN_PERF_ARGS:--b 1,8 -c 8192}
for p in lsa gin; do
  sed -n '/^# machine/p;/#  batch/,$p' "$LOGDIR/decode_perf-$p.log" 2>/dev/null
done

gpu_finish
