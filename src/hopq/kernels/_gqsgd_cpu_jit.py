"""The numba function behind :mod:`hopq.kernels.gqsgd_cpu` (imported only when
numba is installed); module-level so that numba's on-disk cache finds it."""

# mypy: ignore-errors

import numpy as np
from numba import njit

from hopq.numerics.rng import M1, M2

U32 = np.uint32


@njit(inline="always")
def _mix(x):
    """lowbias32 in native uint32 arithmetic (8 lanes per AVX2 vector)."""
    x = U32(x ^ (x >> U32(16)))
    x = U32(x * U32(M1))
    x = U32(x ^ (x >> U32(15)))
    x = U32(x * U32(M2))
    return U32(x ^ (x >> U32(16)))


@njit(nogil=True, cache=True, boundscheck=False)
def exp_reduce(acc, body, k0, k1, start, emin, out, write_out):
    """acc (float32 signed exponent codes) <- Algorithm 2 of acc and the byte
    codes in ``body``; with ``write_out`` also their bytes in ``out``. The draw of
    element i is lowbias32(lowbias32((start + i) ^ k0) ^ k1) (indices < 2^32, as
    the reference's). Branch-free in int32/uint32 so that the loop vectorizes:
    every case is computed and selected. An event of probability 2^-j is "the
    top j bits of h are zero" (j = 0: always; j > 32: never), the reference's
    "h < 2^32 >> j". Returns the number of invalid codes (negative zero, or an
    exponent below ``emin``); the caller raises."""
    one = np.int32(1)
    zero = np.int32(0)
    bad = zero
    k0 = U32(k0)
    k1 = U32(k1)
    base = U32(start)
    emin = np.int32(emin)
    for i in range(acc.size):
        byte = np.int32(body[i])
        eb = byte & np.int32(0x7F)
        nb = byte >> np.int32(7)
        bad += (nb & np.int32(eb == zero)) | (np.int32(eb != zero) & np.int32(eb < emin))
        sb = one - np.int32(2) * nb
        b = eb * sb
        a = np.int32(acc[i])
        sa = one if a > zero else -one
        ea = a * sa
        a_big = (ea != zero) & ((eb == zero) | (ea <= eb))
        eh = ea if a_big else eb
        el = eb if a_big else ea
        sh = sa if a_big else sb
        same = (a > zero) == (b > zero)
        diff = el - eh
        j = diff if same else diff - one
        h = _mix(_mix((base + U32(i)) ^ k0) ^ k1)
        shift = U32(np.int32(32) - min(max(j, one), np.int32(32)))
        ev = np.int32(((h >> shift) == U32(0)) & (j <= np.int32(32))) | np.int32(j <= zero)
        e_res = eh - ev if same else eh + ev
        res = zero if ((not same) & (diff == zero)) else sh * e_res
        r = a + b if ((ea == zero) | (eb == zero)) else res
        acc[i] = np.float32(r)
        if write_out:
            out[i] = np.uint8(
                (r * (one if r > zero else -one)) | (np.int32(128) if r < zero else zero)
            )
    return bad
