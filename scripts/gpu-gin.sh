#!/usr/bin/env bash
# NCCL's device API (ncclGin over the GIN proxy) through the perseus plugin on
# a GPU host: perseus_gin_test (put and alltoall, every byte verified) on 2
# GPUs, and on 4 where there are 4, under every ordering strategy; then
# perseus_gin_perf (all strategies side by side). Run from the repository root
# of a tree built elsewhere and carried over:
#
#   scripts/gpu-gin.sh [LOGDIR [BUILDDIR]]     (defaults: ./gin-logs, $PERSEUS_BUILD_DIR or build)
#
# One log per run in LOGDIR, and LOGDIR/summary.txt with PASS/FAIL/SKIP per run.
# Environment (all optional):
#   PERSEUS_NCCL_LIB   directory holding libnccl.so.2 (default: the PyTorch
#                      environment's nvidia.nccl package, else the system's)
#   PYTHON             python to ask for nvidia.nccl (default python3)
#   GIN_STRATEGIES     strategies for the test (default "ordered target deferred drain")
#   GIN_TEST_ARGS      extra perseus_gin_test options (e.g. "-n 500 -t 64")
#   GIN_PERF_ARGS      extra perseus_gin_perf options (e.g. "-e 4M -P 1,3")
#   GIN_RUN_TIMEOUT    seconds before a run is killed from outside (default 1800;
#                      the programs' own watchdog reports a hang well before)
#   PERSEUS_PROVIDER   default "tcp;ofi_rxm"; PERSEUS_IFACE default lo (shm for shm)
# Exit status: 0 every run passed (or was skipped), 1 a run failed, 77 fewer
# than 2 GPUs.
set -uo pipefail

# shellcheck source=scripts/gpu-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu-common.sh" || exit 1
gpu_paths gin "$@"
STRATEGIES=${GIN_STRATEGIES-ordered target deferred drain}
need_list gpu-gin.sh GIN_STRATEGIES "$STRATEGIES"
RUN_TIMEOUT=${GIN_RUN_TIMEOUT:-1800} RUN_NAME_WIDTH=44 GPU_ENV_FABRIC=1
RUN_GREP='mismatch|watchdog|failed|error|refused|where each rank'

gpu_need_built ", on a machine with nvcc and NCCL 2.28 headers" "$TEST_BIN" "$PERF_BIN"
gpu_export_env
if [ -n "$nccl_lib" ] && [ ! -e "$nccl_lib/libnccl.so.2" ]; then
  echo "gpu-gin.sh: no libnccl.so.2 in $nccl_lib (PERSEUS_NCCL_LIB)" >&2
  exit 1
fi
export NCCL_GIN_TYPE=2 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0
gpu_start

gpu_counts="2"
[ "$ngpus" -ge 4 ] && gpu_counts="2 4"
for g in $gpu_counts; do
  for s in $STRATEGIES; do
    for mode in put alltoall; do
      # shellcheck disable=SC2086  # GIN_TEST_ARGS is a list of options
      PERSEUS_ORDERING=$s run "gin_test-g$g-$s-$mode" "$TEST_BIN" -g "$g" -o "$mode" \
        ${GIN_TEST_ARGS:-}
    done
  done
done

# every strategy in one table; the program sets PERSEUS_ORDERING per set
unset PERSEUS_ORDERING
# shellcheck disable=SC2086
run "gin_perf-g$ngpus" "$PERF_BIN" -g "$ngpus" ${GIN_PERF_ARGS:-}
sed -n '/^# put + signal/,$p' "$LOGDIR/gin_perf-g$ngpus.log" 2>/dev/null

gpu_finish
