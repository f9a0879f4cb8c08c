#!/usr/bin/env bash
# docs/benchmarks.md stays a reference (issue 46): at most 250 lines; every
# link into docs/benchmarks_journal.md names an anchor the journal has; every
# row of a figures table names where it comes from (a journal session, or the
# issue that reported it); and every dated section of the journal has an anchor.
# Usage: benchmarks_doc.sh [CHORUS_BINARY] (unused).
set -uo pipefail
cd "$(dirname "$0")/../.."
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
ref=docs/benchmarks.md journal=docs/benchmarks_journal.md
n=$(wc -l < "$ref")
check "$ref is $n lines (at most 250)" "[ $n -le 250 ]"
missing=""
for a in $(grep -oE 'benchmarks_journal\.md#[a-z0-9-]+' "$ref" | cut -d'#' -f2 | sort -u); do
  grep -q "<a id=\"$a\"></a>" "$journal" || missing+=" $a"
done
check "every journal link of $ref has its anchor${missing:+ (missing:$missing)}" "[ -z '$missing' ]"
# Table rows with a machine column (H100/H200/developers' machine) name their source.
bad=$(grep -E '^\| ' "$ref" | grep -E 'H100|H200|developers' | grep -vE 'benchmarks_journal\.md#|issue 46' | head -3)
check "every figures row names its journal session or issue${bad:+: $bad}" "[ -z \"\$bad\" ]"
sections=$(grep -c '^## 2026-' "$journal"); anchors=$(grep -c '^<a id="' "$journal")
check "every dated journal section has an anchor ($sections sections, $anchors anchors)" "[ $sections = $anchors ] && [ $sections -gt 30 ]"
exit $fail
