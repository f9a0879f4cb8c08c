#!/usr/bin/env python3
"""GPT-2 written in PyTorch, independently of Chorus, reading a Hugging Face-layout
model.safetensors (Conv1D weights [in, out]): the reference that
tests/models/gpt_test.cpp compares Chorus's logits with.

Usage: gpt2_reference.py MODEL.safetensors IDS.txt HEADS OUT.bin
IDS.txt: one line of space-separated ids per sequence. OUT.bin: the logits,
float64 [batch, seq, vocab] row-major. Runs on Debian's python3-torch (1.13,
CPU); the safetensors file is parsed here (8-byte header length, JSON, data).
"""
import json, math, struct, sys

import torch
import torch.nn.functional as F


def load_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    dtypes = {"F32": torch.float32, "F64": torch.float64}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        t = torch.frombuffer(bytearray(raw[base + a:base + b]), dtype=dtypes[info["dtype"]])
        out[name] = t.reshape(info["shape"]).double()
    return out


def gpt2_logits(w, ids, heads):
    B, T = ids.shape
    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][torch.arange(T)]
    layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("transformer.h."))
    C = x.shape[-1]
    D = C // heads
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)

    def ln(x, p):
        return F.layer_norm(x, (C,), w[p + ".weight"], w[p + ".bias"], 1e-5)

    def conv1d(x, p):  # Hugging Face's Conv1D: x @ W + b, W [in, out]
        return x @ w[p + ".weight"] + w[p + ".bias"]

    for i in range(layers):
        p = "transformer.h.%d." % i
        q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(B, T, heads, D).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + conv1d(y, p + "attn.c_proj")
        h = conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")
        x = x + conv1d(F.gelu(h, approximate="tanh"), p + "mlp.c_proj")
    x = ln(x, "transformer.ln_f")
    return x @ w["transformer.wte.weight"].t()  # tied output projection


def main():
    path, ids_path, heads, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    w = load_safetensors(path)
    ids = torch.tensor([[int(t) for t in line.split()] for line in open(ids_path) if line.strip()])
    logits = gpt2_logits(w, ids, heads)
    open(out, "wb").write(logits.contiguous().numpy().astype("<f8").tobytes())
    print("logits", tuple(logits.shape))


if __name__ == "__main__":
    main()
