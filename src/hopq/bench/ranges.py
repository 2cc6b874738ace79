"""``hopq bench ranges``: what range of magnitudes each codec handles.

For every registered codec, n simulated ranks each contribute N(0, 1) x scale for
scales from 1e-40 (subnormal) to 1e38, and, separately, N(0, 1) values with one
outlier of a given magnitude at a position of its own on each rank. A codec
*handles* a case when its output is finite and its vNMSE is within 100x of its
vNMSE at scale 1 (or 1e-6, whichever is larger). The contract (finite in,
finite out) is that a non-finite output appears only where a float32 sum of the
inputs can overflow (the sum of their magnitudes exceeds float32's range: plain
fp32 overflows there too); the table counts every violation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hopq.codecs.registry import codec_choices, codec_info, resolve_codecs
from hopq.comm.topology import TOPOLOGIES
from hopq.options import option
from hopq.reporting import machine, markdown_table

SCALES = tuple(10.0**e for e in range(-40, 39, 2))
OUTLIERS = (1e30, 1e34, 1e36, 1e37, 1e38, 3e38)


@dataclass(frozen=True)
class RangeOptions:
    codecs: tuple[str, ...] = option(("all",), "codecs to scan", choices=codec_choices)
    world_size: int = option(4, "simulated ranks")
    size: int = option(4099, "coordinates per rank")
    topology: str = option("ring", "schedule", choices=lambda: sorted(TOPOLOGIES))
    seed: int = option(0, "seed of the data and the codecs")

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.size < 1:
            raise ValueError("world_size and size must be >= 1")
        resolve_codecs(self.codecs)


def _case(codec: str, xs: list[torch.Tensor], o: RangeOptions) -> tuple[float, bool, bool]:
    """(vNMSE, output finite unless a float32 sum can overflow, no float32 sum can
    overflow). Where the sum of magnitudes exceeds float32's range at some
    position, a partial sum may overflow even uncompressed (fp32 does there)."""
    from hopq.sim import simulate

    stacked = torch.stack([x.double() for x in xs])
    exact = stacked.sum(0)
    r = simulate(xs, codec, o.topology, seed=o.seed)
    out = r.outputs[0].double()
    ok_exact = bool((stacked.abs().sum(0) <= torch.finfo(torch.float32).max).all())
    # where some float32 sum can overflow, block-scaled codecs may spread the
    # overflow's Inf/NaN over its block (as they spread a NaN input): allowed
    bad = ok_exact and not bool(torch.isfinite(out).all())
    if bad or not ok_exact:
        return math.inf, not bad, ok_exact
    err = float((out - exact).square().sum())
    ref = float(exact.square().sum())
    return (err / ref if ref > 0 else (0.0 if err == 0 else math.inf)), True, True


def _data(o: RangeOptions, scale: float, outlier: float | None) -> list[torch.Tensor]:
    xs = []
    for r in range(o.world_size):
        g = torch.Generator().manual_seed(o.seed * 1000 + r)
        x = torch.randn(o.size, generator=g, dtype=torch.float64) * scale
        if outlier is not None:
            x[(r * 997) % o.size] = outlier
        big = torch.finfo(torch.float32).max
        xs.append(x.clamp(-big, big).float())  # finite input, always
    return xs


def run(o: RangeOptions) -> str:
    rows = []
    for codec in resolve_codecs(o.codecs):
        if codec_info(codec).refusal(
            dtype=torch.float32, device=torch.device("cpu"), topology=o.topology
        ):
            continue
        base, _, _ = _case(codec, _data(o, 1.0, None), o)
        bound = max(100 * base, 1e-6)
        handled, violations, worst = [], 0, 0.0
        for s in SCALES:
            v, finite_ok, exact_ok = _case(codec, _data(o, s, None), o)
            violations += not finite_ok
            if exact_ok and finite_ok and v <= bound:
                handled.append(s)
            if exact_ok and finite_ok:
                worst = max(worst, v)
        outl = []
        for m in OUTLIERS:
            v, finite_ok, exact_ok = _case(codec, _data(o, 1.0, m), o)
            violations += not finite_ok
            outl.append(
                "overflow" if not exact_ok else ("NaN/Inf!" if not finite_ok else f"{v:.0e}")
            )
        lo_hi = f"{min(handled):.0e} .. {max(handled):.0e}" if handled else "none"
        rows.append([codec, f"{base:.1e}", lo_hi, str(violations), *outl])
    head = (
        f"{o.world_size} simulated ranks, {o.topology}, {o.size} coordinates each, seed {o.seed}; "
        f"machine: {machine()}.\n\n"
        "'handled': the scales s (N(0,1) x s on every rank, s = 1e-40 .. 1e38 in steps of 100x) "
        "whose output is finite with vNMSE within 100x of the codec's vNMSE at s = 1 (or 1e-6). "
        "'NaN/Inf from finite': cases (scales and outliers) where the output was non-finite "
        "although no float32 sum of the inputs can overflow (the sum of their magnitudes is "
        "within float32's range); the contract says 0. The outlier columns: N(0,1) values plus "
        "one entry of that magnitude per rank at a position of its own; vNMSE, or 'overflow' "
        "where a float32 sum can overflow.\n\n"
    )
    return head + markdown_table(
        [
            "codec",
            "vNMSE at s = 1",
            "handled scales",
            "NaN/Inf from finite",
            *[f"outlier {m:.0e}" for m in OUTLIERS],
        ],
        rows,
    )
