#!/usr/bin/env bash
# `chorus train --strategy pipeline` and `chorus bench --strategy pipeline` on
# logical CPU devices:
#   - an MLP (no batch norm) trained by each schedule over cpu:0,cpu:1 (and
#     interleaved with virtual stages) equals one device on the same batch
#   - the CNN (batch norm, deferred) trains, and its checkpoint resumes on one
#     device and back (state_dict names do not depend on the pipeline)
#   - bad input: one clear line, exit 1
#   - the bench: a row per schedule with throughput, bubble and peak memory per device;
#     with --bound, the plain steps' rates and each row's bound over naive
set -uo pipefail
CHORUS=${1:?usage: train_pipeline.sh path/to/chorus}
fail=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
common=(--model mlp --data synthetic --synthetic-size 1024 --epochs 1 --seed 5 --json --quiet --workers 2 --batch-size 64)
one=$("$CHORUS" train "${common[@]}" --strategy single --devices cpu:0) || { echo "FAIL: single run"; exit 1; }
for args in "--schedule gpipe --micro-batches 4" "--schedule 1f1b --micro-batches 8 --balance 2,4" \
            "--schedule interleaved --micro-batches 4 --virtual-stages 2" "--schedule 1f1b --micro-batches 3 --recompute always" "--schedule gpipe --micro-batches 2 --balance memory"; do
  # shellcheck disable=SC2086
  got=$("$CHORUS" train "${common[@]}" --strategy pipeline --devices cpu:0,cpu:1 $args) || { echo "FAIL: pipeline $args"; fail=1; continue; }
  python3 - "$got" "$one" "$args" <<'PY' || fail=1
import json, sys
p, one, args = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
assert p["strategy"] == "pipeline" and p["devices"] == ["cpu:0", "cpu:1"], p
assert p["steps"] == one["steps"], (p["steps"], one["steps"])
for k in ("train_loss", "test_loss"):
    rel = abs(p[k] - one[k]) / max(abs(one[k]), 1e-12)
    print(f"pipeline {args}: {k} {p[k]:.7f} single {one[k]:.7f} rel {rel:.2e}")
    assert rel <= 1e-4, f"{k} differs: {rel}"
PY
done

# The CNN with batch norm: trains; its checkpoint moves between pipeline and one device.
ck="$tmp/ck"
cnn=(--model cnn --data synthetic --synthetic-size 512 --batch-size 32 --seed 3 --quiet --json --workers 1 --checkpoint-dir "$ck")
a=$("$CHORUS" train "${cnn[@]}" --strategy pipeline --devices cpu:0,cpu:1 --steps 6) || { echo "FAIL: cnn pipeline"; fail=1; }
b=$("$CHORUS" train "${cnn[@]}" --strategy single --devices cpu:0 --steps 12 --resume --allow-change strategy,devices,steps) \
  || { echo "FAIL: resume a pipeline checkpoint on one device"; fail=1; }
c=$("$CHORUS" train "${cnn[@]}" --strategy pipeline --devices cpu:0,cpu:1 --schedule gpipe --steps 16 --resume \
    --allow-change strategy,devices,steps) || { echo "FAIL: resume a one-device checkpoint as a pipeline"; fail=1; }
python3 - "$a" "$b" "$c" <<'PY' || fail=1
import json, sys
a, b, c = (json.loads(x) for x in sys.argv[1:4])
assert (a["steps"], b["steps"], c["steps"]) == (6, 12, 16), (a["steps"], b["steps"], c["steps"])
for r in (a, b, c):
    assert r["test_loss"] == r["test_loss"] and r["test_loss"] < 10, r
print(f"cnn: pipeline 6 steps -> one device to 12 -> pipeline to 16; test loss {a['test_loss']:.4f} {b['test_loss']:.4f} {c['test_loss']:.4f}")
PY

# Bad input: one line naming what is wrong, exit 1.
bad() {  # EXPECTED ARGS...
  local want=$1; shift
  local out rc
  out=$("$CHORUS" train --model cnn --data synthetic --synthetic-size 64 --steps 1 --quiet "$@" 2>&1); rc=$?
  if [ $rc -eq 1 ] && grep -q -- "$want" <<<"$out" && [ "$(wc -l <<<"$out")" -le 2 ]; then
    echo "ok: $* -> $(head -1 <<<"$out")"
  else
    echo "FAIL: $* (rc $rc): $out"; fail=1
  fi
}
bad "adds up to 6" --strategy pipeline --devices cpu:0,cpu:1 --balance 3,3
bad "only 12 layers" --strategy pipeline --devices cpu:0,cpu:1 --balance 1,1,1,1,1,1,1,1,1,1,1,1,1
bad "micro-batches must be from 1 to the batch size" --strategy pipeline --devices cpu:0,cpu:1 --batch-size 8 --micro-batches 16
bad "cpu:99" --strategy pipeline --devices cpu:0,cpu:99
bad "unknown pipeline schedule 'zigzag'" --strategy pipeline --schedule zigzag
bad "unknown recomputation" --strategy pipeline --recompute sometimes
bad "goes with --strategy pipeline" --strategy single --micro-batches 4
bad "--balance: 'x'" --strategy pipeline --balance 4,x

# The bench: one row per schedule.
rows=$("$CHORUS" bench --strategy pipeline --model mlp --devices cpu:0,cpu:1 --batch-size 64 --micro-batches 8 \
       --schedules naive,gpipe,1f1b,interleaved --steps 3 --warmup 1 --json) || { echo "FAIL: bench"; fail=1; }
python3 - "$rows" <<'PY' || fail=1
import json, sys
rows = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")]
assert [r["schedule"] for r in rows] == ["naive", "gpipe", "1f1b", "interleaved"], rows
assert len(rows[1]["balance"].split(",")) == 2 and len(rows[3]["balance"].split(",")) == 4, rows  # 2 virtual stages per device
for r in rows:
    assert r["strategy"] == "pipeline" and r["img_per_s"] > 0 and len(r["peak_mem_bytes_per_device"]) == 2, r
    assert 0 <= r["bubble"] < 1 and 0 <= r["bubble_ideal"] < 1, r
    print(f"bench {r['schedule']}: {r['img_per_s']:.0f} img/s, bubble {r['bubble']:.3f} (ideal {r['bubble_ideal']:.3f}), "
          f"peak {r['peak_mem_bytes_per_device']}, x naive {r['speedup_vs_naive']}")
assert rows[0]["bubble_ideal"] == 0.5, rows[0]  # M = 1 on 2 devices: one works at a time
PY
# --bound: plain steps of the micro-batch and of the batch first, then each
# row's bound = devices x rate(micro-batch) x (1 - ideal bubble) / naive.
rows=$("$CHORUS" bench --strategy pipeline --model mlp --devices cpu:0,cpu:1 --batch-size 64 --micro-batches 4 \
       --schedules naive,gpipe --steps 3 --warmup 1 --bound --json) || { echo "FAIL: bench --bound"; fail=1; }
python3 - "$rows" <<'PY' || fail=1
import json, sys
rows = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")]
plain, naive, gpipe = rows
assert plain["strategy"] == "plain" and plain["micro_batch"] == 16 and plain["batch"] == 64, plain
assert plain["micro_batch_img_per_s"] > 0 and plain["batch_img_per_s"] > 0, plain
assert naive["bound_vs_naive"] is None, naive
want = 2 * plain["micro_batch_img_per_s"] * (1 - gpipe["bubble_ideal"]) / naive["img_per_s"]
assert abs(gpipe["bound_vs_naive"] - want) <= 1e-9 * want, (gpipe, want)
print(f"bench --bound: gpipe {gpipe['speedup_vs_naive']:.2f}x naive, bound {gpipe['bound_vs_naive']:.2f}x")
PY
[ $fail = 0 ] && echo "pipeline command line: all ok"
exit $fail
