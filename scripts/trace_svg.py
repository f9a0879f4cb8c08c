#!/usr/bin/env python3
"""Draws a Chrome trace (chorus train|bench --trace) as an SVG timeline, the
way a trace viewer lays it out: one band per process (rank), one row per
track (thread id), nested spans stacked below their parent. For a picture in
the docs or a machine without a browser; ui.perfetto.dev opens the file itself.

    scripts/trace_svg.py trace.json out.svg [--width 1200]
"""
import argparse
import json
import zlib

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac"]


def colour(name):
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--width", type=int, default=1200)
    a = ap.parse_args()
    ev = json.load(open(a.trace))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in ev if e["ph"] == "X"]
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    label_w, row_h, top = 190, 16, 40
    scale = (a.width - label_w - 20) / (t1 - t0)

    # Depth of each span within its track: the number of open spans it starts inside.
    rows = []  # (pid, tid, depth)
    placed = []
    for key in sorted(threads):
        mine = sorted((e for e in spans if (e["pid"], e["tid"]) == key), key=lambda e: (e["ts"], -e["dur"]))
        stack, depth_max = [], 0
        for e in mine:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            placed.append((key, len(stack), e))
            depth_max = max(depth_max, len(stack))
            stack.append(e["ts"] + e["dur"])
        rows += [(key, d) for d in range(depth_max + 1)]
    y_of, y = {}, top
    out = []
    last_pid = None
    for key, d in rows:
        if key[0] != last_pid:
            out.append(f'<text x="6" y="{y + 12}" font-size="13" font-weight="bold">{esc(procs.get(key[0], str(key[0])))}</text>')
            y += 18
            last_pid = key[0]
        if d == 0:
            out.append(f'<text x="16" y="{y + 12}" font-size="11" fill="#333">{esc(threads[key])}</text>')
            out.append(f'<line x1="{label_w}" x2="{a.width - 10}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        y_of[(key, d)] = y
        y += row_h
    height = y + 30
    for key, d, e in placed:
        x = label_w + (e["ts"] - t0) * scale
        w = max(e["dur"] * scale, 0.6)
        yy = y_of[(key, d)]
        out.append(f'<rect x="{x:.1f}" y="{yy + 1}" width="{w:.1f}" height="{row_h - 2}" fill="{colour(e["name"])}">'
                   f'<title>{esc(e["name"])} {e["dur"] / 1000:.2f} ms</title></rect>')
        if w > 7 * len(e["name"]):
            out.append(f'<text x="{x + 3:.1f}" y="{yy + 12}" font-size="10" fill="white">{esc(e["name"])}</text>')
    # A time axis in milliseconds.
    span_ms = (t1 - t0) / 1000
    step = next(s for s in [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] if span_ms / s <= 12)
    ms = 0
    while ms <= span_ms:
        x = label_w + ms * 1000 * scale
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 8}" y2="{y}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{top - 12}" font-size="10" text-anchor="middle">{ms} ms</text>')
        ms += step
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{a.width}" height="{height}" '
           f'font-family="DejaVu Sans, Arial, sans-serif">', f'<rect width="100%" height="100%" fill="white"/>']
    # grid first, spans over it
    grid = [s for s in out if s.startswith("<line x1") and 'stroke="#eee"' in s or "ms</text>" in s]
    rest = [s for s in out if s not in grid]
    open(a.out, "w").write("\n".join(svg + grid + rest + ["</svg>\n"]))


if __name__ == "__main__":
    main()
