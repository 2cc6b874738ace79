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
Everything works span by span (whole blocks, about ``SPAN`` values, in L1);
the fused hop decodes a span, adds it to the local values and encodes the sum.
The encoder's loops have no branch on the data and run over the whole span
(only the scaling goes block by block), so that LLVM vectorizes them: 2.0x
faster than one loop with per-value branches, and 1.4-1.6x faster again than
the same loops block by block, whose 32 values left too little to vectorize.
2^(M - Ee) is built from its bits rather than looked up, and rint is the
float32 addition of 1.5 * 2^23 (numba's np.rint is a scalar conversion), so
that those loops vectorize too. Indices are unsigned (numba adds negative-index
wrap-around code to signed ones) and copies are loops (its slice assignment
goes element by element)."""

# mypy: ignore-errors
from __future__ import annotations

import numpy as np
from numba import njit

_O = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}

_U32 = np.uint32
_U64 = np.uint64
#: Values per span that the kernels work on at once: whole blocks, about this
#: many (their temporary buffers stay in L1).
SPAN = 2048
#: 1.5 * 2^23: (t + _RINT) - _RINT is t rounded half to even, for |t| < 2^22.
_RINT = np.float32(12582912.0)


@njit(inline="always", **_O)
def _encode_span(xs, lo, hi, scale, B, fmax, bits, man, bias, pw, tmp, codes):
    """Codes of xs[lo:hi] (whole blocks of B values from block lo // B, their
    scales in ``scale``; the last block may be short) into codes[0 : hi - lo];
    returns how many finite scaled values exceeded FMAX (saturated). Loops
    without branches on the data, over the whole span, for LLVM to vectorize."""
    m = hi - lo
    b0 = lo // B
    lo = _U64(lo)
    bi = b0
    for t in range(0, m, B):
        s = scale[bi]
        bi += 1
        e = min(m, t + B)
        if s > np.float32(0.0):
            for j in range(t, e):
                tmp[j] = xs[lo + _U64(j)] / s * fmax
        else:
            for j in range(t, e):
                tmp[j] = xs[lo + _U64(j)]
    sat = 0
    topb = np.uint8(1 << (bits - 1))
    for j in range(m):
        v = tmp[j]
        a = abs(v)
        sat += np.int64((a > fmax) & (a != np.inf))
        codes[j] = topb * np.uint8(v < np.float32(0.0))
        tmp[j] = a if a <= fmax else fmax  # NaN and beyond FMAX: FMAX
    tu = tmp.view(np.uint32)
    pwf = pw.view(np.float32)
    emin = np.int32(1 - bias)
    for j in range(m):
        # 2^(M - Ee) from its bits (a normal float32 for every format): no
        # table lookup, so the loop vectorizes
        ee = max(np.int32(tu[j] >> _U32(23)) - np.int32(127), emin)
        pw[j] = (np.int32(127 + man) - ee) << np.int32(23)
    for j in range(m):
        ee = max(np.int32(tu[j] >> _U32(23)) - np.int32(127), emin)
        # rint of t = a * 2^(M - Ee) < 2^(M + 2): adding and taking away
        # 1.5 * 2^23 rounds half to even in float32 (np.rint compiles to a
        # scalar conversion that keeps the loop from vectorizing)
        k = np.int32((tmp[j] * pwf[j] + _RINT) - _RINT)
        codes[j] |= np.uint8(((ee + np.int32(bias - 1)) << np.int32(man)) + k)
    return sat


@njit(inline="always", **_O)
def _pack(codes, m, bits, out, pos):
    """The first m codes into out from byte pos (bitpack's layout)."""
    pos = _U64(pos)
    if bits == 8:
        for j in range(m):
            out[pos + _U64(j)] = codes[j]
    elif bits == 4:
        q = m >> 1
        for j in range(q):
            out[pos + _U64(j)] = codes[2 * j] | (codes[2 * j + 1] << np.uint8(4))
        if m & 1:
            out[pos + _U64(q)] = codes[m - 1]
    else:  # 6 bits: four codes in three bytes
        q = m >> 2
        for j in range(q):
            w = (
                _U32(codes[4 * j])
                | (_U32(codes[4 * j + 1]) << _U32(6))
                | (_U32(codes[4 * j + 2]) << _U32(12))
                | (_U32(codes[4 * j + 3]) << _U32(18))
            )
            o = pos + _U64(3 * j)
            out[o] = np.uint8(w & _U32(0xFF))
            out[o + _U64(1)] = np.uint8((w >> _U32(8)) & _U32(0xFF))
            out[o + _U64(2)] = np.uint8(w >> _U32(16))
        r = m - 4 * q
        if r:
            w = _U32(0)
            for t in range(r):
                w |= _U32(codes[4 * q + t]) << _U32(6 * t)
            o = pos + _U64(3 * q)
            for t in range((6 * r + 7) // 8):
                out[o + _U64(t)] = np.uint8((w >> _U32(8 * t)) & _U32(0xFF))


@njit(inline="always", **_O)
def _unpack(p, pos, m, bits, codes):
    """m codes from p at byte pos into codes."""
    pos = _U64(pos)
    if bits == 8:
        for j in range(m):
            codes[j] = p[pos + _U64(j)]
    elif bits == 4:
        for j in range(m):
            b = p[pos + _U64(j >> 1)]
            codes[j] = (b >> np.uint8(4 * (j & 1))) & np.uint8(0xF)
    else:
        q = m >> 2
        for j in range(q):
            o = pos + _U64(3 * j)
            w = _U32(p[o]) | (_U32(p[o + _U64(1)]) << _U32(8)) | (_U32(p[o + _U64(2)]) << _U32(16))
            codes[4 * j] = np.uint8(w & _U32(63))
            codes[4 * j + 1] = np.uint8((w >> _U32(6)) & _U32(63))
            codes[4 * j + 2] = np.uint8((w >> _U32(12)) & _U32(63))
            codes[4 * j + 3] = np.uint8(w >> _U32(18))
        r = m - 4 * q
        if r:
            o = pos + _U64(3 * q)
            w = _U32(0)
            for t in range((6 * r + 7) // 8):
                w |= _U32(p[o + _U64(t)]) << _U32(8 * t)
            for t in range(r):
                codes[4 * q + t] = np.uint8((w >> _U32(6 * t)) & _U32(63))


@njit(inline="always", **_O)
def _decode_span(codes, m, b0, scale, B, fmax, safe_max, bits, table, vals):
    """Values of m codes (whole blocks of B from block b0, scales in ``scale``)
    into vals: v * s / FMAX, or v * (s / FMAX) where v * s could overflow
    float32."""
    top = 1 << (bits - 1)
    bi = b0
    for t in range(0, m, B):
        s = scale[bi]
        bi += 1
        e = min(m, t + B)
        safe = s <= safe_max
        sf = s / fmax
        for j in range(t, e):
            c = int(codes[j])
            mag = table[c & (top - 1)]
            v = -mag if c >= top else mag
            vals[j] = (v * s) / fmax if safe else v * sf


@njit(**_O)
def encode(x, scale, B, fmax, bits, man, bias, out):
    """x (float32, a chunk starting at a block boundary), scale per block: the
    payload into out. Returns the saturated count."""
    n = x.shape[0]
    S = B * max(1, SPAN // B)
    tmp = np.empty(S, np.float32)
    pw = np.empty(S, np.int32)
    codes = np.empty(S, np.uint8)
    sat = 0
    for lo in range(0, n, S):
        hi = min(n, lo + S)
        sat += _encode_span(x, lo, hi, scale, B, fmax, bits, man, bias, pw, tmp, codes)
        _pack(codes, hi - lo, bits, out, (lo * bits) >> 3)
    return sat


@njit(**_O)
def decode(p, n, scale, B, fmax, safe_max, bits, table, out, acc):
    """The payload's n values into out (float32), or added to it (acc)."""
    S = B * max(1, SPAN // B)
    codes = np.empty(S, np.uint8)
    vals = np.empty(S, np.float32)
    for lo in range(0, n, S):
        m = min(n, lo + S) - lo
        _unpack(p, (lo * bits) >> 3, m, bits, codes)
        _decode_span(codes, m, lo // B, scale, B, fmax, safe_max, bits, table, vals)
        lu = _U64(lo)
        if acc:
            for j in range(m):
                out[lu + _U64(j)] += vals[j]
        else:
            for j in range(m):
                out[lu + _U64(j)] = vals[j]


@njit(**_O)
def hop(p, local, scale, B, fmax, safe_max, bits, man, bias, table, out):
    """The fused hop span by span: local += decode(p), then the sum's payload
    into out. Returns the saturated count."""
    n = local.shape[0]
    S = B * max(1, SPAN // B)
    codes = np.empty(S, np.uint8)
    vals = np.empty(S, np.float32)
    pw = np.empty(S, np.int32)
    sat = 0
    for lo in range(0, n, S):
        hi = min(n, lo + S)
        m = hi - lo
        pos = (lo * bits) >> 3
        _unpack(p, pos, m, bits, codes)
        _decode_span(codes, m, lo // B, scale, B, fmax, safe_max, bits, table, vals)
        lu = _U64(lo)
        for j in range(m):
            local[lu + _U64(j)] += vals[j]
        sat += _encode_span(local, lo, hi, scale, B, fmax, bits, man, bias, pw, vals, codes)
        _pack(codes, m, bits, out, pos)
    return sat
