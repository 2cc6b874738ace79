"""numba kernels of GComp (compiled on first import, cached on disk). Same bits
as :mod:`hopq.codecs.gcomp.reference`; errors come back as negative codes.

Bit streams are MSB first. The encoder makes two passes over a chunk: the
levels (a loop LLVM vectorizes), then the three streams. Writers keep a 64-bit
accumulator and store a whole 32-bit big-endian word at every value without a
branch (the word index only advances once 32 bits are complete; until then the
store is overwritten), into word buffers copied to the payload at the end of
the chunk; the loop's indices are unsigned (no negative-index wrap-around
code). Readers copy each stream into big-endian 64-bit words (zero padded).
Exponents are decoded from a 64-bit bit buffer refilled 32 bits at a time, so
that the loop's serial chain is only lookup -> shift; a 2-bit level is one
load; a mantissa field is peeked at its bit position with two loads and
shifts. A zero (pruned) value writes level and mantissa fields of width 0. The
fused hop works chunk by chunk while the chunk is in cache: decode, add, then
encode the sum (one loop doing all three spilled registers and was slower)."""

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
    buf8[:nbytes] = p[start : start + nbytes]
    buf8[nbytes : 8 * nw + 16] = 0
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


@njit(**_O)
def _flush(wbuf, wi, acc, nacc, out, pos):
    """Write the last partial word and copy the stream's bytes into out at pos;
    returns the byte count."""
    if nacc > 0:
        wbuf[wi] = _bswap32(_U32((acc << _U64(32 - nacc)) & _U64(0xFFFFFFFF)))
    nbits = 32 * wi + nacc
    nb = (nbits + 7) >> 3
    out[pos : pos + nb] = wbuf.view(np.uint8)[:nb]
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
def _levels(xu, xf, thr, has_thr, fixed, s, e, lvs):
    """Pass 1 of a chunk (vectorized by LLVM): each value's level, 0 for zeros
    and Inf/NaN exponents."""
    m = e - s
    if fixed >= 0:
        for i in range(m):
            lvs[i] = _U32(fixed)
    elif has_thr:
        for i in range(m):
            a = abs(xf[s + i])
            t = thr[s + i]
            lvs[i] = (
                _U32(a * np.float32(64.0) < t)
                + _U32(a * np.float32(4096.0) < t)
                + _U32(a * np.float32(262144.0) < t)
            )
    else:
        for i in range(m):
            lvs[i] = _U32(0)
    for i in range(m):
        ex = (xu[s + i] >> _U32(23)) & _U32(0xFF)
        lvs[i] = lvs[i] * _U32((ex != _U32(0)) & (ex != _U32(255)))


@njit(**_O)
def _encode_chunk(xu, xf, thr, has_thr, fixed, enc_code, enc_len, s, e, ew, lw, mw, out, pos, lvs):
    """Encode values s..e of xu (uint32 bits; xf the same memory as float32) as
    one chunk at out[pos:]; returns (bytes, nnz, exponent bits, mantissa bits)."""
    _levels(xu, xf, thr, has_thr, fixed, s, e, lvs)
    eacc = _U64(0)
    en = _U64(0)
    ei = _U64(0)
    lacc = _U64(0)
    ln_ = _U64(0)
    li = _U64(0)
    macc = _U64(0)
    mn = _U64(0)
    mi = _U64(0)
    nnz = _U64(0)
    m31 = _U64(31)
    for i in range(e - s):
        b = xu[_U64(s + i)]
        ex = (b >> _U32(23)) & _U32(0xFF)
        w = _U64(enc_len[ex])
        eacc = (eacc << w) | _U64(enc_code[ex])
        en += w
        ew[ei] = _bswap32(_U32((eacc >> (en & m31)) & _U64(0xFFFFFFFF)))
        ei += en >> _U64(5)
        en &= m31
        nz = _U64(ex != _U32(0))
        nnz += nz
        lv = _U64(lvs[_U64(i)])
        lacc = (lacc << (nz + nz)) | lv
        ln_ += nz + nz
        lw[li] = _bswap32(_U32((lacc >> (ln_ & m31)) & _U64(0xFFFFFFFF)))
        li += ln_ >> _U64(5)
        ln_ &= m31
        sh = _U64(6) * lv
        keep = (_U64(24) - sh) & (_U64(0) - nz)
        field = (_U64(((b >> _U32(31)) << _U32(23)) | (b & _U32(0x7FFFFF))) >> sh) & (_U64(0) - nz)
        macc = (macc << keep) | field
        mn += keep
        mw[mi] = _bswap32(_U32((macc >> (mn & m31)) & _U64(0xFFFFFFFF)))
        mi += mn >> _U64(5)
        mn &= m31
    ei = int(ei)
    en = int(en)
    li = int(li)
    ln_ = int(ln_)
    mi = int(mi)
    mn = int(mn)
    eb = 32 * ei + en
    mb = 32 * mi + mn
    p = pos
    p += _flush(ew, ei, eacc, en, out, p)
    p += _flush(lw, li, lacc, ln_, out, p)
    p += _flush(mw, mi, macc, mn, out, p)
    return p - pos, int(nnz), eb, mb


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
    lvs = np.empty(min(C, max(n, 1)), np.uint32)
    for c in range(k):
        s = c * C
        e = min(n, s + C)
        nb, nnz, eb, mb = _encode_chunk(
            xu, xf, thr, has_thr, fixed, enc_code, enc_len, s, e, ew, lw, mw, out, pos, lvs
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
def _decode_chunk(p, heads, c, bufs, lut, lengths, n_theta, dst):
    """Chunk c's values as float32 bits into dst (uint32, the chunk's length).
    Returns 0, or -1 bad exponent stream, -2 escaped short code, -3 non-zero
    count, -4 mantissa length."""
    vals = heads[c, 2]
    nnz = heads[c, 3]
    eb = heads[c, 4]
    mb = heads[c, 5]
    EW, LW, MW = _stream_words(p, heads, c, bufs)
    # exponents: a 64-bit buffer holding 32 to 64 unread bits, MSB first,
    # refilled 32 bits at a time (the loop's one serial chain is lookup -> shift)
    bb = EW[0]
    cnt = 64
    fill = 64
    ebit = 0
    sh = _U64(64 - n_theta)
    li = 0
    mbit = 0
    for i in range(vals):
        ent = lut[bb >> sh]
        ln = ent >> 16
        sym = ent & 0xFFFF
        if ln == 0 or ebit + ln > eb:
            return -1
        if sym == 256:
            sym = int((bb << _U64(n_theta)) >> _U64(56))
            if lengths[sym] <= n_theta:
                return -2
        ebit += ln
        bb <<= _U64(ln)
        cnt -= ln
        if cnt < 32:
            h = fill >> 5
            w32 = (EW[h >> 1] >> _U64(32 - 32 * (h & 1))) & _U64(0xFFFFFFFF)
            bb |= w32 << _U64(32 - cnt)
            cnt += 32
            fill += 32
        nz = int(sym != 0)
        # 2-bit levels never straddle a word: one load
        lv = int((LW[li >> 5] >> _U64(62 - 2 * (li & 31))) & _U64(3))
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
        dst[i] = r
    if ebit != eb:
        return -1
    if li != nnz:
        return -3
    if mbit != mb:
        return -4
    return 0


@njit(**_O)
def decode_chunks(p, heads, C, lut, lengths, n_theta, out, out_u, acc):
    """Decode (acc=False) or accumulate (acc=True) every chunk into out (float32;
    out_u: the same memory as uint32). Returns 0 or an error code of
    :func:`_decode_chunk`."""
    bufs = _read_bufs(C, n_theta)
    res = np.empty(C, np.uint32)
    resf = res.view(np.float32)
    for c in range(heads.shape[0]):
        vals = heads[c, 2]
        s = c * C
        err = _decode_chunk(
            p, heads, c, bufs, lut, lengths, n_theta, res if acc else out_u[s : s + vals]
        )
        if err:
            return err
        if acc:
            for i in range(vals):
                out[s + i] += resf[i]
    return 0


@njit(**_O)
def hop_block(
    p, heads, lut, lengths, xu, xf, thr, has_thr, fixed, enc_code, enc_len, n_theta, C, out, head
):
    """The fused hop, chunk by chunk while the chunk stays in cache: decode it
    from p, add it to the local values (xf, overwritten with the sum; xu: the
    same memory as uint32) and encode the sum into out. Returns the payload
    length, or a decode error code (negative; xf is then partly overwritten)."""
    n = xu.shape[0]
    k = (n + C - 1) // C
    pos = 32 + 24 * k
    cm = min(C, max(n, 1))
    bufs = _read_bufs(cm, n_theta)
    ew, lw, mw = _scratch(cm, n_theta)
    lvs = np.empty(cm, np.uint32)
    res = np.empty(cm, np.uint32)
    resf = res.view(np.float32)
    for c in range(k):
        vals = heads[c, 2]
        s = c * C
        err = _decode_chunk(p, heads, c, bufs, lut, lengths, n_theta, res)
        if err:
            return err
        for i in range(vals):
            xf[s + i] += resf[i]
        nb, nnz, eb, mb = _encode_chunk(
            xu, xf, thr, has_thr, fixed, enc_code, enc_len, s, s + vals, ew, lw, mw, out, pos, lvs
        )
        _chunk_header(out, c, pos, nb, vals, nnz, eb, mb)
        pos += nb
    _block_header(out, head, pos)
    return pos
