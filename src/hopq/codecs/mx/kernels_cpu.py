"""MXFP8/6/4's CPU kernels (numba): encode, decode (or accumulate) and the fused
hop, block by block; the same bits as :class:`hopq.codecs.mx.MXCodec`'s
reference (``tests/test_mx_kernels.py`` holds them to it). The reference builds
each hop from a dozen whole-chunk tensor operations (the scaled values, the
saturation count, a table search, the bit packing through int64 words); here
a block of 32 is scaled, rounded and packed in one pass while it is in cache.
numba is optional (``hopq[cpu]``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from hopq.kernels import backend
from hopq.numerics import fp_formats as fpf

_FLOAT_MAX = float(torch.finfo(torch.float32).max)


def available() -> bool:
    return backend("mxfp8", "cpu").available()


def _jit() -> Any:
    from hopq.codecs.mx import _kernels_cpu_jit  # compiled or loaded on first use

    return _kernels_cpu_jit


def supports(fmt: fpf.ElementFormat, block: int) -> bool:
    """Whether every block starts on a byte (the kernels pack block by block)."""
    return (block * fmt.bits) % 8 == 0


@lru_cache(maxsize=8)
def _consts(fmt: fpf.ElementFormat) -> tuple[Any, ...]:
    """(FMAX, the largest scale with v * s finite, magnitude table)."""
    fmax = np.float32(fmt.max)
    # the reference compares float32 s with the Python float FLT_MAX / FMAX,
    # which torch casts to float32
    safe = np.float32(_FLOAT_MAX / fmt.max)
    mags = fpf.magnitudes(fmt).numpy()
    top = 1 << (fmt.bits - 1)
    table = np.full(top, np.nan, np.float32)
    table[: mags.size] = mags
    return fmax, safe, table


def encode(
    x: torch.Tensor, scale: torch.Tensor, fmt: fpf.ElementFormat, block: int
) -> tuple[torch.Tensor, int]:
    """(payload, saturated count) of the contiguous float32 chunk x, whose
    blocks' scales are ``scale``."""
    n = x.numel()
    fmax, _, _ = _consts(fmt)
    out = torch.empty((n * fmt.bits + 7) // 8, dtype=torch.uint8)
    sat = _jit().encode(
        x.reshape(-1).numpy(), scale.numpy(), block, fmax, fmt.bits, fmt.man_bits, fmt.bias,
        out.numpy(),
    )  # fmt: skip
    return out, int(sat)


def decode(
    payload: torch.Tensor,
    scale: torch.Tensor,
    fmt: fpf.ElementFormat,
    block: int,
    out: torch.Tensor,
    acc: bool,
) -> None:
    """out (contiguous float32) = the payload's values, or += with ``acc``."""
    fmax, safe, table = _consts(fmt)
    _jit().decode(
        payload.numpy(), out.numel(), scale.numpy(), block, fmax, safe, fmt.bits, table,
        out.reshape(-1).numpy(), acc,
    )  # fmt: skip


def hop(
    payload: torch.Tensor,
    local: torch.Tensor,
    scale: torch.Tensor,
    fmt: fpf.ElementFormat,
    block: int,
) -> tuple[torch.Tensor, int]:
    """The fused hop: local (contiguous float32) += decode(payload); returns the
    sum's payload and the saturated count."""
    n = local.numel()
    fmax, safe, table = _consts(fmt)
    out = torch.empty((n * fmt.bits + 7) // 8, dtype=torch.uint8)
    sat = _jit().hop(
        payload.numpy(), local.reshape(-1).numpy(), scale.numpy(), block, fmax, safe,
        fmt.bits, fmt.man_bits, fmt.bias, table, out.numpy(),
    )  # fmt: skip
    return out, int(sat)
