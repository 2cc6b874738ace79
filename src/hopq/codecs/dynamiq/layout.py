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

from dataclasses import dataclass

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

    def chunk_segments(self, chunk: int) -> tuple[tuple[Segment, ...], int]:
        """The segments of ``chunk`` and the reordered index of its first super-group."""
        segs = self.segments[chunk]
        return segs, (segs[0].lo if segs else 0)


def split_chunks(sg_bytes: list[int], n_chunks: int) -> list[tuple[int, int]]:
    """Cut the reordered super-groups into n_chunks runs of near-equal bytes."""
    m = len(sg_bytes)
    total = sum(sg_bytes)
    bounds = [0]
    acc = 0
    k = 0
    for c in range(1, n_chunks):
        target = total * c / n_chunks
        while k < m and acc + sg_bytes[k] / 2 <= target:
            acc += sg_bytes[k]
            k += 1
        bounds.append(k)
    bounds.append(m)
    return [(bounds[i], bounds[i + 1]) for i in range(n_chunks)]


def nested_split(sg_bytes: list[int], n_chunks: int, microshards: int) -> list[tuple[int, int]]:
    """:func:`split_chunks` into ``n_chunks``, each cut again into ``microshards``
    runs of near-equal bytes: schedule chunks do not depend on the microshards."""
    out: list[tuple[int, int]] = []
    for lo, hi in split_chunks(sg_bytes, n_chunks):
        if microshards == 1:
            out.append((lo, hi))
            continue
        out += [(lo + a, lo + b) for a, b in split_chunks(sg_bytes[lo:hi], microshards)]
    return out


def build_plan(
    cfg: DynamiQConfig,
    d: int,
    widths: list[int],
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
    chunk c, reordered among themselves: chunks then differ in bytes."""
    S = cfg.supergroup_size
    m = len(widths)
    if bounds is None:
        order = sorted(range(m), key=lambda j: widths[j])  # stable: by width, then position
    else:
        order = []
        for lo, hi in zip(sg_starts, sg_starts[1:], strict=False):
            order += sorted(range(lo, hi), key=lambda j: widths[j])
    sorted_widths = tuple(widths[j] for j in order)
    perm = torch.tensor(order, dtype=torch.int64, device=mu.device)
    cost = {w: cfg.sg_bits(w) // 8 for w in set(sorted_widths)}
    sg_bytes = [cost[w] for w in sorted_widths]
    if bounds is None:
        chunks_sg = nested_split(sg_bytes, n_chunks, microshards)
    else:
        chunks_sg = []
        for lo, hi in zip(sg_starts, sg_starts[1:], strict=False):
            chunks_sg += [
                (lo + a, lo + b) for a, b in nested_split(sg_bytes[lo:hi], 1, microshards)
            ]
    segments = []
    for lo, hi in chunks_sg:
        segs = []
        off = 0
        k = lo
        while k < hi:
            w = sorted_widths[k]
            e = k
            while e < hi and sorted_widths[e] == w:
                e += 1
            nb = sum(sg_bytes[k:e])
            segs.append(Segment(w, k, e, off, nb))
            off += nb
            k = e
        segments.append(tuple(segs))
    total_bits = 8 * sum(sg_bytes) + stats_weight * STATS_BITS * m
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
