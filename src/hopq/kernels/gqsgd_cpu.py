"""gqsgd-exp's CPU kernel (numba): the exponential reduce (Algorithm 2) fused
with the payload's decode, validation and, for the fused hop, the re-encode,
in one pass over the chunk; the same bits as the PyTorch reference
(:func:`hopq.codecs.gqsgd.exp_reduce` and the codec's byte layout).
``tests/test_gqsgd.py`` holds it to the reference bit for bit.

The reference is a chain of about 25 whole-chunk tensor operations (and the
hash's 64-bit products); this walks the chunk once, computing the hash only
where both codes are non-zero. numba is optional (``pip install hopq[cpu]``);
without it the codec runs the reference. The first call compiles (cached on
disk afterwards).
"""

from __future__ import annotations

import numpy as np
import torch

from hopq.kernels import backend


def available() -> bool:
    return backend("gqsgd-exp", "cpu").available()


_EMPTY_U8 = np.empty(0, np.uint8)


def exp_reduce(
    acc: torch.Tensor,
    body: torch.Tensor,
    key: tuple[int, int],
    start: int,
    emin: int,
    out: torch.Tensor | None = None,
) -> int:
    """acc <- exp_reduce(acc, codes of ``body``) in place (acc: contiguous float32
    signed exponent codes, body: uint8 codes); ``out`` (uint8) receives the
    result's bytes. Element i draws its hash at index ``start + i``. Returns the
    number of invalid codes in ``body`` (negative zero, or 0 < e < ``emin``)."""
    from hopq.kernels._gqsgd_cpu_jit import exp_reduce as jit

    if not (acc.is_contiguous() and acc.dtype == torch.float32 and body.dtype == torch.uint8):
        raise TypeError("gqsgd_cpu.exp_reduce: contiguous float32 acc and uint8 body")
    a = acc.numpy()
    b = body.contiguous().numpy()
    o = out.numpy() if out is not None else _EMPTY_U8
    return int(jit(a, b, key[0], key[1], start, emin, o, out is not None))
