# shellcheck shell=bash
# Argument and variable checks every script shares (sourced, not run): a
# bad value stops the script before it runs anything, naming the variable.

# script_args NAME MAX "$@": -h/--help prints the script's header comment
# and exits 0; an argument that starts with '-' (an option none of these
# scripts takes) or more than MAX arguments is an error.
script_args() {
  local name=$1 max=$2 a
  shift 2
  for a in "$@"; do
    case $a in
      -h | --help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
      -*) echo "$name: unknown option '$a' (-h for help)" >&2; exit 1 ;;
    esac
  done
  if [ "$#" -gt "$max" ]; then
    echo "$name: at most $max argument(s), got $#: $* (-h for help)" >&2
    exit 1
  fi
}

# need_list SCRIPT VAR VALUE: a list variable must name something.
need_list() {
  if [ -z "${3//[[:space:]]/}" ]; then
    echo "$1: $2='$3': expected a space-separated list of at least one value" >&2
    exit 1
  fi
}

# need_uint SCRIPT VAR VALUE [MIN [MAX]]: a whole number in [MIN, MAX]
# (default 1 and no bound); 0 is taken only where MIN is 0.
need_uint() {
  local min=${4:-1} max=${5:-}
  if ! [[ $3 =~ ^[0-9]+$ ]] || [ ${#3} -gt 9 ] || [ "$3" -lt "$min" ] ||
     { [ -n "$max" ] && [ "$3" -gt "$max" ]; }; then
    echo "$1: $2='$3': expected a whole number from $min${max:+ to $max}" >&2
    exit 1
  fi
}

# need_num SCRIPT VAR VALUE MIN MAX: a plain decimal number (digits, at most
# one point) in [MIN, MAX].
need_num() {
  if ! [[ $3 =~ ^[0-9]+(\.[0-9]*)?$|^\.[0-9]+$ ]] || [ ${#3} -gt 16 ] ||
     ! awk -v v="$3" -v lo="$4" -v hi="$5" 'BEGIN { exit !(v + 0 >= lo + 0 && v + 0 <= hi + 0) }'; then
    echo "$1: $2='$3': expected a number from $4 to $5" >&2
    exit 1
  fi
}
