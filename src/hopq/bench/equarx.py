"""``hopq bench equarx``: the EQuARX paper's Fig. 7 and Fig. 6 analogues.

* ``error`` (Fig. 7, section IV-A): n ranks, a (size, size) tensor per rank from
  N(0, 1), block 64; MSE of the result against the exact sum (float64) and
  against the bf16 all-reduce's result (the paper's measure) for
  {full-loop ring, semi-loop} x {RS, AG, both quantized}, the naive FP8 E5M2
  cast, bf16, and hopq's own choices (scale format, layout, element) beside
  the default. Run in the simulator (the same engine and codec as a real run).
  The "wire ratio" column is bf16's bytes over the method's, counted from the
  bytes sent: the speedup a purely bandwidth-bound link would give, not a timing.
* ``timing`` (Fig. 6): time of each method relative to a bf16 ring all-reduce,
  sizes 1 KiB to 64 MiB growing 4x, on real Gloo ranks over an emulated network
  (``--rate-mbit``; plain loopback when it is 0 or the network is unavailable).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hopq.options import check_int, check_scoped, option
from hopq.reporting import human_bytes, machine, markdown_table


@dataclass(frozen=True)
class Method:
    label: str
    topology: str
    codec: str
    gather: str | None = None
    config: tuple[tuple[str, Any], ...] = ()

    def make(self) -> tuple[Any, Any]:
        from hopq.codecs.registry import get_codec

        """(codec, gather codec); the config goes to whichever stage is EQuARX."""
        cfg = dict(self.config)
        if self.codec == "equarx":
            return get_codec(self.codec, **cfg), self.gather
        return get_codec(self.codec), None if self.gather is None else get_codec(self.gather, **cfg)


def methods(block: int) -> list[Method]:
    """Fig. 7's flavours, then hopq's choices at the paper's fastest flavour."""
    eq = (("block", block),)
    out = [Method("bf16 (baseline)", "ring", "bf16")]
    for topo, name in (("ring", "full-loop"), ("semiloop", "semi-loop")):
        out += [
            Method(f"{name} RS only", topo, "equarx", "bf16", eq),
            Method(f"{name} AG only", topo, "bf16", "equarx", eq),
            Method(f"{name} RS+AG", topo, "equarx", None, eq),
        ]
    out += [
        Method("biring RS+AG", "biring", "equarx", None, eq),
        Method(
            "naive FP8 E5M2 cast", "ring", "equarx", None, (("element", "e5m2"), ("scale", "none"))
        ),  # fmt: skip
        Method("full-loop RS+AG, fp32 scales", "ring", "equarx", None, (*eq, ("scale", "fp32"))),
        Method(
            "full-loop RS+AG, contiguous blocks",
            "ring",
            "equarx",
            None,
            (*eq, ("layout", "contiguous")),
        ),  # fmt: skip
        Method("full-loop RS+AG, E4M3", "ring", "equarx", None, (*eq, ("element", "e4m3"))),
        Method("full-loop RS+AG, E5M2", "ring", "equarx", None, (*eq, ("element", "e5m2"))),
    ]
    return out


def _parts() -> tuple[str, ...]:
    return ("error", "timing", "kernels")


@dataclass(frozen=True)
class EquarxOptions:
    parts: tuple[str, ...] = option(("error",), "what to run", choices=_parts)
    world_size: int = option(8, "ranks (the paper: 8 TPU v5e chips)")
    size: int = option(4096, "error: each rank's tensor is (size, size) from N(0, 1)")
    block: int = option(64, "entries per scale (Fig. 7: 64)")
    seed: int = option(0, "seed of the inputs")
    min_bytes: int = option(1 << 10, "timing: smallest tensor, bytes of float32")
    max_bytes: int = option(64 << 20, "timing: largest tensor (sizes grow 4x)")
    budget_s: float = option(0.6, "timing: rough seconds per (method, size)")
    rate_mbit: float = option(
        0.0, "timing: per-worker link of an emulated network in Mbit/s; 0: plain loopback"
    )
    kernel_coords: int = option(1 << 22, "kernels: coordinates of one part")
    repeats: int = option(7, "kernels: timed repetitions (median) after a warm-up")

    def __post_init__(self) -> None:
        for p in self.parts:
            if p not in _parts():
                raise ValueError(f"parts must be among {_parts()}, got {p!r}")
        check_int("world_size", self.world_size, lo=1, hi=64)
        check_int("size", self.size, lo=1, hi=1 << 15)
        check_int("block", self.block, lo=1, hi=1 << 20)
        if self.min_bytes < 4 or self.max_bytes < self.min_bytes:
            raise ValueError("need 4 <= min_bytes <= max_bytes")
        check_int("kernel_coords", self.kernel_coords, lo=1, hi=1 << 28)
        check_int("repeats", self.repeats, lo=1, hi=1000)
        timing = ("min_bytes", "max_bytes", "budget_s", "rate_mbit")
        check_scoped(
            self,
            {
                "size": ("error",),
                **dict.fromkeys(timing, ("timing",)),
                "kernel_coords": ("kernels",),
                "repeats": ("kernels",),
            },
            self.parts,
            "--parts",
        )


def error_table(o: EquarxOptions) -> str:
    from hopq.sim import simulate

    n = o.world_size
    g = torch.Generator().manual_seed(o.seed)
    xs = [torch.randn(o.size, o.size, generator=g) for _ in range(n)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    rows = []
    bf16_bytes = None
    bf16_out: torch.Tensor | None = None
    for m in methods(o.block):
        codec, gather = m.make()
        r = simulate(xs, codec, m.topology, seed=o.seed, gather_codec=gather)
        if not r.identical:
            raise RuntimeError(f"{m.label}: ranks differ")
        out = r.outputs[0].double()
        mse = (out - exact).square().mean().item()
        sent = sum(r.bytes_sent)
        if bf16_bytes is None:  # the first method is the bf16 baseline
            bf16_bytes, bf16_out = sent, out
        assert bf16_out is not None
        rows.append(
            [
                m.label,
                m.topology,
                f"{mse:.3g}",
                f"{(out - bf16_out).square().mean().item():.3g}",
                f"{r.vnmse:.3g}",
                f"{r.bits_per_coord:.3f}",
                r.hops_per_chunk,
                f"{bf16_bytes / sent:.2f}x",
            ]
        )
    head = (
        f"{n} ranks (simulator), each a ({o.size}, {o.size}) float32 tensor from N(0, 1), "
        f"seed {o.seed}, block {o.block}, on {machine()}. MSE per entry against the exact "
        "sum (float64), and against the bf16 ring all-reduce's result (the paper's Fig. 7 "
        "measures the MSE relative to its BF16 baseline); vNMSE = ||error||^2 / ||sum||^2 "
        "(against the exact sum); chain = the longest chain of "
        "quantizations a contribution goes through; wire ratio = bf16's bytes / the method's "
        "(counted from the bytes sent).\n\n"
    )
    return head + markdown_table(
        [
            "method",
            "schedule",
            "MSE",
            "MSE vs bf16",
            "vNMSE",
            "bits/coord",
            "chain",
            "wire ratio vs bf16",
        ],
        rows,  # fmt: skip
    )


def timed_methods(block: int) -> tuple[Method, ...]:
    """The timing part's methods, EQuARX with ``block`` entries per scale (the
    naive cast has no scales)."""
    eq = (("block", block),)
    return (
        Method("bf16", "ring", "bf16"),
        Method("equarx full-loop RS+AG", "ring", "equarx", None, eq),
        Method("equarx semi-loop RS+AG", "semiloop", "equarx", None, eq),
        Method("equarx biring RS+AG", "biring", "equarx", None, eq),
        Method("equarx full-loop RS only", "ring", "equarx", "bf16", eq),
        Method("equarx full-loop AG only", "ring", "bf16", "equarx", eq),
        Method(
            "naive FP8 E5M2 cast", "ring", "equarx", None, (("element", "e5m2"), ("scale", "none"))
        ),
    )


def _sizes(o: EquarxOptions) -> list[int]:
    out, s = [], o.min_bytes
    while s <= o.max_bytes:
        out.append(s)
        s *= 4
    return out


def _timing_worker(rank: int, n: int, o: EquarxOptions) -> dict[tuple[str, int], float]:
    from hopq.bench.allreduce import _time
    from hopq.comm.collectives import all_reduce

    out: dict[tuple[str, int], float] = {}
    for size in _sizes(o):
        g = torch.Generator().manual_seed(o.seed * 65536 + rank)  # seed 0: rank r's seed r
        x = torch.randn(size // 4, generator=g)
        for m in timed_methods(o.block):
            codec, gather = m.make()
            fn: Callable[[], object] = functools.partial(
                all_reduce, x, codec, m.topology, gather_codec=gather
            )
            fn()
            first = _time(fn, 1)[0]
            iters = max(3, min(200, int(o.budget_s / max(first, 1e-6))))
            out[(m.label, size)] = statistics.median(_time(fn, iters))
    return out


def timing_table(o: EquarxOptions) -> str:
    from hopq.cluster.launch import run_workers
    from hopq.cluster.network import EmulatedNetwork, unavailable_reason

    n = o.world_size
    where = "plain loopback"
    if o.rate_mbit > 0 and not unavailable_reason():
        with EmulatedNetwork(n, rate_mbit=o.rate_mbit) as net:
            res = run_workers(n, _timing_worker, o, namespaces=net.namespaces)[0]
        where = f"an emulated network, {net.describe()}"
    else:
        if o.rate_mbit > 0:
            where = f"plain loopback (no emulated network: {unavailable_reason()})"
        res = run_workers(n, _timing_worker, o)[0]
    rows = []
    for size in _sizes(o):
        base = res[("bf16", size)]
        for m in timed_methods(o.block):
            t = res[(m.label, size)]
            rows.append([human_bytes(size), m.label, f"{t * 1e6:.0f}", f"{t / base:.2f}"])
    head = (
        f"{n} Gloo ranks on one machine ({machine()}), over {where}; EQuARX's block "
        f"{o.block}, inputs of seed {o.seed}; median of the "
        "slowest rank's time per call. Paper (Fig. 6, TPU v5e): about 1.0 below 2 MiB, "
        "about 0.55 above.\n\n"
    )
    return head + markdown_table(["size", "method", "time (us)", "time / bf16 ring"], rows)


def _stage_times(
    c: Any, x: torch.Tensor, ctx: Any, measure: Callable[[Callable[[], object]], float]
) -> list[float]:
    """Seconds of compress, decompress, decode + add and the fused hop on ``x``."""
    from hopq.codecs.base import LocalStats

    plan = c.plan(x, LocalStats())
    p = c.encode(plan, x, ctx)
    out, acc = torch.empty_like(x), x.clone()
    return [
        measure(lambda: c.encode(plan, x, ctx)),
        measure(lambda: c.decode(plan, p, ctx, out)),
        measure(lambda: c.decode_accumulate(plan, p, acc.copy_(x), ctx)),
        measure(lambda: c.decode_accumulate_encode(plan, p, acc.copy_(x), ctx)),
    ]


def kernel_table(o: EquarxOptions) -> str:
    """M coordinates/s on one core of each stage, the PyTorch reference against the
    numba kernel (the same bits), for every element format and both block
    geometries."""
    from hopq.bench.kernels import one_thread, timer
    from hopq.codecs.base import HopContext
    from hopq.codecs.equarx import Element, EQuARX
    from hopq.codecs.equarx import kernels_cpu as equarx_cpu

    if not equarx_cpu.available():
        raise RuntimeError("hopq bench equarx --parts kernels needs numba: pip install 'hopq[cpu]'")
    n = o.kernel_coords
    x = torch.randn(n, generator=torch.Generator().manual_seed(o.seed))
    measure = timer(torch.device("cpu"), o.repeats)
    ctx = HopContext(0, 0, 0, 1, 0, o.world_size)
    rows = []
    with one_thread():
        for element in (e.value for e in Element):
            for layout in ("strided", "contiguous"):
                speeds: dict[str, list[float]] = {}
                for backend in ("reference", "cpu"):
                    c = EQuARX(backend=backend, element=element, layout=layout, block=o.block)
                    speeds[backend] = [n / t / 1e6 for t in _stage_times(c, x, ctx, measure)]
                for name, ref, cpu in zip(
                    ("compress", "decompress", "decode + add", "fused hop"), *speeds.values(),
                    strict=True,
                ):  # fmt: skip
                    rows.append(
                        [element, layout, name, f"{ref:.0f}", f"{cpu:.0f}", f"{cpu / ref:.1f}x"]
                    )
    head = (
        f"One core ({machine()}), {n:,} float32 coordinates from N(0, 1), bfloat16 "
        f"scales, block {o.block}; M coordinates/s, median of {o.repeats} "
        "(decode + add and the fused hop include a copy that resets the sum).\n\n"
    )
    return head + markdown_table(
        ["element", "layout", "stage", "reference (M/s)", "numba kernel (M/s)", "speed-up"], rows
    )


def run(o: EquarxOptions) -> str:
    """Run the requested parts; return the report (markdown)."""
    out = []
    if "error" in o.parts:
        out.append("## Error (Fig. 7 analogue)\n\n" + error_table(o))
    if "timing" in o.parts:
        out.append("## Time relative to bf16 (Fig. 6 analogue)\n\n" + timing_table(o))
    if "kernels" in o.parts:
        out.append("## Kernels\n\n" + kernel_table(o))
    return "\n\n".join(out)
