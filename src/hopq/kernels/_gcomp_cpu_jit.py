"""numba kernels of GComp (compiled on first import, cached on disk). Same bits
as :mod:`hopq.codecs.gcomp.reference`; errors come back as negative codes."""

# mypy: ignore-errors
from __future__ import annotations

import numpy as np
from numba import njit

_O = {"nogil": True, "cache": True, "boundscheck": False}


@njit(**_O)
def _put32(out, pos, v):
    out[pos] = v & 0xFF
    out[pos + 1] = (v >> 8) & 0xFF
    out[pos + 2] = (v >> 16) & 0xFF
    out[pos + 3] = (v >> 24) & 0xFF


@njit(**_O)
def encode_block(x, thr, has_thr, fixed, enc_code, enc_len, C, out, lv_buf, mt_buf, head):
    """x: float32 values viewed as uint32; writes the block into out (the bound's
    size); returns the payload length. head: the 8 block-header words (the
    compressed length filled in here)."""
    n = x.shape[0]
    k = (n + C - 1) // C
    pos = 32 + 24 * k
    for c in range(k):
        s = c * C
        e = min(n, s + C)
        start = pos
        # exponent stream straight into out; levels and mantissas to scratch
        acc = np.uint64(0)
        nacc = 0
        lacc = np.uint64(0)
        lnacc = 0
        lpos = 0
        macc = np.uint64(0)
        mnacc = 0
        mpos = 0
        eb = 0
        mb = 0
        nnz = 0
        for i in range(s, e):
            b = np.uint32(x[i])
            ex = (b >> np.uint32(23)) & np.uint32(0xFF)
            w = enc_len[ex]
            acc = (acc << np.uint64(w)) | np.uint64(enc_code[ex])
            nacc += w
            eb += w
            while nacc >= 8:
                nacc -= 8
                out[pos] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
                pos += 1
            if ex == 0:
                continue
            nnz += 1
            lv = 0
            if ex != 255:
                if fixed >= 0:
                    lv = fixed
                elif has_thr:
                    a = np.abs(np.float32(x.view(np.float32)[i]))
                    t = thr[i]
                    lv = (
                        int(a * np.float32(64.0) < t)
                        + int(a * np.float32(4096.0) < t)
                        + int(a * np.float32(262144.0) < t)
                    )
            lacc = (lacc << np.uint64(2)) | np.uint64(lv)
            lnacc += 2
            if lnacc == 8:
                lv_buf[lpos] = np.uint8(lacc & np.uint64(0xFF))
                lpos += 1
                lnacc = 0
                lacc = np.uint64(0)
            keep = 24 - 6 * lv
            field = (
                ((b >> np.uint32(31)) << np.uint32(23)) | (b & np.uint32(0x7FFFFF))
            ) >> np.uint32(6 * lv)
            macc = (macc << np.uint64(keep)) | np.uint64(field)
            mnacc += keep
            mb += keep
            while mnacc >= 8:
                mnacc -= 8
                mt_buf[mpos] = np.uint8((macc >> np.uint64(mnacc)) & np.uint64(0xFF))
                mpos += 1
        if nacc > 0:
            out[pos] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))
            pos += 1
        if lnacc > 0:
            lv_buf[lpos] = np.uint8((lacc << np.uint64(8 - lnacc)) & np.uint64(0xFF))
            lpos += 1
        if mnacc > 0:
            mt_buf[mpos] = np.uint8((macc << np.uint64(8 - mnacc)) & np.uint64(0xFF))
            mpos += 1
        for j in range(lpos):
            out[pos + j] = lv_buf[j]
        pos += lpos
        for j in range(mpos):
            out[pos + j] = mt_buf[j]
        pos += mpos
        h = 32 + 24 * c
        _put32(out, h, start)
        _put32(out, h + 4, pos - start)
        _put32(out, h + 8, e - s)
        _put32(out, h + 12, nnz)
        _put32(out, h + 16, eb)
        _put32(out, h + 20, mb)
    comp = 8 * pos
    head[6] = comp & 0xFFFFFFFF
    head[7] = comp >> 32
    for j in range(8):
        _put32(out, 4 * j, head[j])
    return pos


@njit(**_O)
def _peek(p, start, nbytes, pos, w):
    """w (<= 24) bits at bit pos of the stream p[start : start + nbytes] (zeros past its end)."""
    i = pos >> 3
    word = 0
    for j in range(4):
        word <<= 8
        if i + j < nbytes:
            word |= int(p[start + i + j])
    return (word >> (32 - (pos & 7) - w)) & ((1 << w) - 1)


@njit(**_O)
def decode_chunks(p, heads, C, lut_sym, lut_len, lengths, n_theta, out, acc):
    """Decode (acc=False) or accumulate (acc=True) every chunk into out (float32).
    Returns 0, or -1 bad exponent stream, -2 escaped short code, -3 non-zero
    count, -4 mantissa length."""
    res = np.empty(C, np.uint32)
    for c in range(heads.shape[0]):
        off = heads[c, 0]
        vals = heads[c, 2]
        nnz = heads[c, 3]
        eb = heads[c, 4]
        mb = heads[c, 5]
        ebytes = (eb + 7) >> 3
        lstart = off + ebytes
        lbytes = (2 * nnz + 7) >> 3
        mstart = lstart + lbytes
        mbytes = (mb + 7) >> 3
        bit = 0
        li = 0
        mbit = 0
        for i in range(vals):
            win = _peek(p, off, ebytes, bit, n_theta)
            ln = lut_len[win]
            if ln == 0 or bit + ln > eb:
                return -1
            sym = lut_sym[win]
            if sym == 256:
                sym = _peek(p, off, ebytes, bit + n_theta, 8)
                if lengths[sym] <= n_theta:
                    return -2
            bit += ln
            if sym == 0:
                res[i] = 0
                continue
            if li >= nnz:
                return -3
            lv = _peek(p, lstart, lbytes, 2 * li, 2)
            li += 1
            keep = 24 - 6 * lv
            if mbit + keep > mb:
                return -4
            field = _peek(p, mstart, mbytes, mbit, keep)
            mbit += keep
            sign = (field >> (keep - 1)) & 1
            mant = (field & ((1 << (keep - 1)) - 1)) << (6 * lv)
            res[i] = np.uint32((sign << 31) | (sym << 23) | mant)
        if bit != eb:
            return -1
        if li != nnz:
            return -3
        if mbit != mb:
            return -4
        f = res.view(np.float32)
        s = c * C
        if acc:
            for i in range(vals):
                out[s + i] += f[i]
        else:
            for i in range(vals):
                out[s + i] = f[i]
    return 0
