#!/bin/sh
# Runs a GPU test, or exits 77 (meson's "skipped") where no NVIDIA GPU is
# visible, as on CI machines.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "no NVIDIA GPU visible: skipped"
  exit 77
fi
exec "$@"
