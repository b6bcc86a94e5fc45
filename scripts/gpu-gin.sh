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

LOGDIR=${1:-./gin-logs}
BUILD=${2:-${PERSEUS_BUILD_DIR:-build}}
TEST_BIN=$BUILD/gpu/perseus_gin_test
PERF_BIN=$BUILD/gpu/perseus_gin_perf
PLUGIN_DIR=$BUILD/plugin
PYTHON=${PYTHON:-python3}
STRATEGIES=${GIN_STRATEGIES:-ordered target deferred drain}
RUN_TIMEOUT=${GIN_RUN_TIMEOUT:-1800}

ldconfig_p() {
  { command -v ldconfig >/dev/null && ldconfig -p; } 2>/dev/null ||
    /sbin/ldconfig -p 2>/dev/null || true
}

for f in "$TEST_BIN" "$PERF_BIN" "$PLUGIN_DIR/libnccl-net-perseus.so"; do
  if [ ! -e "$f" ]; then
    echo "gpu-gin.sh: $f not found; build first (meson setup $BUILD && ninja -C $BUILD," \
         "on a machine with nvcc and NCCL 2.28 headers)" >&2
    exit 1
  fi
done
mkdir -p "$LOGDIR" || exit 1

# NCCL: the override, else the PyTorch environment's wheel, else the system's.
nccl_lib=${PERSEUS_NCCL_LIB:-}
if [ -z "$nccl_lib" ]; then
  pkg=$("$PYTHON" -c 'import nvidia.nccl as m, os
f = getattr(m, "__file__", None)
print(os.path.dirname(f) if f else list(m.__path__)[0])' 2>/dev/null) || pkg=""
  if [ -n "$pkg" ] && [ -e "$pkg/lib/libnccl.so.2" ]; then nccl_lib=$pkg/lib; fi
fi
if [ -n "$nccl_lib" ] && [ ! -e "$nccl_lib/libnccl.so.2" ]; then
  echo "gpu-gin.sh: no libnccl.so.2 in $nccl_lib (PERSEUS_NCCL_LIB)" >&2
  exit 1
fi

# libfabric.so.1 for the plugin, where the loader does not know it already.
fab_dir=""
if ! ldconfig_p | grep -q 'libfabric\.so\.1 '; then
  for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib /usr/local/lib64 \
           /opt/amazon/efa/lib /opt/amazon/efa/lib64 "$PWD/.carry/lib"; do
    if [ -e "$d/libfabric.so.1" ]; then fab_dir=$d; break; fi
  done
fi

ld="$(cd "$PLUGIN_DIR" && pwd)${nccl_lib:+:$nccl_lib}${fab_dir:+:$fab_dir}"
export LD_LIBRARY_PATH="$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NET_PLUGIN=perseus NCCL_GIN_TYPE=2
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0
export PERSEUS_PROVIDER=${PERSEUS_PROVIDER:-tcp;ofi_rxm}
if [ -z "${PERSEUS_IFACE:-}" ]; then
  [ "$PERSEUS_PROVIDER" = shm ] && PERSEUS_IFACE=shm || PERSEUS_IFACE=lo
fi
export PERSEUS_IFACE NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}

ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
{
  echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
  echo "# perseus $(git describe --always --dirty 2>/dev/null || echo '?'), build $BUILD"
  echo "# NCCL: ${nccl_lib:-system} -> $(ldd "$TEST_BIN" 2>/dev/null | awk '/libnccl/{print $3}')"
  echo "# plugin -> libfabric: $(ldd "$PLUGIN_DIR/libnccl-net-perseus.so" 2>/dev/null |
    awk '/libfabric/{print $3}')"
  echo "# LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  env | grep -E '^(NCCL_|PERSEUS_|CUDA_VISIBLE)' | sort | sed 's/^/# /'
  nvidia-smi -L 2>&1 | sed 's/^/# /'
} | tee "$LOGDIR/env.txt"

if [ "$ngpus" -lt 2 ]; then
  echo "gpu-gin.sh: $ngpus GPU(s) visible, 2 needed: skipped" | tee "$LOGDIR/summary.txt"
  exit 77
fi

: >"$LOGDIR/summary.txt"
failed=0 passed=0 skipped=0

# run NAME COMMAND...: one logged run, its verdict in the summary
run() {
  local name=$1; shift
  local log="$LOGDIR/$name.log" t0=$SECONDS rc verdict
  echo "# $*" >"$log"
  timeout -k 10 "$RUN_TIMEOUT" "$@" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) verdict=PASS; passed=$((passed + 1)) ;;
    77) verdict=SKIP; skipped=$((skipped + 1)) ;;
    124|137) verdict="FAIL (killed after ${RUN_TIMEOUT} s)"; failed=$((failed + 1)) ;;
    *) verdict="FAIL (exit $rc)"; failed=$((failed + 1)) ;;
  esac
  printf '%-44s %-26s %5ds  %s\n' "$name" "$verdict" $((SECONDS - t0)) "$log" |
    tee -a "$LOGDIR/summary.txt"
  if [ "$verdict" != PASS ] && [ "$verdict" != SKIP ]; then
    grep -E 'mismatch|watchdog|failed|error|refused|where each rank' "$log" | head -12 | sed 's/^/    /'
  fi
}

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

echo "# $passed passed, $failed failed, $skipped skipped" | tee -a "$LOGDIR/summary.txt"
[ "$failed" -eq 0 ]
