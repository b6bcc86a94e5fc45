#!/usr/bin/env bash
# Run build/bench/perseus_coll_perf on a GPU host, from the repository root, with
# a tree built elsewhere (the dev machine) and carried over.
#
#   scripts/gpu_coll_perf.sh [perseus_coll_perf options...]
#   e.g. scripts/gpu_coll_perf.sh -g 2 -o all -b 1M -e 1G
#
# NCCL comes from the PyTorch environment's nvidia.nccl package when there is
# one (its lib/ goes first in LD_LIBRARY_PATH), else from the system. The binary
# links libnccl.so.2 by soname with no rpath, so LD_LIBRARY_PATH decides.
# With OUT set, everything printed also goes to $OUT/coll_perf.log.
set -uo pipefail

BUILD=${PERSEUS_BUILD_DIR:-build}  # the meson build directory to use
BIN=$BUILD/bench/perseus_coll_perf
PLUGIN=$BUILD/plugin/libnccl-net-perseus.so
PYTHON=${PYTHON:-python3}

ldconfig_p() {
  { command -v ldconfig >/dev/null && ldconfig -p; } 2>/dev/null ||
    /sbin/ldconfig -p 2>/dev/null || true
}

main() {
  if [ ! -x "$BIN" ]; then
    echo "gpu_coll_perf.sh: $BIN not found; run from the repository root of a built tree" \
         "(meson setup build && ninja -C build, on a machine with nvcc and nccl.h)" >&2
    return 1
  fi

  # NCCL of the PyTorch environment (nvidia-nccl-cu* wheel), else the system's.
  local nccl_pkg nccl_lib=""
  nccl_pkg=$("$PYTHON" -c 'import nvidia.nccl as m, os
f = getattr(m, "__file__", None)
print(os.path.dirname(f) if f else list(m.__path__)[0])' 2>/dev/null) || nccl_pkg=""
  if [ -n "$nccl_pkg" ] && [ -e "$nccl_pkg/lib/libnccl.so.2" ]; then
    nccl_lib="$nccl_pkg/lib"
    echo "# NCCL from the Python environment: $nccl_lib"
  else
    echo "# nvidia.nccl not importable with $PYTHON (or has no lib/libnccl.so.2);" \
         "using the system NCCL: $(ldconfig_p | awk '/libnccl\.so\.2 /{print $NF; exit}')"
  fi

  # libfabric.so.1 (runtime only on the GPU host) for the perseus plugin.
  local fab_dir=""
  if ! ldconfig_p | grep -q 'libfabric\.so\.1 '; then
    local d
    for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib /usr/local/lib64 \
             /opt/amazon/efa/lib /opt/amazon/efa/lib64 "$PWD/.carry/lib"; do
      if [ -e "$d/libfabric.so.1" ]; then fab_dir=$d; break; fi
    done
    if [ -z "$fab_dir" ]; then
      echo "gpu_coll_perf.sh: libfabric.so.1 not found (ldconfig, common folders);" \
           "the perseus sweep will fail to load the plugin" >&2
    fi
  fi

  local ld="${nccl_lib}${fab_dir:+${nccl_lib:+:}$fab_dir}"
  if [ -n "$ld" ]; then
    export LD_LIBRARY_PATH="${ld}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  echo "# LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-(unset)}"
  echo "# $BIN -> $(ldd "$BIN" 2>/dev/null | awk '/libnccl/{print $3}')"
  if [ -e "$PLUGIN" ]; then
    local missing
    missing=$(ldd "$PLUGIN" 2>/dev/null | awk '/not found/{print $1}' | tr '\n' ' ')
    echo "# $PLUGIN -> libfabric: $(ldd "$PLUGIN" 2>/dev/null | awk '/libfabric/{print $3}')" \
         "${missing:+(NOT FOUND: $missing)}"
  fi
  nvidia-smi -L 2>&1 | sed 's/^/# /'

  "$BIN" "$@"
}

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  main "$@" 2>&1 | tee "$OUT/coll_perf.log"
  exit "${PIPESTATUS[0]}"
fi
main "$@"
