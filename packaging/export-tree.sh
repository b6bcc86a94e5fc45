#!/bin/bash
# Copies the source tree to DEST for a package build, as a release tarball
# would hold it:   packaging/export-tree.sh DEST
# In a git checkout: the tracked files and the untracked ones git does not
# ignore (uncommitted changes included); elsewhere: the whole tree minus
# build directories. DEST/.perseus-revision records the git revision, which
# the plugin logs at init when it is built outside git (see meson.build).
set -eu
DEST="$1"
cd "$(dirname "$0")/.."
mkdir -p "$DEST"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # A deleted tracked file stays listed until the deletion is committed.
  git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -xf - -C "$DEST"
  git describe --always --dirty >"$DEST/.perseus-revision"
else
  tar --exclude='./build*' --exclude='./debian' -cf - . | tar -xf - -C "$DEST"
  [ -f "$DEST/.perseus-revision" ] || echo unknown >"$DEST/.perseus-revision"
fi
