"""numba kernels of MXFP8/6/4 (compiled on first import, cached on disk). Same
bits as :class:`hopq.codecs.mx.MXCodec`'s reference.

A block of values is scaled (x / s * FMAX, float32), its magnitudes clamped to
FMAX (NaN to FMAX), and each rounded to the element format with integer
arithmetic on the float32 bits: with E the value's binary exponent and
Ee = max(E, 1 - bias) (the format's subnormals share the smallest exponent),
the magnitude code is ((Ee + bias - 1) << M) + rint(a * 2^(M - Ee)), M the
mantissa bits; the multiplication by a power of two is exact and rint rounds
half to even, so a tie goes to the even code as in the reference, and a
mantissa that rounds up carries into the exponent field. Codes are packed as
:mod:`hopq.numerics.bitpack` lays them out (8 bits as is, four 6-bit codes in
three bytes, two 4-bit codes per byte, little-endian bit streams). Decoding
looks up a table of the format's magnitudes (E4M3's top code is NaN).
Everything works block by block in cache; the fused hop decodes a block, adds
it to the local values and encodes the sum. The encoder's block loops have no
branch on the data and are inlined into the caller's loop, so that LLVM
vectorizes them (2.0x faster than one loop with per-value branches)."""

# mypy: ignore-errors
from __future__ import annotations

import numpy as np
from numba import njit

_O = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}

_U32 = np.uint32
#: Offset of 2^0 in the table of powers of two passed to the kernels.
P2_ZERO = 64


@njit(inline="always", **_O)
def _encode_block(xs, lo, hi, s, fmax, bits, man, bias, p2, tmp, codes):
    """Codes of xs[lo:hi] (scale s) into codes[0 : hi - lo]; returns how many
    finite scaled values exceeded FMAX (saturated). Loops without branches on
    the data, for LLVM to vectorize."""
    m = hi - lo
    if s > np.float32(0.0):
        for j in range(m):
            tmp[j] = xs[lo + j] / s * fmax
    else:
        for j in range(m):
            tmp[j] = xs[lo + j]
    sat = 0
    topb = np.uint8(1 << (bits - 1))
    for j in range(m):
        v = tmp[j]
        a = abs(v)
        sat += np.int64((a > fmax) & (a != np.inf))
        codes[j] = topb * np.uint8(v < np.float32(0.0))
        tmp[j] = a if a <= fmax else fmax  # NaN and beyond FMAX: FMAX
    tu = tmp.view(np.uint32)
    emin = np.int32(1 - bias)
    for j in range(m):
        e = np.int32(tu[j] >> _U32(23)) - np.int32(127)
        ee = max(e, emin)
        k = np.int32(np.rint(tmp[j] * p2[P2_ZERO + man - ee]))
        codes[j] |= np.uint8(((ee + np.int32(bias - 1)) << np.int32(man)) + k)
    return sat


@njit(inline="always", **_O)
def _pack(codes, m, bits, out, pos):
    """The first m codes into out from byte pos (bitpack's layout)."""
    if bits == 8:
        out[pos : pos + m] = codes[:m]
    elif bits == 4:
        q = m >> 1
        for j in range(q):
            out[pos + j] = codes[2 * j] | (codes[2 * j + 1] << np.uint8(4))
        if m & 1:
            out[pos + q] = codes[m - 1]
    else:  # 6 bits: four codes in three bytes
        q = m >> 2
        for j in range(q):
            w = (
                _U32(codes[4 * j])
                | (_U32(codes[4 * j + 1]) << _U32(6))
                | (_U32(codes[4 * j + 2]) << _U32(12))
                | (_U32(codes[4 * j + 3]) << _U32(18))
            )
            o = pos + 3 * j
            out[o] = np.uint8(w & _U32(0xFF))
            out[o + 1] = np.uint8((w >> _U32(8)) & _U32(0xFF))
            out[o + 2] = np.uint8(w >> _U32(16))
        r = m - 4 * q
        if r:
            w = _U32(0)
            for t in range(r):
                w |= _U32(codes[4 * q + t]) << _U32(6 * t)
            o = pos + 3 * q
            for t in range((6 * r + 7) // 8):
                out[o + t] = np.uint8((w >> _U32(8 * t)) & _U32(0xFF))


@njit(**_O)
def _unpack(p, pos, m, bits, codes):
    """m codes from p at byte pos into codes."""
    if bits == 8:
        codes[:m] = p[pos : pos + m]
    elif bits == 4:
        for j in range(m):
            b = p[pos + (j >> 1)]
            codes[j] = (b >> np.uint8(4 * (j & 1))) & np.uint8(0xF)
    else:
        q = m >> 2
        for j in range(q):
            o = pos + 3 * j
            w = _U32(p[o]) | (_U32(p[o + 1]) << _U32(8)) | (_U32(p[o + 2]) << _U32(16))
            codes[4 * j] = np.uint8(w & _U32(63))
            codes[4 * j + 1] = np.uint8((w >> _U32(6)) & _U32(63))
            codes[4 * j + 2] = np.uint8((w >> _U32(12)) & _U32(63))
            codes[4 * j + 3] = np.uint8(w >> _U32(18))
        r = m - 4 * q
        if r:
            o = pos + 3 * q
            w = _U32(0)
            for t in range((6 * r + 7) // 8):
                w |= _U32(p[o + t]) << _U32(8 * t)
            for t in range(r):
                codes[4 * q + t] = np.uint8((w >> _U32(6 * t)) & _U32(63))


@njit(**_O)
def _decode_block(codes, m, s, fmax, safe_max, bits, table, vals):
    """Values of m codes (scale s) into vals: v * s / FMAX, or v * (s / FMAX)
    where v * s could overflow float32."""
    top = 1 << (bits - 1)
    safe = s <= safe_max
    sf = s / fmax
    for j in range(m):
        c = int(codes[j])
        mag = table[c & (top - 1)]
        v = -mag if c >= top else mag
        vals[j] = (v * s) / fmax if safe else v * sf


@njit(**_O)
def encode(x, scale, B, fmax, bits, man, bias, p2, out):
    """x (float32, a chunk starting at a block boundary), scale per block: the
    payload into out. Returns the saturated count."""
    n = x.shape[0]
    tmp = np.empty(B, np.float32)
    codes = np.empty(B, np.uint8)
    sat = 0
    for b in range((n + B - 1) // B):
        lo = b * B
        hi = min(n, lo + B)
        sat += _encode_block(x, lo, hi, scale[b], fmax, bits, man, bias, p2, tmp, codes)
        _pack(codes, hi - lo, bits, out, (lo * bits) >> 3)
    return sat


@njit(**_O)
def decode(p, n, scale, B, fmax, safe_max, bits, table, out, acc):
    """The payload's n values into out (float32), or added to it (acc)."""
    codes = np.empty(B, np.uint8)
    vals = np.empty(B, np.float32)
    for b in range((n + B - 1) // B):
        lo = b * B
        m = min(n, lo + B) - lo
        _unpack(p, (lo * bits) >> 3, m, bits, codes)
        _decode_block(codes, m, scale[b], fmax, safe_max, bits, table, vals)
        if acc:
            for j in range(m):
                out[lo + j] += vals[j]
        else:
            out[lo : lo + m] = vals[:m]


@njit(**_O)
def hop(p, local, scale, B, fmax, safe_max, bits, man, bias, table, p2, out):
    """The fused hop block by block: local += decode(p), then the sum's payload
    into out. Returns the saturated count."""
    n = local.shape[0]
    codes = np.empty(B, np.uint8)
    vals = np.empty(B, np.float32)
    sat = 0
    for b in range((n + B - 1) // B):
        lo = b * B
        hi = min(n, lo + B)
        m = hi - lo
        pos = (lo * bits) >> 3
        _unpack(p, pos, m, bits, codes)
        _decode_block(codes, m, scale[b], fmax, safe_max, bits, table, vals)
        for j in range(m):
            local[lo + j] += vals[j]
        sat += _encode_block(local, lo, hi, scale[b], fmax, bits, man, bias, p2, vals, codes)
        _pack(codes, m, bits, out, pos)
    return sat
