#!/usr/bin/env bash
# Issue 15, as a hostile user: every case is a clear error (one line, exit 1
# or 2, no crash), or it works (metrics CSV, resume past a damaged
# checkpoint, stopping on a signal with a checkpoint).
set -uo pipefail
CHORUS=$(readlink -f "$1")
tmp=$(mktemp -d)
chmod 755 "$tmp"
trap 'chmod -R u+rwx "$tmp"; rm -rf "$tmp"' EXIT
fail=0
expect_error() {  # expect_error "what the message must contain" args...
  local want=$1; shift
  local err rc
  err=$(timeout 120 "$CHORUS" "$@" 2>&1 >/dev/null); rc=$?
  if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then
    echo "FAIL (exit $rc): chorus $*"; echo "  stderr: $err"; fail=1; return
  fi
  if ! grep -qF -- "$want" <<<"$err"; then
    echo "FAIL (message lacks '$want'): chorus $*"; echo "  stderr: $err"; fail=1; return
  fi
  if [ "$(grep -c . <<<"$err")" -ne 1 ]; then
    echo "FAIL (not one line): chorus $*"; echo "$err"; fail=1; return
  fi
  echo "ok: chorus $* -> $err"
}
check() {  # check "description" command...
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}
syn=(--model mlp --data synthetic --synthetic-size 256 --batch-size 32 --devices cpu --workers 0 --seed 3)

# --- integers and numbers: overflow, wrap, clamp, octal, empty --------------
expect_error "--epochs: '9223372036854775807' is not a whole number up to 1000000" train --epochs 9223372036854775807 "${syn[@]}"
expect_error "--batch-size: '9223372036854775807' is not a whole number up to 16777216" train --batch-size 9223372036854775807 --quiet
expect_error "--seed: '-5' is not a whole number from 0 to 18446744073709551615" train --seed -5 --quiet
expect_error "--lr: '' is not a number up to 1000000" train --lr '' --quiet
expect_error "--momentum: '' is not a number below 1" train --momentum '' --quiet
expect_error "--workers: '99999999999' is not a whole number up to 256" train --workers 99999999999 --quiet
expect_error "--workers: '30000' is not a whole number up to 256" train --workers 30000 --quiet
expect_error "--steps: '0x10' is not a whole number" train --steps 0x10 --quiet
expect_error "--epochs: '99999999999999999999' is not a whole number up to 1000000" train --epochs 99999999999999999999 --quiet
expect_error "--label-smoothing: '1' is not a number below 1" train --label-smoothing 1 --quiet
CHORUS_CPU_DEVICES=abc expect_error "CHORUS_CPU_DEVICES='abc' is not a whole number from 1 to 1024" train --devices cpu:1 --data synthetic --steps 1 --quiet
# "010" is ten, not octal eight.
out=$(timeout 120 "$CHORUS" train "${syn[@]}" --epochs 010 --steps 1 --quiet --json)
check "--epochs 010 means 10" grep -q '"epochs":10,' <<<"$out"

# --- worker threads that cannot start -----------------------------------------
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
  as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
else
  as_user=()
fi
err=$(cd "$tmp" && timeout 120 "${as_user[@]}" bash -c 'ulimit -u 40; exec "$0" "$@"' "$CHORUS" train "${syn[@]:0:8}" --workers 64 --steps 1 --quiet 2>&1 >/dev/null); rc=$?
if [ "$(id -u)" != 0 ] || [ ${#as_user[@]} -gt 0 ]; then
  check "--workers 64 under ulimit -u 40 is a clear error (exit $rc: $err)" \
    bash -c '[ "$0" = 1 ] && grep -q "cannot start worker thread .* of 64: Resource temporarily unavailable" <<<"$1"' "$rc" "$err"
fi

# --- data ---------------------------------------------------------------------
idx() {  # idx FILE MAGIC_DIMS... : an IDX file with those dims and zero bytes
  python3 - "$@" <<'PY'
import struct, sys, gzip
path, dims = sys.argv[1], [int(d) for d in sys.argv[2:]]
n = 1
for d in dims: n *= d
data = struct.pack('>I', 0x0800 + len(dims)) + b''.join(struct.pack('>I', d) for d in dims) + bytes(n)
gzip.open(path, 'wb').write(data) if path.endswith('.gz') else open(path, 'wb').write(data)
PY
}
mkdir -p "$tmp/empty-train" "$tmp/empty-test" "$tmp/odd-test"
idx "$tmp/empty-train/train-images-idx3-ubyte" 0 28 28; idx "$tmp/empty-train/train-labels-idx1-ubyte" 0
idx "$tmp/empty-train/t10k-images-idx3-ubyte" 4 28 28; idx "$tmp/empty-train/t10k-labels-idx1-ubyte" 4
expect_error "$tmp/empty-train/train-images-idx3-ubyte: holds 0 images" train --data mnist --data-dir "$tmp/empty-train" --quiet
idx "$tmp/empty-test/train-images-idx3-ubyte" 8 28 28; idx "$tmp/empty-test/train-labels-idx1-ubyte" 8
idx "$tmp/empty-test/t10k-images-idx3-ubyte" 0 28 28; idx "$tmp/empty-test/t10k-labels-idx1-ubyte" 0
expect_error "$tmp/empty-test/t10k-images-idx3-ubyte: holds 0 images" train --data mnist --data-dir "$tmp/empty-test" --quiet
idx "$tmp/odd-test/train-images-idx3-ubyte" 8 28 28; idx "$tmp/odd-test/train-labels-idx1-ubyte" 8
idx "$tmp/odd-test/t10k-images-idx3-ubyte" 4 14 56; idx "$tmp/odd-test/t10k-labels-idx1-ubyte" 4
expect_error "$tmp/odd-test/t10k-images-idx3-ubyte has images of [1, 14, 56] but the model trains on [1, 28, 28]" \
  train --data mnist --data-dir "$tmp/odd-test" --quiet
# A gzip bomb: a real header, then 4 GiB of zeros (4 MB of gzip): read to the header's size only.
python3 - "$tmp/bomb" <<'PY'
import struct, sys, zlib, os
os.makedirs(sys.argv[1], exist_ok=True)
def member(b):
    c = zlib.compressobj(1, zlib.DEFLATED, 31); return c.compress(b) + c.flush()
zeros = member(bytes(64 << 20))
with open(sys.argv[1] + '/train-images-idx3-ubyte.gz', 'wb') as f:
    f.write(member(struct.pack('>IIII', 0x803, 8, 28, 28) + bytes(8 * 784)))
    for _ in range(64): f.write(zeros)
open(sys.argv[1] + '/train-labels-idx1-ubyte', 'wb').write(struct.pack('>II', 0x801, 8) + bytes(8))
open(sys.argv[1] + '/t10k-images-idx3-ubyte', 'wb').write(struct.pack('>IIII', 0x803, 2, 28, 28) + bytes(2 * 784))
open(sys.argv[1] + '/t10k-labels-idx1-ubyte', 'wb').write(struct.pack('>II', 0x801, 2) + bytes(2))
PY
start=$(date +%s)
# Under 4 GB of address space, unless AddressSanitizer (its shadow memory needs terabytes of it).
limit=4000000
# (Not `ldd | grep -q`: grep leaving at the first match can kill ldd with
# SIGPIPE, and pipefail then calls it no match: it did, once, in CI.)
case "$(ldd "$CHORUS" 2>/dev/null)" in *libasan*) limit=unlimited ;; esac
out=$(bash -c 'ulimit -v "$1"; shift; exec "$0" "$@"' "$CHORUS" "$limit" train --data mnist --data-dir "$tmp/bomb" --model mlp --steps 1 --quiet --json --workers 0 2>&1); rc=$?
check "gzip bomb read to the header's size (exit $rc, $(( $(date +%s) - start )) s): $(tail -c 200 <<<"$out")" \
  bash -c '[ "$0" = 0 ] && [ $(( $(date +%s) - $1 )) -lt 60 ]' "$rc" "$start"
# A directory that cannot be read is permission denied, not "not found" (as an ordinary user).
if [ ${#as_user[@]} -gt 0 ] || [ "$(id -u)" != 0 ]; then
  mkdir -p "$tmp/locked" && cp "$tmp/bomb/t10k-"* "$tmp/locked/" && chmod 000 "$tmp/locked"
  err=$(timeout 60 "${as_user[@]}" "$CHORUS" train --data mnist --data-dir "$tmp/locked" --quiet 2>&1 >/dev/null)
  check "unreadable data dir: $err" grep -q "cannot look for $tmp/locked/train-images-idx3-ubyte: Permission denied" <<<"$err"
  chmod 755 "$tmp/locked"
fi

# --- metrics CSV: every record, across a resume -------------------------------
run=(train "${syn[@]}" --epochs 2 --metrics "$tmp/run.csv" --checkpoint-dir "$tmp/m-ck" --quiet)
check "--metrics run.csv trains to the end" timeout 300 "$CHORUS" "${run[@]}" --steps 12
check "--resume with --metrics run.csv trains to the end" timeout 300 "$CHORUS" "${run[@]}" --steps 16 --resume --allow-change steps
check "the CSV has one header and equal-width rows" python3 - "$tmp/run.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
assert {"step", "epoch", "loss", "test_loss", "summary"} <= set(rows[0]), rows[0]
assert all(len(r) == len(rows[0]) for r in rows), [len(r) for r in rows]
assert sum(1 for r in rows[1:] if r[rows[0].index("summary")]) == 2
PY

# --- resume: unreadable newest checkpoint, config, position -------------------
ck=(train "${syn[@]}" --epochs 3 --checkpoint-dir "$tmp/ck")
timeout 300 "$CHORUS" "${ck[@]}" --quiet >/dev/null
newest=$(ls -d "$tmp"/ck/ckpt-* | tail -1)
rm "$newest/model.safetensors"
err=$(timeout 300 "$CHORUS" "${ck[@]}" --resume --quiet 2>&1 >/dev/null); rc=$?
check "resume skips the unreadable checkpoint and says why, also with --quiet (exit $rc): $err" \
  grep -q "skipped $newest: $newest/model.safetensors: missing; .*; kept as $newest.unreadable" <<<"$err"
check "the skipped checkpoint is kept with its state.json and optimizer file" \
  test -f "$newest.unreadable/state.json" -a -f "$newest.unreadable/optimizer.safetensors"
mkdir -p "$tmp/ck1" && timeout 300 "$CHORUS" train "${syn[@]}" --steps 4 --checkpoint-dir "$tmp/ck1" --quiet >/dev/null
rm "$tmp"/ck1/ckpt-*/optimizer.safetensors
expect_error "no checkpoint could be read" train "${syn[@]}" --steps 8 --checkpoint-dir "$tmp/ck1" --resume --quiet
check "--resume --start-fresh starts over" \
  timeout 300 "$CHORUS" train "${syn[@]}" --steps 8 --checkpoint-dir "$tmp/ck1" --resume --start-fresh --quiet
check "...keeping the unreadable checkpoint" test -f "$(ls -d "$tmp"/ck1/ckpt-*.unreadable)/model.safetensors"
expect_error "--batch-size is 64 but the checkpoint" train "${syn[@]/32/64}" --epochs 3 --checkpoint-dir "$tmp/ck" --resume --quiet
expect_error "--data is \"mnist\" but the checkpoint" train --model mlp --data mnist --data-dir "$tmp/bomb" --batch-size 32 --devices cpu --workers 0 --seed 3 --epochs 3 --checkpoint-dir "$tmp/ck" --resume --quiet
expect_error "--epochs is 5 but the checkpoint" train "${syn[@]}" --epochs 5 --checkpoint-dir "$tmp/ck" --resume --quiet
check "--allow-change epochs continues for more epochs" \
  timeout 300 "$CHORUS" train "${syn[@]}" --epochs 5 --checkpoint-dir "$tmp/ck" --resume --allow-change epochs --quiet
last=$(ls -d "$tmp"/ck/ckpt-*[0-9] | tail -1)
python3 -c 'import json,sys; p=sys.argv[1]; s=json.load(open(p)); s["epoch"]=99; s["step"]=99*8; json.dump(s, open(p,"w"))' "$last/state.json"
expect_error "$last/state.json: epoch 99 (batch 0) is past the run's end (5 epochs)" train "${syn[@]}" --epochs 5 --checkpoint-dir "$tmp/ck" --resume --quiet

# --- signals: finish the step, checkpoint, say so, exit 128 + signal ----------
# Job control: without it bash starts background jobs with SIGINT ignored,
# and chorus leaves an ignored signal ignored (as under nohup).
set -m
long=(train --model cnn --data synthetic --synthetic-size 100000 --batch-size 16 --devices cpu --workers 1 --epochs 1)
for sig in INT TERM HUP; do
  rm -rf "$tmp/sig"
  "$CHORUS" "${long[@]}" --checkpoint-dir "$tmp/sig" --quiet 2>"$tmp/sig.err" >/dev/null &
  pid=$!
  sleep 4
  kill -$sig $pid
  wait $pid; rc=$?
  want=$((128 + $(kill -l $sig)))
  check "SIG$sig: exit $rc (want $want), $(tr '\n' ' ' <"$tmp/sig.err")" \
    bash -c '[ "$0" = "$1" ] && grep -q "stopped by SIG$2 at step [0-9]*; checkpoint written to .*/ckpt-" "$3" && ls "$4"/ckpt-*/state.json >/dev/null' \
    "$rc" "$want" "$sig" "$tmp/sig.err" "$tmp/sig"
done
# A step of seconds, so that the second signal comes while the first waits for it.
"$CHORUS" train --model wrn-16-4 --data synthetic --synthetic-size 2048 --batch-size 64 --devices cpu --workers 1 \
  2>"$tmp/sig.err" >/dev/null &
pid=$!
for _ in $(seq 1 600); do grep -q "^training" "$tmp/sig.err" 2>/dev/null && break; sleep 0.1; done
sleep 0.5
kill -INT $pid; sleep 0.2; kill -INT $pid
wait $pid; rc=$?
check "a second SIGINT exits at once (exit $rc): $(tr '\n' ' ' <"$tmp/sig.err")" \
  bash -c '[ "$0" = 130 ] && grep -q "second signal: exiting now" "$1"' "$rc" "$tmp/sig.err"
# A repeated SIGTERM (as `timeout` sends to the command and then its process
# group) still stops cleanly, with the checkpoint.
"$CHORUS" train --model cnn --data synthetic --synthetic-size 4096 --batch-size 64 --devices cpu --workers 1 \
  --checkpoint-dir "$tmp/sig2" 2>"$tmp/sig2.err" >/dev/null &
pid=$!
for _ in $(seq 1 600); do grep -q "^training" "$tmp/sig2.err" 2>/dev/null && break; sleep 0.1; done
sleep 0.3
kill -TERM $pid; kill -TERM $pid
wait $pid; rc=$?
check "SIGTERM twice: exit $rc (want 143) with a checkpoint: $(tr '\n' ' ' <"$tmp/sig2.err")" \
  bash -c '[ "$0" = 143 ] && ! grep -q "exiting now" "$1" && ls "$2"/ckpt-*/state.json >/dev/null' "$rc" "$tmp/sig2.err" "$tmp/sig2"
exit $fail
