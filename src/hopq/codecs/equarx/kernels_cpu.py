"""EQuARX's CPU kernel (numba): int8, FP8 E4M3 or FP8 E5M2 codes with bfloat16
or float32 scales, in either block geometry, one pass per stage over a part;
the same bits as the PyTorch reference (:class:`hopq.codecs.equarx.EQuARXCodec`).
``tests/test_equarx.py`` holds it to the reference bit for bit.

The reference builds each stage from about ten whole-part tensor operations
(finite mask, absolute values, block maxima, the scale's rounding, division,
rounding, clamps, selects, the byte concatenation); here a segment of the part
(64 K entries at the paper's geometry, 256 KB) is decoded and accumulated in
one pass, its column maxima taken in a second and its codes written in a third,
while it stays in cache. FP8 codes are cast with integer arithmetic on the
float32 bits (round to nearest even, subnormals, torch's NaN and Inf codes) and
decoded through a 256-entry table of torch's own values.

numba is optional (``pip install hopq[cpu]``); without it the codec runs the
reference. The first call compiles (cached on disk afterwards).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from hopq.kernels import Mode, backend

_EMPTY_U8 = np.empty(0, np.uint8)
_EMPTY_F32 = np.empty(0, np.float32)
#: The kernel's number for each element format, by the torch dtype of its codes.
CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


@lru_cache(maxsize=4)
def _table(dtype: torch.dtype) -> np.ndarray:
    """float32 value of each of the 256 FP8 codes, as torch casts them (NaN bits
    too); empty for int8, which the kernel decodes itself."""
    if dtype == torch.int8:
        return _EMPTY_F32
    return torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy().copy()


def available() -> bool:
    return backend("equarx", "cpu").available()


def run(
    mode: Mode,
    n: int,
    minishard: int,
    columns: int,
    block: int,
    scale_bytes: int,
    *,
    element: torch.dtype,
    q: float,
    payload: torch.Tensor | None = None,
    local: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    out_payload: torch.Tensor | None = None,
) -> int:
    """One part of ``n`` entries in ``mode`` (see :data:`hopq.kernels.Mode`):
    minishards of ``minishard`` entries in rows of ``columns`` (one scale per
    column; a shorter last one has min(columns, ceil(rest / block)) columns),
    scales of ``scale_bytes`` (2: bfloat16, 4: float32). Tensors are contiguous
    CPU tensors: payloads uint8, ``local`` / ``out_rows`` float32 of n entries.
    ``element``: the codes' dtype (:data:`CODES`), ``q`` its largest value (Q in
    x / A * Q); the codec holds both.
    Returns the number of invalid scales in ``payload`` (negative, NaN or Inf),
    in which case nothing was written."""
    from hopq.codecs.equarx._kernels_cpu_jit import hop

    inb = payload.detach().numpy() if payload is not None else _EMPTY_U8
    loc = local.detach().numpy() if local is not None else _EMPTY_F32
    outf = out_rows.detach().numpy() if out_rows is not None else _EMPTY_F32
    outb = out_payload.detach().numpy() if out_payload is not None else _EMPTY_U8
    return int(
        hop(
            int(mode), n, minishard, columns, block, scale_bytes, inb, loc, outf, outb,
            CODES[element], np.float32(q), _table(element),
        )
    )  # fmt: skip


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the kernel, through the codec."""
    from hopq.codecs.base import HopContext, LocalStats
    from hopq.codecs.equarx import Element, EQuARX

    x = torch.randn(300)
    for element in Element:
        codec = EQuARX(backend="cpu", element=element)
        codec.encode(codec.plan(x, LocalStats()), x, HopContext(0, 0, 0, 1, 0, 1))
