#!/usr/bin/env bash
# A real client over perseus: NCCL built from source, NCCL EP (contrib/nccl_ep,
# NCCL 2.30+) built against it, and ep_bench run through the plugin under each
# ordering strategy, side by side with the NVLink run, in one call on a GPU
# host; then perseus' own GIN programs on that NCCL. A source without NCCL EP
# (2.29) runs only those. NCCL loads perseus as its RMA plugin (v14) and runs its own GIN proxy
# over it, so this exercises the path MoE libraries take. Run from the
# repository root of a tree whose plugin was built (and carried over):
#
#   scripts/gpu-nccl.sh [LOGDIR [BUILDDIR]]   (defaults: ./nccl-logs, $PERSEUS_BUILD_DIR or build)
#
# Environment (optional):
#   NCCL_SRC        the NCCL source tarball, 2.29 or later (default: the newest
#                   nccl-2.3*.tar.gz in ../shared/third_party or .nccl/src)
#   NCCL_WORK       where NCCL is unpacked and built (default .nccl, git-ignored;
#                   a build already there is reused)
#   NCCL_GENCODE    nvcc -gencode flags (default sm_90 only)
#   EP_ARGS         ep_bench options (default "-a ll -t 128"; HT: "-a ht -t 4096")
#   EP_STRATEGIES   perseus runs (default "ordered target drain")
#   EP_RANKS        ranks (default 2; at most the GPUs)
#   EP_HOSTS        pretend hosts the ranks are spread over (default 2 for HT
#                   mode, "-a ht" in EP_ARGS, else 0: one host, every peer
#                   through perseus with P2P off). With N > 0 each rank gets
#                   NCCL_HOSTID and a host name (test/gpu/pretend_host.c
#                   preloaded) of host rank/(EP_RANKS/N): NVLink within a
#                   pretend host, perseus across. HT needs it: NCCL EP counts
#                   nodes by host name (nccl_ep.cc:1320) but sizes its kernels
#                   by NCCL's rail team (nccl_ep.cc:2219), and on one host with
#                   P2P off the two disagree (a NULL attn_to_rdma_map written)
#   EP_ITERS        --iters (default 20), --warmup is a quarter of it
#   EP_BUILD_ONLY   1: build NCCL and NCCL EP, run nothing
#   NCCL_PREBUILT   a tarball of such a build, made before on a host like this one
#                   (the build directory's lib, include and test/nccl_ep, stripped;
#                   the same NCCL version as the source): unpacked as the build, so
#                   nothing is compiled
#   EP_PLUGINS      extra plugin builds to compare, NAME=PATH pairs (e.g.
#                   "base=/path/libnccl-net-perseus.so"); each runs EP_STRATEGIES
#   PERSEUS_NCCL_BUILD  a perseus build directory whose GPU programs were
#                   built against this NCCL's headers (meson setup DIR
#                   -Dnccl_include=.../include, docs/gpu.md); its perseus_gin_test
#                   (put, alltoall) and perseus_tile_test (-p gin) then run on
#                   2 GPUs with this NCCL, under ordered and target. Default
#                   build-nccl<MAJOR><MINOR> (build-nccl230 for 2.30.x) where it
#                   has them; "none" runs none; a directory without them is an error
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
  # shellcheck disable=SC2012  # nccl-X.Y.Z-R.tar.gz names; sort -V picks the newest
  src=$(ls -1 ../shared/third_party/nccl-2.3*.tar.gz "$NCCL_WORK"/src/nccl-2.3*.tar.gz 2>/dev/null |
    sort -V | tail -1)
fi
if [ -z "$src" ] || [ ! -f "$src" ]; then
  echo "gpu-nccl.sh: no NCCL source tarball (set NCCL_SRC)" >&2
  exit 1
fi
tree=$NCCL_WORK/$(tar -tzf "$src" | head -1 | cut -d/ -f1)
nccl_home=$tree/build
# perseus' GIN programs for this NCCL: checked now, before the long build
# (nccl-2.30.7 -> build-nccl230). A program built against other NCCL headers
# than those it runs with may be refused by ncclDevCommCreate.
nccl_mm=$(basename "$tree" | sed -n 's/^nccl-\([0-9]*\)\.\([0-9]*\)\..*/\1\2/p')
gin_build=${PERSEUS_NCCL_BUILD-build-nccl$nccl_mm}
gin_test=$gin_build/test/gpu/perseus_gin_test tile_test=$gin_build/test/gpu/perseus_tile_test
if [ "$gin_build" = none ] || [ -z "$gin_build" ]; then
  gin_build=""
elif [ ! -x "$gin_test" ] || [ ! -x "$tile_test" ]; then
  if [ -n "${PERSEUS_NCCL_BUILD:-}" ]; then
    echo "gpu-nccl.sh: $gin_test or $tile_test not found (PERSEUS_NCCL_BUILD=$gin_build;" \
      "meson setup $gin_build -Dnccl_include=<this NCCL's include> && ninja -C $gin_build)" >&2
    exit 1
  fi
  echo "gpu-nccl.sh: no perseus GIN programs built against $(basename "$tree") in $gin_build" \
    "(PERSEUS_NCCL_BUILD): they are not run"
  gin_build=""
fi
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
if [ -n "${NCCL_PREBUILT:-}" ] && [ ! -e "$nccl_home/lib/libnccl.so" ]; then
  mkdir -p "$nccl_home" && build_step prebuilt tar -xzf "$NCCL_PREBUILT" -C "$nccl_home"
fi
if [ ! -e "$nccl_home/lib/libnccl.so" ]; then
  build_step nccl-build make -C "$tree" -j "$jobs" src.build BUILDDIR="$nccl_home" \
    NVCC_GENCODE="$gencode" \
    ONLY_FUNCS="SendRecv|AllReduce * * RING SIMPLE|AllGather RING SIMPLE|Broadcast RING SIMPLE"
fi
ep_bench=$nccl_home/test/nccl_ep/ep_bench
has_ep=1
[ -d "$tree/contrib/nccl_ep" ] || has_ep=0
if [ "$has_ep" = 1 ] && [ ! -x "$ep_bench" ]; then
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
[ "$has_ep" = 1 ] || TEST_BIN=${gin_test:-$ep_bench}
gpu_start
if [ "$has_ep" = 0 ] && [ -z "$gin_build" ]; then
  echo "gpu-nccl.sh: $(basename "$tree") has no NCCL EP (contrib/nccl_ep) and no perseus GIN programs" \
    "were built against it (PERSEUS_NCCL_BUILD): nothing to run" >&2
  exit 1
fi

iters=${EP_ITERS:-20}
need_uint gpu-nccl.sh EP_ITERS "$iters"
EP_STRATEGIES=${EP_STRATEGIES-ordered target drain}
need_list gpu-nccl.sh EP_STRATEGIES "$EP_STRATEGIES"
ranks=${EP_RANKS:-2}
case " ${EP_ARGS:-} " in *" -a ht "*) hosts=${EP_HOSTS:-2} ;; *) hosts=${EP_HOSTS:-0} ;; esac
if ! [[ $ranks =~ ^[1-9][0-9]*$ && $hosts =~ ^(0|[1-9][0-9]*)$ ]] || [ "$ranks" -gt "$ngpus" ] ||
   { [ "$hosts" -gt 0 ] && [ $((ranks % hosts)) -ne 0 ]; }; then
  echo "gpu-nccl.sh: EP_RANKS=$ranks EP_HOSTS=$hosts: expected 1..$ngpus ranks (the GPUs) spread" \
    "evenly over 0 (one host) or more pretend hosts" >&2
  exit 1
fi
pretend=""
if [ "$hosts" -gt 0 ]; then
  preload=$(cd "$BUILD/test/gpu" 2>/dev/null && pwd)/libperseus_pretend_host.so
  if [ ! -e "$preload" ]; then
    echo "gpu-nccl.sh: $preload not found (ninja -C $BUILD)" >&2
    exit 1
  fi
  pretend=$LOGDIR/pretend-host.sh
  cat >"$pretend" <<EOS || exit 1
#!/bin/sh
# one rank on pretend host rank / $((ranks / hosts)) (NCCL_HOSTID for NCCL, the host name for NCCL EP)
h=pretend-host-\$((OMPI_COMM_WORLD_RANK / $((ranks / hosts))))
NCCL_HOSTID=\$h PERSEUS_TEST_HOSTNAME=\$h LD_PRELOAD=$preload\${LD_PRELOAD:+:\$LD_PRELOAD} exec "\$@"
EOS
  chmod +x "$pretend" || exit 1
fi
# ep NAME PLUGIN EXTRA VAR=VALUE...: one validated ep_bench run on EP_RANKS
# ranks, through PLUGIN ("" = NCCL's own transports, one host), EXTRA added
# to EP_ARGS; on the pretend hosts where there are any and PLUGIN is set.
# mpirun passes on the variables named with -x: every NCCL_*, PERSEUS_*, CUDA_*
# and the library path, as set for the run.
ep() {
  local name=$1 plugin=$2 extra=$3 wrap=""; shift 3
  [ -n "$plugin" ] && wrap=$pretend
  # shellcheck disable=SC2016,SC2086  # expanded by the inner shell; option lists
  run "$name" env -u NCCL_NET_PLUGIN ${plugin:+NCCL_NET_PLUGIN=$plugin} "$@" bash -c '
    np=$1; shift
    xs=(); for v in $(env | grep -oE "^(NCCL|PERSEUS|CUDA|LD_LIBRARY)[A-Z0-9_]*" | sort -u); do xs+=(-x "$v"); done
    exec mpirun -np "$np" --bind-to none "${xs[@]}" "$@"' ep "$ranks" $wrap "$ep_bench" ${EP_ARGS:--a ll -t 128} \
    $extra --validate --iters "$iters" --warmup $(( (iters + 3) / 4 ))
  grep -E '^(Dispatch|Combine|Total)|bw=' "$LOGDIR/$name.log" | head -8 | sed 's/^/    /'
}

new_plugin=$(cd "$PLUGIN_DIR" && pwd)/libnccl-net-perseus.so
plugins="new=$new_plugin ${EP_PLUGINS:-}"
if [ "$has_ep" = 1 ]; then
  ep ep-nvlink "" ""
else
  echo "# $(basename "$tree") has no NCCL EP (contrib/nccl_ep): ep_bench not run" | tee -a "$LOGDIR/summary.txt"
  plugins=""
fi
for pv in $plugins; do
  pname=${pv%%=*} path=${pv#*=}
  for s in $EP_STRATEGIES; do
    if [ "$hosts" -gt 0 ]; then # NVLink within a pretend host, perseus across
      ep "ep-$pname-$s" "$path" "" NCCL_GIN_TYPE=2 PERSEUS_ORDERING="$s"
    else
      ep "ep-$pname-$s" "$path" --disable-nvlink NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
        NCCL_GIN_TYPE=2 PERSEUS_ORDERING="$s"
    fi
  done
done
# perseus' own GIN programs on this NCCL (PERSEUS_NCCL_BUILD): the device
# API through NCCL's GIN proxy over perseus' table, every byte verified; the
# source-built NCCL's lib first on the library path, each program's own NCCL
# variables (GIN proxy, P2P and SHM off), the same plugin as above.
if [ -n "$gin_build" ]; then
  for s in ordered target; do
    for mode in put alltoall; do
      run "gin_test-$s-$mode" env LD_LIBRARY_PATH="$nccl_home/lib:$LD_LIBRARY_PATH" \
        NCCL_NET_PLUGIN="$new_plugin" PERSEUS_ORDERING="$s" "$gin_test" -g 2 -o "$mode" -n 20
    done
    run "tile_test-gin-$s" env LD_LIBRARY_PATH="$nccl_home/lib:$LD_LIBRARY_PATH" \
      NCCL_NET_PLUGIN="$new_plugin" PERSEUS_ORDERING="$s" "$tile_test" -p gin -g 2 -n 20
  done
  grep -h -s -m1 '^# NCCL ' "$LOGDIR/gin_test-ordered-put.log" | sed 's/^/    /'
fi

# The transport bound: perseus' large-message GIN bandwidth per rank in this
# run (perseus_tile_perf on 2 GPUs, 1 and 4 MiB tiles, 64 a round to the one
# peer, one signal per 64: 64 x size / round time, the better of the two),
# and each ep_bench phase against the time its bytes need at that bandwidth.
tile_perf=$BUILD/bench/perseus_tile_perf
if [ -x "$tile_perf" ] && [ "$has_ep" = 1 ]; then
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
        # kernel times: LL prints them as "avg=", HT as "kernel="; the bytes
        # through perseus: LL every byte, HT those to other hosts (rdma_send)
        /^(Dispatch|Combine): +(avg|kernel)=/ {
          v = $2; sub(/^[a-z]+=/, "", v)
          if ($1 == "Dispatch:") d = v + 0; else c = v + 0
        }
        /^Byte counts:/ { split($3, a, "="); mb = a[2] + 0 }
        /^Byte counts \(per rank avg\):/ {
          for (i = 1; i <= NF; i++) if ($i ~ /^rdma_send=/) { split($i, a, "="); mb = a[2] + 0 }
        }
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
