"""What a Global-QSGD kernel module provides (:mod:`.kernels_cpu`): the protocol the
codecs of :mod:`.codec` call their kernels through."""

from __future__ import annotations

from typing import Protocol

import torch


class GQSGDExpKernels(Protocol):
    """What a Global-QSGD kernel module provides (:mod:`.kernels_cpu`): both codecs'
    leaf quantization and the exponential reduce of :mod:`.codec`,
    bit for bit."""

    def linear_quantize(
        self,
        x: torch.Tensor,
        factor: float,
        levels: int,
        key: tuple[int, int],
        start: int = 0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gqsgd-linear's leaf integers (float32) of element indices start..,
        into ``out`` (may be ``x``) when given."""
        ...

    def exp_quantize(
        self,
        x: torch.Tensor,
        scale: float,
        chain: int,
        key: tuple[int, int],
        start: int = 0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gqsgd-exp's leaf codes (signed exponents, float32)."""
        ...

    def linear_hop(
        self,
        acc: torch.Tensor,
        body: torch.Tensor,
        bits: int,
        limit: int,
        out: torch.Tensor | None = None,
    ) -> int:
        """gqsgd-linear's hop on 4-, 8- or 16-bit lanes; returns the number of
        out-of-range lanes or sums."""
        ...

    def linear_unpack(self, body: torch.Tensor, bits: int, limit: int, out: torch.Tensor) -> int:
        """gqsgd-linear's lanes as float32 into ``out``; returns the number beyond
        +-limit."""
        ...

    def linear_pack(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """gqsgd-linear's float32 integers packed into lanes."""
        ...

    def linear_finish(
        self,
        y: torch.Tensor,
        factor: float,
        divisor: float,
        limit: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gqsgd-linear's decode of the integer sums."""
        ...

    def exp_finish(
        self,
        y: torch.Tensor,
        scale: float,
        chain: int,
        divisor: float,
        limit: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gqsgd-exp's decode of the signed exponent codes."""
        ...

    def exp_reduce(
        self,
        acc: torch.Tensor,
        body: torch.Tensor,
        key: tuple[int, int],
        start: int,
        emin: int,
        out: torch.Tensor | None = None,
    ) -> int:
        """acc <- exp_reduce(acc, codes of body) in place, out <- its bytes; returns
        the number of invalid codes in body."""
        ...


__all__ = ["GQSGDExpKernels"]
