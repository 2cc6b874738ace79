"""DynamiQ's widths against the error AdamW sees: the share of super-groups
whose relative error exceeds 10%, beside vNMSE (norm-weighted). The table of
docs/bench/train.md's "DynamiQ over 200 steps" section.

    python docs/bench/scripts/dynamiq_relerr.py gpt minilm

4 workers' gradients (hopq bench vnmse's warm-up: GPT 300 AdamW steps, MiniLM
20), 1M coordinates of each, 4 ranks, ring, hopq.simulate; about 2 minutes on
2 cores. Needs the bench extra (MiniLM)."""

import sys

import torch

import hopq
from hopq.codecs.dynamiq import PAPER
from hopq.train import workloads

S = 256  # DynamiQ's super-group
CONFIGS = {
    "dynamiq default": ("dynamiq", {}),
    "dynamiq widths 4,8,16": ("dynamiq", {"widths": (4, 8, 16)}),
    "dynamiq, the paper's": ("dynamiq", PAPER),
    "mxfp4": ("mxfp4", {}),
    "equarx": ("equarx", {}),
}

torch.manual_seed(0)
for w in sys.argv[1:] or ["gpt", "minilm"]:
    wl = workloads.make(w, 0)
    if w == "minilm":
        sub, warm, batch, lr = slice(12_000_000, 13_000_000), 20, 4, 5e-5
    else:
        sub, warm, batch, lr = slice(1_100_000, 2_100_000), 300, 16, 1e-3
    xs = [g.float() for g in workloads.gradients(wl, 4, warm, batch, lr, 4, 0, 4, sub)]
    exact = sum(x.double() for x in xs)
    n = exact.numel() // S * S
    x2 = exact[:n].view(-1, S).square().sum(1)
    for name, (codec, cfg) in CONFIGS.items():
        r = hopq.simulate(xs, hopq.get_codec(codec, **cfg), "ring", seed=1)
        err = r.outputs[0].double() - exact
        e2 = err[:n].view(-1, S).square().sum(1)
        rel = e2[x2 > 0] / x2[x2 > 0]
        bits = sum(s.bits_per_coord for s in r.stats) / len(r.stats)
        print(
            f"{w:7s} {name:22s} {bits:.2f} bits  vNMSE {float(err.square().sum() / exact.square().sum()):.2e}"
            f"  super-groups with relative error > 10%: {float((rel > 0.1).float().mean()):.1%}",
            flush=True,
        )
