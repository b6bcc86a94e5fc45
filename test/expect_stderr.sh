#!/bin/sh
# expect_stderr.sh [--fails] PATTERN COMMAND [ARGS...]: runs COMMAND (its
# stderr also passed through) and passes when its stderr has a line matching
# PATTERN (grep -E) and it exits 0, or, with --fails, exits non-zero: a fault
# model that must fire, or a check that must catch a planted bug for the
# reason it names (not just any failure). --exit N: fails, with status N
# exactly (2: a refused option).
want_fail=0
want_rc=
if [ "$1" = --fails ]; then want_fail=1; shift; fi
if [ "$1" = --exit ]; then want_fail=1; want_rc=$2; shift 2; fi
pattern=$1
shift
log=$(mktemp) || exit 1
trap 'rm -f "$log"' EXIT
"$@" 2>"$log"
rc=$?
cat "$log" >&2
if [ "$want_fail" -eq 0 ] && [ "$rc" -ne 0 ]; then
  echo "expect_stderr.sh: $1 exited with $rc" >&2
  exit 1
fi
if [ "$want_fail" -eq 1 ] && [ "$rc" -eq 0 ]; then
  echo "expect_stderr.sh: $1 passed, but it must fail ('$pattern')" >&2
  exit 1
fi
if [ -n "$want_rc" ] && [ "$rc" -ne "$want_rc" ]; then
  echo "expect_stderr.sh: $1 exited with $rc, expected $want_rc" >&2
  exit 1
fi
if ! grep -Eq -- "$pattern" "$log"; then
  echo "expect_stderr.sh: no line of stderr matches '$pattern'" >&2
  exit 1
fi
exit 0
