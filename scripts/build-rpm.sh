#!/bin/bash
# Builds the RPMs perseus, perseus-devel and perseus-bench (and the source
# RPM) on an RPM distribution, from this source tree (uncommitted changes
# included), with packaging/rpm/perseus.spec:
#   scripts/build-rpm.sh [OUTDIR]        (default OUTDIR: build-rpm/)
# Needs rpmbuild and the spec's BuildRequires (Fedora/RHEL: dnf install
# rpm-build meson ninja-build gcc libfabric-devel). The version is meson's
# project version, passed as --define "perseus_version X.Y.Z".
# Extra arguments for rpmbuild: PERSEUS_RPMBUILD_ARGS.
set -eu
cd "$(dirname "$0")/.."
# shellcheck source=scripts/args-common.sh
. scripts/args-common.sh || exit 1
script_args build-rpm.sh 1 "$@"
OUT="${1:-build-rpm}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
command -v rpmbuild >/dev/null || { echo "build-rpm: rpmbuild not found (package rpm-build)" >&2; exit 1; }
VERSION="$(packaging/version.sh)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-rpm.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/SOURCES" "$WORK/SPECS"
packaging/export-tree.sh "$WORK/perseus-$VERSION"
REV="$(cat "$WORK/perseus-$VERSION/.perseus-revision")"
tar -C "$WORK" -czf "$WORK/SOURCES/perseus-$VERSION.tar.gz" "perseus-$VERSION"

# The spec with a changelog entry for this build.
SPEC="$WORK/SPECS/perseus.spec"
cp packaging/rpm/perseus.spec "$SPEC"
NAME="$(git log -1 --format='%an <%ae>' 2>/dev/null || echo 'perseus maintainers')"
printf '* %s %s - %s-1\n- Built from revision %s by scripts/build-rpm.sh.\n' \
  "$(LC_ALL=C date '+%a %b %d %Y')" "$NAME" "$VERSION" "$REV" >>"$SPEC"

# shellcheck disable=SC2086
GIT_CEILING_DIRECTORIES="$WORK" rpmbuild -ba --define "_topdir $WORK" \
  --define "perseus_version $VERSION" ${PERSEUS_RPMBUILD_ARGS:-} "$SPEC"

find "$WORK/RPMS" "$WORK/SRPMS" -name '*.rpm' -exec cp {} "$OUT/" \; -exec sh -c 'echo "build-rpm: $1/$(basename "$2")"' sh "$OUT" {} \;
