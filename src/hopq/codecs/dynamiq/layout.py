"""DynamiQ's working-vector layout: super-groups reordered by width, chunks cut at
super-group boundaries with near-equal bytes, each chunk a few width-uniform
segments, and the plan that records it.

Chunk payload layout (the specification kernels follow), segment after segment
in chunk order:

* width 2, 4, 8 with hierarchical scales: k bfloat16 super-group scales, then
  k * S/s uint8 group scales, then k * S * w / 8 bytes of packed codes
  (code = sign << (w-1) | level, :mod:`hopq.numerics.bitpack` layout);
* width 2, 4, 8 with full-precision scales: k * S/s bfloat16 group scales, codes;
* width 16: the entries as bfloat16, stochastically rounded (k * S * 2 bytes);
* width 0 (the zero class, F_j = 0 on every rank): nothing.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

import torch

from hopq.codecs.base import Plan
from hopq.codecs.dynamiq.config import STATS_BITS, DynamiQConfig


@dataclass(frozen=True)
class Segment:
    """A run of super-groups of one width inside a chunk."""

    width: int
    lo: int  # first super-group (reordered index)
    hi: int  # one past the last
    offset: int  # byte offset in the chunk payload
    nbytes: int


@dataclass
class DynamiQPlan(Plan):
    supergroups: int
    #: Width of each super-group, in reordered order (host list).
    widths: tuple[int, ...]
    #: perm[k] = original index of the k-th reordered super-group.
    perm: torch.Tensor
    #: Global mean per super-group (original order).
    mu: torch.Tensor
    segments: tuple[tuple[Segment, ...], ...]
    #: Payload bits per coordinate the allocation planned (stats included).
    planned_bits: float
    #: Whether even the narrowest allocation exceeded the budget (tiny tensors).
    over_budget: bool
    #: The caller's schedule-chunk bounds when the engine asked for them
    #: (chunk-local layout: super-groups start at each chunk's start, and the
    #: reorder stays inside the chunk); None: one layout over the whole vector.
    bounds: tuple[int, ...] | None = None
    #: With bounds: the first super-group of each chunk (and the total at the end).
    sg_starts: tuple[int, ...] = ()
    #: Part by part (the CPU kernels, no bounds): the caller's flat float32
    #: input, whose rows ``prepare_part`` gathers into the working vector a part
    #: at a time; None: ``prepare`` gathered everything.
    source: torch.Tensor | None = None
    #: The result that ``finish_part`` scatters finished parts into.
    out: torch.Tensor | None = None
    prepared: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    #: The power of two the working vector is scaled by (``mu`` is already):
    #: below 1 only where a super-group's values come near float32's limit
    #: (:meth:`~hopq.codecs.dynamiq.codec.DynamiQ.plan`), so that no partial
    #: sum of the working vector overflows; ``finish`` scales back.
    prescale: float = 1.0

    def chunk_segments(self, chunk: int) -> tuple[tuple[Segment, ...], int]:
        """The segments of ``chunk`` and the reordered index of its first super-group."""
        segs = self.segments[chunk]
        return segs, (segs[0].lo if segs else 0)


def split_chunks(cum: torch.Tensor, lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """Cut super-groups lo .. hi (``cum``: their bytes' running sum from 0, a
    float64 tensor with one more entry) into ``parts`` runs of near-equal bytes:
    a super-group joins run c when the byte count at its middle is at most c/parts
    of the total."""
    base = cum[lo]
    total = int(cum[hi] - base)
    mids = (cum[lo:hi] + cum[lo + 1 : hi + 1]) / 2 - base  # halves of integers: exact
    targets = torch.tensor([total * c / parts for c in range(1, parts)], dtype=torch.float64)
    cuts = torch.searchsorted(mids, targets, right=True).tolist()
    bounds = [lo, *(lo + k for k in cuts), hi]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def nested_split(
    cum: torch.Tensor, lo: int, hi: int, n_chunks: int, microshards: int
) -> list[tuple[int, int]]:
    """:func:`split_chunks` into ``n_chunks``, each cut again into ``microshards``
    runs of near-equal bytes: schedule chunks do not depend on the microshards."""
    out: list[tuple[int, int]] = []
    for a, b in split_chunks(cum, lo, hi, n_chunks):
        out += [(a, b)] if microshards == 1 else split_chunks(cum, a, b, microshards)
    return out


def _stable_order(w: torch.Tensor) -> torch.Tensor:
    """``torch.argsort(w, stable=True)`` for widths (0..16): numpy's radix sort of
    bytes, 8x faster for a 16 MiB call's 16K super-groups; torch's on a
    torch-only install."""
    try:
        import numpy as np
    except ImportError:
        return torch.argsort(w, stable=True)
    return torch.from_numpy(np.argsort(w.numpy().astype(np.uint8), kind="stable"))


def build_plan(
    cfg: DynamiQConfig,
    d: int,
    widths: torch.Tensor | list[int],
    n_chunks: int,
    mu: torch.Tensor,
    budget: float,
    microshards: int = 1,
    bounds: tuple[int, ...] | None = None,
    sg_starts: tuple[int, ...] = (),
    stats_weight: float = 1.0,
) -> DynamiQPlan:
    """The plan of ``d`` coordinates whose super-groups got ``widths`` (original
    order), cut into ``n_chunks`` schedule chunks of ``microshards`` parts each.

    With ``bounds`` (the caller's chunk bounds; ``sg_starts`` the first
    super-group of each chunk), chunk c is the super-groups of the caller's
    chunk c, reordered among themselves: chunks then differ in bytes. Tensor
    operations throughout: the Python loop per super-group it replaces took
    8 ms for 4M coordinates, this about half."""
    S = cfg.supergroup_size
    w = torch.as_tensor(widths, dtype=torch.int64)
    m = w.numel()
    ranges = [(0, m)] if bounds is None else list(zip(sg_starts, sg_starts[1:], strict=False))
    # stable: by width, then position (within each of the caller's chunks)
    parts = [lo + _stable_order(w[lo:hi]) for lo, hi in ranges if hi > lo]
    order = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    sw = w[order]
    sorted_widths = tuple(sw.tolist())
    perm = order.to(mu.device)
    # runs of one width: segments are the pieces of a chunk between width changes
    changes = (torch.nonzero(sw[1:] != sw[:-1]).reshape(-1) + 1).tolist()
    lut = torch.zeros(int(w.max()) + 1 if m else 1, dtype=torch.int64)
    for v in {sorted_widths[k] for k in [0, *changes][: len(changes) + (m > 0)]}:
        lut[v] = cfg.sg_bits(v) // 8  # every run's width: each value present
    cum64 = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lut[sw], 0)])
    cum = cum64.double()  # exact below 2^53 bytes
    if bounds is None:
        chunks_sg = nested_split(cum, 0, m, n_chunks, microshards)
    else:
        chunks_sg = []
        for lo, hi in ranges:
            chunks_sg += nested_split(cum, lo, hi, 1, microshards)
    # byte offsets only where segments start or end (16K entries as a list: 0.2 ms)
    at = sorted({0, m, *changes, *(k for c in chunks_sg for k in c)})
    offsets = dict(zip(at, cum64[at].tolist(), strict=True))
    segments = []
    for lo, hi in chunks_sg:
        cuts = [lo, *changes[bisect_right(changes, lo) : bisect_left(changes, hi)], hi]
        segs = []
        for k, e in zip(cuts, cuts[1:], strict=False):
            if e > k:
                segs.append(
                    Segment(
                        sorted_widths[k], k, e, offsets[k] - offsets[lo], offsets[e] - offsets[k]
                    )
                )
        segments.append(tuple(segs))
    sg_bytes_total = offsets[m]
    total_bits = 8 * sg_bytes_total + stats_weight * STATS_BITS * m
    return DynamiQPlan(
        numel=d,
        work_numel=m * S,
        chunks=tuple((lo * S, hi * S) for lo, hi in chunks_sg),
        payload_nbytes=tuple(sum(s.nbytes for s in segs) for segs in segments),
        supergroups=m,
        widths=sorted_widths,
        perm=perm,
        mu=mu,
        segments=tuple(segments),
        planned_bits=total_bits / d if d else 0.0,
        over_budget=bool(d) and total_bits > budget * d + 1e-9,
        bounds=bounds,
        sg_starts=sg_starts,
    )
