#!/bin/sh
# expect_stderr.sh PATTERN COMMAND [ARGS...]: runs COMMAND (its stderr also
# passed through) and passes when it exits 0 and its stderr has a line
# matching PATTERN (grep -E): a test of a fault model that must fire.
pattern=$1
shift
log=$(mktemp) || exit 1
trap 'rm -f "$log"' EXIT
"$@" 2>"$log"
rc=$?
cat "$log" >&2
if [ "$rc" -ne 0 ]; then
  echo "expect_stderr.sh: $1 exited with $rc" >&2
  exit 1
fi
if ! grep -Eq -- "$pattern" "$log"; then
  echo "expect_stderr.sh: no line of stderr matches '$pattern': the fault never fired" >&2
  exit 1
fi
exit 0
