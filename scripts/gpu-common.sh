# shellcheck shell=bash
# Shared by scripts/gpu-gin.sh, gpu-tile.sh and gpu-moe.sh (sourced, not run):
# the build check, NCCL and libfabric discovery, the environment both set up,
# env.txt and the GPU count, one logged run with its verdict, and the summary.
# The sourcing script calls gpu_paths first, sets RUN_TIMEOUT, GPU_ENV_FABRIC
# (1: env.txt names the plugin's libfabric), and for run() RUN_NAME_WIDTH (the
# name column) and RUN_GREP (what a failed run's log shows); GPU_MIN (default
# 2) is the fewest GPUs worth running on.

# shellcheck source=scripts/args-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/args-common.sh" || exit 1

# gpu_paths KIND [LOGDIR [BUILDDIR]]: the script's arguments and where the
# programs are: sets GPU_SCRIPT (gpu-KIND.sh, for messages), LOGDIR (default
# ./KIND-logs), BUILD (default $PERSEUS_BUILD_DIR, else build), TEST_BIN
# (test/gpu/perseus_KIND_test), PERF_BIN (bench/perseus_KIND_perf),
# PLUGIN_DIR and PYTHON (default python3).
gpu_paths() {
  GPU_SCRIPT=gpu-$1.sh
  script_args "$GPU_SCRIPT" 2 "${@:2}"
  case $1 in nccl) RUN_TIMEOUT_VAR=EP_RUN_TIMEOUT ;; *) RUN_TIMEOUT_VAR=${1^^}_RUN_TIMEOUT ;; esac
  LOGDIR=${2:-./$1-logs}
  BUILD=${3:-${PERSEUS_BUILD_DIR:-build}}
  TEST_BIN=$BUILD/test/gpu/perseus_$1_test
  # shellcheck disable=SC2034  # PERF_BIN is for the sourcing script
  PERF_BIN=$BUILD/bench/perseus_$1_perf
  PLUGIN_DIR=$BUILD/plugin
  PYTHON=${PYTHON:-python3}
}

# ldconfig -p, where there is one (quietly nothing otherwise)
gpu_ldconfig_p() {
  { command -v ldconfig >/dev/null && ldconfig -p; } 2>/dev/null ||
    /sbin/ldconfig -p 2>/dev/null || true
}

# gpu_need_built HINT FILE...: exit 1 unless every FILE and the plugin exist
# (HINT ends the "build first (...)" advice), then makes LOGDIR.
gpu_need_built() {
  local hint=$1 f; shift
  for f in "$@" "$PLUGIN_DIR/libnccl-net-perseus.so"; do
    if [ ! -e "$f" ]; then
      echo "$GPU_SCRIPT: $f not found; build first (meson setup $BUILD && ninja -C $BUILD$hint)" >&2
      exit 1
    fi
  done
  mkdir -p -- "$LOGDIR" || exit 1
}

# Sets nccl_lib: the override, else the PyTorch environment's wheel, else
# empty (the system's).
gpu_find_nccl() {
  local pkg
  nccl_lib=${PERSEUS_NCCL_LIB:-}
  if [ -n "$nccl_lib" ] && [ ! -e "$nccl_lib/libnccl.so.2" ]; then
    echo "$GPU_SCRIPT: PERSEUS_NCCL_LIB=$nccl_lib holds no libnccl.so.2" >&2
    exit 1
  fi
  if [ -z "$nccl_lib" ]; then
    pkg=$("$PYTHON" -c 'import nvidia.nccl as m, os
f = getattr(m, "__file__", None)
print(os.path.dirname(f) if f else list(m.__path__)[0])' 2>/dev/null) || pkg=""
    if [ -n "$pkg" ] && [ -e "$pkg/lib/libnccl.so.2" ]; then nccl_lib=$pkg/lib; fi
  fi
}

# Sets fab_dir: where libfabric.so.1 is for the plugin, where the loader does
# not know it already (else empty).
gpu_find_fabric() {
  local d
  fab_dir=""
  if ! gpu_ldconfig_p | grep -q 'libfabric\.so\.1 '; then
    for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib /usr/local/lib64 \
             /opt/amazon/efa/lib /opt/amazon/efa/lib64 "$PWD/.carry/lib"; do
      if [ -e "$d/libfabric.so.1" ]; then fab_dir=$d; break; fi
    done
  fi
}

# The environment every script runs under: NCCL (nccl_lib, gpu_find_nccl) and
# libfabric (fab_dir, gpu_find_fabric) found, the plugin, NCCL and libfabric
# on LD_LIBRARY_PATH, the perseus plugin, its provider and interface. Each
# script exports its own NCCL path variables besides.
gpu_export_env() {
  local ld
  gpu_find_nccl
  gpu_find_fabric
  ld="$(cd "$PLUGIN_DIR" && pwd)${nccl_lib:+:$nccl_lib}${fab_dir:+:$fab_dir}"
  export LD_LIBRARY_PATH="$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export NCCL_NET_PLUGIN=perseus
  export PERSEUS_PROVIDER=${PERSEUS_PROVIDER:-tcp;ofi_rxm}
  if [ -z "${PERSEUS_IFACE:-}" ]; then
    [ "$PERSEUS_PROVIDER" = shm ] && PERSEUS_IFACE=shm || PERSEUS_IFACE=lo
  fi
  export PERSEUS_IFACE NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
}

# gpu_start: sets ngpus, writes LOGDIR/env.txt (with the plugin's libfabric
# where GPU_ENV_FABRIC=1), exits 77 with fewer than GPU_MIN GPUs, else empties
# the summary and zeroes the counts run() keeps.
gpu_start() {
  ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  {
    echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
    echo "# perseus $(git describe --always --dirty 2>/dev/null || echo '?'), build $BUILD"
    echo "# NCCL: ${nccl_lib:-system} -> $(ldd "$TEST_BIN" 2>/dev/null | awk '/libnccl/{print $3}')"
    if [ "${GPU_ENV_FABRIC:-0}" = 1 ]; then
      echo "# plugin -> libfabric: $(ldd "$PLUGIN_DIR/libnccl-net-perseus.so" 2>/dev/null |
        awk '/libfabric/{print $3}')"
    fi
    echo "# LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    env | grep -E '^(NCCL_|PERSEUS_|CUDA_VISIBLE)' | sort | sed 's/^/# /'
    nvidia-smi -L 2>&1 | sed 's/^/# /'
  } | tee "$LOGDIR/env.txt"

  if [ "$ngpus" -lt "${GPU_MIN:-2}" ]; then
    echo "$GPU_SCRIPT: $ngpus GPU(s) visible, ${GPU_MIN:-2} needed: skipped" | tee "$LOGDIR/summary.txt"
    exit 77
  fi

  : >"$LOGDIR/summary.txt"
  failed=0 passed=0 skipped=0
}

# run NAME COMMAND...: one logged run, its verdict in the summary
run() {
  need_uint "$GPU_SCRIPT" "$RUN_TIMEOUT_VAR" "$RUN_TIMEOUT"
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
  printf "%-${RUN_NAME_WIDTH}s %-26s %5ds  %s\n" "$name" "$verdict" $((SECONDS - t0)) "$log" |
    tee -a "$LOGDIR/summary.txt"
  if [ "$verdict" != PASS ] && [ "$verdict" != SKIP ]; then
    grep -E "$RUN_GREP" "$log" | head -12 | sed 's/^/    /'
  fi
}

# The last line of the summary; the status the script ends with.
gpu_finish() {
  echo "# $passed passed, $failed failed, $skipped skipped" | tee -a "$LOGDIR/summary.txt"
  [ "$failed" -eq 0 ]
}
