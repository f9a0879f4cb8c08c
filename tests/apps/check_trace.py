"""Checks a Chrome trace written by chorus train|bench --trace (apps/step_trace.h):

    python3 check_trace.py FILE --ranks N --steps A-B --phases data,forward,...

- valid JSON with traceEvents; one process id per rank, named "rank N";
- every chosen step has a "step K" span on the host track (tid 0) of every
  rank, the steps in order and not overlapping;
- every named phase appears on every rank, each inside its step's span;
- per track, timestamps never go back in file order, durations are >= 0;
- each rank has kernel spans on each device's track ("cpu:0 kernels");
- the ranks' step spans line up in time (one machine, one clock).
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--steps", default="3-5")
    ap.add_argument("--phases", default="forward,backward,optimizer")
    ap.add_argument("--devices", default="cpu:0", help="devices whose kernel tracks every rank must have")
    ap.add_argument("--comm", default="", help="collectives every rank's 'gloo collectives' track must show")
    a = ap.parse_args()
    first, _, last = a.steps.partition("-")
    steps = list(range(int(first), int(last or first) + 1))
    phases = a.phases.split(",")

    doc = json.load(open(a.file))
    ev = doc["traceEvents"]
    spans = [e for e in ev if e["ph"] == "X"]
    meta = [e for e in ev if e["ph"] == "M"]
    pids = sorted({e["pid"] for e in ev})
    assert pids == list(range(a.ranks)), f"pids {pids}, want one per rank 0..{a.ranks - 1}"
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in pids}, names
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}

    last_ts = {}
    for e in spans:
        assert e["dur"] >= 0, e
        key = (e["pid"], e["tid"])
        assert e["ts"] >= last_ts.get(key, float("-inf")), f"time goes back on {key}: {e}"
        last_ts[key] = e["ts"]
        assert key in threads, f"no thread_name for {key}"

    step_start = {}
    for r in pids:
        mine = [e for e in spans if e["pid"] == r]
        host = [e for e in mine if e["tid"] == 0]
        assert threads[(r, 0)] == "host", threads[(r, 0)]
        step_spans = {e["args"]["step"]: e for e in host if e["cat"] == "step"}
        assert sorted(step_spans) == steps, f"rank {r}: steps {sorted(step_spans)}, want {steps}"
        for k in steps:
            assert step_spans[k]["name"] == f"step {k}"
        for k, k2 in zip(steps, steps[1:]):
            s, s2 = step_spans[k], step_spans[k2]
            assert s["ts"] + s["dur"] <= s2["ts"] + 1, f"rank {r}: step {k} overlaps step {k2}"
        step_start[r] = step_spans[steps[0]]["ts"]
        for p in phases:
            got = [e for e in mine if e["name"] == p and e["cat"] == "phase"]
            assert got, f"rank {r}: no '{p}' span (phases seen: {sorted({e['name'] for e in mine if e['cat'] == 'phase'})})"
            for e in got:
                s = step_spans[e["args"]["step"]]
                assert s["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1, \
                    f"rank {r}: {p} at {e['ts']} outside step {e['args']['step']}"
        kernels = [e for e in mine if e["cat"] == "kernel"]
        assert kernels, f"rank {r}: no kernel spans"
        assert all(threads[(r, e["tid"])].endswith(" kernels") for e in kernels), "kernels on a device track"
        for d in a.devices.split(","):
            assert any(threads[(r, e["tid"])] == d + " kernels" for e in kernels), f"rank {r}: no kernels on {d}"
        for op in filter(None, a.comm.split(",")):
            assert any(e["cat"] == "comm" and e["name"] == op and threads[(r, e["tid"])] == "gloo collectives"
                       for e in mine), f"rank {r}: no {op} on the gloo collectives track"
    spread = max(step_start.values()) - min(step_start.values())
    assert spread < 5e6, f"the ranks' first traced steps start {spread / 1e6:.1f} s apart"
    print(f"trace: {len(spans)} spans, {len(pids)} rank(s), steps {steps[0]}-{steps[-1]}, "
          f"phases {', '.join(phases)}; tracks: {sorted(set(threads.values()))}")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL: {e}")
        sys.exit(1)
