#!/usr/bin/env bash
# Striping (PERSEUS_NSTREAMS) A/B on the CPU-only two-sided benchmark:
# perseus_net_perf's send/recv bandwidth per message size with each endpoint
# count, in one run, and each count's bandwidth over one endpoint's.
#
#   scripts/stripe-bench.sh [LOGDIR]     (default ./stripe-logs; run from a built tree)
#
# Environment:
#   STRIPE_COUNTS   PERSEUS_NSTREAMS values, list (default "1 2 4 8"; the first is the base)
#   NET_PERF_ARGS   perseus_net_perf arguments (default "-b 256K -e 256M -f 4 -t sendrecv -n 20 -w 3")
#   PERSEUS_PROVIDER, PERSEUS_IFACE  as for the plugin (default tcp;ofi_rxm on lo)
#   PERSEUS_BUILD_DIR  the build (default build)
# Each extra endpoint has a thread that polls while its parts are in
# flight: a host needs about (count + 1) cores per rank to show the gain,
# and the script says when it has fewer.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck source=scripts/args-common.sh
. scripts/args-common.sh || exit 1
script_args stripe-bench.sh 1 "$@"
LOGDIR=${1:-stripe-logs}
B=${PERSEUS_BUILD_DIR:-build}
COUNTS=${STRIPE_COUNTS-1 2 4 8}
need_list stripe-bench.sh STRIPE_COUNTS "$COUNTS"
for n in $COUNTS; do need_uint stripe-bench.sh "STRIPE_COUNTS entry" "$n" 1 8; done
ARGS=${NET_PERF_ARGS:--b 256K -e 256M -f 4 -t sendrecv -n 20 -w 3}
bench=$B/bench/perseus_net_perf
[ -x "$bench" ] || { echo "stripe-bench.sh: no $bench (build first)" >&2; exit 1; }
mkdir -p -- "$LOGDIR" || exit 1
export PERSEUS_PROVIDER=${PERSEUS_PROVIDER:-tcp;ofi_rxm} PERSEUS_IFACE=${PERSEUS_IFACE:-lo}
cores=$(nproc)
echo "# stripe-bench: $(hostname), $cores cores, $(date -u '+%F %H:%M') UTC, $(git describe --always --dirty 2>/dev/null)"
echo "# $PERSEUS_PROVIDER on $PERSEUS_IFACE, perseus_net_perf $ARGS"
logs=()
for n in $COUNTS; do
  case $n in '' | *[!0-9]*) echo "stripe-bench.sh: STRIPE_COUNTS has '$n', expected counts 1..8" >&2; exit 2 ;; esac
  [ $((2 * (n + 1))) -gt "$cores" ] && echo "# note: $n endpoints want about $((2 * (n + 1))) cores for 2 ranks; this host has $cores"
  # shellcheck disable=SC2086 # ARGS is a list of arguments
  if ! PERSEUS_NSTREAMS=$n "$bench" $ARGS >"$LOGDIR/nstreams-$n.log" 2>&1; then
    echo "stripe-bench.sh: perseus_net_perf with PERSEUS_NSTREAMS=$n failed (see $LOGDIR/nstreams-$n.log)" >&2
    exit 1
  fi
  logs+=("$LOGDIR/nstreams-$n.log")
done
# rows: size, then busbw per count and its ratio to the first count
awk -v counts="$COUNTS" '
  BEGIN { n = split(counts, c, " ") }
  FNR == 1 { f++; table = 0 }
  /^# [a-z]/ { table = $2 == "sendrecv" } # a table header: only sendrecv rows count
  table && /^ +[0-9]+ +[0-9]+ +[a-z0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+/ {
    if (!($1 in seen)) { seen[$1] = 1; order[++rows] = $1 }
    bw[$1, f] = $6
  }
  END {
    if (!rows) {
      print "stripe-bench.sh: no sendrecv rows in the logs (NET_PERF_ARGS must run -t sendrecv or all)" > "/dev/stderr"
      exit 1
    }
    printf "%12s", "size(B)"
    for (i = 1; i <= n; i++) printf "  %9s", c[i] " ep GB/s"
    for (i = 2; i <= n; i++) printf "  %7s", c[i] "/" c[1]
    printf "\n"
    for (r = 1; r <= rows; r++) {
      s = order[r]; printf "%12s", s
      for (i = 1; i <= n; i++) printf "  %9s", ((s, i) in bw) ? bw[s, i] : "-"
      for (i = 2; i <= n; i++)
        printf "  %7s", ((s, i) in bw && (s, 1) in bw && bw[s, 1] > 0) ? sprintf("%.2fx", bw[s, i] / bw[s, 1]) : "-"
      printf "\n"
    }
  }' "${logs[@]}"
