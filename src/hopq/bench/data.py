"""Real text that ships with Python: the standard library's own sources.

No downloads: the corpus is read from the running interpreter's stdlib folder,
in sorted file order, so every worker and every run sees the same bytes.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_source(max_bytes: int = 8 << 20) -> bytes:
    """Concatenated .py files of the standard library (tests and site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "site-packages", "idle_test") for p in rel):
            continue
        try:
            out += path.read_bytes() + b"\n"
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    if not out:
        raise RuntimeError(f"no Python sources found under {root}")
    return bytes(out[:max_bytes])


def byte_split(data: bytes, eval_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out evaluation tokens (bytes as ids 0..255): the last
    ``eval_fraction`` of the corpus is held out."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(t) * (1 - eval_fraction))
    return t[:cut], t[cut:]


def batch(
    tokens: torch.Tensor, batch_size: int, context: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch of (input, next-token target) windows."""
    starts = torch.randint(0, len(tokens) - context - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(context + 1)
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]
