#!/usr/bin/env python3
"""Fails when an #include in src/chorus/<layer>/ reaches a layer that DESIGN.md's
layer table does not let it use ("may use", closed transitively: a layer may use
what the layers it uses may use). Run by ctest as `layers.check`.

Usage: check_layers.py [SRC_ROOT]   (default: src/chorus beside this script)
"""
import pathlib
import re
import sys

# DESIGN.md, "Layers": folder -> the folders it may use directly.
MAY_USE = {
    "core": [],
    "cpu": ["core"],
    "cuda": ["core"],
    "ops": ["core", "cpu", "cuda"],
    "autograd": ["core", "ops"],
    "nn": ["ops", "autograd"],
    # DESIGN.md says "ops"; updates run under NoGradGuard, so autograd too.
    "optim": ["ops", "autograd"],
    "parallel": ["nn", "autograd", "distributed", "data_parallel"],
    # The multi-process runtime (issue 46): stores, rendezvous, launch
    # environment, process groups over Gloo and NCCL. It moves tensors, so it
    # uses ops (and through ops, cuda); it knows nothing of modules or autograd.
    "distributed": ["core", "ops"],
    # The gradient wing (issue 46): bucket plan, reducer engine, comm hooks;
    # DDP, ZeRO (sharded), SyncBatchNorm, the memory plan. Training wrappers
    # over modules and autograd, communicating through distributed's groups.
    "data_parallel": ["nn", "autograd", "distributed"],
    "data": ["core", "ops"],
    "io": ["core", "nn", "optim"],
    "models": ["nn"],
    # Tensor parallelism (issue 50): parallel layers and the tensor-parallel
    # GPT, built from nn's layers, distributed's process groups and models' GPT.
    "tensor_parallel": ["nn", "autograd", "distributed", "models"],
    # The layout planner (issue 50, `chorus plan`): a cost model over models'
    # GPT counts and data_parallel's memory plan, calibrated by timing the real
    # ops (models, nn, optim) -- graphed steps through parallel's GraphedStep,
    # as chorus train replays them -- and writing its file through io.
    "plan": ["models", "data_parallel", "parallel", "optim", "io"],
}


def closure(layer, seen=None):
    seen = set() if seen is None else seen
    for dep in MAY_USE[layer]:
        if dep not in seen:
            seen.add(dep)
            closure(dep, seen)
    return seen


INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]chorus/([a-z_]+)/')
# A relative include that leaves its folder ("../nn/module.h") would slip past
# the check above: across folders, includes are spelled chorus/<layer>/...
RELATIVE_UP = re.compile(r'^\s*#\s*include\s*"[^"]*\.\./')


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent / "src" / "chorus")
    allowed = {layer: closure(layer) | {layer} for layer in MAY_USE}
    problems = []
    files = 0
    for path in sorted(root.rglob("*")):
        if path.suffix not in {".h", ".cpp", ".cu", ".cuh"} or path.parent == root:
            continue  # chorus/chorus.h, the umbrella header, may include everything
        layer = path.relative_to(root).parts[0]
        if layer not in MAY_USE:
            problems.append(f"{path}: folder '{layer}' is not in DESIGN.md's layer table")
            continue
        files += 1
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if RELATIVE_UP.match(line):
                problems.append(f"{path}:{n}: relative include out of '{layer}/' "
                                f"(write it as chorus/<layer>/..., which this check can see)")
                continue
            m = INCLUDE.match(line)
            if m and m.group(1) not in allowed[layer]:
                problems.append(f"{path}:{n}: layer '{layer}' includes chorus/{m.group(1)}/ "
                                f"(it may use: {', '.join(sorted(allowed[layer] - {layer})) or 'nothing'})")
    for p in problems:
        print(p)
    print(f"check_layers: {files} files, {len(problems)} upward includes")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
