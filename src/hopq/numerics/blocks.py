"""Cutting a flat vector into whole blocks (super-groups, MX blocks, top-k blocks,
Hadamard blocks): every codec that works per block pads the tail with zeros."""

from __future__ import annotations

import torch


def n_blocks(numel: int, block: int) -> int:
    """Blocks of ``block`` entries needed to hold ``numel`` entries."""
    return -(-numel // block)


def pad_to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` flattened to float32 and zero-padded to whole blocks, as a
    ``[n_blocks, block]`` tensor; a view of ``x`` when nothing needs padding or
    converting (callers that write to it pass a copy)."""
    flat = x.reshape(-1).to(torch.float32)
    nb = n_blocks(flat.numel(), block)
    if flat.numel() == nb * block:
        return flat.view(nb, block)
    out = flat.new_zeros(nb * block)
    out[: flat.numel()] = flat
    return out.view(nb, block)
