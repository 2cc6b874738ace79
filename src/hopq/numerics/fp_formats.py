"""Small floating-point formats: OCP MX elements E4M3, E3M2, E2M1 and helpers.

Each element format is a sign bit plus an exponent/mantissa magnitude field;
for all three the magnitude codes are ordered like their values, so a sorted
table of the representable magnitudes *is* the code book. Encoding rounds to
nearest, ties to the even code, after clamping to the largest finite value
(done explicitly, so results do not depend on a torch version's cast rules).
E4M3 uses torch's float8_e4m3fn cast (same rounding); E3M2 and E2M1 have no
torch dtype and are encoded through the table here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class ElementFormat:
    name: str
    exp_bits: int
    man_bits: int
    bias: int
    #: E4M3 ("fn") spends its top code on NaN: the last magnitude code is not a number.
    nan_top: bool

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    def magnitude(self, code: int) -> float:
        """Value of a magnitude code (exponent and mantissa fields), per the OCP spec."""
        e, m = code >> self.man_bits, code & ((1 << self.man_bits) - 1)
        if e == 0:
            return m / (1 << self.man_bits) * 2.0 ** (1 - self.bias)
        return (1 + m / (1 << self.man_bits)) * 2.0 ** (e - self.bias)

    @property
    def n_magnitudes(self) -> int:
        """Number of finite magnitude codes."""
        return (1 << (self.bits - 1)) - (1 if self.nan_top else 0)

    @property
    def max(self) -> float:
        return self.magnitude(self.n_magnitudes - 1)


E4M3 = ElementFormat("e4m3", 4, 3, 7, nan_top=True)  # max 448
E3M2 = ElementFormat("e3m2", 3, 2, 3, nan_top=False)  # max 28
E2M1 = ElementFormat("e2m1", 2, 1, 1, nan_top=False)  # max 6


@lru_cache(maxsize=8)
def _table(fmt: ElementFormat) -> tuple[float, ...]:
    return tuple(fmt.magnitude(c) for c in range(fmt.n_magnitudes))


def magnitudes(fmt: ElementFormat, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 table of the finite magnitudes, index = magnitude code."""
    return torch.tensor(_table(fmt), dtype=torch.float32, device=device)


def encode(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """float32 values -> uint8 codes (sign << (bits-1) | magnitude code), round to
    nearest even after clamping finite values to +-max. Non-finite values map to
    the largest magnitude (E3M2 and E2M1 cannot express them; callers poison the
    block scale instead)."""
    mx = fmt.max
    a = torch.nan_to_num(v.abs(), nan=mx, posinf=mx).clamp_(max=mx)
    sign = (v < 0).to(torch.uint8) << (fmt.bits - 1)
    if fmt is E4M3:
        mag = a.to(torch.float8_e4m3fn).view(torch.uint8)
        return mag | sign
    table = magnitudes(fmt, v.device)
    hi = torch.searchsorted(table, a).clamp_(max=table.numel() - 1)
    lo = (hi - 1).clamp_(min=0)
    dlo = a - table[lo]
    dhi = table[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    mag = torch.where(pick_hi, hi, lo).to(torch.uint8)
    return mag | sign


def decode(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """uint8 codes -> float32 values."""
    top = 1 << (fmt.bits - 1)
    c = codes.to(torch.int64)
    mag_code = c & (top - 1)
    if fmt.nan_top:
        table = torch.cat(
            [magnitudes(fmt, codes.device), torch.tensor([float("nan")], device=codes.device)]
        )
    else:
        table = magnitudes(fmt, codes.device)
    mag = table[mag_code]
    return torch.where(c >= top, -mag, mag)


def round_up_bf16(m: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """float32 >= 0 -> the smallest bfloat16 >= it (NaN and Inf preserved). With
    ``saturate``, a finite value above the largest bfloat16 gives that largest
    value instead of Inf (finite in, finite out)."""
    bits = m.contiguous().view(torch.int32).to(torch.int64)
    up = (bits + 0xFFFF) >> 16
    if saturate:
        up = torch.where((up == 0x7F80) & (bits < 0x7F800000), 0x7F7F, up)
    return up.to(torch.int16).view(torch.bfloat16)


def round_up_pow2(m: torch.Tensor) -> torch.Tensor:
    """float32 > 0 -> the smallest power of two >= it (the OCP E8M0 scale); 0 -> 0."""
    mant, exp = torch.frexp(m)
    p = torch.ldexp(torch.ones_like(m), exp.to(torch.int32))  # 2^exp > m >= 2^(exp-1)
    out = torch.where(mant == 0.5, m, p)
    return torch.where(torch.isfinite(m) & (m > 0), out, m)


#: The largest finite bfloat16 (and the largest power of two in float32, the
#: largest E8M0 scale).
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
POW2_MAX = 2.0**127


def keep_finite(rounded: torch.Tensor, original: torch.Tensor, limit: float) -> torch.Tensor:
    """``rounded`` with the entries that rounding (or scaling) pushed to infinity
    from a finite ``original`` saturated at +-``limit``: finite in, finite out;
    NaN and Inf inputs stay as they are."""
    over = torch.isinf(rounded) & torch.isfinite(original)
    if not bool(over.any()):
        return rounded
    return torch.where(
        over, torch.copysign(torch.tensor(limit, dtype=rounded.dtype), rounded), rounded
    )
