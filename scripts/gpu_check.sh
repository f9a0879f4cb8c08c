#!/usr/bin/env bash
# On a GPU machine: build Chorus, run its CUDA tests and measure it beside
# PyTorch, stage by stage, then print a short table of the rows.
#
# Usage: scripts/gpu_check.sh [STAGE...]    (default: build tests bench)
#        scripts/gpu_check.sh --list        every stage and what it does
#
# The stages live in scripts/gpu/stages/*.sh, one file per group: a stage is a
# function stage_NAME with a "# NAME: what it does" line above it, and this
# script knows no stage but those. Named stages run in the order --list shows
# (the files in name order, build first), whatever order they are given in.
# Stage settings are environment variables, documented in each stage. Every
# command runs under `timeout`, so a hang shows up as a failed row instead of
# eating the machine's time. Logs and JSON rows go to $OUT (or ./gpu-out).
# PyTorch's reference scripts are read from .bench/ (a copy of ../shared/bench,
# carried by the device tool).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE_DIR=scripts/gpu/stages

# "name<TAB>file<TAB>what it does" for every stage, in run order.
list_stages() {
  local f
  for f in "$STAGE_DIR"/*.sh; do
    awk -v file="${f##*/}" '
      /^# [a-z0-9]+: / { what = substr($0, 3); name = what; sub(/:.*/, "", name); sub(/^[a-z0-9]+: /, "", what); next }
      /^stage_[a-z0-9]+\(\) \{/ { n = substr($0, 7); sub(/\(\).*/, "", n); print n "\t" file "\t" (n == name ? what : ""); name = "" }
    ' "$f"
  done
}

if [ "${1:-}" = --list ]; then
  list_stages | awk -F'\t' '{ printf "%-12s %-20s %s\n", $1, $2, $3 }'
  exit 0
fi
STAGES=${*:-build tests bench}
known=" $(list_stages | cut -f1 | tr '\n' ' ')"
for s in $STAGES; do
  [[ $known == *" $s "* ]] || { echo "gpu_check.sh: no stage '$s' (scripts/gpu_check.sh --list names them)" >&2; exit 2; }
done

OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
BUILD=build-gpu
C=./$BUILD/chorus
rows="$OUT/rows.jsonl"  # the rows the summary pairs up (bench, dp, ddp, multi)
: > "$rows"
for f in "$STAGE_DIR"/*.sh; do source "$f"; done

nvidia-smi -L
[[ " $STAGES " == *" build "* ]] && stage_build
$C --version; $C devices
for s in $known; do
  [ "$s" = build ] && continue
  [[ " $STAGES " == *" $s "* ]] && "stage_$s"
done
echo "== summary (img/s; ratio = Chorus / PyTorch, same machine, same run)"
python3 scripts/gpu/summary.py "$rows"
