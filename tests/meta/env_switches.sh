#!/usr/bin/env bash
# Note [Environment switches] (src/chorus/core/env_switches.h), checked on the
# tree: no CHORUS_* variable is read with getenv outside the table's file;
# every name the library asks env::get or PathSwitch for is in the table; every
# name in the table is documented (README.md or docs/, not the journal).
# Usage: env_switches.sh [CHORUS_BINARY] (unused).
set -uo pipefail
cd "$(dirname "$0")/../.."
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
table=src/chorus/core/env_switches.cpp
names=$(grep -oE '^ *\{"CHORUS_[A-Z0-9_]+"' "$table" | grep -oE 'CHORUS_[A-Z0-9_]+' | sort)
check "the table has its switches ($(echo "$names" | wc -l))" "[ \$(echo \"$names\" | wc -l) -ge 20 ]"
raw=$(grep -rnE '^[^/]*getenv\("CHORUS_' src apps | grep -v "^$table:" | head -3)
check "no getenv(\"CHORUS_...\") outside $table${raw:+: $raw}" "[ -z \"\$raw\" ]"
asked=$(grep -rhoE '(env::get|PathSwitch)\("CHORUS_[A-Z0-9_]+"' src apps | grep -oE 'CHORUS_[A-Z0-9_]+' | sort -u)
missing=""
for n in $asked; do echo "$names" | grep -qx "$n" || missing+=" $n"; done
check "every name read is in the table${missing:+ (not in it:$missing)}" "[ -z '$missing' ]"
undocumented=""
for n in $names; do
  [ "$n" = CHORUS_BENCH_ROW ] && continue  # internal: chorus bench sets it for its own workers
  grep -q "$n" README.md docs/[!b]*.md docs/benchmarks.md 2>/dev/null || undocumented+=" $n"
done
check "every switch is documented${undocumented:+ (not:$undocumented)}" "[ -z '$undocumented' ]"
exit $fail
