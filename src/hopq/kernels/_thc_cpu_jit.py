"""The numba functions behind :mod:`hopq.kernels.thc_cpu` (imported only when
numba is installed): THC's random signs and uniforms (the lowbias32 hash of
:mod:`hopq.numerics.rng` in 32-bit lanes, ``_u32``) and the Walsh-Hadamard
butterflies of :func:`hopq.codecs.thc.fwht`, in place, one cache-sized block
at a time instead of one pass over the whole vector per butterfly level."""

# mypy: ignore-errors

import numpy as np
from numba import njit

from hopq.kernels._u32 import U32, add32, hash32, uniform


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def signs(out, k0, k1):
    """out[i] = 1 - 2 (hash32(i) & 1): THC's random signs, as float32."""
    idx = U32(0)
    a, b = U32(k0), U32(k1)
    for i in range(out.size):
        out[i] = np.float32(1.0) - np.float32(2.0) * np.float32(hash32(idx, a, b) & U32(1))
        idx = add32(idx, U32(1))


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def uniforms(out, offset, k0, k1):
    """out[i] = hopq.numerics.rng.uniform's draw for element offset + i."""
    idx = U32(offset)
    a, b = U32(k0), U32(k1)
    for i in range(out.size):
        out[i] = uniform(idx, a, b)
        idx = add32(idx, U32(1))


#: Butterfly levels below this span run on one L1-sized piece of a row at a time.
_PIECE = 4096
#: Hadamard blocks gathered or scattered together: a cache line of each.
_TILE = 16

_O = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}


@njit(inline="always")
def _levels(row, lo, hi, h, h_end):
    """Butterflies of spans h, 2h, ... < h_end on row[lo:hi], two levels per
    pass where two remain (radix 4: the same additions, in the same order, for
    every element: level h on (j, j+h) and (j+2h, j+3h), then level 2h on
    (j, j+2h) and (j+h, j+3h))."""
    while 2 * h < h_end:
        for i in range(lo, hi, 4 * h):
            for j in range(i, i + h):
                a = row[j]
                b = row[j + h]
                c = row[j + 2 * h]
                e = row[j + 3 * h]
                s1 = a + b
                d1 = a - b
                s2 = c + e
                d2 = c - e
                row[j] = s1 + s2
                row[j + h] = d1 + d2
                row[j + 2 * h] = s1 - s2
                row[j + 3 * h] = d1 - d2
        h *= 4
    if h < h_end:
        for i in range(lo, hi, 2 * h):
            for j in range(i, i + h):
                a = row[j]
                b = row[j + h]
                row[j] = a + b
                row[j + h] = a - b


@njit(**_O)
def fwht_row(row, scale):
    """One row (length H, a power of two) through the butterflies (a, b) ->
    (a + b, a - b) for h = 1, 2, 4, ..., H/2, then times ``scale``: the
    reference's arithmetic element by element. Levels below ``_PIECE`` run
    piece by piece while a piece is in L1 (each element meets the same
    operations in the same order: a level's butterflies are independent)."""
    H = row.shape[0]
    piece = min(H, _PIECE)
    for lo in range(0, H, piece):
        _levels(row, lo, lo + piece, 1, piece)
    _levels(row, 0, H, piece, H)
    for j in range(H):
        row[j] = row[j] * scale


@njit(**_O)
def fwht_rows(y, scale):
    """:func:`fwht_row` of each row of the 2-D array y."""
    for r in range(y.shape[0]):
        fwht_row(y[r], scale)


@njit(**_O)
def rotate(x, d, H, k0, k1, scale, out):
    """THC's rotation of the float32 vector x (entries d and beyond: 0) into
    out (m * H entries): block j of out is the FWHT of x[j + i m] times its
    random sign, i = 0 .. H - 1 (the reference's signs, interleave and
    transform). Returns max |out|."""
    m = out.shape[0] // H
    a, b = U32(k0), U32(k1)
    for j0 in range(0, m, _TILE):
        j1 = min(m, j0 + _TILE)
        for i in range(H):
            base = i * m
            for j in range(j0, j1):
                pos = base + j
                sg = np.float32(1.0) - np.float32(2.0) * np.float32(hash32(U32(pos), a, b) & U32(1))
                v = x[pos] if pos < d else np.float32(0.0)
                out[j * H + i] = v * sg
        for j in range(j0, j1):
            fwht_row(out[j * H : (j + 1) * H], scale)
    top = np.float32(0.0)
    for k in range(out.shape[0]):
        v = abs(out[k])
        if v > top or v != v:  # NaN wins, as in torch's amax
            top = v
    return top


@njit(**_O)
def quantize(rot, step, k0, k1, levels, out):
    """THC's stochastic rounding: out = clamp(floor(v) + (u < v - floor(v)), -L, L)
    with v = rot / step (float32) and u the uniforms of element indices 0, 1, ..."""
    a, b = U32(k0), U32(k1)
    L = np.float32(levels)
    idx = U32(0)
    for k in range(rot.shape[0]):
        v = rot[k] / step
        lo = np.floor(v)
        u = uniform(idx, a, b)
        q = lo + np.float32(u < v - lo)
        out[k] = min(max(q, -L), L)
        idx = add32(idx, U32(1))


@njit(**_O)
def unrotate(y, step, H, k0, k1, scale, d, out, buf):
    """The inverse of :func:`rotate` on the integer sums y (m * H entries): each
    block times ``step``, its FWHT, back to positions j + i m, times the sign;
    the first d entries into out. buf: _TILE * H float32 of scratch."""
    m = y.shape[0] // H
    a, b = U32(k0), U32(k1)
    for j0 in range(0, m, _TILE):
        j1 = min(m, j0 + _TILE)
        for j in range(j0, j1):
            row = buf[(j - j0) * H : (j - j0 + 1) * H]
            for i in range(H):
                row[i] = y[j * H + i] * step
            fwht_row(row, scale)
        for i in range(H):
            base = i * m
            for j in range(j0, j1):
                pos = base + j
                if pos < d:
                    sg = np.float32(1.0) - np.float32(2.0) * np.float32(
                        hash32(U32(pos), a, b) & U32(1)
                    )
                    out[pos] = buf[(j - j0) * H + i] * sg
