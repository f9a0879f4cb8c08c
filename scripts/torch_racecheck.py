"""PyTorch's own convolutions under compute-sanitizer racecheck.

Run as `compute-sanitizer --tool racecheck --racecheck-report hazard python3
scripts/torch_racecheck.py [CASES]`: the backward-data convolutions of the
shapes Chorus's graph tests and Wide ResNet use, fp32 and bf16, NCHW and
channels-last, with cuDNN's benchmark mode on (so the candidate kernels run
too) unless TORCH_RACE_BENCHMARK=0. If racecheck names the same cuDNN kernel here as under Chorus's tests,
the hazard is in cuDNN's kernel, whoever calls it. CASES: comma-separated
indices into the list printed first (racecheck is slow); default all.
"""
import os
import sys

import torch

# TORCH_RACE_BENCHMARK=0: cuDNN's heuristics' first choice only (PyTorch's default).
torch.backends.cudnn.benchmark = os.environ.get("TORCH_RACE_BENCHMARK", "1") != "0"
# (batch, in channels, out channels, size, stride[, kernel size, default 3]); the last four are the
# stride-2 convolutions (3x3 and the 1x1 shortcut) of the wrn-10-2 the batch-norm chain test runs.
shapes = [(16, 8, 8, 16, 1), (8, 160, 320, 32, 2), (8, 320, 640, 16, 2), (8, 64, 64, 32, 1),
          (8, 32, 64, 16, 2), (8, 32, 64, 16, 2, 1), (8, 64, 128, 8, 2), (8, 64, 128, 8, 2, 1)]
cases = [(dtype, cl, shape) for shape in shapes for cl in (False, True) for dtype in (torch.float32, torch.bfloat16)]
shape_of = lambda shape: (*shape, 3) if len(shape) == 5 else shape
for i, (dtype, cl, shape) in enumerate(cases):
    n, ci, co, s, stride, k = shape_of(shape)
    print(f"torch_racecheck case {i}: {dtype} {'channels-last' if cl else 'NCHW'} n={n} {ci}->{co} {s}x{s} {k}x{k} stride {stride}")
chosen = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else range(len(cases))
fmt = lambda cl: torch.channels_last if cl else torch.contiguous_format
for i in chosen:
    dtype, cl, shape = cases[i]
    n, ci, co, s, stride, k = shape_of(shape)
    x = torch.randn(n, ci, s, s, device="cuda", dtype=dtype).to(memory_format=fmt(cl)).requires_grad_()
    conv = torch.nn.Conv2d(ci, co, k, stride=stride, padding=k // 2, bias=False).cuda().to(dtype).to(memory_format=fmt(cl))
    y = conv(x)
    y.backward(torch.randn_like(y))
    torch.cuda.synchronize()
    print(f"torch_racecheck: ran case {i}: grad norm {x.grad.float().norm().item():.3f}", flush=True)
print("torch_racecheck: done", file=sys.stderr)
