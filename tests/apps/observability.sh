#!/usr/bin/env bash
# What a user looks at (docs/observability.md), from one short CPU run:
# TensorBoard event files decoded in Python (tests/apps/tfevents.py, no
# TensorFlow, no protobuf) and every scalar checked against the --metrics line
# it came from; chorus plot's SVG (two runs, JSON lines and CSV) and
# chorus train --plot; chorus train|bench --trace (tests/apps/check_trace.py:
# phases, one pid per rank, device tracks, timestamps in order). The
# distributed trace (every rank in one file) is tests/distributed/observability_ddp.sh;
# chorus bench --json rows carry the device name and the commit.
set -euo pipefail
CHORUS=$1
HERE=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$CHORUS" train --model mlp --data synthetic --synthetic-size 384 --batch-size 64 --epochs 2 --log-every 2 \
  --devices cpu --workers 0 --quiet --metrics "$work/m.jsonl" --tensorboard "$work/tb" --plot "$work/live.svg" >/dev/null

"$CHORUS" train --model mlp --data synthetic --synthetic-size 384 --batch-size 64 --epochs 2 --log-every 2 \
  --devices cpu --workers 0 --quiet --lr 0.01 --metrics "$work/slow.csv" >/dev/null
"$CHORUS" plot "$work/m.jsonl" "$work/slow.csv" --out "$work/curves.svg"
if "$CHORUS" plot "$work/m.jsonl" --out "$work/curves.pdf" 2>"$work/err"; then echo "a .pdf was accepted"; exit 1; fi
grep -q "must end in .svg or .png" "$work/err"
if command -v rsvg-convert >/dev/null; then
  "$CHORUS" plot "$work/m.jsonl" --out "$work/curves.png"
  head -c 8 "$work/curves.png" | od -c | grep -q "P   N   G"
else
  if "$CHORUS" plot "$work/m.jsonl" --out "$work/curves.png" 2>"$work/err"; then echo "png without rsvg-convert"; exit 1; fi
  grep -q "needs rsvg-convert" "$work/err"
fi

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

python3 - "$work" <<'PY'
import os, sys, xml.etree.ElementTree as ET
work = sys.argv[1]
ns = "{http://www.w3.org/2000/svg}"
for name, runs in [("curves.svg", ["m", "slow"]), ("live.svg", ["m"])]:
    root = ET.parse(os.path.join(work, name)).getroot()
    texts = [t.text for t in root.iter(ns + "text")]
    for title in ["Loss", "Accuracy", "Throughput (img/s)", "Peak memory (MiB)"]:
        assert title in texts, (name, title)
    for r in runs:
        assert r in texts, (name, r, "legend")
    lines = root.findall(ns + "polyline")
    # per run: train loss, val loss, train and val accuracy, throughput, memory
    assert len(lines) == 6 * len(runs), (name, len(lines))
    assert "no data" not in texts, name
print("plot: curves.svg and live.svg hold every panel and run")
PY

"$CHORUS" train --model mlp --data synthetic --synthetic-size 384 --batch-size 64 --epochs 1 --devices cpu \
  --workers 0 --quiet --trace "$work/t.json" --trace-steps 2-4 >/dev/null
python3 "$HERE/check_trace.py" "$work/t.json" --steps 2-4 --phases data,forward,backward,optimizer
"$CHORUS" train --model mlp --data synthetic --synthetic-size 384 --batch-size 32 --epochs 1 --strategy dp \
  --devices cpu:0,cpu:1 --workers 0 --quiet --trace "$work/dp.json" --trace-steps 1-2 >/dev/null
python3 "$HERE/check_trace.py" "$work/dp.json" --steps 1-2 --phases data,forward,backward,optimizer --devices cpu:0,cpu:1
"$CHORUS" bench --model mlp --devices cpu --batch-size 32 --steps 4 --warmup 1 --trace "$work/b.json" \
  --trace-steps 2-3 >/dev/null
python3 "$HERE/check_trace.py" "$work/b.json" --steps 2-3 --phases forward,backward,optimizer
if "$CHORUS" train --steps 1 --trace "$work/x.json" --trace-steps 3-1 2>"$work/err"; then echo "3-1 accepted"; exit 1; fi
grep -q "ends before it begins" "$work/err"

# chorus bench: --json rows name the device and the commit; the table has a memory column.
"$CHORUS" bench --model mlp --devices cpu --batch-size 16 --steps 2 --warmup 1 --json > "$work/bench.jsonl"
"$CHORUS" bench --model mlp --devices cpu --batch-size 16 --steps 2 --warmup 1 | grep -q "peak .* MiB"
"$CHORUS" --version | grep -Eq "^commit: ([0-9a-f]{7,}(-dirty)?|unknown)$"
python3 - "$work/bench.jsonl" <<'PY'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert rows
for r in rows:
    assert r["device_name"] and "cpu:0" in r["device_name"], r["device_name"]
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?|unknown", r["commit"]), r["commit"]
    assert r["peak_mem_bytes"] > 0
print(f"bench: device_name {rows[0]['device_name']!r}, commit {rows[0]['commit']}")
PY
