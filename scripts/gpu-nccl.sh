#!/usr/bin/env bash
# A real client over perseus: NCCL built from source, NCCL EP (contrib/nccl_ep,
# NCCL 2.30+) built against it, and ep_bench run through the plugin under each
# ordering strategy, side by side with the NVLink run, in one call on a GPU
# host. NCCL loads perseus as its RMA plugin (v14) and runs its own GIN proxy
# over it, so this exercises the path MoE libraries take. Run from the
# repository root of a tree whose plugin was built (and carried over):
#
#   scripts/gpu-nccl.sh [LOGDIR [BUILDDIR]]   (defaults: ./nccl-logs, $PERSEUS_BUILD_DIR or build)
#
# Environment (optional):
#   NCCL_SRC        the NCCL source tarball (default: the newest
#                   nccl-2.3*.tar.gz in ../shared/third_party or .nccl/src)
#   NCCL_WORK       where NCCL is unpacked and built (default .nccl, git-ignored;
#                   a build already there is reused)
#   NCCL_GENCODE    nvcc -gencode flags (default sm_90 only)
#   EP_ARGS         ep_bench options (default "-a ll -t 128"; HT: "-a ht -t 4096")
#   EP_STRATEGIES   perseus runs (default "ordered target drain")
#   EP_ITERS        --iters (default 20), --warmup is a quarter of it
#   EP_BUILD_ONLY   1: build NCCL and NCCL EP, run nothing
#   EP_PLUGINS      extra plugin builds to compare, NAME=PATH pairs (e.g.
#                   "base=/path/libnccl-net-perseus.so"); each runs EP_STRATEGIES
#   PERSEUS_PROVIDER, PERSEUS_IFACE as for gpu-gin.sh; PERSEUS_STATS=1 prints
#   perseus' per-operation times at each comm's close.
# The NCCL build keeps only the functions ep_bench needs (ONLY_FUNCS) and so
# runs with NCCL_ALGO=Ring NCCL_PROTO=Simple. Exit status: 0 every run passed,
# 1 a build or run failed, 77 fewer than 2 GPUs.
set -uo pipefail

# shellcheck source=scripts/gpu-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu-common.sh" || exit 1
gpu_paths nccl "$@"
RUN_TIMEOUT=${EP_RUN_TIMEOUT:-300} RUN_NAME_WIDTH=28 GPU_ENV_FABRIC=1
RUN_GREP='FAIL|fail|error|Error|mismatch|watchdog|timed out'
gpu_need_built ""
NCCL_WORK=${NCCL_WORK:-.nccl}
mkdir -p "$NCCL_WORK" || exit 1
NCCL_WORK=$(cd "$NCCL_WORK" && pwd)

# --- the NCCL source ---
src=${NCCL_SRC:-}
if [ -z "$src" ]; then
  src=$(ls -1 ../shared/third_party/nccl-2.3*.tar.gz "$NCCL_WORK"/src/nccl-2.3*.tar.gz 2>/dev/null |
    sort -V | tail -1)
fi
if [ -z "$src" ] || [ ! -f "$src" ]; then
  echo "gpu-nccl.sh: no NCCL 2.30+ source tarball (set NCCL_SRC)" >&2
  exit 1
fi
tree=$NCCL_WORK/$(tar -tzf "$src" | head -1 | cut -d/ -f1)
nccl_home=$tree/build
jobs=$(nproc 2>/dev/null || echo 8)
gencode=${NCCL_GENCODE:--gencode=arch=compute_90,code=sm_90}
# NCCL EP's Makefile wants MPI_HOME/include/mpi.h and MPI_HOME/lib/libmpi.so:
# Debian's OpenMPI keeps them under /usr/lib/<arch>/openmpi, which mpicc names.
mpi_home=${MPI_HOME:-}
if [ -z "$mpi_home" ]; then
  mpi_inc=$(mpicc --showme:incdirs 2>/dev/null | tr ' ' '\n' | grep -m1 '/include$')
  mpi_home=${mpi_inc%/include}
  [ -n "$mpi_home" ] || mpi_home=$(dirname "$(dirname "$(command -v mpicc || echo /usr/bin/mpicc)")")
fi

build_step() { # NAME COMMAND...: logged; exits on failure
  local log="$LOGDIR/$1.log" t0=$SECONDS; shift
  echo "# $*" >"$log"
  if ! "$@" >>"$log" 2>&1; then
    echo "gpu-nccl.sh: $(basename "$log" .log) failed after $((SECONDS - t0)) s; last lines of $log:" >&2
    tail -20 "$log" >&2
    exit 1
  fi
  echo "built $(basename "$log" .log) in $((SECONDS - t0)) s"
}

mkdir -p "$LOGDIR" || exit 1
if [ ! -e "$tree/Makefile" ]; then
  build_step unpack tar -xzf "$src" -C "$NCCL_WORK"
fi
if [ ! -e "$nccl_home/lib/libnccl.so" ]; then
  build_step nccl-build make -C "$tree" -j "$jobs" src.build BUILDDIR="$nccl_home" \
    NVCC_GENCODE="$gencode" \
    ONLY_FUNCS="SendRecv|AllReduce * * RING SIMPLE|AllGather RING SIMPLE|Broadcast RING SIMPLE"
fi
ep_bench=$nccl_home/test/nccl_ep/ep_bench
if [ ! -x "$ep_bench" ]; then
  build_step ep-build make -C "$tree/contrib/nccl_ep" -j "$jobs" lib ep_bench MPI=1 \
    MPI_HOME="$mpi_home" BUILDDIR="$nccl_home" NVCC_GENCODE="$gencode"
fi

[ "${EP_BUILD_ONLY:-0}" = 1 ] && exit 0

# --- the runs ---
# The bound is measured through perseus' own GIN programs, built against the
# PyTorch environment's NCCL: find that before NCCL EP's takes its place.
gpu_find_nccl
bound_nccl=$nccl_lib
export PERSEUS_NCCL_LIB=$nccl_home/lib
gpu_export_env
unset NCCL_NET_PLUGIN
export CUDA_MODULE_LOADING=EAGER NCCL_ALGO=Ring NCCL_PROTO=Simple
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TEST_BIN=$ep_bench
gpu_start

iters=${EP_ITERS:-20}
# ep NAME PLUGIN EXTRA VAR=VALUE...: one validated ep_bench run on 2 ranks,
# through PLUGIN ("" = NCCL's own transports), EXTRA added to EP_ARGS.
# mpirun passes on the variables named with -x: every NCCL_*, PERSEUS_*, CUDA_*
# and the library path, as set for the run.
ep() {
  local name=$1 plugin=$2 extra=$3; shift 3
  # shellcheck disable=SC2016,SC2086  # expanded by the inner shell; option lists
  run "$name" env -u NCCL_NET_PLUGIN ${plugin:+NCCL_NET_PLUGIN=$plugin} "$@" bash -c '
    xs=(); for v in $(env | grep -oE "^(NCCL|PERSEUS|CUDA|LD_LIBRARY)[A-Z0-9_]*" | sort -u); do xs+=(-x "$v"); done
    exec mpirun -np 2 --bind-to none "${xs[@]}" "$@"' ep "$ep_bench" ${EP_ARGS:--a ll -t 128} \
    $extra --validate --iters "$iters" --warmup $(( (iters + 3) / 4 ))
  grep -E '^(Dispatch|Combine|Total)|bw=' "$LOGDIR/$name.log" | head -8 | sed 's/^/    /'
}

ep ep-nvlink "" ""
plugins="new=$(cd "$PLUGIN_DIR" && pwd)/libnccl-net-perseus.so ${EP_PLUGINS:-}"
for pv in $plugins; do
  pname=${pv%%=*} path=${pv#*=}
  for s in ${EP_STRATEGIES:-ordered target drain}; do
    ep "ep-$pname-$s" "$path" --disable-nvlink NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
      NCCL_GIN_TYPE=2 PERSEUS_ORDERING="$s"
  done
done
# The transport bound: perseus' large-message GIN bandwidth per rank in this
# run (perseus_tile_perf on 2 GPUs, 1 and 4 MiB tiles, 64 a round to the one
# peer, one signal per 64: 64 x size / round time, the better of the two),
# and each ep_bench phase against the time its bytes need at that bandwidth.
tile_perf=$BUILD/bench/perseus_tile_perf
if [ -x "$tile_perf" ]; then
  run tile-perf-bound env LD_LIBRARY_PATH="$PLUGIN_DIR${bound_nccl:+:$bound_nccl}${fab_dir:+:$fab_dir}" \
    NCCL_NET_PLUGIN=perseus PERSEUS_ORDERING=ordered "$tile_perf" -g 2 -p gin -b 1M -e 4M -f 4 \
    -B 64 -t 64 -n 10 -w 2
  gbs=$(awk '$2 == 64 && $3 == "|" && $5 + 0 > 0 { bw = 64 * $1 / ($5 * 1e3); if (bw > best) best = bw }
             END { if (best > 0) printf "%.2f", best }' "$LOGDIR/tile-perf-bound.log")
  {
    echo "# transport bound: perseus GIN ${gbs:-?} GB/s per rank (perseus_tile_perf, 1-4 MiB tiles)"
    printf "# %-22s %12s %12s %10s %10s\n" run dispatch_us combine_us disp/bound comb/bound
    for f in "$LOGDIR"/ep-*.log; do
      awk -v name="$(basename "$f" .log)" -v gbs="${gbs:-0}" '
        /^Dispatch: / { sub("avg=", "", $2); d = $2 + 0 }
        /^Combine: / { sub("avg=", "", $2); c = $2 + 0 }
        /^Byte counts:/ { split($3, a, "="); mb = a[2] + 0 }
        END {
          bound = gbs > 0 ? mb * 1e3 / gbs : 0  # us: MB at GB/s
          rd = "-"; rc = "-"
          if (bound > 0) { rd = sprintf("%.2f", d / bound); rc = sprintf("%.2f", c / bound) }
          printf "# %-22s %12.1f %12.1f %10s %10s\n", name, d, c, rd, rc
        }' "$f"
    done
  } | tee -a "$LOGDIR/summary.txt"
fi
gpu_finish
