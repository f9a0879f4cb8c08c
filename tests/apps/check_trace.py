"""Checks a Chrome trace written by chorus train|bench --trace (apps/step_trace.h):

    python3 check_trace.py FILE --ranks N --steps A-B --phases data,forward,...

- valid JSON with traceEvents; one process id per rank, named "rank N";
- every chosen step has a "step K" span on the host track (tid 0) of every
  rank, the steps in order and not overlapping;
- every named phase appears on every rank, each inside its step's span;
- per track, timestamps never go back in file order, durations are >= 0;
- each rank has kernel spans on each device's track ("cpu:0 kernels", or
  on GPUs "cuda:0 kernel launches"; "{rank}" in --devices is the rank);
- the ranks' step spans line up in time (one machine, one clock);
- --comm OPS: each rank's --comm-track ("gloo collectives"; a device mesh's
  groups have their own: "gloo tp collectives") shows each collective;
  --host-comm OPS: each rank's host tracks show each point-to-point wait
  ("send", "recv": a pipeline stage), the main thread's inside its phases;
- with --gpu (Note [Device tracks] in src/chorus/ops/device_trace.h): per
  rank, GPU kernels on each device's "compute stream" track (or its "(CUDA
  graph)" replays), NCCL kernels on
  some track, copies on a "copies" track, all within the traced steps' time
  (the CUPTI clock's offset applied); prints spans and busy time per track
  and the devices' kernel time per step.
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
    ap.add_argument("--comm", default="", help="collectives every rank's --comm-track must show")
    ap.add_argument("--comm-track", default="gloo collectives",
                    help="their track: a device mesh's groups have their own, e.g. 'gloo tp collectives'")
    ap.add_argument("--host-comm", default="",
                    help="point-to-point waits (send, recv) every rank's host tracks must show")
    ap.add_argument("--gpu", action="store_true", help="require the device tracks (CUPTI) and summarise them")
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
        assert all(threads[(r, e["tid"])].endswith((" kernels", " kernel launches")) for e in kernels), \
            "kernels on a device track"
        for d in a.devices.format(rank=r).split(","):
            assert any(threads[(r, e["tid"])] in (d + " kernels", d + " kernel launches") for e in kernels), \
                f"rank {r}: no kernels on {d}"
        if a.gpu:
            device_tracks(r, mine, threads, step_spans, steps, a.devices.format(rank=r).split(","))
        for op in filter(None, a.comm.split(",")):
            assert any(e["cat"] == "comm" and e["name"] == op and threads[(r, e["tid"])] == a.comm_track
                       for e in mine), f"rank {r}: no {op} on the {a.comm_track} track " \
                f"(tracks: {sorted({threads[(r, e['tid'])] for e in mine if e['cat'] == 'comm'})})"
        phase_spans = [e for e in host if e["cat"] == "phase"]
        for op in filter(None, a.host_comm.split(",")):
            got = [e for e in mine if e["cat"] == "comm" and e["name"] == op and threads[(r, e["tid"])].startswith("host")]
            assert got, f"rank {r}: no '{op}' wait on a host track"
            for e in got:  # the main thread's inside its phases (a helper thread of the pipeline keeps its own time)
                assert e["tid"] != 0 or any(p["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"] + 1
                                            for p in phase_spans), f"rank {r}: the {op} wait at {e['ts']} is inside no phase"
    spread = max(step_start.values()) - min(step_start.values())
    assert spread < 5e6, f"the ranks' first traced steps start {spread / 1e6:.1f} s apart"
    print(f"trace: {len(spans)} spans, {len(pids)} rank(s), steps {steps[0]}-{steps[-1]}, "
          f"phases {', '.join(phases)}; tracks: {sorted(set(threads.values()))}")


def device_tracks(r, mine, threads, step_spans, steps, devices):
    dev = [e for e in mine if e["cat"].startswith("gpu_")]
    track = lambda e: threads[(r, e["tid"])]
    for d in devices:
        # "cuda:0 compute stream", or "... (CUDA graph)" for a graphed step's replays
        assert any(e["cat"] == "gpu_kernel" and track(e).startswith(d + " compute stream") for e in dev), \
            f"rank {r}: no GPU kernels on '{d} compute stream' (tracks: {sorted({track(e) for e in dev})})"
        assert any(e["cat"] == "gpu_copy" and track(e) == d + " copies" for e in dev), f"rank {r}: no '{d} copies' track"
    nccl = [e for e in dev if e["cat"] == "gpu_comm"]
    assert nccl, f"rank {r}: no NCCL kernels on any device track"
    assert all(e["name"].startswith("nccl") for e in nccl), "gpu_comm spans are NCCL kernels"
    # The clocks: every device span within the traced steps (the GPU may run
    # a step's kernels after its host span ends, not seconds after).
    t0 = step_spans[steps[0]]["ts"] - 1e6
    t1 = step_spans[steps[-1]]["ts"] + step_spans[steps[-1]]["dur"] + 5e6
    bad = [e for e in dev if not (t0 <= e["ts"] and e["ts"] + e["dur"] <= t1)]
    assert not bad, f"rank {r}: {len(bad)} device spans outside the traced steps, e.g. {bad[0]} (steps {t0}-{t1})"
    print(f"rank {r} device tracks:")
    for name in sorted({track(e) for e in dev}):
        on = [e for e in dev if track(e) == name]
        kinds = sorted({e["cat"] for e in on})
        print(f"  {name:28} {len(on):6d} spans {sum(e['dur'] for e in on) / 1e3:9.2f} ms busy  ({', '.join(kinds)})")
    kern = sum(e["dur"] for e in dev if e["cat"] == "gpu_kernel")
    comm = sum(e["dur"] for e in nccl)
    host = sum(step_spans[k]["dur"] for k in steps)
    print(f"  per step: {kern / 1e3 / len(steps):.2f} ms of compute kernels, {comm / 1e3 / len(steps):.2f} ms of NCCL "
          f"kernels, host step {host / 1e3 / len(steps):.2f} ms; NCCL kernels on {sorted({track(e) for e in nccl})}")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL: {e}")
        sys.exit(1)
