"""Packing of fixed-width codes into bytes: one layout for every width.

Layout (the specification kernels follow): the codes form a little-endian bit
stream: code ``i`` of ``b`` bits occupies stream bits ``[i b, (i + 1) b)``, and
stream bit ``k`` is bit ``k % 8`` of byte ``k // 8``. For b = 1, 2, 4, 8 code
``i`` lives in byte ``i // (8 // b)`` at bit offset ``(i % (8 // b)) * b``; six-bit
codes (MXFP6) go four to three bytes, twelve-bit lanes (THC) two to three. A run
of ``n`` codes takes ``ceil(n b / 8)`` bytes; the unused high bits of the last
byte are zero.

Codes of up to 8 bits are uint8; wider codes are any integer dtype holding
values in ``[0, 2**b)`` (callers mask two's-complement values with
``(1 << b) - 1`` and undo it with :func:`sign_extend`).
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (1, 2, 4, 6, 8, 12, 16)


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group of ``bits``-bit codes."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bit width {bits} not in {SUPPORTED_BITS}")
    span = math.lcm(bits, 8)
    return span // bits, span // 8


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits."""
    _group(bits)
    return (n * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D tensor of codes (each < 2**bits) into bytes."""
    per, nbytes = _group(bits)
    narrow = bits <= 8
    if codes.dim() != 1 or (codes.dtype != torch.uint8 if narrow else codes.is_floating_point()):
        raise TypeError(
            f"pack_bits expects a 1-D {'uint8' if narrow else 'integer'} tensor of {bits}-bit codes"
        )
    n = codes.numel()
    if bits == 8:
        return codes.clone()
    if bits == 16:
        return codes.to(torch.int32).to(torch.int16).view(torch.uint8).clone()
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if nbytes == 1:  # 1, 2, 4 bits: OR the codes of one byte together in uint8
        c = codes.view(-1, per)
        out = c[:, 0].clone()
        for j in range(1, per):
            out |= c[:, j] << (j * bits)
        return out
    c = codes.to(torch.int64).view(-1, per)
    word = c[:, 0].clone()
    for j in range(1, per):
        word |= c[:, j] << (j * bits)
    out = torch.stack([(word >> (8 * k)) & 0xFF for k in range(nbytes)], 1).to(torch.uint8)
    return out.reshape(-1)[: packed_nbytes(n, bits)]


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes, as uint8 for widths up
    to 8 bits and int64 beyond."""
    per, nbytes = _group(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError("unpack_bits expects a 1-D uint8 tensor")
    need = packed_nbytes(n, bits)
    if packed.numel() < need:
        raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return packed[:n].clone()
    if nbytes == 1:
        mask = (1 << bits) - 1
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed[:need].unsqueeze(1) >> shifts) & mask
        return codes.reshape(-1)[:n]
    groups = -(-n // per)
    b = packed[:need].to(torch.int64)
    if groups * nbytes > need:
        b = torch.cat([b, b.new_zeros(groups * nbytes - need)])
    b = b.view(groups, nbytes)
    word = b[:, 0].clone()
    for k in range(1, nbytes):
        word |= b[:, k] << (8 * k)
    mask = (1 << bits) - 1
    codes = torch.stack([(word >> (j * bits)) & mask for j in range(per)], 1)
    return codes.reshape(-1)[:n]


def sign_extend(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Two's-complement ``bits``-bit values held as non-negative integers -> signed."""
    return v - ((v >> (bits - 1)) & 1) * (1 << bits)
