#!/usr/bin/env bash
# Bad input: each case exits non-zero with one clear line on stderr, never a
# crash (no abort, no signal) and never a hang.
set -uo pipefail
CHORUS=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
expect_error() {  # expect_error "what the message must contain" args...
  local want=$1; shift
  local err rc
  err=$(timeout 120 "$CHORUS" "$@" 2>&1 >/dev/null); rc=$?
  if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then
    echo "FAIL (exit $rc): chorus $*"; echo "  stderr: $err"; fail=1; return
  fi
  if ! grep -qi -- "$want" <<<"$err"; then
    echo "FAIL (message lacks '$want'): chorus $*"; echo "  stderr: $err"; fail=1; return
  fi
  if [ "$(grep -c . <<<"$err")" -ne 1 ]; then
    echo "FAIL (not one line): chorus $*"; echo "$err"; fail=1; return
  fi
  echo "ok: chorus $* -> $err"
}
q=(--quiet --steps 1)
expect_error "unknown model 'resnet9000'" train --model resnet9000 "${q[@]}"
expect_error "unknown data set 'imagenet'" train --data imagenet "${q[@]}"
expect_error "unknown strategy 'magic'" train --strategy magic "${q[@]}"
expect_error "unknown device 'tpu:0'" train --devices tpu:0 "${q[@]}"
expect_error "batch-size must be positive" train --batch-size 0 "${q[@]}"
expect_error "lr must be" train --lr -0.1 "${q[@]}"
# -1 was once an out-of-band "use the default": an explicit value is always checked.
expect_error "lr must be a non-negative number, got -1" train --lr -1 "${q[@]}"
expect_error "steps must be positive, got 0" train --steps 0 --quiet
# Nor is an explicitly empty path ("" was once the same as leaving it out).
expect_error "--data-dir is empty" train --data-dir "" "${q[@]}"
expect_error "--checkpoint-dir is empty" train --checkpoint-dir "" "${q[@]}"
expect_error "--metrics is empty" train --metrics "" "${q[@]}"
expect_error "--device-counts: '' is not a number" bench --strategy dp --devices cpu:0,cpu:1 --device-counts ""
expect_error "--device-counts: '2x' is not a number" bench --strategy dp --devices cpu:0,cpu:1 --device-counts 1,2x
if "$CHORUS" devices | grep -q "no CUDA GPU"; then
  expect_error "cuda:0" train --devices cuda:0 "${q[@]}"
fi
expect_error "cpu:99" train --devices cpu:99 "${q[@]}"
expect_error "--channels-last needs CUDA devices (got cpu:0)" train --devices cpu:0 --channels-last "${q[@]}"
expect_error "--channels-last and --no-channels-last contradict" train --channels-last --no-channels-last "${q[@]}"
# DataParallel device lists: empty, a device twice.
expect_error "empty device list" train --strategy dp --devices "" "${q[@]}"
expect_error "empty device list" bench --strategy dp --devices ","
expect_error "appears twice" train --strategy dp --devices cpu:0,cpu:0 "${q[@]}"
expect_error "--dp-broadcast goes with --strategy dp" train --dp-broadcast "${q[@]}"
expect_error "--dp-all-reduce goes with --strategy dp" train --dp-all-reduce copy-engine "${q[@]}"
expect_error "--dp-all-reduce must be auto, nccl, copy-engine or in-update, got 'ring'" train --strategy dp --devices cpu:0,cpu:1 --dp-all-reduce ring "${q[@]}"
expect_error "not --dp-broadcast" train --strategy dp --devices cpu:0,cpu:1 --dp-broadcast --dp-all-reduce nccl "${q[@]}"
CHORUS_DP_ALLREDUCE=nvls expect_error "CHORUS_DP_ALLREDUCE must be auto, nccl, copy-engine or in-update, got 'nvls'" bench --strategy dp --devices cpu:0,cpu:1 --model mlp --steps 1 --warmup 0
CHORUS_DP_GRADS=flat expect_error "CHORUS_DP_GRADS='flat' is not a way to hand gradients to the all-reduce (expected in-place or packed)" train --strategy dp --devices cpu:0,cpu:1 "${q[@]}"
CHORUS_DP_GRADS_MIN_BYTES=1MB expect_error "CHORUS_DP_GRADS_MIN_BYTES='1MB' is not a number of bytes" bench --strategy dp --devices cpu:0,cpu:1 --model mlp --steps 1 --warmup 0
expect_error "--bucket-mb must be a number >= 0" train --strategy dp --devices cpu:0,cpu:1 --bucket-mb -1 "${q[@]}"
expect_error "comm-hook noop communicates nothing" train --comm-hook noop "${q[@]}"
expect_error "--comm-hook must be allreduce, bf16 or noop, got 'bogus'" bench --strategy ddp --comm-hook bogus
expect_error "--bucket-mb must be a number >= 0" bench --strategy dp --devices cpu:0,cpu:1 --bucket-mb -2
expect_error "--last-bucket-mb must be a number >= 0, got -1" bench --strategy dp --devices cpu:0,cpu:1 --last-bucket-mb -1
expect_error "not found" train --data fashion-mnist --data-dir "$tmp/nowhere" "${q[@]}"
# A truncated IDX file names the file and what was expected.
mkdir -p "$tmp/fm"
if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  cp /usr/share/datasets/fashion-mnist/*.gz "$tmp/fm/"
  gzip -dc /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz | head -c 100000 | gzip > "$tmp/fm/train-images-idx3-ubyte.gz"
  expect_error "train-images-idx3-ubyte" train --data fashion-mnist --data-dir "$tmp/fm" "${q[@]}"
fi
# CIFAR: a file of the wrong size.
mkdir -p "$tmp/cifar"
head -c 5000 /dev/urandom > "$tmp/cifar/data_batch_1.bin"
expect_error "data_batch" train --data cifar10 --data-dir "$tmp/cifar" --model resnet20 "${q[@]}"
# A corrupted checkpoint is reported, naming the file.
"$CHORUS" train --model mlp --data synthetic --synthetic-size 256 --steps 4 --devices cpu --quiet \
  --checkpoint-dir "$tmp/ck" >/dev/null
ck=$(ls -d "$tmp"/ck/ckpt-* | tail -1)
head -c 200 "$ck/model.safetensors" > "$ck/model.tmp" && mv "$ck/model.tmp" "$ck/model.safetensors"
expect_error "model.safetensors" train --model mlp --data synthetic --synthetic-size 256 --steps 4 --devices cpu \
  --checkpoint-dir "$tmp/ck" --resume --quiet
expect_error "needs --checkpoint-dir" train --resume "${q[@]}"
expect_error "unknown precision" train --precision fp8 "${q[@]}"
expect_error "error" train --epochs abc
expect_error "error" frobnicate
exit $fail
