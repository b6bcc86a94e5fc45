#!/bin/sh
# Installs what perseus needs to build and test, on Debian 12 or Ubuntu 24.04.
# Idempotent: installs only the packages that are missing.
set -eu
[ "$#" -eq 0 ] || { echo "install-deps.sh: takes no arguments (PERSEUS_WITH_CLANG, _VALGRIND, _PACKAGING=1 add packages)" >&2; exit 1; }
for v in PERSEUS_WITH_CLANG PERSEUS_WITH_VALGRIND PERSEUS_WITH_PACKAGING; do
  eval "val=\${$v:-0}"
  case "$val" in 0 | 1) ;; *) echo "install-deps.sh: $v='$val': 0 or 1 expected" >&2; exit 1 ;; esac
done
PKGS="build-essential pkg-config meson ninja-build libfabric-dev libfabric-bin libibverbs-dev git python3"
[ "${PERSEUS_WITH_CLANG:-0}" = 1 ] && PKGS="$PKGS clang"
[ "${PERSEUS_WITH_VALGRIND:-0}" = 1 ] && PKGS="$PKGS valgrind"
# scripts/build-deb.sh and scripts/check-package.sh: dpkg-buildpackage and dh
# (Rules-Requires-Root: no, so no fakeroot), nm/readelf from binutils.
[ "${PERSEUS_WITH_PACKAGING:-0}" = 1 ] && PKGS="$PKGS dpkg-dev debhelper binutils"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "perseus: installing:$missing"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
