#!/usr/bin/env bash
# What a user looks at (docs/observability.md), from one short CPU run:
# TensorBoard event files decoded in Python (tests/apps/tfevents.py, no
# TensorFlow, no protobuf) and every scalar checked against the --metrics line
# it came from.
set -euo pipefail
CHORUS=$1
HERE=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$CHORUS" train --model mlp --data synthetic --synthetic-size 384 --batch-size 64 --epochs 2 --log-every 2 \
  --devices cpu --workers 0 --quiet --metrics "$work/m.jsonl" --tensorboard "$work/tb" >/dev/null

python3 - "$work" "$HERE" <<'PY'
import glob, json, os, struct, sys
work, here = sys.argv[1], sys.argv[2]
sys.path.insert(0, here)
import tfevents

runs = glob.glob(os.path.join(work, "tb", "*"))
assert len(runs) == 1, f"one run directory per job, got {runs}"
assert os.path.basename(runs[0]).endswith("-mlp-single"), runs[0]
files = glob.glob(os.path.join(runs[0], "events.out.tfevents.*"))
assert len(files) == 1, files
ev = list(tfevents.events(files[0]))
assert ev[0]["file_version"] == "brain.Event:2", ev[0]

# The tags each --metrics record should give (apps/run_log.cpp's table, written out again here).
STEP = {"loss": "train/loss", "accuracy": "train/accuracy", "lr": "train/lr", "img_per_s": "train/img_per_s",
        "step_ms": "train/step_ms", "grad_norm": "train/grad_norm", "peak_mem_bytes": "memory/peak_bytes"}
EPOCH = {"test_loss": "val/loss", "test_accuracy": "val/accuracy", "mem_in_use_bytes": "memory/in_use_bytes"}
want = []
for line in open(os.path.join(work, "m.jsonl")):
    r = json.loads(line)
    if "summary" in r:
        continue
    table = STEP if "loss" in r else EPOCH
    tags = {tag: r[key] for key, tag in table.items() if key in r}
    for dev, v in r.get("peak_mem_bytes_per_device", {}).items():
        tags["memory/peak_bytes/" + dev] = v
    want.append((r["step"], tags))
got = [(e["step"], e["scalars"]) for e in ev[1:]]
assert len(got) == len(want), f"{len(got)} events, {len(want)} metrics records"
f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]
for (gs, gt), (ws, wt) in zip(got, want):
    assert gs == ws, (gs, ws)
    assert set(gt) == set(wt), (gs, sorted(gt), sorted(wt))
    for tag, v in wt.items():
        assert gt[tag] == f32(v), (gs, tag, gt[tag], v)
seen = set().union(*(t for _, t in got))
for tag in ["train/loss", "train/accuracy", "train/lr", "train/img_per_s", "train/step_ms", "train/grad_norm",
            "memory/peak_bytes", "val/loss", "val/accuracy", "memory/peak_bytes/cpu:0"]:
    assert tag in seen, f"no {tag} in {sorted(seen)}"
print(f"tensorboard: {len(got)} events, {sum(len(t) for _, t in got)} scalars match the metrics file")
PY

