"""One call of DynamiQ's fused segment kernel, and what a kernel module provides.

The codec cuts every chunk into width-uniform segments of whole super-groups
(:mod:`.layout`) and runs each segment through one of the four fused kernels of
section 4 (:class:`~hopq.kernels.Mode`). :class:`SegmentCall` is everything such a
run needs, built once by the codec and handed to whichever backend runs it
(:mod:`.kernels_cpu`, numba; :mod:`.kernels_triton`, Triton). Both reproduce
:func:`.reference.run_segment`, the reference's reading of the same call, bit
for bit (``tests/test_kernels.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from hopq.kernels import Mode


class Streams(NamedTuple):
    """The random streams of one encoding (:func:`.reference.streams`): hash keys
    and the correlated-rounding class (``peers`` = 1: independent rounding)."""

    gamma_key: tuple[int, int]
    perm_key: tuple[int, int]
    peers: int
    peer: int
    #: The units modulo ``peers`` the permutation's multiplier is drawn from.
    units: tuple[int, ...]
    scale_key: tuple[int, int]


@dataclass(frozen=True, slots=True)
class SegmentCall:
    """One width-uniform segment of ``rows`` super-groups in ``mode``.

    Tensors are contiguous and on the backend's device: ``payload`` and
    ``out_payload`` uint8 (exactly the segment's bytes), ``local`` and
    ``out_rows`` float32 of ``rows * S`` entries. Which ones a mode uses:

    ============== ============= ================= ================================
    mode           ``payload``   ``local``         written
    ============== ============= ================= ================================
    ``ENCODE``     -             rows to encode    ``out_payload``
    ``DECODE``     read          -                 ``out_rows``
    ``DECODE_ACC`` read          the accumulator   ``out_rows`` (may be ``local``)
    ``DAR``        read          rows to add       ``out_payload``
    ============== ============= ================= ================================
    """

    mode: Mode
    #: Bits per entry: 2, 4, 8 (quantized levels) or 16 (bfloat16).
    width: int
    #: Super-groups in the segment.
    rows: int
    #: Entries per super-group and per group.
    S: int
    s: int
    #: The segment's first super-group in the working vector: the position of
    #: its entries in the random streams.
    row0: int
    #: The level table's parameter at this width (``DynamiQConfig.eps_for``).
    eps: float
    streams: Streams
    payload: torch.Tensor | None = None
    local: torch.Tensor | None = None
    out_rows: torch.Tensor | None = None
    out_payload: torch.Tensor | None = None


class DynamiQKernels(Protocol):
    """What a DynamiQ kernel module provides (:mod:`.kernels_cpu`,
    :mod:`.kernels_triton`). Every function reproduces :mod:`.reference` bit for bit."""

    def run_segment(self, call: SegmentCall) -> None:
        """Run one segment (see :class:`SegmentCall`)."""

    def supergroup_stats(self, x: torch.Tensor, S: int) -> torch.Tensor:
        """[2, m] float32: per super-group mean and sum of squares (tree order)."""
        ...

    def gather_rows(
        self, x: torch.Tensor, perm: torch.Tensor, mu: torch.Tensor, S: int
    ) -> torch.Tensor:
        """The working vector: rows reordered by ``perm``, means subtracted."""
        ...

    def scatter_rows(
        self,
        y: torch.Tensor,
        perm: torch.Tensor,
        mu: torch.Tensor,
        S: int,
        n: int,
        avg: bool,
        d: int,
    ) -> torch.Tensor:
        """The inverse reorder with the means added back (sum or average)."""
        ...


__all__ = ["DynamiQKernels", "SegmentCall", "Streams"]
