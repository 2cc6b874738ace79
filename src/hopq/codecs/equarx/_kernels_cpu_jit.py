"""The numba function behind :mod:`hopq.codecs.equarx.kernels_cpu` (imported only when
numba is installed); module-level so that numba's on-disk cache finds it.

Inner loops index row slices (``row[c]``, c from ``range``) rather than the
whole array at ``q + c``: numba cannot tell that ``q + c`` is non-negative and
wraps negative indices, which keeps LLVM from vectorizing; with slices the
quantization runs 2.5x and the maxima 1.5-2x faster."""

# mypy: ignore-errors

import numpy as np
from numba import njit

ENCODE, DECODE, DECODE_ACC, DAR = 0, 1, 2, 3  # hopq.kernels.Mode
INT8, E4M3, E5M2 = 0, 1, 2  # element formats (hopq.codecs.equarx.kernels_cpu.CODES)

_F0 = np.float32(0.0)
_INF = np.float32(np.inf)
_FMAX = np.float32(np.finfo(np.float32).max)
_Q = np.float32(127.0)
_LIM = np.float32(128.0)
#: 1.5 * 2^23: adding and subtracting it rounds |v| <= 2^22 to an integer,
#: ties to even (the FPU's rounding mode), as torch.round does.
_MAGIC = np.float32(12582912.0)
_ABS = np.int32(0x7FFFFFFF)
_INF_BITS = np.int32(0x7F800000)
#: Bits of the smallest normal of E4M3 (2^-6) and E5M2 (2^-14) as float32, and
#: the factors that make their subnormal steps (2^-9, 2^-16) one.
_E4M3_MIN_NORMAL = np.int32(121 << 23)
_E5M2_MIN_NORMAL = np.int32(113 << 23)
_E4M3_SUB = np.float32(2.0**9)
_E5M2_SUB = np.float32(2.0**16)


@njit(inline="always")
def _scale(inb, k, sbytes, bits, fbits):
    """Scale k of the payload (bf16 or fp32, little-endian) as float32."""
    if sbytes == 2:
        bits[0] = (np.int32(inb[2 * k]) | (np.int32(inb[2 * k + 1]) << 8)) << 16
    else:
        o = 4 * k
        bits[0] = (
            np.int32(inb[o])
            | (np.int32(inb[o + 1]) << 8)
            | (np.int32(inb[o + 2]) << 16)
            | (np.int32(inb[o + 3]) << 24)
        )
    return fbits[0]


@njit(inline="always")
def _acc(a, v):
    """a + v, saturated at +-float32's maximum where two finite terms overflow
    (the reference's ``add_saturating``); NaN and Inf terms keep their sum."""
    s = a + v
    t = min(max(s, -_FMAX), _FMAX)
    return t if (abs(a) < _INF and abs(v) < _INF) else s


@njit(inline="always")
def _decoded(code, f):
    """The reference's dequantization of an int8 code with factor A / 127."""
    v = np.float32(code) * f
    v = min(max(v, -_FMAX), _FMAX)
    return np.float32(np.nan) if code == -128 else v


@njit(inline="always")
def _code(x, a):
    """The reference's quantization of x under scale a: round(x / a * 127),
    ties to even, clamped to +-127; -128 for a non-finite x."""
    v = x / a * _Q if a > _F0 else _F0
    v = min(max(v, -_LIM), _LIM)
    v = (v + _MAGIC) - _MAGIC
    v = min(max(v, -_Q), _Q)
    return np.int32(v) if abs(x) < _INF else np.int32(-128)


@njit(inline="always")
def _decoded8(t, f):
    """The reference's dequantization of an FP8 code whose value (torch's cast to
    float32) is t, with factor A / Q: clamped to float32's range; NaN and Inf
    codes keep torch's bits (a product or clamp of NaN keeps its payload)."""
    v = t * f
    v = min(max(v, -_FMAX), _FMAX)
    return v if abs(t) < _INF else t


@njit(inline="always")
def _scaled8(x, a, q):
    """x / A * Q clamped to +-Q (0 under a zero scale), as the reference before
    its cast; a non-finite x is replaced by its own code later."""
    v = x / a * q if a > _F0 else _F0
    return min(max(v, -q), q)


@njit(inline="always")
def _fp8(v, vb, xb, el):
    """torch's cast of the finite float32 v (bits vb, |v| <= the format's largest
    value) to E4M3fn or E5M2, round to nearest even, subnormals included; xb is
    the entry's own bits: a non-finite entry is E4M3's NaN (0x7F) or E5M2's
    signed Inf (0x7C) or NaN (0x7F)."""
    sign = (vb >> 31) & 1
    u = vb & _ABS
    if el == E4M3:
        thr, shift, off, sub = _E4M3_MIN_NORMAL, 20, 960, _E4M3_SUB
    else:
        thr, shift, off, sub = _E5M2_MIN_NORMAL, 21, 448, _E5M2_SUB
    # below the smallest normal: a multiple of the subnormal step (exact power
    # of two scaling, then the FPU's ties-to-even rounding via _MAGIC); its
    # rounding up to 2^mbits is the smallest normal's code, as it should be
    small = np.int32((abs(v) * sub + _MAGIC) - _MAGIC)
    big = ((u + ((np.int32(1) << (shift - 1)) - 1) + ((u >> shift) & 1)) >> shift) - off
    code = (small if u < thr else big) | (sign << 7)
    xa = xb & _ABS
    if xa >= _INF_BITS:  # the entry itself is non-finite
        if el == E4M3:
            code = np.int32(0x7F)
        else:
            code = (np.int32(0x7C) if xa == _INF_BITS else np.int32(0x7F)) | (((xb >> 31) & 1) << 7)
    return code


@njit(inline="always")
def _put_scale(outb, k, sbytes, amax_bits, bits, fbits):
    """Write scale k from the bit pattern of a block's finite absmax (bf16:
    rounded up, finite in, finite out) and return its float32 value."""
    mi = np.int64(amax_bits)
    if sbytes == 2:
        mb = (mi + 0xFFFF) >> 16
        if mb == 0x7F80:
            mb = 0x7F7F
        outb[2 * k] = np.uint8(mb & 0xFF)
        outb[2 * k + 1] = np.uint8((mb >> 8) & 0xFF)
        bits[0] = np.int32(mb << 16)
    else:
        for t in range(4):
            outb[4 * k + t] = np.uint8((mi >> (8 * t)) & 0xFF)
        bits[0] = np.int32(mi)
    return fbits[0]


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def hop(mode, n, M, S, block, sbytes, inb, local, outf, outb, el, q, table):
    """One part of n entries in ``mode`` (hopq.kernels.Mode). Geometry as
    EQuARXCodec._views: segments of M entries laid out as rows of S columns,
    scale c of a segment covering its column c; a shorter last segment of r
    entries has min(S, ceil(r / block)) columns. Payload: every scale
    (``sbytes`` = 2: bfloat16 rounded up, 4: float32), then one code per entry:
    ``el`` INT8 (-128: a non-finite entry), E4M3 or E5M2 (torch's float8
    bytes; ``table``: the float32 value of each of the 256 codes). ``q``: the
    element's largest value, Q in x / A * Q.

    ENCODE: local -> outb. DECODE: inb -> outf. DECODE_ACC: local += decode(inb).
    DAR: local += decode(inb), then local -> outb. Every float operation is the
    reference's, in its order. Returns the number of invalid scales (negative,
    NaN or Inf; then nothing was written) or 0.

    Maxima are taken on bit patterns (|x| as int32: the same order as the
    floats for x >= 0, and integer maxima vectorize), non-finite entries as 0."""
    full = n // M
    rest = n - full * M
    last_cols = min(S, (rest + block - 1) // block) if rest > 0 else 0
    n_scales = full * S + last_cols
    sb = n_scales * sbytes
    bits = np.empty(1, np.int32)
    fbits = bits.view(np.float32)
    if mode != ENCODE:
        bad = 0
        for k in range(n_scales):
            a = _scale(inb, k, sbytes, bits, fbits)
            # negative (incl. -0.0: the sign bit), NaN or Inf
            bad += 1 if (bits[0] < 0 or not (a < _INF)) else 0
        if bad:
            return bad
    locali = local.view(np.int32)
    fac = np.empty(S, np.float32)
    amaxi = np.empty(S, np.int32)
    a32 = np.empty(S, np.float32)
    tmp = np.empty(max(S, M) if el != INT8 else 0, np.float32)
    tmpi = tmp.view(np.int32)
    nseg = full + (1 if rest > 0 else 0)
    for j in range(nseg):
        p = j * M
        C = S if j < full else last_cols
        L = M if j < full else rest
        s0 = j * S
        # rows of C columns; one scale per column. C == 1 (the contiguous
        # layout) is one row of L entries under one scale: its loops run
        # over the row instead of over one-entry rows.
        if mode != ENCODE:
            for c in range(C):
                fac[c] = _scale(inb, s0 + c, sbytes, bits, fbits) / q
            if C == 1:
                f = fac[0]
                codes = inb[sb + p : sb + p + L]
                dst = outf[p : p + L] if mode == DECODE else local[p : p + L]
                if el == INT8:
                    for i in range(L):
                        v = _decoded(np.int32(np.int8(codes[i])), f)
                        dst[i] = v if mode == DECODE else _acc(dst[i], v)
                else:
                    for i in range(L):
                        v = _decoded8(table[codes[i]], f)
                        dst[i] = v if mode == DECODE else _acc(dst[i], v)
            else:
                for r0 in range(0, L, C):
                    w = min(C, L - r0)
                    o = p + r0
                    codes = inb[sb + o : sb + o + w]
                    dst = outf[o : o + w] if mode == DECODE else local[o : o + w]
                    if el == INT8:
                        for c in range(w):
                            v = _decoded(np.int32(np.int8(codes[c])), fac[c])
                            dst[c] = v if mode == DECODE else _acc(dst[c], v)
                    else:
                        for c in range(w):
                            v = _decoded8(table[codes[c]], fac[c])
                            dst[c] = v if mode == DECODE else _acc(dst[c], v)
        if mode in (DECODE, DECODE_ACC):
            continue
        # -- encode: per column the largest finite |x| ------------------------
        if C == 1:
            row = locali[p : p + L]
            mi = np.int32(0)
            for i in range(L):
                a = row[i] & _ABS
                mi = max(mi, a if a < _INF_BITS else np.int32(0))
            amaxi[0] = mi
        else:
            for c in range(C):
                amaxi[c] = 0
            for r0 in range(0, L, C):
                w = min(C, L - r0)
                row = locali[p + r0 : p + r0 + w]
                for c in range(w):
                    a = row[c] & _ABS
                    a = a if a < _INF_BITS else np.int32(0)
                    amaxi[c] = a if a > amaxi[c] else amaxi[c]
        for c in range(C):
            a32[c] = _put_scale(outb, s0 + c, sbytes, amaxi[c], bits, fbits)
        # -- encode: codes ----------------------------------------------------
        if el == INT8:
            if C == 1:
                ac = a32[0]
                row = local[p : p + L]
                dst = outb[sb + p : sb + p + L]
                for i in range(L):
                    dst[i] = np.uint8(_code(row[i], ac) & 0xFF)
            else:
                for r0 in range(0, L, C):
                    w = min(C, L - r0)
                    row = local[p + r0 : p + r0 + w]
                    dst = outb[sb + p + r0 : sb + p + r0 + w]
                    for c in range(w):
                        dst[c] = np.uint8(_code(row[c], a32[c]) & 0xFF)
            continue
        # FP8: the scaled values first (into tmp), then their casts from the bits
        # (C == 1: the whole run is one row under scale 0)
        step = C if C > 1 else L
        for r0 in range(0, L, step):
            w = min(step, L - r0)
            row = local[p + r0 : p + r0 + w]
            rowi = locali[p + r0 : p + r0 + w]
            dst = outb[sb + p + r0 : sb + p + r0 + w]
            for c in range(w):
                tmp[c] = _scaled8(row[c], a32[c if C > 1 else 0], q)
            for c in range(w):
                dst[c] = np.uint8(_fp8(tmp[c], tmpi[c], rowi[c], el) & 0xFF)
    return 0
