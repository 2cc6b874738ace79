"""Packing of 1, 2, 4 and 8-bit codes into uint8.

Layout (the specification kernels follow): element ``i`` of a run of ``b``-bit
codes lives in byte ``i // (8 // b)`` at bit offset ``(i % (8 // b)) * b``
(little-endian within the byte). A run of ``n`` codes takes ``ceil(n*b/8)``
bytes; the unused high bits of the last byte are zero.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 4, 8)


def _check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bit width {bits} not in {SUPPORTED_BITS}")
    return 8 // bits


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits."""
    _check_bits(bits)
    return (n * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes (each < 2**bits) into bytes."""
    per = _check_bits(bits)
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise TypeError("pack_bits expects a 1-D uint8 tensor of codes")
    if per == 1:
        return codes.clone()
    n = codes.numel()
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    c = codes.view(-1, per)
    out = c[:, 0].clone()
    for j in range(1, per):
        out |= c[:, j] << (j * bits)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as uint8."""
    per = _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError("unpack_bits expects a 1-D uint8 tensor")
    if packed.numel() < packed_nbytes(n, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits")
    if per == 1:
        return packed[:n].clone()
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed[: packed_nbytes(n, bits)].unsqueeze(1) >> shifts) & mask
    return codes.reshape(-1)[:n]
