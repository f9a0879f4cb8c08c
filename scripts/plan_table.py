#!/usr/bin/env python3
"""docs/parallelism.md's "Predicted beside measured" table, regenerated.

For each measured row (bench/plan/measured.jsonl: model, gpus, batch a GPU,
the plan's layout name, extra `chorus plan` flags, the measured tok/s, MFU,
peak GiB, machine and source) it runs `chorus plan --json` with the
calibration and prints one Markdown row: measured, predicted, and their
ratio (bold when it is outside 10%). --beyond also prints the best layouts
on 64 and 1024 GPUs (gpt2-xl 8 sequences a GPU, d84 4 with --recompute).

  python3 scripts/plan_table.py --chorus build-cpu/chorus \
      --calibration bench/plan/h200_s38_v2.json --measured bench/plan/measured.jsonl --beyond
"""
import argparse
import json
import subprocess
import sys


def plan_rows(chorus, calibration, model, gpus, batch, flags):
    cmd = [chorus, "plan", "--model", model, "--gpus", str(gpus), "--batch-size", str(batch),
           "--calibration", calibration, "--json", *flags]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"plan_table.py: {' '.join(cmd)} failed: {out.stderr.strip()}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def cell(tok, mfu, gib):
    s = f"{tok:,.0f}" if tok is not None else "-"
    if mfu is not None:
        s += f" ({100 * mfu:.1f}%)"
    if gib is not None:
        s += f", {gib:.2f}"
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chorus", required=True, help="the chorus binary (a CPU build will do)")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--measured", required=True, help="JSONL of measured rows (bench/plan/measured.jsonl)")
    ap.add_argument("--beyond", action="store_true", help="also the best layouts on 64 and 1024 GPUs")
    a = ap.parse_args()
    measured = [json.loads(line) for line in open(a.measured) if line.strip()]
    print("| model | layout | GPUs | measured tok/s (MFU), peak GiB | machine, source | "
          "predicted tok/s (MFU), plan GiB | predicted / measured |")
    print("| --- | --- | ---: | --- | --- | --- | ---: |")
    within = total = 0
    for m in measured:
        rows = plan_rows(a.chorus, a.calibration, m["model"], m["gpus"], m["batch"], m.get("flags", []))
        hit = [r for r in rows if r["layout"] == m["layout"]]
        if not hit:
            sys.exit(f"plan_table.py: chorus plan has no layout '{m['layout']}' for {m['model']} on {m['gpus']} GPUs")
        r = hit[0]
        pred = cell(r["tok_per_s"], r["mfu"], r["memory_bytes"] / 2**30)
        if not r.get("rates_exact", True):
            pred += f" ({r.get('rates_of')}'s rates)"
        ratio = r["tok_per_s"] / m["tok_s"] if r["tok_per_s"] else None
        if ratio is not None:
            total += 1
            within += abs(ratio - 1) <= 0.10
        ratio_s = "-" if ratio is None else (f"{ratio:.3f}" if abs(ratio - 1) <= 0.10 else f"**{ratio:.3f}**")
        print(f"| {m['model']} | {m['label']} | {m['gpus']} | {cell(m['tok_s'], m.get('mfu'), m.get('peak_gib'))} | "
              f"{m['machine']}, {m['source']} | {pred} | {ratio_s} |")
    print(f"\nWithin 10%: {within} of {total} rows.")
    if a.beyond:
        print("\n| model | GPUs | best layout | predicted tok/s (MFU) | memory GiB | next best |")
        print("| --- | ---: | --- | --- | --- | --- |")
        for model, batch, flags in (("gpt2-xl", 8, []), ("d84", 4, ["--recompute"])):
            for gpus in (64, 1024):
                fit = [r for r in plan_rows(a.chorus, a.calibration, model, gpus, batch, flags) if r["fits"]]
                best = fit[0]
                nxt = f"{fit[1]['layout']} {fit[1]['tok_per_s']:,.0f}" if len(fit) > 1 else "-"
                print(f"| {model} | {gpus} | {best['layout']} | {best['tok_per_s']:,.0f} ({100 * best['mfu']:.1f}%) | "
                      f"{best['memory_bytes'] / 2**30:.2f} | {nxt} |")


if __name__ == "__main__":
    main()
