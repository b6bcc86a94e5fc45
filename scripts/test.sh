#!/bin/sh
# README command 2: build perseus and run every CPU test:
#   - the test suites (unit, ABI harness on every version and provider, faults)
#   - hostile-input scenarios under valgrind
#   - the same core suites again under AddressSanitizer + UBSan
#   - a compile of the whole tree with clang (-Werror)
#   - the Debian packages, built and checked (scripts/check-package.sh)
# Ends with "N passed, N failed, N skipped". GPU tests skip (77) without a GPU.
set -u
cd "$(dirname "$0")/.." || exit 1
case "${1-}" in
  -h | --help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  "") ;;
  *) echo "test.sh: takes no arguments, got '$*' (-h for help)" >&2; exit 1 ;;
esac
case "${PERSEUS_TEST_JOBS:-1}" in
  *[!0-9]* | 0*) echo "test.sh: PERSEUS_TEST_JOBS='$PERSEUS_TEST_JOBS': expected a whole number from 1" >&2; exit 1 ;;
esac
PERSEUS_WITH_CLANG=1 PERSEUS_WITH_VALGRIND=1 scripts/install-deps.sh || { echo "dependency install failed"; echo "0 passed, 1 failed"; exit 1; }
JOBS="${PERSEUS_TEST_JOBS:-$(nproc)}"
passed=0 failed=0 skipped=0
LOGDIR="$(mktemp -d)"

# meson test prints "Ok: N", "Fail: N", ... at the end; add them up.
tally() {
  ok=$(awk '/^Ok:/{print $2}' "$1"); fl=$(awk '/^Fail:/{print $2}' "$1")
  sk=$(awk '/^Skipped:/{print $2}' "$1"); to=$(awk '/^Timeout:/{print $2}' "$1")
  up=$(awk '/^Unexpected Pass:/{print $3}' "$1"); xf=$(awk '/^Expected Fail:/{print $3}' "$1")
  # an expected failure is a passing test (a check shown to catch a planted bug)
  passed=$((passed + ${ok:-0} + ${xf:-0})); skipped=$((skipped + ${sk:-0}))
  failed=$((failed + ${fl:-0} + ${to:-0} + ${up:-0}))
}

step() { # name, command...: a build step counts as one test
  name="$1"; shift
  if "$@" >"$LOGDIR/$name.log" 2>&1; then passed=$((passed + 1)); echo "ok   $name"
  else failed=$((failed + 1)); echo "FAIL $name"; tail -40 "$LOGDIR/$name.log"; fi
}

suite() { # builddir, log name, meson test args...
  dir="$1"; log="$2"; shift 2
  meson test -C "$dir" --num-processes "$JOBS" --logbase "$log" "$@" >"$LOGDIR/$log.log" 2>&1
  grep -E '^ *[0-9]+/[0-9]+ ' "$LOGDIR/$log.log" | sed 's/^ *//' | awk '!seen[$0]++'
  grep -q '^Ok:' "$LOGDIR/$log.log" || { tail -40 "$LOGDIR/$log.log"; failed=$((failed + 1)); }
  # each failed test's name, result and the tail of what it printed, kept for
  # the end of the output, where a CI excerpt shows it
  # (meson names the log <logbase>-<wrapper> under --wrapper: the newest match)
  json=$(ls -t "$dir/meson-logs/$log"*.json 2>/dev/null | head -n 1) # names are ours: no odd characters
  if [ -n "$json" ]; then python3 - "$json" "$log" >>"$LOGDIR/failures.txt" <<'PY' || true
import json, sys
for line in open(sys.argv[1]):
    t = json.loads(line)
    if t["result"] in ("OK", "SKIP", "EXPECTEDFAIL"):
        continue
    print("---- %s [%s] %s, %.1f s, rc %s" % (t["name"], sys.argv[2], t["result"], t["duration"], t["returncode"]))
    for part in ("stdout", "stderr"):
        lines = (t.get(part) or "").splitlines()
        if lines:
            print("  %s (last %d of %d lines):" % (part, min(30, len(lines)), len(lines)))
            for l in lines[-30:]:
                print("  | " + l[:300])
PY
  fi
  tally "$LOGDIR/$log.log"
}

step build-gcc sh -c '{ [ -f build/build.ninja ] || meson setup build; } && ninja -C build'
if [ -f build/build.ninja ]; then
  suite build main
fi

# Every hostile-input scenario once under valgrind as well (what ASan's
# redzones and quarantine can miss, uninitialised reads), each on one table
# version (the versions share the code under test); abandon's 2,000
# endpoints are left to ASan, and the connection scenarios run on tcp and
# shm only: over sockets, whose progress thread valgrind slows most, a valid
# connect missed the scenarios' 1.5 s PERSEUS_PEER_TIMEOUT_MS. One at a
# time, for the same reason. perseus' engine thread off (test/valgrind.supp
# says why).
if [ -f build/build.ninja ] && command -v valgrind >/dev/null 2>&1; then
  PERSEUS_PROGRESS_THREAD=0 suite build valgrind --num-processes 1 --timeout-multiplier 6 \
    --wrapper "valgrind -q --error-exitcode=99 --leak-check=no --suppressions=$PWD/test/valgrind.supp" \
    hostile-net-v12-tcp hostile-net-stale-req-v12-tcp hostile-net-double-close-v8-tcp \
    hostile-net-stale-mh-v11-tcp hostile-net-reconnect-v10-tcp hostile-net-double-dereg-v9-tcp \
    hostile-net-finalize-v11-tcp hostile-net-wrong-id-v12-tcp hostile-net-wrong-id-v12-shm \
    hostile-net-half-open-tcp-v12 \
    hostile-net-shm-stale-v12-shm hostile-net-shm-addr-v10-shm hostile-net-shm-dead-peer-v12-shm \
    hostile-rma-stale-window-rma14-tcp hostile-rma-double-close-gin11-tcp hostile-rma-bounds-gin13-tcp \
    hostile-rma-put-dereg-rma13-tcp hostile-rma-stale-req-gin12-tcp \
    hostile-rma-signal-misaligned-rma14-tcp hostile-rma-signal-dereg-gin13-tcp \
    hostile-rma-double-dereg-rma13-tcp
fi

step build-asan sh -c '{ [ -f build-asan/build.ninja ] || meson setup build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled; } && ninja -C build-asan'
if [ -f build-asan/build.ninja ]; then
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
    suite build-asan asan --suite unit --suite fault --suite quick
fi

step build-clang sh -c '{ [ -f build-clang/build.ninja ] || CC=clang meson setup build-clang -Dcuda=disabled; } && ninja -C build-clang'

# Packaging: build the .debs, unpack them into a scratch root, check where every
# file is, the exported symbols, and the installed plugin and benchmark at work.
step package scripts/check-package.sh

if [ -s "$LOGDIR/failures.txt" ]; then echo "== what the failed tests printed"; cat "$LOGDIR/failures.txt"; fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
