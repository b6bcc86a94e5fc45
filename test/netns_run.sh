#!/bin/sh
# Runs a test program with each of its forked ranks on a "host" of its own:
# a network namespace per rank, joined by veth pairs to a bridge that lives
# in a switch namespace of its own, so that the machine's interfaces,
# addresses and routes are never touched. The harness moves rank i into
# namespace ${PERSEUS_TEST_NETNS}i (harness/proc.c).
#
#   test/netns_run.sh HOSTS LAYOUT COMMAND [ARGS...]
#
# LAYOUT, what each host gets:
#   ipv4         eth0 10.88.0.(i+1)/24; host 0 also eth1 10.89.0.1/24, an
#                interface on a bridge with nobody else (no peer reaches it)
#   ipv6         eth0 fd88::(i+1)/64 only (no IPv4 address), host 0's eth1
#                fd89::1/64 likewise
#   unreachable  as ipv4, but host 0 has only eth1: the address its handles
#                carry is one no peer can reach
# Every host has lo up. NETNS_EXPECT (optional): COMMAND must fail, and its
# output must match this extended regular expression (a clear error, not
# a hang: the test's own timeout bounds it). NETNS_CUT=HOST:AT[:FOR]
# (optional): host HOST's eth0 link goes down AT seconds after COMMAND
# starts, and comes back FOR seconds later (never, without FOR).
# Exit: COMMAND's status (or 0/1 for NETNS_EXPECT), 77 when namespaces cannot
# be made here (not root, no iproute2, no veth or bridge support).
set -u
if [ $# -lt 3 ]; then
  echo "usage: $0 HOSTS ipv4|ipv6|unreachable COMMAND [ARGS...]" >&2
  exit 2
fi
hosts=$1 layout=$2
shift 2
case $layout in ipv4 | ipv6 | unreachable) ;; *)
  echo "netns_run.sh: layout '$layout' is not ipv4, ipv6 or unreachable" >&2
  exit 2
  ;;
esac
case $hosts in '' | *[!0-9]*)
  echo "netns_run.sh: HOSTS '$hosts' is not a number" >&2
  exit 2
  ;;
esac

skip() {
  echo "SKIP: network namespaces cannot be made here ($1)"
  exit 77
}
[ "$(id -u)" = 0 ] || skip "not root"
command -v ip >/dev/null 2>&1 || skip "no ip command (iproute2)"

pfx="ps$$-"
sw="${pfx}sw"
made="" cut_pid=""
# shellcheck disable=SC2317 # run by the trap
cleanup() {
  [ -n "$cut_pid" ] && kill "$cut_pid" 2>/dev/null
  for n in $made; do ip netns del "$n" 2>/dev/null; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mk() { # a namespace, remembered for cleanup
  ip netns add "$1" || return 1
  made="$made $1"
  ip -n "$1" link set lo up
}

mk "$sw" 2>/dev/null || skip "ip netns add failed"
if ! ip -n "$sw" link add br0 type bridge 2>/dev/null; then skip "no bridge support"; fi
ip -n "$sw" link set br0 up || exit 1
ip -n "$sw" link add br1 type bridge && ip -n "$sw" link set br1 up || exit 1

# host i's interface `dev` on bridge `br`: the veth's other end sits in the
# switch namespace, never in the machine's own
plug() { # ns dev br addr
  ip -n "$1" link add "$2" type veth peer name "$1-$2" netns "$sw" || return 1
  case $4 in *:*) dad=nodad ;; *) dad="" ;; esac # IPv6: usable at once
  # shellcheck disable=SC2086 # dad is one word or none
  ip -n "$sw" link set "$1-$2" master "$3" up &&
    ip -n "$1" addr add "$4" dev "$2" $dad &&
    ip -n "$1" link set "$2" up
}

i=0
while [ "$i" -lt "$hosts" ]; do
  ns="$pfx$i"
  mk "$ns" || exit 1
  case $layout in
    ipv4) a0="10.88.0.$((i + 1))/24" a1="10.89.0.1/24" ;;
    ipv6) a0="fd88::$((i + 1))/64" a1="fd89::1/64" ;;
    unreachable) a0="10.88.0.$((i + 1))/24" a1="10.89.0.1/24" ;;
  esac
  if [ "$layout" != unreachable ] || [ "$i" -ne 0 ]; then
    plug "$ns" eth0 br0 "$a0" || { echo "netns_run.sh: cannot plug $ns eth0" >&2; exit 1; }
  fi
  if [ "$i" -eq 0 ]; then
    plug "$ns" eth1 br1 "$a1" || { echo "netns_run.sh: cannot plug $ns eth1" >&2; exit 1; }
  fi
  i=$((i + 1))
done

echo "# netns_run: $hosts hosts ($layout), namespaces ${pfx}0..${pfx}$((hosts - 1))"
export PERSEUS_TEST_NETNS="$pfx"
if [ -n "${NETNS_CUT:-}" ]; then # the cut, from the switch's side of the veth
  IFS=: read -r cut_host cut_at cut_for <<EOF_CUT
$NETNS_CUT
EOF_CUT
  port="$pfx$cut_host-eth0"
  (
    sleep "$cut_at"
    ip -n "$sw" link set "$port" down && echo "# netns_run: link of host $cut_host cut"
    if [ -n "$cut_for" ]; then
      sleep "$cut_for"
      ip -n "$sw" link set "$port" up && echo "# netns_run: link of host $cut_host back"
    fi
  ) &
  cut_pid=$!
fi
if [ -z "${NETNS_EXPECT:-}" ]; then
  "$@"
  exit $?
fi
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ "$rc" -eq 0 ]; then
  echo "netns_run.sh: '$*' succeeded; expected it to fail with /$NETNS_EXPECT/"
  exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq -- "$NETNS_EXPECT"; then
  echo "netns_run.sh: '$*' failed (status $rc) without saying /$NETNS_EXPECT/"
  exit 1
fi
echo "netns_run.sh: failed as expected (status $rc)"
exit 0
