#!/usr/bin/env bash
# perseus' device library (device/include/perseus/device.cuh) on a GPU host:
# perseus_tile_test on 2 GPUs, and on 4 where there are 4, over the LSA path
# (P2P on, NVLink stores) and the GIN path (P2P off, the plugin) under the
# ordered and target strategies; then perseus_tile_perf (LSA and GIN side by
# side). The programs set each path's NCCL variables themselves (-p), so
# unlike gpu-gin.sh this script exports no NCCL_P2P_DISABLE. Run from the
# repository root of a tree built elsewhere and carried over:
#
#   scripts/gpu-tile.sh [LOGDIR [BUILDDIR]]    (defaults: ./tile-logs, $PERSEUS_BUILD_DIR or build)
#
# Environment (optional): PERSEUS_NCCL_LIB, PYTHON, PERSEUS_PROVIDER,
# PERSEUS_IFACE as for gpu-gin.sh; TILE_STRATEGIES (default "ordered target"),
# TILE_TEST_ARGS (e.g. "-n 500"), TILE_PERF_ARGS (e.g. "-e 4M -B 1,4,16,64"),
# TILE_RUN_TIMEOUT (default 1800 s).
# Exit status: 0 every run passed (or was skipped), 1 a run failed, 77 fewer
# than 2 GPUs.
set -uo pipefail

LOGDIR=${1:-./tile-logs}
BUILD=${2:-${PERSEUS_BUILD_DIR:-build}}
TEST_BIN=$BUILD/gpu/perseus_tile_test
PERF_BIN=$BUILD/gpu/perseus_tile_perf
PLUGIN_DIR=$BUILD/plugin
PYTHON=${PYTHON:-python3}
STRATEGIES=${TILE_STRATEGIES:-ordered target}
RUN_TIMEOUT=${TILE_RUN_TIMEOUT:-1800}

for f in "$TEST_BIN" "$PERF_BIN" "$PLUGIN_DIR/libnccl-net-perseus.so"; do
  if [ ! -e "$f" ]; then
    echo "gpu-tile.sh: $f not found; build first (meson setup $BUILD && ninja -C $BUILD)" >&2
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
fab_dir=""
if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q 'libfabric\.so\.1 '; then
  for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib /usr/local/lib64 \
           /opt/amazon/efa/lib /opt/amazon/efa/lib64 "$PWD/.carry/lib"; do
    if [ -e "$d/libfabric.so.1" ]; then fab_dir=$d; break; fi
  done
fi
ld="$(cd "$PLUGIN_DIR" && pwd)${nccl_lib:+:$nccl_lib}${fab_dir:+:$fab_dir}"
export LD_LIBRARY_PATH="$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NET_PLUGIN=perseus
unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE # the programs choose per path (-p)
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
  echo "# LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  env | grep -E '^(NCCL_|PERSEUS_|CUDA_VISIBLE)' | sort | sed 's/^/# /'
  nvidia-smi -L 2>&1 | sed 's/^/# /'
} | tee "$LOGDIR/env.txt"
if [ "$ngpus" -lt 2 ]; then
  echo "gpu-tile.sh: $ngpus GPU(s) visible, 2 needed: skipped" | tee "$LOGDIR/summary.txt"
  exit 77
fi

: >"$LOGDIR/summary.txt"
failed=0 passed=0 skipped=0
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
  printf '%-40s %-26s %5ds  %s\n' "$name" "$verdict" $((SECONDS - t0)) "$log" |
    tee -a "$LOGDIR/summary.txt"
  if [ "$verdict" != PASS ] && [ "$verdict" != SKIP ]; then
    grep -E 'mismatch|signal|watchdog|failed|error|overlap|where each rank' "$log" | head -12 |
      sed 's/^/    /'
  fi
}

gpu_counts="2"
[ "$ngpus" -ge 4 ] && gpu_counts="2 4"
for g in $gpu_counts; do
  # shellcheck disable=SC2086  # TILE_TEST_ARGS is a list of options
  run "tile_test-g$g-lsa" "$TEST_BIN" -p lsa -g "$g" ${TILE_TEST_ARGS:-}
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

for s in $STRATEGIES; do
  # shellcheck disable=SC2086
  PERSEUS_ORDERING=$s run "tile_perf-g$ngpus-$s" "$PERF_BIN" -g "$ngpus" ${TILE_PERF_ARGS:-}
  sed -n '/^# machine/p;/size(B)/,$p' "$LOGDIR/tile_perf-g$ngpus-$s.log" 2>/dev/null
done

echo "# $passed passed, $failed failed, $skipped skipped" | tee -a "$LOGDIR/summary.txt"
[ "$failed" -eq 0 ]
