#!/bin/sh
# README command 1: build perseus and run the main job on the embedded
# default: loopback, libfabric tcp, host memory, no GPU. The job is
# perseus_put_signal_perf: tiles + one signal per peer through the plugin's
# one-sided table, every ordering strategy side by side, drain (the
# baseline that blocks the proxy) against the others.
#   scripts/run.sh [benchmark options...]      (see -h)
set -eu
cd "$(dirname "$0")/.."
scripts/install-deps.sh
[ -f build/build.ninja ] || meson setup build >/dev/null
ninja -C build >/dev/null
export PERSEUS_PROVIDER="${PERSEUS_PROVIDER:-tcp;ofi_rxm}"
if [ -z "${PERSEUS_IFACE:-}" ]; then
  [ "$PERSEUS_PROVIDER" = shm ] && PERSEUS_IFACE=shm || PERSEUS_IFACE=lo
fi
export PERSEUS_IFACE
exec build/bench/perseus_put_signal_perf "$@"
