"""DynamiQ's configuration: its knobs, their choices and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from hopq.codecs.base import CodecConfig
from hopq.numerics.levels import level_table
from hopq.options import check_int, check_options, int_tuple, option

SUPPORTED_WIDTHS = (2, 4, 8, 16)
#: Bits of the statistics exchange per super-group: mean and sum of squares in bfloat16.
STATS_BITS = 32
#: Largest super-group: the paper uses 256; beyond a few thousand a small tensor
#: pads to one huge super-group (2**24 would pad 12 entries to 16M).
MAX_SUPERGROUP = 4096

#: eps of the non-uniform levels per width: the lowest vNMSE of the sweep in
#: ``hopq bench vnmse --tables eps`` on MiniLM gradients, n = 4, ring
#: (docs/bench/vnmse.md, "Choosing eps": 4 bits 0.0356 at eps 0.3 vs 0.0459
#: uniform; 8 bits 1.6e-4 at 0.08 vs 2.0e-4 uniform). Two-bit codes have two
#: levels, {0, 1}: no eps.
DEFAULT_EPS: dict[int, float] = {2: 0.0, 4: 0.3, 8: 0.08}


class Allocation(str, Enum):
    #: Appendix A: thresholds tied by T_{2,4} = 17/512 T_{4,8}, offset u searched.
    HEURISTIC = "heuristic"
    #: Greedy by estimated error reduction per bit (beyond the paper).
    EXACT = "exact"
    #: One width for all: the widest that fits the budget (ablation).
    FIXED = "fixed"


class Levels(str, Enum):
    NONUNIFORM = "nonuniform"
    UNIFORM = "uniform"


class Scales(str, Enum):
    HIERARCHICAL = "hierarchical"  # bf16 super-group max + uint8 group fractions
    FULL = "full"  # a bfloat16 scale per group (ablation)


class Backend(str, Enum):
    #: The first available kernel backend for the tensor's device
    #: (:mod:`hopq.kernels`), else the reference.
    AUTO = "auto"
    REFERENCE = "reference"
    #: hopq.codecs.dynamiq.kernels_triton (CUDA tensors; on CPU only under TRITON_INTERPRET=1).
    TRITON = "triton"
    #: hopq.codecs.dynamiq.kernels_cpu (CPU tensors, numba).
    CPU = "cpu"


class Rounding(str, Enum):
    #: Correlated among the encoders of a chunk at equal tree depth (disjoint
    #: subtrees); unbiased. On a ring every depth has one encoder: independent.
    CORRELATED = "correlated"
    INDEPENDENT = "independent"
    #: The paper's formula over all n encoders of the chunk's path. Biased in
    #: multi-hop: a hop rounds a value that holds the previous hops' rounding.
    PATH = "path"


def _eps_value(e: Any) -> float:
    if isinstance(e, bool) or not isinstance(e, int | float):
        raise TypeError(f"dynamiq: eps values must be numbers, got {e!r}")
    return float(e)


@dataclass(frozen=True)
class DynamiQConfig(CodecConfig):
    """DynamiQ's knobs. The defaults are hopq's best measured configuration: the
    paper's (section 5) plus the exact allocation, the 16-bit class and the zero
    class, which together lowered vNMSE at the same 5.00 measured bits by 28% on
    MiniLM fine-tuning gradients and 15% on the GPT's, and groups of 32 entries
    instead of 16 (half the group scales' bits go to the entries instead), which
    lowered it by another 19-21% on MiniLM and 8-10% on the GPT (``hopq bench
    vnmse --tables beyond``, docs/bench/vnmse.md). The paper's configuration is
    one option away: ``allocation="heuristic", widths=(2, 4, 8),
    zero_class=False, group_size=16`` (``PAPER``)."""

    budget: float = option(
        5.0, "bits per coordinate, payload, scales and statistics included", gt=0.0, hi=64.0
    )
    widths: tuple[int, ...] = option(
        (2, 4, 8, 16),
        "bit widths a super-group may get (subset of 2 4 8 16; the paper: 2 4 8)",
        choices=SUPPORTED_WIDTHS,
    )
    group_size: int = option(
        32,
        "entries per group (one scale each), a power of two (the paper: 16)",
        lo=1,
        hi=MAX_SUPERGROUP,
    )
    supergroup_size: int = option(
        256, "entries per super-group (one width each), a power of two", lo=1, hi=MAX_SUPERGROUP
    )
    allocation: Allocation = option(
        Allocation.EXACT, "how widths are chosen from statistics (the paper: heuristic)"
    )
    levels: Levels = option(Levels.NONUNIFORM, "quantization levels")
    scales: Scales = option(Scales.HIERARCHICAL, "scale format")
    rounding: Rounding = option(Rounding.CORRELATED, "stochastic rounding across encoders")
    zero_class: bool = option(
        True,
        "super-groups with F_j = 0 on every rank cost nothing and come out exact (the paper: off)",
    )
    #: eps per width, as ((width, eps), ...); None: DEFAULT_EPS.
    eps: tuple[tuple[int, float], ...] | None = option(
        None,
        "eps of the non-uniform levels per width, ((width, eps), ...)",
        invalid=((4, -0.1),),
    )
    backend: Backend = option(Backend.AUTO, "implementation of encode/decode (same bits)")
    share_budget: bool = option(
        True, "keyed calls (DDP buckets) share one bit budget per step (beyond the paper)"
    )
    optimizer_weights: bool = option(
        True,
        "given the optimizer (HookState(optimizer=...)), weigh each coordinate's energy by "
        "its step size squared (Adam: lr / (sqrt(v) + eps)), so the allocation minimises the "
        "update's error, not the gradient's (beyond the paper)",
    )

    small_call_fallback: bool = option(
        True,
        "calls too small for the budget to give every super-group the width a large call "
        "gets run bf16 (RunStats.fallback names it; docs/codecs/dynamiq.md); False: "
        "DynamiQ at any size",
    )

    def __post_init__(self) -> None:
        check_options(self, "dynamiq")
        widths = tuple(sorted(set(int_tuple("dynamiq: widths", self.widths))))
        if not widths or any(w not in SUPPORTED_WIDTHS for w in widths):
            raise ValueError(
                f"dynamiq: widths must be a non-empty subset of {SUPPORTED_WIDTHS}, got {self.widths}"
            )
        object.__setattr__(self, "widths", widths)
        s = check_int("dynamiq: group_size", self.group_size, lo=1)
        S = check_int("dynamiq: supergroup_size", self.supergroup_size, lo=1, hi=MAX_SUPERGROUP)
        for name, v in (("group_size", s), ("supergroup_size", S)):
            if v & (v - 1):
                raise ValueError(f"dynamiq: {name} must be a power of two, got {v}")
        if S % s:
            raise ValueError(f"dynamiq: group_size {s} does not divide supergroup_size {S}")
        if s < 2 and self.scales is Scales.HIERARCHICAL:
            raise ValueError("dynamiq: hierarchical scales need groups of at least 2 entries")
        floor = min(self.sg_bits(w) for w in widths) / S + STATS_BITS / S
        if not self.budget >= floor:
            raise ValueError(
                f"dynamiq: budget {self.budget} bits/coordinate is below the metadata cost: the narrowest "
                f"width {widths[0]} already takes {floor:.4f} with scales and statistics (S={S}, s={s})"
            )
        if self.eps is not None:
            if not isinstance(self.eps, tuple | list) or not all(
                isinstance(p, tuple | list) and len(p) == 2 for p in self.eps
            ):
                raise TypeError(f"dynamiq: eps must be ((width, eps), ...), got {self.eps!r}")
            pairs = tuple((check_int("dynamiq: eps width", w), _eps_value(e)) for w, e in self.eps)
            seen = [w for w, _ in pairs]
            if len(set(seen)) != len(seen):
                raise ValueError(f"dynamiq: eps names each width at most once, got widths {seen}")
            for w, e in pairs:
                if w not in SUPPORTED_WIDTHS or not (math.isfinite(e) and e >= 0):
                    raise ValueError(
                        f"dynamiq: eps must be >= 0 per supported width, got {self.eps}"
                    )
                if e and w not in (4, 8):  # 2 bits: levels {0, 1}; 16 bits: bfloat16
                    raise ValueError(
                        f"dynamiq: eps shapes the 4- and 8-bit level tables only, got {e} "
                        f"for width {w}"
                    )
                if e and self.levels is Levels.UNIFORM:
                    raise ValueError(
                        f"dynamiq: eps {e} for width {w} shapes non-uniform levels; "
                        "levels='uniform' would ignore it"
                    )
                if e and w not in widths:
                    raise ValueError(
                        f"dynamiq: eps {e} for width {w}, which is not among the widths "
                        f"{tuple(widths)}: it would be ignored"
                    )
            object.__setattr__(self, "eps", pairs)
        for w in widths:  # the level table must exist (a large eps overflows it)
            if w in (2, 4, 8):
                try:
                    table = level_table(w, self.eps_for(w))
                except OverflowError:
                    table = torch.full((2,), math.nan)
                if not bool(table.isfinite().all()) or not bool((table[1:] > table[:-1]).all()):
                    raise ValueError(
                        f"dynamiq: eps {self.eps_for(w)} gives no usable {w}-bit level table "
                        "(levels overflow or coincide in float32)"
                    )

    def eps_for(self, width: int) -> float:
        if self.levels is Levels.UNIFORM:
            return 0.0
        table = dict(self.eps) if self.eps is not None else DEFAULT_EPS
        return table.get(width, DEFAULT_EPS.get(width, 0.0))

    def meta_bits(self, width: int) -> int:
        """Scale bits per super-group of this width."""
        if width in (0, 16):
            return 0
        groups = self.supergroup_size // self.group_size
        return 16 * groups if self.scales is Scales.FULL else 16 + 8 * groups

    def sg_bits(self, width: int) -> int:
        """Payload bits of one super-group (codes and scales)."""
        return self.supergroup_size * width + self.meta_bits(width)


#: The paper's configuration (section 5), where hopq's defaults depart from it:
#: ``DynamiQ(**PAPER)``.
PAPER: dict[str, Any] = {
    "allocation": "heuristic",
    "widths": (2, 4, 8),
    "zero_class": False,
    "group_size": 16,
}
