"""Reordering a vector by rows (super-groups) with per-row offsets: DynamiQ's
``prepare`` (gather rows by a permutation, subtract the means) and ``finish``
(scatter them back, add the means). These are the specification; the CPU
kernels reproduce them bit for bit, and the Triton backend calls them as they
are (on a GPU they are memory-bound index operations already)."""

from __future__ import annotations

import torch

from hopq.numerics.blocks import pad_to_blocks
from hopq.numerics.div import div_


def gather_rows(x: torch.Tensor, perm: torch.Tensor, mu: torch.Tensor, S: int) -> torch.Tensor:
    """Row k of the result = (row perm[k] of x, zero-padded) - mu[perm[k]], with
    the padding kept exactly zero; flat float32 of len(perm) * S."""
    d = x.numel()
    m = perm.numel()
    xs = pad_to_blocks(x, S) - mu[:, None]
    if d % S and m:
        xs[-1, d % S :] = 0
    return xs.index_select(0, perm).reshape(-1)


def scatter_rows(
    y: torch.Tensor, perm: torch.Tensor, mu: torch.Tensor, S: int, n: int, avg: bool, d: int
) -> torch.Tensor:
    """Row perm[k] of the result = row k of y, then y / n + mu (``avg``) or
    y + n mu (sum); cut to the first ``d`` entries."""
    m = perm.numel()
    out = torch.empty_like(y).view(m, S)
    out.index_copy_(0, perm, y.view(m, S))
    if avg:
        div_(out, n).add_(mu[:, None])
    else:
        out.add_(mu[:, None] * n)
    return out.reshape(-1)[:d]
