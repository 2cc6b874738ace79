"""The one-shot ``direct`` schedule beside ring, butterfly and tree: vNMSE, bits
per coordinate, the longest compression chain and the simulator's seconds per
call, for a few codecs at n = 4, 8, 16. The table of docs/bench/vnmse.md's
"The direct schedule" section.

    python docs/bench/scripts/direct_schedule.py gauss gpt

``gauss``: i.i.d. standard normal vectors, one per worker. ``gpt``: the GPT's
gradients as ``hopq bench vnmse`` takes them (300 AdamW steps, then one
micro-batch of 4 sequences per worker, the 1M coordinates in the middle of the
model). One ``hopq.simulate`` per cell (seed 0, after the codec's warm-up
rounds); the seconds are the simulator's wall clock for all n virtual ranks
on one process, a rough figure only."""

import sys
import time

import torch

import hopq
from hopq.comm.topology import get_schedule
from hopq.train import workloads

CODECS = ("dynamiq", "mxfp8", "equarx", "bf16", "thc", "gqsgd-exp")
TOPOLOGIES = ("ring", "butterfly", "tree", "direct")
WORLDS = (4, 8, 16)
COORDS = 1 << 20


def inputs(data: str, n: int) -> list[torch.Tensor]:
    if data == "gauss":
        g = torch.Generator().manual_seed(n)
        return [torch.randn(COORDS, generator=g) for _ in range(n)]
    wl = workloads.make(data, 0)
    start = (3_200_000 - COORDS) // 2
    sub = slice(start, start + COORDS)
    grads = workloads.gradients(wl, n, 300, 16, 1e-3, 4, 0, 0, sub)
    return [g.float() for g in grads]


def main(datas: list[str]) -> None:
    torch.manual_seed(0)
    for data in datas:
        cache = {}
        if data != "gauss":  # one warm-up, the largest world: the others are its first n
            every = inputs(data, max(WORLDS))
            cache = {n: every[:n] for n in WORLDS}
        print(f"\n{data}, {COORDS:,} coordinates per worker: vNMSE\n")
        print("| codec | bits | n | " + " | ".join(TOPOLOGIES) + " |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in TOPOLOGIES) + " |")
        seconds = dict.fromkeys(TOPOLOGIES, 0.0)
        for codec in CODECS:
            for n in WORLDS:
                xs = cache[n] if n in cache else inputs(data, n)
                cells, bits = [], set()
                for topo in TOPOLOGIES:
                    c = hopq.get_codec(codec)
                    for k in range(c.warmup_rounds):
                        hopq.simulate(xs, c, topo, seed=1 + k)
                    t0 = time.perf_counter()
                    r = hopq.simulate(xs, c, topo, seed=0)
                    seconds[topo] += time.perf_counter() - t0
                    cells.append(f"{r.vnmse:.3g}")
                    bits.add(f"{r.bits_per_coord:.2f}")
                print(f"| {codec} | {'/'.join(sorted(bits))} | {n} | " + " | ".join(cells) + " |")
        for n in WORLDS:
            chains = [str(max(get_schedule(t, n).compression_chains())) for t in TOPOLOGIES]
            print(f"| longest chain | | {n} | " + " | ".join(chains) + " |")
        calls = len(CODECS) * len(WORLDS)
        print(
            "\nsimulator seconds per call, mean over the table: "
            + ", ".join(f"{t} {seconds[t] / calls:.2f}" for t in TOPOLOGIES),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:] or ["gauss", "gpt"])
