#!/usr/bin/env python3
"""The table scripts/gpu_check.sh prints last: every Chorus row of $OUT/rows.jsonl beside the PyTorch row of the
same model, precision, layout, GPU count and mode from the same run. Usage: summary.py ROWS.jsonl"""
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
ch = [r for r in rows if "strategy" in r]
th = [r for r in rows if r.get("torch")]
print(f"{'model':10} {'prec':5} {'strategy':8} {'graph':5} {'dev':>3} {'chorus':>9} {'torch':>9} {'ratio':>6} {'peakMiB':>8} {'torchMiB':>8} {'issue/total ms':>15}")
for c in ch:
    mode = "single" if c["devices"] == 1 else c["strategy"]
    t = next((t for t in th if t["model"] == c["model"] and t["precision"] == c["precision"] and t["gpus"] == c["devices"]
              and t.get("channels_last", False) == c.get("channels_last", False)
              and (t["mode"] == mode or (mode == "dp" and t["mode"] == "ddp"))), None)
    tv = t["img_per_s"] if t else float("nan")
    tm = t.get("peak_mem_bytes", float("nan")) / 2**20 if t else float("nan")
    print(f"{c['model']:10} {c['precision']:5} {c['strategy']:8} {'yes' if c.get('cuda_graphs') else 'no':5} {c['devices']:>3} {c['img_per_s']:9.1f} {tv:9.1f} {c['img_per_s']/tv:6.2f} "
          f"{c['peak_mem_bytes']/2**20:8.0f} {tm:8.0f} {c.get('host_issue_ms',0):7.1f}/{c.get('total_ms',0):.1f}")
