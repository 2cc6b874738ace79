"""numba kernels of GComp (compiled on first import, cached on disk). Same bits
as :mod:`hopq.codecs.gcomp.reference`; errors come back as negative codes.

Bit streams are MSB first. Writers keep a 64-bit accumulator and store a whole
32-bit big-endian word at every value without a branch (the word index only
advances once 32 bits are complete; until then the store is overwritten), into
word buffers that are copied to the payload at the end of the chunk. Readers
copy each stream into big-endian 64-bit words (zero padded) and peek any field
at any bit position with two loads and shifts. Every value is handled without
a data-dependent branch: a zero (pruned) value writes level and mantissa fields
of width 0. The fused hop decodes a value, adds the local one and encodes the
sum in the same iteration."""

# mypy: ignore-errors
from __future__ import annotations

import numpy as np
from numba import njit

_O = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}

_U64 = np.uint64
_U32 = np.uint32


@njit(**_O)
def _put32(out, pos, v):
    out[pos] = v & 0xFF
    out[pos + 1] = (v >> 8) & 0xFF
    out[pos + 2] = (v >> 16) & 0xFF
    out[pos + 3] = (v >> 24) & 0xFF


@njit(inline="always", **_O)
def _bswap32(v):
    return (
        ((v & _U32(0xFF)) << _U32(24))
        | ((v & _U32(0xFF00)) << _U32(8))
        | ((v >> _U32(8)) & _U32(0xFF00))
        | (v >> _U32(24))
    )


@njit(inline="always", **_O)
def _bswap64(v):
    lo = _U64(_bswap32(_U32(v & _U64(0xFFFFFFFF))))
    hi = _U64(_bswap32(_U32(v >> _U64(32))))
    return (lo << _U64(32)) | hi


@njit(**_O)
def _words(p, start, nbytes, buf8):
    """The stream p[start : start + nbytes] as big-endian uint64 words (two zero
    words of padding) in buf8's memory; returns the word view."""
    nw = (nbytes + 7) >> 3
    for j in range(nbytes):
        buf8[j] = p[start + j]
    for j in range(nbytes, 8 * nw + 16):
        buf8[j] = 0
    w = buf8[: 8 * nw + 16].view(np.uint64)
    for j in range(nw):
        w[j] = _bswap64(w[j])
    return w


@njit(inline="always", **_O)
def _peek(w0, w1, pos, width):
    """``width`` (1-32) bits at bit ``pos`` of a word stream, w0 and w1 its
    words pos >> 6 and pos >> 6 + 1 (scalars: an array argument would cost a
    reference count per call inside the loops)."""
    o = _U64(pos & 63)
    hi = (w0 << o) | ((w1 >> _U64(1)) >> (_U64(63) - o))
    return hi >> _U64(64 - width)


@njit(inline="always", **_O)
def _level(a, t, has_thr, fixed, ex):
    lv = 0
    if fixed >= 0:
        lv = fixed
    elif has_thr:
        lv = int(a * np.float32(64.0) < t) + int(a * np.float32(4096.0) < t)
        lv += int(a * np.float32(262144.0) < t)
    return lv * int(ex != 255)


@njit(**_O)
def _flush(wbuf, wi, acc, nacc, out, pos):
    """Write the last partial word and copy the stream's bytes into out at pos;
    returns the byte count."""
    if nacc > 0:
        wbuf[wi] = _bswap32(_U32((acc << _U64(32 - nacc)) & _U64(0xFFFFFFFF)))
    nbits = 32 * wi + nacc
    nb = (nbits + 7) >> 3
    b = wbuf.view(np.uint8)
    for j in range(nb):
        out[pos + j] = b[j]
    return nb


@njit(**_O)
def _scratch(C, n_theta):
    nw = (C * (n_theta + 8)) // 32 + 4
    return (
        np.empty(nw, np.uint32),
        np.empty((2 * C) // 32 + 4, np.uint32),
        np.empty((24 * C) // 32 + 4, np.uint32),
    )


@njit(**_O)
def _encode_chunk(xu, xf, thr, has_thr, fixed, enc_code, enc_len, s, e, ew, lw, mw, out, pos):
    """Encode values s..e of xu (uint32 bits; xf the same memory as float32) as
    one chunk at out[pos:]; returns (bytes, nnz, exponent bits, mantissa bits)."""
    eacc = _U64(0)
    en = 0
    ei = 0
    lacc = _U64(0)
    ln_ = 0
    li = 0
    macc = _U64(0)
    mn = 0
    mi = 0
    nnz = 0
    for i in range(s, e):
        b = xu[i]
        ex = (b >> _U32(23)) & _U32(0xFF)
        w = enc_len[ex]
        eacc = (eacc << _U64(w)) | _U64(enc_code[ex])
        en += w
        f = en >> 5
        en -= f << 5
        ew[ei] = _bswap32(_U32((eacc >> _U64(en)) & _U64(0xFFFFFFFF)))
        ei += f
        nz = int(ex != 0)
        nnz += nz
        t = thr[i] if has_thr else np.float32(0.0)
        lv = _level(abs(xf[i]), t, has_thr, fixed, ex) * nz
        lacc = (lacc << _U64(2 * nz)) | _U64(lv)
        ln_ += 2 * nz
        f = ln_ >> 5
        ln_ -= f << 5
        lw[li] = _bswap32(_U32((lacc >> _U64(ln_)) & _U64(0xFFFFFFFF)))
        li += f
        keep = (24 - 6 * lv) * nz
        field = (((b >> _U32(31)) << _U32(23)) | (b & _U32(0x7FFFFF))) >> _U32(6 * lv)
        field = field & _U32(-nz & 0xFFFFFFFF)
        macc = (macc << _U64(keep)) | _U64(field)
        mn += keep
        f = mn >> 5
        mn -= f << 5
        mw[mi] = _bswap32(_U32((macc >> _U64(mn)) & _U64(0xFFFFFFFF)))
        mi += f
    eb = 32 * ei + en
    mb = 32 * mi + mn
    p = pos
    p += _flush(ew, ei, eacc, en, out, p)
    p += _flush(lw, li, lacc, ln_, out, p)
    p += _flush(mw, mi, macc, mn, out, p)
    return p - pos, nnz, eb, mb


@njit(**_O)
def _chunk_header(out, c, start, nbytes, vals, nnz, eb, mb):
    h = 32 + 24 * c
    _put32(out, h, start)
    _put32(out, h + 4, nbytes)
    _put32(out, h + 8, vals)
    _put32(out, h + 12, nnz)
    _put32(out, h + 16, eb)
    _put32(out, h + 20, mb)


@njit(**_O)
def _block_header(out, head, pos):
    comp = 8 * pos
    head[6] = comp & 0xFFFFFFFF
    head[7] = comp >> 32
    for j in range(8):
        _put32(out, 4 * j, head[j])


@njit(**_O)
def encode_block(xu, xf, thr, has_thr, fixed, enc_code, enc_len, n_theta, C, out, head):
    """xu: float32 values viewed as uint32 (xf: as float32); writes the block
    into out (the bound's size); returns the payload length. head: the 8
    block-header words (the compressed length filled in here)."""
    n = xu.shape[0]
    k = (n + C - 1) // C
    pos = 32 + 24 * k
    ew, lw, mw = _scratch(min(C, max(n, 1)), n_theta)
    for c in range(k):
        s = c * C
        e = min(n, s + C)
        nb, nnz, eb, mb = _encode_chunk(
            xu, xf, thr, has_thr, fixed, enc_code, enc_len, s, e, ew, lw, mw, out, pos
        )
        _chunk_header(out, c, pos, nb, e - s, nnz, eb, mb)
        pos += nb
    _block_header(out, head, pos)
    return pos


@njit(**_O)
def _stream_words(p, heads, c, bufs):
    off = heads[c, 0]
    nnz = heads[c, 3]
    eb = heads[c, 4]
    mb = heads[c, 5]
    ebytes = (eb + 7) >> 3
    lbytes = (2 * nnz + 7) >> 3
    mbytes = (mb + 7) >> 3
    EW = _words(p, off, ebytes, bufs[0])
    LW = _words(p, off + ebytes, lbytes, bufs[1])
    MW = _words(p, off + ebytes + lbytes, mbytes, bufs[2])
    return EW, LW, MW


@njit(**_O)
def _read_bufs(C, n_theta):
    return (
        np.empty(C * (n_theta + 8) // 8 + 40, np.uint8),
        np.empty(C // 4 + 40, np.uint8),
        np.empty(3 * C + 40, np.uint8),
    )


@njit(**_O)
def decode_chunks(p, heads, C, lut, lengths, n_theta, out, out_u, acc):
    """Decode (acc=False) or accumulate (acc=True) every chunk into out (float32;
    out_u: the same memory as uint32). Returns 0, or -1 bad exponent stream, -2
    escaped short code, -3 non-zero count, -4 mantissa length."""
    bufs = _read_bufs(C, n_theta)
    res = np.empty(C, np.uint32)
    resf = res.view(np.float32)
    for c in range(heads.shape[0]):
        vals = heads[c, 2]
        nnz = heads[c, 3]
        eb = heads[c, 4]
        mb = heads[c, 5]
        EW, LW, MW = _stream_words(p, heads, c, bufs)
        ebit = 0
        li = 0
        mbit = 0
        s = c * C
        for i in range(vals):
            # decode one value (inline: no array crosses a call in the loop)
            q = ebit >> 6
            win = _peek(EW[q], EW[q + 1], ebit, n_theta)
            ent = lut[win]
            ln = ent >> 16
            sym = ent & 0xFFFF
            if ln == 0 or ebit + ln > eb:
                return -1
            if sym == 256:
                q = (ebit + n_theta) >> 6
                sym = int(_peek(EW[q], EW[q + 1], ebit + n_theta, 8))
                if lengths[sym] <= n_theta:
                    return -2
            ebit += ln
            nz = int(sym != 0)
            q = (2 * li) >> 6
            lv = int(_peek(LW[q], LW[q + 1], 2 * li, 2))
            keep = 24 - 6 * lv
            q = mbit >> 6
            field = _U32(_peek(MW[q], MW[q + 1], mbit, keep))
            sign = (field >> _U32(keep - 1)) & _U32(1)
            mant = (field & _U32((1 << (keep - 1)) - 1)) << _U32(6 * lv)
            r = ((sign << _U32(31)) | (_U32(sym) << _U32(23)) | mant) & _U32(-nz & 0xFFFFFFFF)
            li += nz
            mbit += keep * nz
            if li > nnz:
                return -3
            if mbit > mb:
                return -4
            if acc:
                res[i] = r
            else:
                out_u[s + i] = r
        if ebit != eb:
            return -1
        if li != nnz:
            return -3
        if mbit != mb:
            return -4
        if acc:
            for i in range(vals):
                out[s + i] += resf[i]
    return 0


@njit(**_O)
def hop_block(
    p, heads, lut, lengths, xu, xf, thr, has_thr, fixed, enc_code, enc_len, n_theta, C, out, head
):
    """The fused hop in one pass: per value, decode it from p, add it to the local
    value (xf, overwritten with the sum; xu: the same memory as uint32) and
    encode the sum into out. Returns the payload length, or a decode error code
    (negative; xf is then partly overwritten)."""
    n = xu.shape[0]
    k = (n + C - 1) // C
    pos = 32 + 24 * k
    cm = min(C, max(n, 1))
    bufs = _read_bufs(cm, n_theta)
    ew, lw, mw = _scratch(cm, n_theta)
    one = np.empty(1, np.uint32)
    onef = one.view(np.float32)
    for c in range(k):
        vals = heads[c, 2]
        dnnz = heads[c, 3]
        deb = heads[c, 4]
        dmb = heads[c, 5]
        EW, LW, MW = _stream_words(p, heads, c, bufs)
        ebit = 0
        dli = 0
        mbit = 0
        s = c * C
        e = s + vals
        eacc = _U64(0)
        en = 0
        ei = 0
        lacc = _U64(0)
        ln_ = 0
        li = 0
        macc = _U64(0)
        mn = 0
        mi = 0
        nnz = 0
        for i in range(s, e):
            # decode one value (inline: no array crosses a call in the loop)
            q = ebit >> 6
            win = _peek(EW[q], EW[q + 1], ebit, n_theta)
            ent = lut[win]
            ln = ent >> 16
            sym = ent & 0xFFFF
            if ln == 0 or ebit + ln > deb:
                return -1
            if sym == 256:
                q = (ebit + n_theta) >> 6
                sym = int(_peek(EW[q], EW[q + 1], ebit + n_theta, 8))
                if lengths[sym] <= n_theta:
                    return -2
            ebit += ln
            nz = int(sym != 0)
            q = (2 * dli) >> 6
            lv = int(_peek(LW[q], LW[q + 1], 2 * dli, 2))
            keep = 24 - 6 * lv
            q = mbit >> 6
            field = _U32(_peek(MW[q], MW[q + 1], mbit, keep))
            sign = (field >> _U32(keep - 1)) & _U32(1)
            mant = (field & _U32((1 << (keep - 1)) - 1)) << _U32(6 * lv)
            r = ((sign << _U32(31)) | (_U32(sym) << _U32(23)) | mant) & _U32(-nz & 0xFFFFFFFF)
            dli += nz
            mbit += keep * nz
            if dli > dnnz:
                return -3
            if mbit > dmb:
                return -4
            one[0] = r
            v = xf[i] + onef[0]
            xf[i] = v
            b = xu[i]
            # encode the sum (as _encode_chunk)
            ex = (b >> _U32(23)) & _U32(0xFF)
            w = enc_len[ex]
            eacc = (eacc << _U64(w)) | _U64(enc_code[ex])
            en += w
            f = en >> 5
            en -= f << 5
            ew[ei] = _bswap32(_U32((eacc >> _U64(en)) & _U64(0xFFFFFFFF)))
            ei += f
            nz = int(ex != 0)
            nnz += nz
            t = thr[i] if has_thr else np.float32(0.0)
            lv = _level(abs(v), t, has_thr, fixed, ex) * nz
            lacc = (lacc << _U64(2 * nz)) | _U64(lv)
            ln_ += 2 * nz
            f = ln_ >> 5
            ln_ -= f << 5
            lw[li] = _bswap32(_U32((lacc >> _U64(ln_)) & _U64(0xFFFFFFFF)))
            li += f
            keep = (24 - 6 * lv) * nz
            field = (((b >> _U32(31)) << _U32(23)) | (b & _U32(0x7FFFFF))) >> _U32(6 * lv)
            field = field & _U32(-nz & 0xFFFFFFFF)
            macc = (macc << _U64(keep)) | _U64(field)
            mn += keep
            f = mn >> 5
            mn -= f << 5
            mw[mi] = _bswap32(_U32((macc >> _U64(mn)) & _U64(0xFFFFFFFF)))
            mi += f
        if ebit != deb:
            return -1
        if dli != dnnz:
            return -3
        if mbit != dmb:
            return -4
        eb = 32 * ei + en
        mb = 32 * mi + mn
        q = pos
        q += _flush(ew, ei, eacc, en, out, q)
        q += _flush(lw, li, lacc, ln_, out, q)
        q += _flush(mw, mi, macc, mn, out, q)
        _chunk_header(out, c, pos, q - pos, vals, nnz, eb, mb)
        pos = q
    _block_header(out, head, pos)
    return pos
