#!/bin/bash
# Packaging check, run by scripts/test.sh (one test there):
#   builds the .debs with scripts/build-deb.sh, unpacks them into a scratch
#   root with dpkg -x, and checks that every file is in its package and place,
#   that the plugin exports only nccl*Plugin_v* symbols, that versions agree
#   with meson.build, and that the installed plugin and the installed
#   perseus_net_perf work (traffic on loopback only).
# Prints "ok"/"FAIL" per check and exits non-zero if any failed.
# PERSEUS_BUILD_DIR (default build): the build tree whose ABI harness is used.
set -eu
cd "$(dirname "$0")/.."
# shellcheck source=scripts/args-common.sh
. scripts/args-common.sh || exit 1
script_args check-package.sh 0 "$@"
BUILD="${PERSEUS_BUILD_DIR:-build}"
PERSEUS_WITH_PACKAGING=1 scripts/install-deps.sh

WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-pkgcheck.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
ROOT="$WORK/root"
LOG="$WORK/check.log"
VERSION="$(packaging/version.sh)"
ARCH="$(dpkg-architecture -qDEB_HOST_ARCH)"
MA="$(dpkg-architecture -qDEB_HOST_MULTIARCH)"
REV=""
git rev-parse --is-inside-work-tree >/dev/null 2>&1 && REV="$(git describe --always --dirty)"
LIBDIR="$ROOT/usr/lib/$MA"
LIB="$LIBDIR/libnccl-net-perseus.so"
export PKG_CONFIG_PATH="$LIBDIR/pkgconfig"
DEB_LIB="$WORK/debs/libnccl-net-perseus_${VERSION}_$ARCH.deb"
DEB_DEV="$WORK/debs/perseus-dev_${VERSION}_$ARCH.deb"
DEB_BENCH="$WORK/debs/perseus-bench_${VERSION}_$ARCH.deb"
SYMS='^(nccl(Net|Gin|Rma|CollNet)Plugin_v[0-9]+|perseus_rma_peer_stats|perseus_rma_process_stats|perseus_rma_ordering)$'
ONE_SIDED='ncclGinPlugin_v11 ncclGinPlugin_v12 ncclGinPlugin_v13 ncclRmaPlugin_v13 ncclRmaPlugin_v14'

npass=0 nfail=0
check() { # description, command...: the command's output goes to $LOG
  desc="$1"; shift
  if "$@" >"$LOG" 2>&1; then npass=$((npass + 1)); echo "ok   $desc"
  else nfail=$((nfail + 1)); echo "FAIL $desc"; sed 's/^/     /' "$LOG" | tail -30; fi
}

# --- the checks ------------------------------------------------------------------
# The file list of a .deb, one path a line, without "./".
deb_files() { dpkg-deb --fsys-tarfile "$1" | tar -t | sed 's|^\./||; s|/$||'; }
has_file() { # deb, path regex: the deb holds a file matching it
  deb_files "$1" | grep -xE "$2" || { echo "$(basename "$1") has no $2; it holds:"; deb_files "$1"; return 1; }
}
lacks_file() { # deb, path regex
  ! deb_files "$1" | grep -xE "$2"
}
only_the_plugin_so() {
  sos="$(deb_files "$DEB_LIB" | grep -E '\.so(\.[0-9]+)*$')"
  echo "$sos"; [ "$sos" = "usr/lib/$MA/libnccl-net-perseus.so" ]
}
three_debs() {
  set -- "$WORK"/debs/*.deb
  printf '%s\n' "$@"
  [ $# = 3 ] && [ -f "$DEB_LIB" ] && [ -f "$DEB_DEV" ] && [ -f "$DEB_BENCH" ]
}
field_has() { # deb, field, regex
  dpkg-deb -f "$1" "$2"; dpkg-deb -f "$1" "$2" | grep -qE "$3"
}
versions_are_meson() {
  for d in "$DEB_LIB" "$DEB_DEV" "$DEB_BENCH"; do
    v="$(dpkg-deb -f "$d" Version)"; echo "$(basename "$d"): $v"; [ "$v" = "$VERSION" ] || return 1
  done
}
soname_unversioned() {
  readelf -d "$LIB" | grep SONAME; readelf -d "$LIB" | grep -qF 'Library soname: [libnccl-net-perseus.so]'
}
exports_only_plugin_tables() {
  syms="$(nm -D --defined-only "$LIB" | awk '{print $NF}')"
  echo "$syms"
  for s in $ONE_SIDED perseus_rma_peer_stats perseus_rma_process_stats perseus_rma_ordering; do
    echo "$syms" | grep -qx "$s" || { echo "missing: $s"; return 1; }
  done
  echo "$syms" | grep -q '^ncclNetPlugin_v[0-9]*$' && ! echo "$syms" | grep -vE "$SYMS"
}
no_rpath() { ! readelf -d "$LIB" "$ROOT/usr/bin/perseus_net_perf" | grep -E 'RPATH|RUNPATH'; }
pc_ok() {
  # prefix=/usr in the .pc: point it at the scratch root
  pc="pkg-config --define-variable=prefix=$ROOT/usr"
  echo "version $($pc --modversion perseus), nccl_min_version $($pc --variable=nccl_min_version perseus)," \
    "plugindir $($pc --variable=plugindir perseus), plugin $($pc --variable=plugin perseus)"
  [ "$($pc --modversion perseus)" = "$VERSION" ] &&
    [ -n "$($pc --variable=nccl_min_version perseus)" ] &&
    [ -f "$($pc --variable=plugindir perseus)/$($pc --variable=plugin perseus)" ]
}
header_ok() { # compile against the installed header, found through the .pc
  cat >"$WORK/ver.c" <<'C'
#include <perseus/perseus_version.h>
#include <stdio.h>
#if PERSEUS_VERSION_CODE != PERSEUS_VERSION_NUM(PERSEUS_VERSION_MAJOR, PERSEUS_VERSION_MINOR, PERSEUS_VERSION_PATCH)
#error PERSEUS_VERSION_CODE
#endif
int main(void) {
  printf("%s %d.%d.%d\n", PERSEUS_VERSION, PERSEUS_VERSION_MAJOR, PERSEUS_VERSION_MINOR,
         PERSEUS_VERSION_PATCH);
  return 0;
}
C
  # shellcheck disable=SC2046
  cc -std=c11 -Wall -Werror $(pkg-config --define-variable=prefix="$ROOT/usr" --cflags perseus) \
    -o "$WORK/ver" "$WORK/ver.c" && "$WORK/ver" && [ "$("$WORK/ver")" = "$VERSION $VERSION" ]
}
harness() { # ABI version: the build tree's harness on the installed plugin
  env PERSEUS_PLUGIN_PATH="$LIB" NCCL_DEBUG=INFO \
    "$BUILD/test/perseus_abi_harness" -v "$1" -r 2 -s sizes -m 1048576 2>&1 | tee "$WORK/harness-v$1.log"
  [ "${PIPESTATUS[0]}" = 0 ]
}
logs_version() {
  grep -F "initializing" "$WORK/harness-v12.log" | head -1
  grep -qF "perseus $VERSION (${REV:-}" "$WORK/harness-v12.log"
}
net_perf_by_name() { # the installed benchmark dlopen()s the plugin by name, as NCCL does
  LD_DEBUG=files LD_LIBRARY_PATH="$LIBDIR" "$ROOT/usr/bin/perseus_net_perf" -b 8 -e 64K -n 2 -w 1 \
    2>"$WORK/ld.log" || { tail -20 "$WORK/ld.log"; return 1; }
  grep -F "calling init: $LIB" "$WORK/ld.log" | head -1 | grep .
}

# --- build and unpack ------------------------------------------------------------
echo "perseus $VERSION ${REV:+($REV) }packages for $ARCH ($MA)"
t0=$(date +%s)
if ! scripts/build-deb.sh "$WORK/debs" >"$WORK/build-deb.log" 2>&1; then
  tail -40 "$WORK/build-deb.log"; echo "FAIL scripts/build-deb.sh"; exit 1
fi
echo "built the packages in $(($(date +%s) - t0)) s"
check "three packages, version $VERSION" three_debs
for d in "$DEB_LIB" "$DEB_DEV" "$DEB_BENCH"; do
  [ -f "$d" ] && dpkg -x "$d" "$ROOT"
done

# --- files in their packages --------------------------------------------------------
check "libnccl-net-perseus: usr/lib/$MA/libnccl-net-perseus.so" has_file "$DEB_LIB" "usr/lib/$MA/libnccl-net-perseus\.so"
check "libnccl-net-perseus: no other shared object, no .so.N" only_the_plugin_so
check "perseus-dev: usr/include/perseus/perseus_version.h" has_file "$DEB_DEV" "usr/include/perseus/perseus_version\.h"
check "perseus-dev: usr/include/perseus/perseus_rma.h" has_file "$DEB_DEV" "usr/include/perseus/perseus_rma\.h"
check "perseus-dev: usr/include/perseus/device.cuh" has_file "$DEB_DEV" "usr/include/perseus/device\.cuh"
check "perseus-dev: usr/include/perseus/device/batch.cuh" has_file "$DEB_DEV" "usr/include/perseus/device/batch\.cuh"
check "perseus-dev: usr/lib/$MA/pkgconfig/perseus.pc" has_file "$DEB_DEV" "usr/lib/$MA/pkgconfig/perseus\.pc"
check "perseus-bench: usr/bin/perseus_net_perf" has_file "$DEB_BENCH" "usr/bin/perseus_net_perf"
check "perseus-bench: usr/share/man/man1/perseus_net_perf.1" has_file "$DEB_BENCH" "usr/share/man/man1/perseus_net_perf\.1(\.gz)?"
for doc in README.md docs/design.md docs/results.md; do
  check "perseus-bench: usr/share/doc/perseus/$doc" has_file "$DEB_BENCH" "usr/share/doc/perseus/$doc(\.gz)?"
done
check "perseus-bench: no perseus_coll_perf (packages build with -Dcuda=disabled)" \
  lacks_file "$DEB_BENCH" ".*perseus_coll_perf"

# --- metadata and the installed plugin ------------------------------------------------
check "libnccl-net-perseus Depends on libfabric1" field_has "$DEB_LIB" Depends 'libfabric1'
check "package versions are the meson version $VERSION" versions_are_meson
check "plugin SONAME is libnccl-net-perseus.so (no version suffix)" soname_unversioned
check "plugin exports only $SYMS (ncclNetPlugin_v*, $ONE_SIDED among them)" exports_only_plugin_tables
check "no RPATH/RUNPATH in the installed plugin and benchmark" no_rpath
check "pkg-config: perseus $VERSION, nccl_min_version set, plugindir/plugin is the plugin" pc_ok
check "<perseus/perseus_version.h> through pkg-config --cflags perseus says $VERSION" header_ok

# --- the installed plugin at work (loopback TCP only) -----------------------------------
export PERSEUS_PROVIDER='tcp;ofi_rxm' PERSEUS_IFACE=lo
[ -f "$BUILD/build.ninja" ] || meson setup "$BUILD" >/dev/null
ninja -C "$BUILD" test/perseus_abi_harness >/dev/null
for v in 12 8; do
  check "ABI harness ($BUILD) on the installed plugin: v$v, 2 ranks, sizes up to 1 MiB" harness "$v"
done
# The copy build-deb.sh builds is no git checkout: vcs_tag fell back to the
# revision recorded in .perseus-revision.
check "installed plugin logs its version and revision: perseus $VERSION (${REV:-...})" logs_version
check "installed perseus_net_perf finds the plugin by name through LD_LIBRARY_PATH" net_perf_by_name

echo "package checks: $npass passed, $nfail failed"
[ "$nfail" -eq 0 ]
