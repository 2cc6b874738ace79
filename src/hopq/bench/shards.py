"""``hopq bench shards``: DynamiQ's error over rank shards (FSDP's reduce-scatter)
against the whole-vector DynamiQ on the same data.

A reduce-scatter over equal rank-ordered shards runs DynamiQ chunk-locally:
super-groups start at every shard and are reordered inside it, while the
statistics exchange and the bit allocation stay global (one allocation over
every super-group of every shard). Three rows per data set and world size, all
``hopq.simulate`` on the same worker tensors, DynamiQ's defaults, ring:

* ``whole vector``: the all-reduce as DDP runs it (the global sort, chunks of
  near-equal bytes);
* ``chunk-local``: the all-reduce over the chunk-local layout
  (``hopq.simulate(shards="equal")``): the same accounting as the row above,
  so the difference is what the layout itself costs;
* ``reduce-scatter``: ``hopq.simulate_reduce_scatter(shards="equal")``, what
  ``hopq.FSDPReduceScatter`` runs. Its bits per coordinate count (n-1)/n x d
  coordinates, so the statistics exchange (32 bits per super-group, an
  all-reduce either way) weighs twice as much there and DynamiQ leaves that
  much less to the payload to stay within its budget;
* ``budget per shard``: for contrast, each shard compressed by its own
  DynamiQ all-reduce with its own 5-bit budget (what a design that also
  confined the allocation to the shard would give).

vNMSE is against the exact float64 sum over all coordinates (for the
reduce-scatters: over the concatenated shards); bits per coordinate count the
bytes sent with each call's own denominator (all-reduce 2(n-1)/n d,
reduce-scatter (n-1)/n d).

Data, per worker i of n: FSDP's reduce-scatter input, i.e. every parameter's
gradient padded to a multiple of n along dim 0 and cut into n row blocks, shard
r holding the r-th block of every parameter (``fsdp`` layout; FSDP's
``chunk_cat``), or the parameters simply concatenated (``flat``: whole layers
land in different shards, the hard case for per-shard budgets).

* ``synthetic``: 48 layers of assorted shapes (855k coordinates), per-layer
  scales log-uniform over four decades, Student-t (3 degrees of freedom)
  entries, each worker the layer's shared signal plus its own noise of equal
  size;
* ``gpt``: the byte-level GPT of :mod:`hopq.train.workloads` after
  ``gpt_warmup`` AdamW steps, one micro-batch per worker.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from hopq.codecs.registry import get_codec
from hopq.options import check_int, check_scoped, option
from hopq.reporting import machine, markdown_table
from hopq.sim import simulate, simulate_reduce_scatter

DATA = ("synthetic", "gpt")
LAYOUTS = ("fsdp", "flat")


@dataclass(frozen=True)
class ShardOptions:
    data: tuple[str, ...] = option(DATA, "data sets", choices=DATA)
    layouts: tuple[str, ...] = option(LAYOUTS, "reduce-scatter input layouts", choices=LAYOUTS)
    worlds: tuple[int, ...] = option((2, 4, 8), "world sizes")
    gpt_warmup: int = option(50, "AdamW steps before the GPT's gradients are taken")
    seed: int = option(0, "seed of the data and the codec")

    def __post_init__(self) -> None:
        for n in self.worlds:
            check_int("worlds", n, lo=1, hi=64)
        check_int("gpt_warmup", self.gpt_warmup, lo=0)
        for d in self.data:
            if d not in DATA:
                raise ValueError(f"unknown data {d!r}; choose from {DATA}")
        for lay in self.layouts:
            if lay not in LAYOUTS:
                raise ValueError(f"unknown layout {lay!r}; choose from {LAYOUTS}")
        check_scoped(self, {"gpt_warmup": ("gpt",)}, self.data, "--data")


def synthetic_layers(workers: int, seed: int) -> list[list[torch.Tensor]]:
    """Per worker, 48 gradient-like tensors (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    shapes = []
    for k in range(16):  # blocks of a small transformer-like stack
        w = int(torch.randint(96, 257, (1,), generator=g))
        shapes += [(w, 128), (w,), (128, w) if k % 2 else (3 * w, 64)]
    signal, scales = [], []
    t = torch.distributions.StudentT(3.0)
    for s in shapes:
        torch.manual_seed(int(torch.randint(0, 1 << 30, (1,), generator=g)))
        scales.append(10 ** float(torch.empty(1).uniform_(-4, 0, generator=g)))
        signal.append(t.sample(s))
    out = []
    for i in range(workers):
        torch.manual_seed(seed * 7919 + i + 1)
        out.append(
            [sc * (sig + t.sample(sig.shape)) for sig, sc in zip(signal, scales, strict=True)]
        )
    return out


def gpt_layers(workers: int, warmup: int, seed: int) -> tuple[list[list[torch.Tensor]], str]:
    from hopq.train import workloads

    wl = workloads.make("gpt", seed)
    shapes = [p.shape for p in wl.model.parameters()]
    flats = workloads.gradients(wl, workers, warmup, 16, 1e-3, 4, seed)
    out = []
    for f in flats:
        parts = torch.split(f, [s.numel() for s in shapes])
        out.append([p.view(s) for p, s in zip(parts, shapes, strict=True)])
    return out, wl.description


def fsdp_input(layers: list[torch.Tensor], n: int) -> torch.Tensor:
    """FSDP2's reduce-scatter input: each tensor padded along dim 0 to a multiple
    of n and cut into n row blocks; block r of every tensor, in order, is shard r."""
    blocks: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for t in layers:
        t2 = t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1)
        rows = -(-t2.shape[0] // n) * n
        padded = torch.zeros(rows, t2.shape[1], dtype=t2.dtype)
        padded[: t2.shape[0]] = t2
        for r, b in enumerate(padded.chunk(n)):
            blocks[r].append(b.reshape(-1))
    return torch.cat([torch.cat(b) for b in blocks])


HEADER = ["data, layout", "n", "coordinates", "DynamiQ", "bits/coord", "vNMSE"]


def _fmt(v: float) -> str:
    return f"{v:.3e}"


def run(o: ShardOptions) -> str:
    nmax = max(o.worlds)
    sets: dict[str, tuple[list[list[torch.Tensor]], str]] = {}
    for d in o.data:
        print(f"collecting {nmax} workers' gradients for {d} ...", file=sys.stderr, flush=True)
        if d == "synthetic":
            sets[d] = (synthetic_layers(nmax, o.seed), "synthetic (see the command's docstring)")
        else:
            layers, desc = gpt_layers(nmax, o.gpt_warmup, o.seed)
            sets[d] = (layers, f"{desc}; gradients after {o.gpt_warmup} AdamW steps")
    rows = []
    for d, (layers, _) in sets.items():
        for lay in o.layouts:
            for n in o.worlds:
                if lay == "fsdp":
                    xs = [fsdp_input(w, n) for w in layers[:n]]
                else:
                    xs = [torch.cat([t.reshape(-1) for t in w]) for w in layers[:n]]
                whole = simulate(xs, get_codec("dynamiq"), "ring", seed=o.seed, op="avg")
                local = simulate(
                    xs, get_codec("dynamiq"), "ring", seed=o.seed, op="avg", shards="equal"
                )
                rs = simulate_reduce_scatter(
                    xs, get_codec("dynamiq"), "ring", seed=o.seed, op="avg"
                )
                # each shard by its own DynamiQ (its own budget)
                err = ref = sent = moved = 0.0
                exact = torch.stack([x.double() for x in xs]).mean(0)
                for r in range(n):
                    a, b = rs.shards[r], rs.shards[r + 1]
                    part = simulate(
                        [x[a:b] for x in xs], get_codec("dynamiq"), "ring", seed=o.seed, op="avg"
                    )
                    err += float((part.outputs[0].double() - exact[a:b]).square().sum())
                    ref += float(exact[a:b].square().sum())
                    sent += sum(part.bytes_sent) / n
                    moved += 2 * (n - 1) / n * (b - a)
                per = err / ref if ref else 0.0
                label = f"{d}, {lay}"
                d_all = xs[0].numel()
                bits = 8 * sent / moved if moved else 0.0
                for what, bpc, v in (
                    ("whole vector", whole.bits_per_coord, whole.vnmse),
                    ("chunk-local", local.bits_per_coord, local.vnmse),
                    ("reduce-scatter", rs.bits_per_coord, rs.vnmse),
                    ("budget per shard", bits, per),
                ):
                    rows.append([label, n, d_all, what, f"{bpc:.3f}", _fmt(v)])
                print(markdown_table(HEADER, rows[-4:]), file=sys.stderr, flush=True)
    head = [f"Machine: {machine()}", ""]
    head += [f"- **{d}**: {desc}" for d, (_, desc) in sets.items()]
    table = markdown_table(HEADER, rows)
    return "\n".join([*head, "", table, ""])
