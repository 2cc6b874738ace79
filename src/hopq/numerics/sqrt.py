"""Square root in place, correctly rounded on every device.

torch's CPU ``sqrt`` of float32 is not correctly rounded: on this project's
AVX-512 machine and on the device machine's CPU, 0.66% of the square roots of
uniform random values were one ulp off IEEE's (measured against the float64
root rounded to float32), while torch's CUDA ``sqrt`` (H200) matched IEEE's on
every one. GComp's thresholds take a square root of Adam's second moment, so
the same optimizer state gave different thresholds on a GPU and on a CPU.
Here the CPU's float32 root comes from numpy's (the hardware's square root
instruction) when numpy is installed, and otherwise from torch's float64 root
rounded to float32. That is the correctly rounded float32 root whenever the
float64 root is within 2^-51 (relative) of the exact one, as one accurate to a
float64 ulp (2^-52) is: the exact root of a float32 lies at least that far from
a float32 rounding boundary. ``tests/test_numerics.py`` checks both routes
against Python's root. Other dtypes and devices use torch's.
"""

from __future__ import annotations

import torch

_CHUNK = 1 << 20


def sqrt_(t: torch.Tensor) -> torch.Tensor:
    """``t.sqrt_()``, correctly rounded for float32 on the CPU too; returns ``t``."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        return t.sqrt_()
    try:
        import numpy as np
    except ImportError:  # a torch-only install
        flat = t.view(-1)
        for i in range(0, flat.numel(), _CHUNK):
            part = flat[i : i + _CHUNK]
            part.copy_(part.double().sqrt_())
        return t
    a = t.numpy()
    with np.errstate(invalid="ignore"):  # negative values give NaN, as torch's
        np.sqrt(a, out=a)
    return t


__all__ = ["sqrt_"]
