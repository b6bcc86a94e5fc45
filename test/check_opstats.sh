#!/bin/sh
# check_opstats.sh [--staged] [--throttled] [--threaded] COMMAND [ARGS...]: runs COMMAND with
# PERSEUS_STATS=1 (its stderr also passed through) and checks the
# per-operation stats lines the one-sided engine prints when a comm closes:
#   - COMMAND exits 0 and prints at least one "times of N ops" line;
#   - every peer whose first line counts puts has a times line and a held-back
#     line, with N > 0 and queued, wire, total and settled timed;
#   - every timed interval reads p50 <= p90 <= p99 <= max and mean <= max;
#     no step of the engine's (queued, copy, wire, signal wait) is longer
#     than the time to settled, and neither the copy nor the report lag
#     longer than the total to the report (max against max; a staged put is
#     reported once copied out, so its total may be the shorter);
#   - the depth at post reads p50 <= max, and its max is the first line's
#     "max in flight" (both are the most operations posted to the peer);
#   - with --staged (GPU source windows through staging, e.g. rma_test -G dsg):
#     some peer has copies out of the GPU timed and a post held back for a
#     send slot, a copy or a credit, and some peer's chunks went in fewer
#     staged writes than there were chunks (packed into one write);
#   - every comm's "progress calls, passes" line reads 1 <= passes <= calls
#     (passes >= 1 only, where an engine thread made them; with --threaded
#     every comm must have had one),
#     and is followed by its calls line: a share inside perseus of 0-100%,
#     data calls timed where the comm was busy (some comm was), and the gap
#     between data calls in order;
#     with --throttled (a long PERSEUS_PROGRESS_INTERVAL_US) some comm made
#     at least twice as many calls as passes;
#   - with --atomics all|none: every signal of every peer went as an atomic
#     add (the NIC applies it), or none did.
staged=0 throttled=0 want_threaded=0 atomics=""
while :; do
  case $1 in
    --staged) staged=1; shift ;;
    --throttled) throttled=1; shift ;;
    --threaded) want_threaded=1; shift ;;
    --atomics)
      case $2 in all | none) ;; *) echo "check_opstats.sh: --atomics takes all or none, not '$2'" >&2; exit 2 ;; esac
      atomics=$2; shift 2 ;;
    *) break ;;
  esac
done
log=$(mktemp) || exit 1
trap 'rm -f "$log"' EXIT
PERSEUS_STATS=1 "$@" 2>"$log"
rc=$?
cat "$log" >&2
if [ "$rc" -ne 0 ]; then
  echo "check_opstats.sh: $1 exited with $rc" >&2
  exit 1
fi
awk -v staged="$staged" -v throttled="$throttled" -v want_threaded="$want_threaded" -v atomics="$atomics" '
function fail(msg) { print "check_opstats.sh: " msg >"/dev/stderr"; bad = 1 }
# The value of interval `name` on this line: "-" (not timed) or its four
# numbers and mean in v[1..5]; "" when the line lacks it.
function interval(line, name, v,   s, n) {
  if (!match(line, " " name " (-|[0-9.]+/[0-9.]+/[0-9.]+/[0-9.]+ mean [0-9.]+)")) return ""
  s = substr(line, RSTART + length(name) + 2, RLENGTH - length(name) - 2)
  if (s == "-") return "-"
  sub(/ mean /, "/", s)
  n = split(s, v, "/")
  return n == 5 ? "timed" : ""
}
/^perseus stats: rank [0-9]+: [0-9]+ progress calls, [0-9]+ passes/ {
  ncomms++
  threaded = $0 ~ /made by the engine thread/
  if (threaded) nthreaded++
  if (!($8 + 0 >= 1 && (threaded || $8 + 0 <= $5 + 0)))
    fail("rank " $4 " " $5 " progress calls but " $8 " passes")
  if (!threaded && $5 + 0 >= 2 * ($8 + 0)) fewer++
}
/^perseus stats: rank [0-9]+: NCCL.s calls while work was outstanding / {
  ncalls++
  pct = $0; sub(/.*ms, /, "", pct); sub(/% of it inside perseus.*/, "", pct)
  if (!(pct + 0 >= 0 && pct + 0 <= 100)) fail("rank " $4 " inside perseus " pct "%")
  nd = $0; sub(/.*: data /, "", nd); sub(/ .*/, "", nd)
  busy = $0; sub(/.*outstanding \(/, "", busy); sub(/ ms.*/, "", busy)
  if (busy + 0 > 0 && !(nd + 0 >= 1)) fail("rank " $4 ": busy, but no data call timed: " $0)
  if (nd + 0 >= 1) datacalls++
  what = interval($0, "gap between data calls", v)
  if (what == "") fail("rank " $4 ": no gap interval in: " $0)
  else if (what == "timed" && !(v[1] + 0 <= v[2] + 0 && v[2] + 0 <= v[3] + 0 && v[3] + 0 <= v[4] + 0 && v[5] + 0 <= v[4] + 0))
    fail("rank " $4 ": gap between data calls out of order: " v[1] "/" v[2] "/" v[3] "/" v[4] " mean " v[5])
}
/^perseus stats: rank [0-9]+ -> [0-9]+ \(/ {
  key = $4 "->" $6
  for (i = 1; i <= NF; i++) {
    if ($i == "puts") puts[key] = $(i + 1)
    if ($i == "in" && $(i + 1) == "flight") inflight[key] = $(i + 2) + 0
    if ($i == "staged" && $(i + 1) == "writes") swrites[key] = $(i + 2) + 0
    if ($i == "chunks" && $(i - 2) == "of") schunks[key] = $(i - 1) + 0
    if ($i == "signals" && $(i + 2) ~ /^\(/) {
      nsig = $(i + 1) + 0; nat = substr($(i + 2), 2) + 0; sigs += nsig
      if (atomics == "all" && nat != nsig) fail(key ": " nat " of " nsig " signals as atomics, all expected")
      if (atomics == "none" && nat != 0) fail(key ": " nat " of " nsig " signals as atomics, none expected")
    }
  }
}
/^perseus stats: rank [0-9]+ -> [0-9]+ times of / {
  key = $4 "->" $6
  times[key] = 1
  nops = $9
  if (nops + 0 <= 0) fail(key ": times of " nops " ops")
  tmax = -1; smax = -1
  if (interval($0, "total", tv) == "timed") tmax = tv[4] + 0
  if (interval($0, "settled", tv) == "timed") smax = tv[4] + 0
  for (k = 1; k <= 8; k++) {
    nm = k == 1 ? "queued" : k == 2 ? "copy" : k == 3 ? "post call" : k == 4 ? "wire" : \
         k == 5 ? "signal wait" : k == 6 ? "report lag" : k == 7 ? "total" : "settled"
    what = interval($0, nm, v)
    if (what == "") { fail(key ": no \"" nm "\" interval in: " $0); continue }
    if (what == "-") {
      if (nm == "queued" || nm == "wire" || nm == "total" || nm == "settled") fail(key ": " nm " not timed")
      continue
    }
    if (!(v[1] + 0 <= v[2] + 0 && v[2] + 0 <= v[3] + 0 && v[3] + 0 <= v[4] + 0))
      fail(key ": " nm " p50/p90/p99/max out of order: " v[1] "/" v[2] "/" v[3] "/" v[4])
    if (v[5] + 0 > v[4] + 0) fail(key ": " nm " mean " v[5] " over its max " v[4])
    if ((nm == "queued" || nm == "copy" || nm == "wire" || nm == "signal wait") && v[4] + 0 > smax)
      fail(key ": " nm " max " v[4] " over the settled max " smax)
    if ((nm == "copy" || nm == "report lag") && v[4] + 0 > tmax)
      fail(key ": " nm " max " v[4] " over the total max " tmax)
    if (nm == "copy") copies++
  }
}
/^perseus stats: rank [0-9]+ -> [0-9]+ held back \(stops\/passes\): / {
  key = $4 "->" $6
  held[key] = 1
  line = $0
  gsub(/,|;/, "", line)
  n = split(line, f, " ")
  for (i = 1; i <= n; i++) {
    if (f[i] == "provider" || f[i] == "bound" || f[i] == "slot" || f[i] == "unfilled" ||
        f[i] == "copy" || f[i] == "credit") {
      if (split(f[i + 1], sp, "/") != 2 || sp[1] + 0 > sp[2] + 0 || (sp[1] + 0 == 0) != (sp[2] + 0 == 0))
        fail(key ": held back for " f[i] " " f[i + 1] ": not stops/passes with stops <= passes")
      if (f[i] != "provider" && f[i] != "bound") waits += sp[1]
    }
    if (f[i] == "p50") p50 = f[i + 1]
    if (f[i] == "max") dmax = f[i + 1]
  }
  if (!(p50 + 0 <= dmax + 0 && dmax + 0 >= 1)) fail(key ": depth at post p50 " p50 " max " dmax)
  depth[key] = dmax
}
END {
  for (key in puts) {
    if (puts[key] + 0 == 0) continue
    npeers++
    if (!(key in times)) fail(key ": " puts[key] " puts but no times line")
    if (!(key in held)) fail(key ": " puts[key] " puts but no held-back line")
    else if (depth[key] + 0 != inflight[key] + 0)
      fail(key ": depth at post max " depth[key] " but max in flight " inflight[key])
    if ((key in swrites) && swrites[key] > 0 && swrites[key] < schunks[key]) packed++
  }
  if (!npeers) fail("no peer with puts: is PERSEUS_STATS read?")
  if (atomics != "" && !sigs) fail("--atomics " atomics ": no signals counted")
  if (!ncomms) fail("no progress calls line")
  if (ncalls != ncomms) fail(ncomms " progress calls lines but " ncalls " calls lines")
  if (!datacalls) fail("no comm timed a data call")
  if (want_threaded && nthreaded != ncomms) fail(ncomms - nthreaded " comms ran without an engine thread")
  if (throttled && !fewer) fail("throttled, but no comm made twice as many progress calls as passes")
  if (staged && !copies) fail("staged, but no copy out of the GPU was timed")
  if (staged && !waits) fail("staged, but nothing was held back for a send slot, a copy or a credit")
  if (staged && !packed) fail("staged, but no peer had its chunks packed into fewer staged writes")
  if (!bad) print "check_opstats.sh: stats lines of " npeers " peers consistent" >"/dev/stderr"
  exit bad
}' "$log"
