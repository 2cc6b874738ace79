"""The numba function behind :mod:`hopq.kernels.gqsgd_cpu` (imported only when
numba is installed); module-level so that numba's on-disk cache finds it."""

# mypy: ignore-errors

import numpy as np
from numba import njit

from hopq.kernels._u32 import U32, hash32
from hopq.kernels._u32 import uniform as _uniform


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
        h = hash32(base + U32(i), k0, k1)
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


@njit(nogil=True, cache=True, boundscheck=False)
def linear_quantize(x, factor, levels, k0, k1, start, out):
    """out <- gqsgd-linear's leaf integers (as float32): x * factor (float64)
    rounded down or up with the uniform of element index start + i, clamped to
    [-levels, levels]. ``out`` may be ``x`` (in place)."""
    k0 = U32(k0)
    k1 = U32(k1)
    lim = np.float64(levels)
    for i in range(x.size):
        v = np.float64(x[i]) * factor
        lo = np.floor(v)
        u = np.float64(_uniform(U32(start + i), k0, k1))
        q = lo + (1.0 if u < v - lo else 0.0)
        out[i] = np.float32(min(max(q, -lim), lim))


_BLOCK = 4096
_FRAC = np.uint64((1 << 52) - 1)


@njit(nogil=True, cache=True, boundscheck=False)
def exp_quantize(x, scale, chain, k0, k1, start, out):
    """out <- gqsgd-exp's leaf codes (signed exponents as float32): natural
    dithering of t = |x| / scale scaled by 2^-chain (the reference's
    exp_quantize). frexp(t) = (m, E) is read from t's bits, a block at a time:
    E = biased exponent - 1022 and 2 m - 1 = the 52-bit fraction, exactly
    (a subnormal t reads E = -1022, which still lands in the bottom case,
    the only one that uses t then: t 2^(127 - chain) = ldexp, exact).
    Element i draws the uniform of index start + i; ``out`` may be ``x``. The
    loops index block slices (numba wraps a negative ``b0 + j``, which keeps
    LLVM from vectorizing)."""
    k0 = U32(k0)
    k1 = U32(k1)
    p2 = 2.0 ** (127 - chain)
    t = np.empty(_BLOCK, np.float64)
    bits = t.view(np.uint64)
    for b0 in range(0, x.size, _BLOCK):
        nb = min(_BLOCK, x.size - b0)
        xs = x[b0 : b0 + nb]
        os = out[b0 : b0 + nb]
        for j in range(nb):
            t[j] = abs(np.float64(xs[j])) / scale
        for j in range(nb):
            w = bits[j]
            E = np.int32(w >> np.uint64(52)) - np.int32(1022)
            frac = np.float64(w & _FRAC) * 2.0**-52
            e_hi = np.int32(chain) - E
            u = np.float64(_uniform(U32(start + b0 + j), k0, k1))
            e_mid = e_hi if u < frac else e_hi + np.int32(1)
            e_bot = np.int32(127) if u < t[j] * p2 else np.int32(0)
            e = e_bot if e_hi >= np.int32(127) else e_mid
            e = e if t[j] > 0.0 else np.int32(0)
            os[j] = np.float32(-e if xs[j] < np.float32(0.0) else e)


@njit(nogil=True, cache=True, boundscheck=False)
def linear_hop8(acc, body, limit, out):
    """acc (float32 integers) += the int8 lanes of ``body``; ``out`` <- the sums
    as int8 bytes. Returns how many received lanes or sums lie beyond +-limit
    (the caller raises PayloadError)."""
    bad = np.int32(0)
    lim = np.int32(limit)
    for i in range(acc.size):
        v = np.int32(np.int8(body[i]))
        s = np.int32(acc[i]) + v
        bad += np.int32(abs(v) > lim) | np.int32(abs(s) > lim)
        acc[i] = np.float32(s)
        out[i] = np.uint8(s & np.int32(0xFF))
    return bad


@njit(inline="always")
def _saturate(v, limit):
    """float32(v), saturated at +-limit where rounding a finite v overflows
    (the reference's keep_finite)."""
    r = np.float32(v)
    if np.isinf(r) and np.isfinite(v):
        r = np.float32(limit) if v > 0.0 else np.float32(-limit)
    return r


@njit(nogil=True, cache=True, boundscheck=False)
def linear_finish(y, factor, divisor, limit, out):
    """out <- float32(y * factor / divisor) (float64 arithmetic, divisor 1: no
    division), saturated: gqsgd-linear's decode of the integer sums."""
    for i in range(y.size):
        v = np.float64(y[i]) * factor
        if divisor != 1.0:
            v = v / divisor
        out[i] = _saturate(v, limit)


@njit(nogil=True, cache=True, boundscheck=False)
def exp_finish(y, scale, chain, divisor, limit, out):
    """out <- float32(sign 2^(chain - e) scale / divisor) for the signed exponent
    codes y (0: zero), saturated: gqsgd-exp's decode. 2^(chain - e) scale is
    exact in float64 (chain - e in [chain - 127, chain - 1]), as the reference's
    ldexp."""
    pw = np.empty(128, np.float64)
    for e in range(128):
        pw[e] = scale * 2.0 ** (chain - e)
    for i in range(y.size):
        c = np.int32(y[i])
        e = abs(c)
        v = 0.0
        if e > 0:
            v = -pw[e] if c < 0 else pw[e]
            if divisor != 1.0:
                v = v / divisor
        out[i] = _saturate(v, limit)
