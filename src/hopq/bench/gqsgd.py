"""``hopq bench gqsgd``: Global-QSGD's claims measured in the simulator.

1. The per-aggregation variance growth of the exponential reduce on the tree
   for n = 2..64 against the paper's (9/8)^(levels) (section 4.2): the second
   moment E||tree result||^2 over E||exact sum of the same leaf codes||^2 (the
   leaves are recorded during the very run, same seed), and the squared error
   of the tree over that of the leaves' exact sum; beside them the vNMSE of
   gqsgd-exp and gqsgd-linear on the tree and ring.
2. The exponential reduce's throughput on one CPU core: the numba kernel's fused
   hop (decode, validate, reduce, re-encode), the PyTorch reference, and a
   float32 add (torch, one thread) as the ceiling, in M coordinates per second.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from hopq.codecs.base import ReduceOp
from hopq.codecs.gqsgd import GQSGDExp, GQSGDExpPlan, codes_to_bytes, exp_reduce
from hopq.numerics.rng import hash32
from hopq.options import check_int, option
from hopq.reporting import Progress, machine, markdown_table
from hopq.sim import simulate


@dataclass(frozen=True)
class GQSGDOptions:
    worlds: tuple[int, ...] = option(
        (2, 3, 4, 6, 8, 12, 16, 32, 64), "world sizes of the variance table"
    )
    size: int = option(4096, "coordinates per rank")
    seeds: int = option(4, "runs per world size")
    coords: int = option(1 << 24, "coordinates of the kernel timing")
    repeats: int = option(5, "timed repeats (the best is kept)")

    def __post_init__(self) -> None:
        for n in self.worlds:
            check_int("worlds", n, lo=2, hi=256)
        check_int("size", self.size, lo=1)
        check_int("seeds", self.seeds, lo=1)
        check_int("coords", self.coords, lo=1024, hi=1 << 30)
        check_int("repeats", self.repeats, lo=1)


class _Leaves(GQSGDExp):
    """gqsgd-exp that records, per rank, the decoded value of its leaf codes."""

    leaves: dict[int, torch.Tensor] = {}

    def prepare(self, plan: GQSGDExpPlan, x: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        w = super().prepare(plan, x, scratch)
        _Leaves.leaves[plan.rank] = self.finish(plan, w.clone(), ReduceOp.SUM, 1).double()
        return w


def second_moment_growth(
    n: int, seeds: int = 4, size: int = 4096, topology: str = "tree"
) -> tuple[float, float]:
    """(E||result||^2 / E||exact sum of the same leaves||^2, E||result - x||^2 /
    E||leaves' exact sum - x||^2) of gqsgd-exp on ``topology``, Gaussian inputs."""
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(size, generator=g) for _ in range(n)]
    exact = torch.stack(xs).double().sum(0)
    m2_out = m2_leaf = se_out = se_leaf = 0.0
    for seed in range(seeds):
        _Leaves.leaves.clear()
        out = simulate(xs, _Leaves(), topology, seed=seed).outputs[0].double()
        leafsum = torch.stack([_Leaves.leaves[r] for r in range(n)]).sum(0)
        m2_out += out.square().sum().item()
        m2_leaf += leafsum.square().sum().item()
        se_out += (out - exact).square().sum().item()
        se_leaf += (leafsum - exact).square().sum().item()
    return m2_out / m2_leaf, se_out / se_leaf


def _vnmse(codec: str, topology: str, n: int, size: int, seeds: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(1000 + n)
    xs = [torch.randn(size, generator=g) for _ in range(n)]
    exact = torch.stack(xs).double().sum(0)
    tot, bits = 0.0, 0.0
    for seed in range(seeds):
        r = simulate(xs, codec, topology, seed=seed)
        tot += ((r.outputs[0].double() - exact).square().sum() / exact.square().sum()).item()
        bits = r.bits_per_coord
    return tot / seeds, bits


def _best(f: Any, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def kernel_rows(o: GQSGDOptions) -> list[list[object]]:
    """M coordinates per second of the fused exponential hop on one core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        n = o.coords
        e = torch.randint(4, 40, (2, n), generator=g, dtype=torch.int32)
        s = torch.randint(0, 2, (2, n), generator=g, dtype=torch.int32) * 2 - 1
        a, b = e[0] * s[0], e[1] * s[1]
        body = codes_to_bytes(b)
        key = (0x1234567, 0x89ABCDE)
        x, y = torch.rand(n), torch.rand(n)
        add = n / _best(lambda: x.add_(y), o.repeats) / 1e6
        rows: list[list[object]] = [["float32 add (torch, the ceiling)", f"{add:.0f}", "1.00"]]
        from hopq.kernels import gqsgd_cpu

        if gqsgd_cpu.available():
            out = torch.empty(n, dtype=torch.uint8)
            acc = a.to(torch.float32)
            gqsgd_cpu.exp_reduce(acc[:64].clone(), body[:64], key, 0, 2, out[:64])  # compile
            accs = [a.to(torch.float32) for _ in range(o.repeats)]

            def hop() -> None:
                gqsgd_cpu.exp_reduce(accs.pop(), body, key, 0, 2, out)

            k = n / _best(hop, o.repeats) / 1e6
            rows.append(["numba fused hop (decode, reduce, encode)", f"{k:.0f}", f"{k / add:.2f}"])
        else:
            rows.append(["numba fused hop", "numba not installed", ""])
        m = min(n, 1 << 21)
        ref = m / _best(lambda: exp_reduce(a[:m], b[:m], hash32(torch.arange(m), key)), 1) / 1e6
        rows.append(["PyTorch reference (reduce + hash only)", f"{ref:.1f}", f"{ref / add:.3f}"])
        return rows
    finally:
        torch.set_num_threads(threads)


def run(o: GQSGDOptions) -> str:
    rows = []
    with Progress("gqsgd", len(o.worlds), every=1) as bar:
        for n in o.worlds:
            levels = math.ceil(math.log2(n))
            growth, se_ratio = second_moment_growth(n, o.seeds, o.size)
            ve, be = _vnmse("gqsgd-exp", "tree", n, o.size, o.seeds)
            vl, _ = _vnmse("gqsgd-linear", "tree", n, o.size, o.seeds)
            ring = _vnmse("gqsgd-exp", "ring", n, o.size, o.seeds)[0] if n <= 16 else float("nan")
            rows.append(
                [
                    n, levels, f"{growth:.4f}", f"{(9 / 8) ** levels:.4f}",
                    "yes" if growth <= (9 / 8) ** levels else "**no**", f"{se_ratio:.2f}",
                    f"{ve:.4f}", f"{ring:.4f}", f"{vl:.4f}", f"{be:.2f}",
                ]
            )  # fmt: skip
            bar.update(f"n={n}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    krows = kernel_rows(o)
    return "\n".join(
        [
            f"Machine: {machine()}; load average {load:.1f} when the timings ran "
            f"({os.cpu_count()} cores; timings on a loaded machine are indicative).",
            "",
            f"Variance growth of gqsgd-exp on the tree ({o.size} Gaussian coordinates per "
            f"rank, {o.seeds} seeds). *growth*: E||tree result||^2 / E||exact sum of the same "
            "leaf codes||^2, the quantity the paper bounds by (9/8)^levels; *error ratio*: the "
            "tree's squared error over the leaves' exact sum's. vNMSE of gqsgd-exp on the "
            "tree and ring (ring up to n = 16) and of gqsgd-linear (8-bit) on the tree.",
            "",
            markdown_table(
                [
                    "n",
                    "levels",
                    "growth",
                    "(9/8)^levels",
                    "within",
                    "error ratio",
                    "vNMSE E tree",
                    "vNMSE E ring",
                    "vNMSE L8 tree",
                    "bits/coord E",
                ],
                rows,
            ),  # fmt: skip
            "",
            f"The exponential reduce on one core ({o.coords} coordinates, exponents 4..39, "
            f"random signs; best of {o.repeats}):",
            "",
            markdown_table(["implementation", "M coords/s", "x float add"], krows),
        ]
    )
