"""Where a two-tier all-reduce's time goes, per rank: the head (from the call's
start to its first inter-node call), the inter-node calls together (where the
pipeline plans each piece while the previous one's payloads flow: their hops
and finish alone), the tail
(from the last inter-node call's end to the call's end) and the process's CPU
seconds, medians over the calls after two warm-up ones. The figures of
docs/bench/allreduce.md's "Two nodes of two workers". Run it once per node of
an emulated cluster:

    hopq cluster run --nodes 2 --workers-per-node 2 --rate-mbit 200 -- \\
        torchrun --nnodes {nodes} --nproc_per_node {workers_per_node} \\
        --rdzv-backend c10d --rdzv-endpoint {master}:29400 --rdzv-id t \\
        --local-addr {addr} --rdzv-conf is_host={is_host} \\
        docs/bench/scripts/two_tier_timeline.py

Environment: NUMEL (default 4194304, 16 MiB of float32), CALLS (14), LAYOUT
("auto": two-tier; "flat": one ring over every rank), PIECE_COORDS (the
pipeline's piece size, ``hierarchy.PIECE_COORDS``; default hopq's own). It times the pipeline's
pieces by wrapping a private class, so it follows hopq's internals."""

import os
import statistics
import time

import torch
import torch.distributed as dist

import hopq
from hopq.comm import hierarchy

EVENTS: list[tuple[str, float, float]] = []
T0 = [0.0]


def _timed(name: str) -> None:
    inner = getattr(hierarchy._Pipeline, name)

    def wrapper(self, j, *args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return inner(self, j, *args, **kwargs)
        finally:
            EVENTS.append((name, t - T0[0], time.perf_counter() - T0[0]))

    setattr(hierarchy._Pipeline, name, wrapper)


_timed("inter")  # a piece's inter-node call, planned in turn
_timed("run_piece")  # a piece's hops and finish, planned while the previous piece's ran
if "PIECE_COORDS" in os.environ:
    hierarchy.PIECE_COORDS = int(os.environ["PIECE_COORDS"])
dist.init_process_group("gloo")
rank = dist.get_rank()
numel = int(os.environ.get("NUMEL", 4 << 20))
layout = os.environ.get("LAYOUT", "auto")
x0 = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
rows = []
for call in range(int(os.environ.get("CALLS", 14))):
    x = x0.clone()
    dist.barrier()
    EVENTS.clear()
    T0[0], cpu = time.perf_counter(), time.process_time()
    hopq.all_reduce(x, codec="dynamiq", layout=None if layout == "flat" else layout)
    wall, cpu = time.perf_counter() - T0[0], time.process_time() - cpu
    if call >= 2:
        inter = [e for e in EVENTS if e[0] in ("inter", "run_piece")]
        head = min(e[1] for e in inter) if inter else float("nan")
        tail = wall - max(e[2] for e in inter) if inter else float("nan")
        rows.append((wall, head, sum(e[2] - e[1] for e in inter), tail, cpu))
names = ("call", "head", "inter-node calls", "tail", "process CPU")
shown = [i for i in range(len(names)) if layout != "flat" or i in (0, 4)]  # flat: no pieces
figures = [f"{names[i]} {statistics.median(r[i] for r in rows) * 1e3:.1f}" for i in shown]
pieces = len(hierarchy.tier_pieces(numel, 2)) - 1 if layout != "flat" else 1
print(
    f"rank {rank} ({layout}, {numel} entries, {pieces} pieces), median ms: {', '.join(figures)}",
    flush=True,
)
dist.destroy_process_group()
