#!/bin/sh
# Prints the project version: meson's own reading of project() in meson.build,
# the one place the version is written. Used by the package build scripts.
set -eu
cd "$(dirname "$0")/.."
meson introspect --projectinfo meson.build |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["version"])'
