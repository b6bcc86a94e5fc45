#!/bin/sh
# Every PERSEUS_* variable the sources read (a quoted name or a shell
# expansion in plugin/, harness/, bench/, test/, decode/, moe/ or scripts/)
# has a row in docs/configuration.md, written `NAME`. $1 is the source root.
# Exit 0 all documented, 1 with the missing names listed.
root=${1:?usage: check_env_docs.sh SOURCE_ROOT}
doc=$root/docs/configuration.md
[ -r "$doc" ] || { echo "check_env_docs: $doc not readable" >&2; exit 1; }
names=$(cd "$root" && grep -rhoE '"PERSEUS_[A-Z0-9_]+"|\$\{?PERSEUS_[A-Z0-9_]+' \
          plugin harness bench test decode moe scripts | sed 's/[^A-Z0-9_]//g' | sort -u)
[ -n "$names" ] || { echo "check_env_docs: no PERSEUS_ variable found under $root" >&2; exit 1; }
missing=0
for v in $names; do
  if ! grep -q "\`$v\`" "$doc"; then
    echo "check_env_docs: $v is read by the sources but has no row in docs/configuration.md"
    missing=$((missing + 1))
  fi
done
echo "check_env_docs: $(echo "$names" | wc -l) variables, $missing undocumented"
[ "$missing" -eq 0 ]
