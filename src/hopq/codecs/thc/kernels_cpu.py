"""THC's CPU kernel (numba): the random signs and the rounding uniforms of its
rotation and quantization, and the Walsh-Hadamard transform, the same bits as
the PyTorch reference (:mod:`hopq.codecs.thc`; ``tests/test_thc_omnireduce.py``
holds them to it bit for bit).

The reference hashes with 64-bit tensors that emulate 32-bit multiplies and
runs the transform as log2(H) passes over the whole vector, each building a new
tensor; here the hash runs in 32-bit lanes and each Hadamard block is
transformed in place while it stays in cache, two butterfly levels per pass
(the levels below 4096 piece by piece in L1). For the common case (a float32
all-reduce) :func:`rotate`, :func:`quantize` and :func:`unrotate` fuse the
signs, the interleave, the transform and the maximum, the rounding, and the
inverse with its scaling into one kernel each. On 4M coordinates (one
process, Intel Xeon): the codec's plan 413 -> 38 -> 36 -> 30 ms, prepare 375 ->
14 -> 8.5 ms, finish 427 -> 37 -> 29 -> 21 ms (docs/codecs/thc.md). 8-bit lanes
are packed by :func:`pack8` in one pass.

numba is optional (``pip install hopq[cpu]``); without it the codec runs the
reference. The first call compiles (cached on disk afterwards).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hopq.kernels import backend


def available() -> bool:
    return backend("thc", "cpu").available()


def signs(n: int, key: tuple[int, int]) -> torch.Tensor:
    """float32 +-1 of elements 0 .. n-1 (``THC._signs``)."""
    from hopq.codecs.thc._kernels_cpu_jit import signs as kernel

    out = torch.empty(n, dtype=torch.float32)
    kernel(out.numpy(), np.uint32(key[0]), np.uint32(key[1]))
    return out


def uniform(n: int, key: tuple[int, int], offset: int = 0) -> torch.Tensor:
    """:func:`hopq.numerics.rng.uniform` of elements offset .. offset + n - 1."""
    from hopq.codecs.thc._kernels_cpu_jit import uniforms as kernel

    if offset < 0 or offset + n > 2**32:
        raise ValueError(f"element indices [{offset}, {offset + n}) exceed the 32-bit counter")
    out = torch.empty(n, dtype=torch.float32)
    kernel(out.numpy(), np.uint32(offset), np.uint32(key[0]), np.uint32(key[1]))
    return out


def fwht(x: torch.Tensor) -> torch.Tensor:
    """:func:`hopq.codecs.thc.fwht` (float32 or float64, CPU): a new tensor."""
    from hopq.codecs.thc._kernels_cpu_jit import fwht_rows

    H = x.shape[-1]
    y = x.detach().reshape(-1, H).clone(memory_format=torch.contiguous_format)
    if y.numel():
        # the reference multiplies by the Python float 1/sqrt(H), which torch
        # applies in the tensor's dtype
        fwht_rows(y.numpy(), _scale(H) if y.dtype == torch.float32 else 1.0 / math.sqrt(H))
    return y.view(x.shape)


def _scale(H: int) -> np.float32:
    return np.float32(1.0 / math.sqrt(H))


def rotate(x: torch.Tensor, H: int, work: int, key: tuple[int, int]) -> tuple[torch.Tensor, float]:
    """``THC._rotate`` of the float32 vector x padded to ``work`` entries, in one
    fused pass per tile of Hadamard blocks; also max |rotated|."""
    from hopq.codecs.thc._kernels_cpu_jit import rotate as kernel

    out = torch.empty(work, dtype=torch.float32)
    top = kernel(
        x.detach().reshape(-1).contiguous().numpy(), x.numel(), H, np.uint32(key[0]),
        np.uint32(key[1]), _scale(H), out.numpy(),
    )  # fmt: skip
    return out, float(top)


def quantize(rot: torch.Tensor, step: float, key: tuple[int, int], levels: int) -> torch.Tensor:
    """``THC.prepare``'s stochastic rounding of rot / step to integers in [-L, L]."""
    from hopq.codecs.thc._kernels_cpu_jit import quantize as kernel

    out = torch.empty_like(rot)
    kernel(rot.numpy(), np.float32(step), np.uint32(key[0]), np.uint32(key[1]), levels, out.numpy())
    return out


def unrotate(y: torch.Tensor, step: float, H: int, key: tuple[int, int], d: int) -> torch.Tensor:
    """``THC.finish``'s inverse rotation of the integer sums y (times ``step``):
    the first d entries in the caller's layout."""
    from hopq.codecs.thc._kernels_cpu_jit import _TILE
    from hopq.codecs.thc._kernels_cpu_jit import unrotate as kernel

    out = torch.empty(d, dtype=torch.float32)
    buf = np.empty(_TILE * H, np.float32)
    kernel(
        y.detach().reshape(-1).contiguous().numpy(), np.float32(step), H, np.uint32(key[0]),
        np.uint32(key[1]), _scale(H), d, out.numpy(), buf,
    )  # fmt: skip
    return out


def pack8(ints: torch.Tensor, top: int) -> tuple[torch.Tensor, int]:
    """``THC._pack`` for 8-bit lanes: (the integers clamped to +-top as int8
    bytes, how many were clamped) in one pass."""
    from hopq.codecs.thc._kernels_cpu_jit import pack8 as kernel

    out = torch.empty(ints.numel(), dtype=torch.int8)
    sat = kernel(ints.detach().reshape(-1).contiguous().numpy(), top, out.numpy())
    return out.view(torch.uint8), int(sat)
