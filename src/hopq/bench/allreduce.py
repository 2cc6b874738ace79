"""``hopq bench allreduce``: nccl-tests style timings of hopq's all-reduce
against ``torch.distributed.all_reduce`` measured in the same run: on the
float32 tensor, and as torch's ``fp16_compress_hook`` does it (cast to float16
divided by n, all-reduce, cast back into the float32 tensor), the same bytes
on the wire as hopq's bf16.

algbw = size / time, busbw = algbw x 2(n-1)/n (nccl-tests conventions), with
size the bytes of the caller's float32 tensor. Each timing is the median over
iterations of the slowest rank's time.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hopq.cluster.launch import run_workers
from hopq.cluster.network import CONGESTION, check_congestion, check_mtu, check_nodes
from hopq.codecs.registry import codec_choices, get_codec, resolve_codecs
from hopq.comm.collectives import all_reduce
from hopq.comm.engine import RunStats
from hopq.comm.layout import resolve_spec
from hopq.comm.topology import TOPOLOGIES, get_schedule
from hopq.options import changed_options, option
from hopq.reporting import human_bytes, machine, markdown_table

NATIVE = "torch.distributed"
#: torch's fp16 hook's all-reduce of a bucket: what a PyTorch user who compresses
#: at all already has.
NATIVE_FP16 = "torch.distributed/fp16"
NATIVES = (NATIVE, NATIVE_FP16)
#: (method, size) -> seconds, ("step", 0) -> seconds, (method, size, "bytes" | "codec")
Results = dict[tuple[Any, ...], float]


@dataclass(frozen=True)
class Options:
    world_size: int = option(4, "Gloo ranks on this machine")
    min_bytes: int = option(1 << 10, "smallest tensor, bytes of float32")
    max_bytes: int = option(64 << 20, "largest tensor (sizes grow 4x)")
    codecs: tuple[str, ...] = option(
        ("auto",),
        "codecs to time; auto: all but fp32/fp16; all: every codec",
        choices=codec_choices,
    )
    topologies: tuple[str, ...] = option(
        ("ring", "butterfly"),
        "schedules to time; hier:<schedule>: hopq's two-tier all-reduce with that schedule "
        "between nodes (the layout from --layout, else the emulated nodes')",
        choices=lambda: sorted(TOPOLOGIES) + [f"hier:{t}" for t in sorted(TOPOLOGIES)],
    )
    budget_s: float = option(0.6, "rough seconds per (method, size); sets the iteration count")
    rate_mbit: float = option(
        0.0, "per-worker link of an emulated network in Mbit/s; 0: plain loopback"
    )
    mtu: int = option(
        1500, "the emulated links' MTU (9000: jumbo frames, fewer header bytes per payload byte)"
    )
    tcp_congestion: str = option(
        CONGESTION,
        "TCP congestion control in the emulated network's namespaces (reno: the link "
        "is the only limit; bbr: the host's default here, whose probing slows some calls)",
    )
    nodes: int = option(
        0,
        "nodes of the emulated network (with --rate-mbit): --world-size becomes "
        "nodes x --workers-per-node; 0: world size / workers per node",
    )
    workers_per_node: int = option(
        1,
        "workers sharing each emulated node: they talk over its loopback, and only "
        "traffic between nodes crosses the --rate-mbit link (one per node)",
    )
    intra_rate_mbit: float = option(
        0.0,
        "rate of each emulated node's loopback in Mbit/s (all traffic between its "
        "workers together); 0: unshaped",
    )
    layout: str = option(
        "",
        "hopq's two-tier all-reduce: auto (the workers' torchrun-style LOCAL_WORLD_SIZE "
        "and GROUP_RANK, which the emulated nodes set) or NxG; empty: one flat schedule",
    )
    agreement_cost: bool = option(
        False,
        "instead: time every codec without the agreement, with its round in every call "
        "and once per signature, beside torch's fp16 hook, interleaved",
    )
    microshards: tuple[int, ...] = option(
        (0,),
        "messages per schedule chunk and step (the pipeline's depth); 0: the engine's "
        "choice by size; several: each is timed as its own method",
    )

    def __post_init__(self) -> None:
        n = check_nodes(
            self.world_size, "world_size" in changed_options(self), self.nodes,
            self.workers_per_node, self.intra_rate_mbit,
        )  # fmt: skip
        object.__setattr__(self, "world_size", n)
        if self.world_size < 1 or self.min_bytes < 4 or self.max_bytes < self.min_bytes:
            raise ValueError("need world_size >= 1 and 4 <= min_bytes <= max_bytes")
        if self.rate_mbit <= 0 and (
            self.nodes or self.workers_per_node > 1 or self.intra_rate_mbit
        ):
            raise ValueError(
                "--nodes, --workers-per-node and --intra-rate-mbit shape the emulated "
                "network: give --rate-mbit too"
            )
        if self.layout:
            resolve_spec(self.layout)
        for t in self.topologies:
            get_schedule(t.removeprefix(HIER), 1)
        if any(t.startswith(HIER) for t in self.topologies) and not (
            self.layout or self.workers_per_node > 1
        ):
            raise ValueError(
                "hier: schedules need nodes of several workers: give --workers-per-node "
                "(with --rate-mbit) or --layout"
            )
        self.resolved_codecs()
        check_mtu(self.mtu)
        if self.mtu != 1500 and self.rate_mbit <= 0:
            raise ValueError("--mtu sets the emulated network's links: give --rate-mbit too")
        check_congestion(self.tcp_congestion)
        if self.tcp_congestion != CONGESTION and self.rate_mbit <= 0:
            raise ValueError(
                "--tcp-congestion sets the emulated network's TCP: give --rate-mbit too"
            )
        if not self.microshards or any(u < 0 or u > 64 for u in self.microshards):
            raise ValueError("--microshards: counts from 1 to 64, or 0 for the engine's choice")

    def methods(self) -> list[str]:
        """torch's two and every codec/topology[/u<microshards>] to time."""
        return [NATIVE, NATIVE_FP16] + [
            f"{c}/{t}" + (f"/u{u}" if u else "")
            for c in self.resolved_codecs()
            for t in self.topologies
            for u in self.microshards
        ]

    def resolved_codecs(self) -> list[str]:
        return resolve_codecs(self.codecs)


def _sizes(o: Options) -> list[int]:
    out, s = [], o.min_bytes
    while s <= o.max_bytes:
        out.append(s)
        s *= 4
    return out


#: The prefix of a schedule that runs hopq's two-tier all-reduce.
HIER = "hier:"


def _schedule(method: str, o: Options) -> tuple[str, str | None]:
    """(topology, layout) of a hopq method ``codec/topology[/u<m>]``."""
    t = method.split("/")[1]
    if t.startswith(HIER):
        return t.removeprefix(HIER), o.layout or "auto"
    return t, o.layout or None


def _microshards(method: str) -> int | None:
    """The microshard count a method names (``codec/topology/u4``), or None: auto."""
    parts = method.split("/")
    return int(parts[2][1:]) if len(parts) > 2 else None


def _time(
    fn: Callable[[], object], iters: int, reset: Callable[[], object] | None = None
) -> list[float]:
    """Seconds of each of ``iters`` calls (the slowest rank's); ``reset`` runs
    untimed before each."""
    times = []
    for _ in range(iters):
        if reset is not None:
            reset()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time per iteration
    return t.tolist()


def _step_latency(rank: int, n: int) -> float:
    """Median time of one ring step (send 4 bytes to the next rank, receive from the
    previous): the floor of a schedule with 2(n-1) sequential steps."""
    s, r = torch.zeros(1), torch.empty(1)
    nxt, prv = (rank + 1) % n, (rank - 1) % n

    def step() -> None:
        ops = [dist.P2POp(dist.isend, s, nxt), dist.P2POp(dist.irecv, r, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    for _ in range(5):
        step()
    return statistics.median(_time(step, 100))


#: The agreement variants ``--agreement-cost`` times, in alternation: none at all
#: (unsafe, the floor), a round in every call, and a round once per signature
#: (the default: later calls of an agreed signature skip it).
AGREEMENT_VARIANTS = ("none", "every call", "once per signature")


def _agreement_worker(rank: int, n: int, o: Options) -> dict[tuple[str, int, str], float]:
    """Median time per (method, size, variant): hopq's methods under each of
    :data:`AGREEMENT_VARIANTS`, and torch's fp16 hook and plain all-reduce (the
    variant ""); all timed in alternation, so that drift on a shared machine
    hits them alike."""
    from hopq.comm import engine

    out: dict[tuple[str, int, str], float] = {}
    methods = [m for m in o.methods() if m not in NATIVES]  # with --microshards' depths
    codecs = {m: get_codec(m.split("/")[0]) for m in methods}
    settings = {
        "none": (False, True),
        "every call": (True, False),
        "once per signature": (True, True),
    }
    for size in _sizes(o):
        x0 = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
        x = x0.clone()
        reset = functools.partial(x.copy_, x0)  # the same data for every call
        runs: dict[tuple[str, str], Callable[[], object]] = {
            (NATIVE, ""): functools.partial(dist.all_reduce, x),
            (NATIVE_FP16, ""): functools.partial(_fp16_hook_all_reduce, x, n),
        }
        for m in methods:
            topology, layout = _schedule(m, o)
            hop = functools.partial(
                all_reduce, x, codecs[m], topology, microshards=_microshards(m), layout=layout
            )
            for v in AGREEMENT_VARIANTS:
                runs[(m, v)] = hop
        firsts = []
        for go in runs.values():
            reset()
            go()  # warm-up, and the signature's agreement
            firsts.append(_time(go, 1, reset)[0])
        iters = max(5, min(100, int(o.budget_s / max(max(firsts), 1e-6))))
        times: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
        try:
            for _ in range(iters):
                for (m, v), go in runs.items():
                    engine.AGREEMENT, engine.SKIP_AGREED = settings.get(v, (True, True))
                    times[(m, v)] += _time(go, 1, reset)
        finally:
            engine.AGREEMENT, engine.SKIP_AGREED = True, True
        for (m, v), ts in times.items():
            out[(m, size, v)] = statistics.median(ts)
    return out


def _agreement_report(o: Options) -> str:
    n = o.world_size
    res, where = _run_workers(o, _agreement_worker)
    rows = []
    for size in _sizes(o):
        for m in o.methods():
            if m not in NATIVES:
                none, every, once = (res[(m, size, v)] for v in AGREEMENT_VARIANTS)
                rows.append(
                    [human_bytes(size), m, f"{res[(NATIVE_FP16, size, '')] * 1e3:.2f}",
                     f"{none * 1e3:.2f}", f"{every * 1e3:.2f}", f"{once * 1e3:.2f}",
                     f"{(every - once) * 1e3:+.2f}", f"{(once / every - 1) * 100:+.0f}%"]
                )  # fmt: skip
    return (
        f"{n} Gloo ranks on one machine ({machine()}), over {where}; median of "
        "alternating runs: torch's fp16 hook (its all-reduce of the bucket as "
        "float16), and hopq without any agreement (unsafe: the floor), with the "
        "agreement's round in every call, and with it once per signature (later "
        "calls of an agreed signature skip it, the default).\n\n"
        + markdown_table(
            [
                "size",
                "method",
                "torch fp16 hook (ms)",
                "no agreement (ms)",
                "round every call (ms)",
                "once per signature (ms)",
                "saved (ms)",
                "change",
            ],
            rows,
        )  # fmt: skip
    )


def _fp16_hook_all_reduce(x: torch.Tensor, n: int) -> None:
    """What torch's ``fp16_compress_hook`` does with a bucket ``x``: float16
    divided by n, Gloo's all-reduce, back into ``x``."""
    h = x.to(torch.float16).div_(n)
    dist.all_reduce(h)
    x.copy_(h)


def _worker(rank: int, n: int, o: Options) -> Results:
    """Per (method, size): the median time; for hopq's methods also, as
    (method, size, "bytes") and (method, size, "codec"), the most bytes any rank
    sent in one call and the largest per-rank median of its codec work (the
    call's seconds not spent waiting on the transport)."""
    out: Results = {}
    if n > 1:
        out[("step", 0)] = _step_latency(rank, n)
    methods = o.methods()
    codecs = {m: get_codec(m.split("/")[0]) for m in methods if m not in NATIVES}
    for size in _sizes(o):
        x0 = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
        x = x0.clone()
        # every call starts from the same data: an in-place sum grows n-fold per
        # call (to Inf within ~64 calls), and statistics-driven codecs (GComp's
        # code table) would see drifting inputs
        reset = functools.partial(x.copy_, x0)
        for m in methods:
            runs: list[RunStats] = []
            fn: Callable[[], object] = functools.partial(dist.all_reduce, x)
            if m == NATIVE_FP16:
                fn = functools.partial(_fp16_hook_all_reduce, x, n)
                out[(m, size, "bytes")] = 2 * (n - 1) / n * size / 2
            elif m != NATIVE:
                topology, layout = _schedule(m, o)
                call = functools.partial(
                    all_reduce, x, codecs[m], topology, microshards=_microshards(m), layout=layout
                )

                def fn(call: Callable[[], RunStats] = call, runs: list[RunStats] = runs) -> None:
                    runs.append(call())

            reset()
            fn()  # warm-up (and first-call setup)
            first = _time(fn, 1, reset)[0]
            iters = max(3, min(200, int(o.budget_s / max(first, 1e-6))))
            runs.clear()
            out[(m, size)] = statistics.median(_time(fn, iters, reset))
            if runs:
                mine = torch.tensor(
                    [
                        max(r.bytes_sent for r in runs),
                        statistics.median(r.seconds - r.comm_seconds for r in runs),
                    ],
                    dtype=torch.float64,
                )
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                out[(m, size, "bytes")], out[(m, size, "codec")] = mine.tolist()
    # how the two-tier calls' float32 tier ran inside the nodes (every rank's)
    from hopq.comm import shm

    node = shm.ranks_state()
    if node is not None:
        out[("shared memory", 0)] = node
    return out


def measure(o: Options) -> tuple[Results, str]:
    """Times of every (method, size) of ``o`` (seconds, median of the slowest
    rank's), the ring step's latency as ("step", 0), and where they ran."""
    return _run_workers(o, _worker)


def _run_workers(o: Options, worker: Callable[[int, int, Options], Any]) -> tuple[Any, str]:
    """Rank 0's results of ``worker`` on o.world_size Gloo ranks, on the emulated
    network when ``o.rate_mbit`` asks for one, and where they ran."""
    from hopq.cluster.network import EmulatedNetwork, unavailable_reason

    n = o.world_size
    where = "loopback"
    if o.rate_mbit > 0:
        why = unavailable_reason()
        if why:
            print(f"no emulated network ({why}): measuring on plain loopback", flush=True)
            where = f"loopback ({why})"
            res = run_workers(n, worker, o)[0]
        else:
            with EmulatedNetwork(
                n,
                rate_mbit=o.rate_mbit,
                mtu=o.mtu,
                congestion=o.tcp_congestion,
                workers_per_node=o.workers_per_node,
                intra_rate_mbit=o.intra_rate_mbit,
            ) as net:
                res = run_workers(
                    n,
                    worker,
                    o,
                    namespaces=net.namespaces,
                    workers_per_node=net.workers_per_node,
                )[0]
            where = f"an emulated network, {net.describe()}"
    else:
        res = run_workers(n, worker, o)[0]
    return res, where


def run(o: Options) -> str:
    """Run the benchmark; return the report (markdown)."""
    if o.agreement_cost:
        return _agreement_report(o)
    n = o.world_size
    res, where = measure(o)
    methods = o.methods()
    # one link per worker: every byte a rank sends crosses it; with nodes of
    # several workers some bytes stay on a node's loopback, so no such ideal
    ideal_cols = o.rate_mbit > 0 and o.workers_per_node == 1
    rows = []
    for size in _sizes(o):
        base = res[(NATIVE, size)]
        for m in methods:
            t = res[(m, size)]
            algbw = size / t / 1e9
            bf16 = res.get(("bf16" + m[m.index("/") :], size)) if m not in NATIVES else None
            # a ring's bytes for Gloo's own algorithm; hopq counts what it sent
            sent = res.get((m, size, "bytes"), 2 * (n - 1) / n * size)
            codec = res.get((m, size, "codec"))
            row = [
                human_bytes(size),
                m,
                f"{t * 1e6:.0f}",
                f"{algbw:.3f}",
                f"{algbw * 2 * (n - 1) / n:.3f}",
                f"{t / base:.2f}",
                f"{bf16 / t:.2f}x" if bf16 else "",
                human_bytes(int(sent)),
                f"{codec * 1e3:.0f}" if codec is not None else "",
            ]
            if ideal_cols:
                ideal = sent * 8 / (o.rate_mbit * 1e6)
                row += [f"{ideal * 1e3:.0f}", f"{t / ideal:.2f}x"]
            rows.append(row)
    head = f"{n} Gloo ranks on one machine ({machine()}), over {where}\n"
    if o.layout:
        head += f"hopq's methods run two-tier, layout={o.layout}.\n"
    if ("shared memory", 0) in res:
        from hopq.comm import shm

        head += shm.describe(res[("shared memory", 0)]) + "\n"
    if o.rate_mbit > 0 and where.startswith("an emulated"):
        from hopq.cluster.network import payload_fraction

        share = payload_fraction(o.mtu)
        head += (
            f"At MTU {o.mtu} the link carries {(1 - share) * 100:.1f}% TCP/IP and Ethernet "
            f"header bytes: no transfer runs below {1 / share:.3f}x of its wire ideal.\n"
        )
    if ("step", 0) in res:
        step = res[("step", 0)]
        head += (
            f"One ring step (4-byte isend/irecv to the neighbours) takes {step * 1e6:.0f} us here, "
            f"so a {2 * (n - 1)}-step ring cannot finish in under {2 * (n - 1) * step * 1e6:.0f} us.\n"
        )
    head += "\n"
    return (
        head
        + markdown_table(
            [
                "size",
                "method",
                "time (us)",
                "algbw (GB/s)",
                "busbw (GB/s)",
                f"time / {NATIVE}",
                "speedup vs bf16",
                "sent / rank",
                "codec work (ms)",
            ]
            + (["wire ideal (ms)", "time / ideal"] if ideal_cols else []),
            rows,
        )
        + (
            f"\n\n{NATIVE_FP16}: what torch's fp16_compress_hook does with a bucket (cast to "
            "float16 divided by n, Gloo's all-reduce, cast back), timed whole. "
            "sent / rank: the most payload and statistics bytes one rank sent in a call "
            f"(for torch's, a ring's 2(n-1)/n of the tensor); codec work: the largest "
            "per-rank median of a call's seconds not spent waiting on the transport"
            + (
                "; wire ideal: sent / rank at the link rate, the time a call takes if "
                "nothing but the link limits it."
                if ideal_cols
                else "."
            )
        )
    )
