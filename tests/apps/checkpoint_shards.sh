#!/usr/bin/env bash
# Issue 49, item 3: `chorus checkpoint shard` turns one full safetensors file
# into a sharded checkpoint and `chorus checkpoint consolidate` turns it back,
# bit-exactly, at any world size; a GPT goes out under Hugging Face's layout
# and comes back; bad input is one line and exit 1.
set -uo pipefail
CHORUS=$(readlink -f "$1")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
check() {  # check "description" command...
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}
# Tensor by tensor (name, dtype, shape, bytes), whatever the metadata: python3's standard library only.
same_tensors() {
  python3 - "$1" "$2" <<'EOF'
import json, struct, sys
def tensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n]); header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]) for k, v in header.items()}
sys.exit(0 if tensors(sys.argv[1]) == tensors(sys.argv[2]) else 1)
EOF
}
shape_of() { python3 -c 'import json,struct,sys; d=open(sys.argv[1],"rb").read(); n=struct.unpack("<Q",d[:8])[0]; print(json.loads(d[8:8+n])[sys.argv[2]]["shape"])' "$1" "$2"; }

# --- a model file: one step of the MLP ---------------------------------------
"$CHORUS" train --model mlp --data synthetic --synthetic-size 64 --batch-size 32 --devices cpu --workers 0 --steps 1 \
  --quiet --checkpoint-dir "$tmp/run" > /dev/null
model=$tmp/run/ckpt-00000001/model.safetensors
check "a model file to shard" test -f "$model"

err=$("$CHORUS" checkpoint shard "$model" "$tmp/sh3" --world 3 --step 7 2>&1); rc=$?
check "shard --world 3 (exit $rc): $err" test "$rc" = 0
check "three shards, the replicated file, the index and latest" test -f "$tmp/sh3/ckpt-00000007/shard-00002-of-00003.safetensors" \
  -a -f "$tmp/sh3/ckpt-00000007/replicated.safetensors" -a -f "$tmp/sh3/ckpt-00000007/index.json" -a "$(cat "$tmp/sh3/latest")" = ckpt-00000007
err=$("$CHORUS" checkpoint consolidate "$tmp/sh3" "$tmp/full.safetensors" 2>&1); rc=$?
check "consolidate (exit $rc)" test "$rc" = 0
check "it says what it wrote: $(tail -1 <<<"$err")" grep -q "^wrote $tmp/full.safetensors: .* tensors, .* bytes of weights, Chorus's names" <<<"$err"
check "shard then consolidate gives the same file, byte for byte" cmp -s "$model" "$tmp/full.safetensors"
"$CHORUS" checkpoint shard "$tmp/full.safetensors" "$tmp/sh1" --world 1 2>/dev/null
"$CHORUS" checkpoint consolidate "$tmp/sh1/ckpt-00000000" "$tmp/full1.safetensors" 2>/dev/null
check "again at world 1, from the checkpoint's own directory" cmp -s "$model" "$tmp/full1.safetensors"

# --- a GPT: Hugging Face's layout out, and back ----------------------------------
python3 -c "
import random; random.seed(1); w='in the beginning god created heaven and earth'.split()
print('\n'.join(' '.join(random.choice(w) for _ in range(12)) for _ in range(400)))" > "$tmp/text.txt"
"$CHORUS" train --model d2 --data "text:$tmp/text.txt" --seq-len 32 --batch-size 2 --steps 1 --quiet \
  --checkpoint-dir "$tmp/gpt" > /dev/null
gpt=$tmp/gpt/ckpt-00000001/model.safetensors
err=$("$CHORUS" checkpoint shard "$gpt" "$tmp/gsh" --world 2 --model d2 2>&1); rc=$?
check "shard a GPT (exit $rc)" test "$rc" = 0
err=$("$CHORUS" checkpoint consolidate "$tmp/gsh" "$tmp/hf.safetensors" 2>&1); rc=$?
check "consolidate a GPT: Hugging Face's names by default (exit $rc): $(tail -1 <<<"$err")" \
  grep -q "Hugging Face GPT-2 names and layout (d2)" <<<"$err"
check "Conv1D weights in Hugging Face's [in, out] layout" \
  test "$(shape_of "$tmp/hf.safetensors" transformer.h.0.attn.c_attn.weight)" = "$(python3 -c 'print([128, 384])')"
err=$("$CHORUS" checkpoint shard "$tmp/hf.safetensors" "$tmp/hsh" --world 3 2>&1); rc=$?
check "shard recognises the Hugging Face file (exit $rc)" grep -q "converted from Hugging Face's layout (GPT d2" <<<"$err"
"$CHORUS" checkpoint consolidate "$tmp/hsh" "$tmp/back.safetensors" --chorus-names 2>/dev/null
check "and gives the GPT back in Chorus's layout, tensor for tensor" same_tensors "$gpt" "$tmp/back.safetensors"

# --- bad input: one line, exit 1 ----------------------------------------------------
bad() {  # bad "description" "expected text" args...
  local what=$1 want=$2; shift 2
  local out rc
  out=$("$CHORUS" "$@" 2>&1 >/dev/null); rc=$?
  check "$what (exit $rc): $out" bash -c '[ "$1" = 1 ] && [ "$(grep -c . <<<"$2")" = 1 ] && grep -qF -- "$3" <<<"$2"' _ "$rc" "$out" "$want"
}
bad "a missing directory" "$tmp/nowhere: no such directory" checkpoint consolidate "$tmp/nowhere" "$tmp/x.safetensors"
bad "a one-process checkpoint is not a sharded one" "not a sharded checkpoint" checkpoint consolidate "$tmp/run" "$tmp/x.safetensors"
bad "--world 0" "--world must be between 1 and 100000, got 0" checkpoint shard "$model" "$tmp/w0" --world 0
bad "--hf for a model that is not a GPT" "is not a GPT's" checkpoint consolidate "$tmp/sh3" "$tmp/x.safetensors" --hf
cp -r "$tmp/sh3" "$tmp/corrupt"
echo '{"format": "chorus-sharded-checkpoint", ' > "$tmp/corrupt/ckpt-00000007/index.json"
bad "a corrupt index" "index.json: not valid JSON" checkpoint consolidate "$tmp/corrupt/ckpt-00000007" "$tmp/x.safetensors"
cp -r "$tmp/sh3" "$tmp/holed"
rm "$tmp/holed/ckpt-00000007/shard-00001-of-00003.safetensors"
bad "a missing shard file" "shard-00001-of-00003.safetensors: missing" checkpoint consolidate "$tmp/holed/ckpt-00000007" "$tmp/x.safetensors"
check "no output file from any of them" test ! -e "$tmp/x.safetensors"
exit $fail
