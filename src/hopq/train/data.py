"""Real text that ships with Python: the standard library's own sources.

No downloads: the corpus is read from the running interpreter's stdlib folder,
in sorted file order, so every worker and every run sees the same bytes.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

#: Folders of the standard library left out: its tests and installed packages.
_SKIP = ("test", "tests", "site-packages", "idle_test")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> Iterator[Path]:
    """The standard library's .py files in sorted order, tests and site-packages excluded."""
    root = stdlib_root()
    for path in sorted(root.rglob("*.py")):
        if not any(p in _SKIP for p in path.relative_to(root).parts):
            yield path


def stdlib_source(max_bytes: int = 8 << 20) -> bytes:
    """Concatenated .py files of the standard library (tests and site-packages excluded)."""
    out = bytearray()
    for path in stdlib_files():
        try:
            out += path.read_bytes() + b"\n"
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    if not out:
        raise RuntimeError(f"no Python sources found under {stdlib_root()}")
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
