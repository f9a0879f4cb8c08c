#!/usr/bin/env bash
# A rank of a device-mesh GPT job (chorus train --mesh, apps/train_gpt_mesh.cpp)
# killed with SIGKILL mid-training, under chorus launch with a long
# --grace-period so that the survivors must end by themselves:
#   - pp=2, the last stage killed mid-step (no checkpoints): the first
#     stage's send/recv (or the step's collective) fails;
#   - tp=2, rank 0 killed (it writes the checkpoints, one every step, so it
#     is most often killed writing or gathering one): its tensor peer's
#     collective fails;
#   - dp=2,tp=2, rank 3 killed: its tensor peer (rank 2) and its data peer
#     (rank 1) wait for it; rank 0 waits for them (Note [Failures that
#     cascade] in src/chorus/distributed/process_group.h), and the subgroups' members
#     are named by their job ranks (Note [Ranks named in the job's numbering]).
# Every survivor must exit with one line naming the killed rank (its job rank)
# within a bound of the kill, the launcher non-zero, no process left; every
# checkpoint that looks complete (ckpt-*) must be whole: each safetensors file
# as long as its header says, and the latest one resumed by a plain run.
set -uo pipefail
CHORUS=${1:?chorus}
HERE=$(cd "$(dirname "$0")" && pwd)
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$HERE/../testing/free_port.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
TIMEOUT_S=3  # --dist-timeout: a roll call waits min(it, 5 s) for late ranks
# From the kill to the launcher's exit: the victim's peers fail (at once on a
# closed connection, at worst at the timeout) and hold their roll call; the
# ranks that wait for those peers do the same after them; then start-up slack.
LIMIT_S=$((4 * TIMEOUT_S + 10))
python3 -c "
import random; random.seed(5); w='the quick brown fox jumps over a lazy dog and runs far away'.split()
print('\n'.join(' '.join(random.choice(w) for _ in range(12)) for _ in range(2000)))" > "$tmp/t.txt"
G=(--model d2 --data "text:$tmp/t.txt" --seq-len 16 --batch-size 4)
fail=0
bad() { echo "FAIL: $*"; fail=1; }

killed_run() {  # NAME NPROC MESH VICTIM CHECKPOINT_EVERY (0: none) [TRAIN ARGS...]
  local name=$1 n=$2 mesh=$3 victim=$4 every=$5; shift 5
  local marker="mesh-dead-rank-$$-$name" ck="$tmp/$name-ck" err="$tmp/$name.err"
  local saving=(); [ "$every" -gt 0 ] && saving=(--checkpoint-dir "$ck" --checkpoint-every "$every")
  CHORUS_TEST_MARKER=$marker timeout 90 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" \
    --grace-period 60 -- "$CHORUS" train "${G[@]}" --mesh "$mesh" --steps 100000 --log-every 1 \
    --dist-timeout "$TIMEOUT_S" "${saving[@]}" "$@" > /dev/null 2> "$err" &
  local job=$! pid=""
  # The victim: its own chorus process (the first with the marker and its
  # RANK; a child it starts for a moment inherits both), once training runs.
  for _ in $(seq 300); do
    pid=""
    for f in $(grep -l "CHORUS_TEST_MARKER=$marker" /proc/[0-9]*/environ 2>/dev/null); do
      local p; p=$(cut -d/ -f3 <<<"$f")
      [ "$(cat /proc/$p/comm 2>/dev/null)" = chorus ] || continue
      tr '\0' '\n' < "$f" 2>/dev/null | grep -qx "RANK=$victim" || continue
      { [ -z "$pid" ] || [ "$p" -lt "$pid" ]; } && pid=$p
    done
    [ -n "$pid" ] && grep -q "step 4/" "$err" && break
    kill -0 $job 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$pid" ] && grep -q "step 4/" "$err" || { bad "$name: the job did not train"; cat "$err"; kill $job; wait $job; return; }
  kill -9 "$pid"
  local t0; t0=$(date +%s.%N)
  wait $job; local rc=$?
  local took; took=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
  local left
  left=$(grep -l "CHORUS_TEST_MARKER=$marker" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
  [ -n "$left" ] && { bad "$name: processes left: $left"; kill -9 $left 2>/dev/null; }
  grep -E "chorus: error|did not arrive|was killed|job is stopped" "$err" | head -8
  { [ $rc -ne 0 ] && [ $rc -ne 124 ]; } || bad "$name: the launcher exited $rc"
  grep -q "chorus launch: rank $victim (pid $pid) was killed by signal 9" "$err" || bad "$name: the launcher did not name rank $victim"
  for ((s = 0; s < n; s++)); do
    [ $s = "$victim" ] && continue
    # One line, the survivor's own error, naming the victim by its job rank.
    grep -Eq "^\[rank $s\] chorus: error: .* failed on rank $s \(timeout $TIMEOUT_S s[^)]*\): rank $victim did not arrive \(dead" "$err" ||
      bad "$name: rank $s did not end naming rank $victim"
    [ "$(grep -c "^\[rank $s\] chorus: error:" "$err")" = 1 ] || bad "$name: rank $s did not say one error line"
  done
  grep -q "had been stopped by a signal\|did not stop within" "$err" && bad "$name: the launcher had to stop a survivor"
  python3 -c "import sys; sys.exit(0 if $took <= $LIMIT_S else 1)" || bad "$name: the survivors took $took s (limit $LIMIT_S s)"
  echo "$name: rank $victim killed, the job ended in $took s (limit $LIMIT_S s)"
  [ $fail = 0 ] || { cat "$err" | tail -30; return; }
  local dp=1; [[ $mesh =~ dp=([0-9]+) ]] && dp=${BASH_REMATCH[1]}
  [ "$every" -gt 0 ] && check_checkpoints "$name" "$ck" "$dp"
}

check_checkpoints() {  # NAME DIR DP: whole checkpoints, the latest resumed without --mesh
  local name=$1 ck=$2 dp=$3
  python3 - "$ck" <<'PY' || { bad "$1: a checkpoint that looks complete is not whole"; return; }
import json, os, struct, sys
d = sys.argv[1]
names = sorted(n for n in os.listdir(d) if n.startswith("ckpt-"))
assert names, f"no checkpoint in {os.listdir(d)}"
for n in names:
    p = os.path.join(d, n)
    for f in ("model.safetensors", "optimizer.safetensors", "state.json"):
        assert os.path.isfile(os.path.join(p, f)), f"{n}: no {f}"
    json.load(open(os.path.join(p, "state.json")))
    for f in ("model.safetensors", "optimizer.safetensors"):
        with open(os.path.join(p, f), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            k = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(k))
            end = max((v["data_offsets"][1] for key, v in h.items() if key != "__metadata__"), default=0)
            assert size == 8 + k + end, f"{n}/{f}: {size} bytes, its header says {8 + k + end}"
print(f"checkpoints: {len(names)} whole ({', '.join(names)}); debris set aside: "
      f"{len([n for n in os.listdir(d) if n.startswith('.tmp-')])}")
PY
  # One process reads the tokens of dp ranks' steps in dp times as many
  # (Note [Progress in samples] in apps/run_position.h).
  local last; last=$(ls "$ck" | grep '^ckpt-' | sort | tail -1 | sed 's/ckpt-0*//')
  local at=$((last * dp))
  timeout 60 "$CHORUS" train "${G[@]}" --devices cpu --checkpoint-dir "$ck" --resume --steps $((at + 1)) \
    > /dev/null 2> "$tmp/resume.err" || { bad "$name: the latest checkpoint (step $last) did not resume"; cat "$tmp/resume.err"; return; }
  grep -q "resumed from .*ckpt-0*$last at step $at\$" "$tmp/resume.err" ||
    { bad "$name: the resume did not start at step $at"; cat "$tmp/resume.err"; }
}

# The kill comes once step 4 is logged and the victim found, steps later: a
# d2 step is short beside a checkpoint's writing, so a run that saves is
# mostly killed while saving, and pp=2 saves nothing (killed mid-step, in
# its pipeline's sends and receives or the step's collectives).
killed_run pp2 2 pp=2 1 0 --micro-batches 2
killed_run tp2 2 tp=2 0 1
killed_run dp2tp2 4 dp=2,tp=2 3 2
[ $fail = 0 ] && echo "ok: killed mesh ranks named by every survivor, no checkpoint half-written"
exit $fail
