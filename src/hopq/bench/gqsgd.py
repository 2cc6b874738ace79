"""``hopq bench gqsgd``: Global-QSGD's claims measured in the simulator.

1. The per-aggregation variance growth of the exponential reduce on the tree
   for n = 2..64 against the paper's (9/8)^(levels) (section 4.2): the second
   moment E||tree result||^2 over E||exact sum of the same leaf codes||^2 (the
   leaves are recorded during the very run, same seed), and the squared error
   of the tree over that of the leaves' exact sum; beside them the vNMSE of
   gqsgd-exp and gqsgd-linear on the tree and ring.
3. (``--parts quality``) the paper's Table 4 analogue: a workload trained with
   each codec in the loop (:mod:`hopq.bench.quality`, the tree all-reduce)
   over several seeds; the held-out loss after a fixed number of steps.
2. The kernels' throughput on one CPU core: the exponential reduce's fused hop
   (decode, validate, reduce, re-encode), the linear hop on int8 lanes, both
   leaf quantizers and the PyTorch reference of the reduce, beside a float32 add
   (torch, one thread) as the ceiling, in M coordinates per second.
4. (``--parts costmodel``) the paper's section 7 model against the emulated
   network: its all-reduce times T (no compression) and T^ (Global-QSGD) on
   the tree, with its constants measured here (alpha: a ring step; beta: the
   link; gamma, gamma^: a float add and each codec's reduce on one core; delta:
   each codec's quantize + decode per byte, 0 as the paper assumes and as
   measured), its speed-up condition (A.5), and the times measured by
   ``hopq bench allreduce`` at two link rates in the same run.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from hopq.bench.kernels import one_thread
from hopq.codecs.base import ReduceOp
from hopq.codecs.gqsgd import GQSGDExp, GQSGDExpPlan, codes_to_bytes, exp_reduce
from hopq.numerics.rng import hash32
from hopq.options import check_int, check_scoped, option
from hopq.reporting import Progress, machine, markdown_table
from hopq.sim import simulate
from hopq.train.workloads import WORKLOADS

PARTS = ("variance", "kernels", "quality", "costmodel")
#: Table 4's contenders: (label, codec name, its options); None: no compression.
QUALITY_CODECS: tuple[tuple[str, str | None, dict[str, Any]], ...] = (
    ("no compression (fp32)", None, {}),
    ("L 8-bit (gqsgd-linear)", "gqsgd-linear", {"bits": 8}),
    ("L 4-bit (gqsgd-linear)", "gqsgd-linear", {"bits": 4}),
    ("E 8-bit (gqsgd-exp)", "gqsgd-exp", {}),
    ("dynamiq (5 bits)", "dynamiq", {}),
    ("mxfp8", "mxfp8", {}),
    ("thc", "thc", {}),
)
#: ``--quality-codecs`` names of the rows after the fp32 baseline (which always runs).
QUALITY_KEYS = ("L8", "L4", "E8", "dynamiq", "mxfp8", "thc")


@dataclass(frozen=True)
class GQSGDOptions:
    parts: tuple[str, ...] = option(("variance", "kernels"), "what to measure", choices=PARTS)
    worlds: tuple[int, ...] = option(
        (2, 3, 4, 6, 8, 12, 16, 32, 64), "world sizes of the variance table"
    )
    size: int = option(4096, "coordinates per rank")
    seeds: int = option(4, "runs per world size")
    coords: int = option(1 << 24, "coordinates of the kernels part's timing")
    repeats: int = option(5, "the kernels part's timed repeats (the best is kept)")
    quality_workloads: tuple[str, ...] = option(
        ("gpt",), "workloads of the quality table", choices=tuple(WORKLOADS)
    )
    quality_seeds: int = option(3, "seeds (weights, data, codec) of the quality table")
    quality_steps: int = option(60, "training steps of the quality table")
    quality_workers: int = option(4, "simulated workers of the quality table")
    quality_batch: int = option(4, "sequences per worker of the quality table")
    quality_codecs: tuple[str, ...] = option(
        QUALITY_KEYS,
        "rows of the quality table beside the fp32 baseline",
        choices=lambda: QUALITY_KEYS,
    )
    model_rates: tuple[float, ...] = option(
        (1000.0, 100.0), "cost model: per-worker link rates (Mbit/s), the paper's P2P and SHM"
    )
    model_world: int = option(4, "cost model: Gloo ranks (the paper's 4 GPUs)")
    model_bytes: int = option(16 << 20, "cost model: float32 bytes per rank")

    def __post_init__(self) -> None:
        bad = set(self.parts) - set(PARTS)
        if bad:
            raise ValueError(f"unknown parts {sorted(bad)}; choose from {PARTS}")
        bad = set(self.quality_workloads) - set(WORKLOADS)
        if bad:
            raise ValueError(f"unknown workloads {sorted(bad)}; choose from {sorted(WORKLOADS)}")
        bad = set(self.quality_codecs) - set(QUALITY_KEYS)
        if bad:
            raise ValueError(f"unknown quality codecs {sorted(bad)}; choose from {QUALITY_KEYS}")
        check_int("quality_seeds", self.quality_seeds, lo=1)
        check_int("quality_steps", self.quality_steps, lo=1)
        check_int("quality_workers", self.quality_workers, lo=2, hi=64)
        check_int("quality_batch", self.quality_batch, lo=1)
        for n in self.worlds:
            check_int("worlds", n, lo=2, hi=256)
        check_int("size", self.size, lo=1)
        check_int("seeds", self.seeds, lo=1)
        check_int("coords", self.coords, lo=1024, hi=1 << 30)
        check_int("repeats", self.repeats, lo=1)
        quality = {f"quality_{k}": ("quality",) for k in ("workloads", "seeds", "steps")}
        quality |= {f"quality_{k}": ("quality",) for k in ("workers", "batch", "codecs")}
        check_scoped(
            self,
            {
                "worlds": ("variance",),
                "size": ("variance",),
                "seeds": ("variance",),
                "coords": ("kernels",),
                "repeats": ("kernels",),
                **quality,
                "model_rates": ("costmodel",),
                "model_world": ("costmodel",),
                "model_bytes": ("costmodel",),
            },
            self.parts,
            "--parts",
        )


class _Leaves(GQSGDExp):
    """gqsgd-exp that records, per rank, the decoded value of its leaf codes."""

    leaves: dict[int, torch.Tensor] = {}

    def prepare(self, plan: GQSGDExpPlan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        w = super().prepare(plan, x, overwrite)
        for m in range(len(plan.chunks)):  # every part's leaf codes now
            super().prepare_part(plan, w, m)
        _Leaves.leaves[plan.rank] = self.finish(plan, w.clone(), ReduceOp.SUM, 1).double()
        return w

    def prepare_part(self, plan: GQSGDExpPlan, work: torch.Tensor, part: int) -> None:
        pass  # prepare did every part


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
    with one_thread():
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
        from hopq.codecs.gqsgd import kernels_cpu as gqsgd_cpu

        if gqsgd_cpu.available():
            out = torch.empty(n, dtype=torch.uint8)
            acc = a.to(torch.float32)
            gqsgd_cpu.exp_reduce(acc[:64].clone(), body[:64], key, 0, 2, out[:64])  # compile
            accs = [a.to(torch.float32) for _ in range(o.repeats)]

            def hop() -> None:
                gqsgd_cpu.exp_reduce(accs.pop(), body, key, 0, 2, out)

            k = n / _best(hop, o.repeats) / 1e6
            rows.append(["numba fused hop (decode, reduce, encode)", f"{k:.0f}", f"{k / add:.2f}"])
            for label, rate in _other_kernels(n, o.repeats):
                rows.append([label, f"{rate:.0f}", f"{rate / add:.2f}"])
        else:
            rows.append(["numba fused hop", "numba not installed", ""])
        m = min(n, 1 << 21)
        ref = m / _best(lambda: exp_reduce(a[:m], b[:m], hash32(torch.arange(m), key)), 1) / 1e6
        rows.append(["PyTorch reference (reduce + hash only)", f"{ref:.1f}", f"{ref / add:.3f}"])
        return rows


LINEAR_HOP = "numba linear hop (int8 lanes: add, check, encode)"
LINEAR_HOP4 = "numba linear hop (4-bit lanes)"
LINEAR_HOP16 = "numba linear hop (16-bit lanes)"


def _other_kernels(n: int, repeats: int, only: str | None = None) -> list[tuple[str, float]]:
    """M coordinates/s (one core) of gqsgd_cpu's other kernels on n coordinates
    (``only``: just the one with that label)."""
    from hopq.codecs.base import HopContext, LocalStats
    from hopq.codecs.gqsgd import GQSGDLinear
    from hopq.codecs.gqsgd import kernels_cpu as gqsgd_cpu

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g)
    lanes = torch.randint(-31, 32, (n,), generator=g, dtype=torch.int8).view(torch.uint8)
    acc0 = torch.randint(-31, 32, (n,), generator=g).to(torch.float32)
    out = torch.empty(n, dtype=torch.uint8)
    accs = [acc0.clone() for _ in range(3 * (repeats + 1))]
    codes = torch.randint(1, 40, (n,), generator=g).to(torch.float32)
    key = (0x1234567, 0x89ABCDE)
    small = torch.randint(-3, 4, (n,), generator=g).to(torch.float32)  # 2 ranks x 3 levels
    smalls = [small.clone() for _ in range(2 * (repeats + 1))]
    nib = gqsgd_cpu.linear_pack(small, 4)
    half = gqsgd_cpu.linear_pack(acc0, 16)
    nib_out, half_out = torch.empty_like(nib), torch.empty_like(half)
    ref4 = GQSGDLinear(bits=4, backend="reference")
    plan4 = ref4.plan(small, LocalStats(world_size=2))
    ctx = HopContext(0, 0, 0, 1, 0, 2)
    fns = [
        (LINEAR_HOP, lambda: gqsgd_cpu.linear_hop(accs.pop(), lanes, 8, 124, out)),
        (LINEAR_HOP4, lambda: gqsgd_cpu.linear_hop(smalls.pop(), nib, 4, 6, nib_out)),
        (
            "PyTorch reference linear hop (4-bit lanes)",
            lambda: ref4.decode_accumulate_encode(plan4, nib, smalls.pop(), ctx),
        ),
        (LINEAR_HOP16, lambda: gqsgd_cpu.linear_hop(accs.pop(), half, 16, 32767, half_out)),
        ("numba linear leaf quantize", lambda: gqsgd_cpu.linear_quantize(x, 7.0, 31, key)),
        ("numba exp leaf quantize", lambda: gqsgd_cpu.exp_quantize(x, 5.0, 3, key)),
        ("numba linear decode (finish)", lambda: gqsgd_cpu.linear_finish(acc0, 0.1, 4, 3e38)),
        ("numba exp decode (finish)", lambda: gqsgd_cpu.exp_finish(codes, 5.0, 3, 4, 3e38)),
    ]  # fmt: skip
    rows = []
    for label, f in fns:
        if only is not None and label != only:
            continue
        f()  # compile / warm
        rows.append((label, n / _best(f, repeats) / 1e6))
    return rows


def _one_core_rates(n: int = 1 << 22) -> dict[str, float]:
    """Bytes per second on one core: gamma (a float32 add, of fp32 bytes), each
    codec's reduce (gamma^, of its 1-byte codes) and its quantize + decode
    (1 / delta, of fp32 bytes), and the codecs' plans (global max)."""
    from hopq.codecs.base import LocalStats
    from hopq.codecs.gqsgd import GQSGDLinear
    from hopq.kernels import backend

    if not backend("gqsgd-exp", "cpu").available():  # checked before numpy is imported
        raise RuntimeError(
            "hopq bench gqsgd --parts costmodel times the numba kernels: pip install 'hopq[cpu]'"
        )
    from hopq.codecs.gqsgd import kernels_cpu as gqsgd_cpu

    with one_thread():
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
        out: dict[str, float] = {"gamma": 4 * n / _best(lambda: x.add_(y), 5)}
        lin = _other_kernels(n, 3, only=LINEAR_HOP)[0][1]
        out["gamma^ gqsgd-linear"] = lin * 1e6  # 1 byte per coordinate
        e = torch.randint(4, 40, (2, n), generator=g, dtype=torch.int32)
        body = codes_to_bytes(e[1])
        acc = e[0].to(torch.float32)
        o8 = torch.empty(n, dtype=torch.uint8)
        red = n / _best(lambda: gqsgd_cpu.exp_reduce(acc.clone(), body, (1, 2), 0, 2, o8), 3)
        out["gamma^ gqsgd-exp"] = red
        for name, codec in (("gqsgd-linear", GQSGDLinear()), ("gqsgd-exp", GQSGDExp())):
            st = LocalStats(world_size=4)

            def whole(c: Any = codec, s: Any = st) -> None:
                plan = c.plan(x, s)
                c.finish(plan, c.prepare_all(plan, x), ReduceOp.AVG, 4)

            out[f"delta {name}"] = _best(whole, 3) / (4 * n)  # seconds per fp32 byte
        return out


def paper_model(
    n: int, S: float, alpha: float, beta: float, gamma: float, rho: float = 1.0,
    gamma_hat: float | None = None, delta: float = 0.0,
) -> float:  # fmt: skip
    """Global-QSGD's section 7 (appendix A) all-reduce time on a tree of n:
    2 log(n) alpha + 2 log(n) S^/beta + log(n) S^/gamma^ + delta S, S^ = S / rho
    (rho = 1, gamma^ = gamma, delta = 0: the uncompressed baseline T)."""
    L = math.ceil(math.log2(n))
    Sh = S / rho
    return 2 * L * alpha + 2 * L * Sh / beta + L * Sh / (gamma_hat or gamma) + delta * S


def speedup_condition(beta: float, gamma: float, rho: float, omega: float) -> bool:
    """The paper's (A.5): compression pays when beta (rho - omega) > 2 gamma (1 - rho)."""
    return beta * (rho - omega) > 2 * gamma * (1 - rho)


def costmodel_section(o: GQSGDOptions) -> str:
    from hopq.bench.allreduce import NATIVE, measure
    from hopq.bench.allreduce import Options as AROptions

    n, size = o.model_world, o.model_bytes
    cores = os.cpu_count() or 1
    rates = _one_core_rates()
    gamma = rates["gamma"]
    codecs = ("gqsgd-linear", "gqsgd-exp")
    rows = []
    for mbit in o.model_rates:
        res, where = measure(
            AROptions(
                world_size=n, min_bytes=size, max_bytes=size, codecs=("fp32",) + codecs,
                topologies=("tree", "ring"), budget_s=2.0, rate_mbit=mbit,
            )
        )  # fmt: skip
        alpha, beta = res[("step", 0)], mbit * 1e6 / 8
        base_model = paper_model(n, size, alpha, beta, gamma)
        base = res[("fp32/tree", size)]
        rows.append(
            [f"{mbit:g}", "fp32 (none)", f"{base_model:.3f}", "", f"{base:.3f}", "", "",
             f"{res[(NATIVE, size)]:.3f}", ""]
        )  # fmt: skip
        for c in codecs:
            gh = rates[f"gamma^ {c}"]
            omega = gamma / gh
            t0 = paper_model(n, size, alpha, beta, gamma, 4.0, gh)
            # ranks sharing the cores: each rank's codec work takes n / cores as long
            td = paper_model(n, size, alpha, beta, gamma, 4.0, gh, rates[f"delta {c}"] * n / cores)
            tree, ring = res[(f"{c}/tree", size)], res[(f"{c}/ring", size)]
            cond = speedup_condition(beta, gamma, 4.0, omega)
            rows.append(
                [
                    f"{mbit:g}", c, f"{t0:.3f} ({base_model / t0:.2f}x)",
                    f"{td:.3f} ({base_model / td:.2f}x)",
                    f"{tree:.3f} ({base / tree:.2f}x)", f"{omega:.2f}",
                    f"{'yes' if cond else 'no'} / {'yes' if base / tree > 1 else 'no'}",
                    f"{ring:.3f}", f"{res[(NATIVE, size)] / ring:.2f}x",
                ]
            )  # fmt: skip
    delta = ", ".join(f"{c} {rates[f'delta {c}'] * 1e9:.2f} ns" for c in codecs)
    return (
        f"{n} Gloo ranks, {size / 2**20:g} MiB of float32 per rank, on {where.split(',')[0]} "
        f"({machine()}); model constants measured in this run: alpha = the ring step "
        f"({res[('step', 0)] * 1e6:.0f} us at the last rate), beta = the link, gamma = a "
        f"float32 add on one core ({gamma / 1e9:.2f} GB/s), gamma^ = each codec's reduce on "
        f"one core (gqsgd-linear {rates['gamma^ gqsgd-linear'] / 1e9:.2f} GB/s, gqsgd-exp "
        f"{rates['gamma^ gqsgd-exp'] / 1e9:.2f} GB/s of codes), delta = quantize + decode per "
        f"fp32 byte ({delta}; times {n}/{cores} for ranks sharing cores), rho = 4. "
        "Speed-ups in the model and on the tree are against fp32 on the tree; the ring "
        f"columns against `{NATIVE}` (Gloo's ring).\n\n"
        + markdown_table(
            [
                "Mbit/s",
                "codec",
                "model T^ (s), delta = 0",
                "model, delta measured",
                "measured tree (s)",
                "omega",
                "A.5 predicts / measured a speed-up",
                "measured ring (s)",
                f"ring vs {NATIVE}",
            ],
            rows,
        )  # fmt: skip
    )


def quality_section(o: GQSGDOptions, say: Any = None) -> str:
    """Table 4's analogue: held-out loss after ``quality_steps`` steps per codec,
    mean and spread over ``quality_seeds`` seeds."""
    import statistics

    from hopq.bench.quality import SimTraining, train
    from hopq.codecs.registry import get_codec

    out = []
    chosen = [QUALITY_CODECS[0]] + [
        row for key, row in zip(QUALITY_KEYS, QUALITY_CODECS[1:], strict=True)
        if key in o.quality_codecs
    ]  # fmt: skip
    total = len(o.quality_workloads) * len(chosen) * o.quality_seeds
    with Progress("quality", total, every=1) as bar:
        for w in o.quality_workloads:
            rows = []
            base = float("nan")
            for label, name, kw in chosen:
                held, bits = [], []
                for seed in range(o.quality_seeds):
                    cfg = SimTraining(
                        workload=w, optimizer="adamw", steps=o.quality_steps,
                        workers=o.quality_workers, batch=o.quality_batch, seed=seed,
                        topology="tree", held_out=8,
                    )  # fmt: skip
                    codec = None if name is None else get_codec(name, **kw)
                    c = train(cfg, codec)
                    held.append(c.held_out)
                    bits.append(c.bits)
                    bar.update(f"{w} {label} seed {seed}")
                mean = statistics.fmean(held)
                sd = statistics.stdev(held) if len(held) > 1 else 0.0
                if name is None:
                    base = mean
                rows.append(
                    [
                        label,
                        f"{mean:.4f} ± {sd:.4f}",
                        f"{math.exp(mean):.2f}",
                        f"{(mean - base) / base:+.2%}" if name is not None else "—",
                        "32" if name is None else f"{statistics.fmean(bits):.2f}",
                    ]
                )
            out += [
                "",
                f"**{w}**: AdamW, {o.quality_workers} workers x {o.quality_batch} sequences, "
                f"{o.quality_steps} steps, the tree all-reduce, {o.quality_seeds} seeds "
                "(weights, data order and codec randomness); held-out loss after the last "
                "step (mean ± standard deviation over the seeds):",
                "",
                markdown_table(
                    ["codec", "held-out loss", "perplexity", "vs fp32", "bits/coord"], rows
                ),
            ]
    return "\n".join(out)


def run(o: GQSGDOptions) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    parts = [
        f"Machine: {machine()}; load average {load:.1f} at the start "
        f"({os.cpu_count()} cores; timings on a loaded machine are indicative)."
    ]
    if "variance" in o.parts:
        parts.append(variance_section(o))
    if "kernels" in o.parts:
        krows = kernel_rows(o)
        parts += [
            f"The exponential reduce on one core ({o.coords} coordinates, exponents 4..39, "
            f"random signs; best of {o.repeats}):",
            "",
            markdown_table(["implementation", "M coords/s", "x float add"], krows),
        ]
    if "quality" in o.parts:
        parts.append("Training quality (the paper's Table 4):\n" + quality_section(o))
    if "costmodel" in o.parts:
        parts.append(
            "The paper's cost model (section 7) against the network:\n" + costmodel_section(o)
        )
    return "\n\n".join(parts)


def variance_section(o: GQSGDOptions) -> str:
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
    return "\n".join(
        [
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
        ]
    )
