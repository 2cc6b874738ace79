"""Division by a Python number, correctly rounded on every device.

torch's CUDA kernel divides by a CPU scalar as a multiplication by its
reciprocal ("may lose one bit of precision", BinaryDivTrueKernel.cu): ``x / 255.0``
on a GPU is up to one ulp off the CPU's ``x / 255.0`` and off a kernel's
``tl.div_rn``. A codec's reference is its specification on every device, so its
divisions by constants go through here: on CPU plain ``/``, elsewhere a division
by a 0-dimensional tensor on the same device, which the kernel divides exactly.
"""

from __future__ import annotations

import torch


def _divisor(t: torch.Tensor, d: float) -> float | torch.Tensor:
    if t.device.type == "cpu":
        return d
    if not t.is_floating_point():
        raise TypeError(f"exact division needs a floating-point tensor, got {t.dtype}")
    return torch.full((), d, dtype=t.dtype, device=t.device)


def div(t: torch.Tensor, d: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t / d``, correctly rounded on every device (into ``out`` if given)."""
    return torch.div(t, _divisor(t, d), out=out)


def div_(t: torch.Tensor, d: float) -> torch.Tensor:
    """``t /= d`` in place, correctly rounded on every device."""
    return t.div_(_divisor(t, d))
