"""The numba function behind :mod:`hopq.codecs.gqsgd.kernels_cpu` (imported only when
numba is installed); module-level so that numba's on-disk cache finds it."""

# mypy: ignore-errors

import numpy as np
from numba import njit

from hopq.numerics.u32 import U32, add32, hash32, iadd32, isub32, lshr32
from hopq.numerics.u32 import uniform as _uniform

I32 = np.int32


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def exp_reduce(acc, body, k0, k1, start, emin, out):
    """acc (float32 signed exponent codes) <- Algorithm 2 of acc and the byte
    codes in ``body``; ``out`` <- the result's bytes. The draw of element i is
    lowbias32(lowbias32((start + i) ^ k0) ^ k1) (indices < 2^32, as the
    reference's). Branch-free so that the loop vectorizes: every case is
    computed and selected. All arithmetic is int32/uint32 through the
    intrinsics of :mod:`hopq.numerics.u32` (numba's own int32 arithmetic widens to int64: four
    lanes instead of eight and a scalar int -> float32 conversion, 2.2x slower).
    An event of probability 2^-j is "the top j bits of h are zero" (j = 0:
    always; j > 32: never), the reference's "h < 2^32 >> j". Returns the
    number of invalid codes (negative zero, or an exponent below ``emin``);
    the caller raises."""
    one = I32(1)
    zero = I32(0)
    bad = zero
    k0 = U32(k0)
    k1 = U32(k1)
    idx = U32(start)
    emin = I32(emin)
    for i in range(acc.size):
        byte = I32(body[i])
        eb = I32(byte & I32(0x7F))
        nb = byte >= I32(128)  # b's sign bit
        bad = iadd32(bad, one if ((nb & (eb == zero)) | ((eb != zero) & (eb < emin))) else zero)
        a = I32(acc[i])
        pa = a > zero
        ea = a if pa else isub32(zero, a)
        a_big = (ea != zero) & ((eb == zero) | (ea <= eb))  # a has the larger magnitude
        eh = ea if a_big else eb
        el = eb if a_big else ea
        neg_h = (not pa) if a_big else nb
        same = pa == ((eb != zero) & (not nb))
        diff = isub32(el, eh)
        j = diff if same else isub32(diff, one)
        h = hash32(idx, k0, k1)
        idx = add32(idx, U32(1))
        shift = U32(isub32(I32(32), min(max(j, one), I32(32))))
        ev = ((lshr32(h, shift) == U32(0)) & (j <= I32(32))) | (j <= zero)
        evi = one if ev else zero
        e_res = isub32(eh, evi) if same else iadd32(eh, evi)
        mag = zero if ((not same) & (diff == zero)) else e_res
        # one side zero: the sum is the other side
        simple = (ea == zero) | (eb == zero)
        r_mag = iadd32(ea, eb) if simple else mag
        r_neg = (((not pa) & (ea != zero)) | (nb & (eb != zero))) if simple else neg_h
        acc[i] = np.float32(isub32(zero, r_mag) if r_neg else r_mag)
        out[i] = np.uint8(r_mag | (I32(128) if (r_neg & (r_mag != zero)) else zero))
    return bad


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
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


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
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
        idx = U32(start + b0)
        for j in range(nb):
            w = bits[j]
            E = isub32(I32(w >> np.uint64(52)), I32(1022))
            frac = np.float64(w & _FRAC) * 2.0**-52
            e_hi = isub32(I32(chain), E)
            u = np.float64(_uniform(idx, k0, k1))
            idx = add32(idx, U32(1))
            e_mid = e_hi if u < frac else iadd32(e_hi, I32(1))
            e_bot = I32(127) if u < t[j] * p2 else I32(0)
            e = e_bot if e_hi >= I32(127) else e_mid
            e = e if t[j] > 0.0 else I32(0)
            os[j] = np.float32(isub32(I32(0), e) if xs[j] < np.float32(0.0) else e)


@njit(inline="always")
def _lane(body, i, bits):
    """Lane i of a packed payload (little-endian bit stream), sign-extended."""
    if bits == 8:
        return np.int32(np.int8(body[i]))
    if bits == 4:
        b = np.int32(body[i >> 1])
        v = (b >> (4 * (i & 1))) & np.int32(0xF)
        return v - ((v >> 3) & np.int32(1)) * np.int32(16)
    return np.int32(np.int16(np.int32(body[2 * i]) | (np.int32(body[2 * i + 1]) << 8)))


@njit(inline="always")
def _put_lane(out, i, v, bits):
    """Write v's low ``bits`` bits as lane i (4-bit lanes: or'ed into a byte the
    caller zeroed)."""
    if bits == 8:
        out[i] = np.uint8(v & np.int32(0xFF))
    elif bits == 4:
        out[i >> 1] |= np.uint8((v & np.int32(0xF)) << (4 * (i & 1)))
    else:
        out[2 * i] = np.uint8(v & np.int32(0xFF))
        out[2 * i + 1] = np.uint8((v >> 8) & np.int32(0xFF))


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def linear_hop(acc, body, bits, limit, out, encode):
    """acc (float32 integers) += the ``bits``-bit lanes (4, 8 or 16) of ``body``;
    with ``encode``, ``out`` <- the sums' lanes (as :func:`hopq.numerics.bitpack.pack_bits`
    lays them out). Returns how many received lanes or sums lie beyond +-limit
    (the caller raises PayloadError)."""
    bad = np.int32(0)
    lim = np.int32(limit)
    n = acc.size
    if bits == 8:  # the common case, one branch-free loop
        for i in range(n):
            v = np.int32(np.int8(body[i]))
            s = np.int32(acc[i]) + v
            bad += np.int32(abs(v) > lim) | np.int32(abs(s) > lim)
            acc[i] = np.float32(s)
            out[i] = np.uint8(s & np.int32(0xFF))
        return bad
    if encode and bits == 4:
        out[:] = 0
    for i in range(n):
        v = _lane(body, i, bits)
        s = np.int32(acc[i]) + v
        bad += np.int32(abs(v) > lim) | np.int32(abs(s) > lim)
        acc[i] = np.float32(s)
        if encode:
            _put_lane(out, i, s, bits)
    return bad


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def linear_unpack(body, bits, limit, out):
    """out (float32) <- the ``bits``-bit lanes of ``body``; returns how many lie
    beyond +-limit."""
    bad = np.int32(0)
    lim = np.int32(limit)
    for i in range(out.size):
        v = _lane(body, i, bits)
        bad += np.int32(abs(v) > lim)
        out[i] = np.float32(v)
    return bad


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def linear_pack(x, bits, out):
    """out <- the float32 integers of ``x`` as ``bits``-bit lanes (low bits)."""
    if bits == 4:
        out[:] = 0
    for i in range(x.size):
        _put_lane(out, i, np.int32(x[i]), bits)


@njit(inline="always")
def _saturate(v, limit):
    """float32(v), saturated at +-limit where rounding a finite v overflows
    (the reference's keep_finite)."""
    r = np.float32(v)
    if np.isinf(r) and np.isfinite(v):
        r = np.float32(limit) if v > 0.0 else np.float32(-limit)
    return r


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def linear_finish(y, factor, divisor, limit, out):
    """out <- float32(y * factor / divisor) (float64 arithmetic, divisor 1: no
    division), saturated: gqsgd-linear's decode of the integer sums."""
    for i in range(y.size):
        v = np.float64(y[i]) * factor
        if divisor != 1.0:
            v = v / divisor
        out[i] = _saturate(v, limit)


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
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
