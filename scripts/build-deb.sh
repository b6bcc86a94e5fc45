#!/bin/bash
# Builds the Debian packages libnccl-net-perseus, perseus-dev and perseus-bench
# from this source tree (uncommitted changes included):
#   scripts/build-deb.sh [OUTDIR]        (default OUTDIR: build-deb/)
# The tree is copied to a temporary directory (packaging/export-tree.sh),
# packaging/debian becomes debian/ there, debian/changelog is written with the
# meson project version (the project's one version number), and
#   dpkg-buildpackage -us -uc -b
# runs; the .debs are copied to OUTDIR and the temporary directory removed.
# Environment: DEB_BUILD_OPTIONS (default "noautodbgsym": no -dbgsym
# packages; add "nocheck" to skip the unit tests of the build),
# PERSEUS_KEEP_BUILD=1 keeps the temporary directory (its path is printed).
set -eu
cd "$(dirname "$0")/.."
# shellcheck source=scripts/args-common.sh
. scripts/args-common.sh || exit 1
script_args build-deb.sh 1 "$@"
case ${PERSEUS_KEEP_BUILD:-0} in 0 | 1) ;; *) echo "build-deb.sh: PERSEUS_KEEP_BUILD=$PERSEUS_KEEP_BUILD: 0 or 1 expected" >&2; exit 1 ;; esac
OUT="${1:-build-deb}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

PERSEUS_WITH_PACKAGING=1 scripts/install-deps.sh
VERSION="$(packaging/version.sh)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-deb.XXXXXX")"
if [ "${PERSEUS_KEEP_BUILD:-0}" = 1 ]; then echo "build-deb: build tree kept in $WORK"
else trap 'rm -rf "$WORK"' EXIT; fi
TREE="$WORK/perseus-$VERSION"
packaging/export-tree.sh "$TREE"
REV="$(cat "$TREE/.perseus-revision")"
DATE="$(git log -1 --format=%aD 2>/dev/null || date -R)"

rm -rf "$TREE/debian"
cp -r packaging/debian "$TREE/debian"
MAINT="$(sed -n 's/^Maintainer: //p' "$TREE/debian/control")"
cat >"$TREE/debian/changelog" <<CHANGELOG
perseus ($VERSION) unstable; urgency=medium

  * Built from revision $REV by scripts/build-deb.sh.

 -- $MAINT  $DATE
CHANGELOG

export DEB_BUILD_OPTIONS="${DEB_BUILD_OPTIONS:-noautodbgsym}"
# The copy is no git checkout: keep git from finding a repository above it,
# so that the revision comes from .perseus-revision.
export GIT_CEILING_DIRECTORIES="$WORK"
(cd "$TREE" && dpkg-buildpackage -us -uc -b -J"$(nproc)")

for f in "$WORK"/*.deb; do
  cp "$f" "$OUT/"
  echo "build-deb: $OUT/$(basename "$f")"
done
