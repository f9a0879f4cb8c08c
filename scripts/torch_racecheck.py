"""PyTorch's own convolutions under compute-sanitizer racecheck.

Run as `compute-sanitizer --tool racecheck --racecheck-report hazard python3
scripts/torch_racecheck.py`: the backward-data convolutions of the shapes
Chorus's graph tests and Wide ResNet use, fp32 and bf16 channels-last, with
cuDNN's benchmark mode on (so the candidate kernels run too). If racecheck
names the same cuDNN kernel here as under Chorus's tests, the hazard is in
cuDNN's kernel, whoever calls it.
"""
import sys

import torch

torch.backends.cudnn.benchmark = True
# (batch, in channels, out channels, size, stride)
shapes = [(16, 8, 8, 16, 1), (8, 160, 320, 32, 2), (8, 320, 640, 16, 2), (8, 64, 64, 32, 1)]
# argv[1]: how many of the (dtype, shape) cases to run (racecheck is slow).
cases = [(dtype, shape) for shape in shapes for dtype in (torch.float32, torch.bfloat16)]
for dtype, (n, ci, co, s, stride) in cases[: int(sys.argv[1]) if len(sys.argv) > 1 else None]:
    x = torch.randn(n, ci, s, s, device="cuda", dtype=dtype).to(memory_format=torch.channels_last).requires_grad_()
    conv = torch.nn.Conv2d(ci, co, 3, stride=stride, padding=1, bias=False).cuda().to(dtype)
    conv = conv.to(memory_format=torch.channels_last)
    y = conv(x)
    y.backward(torch.randn_like(y))
    torch.cuda.synchronize()
    print(f"torch_racecheck: {dtype} n={n} {ci}->{co} {s}x{s} stride {stride}: grad norm "
          f"{x.grad.float().norm().item():.3f}", flush=True)
print("torch_racecheck: done", file=sys.stderr)
