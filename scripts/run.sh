#!/bin/sh
# README command 1: build perseus and run the main job on the embedded
# default: loopback, libfabric tcp, host memory, no GPU.
#   scripts/run.sh [benchmark options...]      (see -h)
set -eu
cd "$(dirname "$0")/.."
scripts/install-deps.sh
[ -f build/build.ninja ] || meson setup build >/dev/null
ninja -C build >/dev/null
export PERSEUS_PROVIDER="${PERSEUS_PROVIDER:-tcp;ofi_rxm}"
export PERSEUS_IFACE="${PERSEUS_IFACE:-lo}"
exec build/bench/perseus_net_perf "$@"
