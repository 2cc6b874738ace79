"""Counter-based hash RNG: (seed, round, chunk, hop, element index) -> uniform float32.

Randomness in hopq never comes from torch's global generator: every rank, the
simulator and the Triton kernels must draw the very same numbers for the same
coordinates, so each draw is a pure function of its coordinates.

Construction (the specification that kernels reproduce bit for bit):

* ``stream_key(seed, round, chunk, hop)`` folds the four stream coordinates
  into two 32-bit keys on the host with Python integers (scalar work, once per
  encode call).
* For element ``i`` (uint32): ``h = mix32(mix32(i ^ k0) ^ k1)`` where ``mix32``
  is the "lowbias32" integer finalizer (xorshift-multiply, constants
  0x7FEB352D and 0x846CA68B, found by C. Wellons' hash prospector to have very
  low avalanche bias). Two rounds with independent keys decorrelate streams
  that differ in one key bit.
* ``u = (h >> 8) * 2**-24``: 24 random bits, exactly representable in float32,
  so ``u`` is in [0, 1) with no rounding anywhere.

The torch version works on int64 tensors and keeps every intermediate below
2**63 (the 32x32-bit product is split into 16-bit halves), so it is exact on
every device; a Triton kernel does the same in native uint32 arithmetic.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
M1 = 0x7FEB352D
M2 = 0x846CA68B
# Golden-ratio increment used to spread the stream coordinates before mixing.
GOLDEN = 0x9E3779B9


def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (host side, used for keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * M1) & MASK32
    x ^= x >> 15
    x = (x * M2) & MASK32
    x ^= x >> 16
    return x


def stream_key(seed: int, round: int, chunk: int, hop: int) -> tuple[int, int]:
    """Two 32-bit keys naming one random stream; pure function of its arguments."""
    k = mix32_int(seed ^ GOLDEN)
    k = mix32_int(k ^ (seed >> 32) ^ (round * GOLDEN))
    k0 = mix32_int(k ^ (chunk * 0x85EBCA6B) ^ (hop << 20))
    k1 = mix32_int(k0 ^ (hop * 0xC2B2AE35) ^ (round >> 32) ^ GOLDEN)
    return k0, k1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 elementwise on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, M1)
    x = x ^ (x >> 15)
    x = _mul32(x, M2)
    return x ^ (x >> 16)


def hash32(index: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """32-bit hash of element indices (int64, < 2**32) under a stream key."""
    return mix32(mix32(index ^ key[0]) ^ key[1])


def uniform(
    n: int,
    key: tuple[int, int],
    *,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """float32 uniforms in [0, 1) for element indices offset .. offset + n - 1."""
    if offset < 0 or offset + n > 2**32:
        raise ValueError(f"element indices [{offset}, {offset + n}) exceed the 32-bit counter")
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    h = hash32(idx, key)
    return (h >> 8).to(torch.float32) * (2.0**-24)
