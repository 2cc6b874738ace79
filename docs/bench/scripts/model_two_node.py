"""The cost model's prediction for the all-reduces of the emulated clusters of
docs/bench/model.md: by default docs/bench/allreduce.md's "Two nodes of two
workers" (2 nodes x 2 workers, 16 and 64 MiB), or ``--layout 2x1`` / ``4x1``
(single-worker nodes, flat schedules only) at ``--sizes-mib 4``; 200 Mbit/s
between nodes (95.6% of it TCP payload at MTU 1500), loopback inside, the
workers sharing this machine's 2 cores, with this machine's codec speeds (one
core, 1M coordinates). Both duplex factors are printed: 1 (full duplex) and 2.

    python docs/bench/scripts/model_two_node.py [--layout 2x2] [--sizes-mib 16 64]
        [--step-us 700] [--intra-gbit 10]

The step latency is what ``hopq bench allreduce`` prints ("One ring step ...
takes ... us"); the loopback's rate is an assumption of the model (it is not
shaped): 10 Gbit/s by default.
"""

import argparse

from hopq.bench.cost_model import calibrate
from hopq.comm.cost import Network, predict

CASES = [
    ("dynamiq", "ring"),
    ("dynamiq", "hier:ring"),
    ("dynamiq", "hier:butterfly"),
    ("bf16", "ring"),
    ("bf16", "hier:ring"),
    ("bf16", "hier:butterfly"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-us", type=float, default=700.0)
    ap.add_argument("--intra-gbit", type=float, default=10.0)
    ap.add_argument("--layout", default="2x2")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    a = ap.parse_args()
    nodes, per = (int(v) for v in a.layout.split("x"))
    cores = max(1, 2 // nodes)  # this machine's 2 cores, shared by the nodes' workers
    cases = (
        CASES if per > 1 else [(c, t) for c in ("dynamiq", "bf16") for t in ("ring", "butterfly")]
    )
    costs = {c: calibrate(c, 1 << 20) for c in ("dynamiq", "bf16", "fp32")}
    print("| codec | schedule | size | model, duplex 1 (ms) | model, duplex 2 (ms) |")
    print("|---|---|---|---:|---:|")
    for mib in a.sizes_mib:
        size, d = f"{mib} MiB", mib << 18
        for codec, schedule in cases:
            cells = []
            for duplex in (1.0, 2.0):
                net = Network(
                    nodes=nodes, per_node=per, inter_gbit=0.2 * 0.956, intra_gbit=a.intra_gbit,
                    inter_latency_us=a.step_us, intra_latency_us=a.step_us / 4,
                    cores_per_node=min(per, cores), duplex=duplex,
                )  # fmt: skip
                p = predict(costs[codec], schedule, net, d, exact=costs["fp32"])
                cells.append(f"{p.seconds * 1e3:.0f}")
            print(f"| {codec} | {schedule} | {size} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
