"""Reductions in a fixed order, so that a kernel can reproduce them bit for bit.

``torch.sum`` fixes no summation order (it depends on vector width and threads),
so a float32 sum computed by a kernel would differ from it in the last bits.
:func:`tree_sum` fixes one: the last dimension (a power of two) is halved
log2(n) times, ``x[..., :h] + x[..., h:]``; each addition of two numbers is
exact to specify, and a kernel does the same with in-register reshapes.
"""

from __future__ import annotations

import torch


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (a power of two) by pairwise halving."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two last dimension, got {n}")
    while n > 1:
        n //= 2
        x = x[..., :n] + x[..., n:]
    return x[..., 0]
