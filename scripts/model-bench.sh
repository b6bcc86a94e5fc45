#!/usr/bin/env bash
# The proxy-bound regime of seed 000 on the model fabric (docs/model.md):
# perseus_put_signal_perf per link latency, link bandwidth and peer count,
# each strategy's time per batch next to what the model in docs/model.md
# predicts, and drain's time over each strategy's.
#
#   scripts/model-bench.sh [LOGDIR]     (default ./model-logs; run from a built tree)
#
# Environment (each a space-separated list where it says so):
#   MODEL_PEERS     peers per rank (ranks - 1), list (default "8")
#   MODEL_LAT_US    link latencies in us, list (default "2 5")
#   MODEL_GBPS      link bandwidths in GB/s, list (default "12.5 25")
#   MODEL_SIZE      tile size (default 16K), MODEL_T tiles per signal (default 8)
#   MODEL_ITERS     timed batches (default 2000: a run of a few hundred ms, so that
#                   one descheduling on a busy host does not decide it), warmup a tenth
#   MODEL_BIND      1: each rank and its NIC threads on their own share of the
#                   cores (put_signal_perf -A), as a proxy runs near its NIC (on a
#                   host of several sockets); 0: unbound (default 0)
#   MODEL_LATENCY   1: also each strategy's batch latency (batch mode: the next
#                   batch starts once every signal of this one arrived), and drain's
#                   over it (default 1)
#   MODEL_REPS      runs of each measurement, one after the other (default 1;
#                   each run times every strategy in turn): each time is then the
#                   median of the runs, and `vs drain` the median of the runs' own
#                   ratios with their lowest and highest (a busy or virtual host
#                   varies between runs far more than the strategies differ within one)
#   PERSEUS_BUILD_DIR  the build (default build)
#   PERSEUS_MODEL_NIC_THREADS  NIC threads per rank (default: what the cores
#                   allow, 1..4: the ranks' cores left over, shared out)
# First a calibration run measures each strategy's fixed costs on links too
# fast to matter (0 us, 1000 GB/s): c, the proxy's cost per operation, from
# T = P (t + 1) c for ordered, fence and target (target's also pays the
# remote completion of each write it receives), and drain's cost per peer
# turn d0 from T = P d0 (posting, the NIC's copy and its completion notice);
# the model then adds what latency and bandwidth cost each (docs/model.md;
# drain's turn adds its last tile's wire time and the round trip to d0: its
# other tiles crossed while the proxy posted to the other peers).
# Each rank needs a core for itself and one for its NIC
# thread: a host with fewer than 2 (P + 1) cores measures its scheduler, and
# the script says so.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck source=scripts/args-common.sh
. scripts/args-common.sh || exit 1
script_args model-bench.sh 1 "$@"
LOGDIR=${1:-model-logs}
B=${PERSEUS_BUILD_DIR:-build}
PEERS=${MODEL_PEERS-8}
LATS=${MODEL_LAT_US-2 5}
BWS=${MODEL_GBPS-12.5 25}
SIZE=${MODEL_SIZE:-16K}
T=${MODEL_T:-8}
ITERS=${MODEL_ITERS:-2000}
REPS=${MODEL_REPS:-1}
need_list model-bench.sh MODEL_PEERS "$PEERS"
need_list model-bench.sh MODEL_LAT_US "$LATS"
need_list model-bench.sh MODEL_GBPS "$BWS"
for p in $PEERS; do need_uint model-bench.sh "MODEL_PEERS entry" "$p" 1 31; done
# the model fabric's own ranges (PERSEUS_MODEL_LATENCY_US, PERSEUS_MODEL_GBPS)
for l in $LATS; do need_num model-bench.sh "MODEL_LAT_US entry" "$l" 0 1000000; done
for g in $BWS; do need_num model-bench.sh "MODEL_GBPS entry" "$g" 0.01 1000; done
USER_NIC=${PERSEUS_MODEL_NIC_THREADS:-}
[ -n "$USER_NIC" ] && need_uint model-bench.sh PERSEUS_MODEL_NIC_THREADS "$USER_NIC" 1 16
need_uint model-bench.sh MODEL_T "$T" 1 4096
need_uint model-bench.sh MODEL_ITERS "$ITERS"
need_uint model-bench.sh MODEL_REPS "$REPS" 1 50
BIND=${MODEL_BIND:-0}
LATENCY=${MODEL_LATENCY:-1}
case $BIND in 0) BIND_ARG="" ;; 1) BIND_ARG="-A" ;; *) echo "model-bench.sh: MODEL_BIND=$BIND: 0 or 1 expected" >&2; exit 1 ;; esac
case $LATENCY in 0 | 1) ;; *) echo "model-bench.sh: MODEL_LATENCY=$LATENCY: 0 or 1 expected" >&2; exit 1 ;; esac
bench=$B/bench/perseus_put_signal_perf
[ -x "$bench" ] || { echo "model-bench.sh: no $bench (build first)" >&2; exit 1; }
[ -f "$B/test/model/libmodel-fi.so" ] || { echo "model-bench.sh: no model fabric in $B/test/model" >&2; exit 1; }
mkdir -p -- "$LOGDIR" || exit 1
B=$(cd -- "$B" && pwd) || exit 1 # relative or absolute alike
export FI_PROVIDER_PATH=$B/test/model PERSEUS_PROVIDER=model PERSEUS_IFACE=model0
bytes=$(numfmt --from=iec "$SIZE") || { echo "model-bench.sh: MODEL_SIZE=$SIZE is not a size" >&2; exit 1; }
cores=$(nproc)
echo "# model-bench: $(hostname), $cores cores, $(date -u '+%F %H:%M') UTC, $(git describe --always --dirty 2>/dev/null)"
echo "# tile $bytes B, $T tiles per signal, $ITERS batches, $REPS run(s) of each, ranks $([ -n "$BIND_ARG" ] && echo "bound to a share of the cores each" || echo unbound)"

# One run; prints "strategy time_us" per row of the table. A sixth argument
# gives the mode (-m, default stream).
run() { # log ranks latency gbps strategies [mode]
  PERSEUS_MODEL_LATENCY_US=$3 PERSEUS_MODEL_GBPS=$4 timeout 600 "$bench" -r "$2" -b "$SIZE" -e "$SIZE" \
    -t "$T" -n "$ITERS" -w $((ITERS / 10 + 1)) -c 1 -s "$5" -z "$SIZE" -m "${6:-stream}" $BIND_ARG >"$1" 2>&1 || {
    echo "model-bench.sh: run failed, see $1" >&2; tail -5 "$1" >&2; return 1; }
  awk '$1 ~ /^[0-9]+$/ && NF >= 10 {print $3, $4}' "$1"
}

# REPS runs of the four strategies (log prefix, ranks, latency, gbps[, mode]);
# prints "run strategy time_us" per strategy and run.
runs() {
  local r
  for ((r = 0; r < REPS; r++)); do
    run "$1-run$r.log" "$2" "$3" "$4" ordered,fence,target,drain "${5:-stream}" |
      awk -v r="$r" '{ print r, $1, $2 }' || return 1
  done
}
# From runs' lines: "strategy median_us" per strategy, and with drain "ratio_median ratio_min ratio_max" of drain's time over its, run by run.
summary='
  { t[$2, $1] = $3; if (!($2 in seen)) { seen[$2] = 1; order[n++] = $2 } if ($1 + 1 > R) R = $1 + 1 }
  function median(a, m,   i, j, x) {
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { x = a[i]; a[i] = a[j]; a[j] = x }
    return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
  }
  END {
    for (i = 0; i < n; i++) {
      st = order[i]; split("", v); split("", q)
      for (r = 0; r < R; r++) { v[r + 1] = t[st, r]; q[r + 1] = t["drain", r] / t[st, r] }
      lo = hi = q[1]; for (r = 2; r <= R; r++) { if (q[r] < lo) lo = q[r]; if (q[r] > hi) hi = q[r] }
      printf "%s %.3f %.3f %.3f %.3f\n", st, median(v, R), median(q, R), lo, hi
    }
  }'

for P in $PEERS; do
  R=$((P + 1))
  [ $((2 * R)) -gt "$cores" ] && echo "# note: $R ranks and their NIC threads need $((2 * R)) cores, this host has $cores"
  # A rank's copies to its peers run on its NIC threads: with one, a rank's
  # links share one core's memcpy rate, not the per-link bandwidth asked for.
  nic=${USER_NIC:-$(( cores / R - 1 ))}
  [ "$nic" -lt 1 ] && nic=1
  [ -z "$USER_NIC" ] && [ "$nic" -gt 4 ] && nic=4
  export PERSEUS_MODEL_NIC_THREADS=$nic
  echo "# P = $P: $R ranks, $nic NIC thread(s) each (PERSEUS_MODEL_NIC_THREADS)"
  cal=$(runs "$LOGDIR/calibrate-p$P" "$R" 0 1000) || exit 1
  cal=$(echo "$cal" | awk "$summary" | awk '{ print $1, $2 }')
  consts=$(echo "$cal" | awk -v P="$P" -v k="$T" '
    $1 == "drain" { printf "drain %.3f ", $2 / P; next }
    { printf "%s %.3f ", $1, $2 / (P * (k + 1)) }')
  echo "# P = $P: calibration (0 us, 1000 GB/s), us: $(echo "$cal" | tr '\n' ' ')"
  echo "# P = $P: c per operation (ordered, fence, target) and d0 per drain turn, us: $consts"
  printf "# %4s %6s %9s %9s %11s %11s %8s %9s\n" P "L(us)" "B(GB/s)" strategy "meas(us)" "model(us)" "err" "vs drain"
  for L in $LATS; do
    for BW in $BWS; do
      rows=$(runs "$LOGDIR/p$P-l$L-b$BW" "$R" "$L" "$BW") || exit 1
      echo "$rows" | awk "$summary" | awk -v P="$P" -v L="$L" -v BW="$BW" -v consts="$consts" -v k="$T" -v s="$bytes" -v reps="$REPS" '
        function max(a, b) { return a > b ? a : b }
        BEGIN { nf = split(consts, f, " "); for (i = 1; i < nf; i += 2) c[f[i]] = f[i + 1] }
        { meas[$1] = $2; ratio[$1] = $3; lo[$1] = $4; hi[$1] = $5; order[n++] = $1 }
        END {
          wire = k * s / (BW * 1e3)            # t.s/B in us
          for (i = 0; i < n; i++) {
            st = order[i]; m = meas[st]
            # a drain turn: what a calibration turn held (posts, the NIC copy,
            # the completion notice), then the wire time of the last tile of
            # the turn only, the rest having crossed while the proxy
            # posted to the other peers (a tile to this peer every P posts),
            # unless the link falls behind those posts; then the round trip
            tile = s / (BW * 1e3)
            if (st == "drain") pred = P * (c["drain"] + max(tile, wire - (k - 1) * P * c["ordered"]) + 2 * L)
            else { post = P * (k + 1) * c[st]; pred = post > wire ? post : wire }
            printf "  %4d %6s %9s %9s %11.1f %11.1f %+7.0f%% %8.2fx", P, L, BW, st, m, pred,
                   100 * (m - pred) / pred, ratio[st]
            if (reps > 1) printf " (%.2f-%.2f)", lo[st], hi[st]
            printf "\n"
          }
        }'
      [ "$LATENCY" = 1 ] || continue
      lat=$(runs "$LOGDIR/p$P-l$L-b$BW-latency" "$R" "$L" "$BW" batch) || exit 1
      echo "$lat" | awk "$summary" | awk -v P="$P" -v L="$L" -v BW="$BW" -v reps="$REPS" '
        { meas[$1] = $2; ratio[$1] = $3; lo[$1] = $4; hi[$1] = $5; order[n++] = $1 }
        END {
          printf "  %4d %6s %9s   batch latency (us):", P, L, BW
          for (i = 0; i < n; i++) {
            printf " %s %.1f (%.2fx lower than drain", order[i], meas[order[i]], ratio[order[i]]
            if (reps > 1) printf ", %.2f-%.2f", lo[order[i]], hi[order[i]]
            printf ")"
          }
          printf "\n"
        }'
    done
  done
done
