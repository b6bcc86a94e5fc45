#!/usr/bin/env bash
# Builds a pinned libfabric release with CUDA support into a prefix, so that
# providers can register GPU memory themselves (FI_HMEM) and perseus' direct
# path for GPU windows runs (PERSEUS_STAGING, docs/gpu.md). The CUDA runtime
# is loaded at run time (--enable-cuda-dlopen): the build needs the CUDA
# toolkit's headers, not a GPU, and the result also loads on hosts without
# one. Build on the dev machine and carry the prefix to a GPU host.
#
#   scripts/build-libfabric.sh [PREFIX]     (default .libfabric/prefix, git-ignored)
#
# Environment:
#   LIBFABRIC_SRC   a libfabric source tree or tarball (default .libfabric/src/
#                   libfabric-$LIBFABRIC_VERSION.tar.gz or a directory of that name);
#                   a git tree needs autotools (autogen.sh), which are installed
#   LIBFABRIC_VERSION  the release expected (default 1.22.0): the build stops
#                   when the source says another
#   CUDA_HOME       the CUDA toolkit (default /usr/local/cuda)
#
# Then build perseus against it:
#   PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig meson setup build-hmem
#   LD_LIBRARY_PATH=$PREFIX/lib ...        (when running)
# It ends by listing which of its providers offer FI_HMEM.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/args-common.sh
. scripts/args-common.sh || exit 1
script_args build-libfabric.sh 1 "$@"
VERSION=${LIBFABRIC_VERSION:-1.22.0}
PREFIX=${1:-.libfabric/prefix}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
SRC=${LIBFABRIC_SRC:-.libfabric/src/libfabric-$VERSION.tar.gz}
[ -e "$SRC" ] || SRC=${SRC%.tar.gz}
if [ ! -e "$SRC" ]; then
  echo "build-libfabric.sh: no libfabric source at ${LIBFABRIC_SRC:-.libfabric/src/libfabric-$VERSION[.tar.gz]}" >&2
  echo "  (a release tarball from github.com/ofiwg/libfabric, or its git tree at v$VERSION)" >&2
  exit 1
fi
if [ ! -f "$CUDA_HOME/include/cuda.h" ]; then
  echo "build-libfabric.sh: no CUDA toolkit at CUDA_HOME=$CUDA_HOME (cuda.h not found)" >&2
  exit 1
fi
mkdir -p .libfabric "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
WORK=$(mktemp -d "$PWD/.libfabric/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ -d "$SRC" ]; then
  cp -a "$SRC/." "$WORK/"
else
  tar -xzf "$SRC" -C "$WORK" --strip-components=1
fi
cd "$WORK"
if [ ! -x configure ]; then
  for t in autoreconf libtoolize automake; do
    command -v $t >/dev/null || { sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd=sudo;
      $sudo_cmd apt-get install -y -q autoconf automake libtool >/dev/null; break; }
  done
  ./autogen.sh >autogen.log 2>&1 || { tail -20 autogen.log; exit 1; }
fi
have=$(sed -n 's/^AC_INIT(\[libfabric\], \[\([^]]*\)\].*/\1/p' configure.ac)
if [ "$have" != "$VERSION" ]; then
  echo "build-libfabric.sh: the source is libfabric $have, expected $VERSION (LIBFABRIC_VERSION)" >&2
  exit 1
fi
# libfabric's CUDA support includes nvml.h for three NVML calls it makes
# through dlopen; toolkits without the NVML headers get these declarations.
CPPFLAGS_SHIM=""
if [ ! -f "$CUDA_HOME/include/nvml.h" ]; then
  mkdir -p shim
  cat >shim/nvml.h <<'EOF_NVML'
/* NVML as libfabric's CUDA support uses it (resolved at run time). */
#ifndef PERSEUS_NVML_SHIM_H
#define PERSEUS_NVML_SHIM_H
typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count);
nvmlReturn_t nvmlShutdown(void);
#endif
EOF_NVML
  CPPFLAGS_SHIM="-I$WORK/shim"
  echo "no nvml.h in $CUDA_HOME/include: using a declaration shim for the three NVML calls"
fi
# The providers perseus runs on here (tcp, rxm, shm, sockets) and the HMEM
# interfaces; the hardware providers build where their libraries are.
CPPFLAGS="${CPPFLAGS:-} $CPPFLAGS_SHIM" \
./configure --prefix="$PREFIX" --with-cuda="$CUDA_HOME" --enable-cuda-dlopen \
  --enable-tcp --enable-rxm --enable-shm --enable-sockets --disable-psm3 --disable-opx \
  --disable-usnic >configure.log 2>&1 || { tail -30 configure.log; exit 1; }
grep -E "^\*\*\*|CUDA" configure.log | grep -iE "cuda|provider" | head -5 || true
make -j"$(nproc)" >make.log 2>&1 || { tail -30 make.log; exit 1; }
make install >install.log 2>&1 || { tail -30 install.log; exit 1; }
echo "libfabric $VERSION with CUDA (dlopen) installed in $PREFIX"
echo "providers offering FI_HMEM (CUDA support is only initialized where a GPU and its driver are):"
LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/fi_info" -c FI_HMEM 2>/dev/null | awk '/^provider:/{print "  " $2}' | sort -u || true
