"""The two-tier all-reduce (``layout=``) beside the flat one: vNMSE and the bits
per coordinate that cross between nodes, for 8 workers as one flat group, as
2 nodes x 4 and as 4 nodes x 2, on i.i.d. standard normal vectors of 2^18
coordinates (one per worker, seed 0). The table of
docs/integrations/multinode.md's "What a two-tier call costs and gains".

    python docs/bench/scripts/two_tier.py

A flat cell's bits are the call's bits per coordinate (every hop may cross
nodes); a two-tier cell's are ``RunStats.inter_bits_per_coord`` averaged over
the ranks: the inter-node all-reduce's own, relative to an uncompressed ring
among the N nodes over the node-shard. One ``hopq.simulate`` per cell."""

import torch

import hopq

CODECS = ("dynamiq", "thc", "mxfp4", "mxfp8", "equarx", "gqsgd-exp", "gqsgd-linear", "bf16",
          "omnireduce")  # fmt: skip
CELLS = (
    ("ring", None),
    ("butterfly", None),
    ("ring", "2x4"),
    ("ring", "4x2"),
    ("butterfly", "4x2"),
)
COORDS = 1 << 18


def main() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(COORDS, generator=g) for _ in range(8)]
    head = [f"{'flat' if lay is None else lay} {topo}" for topo, lay in CELLS]
    print("| codec | " + " | ".join(head) + " |")
    print("|---" * (len(CELLS) + 1) + "|")
    for codec in CODECS:
        cells = []
        for topo, lay in CELLS:
            r = hopq.simulate(xs, codec, topo, seed=1, layout=lay)
            assert r.identical
            if lay is None:
                bits = r.bits_per_coord
            else:
                bits = sum(s.inter_bits_per_coord for s in r.stats) / len(r.stats)
            cells.append(f"{r.vnmse:.3g} ({bits:.2f} b)")
        print(f"| {codec} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
