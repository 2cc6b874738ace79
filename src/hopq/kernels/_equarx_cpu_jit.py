"""The numba function behind :mod:`hopq.kernels.equarx_cpu` (imported only when
numba is installed); module-level so that numba's on-disk cache finds it.

Inner loops index row slices (``row[c]``, c from ``range``) rather than the
whole array at ``q + c``: numba cannot tell that ``q + c`` is non-negative and
wraps negative indices, which keeps LLVM from vectorizing; with slices the
quantization runs 2.5x and the maxima 1.5-2x faster."""

# mypy: ignore-errors

import numpy as np
from numba import njit

ENCODE, DECODE, DECODE_ACC, DAR = 0, 1, 2, 3  # hopq.kernels.Mode

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
def hop(mode, n, M, S, block, sbytes, inb, local, outf, outb):
    """One part of n entries in ``mode`` (hopq.kernels.Mode). Geometry as
    EQuARXCodec._views: segments of M entries laid out as rows of S columns,
    scale c of a segment covering its column c; a shorter last segment of r
    entries has min(S, ceil(r / block)) columns. Payload: every scale
    (``sbytes`` = 2: bfloat16 rounded up, 4: float32), then one int8 code per
    entry (-128: a non-finite entry).

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
                fac[c] = _scale(inb, s0 + c, sbytes, bits, fbits) / _Q
            if C == 1:
                f = fac[0]
                codes = inb[sb + p : sb + p + L]
                dst = outf[p : p + L] if mode == DECODE else local[p : p + L]
                for i in range(L):
                    v = _decoded(np.int32(np.int8(codes[i])), f)
                    dst[i] = v if mode == DECODE else dst[i] + v
            else:
                for r0 in range(0, L, C):
                    w = min(C, L - r0)
                    q = p + r0
                    codes = inb[sb + q : sb + q + w]
                    dst = outf[q : q + w] if mode == DECODE else local[q : q + w]
                    for c in range(w):
                        v = _decoded(np.int32(np.int8(codes[c])), fac[c])
                        dst[c] = v if mode == DECODE else dst[c] + v
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
    return 0
