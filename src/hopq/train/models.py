"""Small models for the training job."""

from __future__ import annotations

import torch
from torch import nn


class TinyGPT(nn.Module):
    """A byte-level causal transformer (pre-norm), small enough for CPU workers."""

    def __init__(
        self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4, context: int = 128
    ) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        # GPT-2's initialisation: unit-variance embeddings would make the tied
        # output logits huge (initial loss ~ 60 instead of ln 256 = 5.5).
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))
