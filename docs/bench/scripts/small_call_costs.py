"""Where a small all-reduce's time goes on one machine: a hopq call beside the
bare messages of the same pattern and beside what torch's fp16 hook does, each
timed on rank 0 as wall-clock and as the calling thread's CPU, with the median
cost of posting one receive and one send (the Gloo group's ``recv`` and ``send``,
which return once the operation is queued). The figures of
docs/bench/allreduce.md's "hopq's bf16 beside torch's fp16 hook". Run it with
torchrun on one machine:

    torchrun --nproc_per_node 2 docs/bench/scripts/small_call_costs.py

Environment: NUMEL (default 256 coordinates: 1 KiB of float32), TOPOLOGY
(direct), CALLS (1000, after 50 warm-up ones), BUSY_US (300: the pause of
busy Python before each post in the last row, which keeps every process's
main thread on a core as a hopq call's Python does).

The bare pattern is two rounds of one receive and one send with every peer:
a direct all-reduce's messages (on 2 ranks a ring's too)."""

import os
import statistics
import time

import torch
import torch.distributed as dist

import hopq

POSTS: dict[str, list[float]] = {"irecv": [], "isend": []}


def _timed_posts() -> None:
    """Wrap the process group's own ``recv`` and ``send`` (which hopq's transport
    calls, and torch.distributed's ``irecv`` and ``isend`` behind their checks)
    to record each post's wall-clock seconds."""
    for name, method in (("irecv", "recv"), ("isend", "send")):
        inner = getattr(dist.ProcessGroup, method)

        def wrapper(*args, _inner=inner, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                POSTS[_name].append(time.perf_counter() - t)

        setattr(dist.ProcessGroup, method, wrapper)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    _timed_posts()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    numel = int(os.environ.get("NUMEL", 256))
    topology = os.environ.get("TOPOLOGY", "direct")
    calls = int(os.environ.get("CALLS", 1000))
    busy = float(os.environ.get("BUSY_US", 300)) * 1e-6
    x0 = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    peers = [q for q in range(n) if q != rank]
    inbox = {q: torch.empty(numel * 2 + 256, dtype=torch.uint8) for q in peers}
    outbox = torch.ones(numel * 2 // n + 64, dtype=torch.uint8)

    def bare(pause: float) -> None:
        for _ in range(2):
            works = []
            for q in peers:
                _busy(pause)
                works.append(dist.irecv(inbox[q], q))
                _busy(pause)
                works.append(dist.isend(outbox, q))
            for w in works:
                w.wait()

    def hopq_call() -> None:
        hopq.all_reduce(x0.clone(), codec="bf16", topology=topology)

    def fp16_hook() -> None:
        x = x0.clone()
        h = x.div(n).half()
        dist.all_reduce(h)
        x.copy_(h)

    rows = [
        ("bare messages", lambda: bare(0.0)),
        (f"hopq bf16, {topology}", hopq_call),
        ("torch's fp16 hook", fp16_hook),
        (f"bare messages, {busy * 1e6:.0f} us of Python before each post", lambda: bare(busy)),
    ]
    out = []
    for label, fn in rows:
        for _ in range(50):
            fn()
        for v in POSTS.values():
            v.clear()
        wall, cpu = [], []
        for _ in range(calls):
            dist.barrier()
            t, c = time.perf_counter(), time.thread_time()
            fn()
            wall.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
        posts = {k: statistics.median(v) * 1e6 if v else float("nan") for k, v in POSTS.items()}
        out.append((label, statistics.median(wall), statistics.median(cpu), posts))
    if rank == 0:
        print(f"{n} ranks, {numel} coordinates, medians of {calls} calls (rank 0)")
        print("| | wall (ms) | thread CPU (ms) | one irecv post (us) | one isend post (us) |")
        print("|---|---:|---:|---:|---:|")
        for label, w, c, p in out:
            posts = " | ".join("" if v != v else f"{v:.0f}" for v in p.values())
            print(f"| {label} | {w * 1e3:.2f} | {c * 1e3:.2f} | {posts} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
