"""The numba functions behind :mod:`hopq.codecs.thc.kernels_cpu` (imported only when
numba is installed): THC's random signs and uniforms (the lowbias32 hash of
:mod:`hopq.numerics.rng` in 32-bit lanes, :mod:`hopq.numerics.u32`) and the Walsh-Hadamard
butterflies of :func:`hopq.codecs.thc.fwht`, in place, one cache-sized block
at a time instead of one pass over the whole vector per butterfly level.

What keeps them fast: the butterfly loops index with unsigned integers (numba
adds negative-index wrap-around code to signed ones, which kept them scalar:
the transform of 4M entries 19 -> 10.5 ms); the first three levels run eight
entries at a time in registers; and the interleave of :func:`rotate` and
:func:`unrotate` goes through _TILE x _TILE squares, so that every cache line
of the rows (H entries apart, so in the same cache sets) is written whole at
once (rotate 32 -> 24 ms, unrotate 24 -> 18 ms)."""

# mypy: ignore-errors

import numpy as np
from numba import njit

from hopq.numerics.u32 import U32, add32, hash32, uniform


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
        hu = np.uint64(h)
        for i in range(lo, hi, 4 * h):
            iu = np.uint64(i)
            for t in range(h):
                j = iu + np.uint64(t)
                a = row[j]
                b = row[j + hu]
                c = row[j + 2 * hu]
                e = row[j + 3 * hu]
                s1 = a + b
                d1 = a - b
                s2 = c + e
                d2 = c - e
                row[j] = s1 + s2
                row[j + hu] = d1 + d2
                row[j + 2 * hu] = s1 - s2
                row[j + 3 * hu] = d1 - d2
        h *= 4
    if h < h_end:
        hu = np.uint64(h)
        for i in range(lo, hi, 2 * h):
            iu = np.uint64(i)
            for t in range(h):
                j = iu + np.uint64(t)
                a = row[j]
                b = row[j + hu]
                row[j] = a + b
                row[j + hu] = a - b


@njit(inline="always")
def _first3(row, lo, hi):
    """Levels h = 1, 2, 4 on row[lo:hi] (a multiple of 8), eight entries at a
    time in registers: the same additions in the same order as level by level."""
    for gi in range(lo, hi, 8):
        g = np.uint64(gi)
        x0 = row[g]
        x1 = row[g + np.uint64(1)]
        x2 = row[g + np.uint64(2)]
        x3 = row[g + np.uint64(3)]
        x4 = row[g + np.uint64(4)]
        x5 = row[g + np.uint64(5)]
        x6 = row[g + np.uint64(6)]
        x7 = row[g + np.uint64(7)]
        a0 = x0 + x1
        a1 = x0 - x1
        a2 = x2 + x3
        a3 = x2 - x3
        a4 = x4 + x5
        a5 = x4 - x5
        a6 = x6 + x7
        a7 = x6 - x7
        b0 = a0 + a2
        b2 = a0 - a2
        b1 = a1 + a3
        b3 = a1 - a3
        b4 = a4 + a6
        b6 = a4 - a6
        b5 = a5 + a7
        b7 = a5 - a7
        row[g] = b0 + b4
        row[g + np.uint64(4)] = b0 - b4
        row[g + np.uint64(1)] = b1 + b5
        row[g + np.uint64(5)] = b1 - b5
        row[g + np.uint64(2)] = b2 + b6
        row[g + np.uint64(6)] = b2 - b6
        row[g + np.uint64(3)] = b3 + b7
        row[g + np.uint64(7)] = b3 - b7


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
        if piece >= 8:
            _first3(row, lo, lo + piece)
            _levels(row, lo, lo + piece, 8, piece)
        else:
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
    tile = np.empty(_TILE * _TILE, np.float32)
    top = np.float32(0.0)
    nan = False
    for j0 in range(0, m, _TILE):
        j1 = min(m, j0 + _TILE)
        i_fast = 0
        if j1 - j0 == _TILE:
            # whole tiles inside x: _TILE x _TILE squares through a local tile,
            # so that every line of out is written whole at once (rows H apart
            # share cache sets: lines written one entry at a time were evicted
            # before they were full)
            i_fast = min(H, max(0, (d - j1) // m + 1)) // _TILE * _TILE
            for i0 in range(0, i_fast, _TILE):
                for ii in range(_TILE):
                    bu = np.uint64((i0 + ii) * m + j0)
                    for jj in range(_TILE):
                        pos = bu + np.uint64(jj)
                        sg = np.float32(1.0) - np.float32(2.0) * np.float32(
                            hash32(U32(pos), a, b) & U32(1)
                        )
                        tile[ii * _TILE + jj] = x[pos] * sg
                for jj in range(_TILE):
                    ob = np.uint64((j0 + jj) * H + i0)
                    for ii in range(_TILE):
                        out[ob + np.uint64(ii)] = tile[ii * _TILE + jj]
        for i in range(i_fast, H):
            base = i * m
            for j in range(j0, j1):
                pos = base + j
                sg = np.float32(1.0) - np.float32(2.0) * np.float32(hash32(U32(pos), a, b) & U32(1))
                v = x[pos] if pos < d else np.float32(0.0)
                out[j * H + i] = v * sg
        for j in range(j0, j1):
            row = out[j * H : (j + 1) * H]
            fwht_row(row, scale)
            for k in range(H):  # the maximum while the row is in cache
                v = abs(row[k])
                top = max(top, v)
                nan |= v != v
    return np.float32(np.nan) if nan else top  # NaN wins, as in torch's amax


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
    the first d entries into out. buf: a workspace of _TILE * H float32."""
    m = y.shape[0] // H
    a, b = U32(k0), U32(k1)
    tile = np.empty(_TILE * _TILE, np.float32)
    for j0 in range(0, m, _TILE):
        j1 = min(m, j0 + _TILE)
        for j in range(j0, j1):
            row = buf[(j - j0) * H : (j - j0 + 1) * H]
            for i in range(H):
                row[i] = y[j * H + i] * step
            fwht_row(row, scale)
        i_fast = 0
        if j1 - j0 == _TILE:  # whole squares through a local tile, as in rotate
            i_fast = min(H, max(0, (d - j1) // m + 1)) // _TILE * _TILE
            for i0 in range(0, i_fast, _TILE):
                for jj in range(_TILE):
                    rb = np.uint64(jj * H + i0)
                    for ii in range(_TILE):
                        tile[ii * _TILE + jj] = buf[rb + np.uint64(ii)]
                for ii in range(_TILE):
                    bu = np.uint64((i0 + ii) * m + j0)
                    for jj in range(_TILE):
                        pos = bu + np.uint64(jj)
                        sg = np.float32(1.0) - np.float32(2.0) * np.float32(
                            hash32(U32(pos), a, b) & U32(1)
                        )
                        out[pos] = tile[ii * _TILE + jj] * sg
        for i in range(i_fast, H):
            base = i * m
            for j in range(j0, j1):
                pos = base + j
                if pos < d:
                    sg = np.float32(1.0) - np.float32(2.0) * np.float32(
                        hash32(U32(pos), a, b) & U32(1)
                    )
                    out[pos] = buf[(j - j0) * H + i] * sg


@njit(**_O)
def pack8(ints, top, out):
    """THC's 8-bit lanes: each integer (float32) clamped to +-top, as int8 (two's
    complement) into out; returns how many were clamped."""
    t = np.float32(top)
    sat = 0
    for k in range(ints.shape[0]):
        v = ints[k]
        sat += np.int64(abs(v) > t)
        out[k] = np.int8(min(max(v, -t), t))
    return sat
