"""Runs ../shared/bench/torch_baseline.py (copied to .bench/) in this process and
adds PyTorch's peak device memory (torch.cuda.max_memory_allocated) to its JSON
line, so Chorus's peak_mem_bytes can be compared in the same run."""
import contextlib, io, json, os, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".bench"))
import torch  # noqa: E402
import torch_baseline  # noqa: E402

buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    torch_baseline.main()
for line in buf.getvalue().splitlines():
    if line.startswith("{"):
        row = json.loads(line)
        row["torch"] = 1
        if row.get("mode") != "ddp":
            row["peak_mem_bytes"] = max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
        print(json.dumps(row), flush=True)
