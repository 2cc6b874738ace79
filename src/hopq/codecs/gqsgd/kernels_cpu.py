"""gqsgd-exp's CPU kernel (numba): the exponential reduce (Algorithm 2) fused
with the payload's decode, validation and, for the fused hop, the re-encode,
in one pass over the chunk; the same bits as the PyTorch reference
(:func:`hopq.codecs.gqsgd.exp_reduce` and the codec's byte layout).
``tests/test_gqsgd.py`` holds it to the reference bit for bit.

The reference is a chain of about 25 whole-chunk tensor operations (and the
hash's 64-bit products); this walks the chunk once, computing the hash only
where both codes are non-zero. numba is optional (``pip install hopq[cpu]``);
without it the codec runs the reference. The first call compiles (cached on
disk afterwards).
"""

from __future__ import annotations

import numpy as np
import torch

from hopq.kernels import backend
from hopq.numerics.bitpack import packed_nbytes


def available() -> bool:
    return backend("gqsgd-exp", "cpu").available()


def exp_reduce(
    acc: torch.Tensor,
    body: torch.Tensor,
    key: tuple[int, int],
    start: int,
    emin: int,
    out: torch.Tensor | None = None,
) -> int:
    """acc <- exp_reduce(acc, codes of ``body``) in place (acc: contiguous float32
    signed exponent codes, body: uint8 codes); ``out`` (uint8) receives the
    result's bytes. Element i draws its hash at index ``start + i``. Returns the
    number of invalid codes in ``body`` (negative zero, or 0 < e < ``emin``)."""
    from hopq.codecs.gqsgd._kernels_cpu_jit import exp_reduce as jit

    if not (acc.is_contiguous() and acc.dtype == torch.float32 and body.dtype == torch.uint8):
        raise TypeError("gqsgd_cpu.exp_reduce: contiguous float32 acc and uint8 body")
    a = acc.numpy()
    b = body.contiguous().numpy()
    o = out.numpy() if out is not None else np.empty(a.size, np.uint8)
    _check_indices(start, a.size)
    return int(jit(a, b, key[0], key[1], start, emin, o))


def _leaf_args(x: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError("gqsgd_cpu: float32 CPU input")
    flat = x.reshape(-1).contiguous()
    return flat.numpy(), torch.empty(flat.numel(), dtype=torch.float32)


def _check_indices(start: int, n: int) -> None:
    """The element indices start .. start + n - 1 fit the 32-bit counter (the
    reference's ``uniform`` and ``hash32`` raise otherwise; the kernels would wrap)."""
    if start < 0 or start + n > 2**32:
        raise ValueError(f"element indices [{start}, {start + n}) exceed the 32-bit counter")


def _into(a: np.ndarray, fresh: torch.Tensor, out: torch.Tensor | None, what: str) -> torch.Tensor:
    """``out`` checked to match the input array ``a`` (it may be the input
    itself), or ``fresh`` when None."""
    if out is None:
        return fresh
    if not (out.is_contiguous() and out.dtype == torch.float32 and out.numel() == a.size):
        raise TypeError(f"gqsgd_cpu.{what}: out must be contiguous float32 like the input")
    return out


def linear_quantize(
    x: torch.Tensor,
    factor: float,
    levels: int,
    key: tuple[int, int],
    start: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """gqsgd-linear's leaf integers (float32): x * factor rounded stochastically
    with the uniforms of ``key`` at element indices start.., clamped to +-levels;
    into ``out`` (contiguous float32, may be ``x`` itself) when given."""
    from hopq.codecs.gqsgd._kernels_cpu_jit import linear_quantize as jit

    a, fresh = _leaf_args(x)
    _check_indices(start, a.size)
    out = _into(a, fresh, out, "linear_quantize")
    jit(a, float(factor), int(levels), key[0], key[1], int(start), out.numpy())
    return out


def exp_quantize(
    x: torch.Tensor,
    scale: float,
    chain: int,
    key: tuple[int, int],
    start: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """gqsgd-exp's leaf codes (signed exponents, float32) of x / scale scaled by
    2^-chain, with the uniforms of ``key`` at element indices start..; into
    ``out`` (may be ``x``) when given."""
    from hopq.codecs.gqsgd._kernels_cpu_jit import exp_quantize as jit

    a, fresh = _leaf_args(x)
    _check_indices(start, a.size)
    out = _into(a, fresh, out, "exp_quantize")
    jit(a, float(scale), int(chain), key[0], key[1], int(start), out.numpy())
    return out


def linear_hop(
    acc: torch.Tensor,
    body: torch.Tensor,
    bits: int,
    limit: int,
    out: torch.Tensor | None = None,
) -> int:
    """gqsgd-linear's hop on ``bits``-bit lanes (4, 8 or 16): acc (contiguous
    float32 integers) += the lanes of ``body`` in place; ``out`` (uint8, the
    packed size), when given, <- the sums' lanes. Returns the number of lanes or
    sums beyond +-limit (a corrupt payload)."""
    from hopq.codecs.gqsgd._kernels_cpu_jit import linear_hop as jit

    _check_lanes(acc, body, bits)
    a = acc.numpy()
    o = out.numpy() if out is not None else np.empty(body.numel(), np.uint8)
    return int(jit(a, body.contiguous().numpy(), bits, limit, o, out is not None))


def linear_unpack(body: torch.Tensor, bits: int, limit: int, out: torch.Tensor) -> int:
    """``out`` (contiguous float32) <- the ``bits``-bit lanes of ``body``; returns
    the number of lanes beyond +-limit."""
    from hopq.codecs.gqsgd._kernels_cpu_jit import linear_unpack as jit

    _check_lanes(out, body, bits)
    return int(jit(body.contiguous().numpy(), bits, limit, out.numpy()))


def linear_pack(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 integers of ``x`` (contiguous) packed as ``bits``-bit lanes."""
    from hopq.codecs.gqsgd._kernels_cpu_jit import linear_pack as jit

    _check_bits(bits)
    out = torch.empty(packed_nbytes(x.numel(), bits), dtype=torch.uint8)
    _check_lanes(x, out, bits)
    jit(x.numpy(), bits, out.numpy())
    return out


def _check_bits(bits: int) -> None:
    if bits not in (4, 8, 16):
        raise ValueError(f"gqsgd_cpu: lanes of 4, 8 or 16 bits, got {bits}")


def _check_lanes(v: torch.Tensor, body: torch.Tensor, bits: int) -> None:
    _check_bits(bits)
    if not (v.is_contiguous() and v.dtype == torch.float32 and body.dtype == torch.uint8):
        raise TypeError("gqsgd_cpu: contiguous float32 values and a uint8 payload")
    if body.numel() != packed_nbytes(v.numel(), bits):
        raise ValueError(
            f"gqsgd_cpu: {v.numel()} lanes of {bits} bits take "
            f"{packed_nbytes(v.numel(), bits)} bytes, the payload has {body.numel()}"
        )


def _finish_args(y: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    if y.dtype != torch.float32 or y.device.type != "cpu":
        raise TypeError("gqsgd_cpu: float32 CPU sums")
    flat = y.reshape(-1).contiguous()
    return flat.numpy(), torch.empty(flat.numel(), dtype=torch.float32)


def linear_finish(
    y: torch.Tensor, factor: float, divisor: float, limit: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """float32(y * factor / divisor) in float64 arithmetic, saturated at +-limit;
    into ``out`` (contiguous float32, may be ``y`` itself) when given."""
    from hopq.codecs.gqsgd._kernels_cpu_jit import linear_finish as jit

    a, fresh = _finish_args(y)
    out = _into(a, fresh, out, "linear_finish")
    jit(a, float(factor), float(divisor), float(limit), out.numpy())
    return out


def exp_finish(
    y: torch.Tensor,
    scale: float,
    chain: int,
    divisor: float,
    limit: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The values of signed exponent codes y, sign 2^(chain - e) scale / divisor,
    as float32 saturated at +-limit; into ``out`` (may be ``y``) when given."""
    from hopq.codecs.gqsgd._kernels_cpu_jit import exp_finish as jit

    a, fresh = _finish_args(y)
    out = _into(a, fresh, out, "exp_finish")
    jit(a, float(scale), int(chain), float(divisor), float(limit), out.numpy())
    return out
