"""The numba function behind :mod:`hopq.kernels.equarx_cpu` (imported only when
numba is installed); module-level so that numba's on-disk cache finds it."""

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


@njit(nogil=True, cache=True, boundscheck=False)
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
    NaN or Inf; then nothing was written) or 0."""
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
    fac = np.empty(S, np.float32)
    amax = np.empty(S, np.float32)
    amaxi = amax.view(np.int32)
    a32 = np.empty(S, np.float32)
    nseg = full + (1 if rest > 0 else 0)
    for j in range(nseg):
        p = j * M
        C = S if j < full else last_cols
        L = M if j < full else rest
        s0 = j * S
        if mode != ENCODE:
            for c in range(C):
                fac[c] = _scale(inb, s0 + c, sbytes, bits, fbits) / _Q
            for r0 in range(0, L, C):
                w = min(C, L - r0)
                q = p + r0
                for c in range(w):
                    code = np.int32(np.int8(inb[sb + q + c]))
                    v = np.float32(code) * fac[c]
                    v = min(max(v, -_FMAX), _FMAX)
                    v = np.float32(np.nan) if code == -128 else v
                    if mode == DECODE:
                        outf[q + c] = v
                    else:
                        local[q + c] = local[q + c] + v
        if mode in (DECODE, DECODE_ACC):
            continue
        # -- encode: per column the largest finite |x| ------------------------
        for c in range(C):
            amax[c] = _F0
        for r0 in range(0, L, C):
            w = min(C, L - r0)
            q = p + r0
            for c in range(w):
                a = abs(local[q + c])
                a = a if a < _INF else _F0
                amax[c] = a if a > amax[c] else amax[c]
        for c in range(C):
            k = s0 + c
            if sbytes == 2:
                mi = np.int64(amaxi[c])
                mb = (mi + 0xFFFF) >> 16  # round_up_bf16, finite in, finite out
                if mb == 0x7F80:
                    mb = 0x7F7F
                outb[2 * k] = np.uint8(mb & 0xFF)
                outb[2 * k + 1] = np.uint8((mb >> 8) & 0xFF)
                bits[0] = np.int32(mb << 16)
                a32[c] = fbits[0]
            else:
                mi = np.int64(amaxi[c])
                for t in range(4):
                    outb[4 * k + t] = np.uint8((mi >> (8 * t)) & 0xFF)
                a32[c] = amax[c]
        # -- encode: codes ----------------------------------------------------
        for r0 in range(0, L, C):
            w = min(C, L - r0)
            q = p + r0
            for c in range(w):
                x = local[q + c]
                ac = a32[c]
                v = x / ac * _Q if ac > _F0 else _F0
                v = min(max(v, -_LIM), _LIM)
                v = (v + _MAGIC) - _MAGIC
                v = min(max(v, -_Q), _Q)
                code = np.int32(v) if abs(x) < _INF else np.int32(-128)
                outb[sb + q + c] = np.uint8(code & 0xFF)
    return 0
