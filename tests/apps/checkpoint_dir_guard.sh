#!/usr/bin/env bash
# Issue 47, items 12 and 13: a checkpoint directory in use by one job is
# refused to a second, naming the first (host, pid); and a file size limit
# (ulimit -f) makes a checkpoint save an IOError naming the file, not death by
# SIGXFSZ (exit 153), with the checkpoint before it intact.
set -uo pipefail
CHORUS=$(readlink -f "$1")
tmp=$(mktemp -d)
trap 'kill "${job:-}" 2>/dev/null; rm -rf "$tmp"' EXIT
fail=0
check() {  # check "description" command...
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}
syn=(--model mlp --data synthetic --synthetic-size 256 --batch-size 32 --devices cpu --workers 0 --seed 3 --quiet)
sums() { (cd "$1" && sha256sum ckpt-*/* latest); }

# --- 13: ulimit -f -------------------------------------------------------------
ck=(train "${syn[@]}" --checkpoint-dir "$tmp/ck")
timeout 300 "$CHORUS" "${ck[@]}" --steps 4 > /dev/null
before=$(sums "$tmp/ck")
err=$( (ulimit -f 64; exec timeout 300 "$CHORUS" "${ck[@]}" --steps 8 --resume --allow-change steps) 2>&1 >/dev/null); rc=$?
check "past ulimit -f: exit 1, not SIGXFSZ's 153 (exit $rc): $err" test "$rc" = 1
check "one line naming the file and the limit" \
  bash -c '[ "$(grep -c . <<<"$1")" = 1 ] && grep -q "cannot save checkpoint .*/ckpt-00000008: .*model.safetensors: write failed at byte [0-9]*: File too large (the file size limit, ulimit -f, is 65536 bytes)" <<<"$1"' _ "$err"
check "the checkpoint before is intact" test "$(sums "$tmp/ck")" = "$before"
check "no half-written save is left" test -z "$(ls -A "$tmp/ck" | grep -v -e '^ckpt-00000004$' -e '^latest$' -e '^lock$')"
err=$(timeout 300 "$CHORUS" "${ck[@]}" --steps 8 --resume --allow-change steps 2>&1 >/dev/null); rc=$?
check "without the limit the run resumes from it and ends (exit $rc)" test "$rc" = 0 -a -f "$tmp/ck/ckpt-00000008/state.json"

# --- 12: two jobs, one checkpoint directory ------------------------------------
"$CHORUS" train "${syn[@]}" --epochs 1000000 --checkpoint-dir "$tmp/lk" > /dev/null 2>&1 &
job=$!
for _ in $(seq 600); do grep -qs "pid $job\$" "$tmp/lk/lock" && break; sleep 0.1; done
check "the first job holds the directory: $(cat "$tmp/lk/lock" 2>/dev/null)" grep -q "^host $(uname -n), pid $job\$" "$tmp/lk/lock"
err=$(timeout 120 "$CHORUS" train "${syn[@]}" --steps 2 --checkpoint-dir "$tmp/lk" 2>&1 >/dev/null); rc=$?
check "a second job on it is refused at once, naming the first (exit $rc): $err" \
  bash -c '[ "$2" = 1 ] && [ "$(grep -c . <<<"$1")" = 1 ] && grep -qF "$3: the checkpoint directory is in use by another job (host $4, pid $5)" <<<"$1"' \
  _ "$err" "$rc" "$tmp/lk" "$(uname -n)" "$job"
check "the first job is still training" kill -0 "$job"
kill -TERM "$job"; wait "$job"; rc=$?
check "the first job stops on SIGTERM (exit $rc)" test "$rc" = 143
job=
check "its lock went with it" python3 -c 'import fcntl, sys; f = open(sys.argv[1], "a"); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)' "$tmp/lk/lock"
exit $fail
