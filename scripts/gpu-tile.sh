#!/usr/bin/env bash
# perseus' device library (include/perseus/device.cuh) on a GPU host:
# perseus_tile_test on 2 GPUs, and on 4 where there are 4, over the LSA path
# (P2P on, NVLink stores or TMA copies drawn per iteration), TMA only, and the
# GIN path (P2P off, the plugin) under the ordered and target strategies; then
# perseus_tile_perf: LSA, TMA and GIN side by side under the first perf
# strategy, GIN alone under the others (the fence count per tile differs by
# strategy, the NVLink paths do not). The programs set each path's NCCL variables themselves (-p), so
# unlike gpu-gin.sh this script exports no NCCL_P2P_DISABLE. Run from the
# repository root of a tree built elsewhere and carried over:
#
#   scripts/gpu-tile.sh [LOGDIR [BUILDDIR]]    (defaults: ./tile-logs, $PERSEUS_BUILD_DIR or build)
#
# Environment (optional): PERSEUS_NCCL_LIB, PYTHON, PERSEUS_PROVIDER,
# PERSEUS_IFACE as for gpu-gin.sh; TILE_STRATEGIES (default "ordered target"),
# TILE_PERF_STRATEGIES (default "ordered deferred drain"),
# TILE_TEST_ARGS (e.g. "-n 500"), TILE_PERF_ARGS (e.g. "-e 4M -B 1,4,16,64"),
# TILE_RUN_TIMEOUT (default 1800 s).
# Exit status: 0 every run passed (or was skipped), 1 a run failed, 77 fewer
# than 2 GPUs.
set -uo pipefail

# shellcheck source=scripts/gpu-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu-common.sh" || exit 1
gpu_paths tile "$@"
STRATEGIES=${TILE_STRATEGIES-ordered target}
PERF_STRATEGIES=${TILE_PERF_STRATEGIES-ordered deferred drain}
need_list gpu-tile.sh TILE_STRATEGIES "$STRATEGIES"
need_list gpu-tile.sh TILE_PERF_STRATEGIES "$PERF_STRATEGIES"
RUN_TIMEOUT=${TILE_RUN_TIMEOUT:-1800} RUN_NAME_WIDTH=40 GPU_ENV_FABRIC=0
RUN_GREP='mismatch|signal|watchdog|failed|error|overlap|where each rank'

gpu_need_built "" "$TEST_BIN" "$PERF_BIN"
gpu_export_env
unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE # the programs choose per path (-p)
gpu_start

gpu_counts="2"
[ "$ngpus" -ge 4 ] && gpu_counts="2 4"
for g in $gpu_counts; do
  # shellcheck disable=SC2086  # TILE_TEST_ARGS is a list of options
  run "tile_test-g$g-lsa" "$TEST_BIN" -p lsa -g "$g" ${TILE_TEST_ARGS:-}
  # shellcheck disable=SC2086
  run "tile_test-g$g-tma" "$TEST_BIN" -p tma -g "$g" ${TILE_TEST_ARGS:-}
  for s in $STRATEGIES; do
    # shellcheck disable=SC2086
    PERSEUS_ORDERING=$s run "tile_test-g$g-gin-$s" "$TEST_BIN" -p gin -g "$g" ${TILE_TEST_ARGS:-}
  done
done
# fixed batches too: per-tile signaling (1) and one batch per pair (64)
for b in 1 64; do
  # shellcheck disable=SC2086
  run "tile_test-g2-gin-B$b" "$TEST_BIN" -p gin -g 2 -B "$b" ${TILE_TEST_ARGS:-}
  # shellcheck disable=SC2086
  run "tile_test-g2-lsa-B$b" "$TEST_BIN" -p lsa -g 2 -B "$b" ${TILE_TEST_ARGS:-}
done

paths=lsa,tma,gin
for s in $PERF_STRATEGIES; do
  # shellcheck disable=SC2086
  PERSEUS_ORDERING=$s run "tile_perf-g$ngpus-$s" "$PERF_BIN" -g "$ngpus" -p "$paths" \
    ${TILE_PERF_ARGS:-}
  sed -n '/^# machine/p;/size(B)/,$p' "$LOGDIR/tile_perf-g$ngpus-$s.log" 2>/dev/null
  paths=gin
done

gpu_finish
