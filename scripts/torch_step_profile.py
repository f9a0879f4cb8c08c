"""PyTorch's training step of ../shared/bench/torch_baseline.py (copied to
.bench/), between torch.cuda.profiler.start() and stop(), for
`ncu --profile-from-start off` (scripts/ncu_step.py sums it).

    python3 scripts/torch_step_profile.py MODEL PRECISION CHANNELS_LAST COMPILE STEPS"""
import os, sys, types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".bench"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_baseline  # noqa: E402

model, precision, cl, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4], int(sys.argv[5])
args = types.SimpleNamespace(model=model, channels_last=cl)
dev = torch.device("cuda", 0)
torch.backends.cudnn.benchmark = True
m = torch_baseline.make(args, dev)
if mode != "eager":
    m = torch.compile(m, mode=None if mode == "default" else mode)
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
x = torch.randn(128, 3, 32, 32, device=dev)
if cl:
    x = x.to(memory_format=torch.channels_last)
y = torch.randint(0, 10, (128,), device=dev)


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = F.cross_entropy(m(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


for _ in range(8):
    step()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for _ in range(steps):
    step()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print(f"profiled {steps} steps of {model} {precision} channels_last={cl} {mode}")
