"""numba kernels of GComp (compiled on first import, cached on disk). Same bits
as :mod:`hopq.codecs.gcomp.reference`; errors come back as negative codes.

Bit streams are MSB first. The encoder works on sub-blocks of ``SUB`` values
that stay in L1: a first loop, which LLVM vectorizes, turns each value into
three records ``bits << 6 | width`` (its exponent's code from the table, its
2-bit level, its sign and kept mantissa bits; widths 0 for a pruned zero); the
levels of each 16 values are joined into one record of at most 32 bits, by
pairs in four vectorized rounds, and the exponent and mantissa records of each
two values into one 64-bit record (at most 36 and 48 bits). A second loop
appends the joined records to their streams, so it runs once per two values. The
first loop's integer work goes through :mod:`hopq.numerics.u32`'s 32-bit
operations (numba widens ``uint32`` arithmetic to 64 bits, which halves the
vector lanes): the encoder ran 13-20% faster for it. A
writer is a 64-bit accumulator and the stream's total bit count ``P``: after
each append it stores, without a branch, the 8 bytes from the first unfinished
one (an unaligned big-endian store; at most 7 bits were pending, so up to 57
bits fit), so the loop keeps no byte index and no per-stream remainder.

The decoder reads exponents from a 64-bit bit buffer refilled 32 bits at a
time from big-endian words (without a branch), so the loop's serial chain is
lookup -> shift, and it looks up to three codes at once where they fit in the
next 12 bits (a multi-code table), so the chain runs once per two or three
values; the
one-code table packs ``symbol << 8 | length`` and one compare sends the escape
and the codes the table does not know to a rare branch. The levels are first
unpacked one per byte, and a mantissa field is peeked at its bit position with
one unaligned big-endian 32-bit load and a shift. Reads past a stream's end
stay inside the workspace buffers (each sized for a chunk's worst case), and the
counts are checked once at the end of the chunk against the header.
Accumulating decoders add each value to the local one in the decoder's loop (no
decoded buffer, no second pass). The fused hop works chunk by chunk while the
chunk is in cache: decode into the local values, then encode the sum."""

# mypy: ignore-errors
from __future__ import annotations

import numpy as np
from llvmlite import ir as _ir
from numba import njit, types
from numba.extending import intrinsic, overload

from hopq.numerics.u32 import add32, and32, lshr32, ltu32, mul32, neu32, or32, shl32, sub32

_O = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}

_U64 = np.uint64
_U32 = np.uint32

#: Values per encoder sub-block: their records and temporary buffers stay in L1.
SUB = 2048
#: Lookup-table entries at or above this (symbol >= 256) are the escape or a
#: code the table does not know (symbol 257).
_RARE = 256 << 8
#: Multi-code table entries at or above this: the first code is not in the table.
_MULTI_RARE = 0xFFFFFFFF
#: By level + 4 * (value != 0): the kept sign + mantissa bits, and the mask of
#: the kept mantissa bits (all 0 for a pruned zero).
_KEEP = np.array([0, 0, 0, 0, 24, 18, 12, 6], np.uint64)
_MASK = np.array([0, 0, 0, 0, 0x7FFFFF, 0x7FFFC0, 0x7FF000, 0x7C0000], np.uint64)


@intrinsic
def _load_be32(typingctx, arr, idx):
    """The 4 bytes of a C-contiguous uint8 array from index idx as a big-endian
    uint32: one unaligned load and a byte swap (numba has no unaligned loads)."""
    sig = types.uint32(arr, idx)

    def codegen(context, builder, signature, args):
        a, i = args
        ary = context.make_array(signature.args[0])(context, builder, a)
        ptr = builder.gep(ary.data, [i])
        p32 = builder.bitcast(ptr, _ir.IntType(32).as_pointer())
        v = builder.load(p32, align=1)
        fn = builder.module.declare_intrinsic("llvm.bswap", [_ir.IntType(32)])
        return builder.call(fn, [v])

    return sig, codegen


@intrinsic
def _store_be64(typingctx, arr, idx, val):
    """Store val big-endian into the 8 bytes of a C-contiguous uint8 array from
    index idx (unaligned)."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        a, i, v = args
        ary = context.make_array(signature.args[0])(context, builder, a)
        ptr = builder.gep(ary.data, [i])
        p64 = builder.bitcast(ptr, _ir.IntType(64).as_pointer())
        fn = builder.module.declare_intrinsic("llvm.bswap", [_ir.IntType(64)])
        builder.store(builder.call(fn, [v]), p64, align=1)
        return context.get_dummy_value()

    return sig, codegen


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


@njit(**_O)
def _copy(dst, d0, src, s0, n):
    """dst[d0 : d0 + n] = src[s0 : s0 + n] as a loop LLVM turns into a memory
    copy (numba's slice assignment goes element by element: ten times slower)."""
    d0 = _U64(d0)
    s0 = _U64(s0)
    for j in range(n):
        dst[d0 + _U64(j)] = src[s0 + _U64(j)]


# -- encoder -------------------------------------------------------------------


@njit(**_O)
def _pairs(b, w, ob, ow, n):
    """Join fields 2j and 2j + 1 (bits b, widths w) into ob[j], ow[j], j < n."""
    for j in range(n):
        k = _U64(2 * j)
        w1 = w[k + _U64(1)]
        ob[j] = or32(shl32(b[k], w1), b[k + _U64(1)])
        ow[j] = add32(w[k], w1)


@njit(**_O)
def _records(xu, xf, thr, has_thr, fixed, etab, s, m, lvs, re, rl, rm, tb, tw):
    """Loop 1 of a sub-block: values s..s+m as records ``bits << 6 | width`` of
    the exponent and mantissa streams (re, rm), and the level stream's bits and
    widths of each group of 16 values (rl, lvs; lvs first holds the levels).
    Unsigned indices and masks, not branches: LLVM vectorizes every loop but
    the table lookup's."""
    s = _U64(s)
    if fixed >= 0:
        for i in range(m):
            lvs[i] = _U32(fixed)
    elif has_thr:
        for i in range(m):
            a = abs(xf[s + _U64(i)])
            t = thr[s + _U64(i)]
            lvs[i] = add32(
                add32(_U32(a * np.float32(64.0) < t), _U32(a * np.float32(4096.0) < t)),
                _U32(a * np.float32(262144.0) < t),
            )
    else:
        for i in range(m):
            lvs[i] = _U32(0)
    for i in range(m):
        b = xu[s + _U64(i)]
        ex = and32(lshr32(b, _U32(23)), _U32(0xFF))
        nz = neu32(ex, _U32(0))
        mnz = sub32(_U32(0), nz)
        # level 0 for zeros, Inf and NaN (exponent 0 or 255)
        lv = and32(lvs[i], sub32(_U32(0), ltu32(sub32(ex, _U32(1)), _U32(254))))
        sh = mul32(_U32(6), lv)
        sm = or32(and32(lshr32(b, _U32(8)), _U32(0x800000)), and32(b, _U32(0x7FFFFF)))
        field = lshr32(sm, sh)
        rl[i] = lv
        lvs[i] = add32(nz, nz)  # the level's width, over the level read above
        rm[i] = or32(shl32(and32(field, mnz), _U32(6)), and32(sub32(_U32(24), sh), mnz))
    for i in range(m):
        re[i] = etab[(xu[s + _U64(i)] >> _U32(23)) & _U32(0xFF)]
    # levels: 16 values' fields joined into one (bits, width <= 32) record, by
    # pairs in four rounds (rl, lvs) -> (tb, tw) -> (rl, lvs) -> ...
    g = (m + 15) & ~15
    for i in range(m, g):
        rl[i] = _U32(0)
        lvs[i] = _U32(0)
    _pairs(rl, lvs, tb, tw, g >> 1)
    _pairs(tb, tw, rl, lvs, g >> 2)
    _pairs(rl, lvs, tb, tw, g >> 3)
    _pairs(tb, tw, rl, lvs, g >> 4)


@njit(**_O)
def _join2(re, rm, m, pe, pm):
    """Join the records of values 2j and 2j + 1 of each stream into one u64
    record (bits << 6 | width; widths up to 36 and 48 bits)."""
    if m & 1:
        re[m] = _U32(0)
        rm[m] = _U32(0)
    for j in range((m + 1) >> 1):
        k = _U64(2 * j)
        a = _U64(re[k])
        b = _U64(re[k + _U64(1)])
        wb = b & _U64(63)
        pe[j] = ((((a >> _U64(6)) << wb) | (b >> _U64(6))) << _U64(6)) | ((a & _U64(63)) + wb)
        a = _U64(rm[k])
        b = _U64(rm[k + _U64(1)])
        wb = b & _U64(63)
        pm[j] = ((((a >> _U64(6)) << wb) | (b >> _U64(6))) << _U64(6)) | ((a & _U64(63)) + wb)


@njit(inline="always", **_O)
def _put_bits(buf, acc, p, r):
    """Append record r (bits << 6 | width, width <= 56) to a byte stream whose
    writer holds acc (its last p & 7 bits pending) and p bits; stores the 8
    bytes from the first unfinished one. Returns (acc, p)."""
    w = r & _U64(63)
    acc = (acc << w) | (r >> _U64(6))
    b0 = p >> _U64(3)
    p += w
    pend = p - (b0 << _U64(3))
    _store_be64(buf, b0, (acc << (_U64(63) - pend)) << _U64(1))
    return acc, p


@njit(**_O)
def _append(pe, rl, rw, pm, m, ew, lw, mw, st):
    """Loop 2: append m values' records (joined by pairs: pe, pm) to the three
    byte streams (the levels as one record per 16 values: bits rl, widths
    rw). st: [acc, P] of each writer (exponents, levels, mantissas), updated."""
    ea = st[0]
    ep = st[1]
    la = st[2]
    lp = st[3]
    ma = st[4]
    mp = st[5]
    for j in range((m + 1) >> 1):
        ea, ep = _put_bits(ew, ea, ep, pe[j])
        ma, mp = _put_bits(mw, ma, mp, pm[j])
    for j in range((m + 15) >> 4):  # levels: one record per 16 values
        la, lp = _put_bits(lw, la, lp, (_U64(rl[j]) << _U64(6)) | _U64(rw[j]))
    st[0] = ea
    st[1] = ep
    st[2] = la
    st[3] = lp
    st[4] = ma
    st[5] = mp


@njit(**_O)
def _flush(wbuf, nbits, out, pos):
    """Copy the stream's bytes (its writer stored the last partial byte too)
    into out at pos; returns the byte count."""
    nb = (nbits + 7) >> 3
    _copy(out, pos, wbuf, 0, nb)
    return nb


@njit(**_O)
def _enc_workspace(C, n_theta):
    """(exponent, level, mantissa byte buffers with 16 bytes of slack for the
    writers' 8-byte stores, a level buffer, three record buffers (one value
    longer: a lone last value pairs with an empty record), two pairing buffers,
    writer state, the two joined-record buffers) for chunks of at most C
    values."""
    return (
        np.empty((C * (n_theta + 8)) // 8 + 16, np.uint8),
        np.empty((2 * C) // 8 + 16, np.uint8),
        np.empty((24 * C) // 8 + 16, np.uint8),
        np.empty(SUB, np.uint32),
        np.empty(SUB + 1, np.uint32),
        np.empty(SUB, np.uint32),
        np.empty(SUB + 1, np.uint32),
        np.empty(SUB // 2, np.uint32),
        np.empty(SUB // 2, np.uint32),
        np.zeros(6, np.uint64),
        np.empty(SUB // 2 + 1, np.uint64),
        np.empty(SUB // 2 + 1, np.uint64),
    )


@njit(**_O)
def _encode_chunk(xu, xf, thr, has_thr, fixed, etab, s, e, ws, out, pos):
    """Encode values s..e of xu (uint32 bits; xf the same memory as float32) as
    one chunk at out[pos:]; returns (bytes, nnz, exponent bits, mantissa bits)."""
    ew, lw, mw, lvs, re, rl, rm, tb, tw, st, pe, pm = ws
    st[:] = 0
    for b in range(s, e, SUB):
        m = min(SUB, e - b)
        _records(xu, xf, thr, has_thr, fixed, etab, b, m, lvs, re, rl, rm, tb, tw)
        _join2(re, rm, m, pe, pm)
        _append(pe, rl, lvs, pm, m, ew, lw, mw, st)
    eb = int(st[1])
    lb = int(st[3])
    mb = int(st[5])
    p = pos
    p += _flush(ew, eb, out, p)
    p += _flush(lw, lb, out, p)
    p += _flush(mw, mb, out, p)
    return p - pos, lb >> 1, eb, mb


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
def encode_block(xu, xf, thr, has_thr, fixed, etab, n_theta, C, out, head):
    """xu: float32 values viewed as uint32 (xf: as float32); writes the block
    into out (the bound's size); returns the payload length. etab: each
    exponent's code << 6 | length. head: the 8 block-header words (the
    compressed length filled in here)."""
    n = xu.shape[0]
    k = (n + C - 1) // C
    pos = 32 + 24 * k
    ws = _enc_workspace(min(C, max(n, 1)), n_theta)
    for c in range(k):
        s = c * C
        e = min(n, s + C)
        nb, nnz, eb, mb = _encode_chunk(xu, xf, thr, has_thr, fixed, etab, s, e, ws, out, pos)
        _chunk_header(out, c, pos, nb, e - s, nnz, eb, mb)
        pos += nb
    _block_header(out, head, pos)
    return pos


# -- decoder -------------------------------------------------------------------


@njit(**_O)
def _dec_workspace(C, n_theta):
    """(exponent words, levels one per byte, mantissa bytes with room for an
    8-byte load past any position a chunk can reach) for chunks of at most C
    values."""
    return (
        np.empty((C * (n_theta + 8)) // 32 + 8, np.uint32),
        np.zeros(C + 8, np.uint8),  # zeros: a corrupt count reads levels 0-3 only
        np.empty(3 * C + 32, np.uint8),
    )


@njit(**_O)
def _load_streams(p, off, ebytes, lbytes, mbytes, E, L, M):
    """The chunk's streams in decoder form: exponents as big-endian 32-bit
    words, levels one per byte, mantissas as they came (big-endian bytes,
    peeked by :func:`_load_be32`); zero padded."""
    ne = (ebytes + 3) >> 2
    e8 = E.view(np.uint8)
    _copy(e8, 0, p, off, ebytes)
    e8[ebytes : 4 * ne + 8] = 0
    for j in range(ne + 2):
        E[j] = _bswap32(E[j])
    lo = off + ebytes
    lo = _U64(lo)
    for j in range(lbytes):
        v = p[lo + _U64(j)]
        d = _U64(4 * j)
        L[d] = v >> 6
        L[d + _U64(1)] = (v >> 4) & 3
        L[d + _U64(2)] = (v >> 2) & 3
        L[d + _U64(3)] = v & 3
    L[4 * lbytes : 4 * lbytes + 8] = 0
    mo = lo + _U64(lbytes)
    _copy(M, 0, p, mo, mbytes)
    M[mbytes : mbytes + 16] = 0


@njit(inline="always", **_O)
def _value(M, L, li, mbit, sym):
    """One value's float32 bits from its exponent ``sym``, its level (``L[li]``,
    read when the value is non-zero) and its sign + kept mantissa bits at bit
    ``mbit`` of M; with the level and mantissa positions after it."""
    nz = _U64(sym != _U64(0))
    lx = _U64(L[li]) + (nz << _U64(2))
    # the field's at most 24 bits start within the first byte: 4 bytes hold them
    u = _U64(_U32(_load_be32(M, mbit >> _U64(3)) << _U32(mbit & _U64(7))))
    v = _U32((u & (nz << _U64(31))) | ((u >> _U64(8)) & _MASK[lx]) | (sym << _U64(23)))
    return v, li + nz, mbit + _KEEP[lx]


def _put(dst, i, n, k, v1, v2, v3):
    """Store up to three decoded values at dst[i], dst[i + n], dst[i + 2n] (n 1,
    or 0 for the chunk's last two values, which take one code each): v1, v2
    when k >= 1, v3 when k = 2; by dst's type their float32 bits (uint32) or
    added to the local values in place (float32). Values that are not there
    are written all the same, so the loop does not branch on ``k``: with a
    placeholder that a later store overwrites (bits), or with the local value
    plus -0.0, which is that value (sums; an sNaN comes out quietened, as the
    next value's addition leaves it anyway). The stores run last to first, so
    that with n = 0 the first one wins."""


@overload(_put, inline="always")
def _put_by_type(dst, i, n, k, v1, v2, v3):
    if isinstance(dst.dtype, types.Float):

        def put_sum(dst, i, n, k, v1, v2, v3):
            # local + decoded (the reference's order), all read before any store
            a1 = dst[i]
            a2 = dst[i + n]
            a3 = dst[i + n + n]
            dst[i + n + n] = a3 + _U32(v3 | (_U32(k < _U64(2)) << _U32(31))).view(np.float32)
            dst[i + n] = a2 + _U32(v2 | (_U32(k < _U64(1)) << _U32(31))).view(np.float32)
            dst[i] = a1 + _U32(v1).view(np.float32)

        return put_sum

    def put_bits(dst, i, n, k, v1, v2, v3):
        dst[i + n + n] = v3
        dst[i + n] = v2
        dst[i] = v1

    return put_bits


@njit(**_O)
def _decode_chunk(p, heads, c, ws, lut, plut, pw, lengths, n_theta, dst):
    """Chunk c's values into dst (the chunk's length): their float32 bits when
    dst is uint32, added to it when it is float32 (the accumulation fused into
    the decoder's loop, where it hides behind the exponent chain). Returns 0, or -1 bad exponent stream, -2
    escaped short code, -3 non-zero count, -4 mantissa length.

    Exponents are decoded up to three at a time where their codes fit in the
    next ``pw`` bits (the table ``plut`` of :func:`hopq.codecs.gcomp.kernels_cpu._multi_table`:
    the symbols in bytes 0-2, their lengths' sum << 24, the count of codes
    after the first << 29; ``_MULTI_RARE`` where the first code is not in
    ``lut``), so the loop's serial chain, lookup -> shift, runs once per two or
    three values (three pay on gradients with many zeros, whose code is
    short). All three values are always computed: an absent code's symbol is
    0, whose level and mantissa positions advance by 0. Escapes and unknown
    codes take the one-value ``lut`` path, and so do the chunk's last two
    values. The values are stored without a branch on how many codes there
    were (see :func:`_put`)."""
    E, L, M = ws
    off = heads[c, 0]
    vals = heads[c, 2]
    nnz = heads[c, 3]
    eb = heads[c, 4]
    mb = heads[c, 5]
    ebytes = (eb + 7) >> 3
    lbytes = (2 * nnz + 7) >> 3
    mbytes = (mb + 7) >> 3
    _load_streams(p, off, ebytes, lbytes, mbytes, E, L, M)
    bb = (_U64(E[0]) << _U64(32)) | _U64(E[1])
    cnt = _U64(64)
    fi = _U64(2)
    sh = _U64(64 - n_theta)
    psh = _U64(64 - pw)
    nt = _U64(n_theta)
    li = _U64(0)
    mbit = _U64(0)
    i = _U64(0)
    nv = _U64(vals)
    # the chunk's last two values take one code each (the table's three would
    # run past the chunk)
    lim = nv - _U64(2) if nv > _U64(2) else _U64(0)
    while True:
        if i < lim:
            ent = _U64(plut[bb >> psh])
        elif i < nv:
            ent = _U64(_MULTI_RARE)
        else:
            break
        if ent >= _U64(_MULTI_RARE):
            e1 = _U64(lut[bb >> sh])
            if e1 >= _U64(_RARE):
                if e1 >> _U64(8) != _U64(256):
                    return -1
                s1 = (bb << nt) >> _U64(56)
                if lengths[s1] <= n_theta:
                    return -2
            else:
                s1 = e1 >> _U64(8)
            ent = s1 | ((e1 & _U64(0xFF)) << _U64(24))
        ln = (ent >> _U64(24)) & _U64(31)
        bb <<= ln
        cnt -= ln
        need = _U64(cnt < _U64(32))
        bb |= (_U64(E[fi]) << ((_U64(32) - cnt) & _U64(63))) & (_U64(0) - need)
        cnt += need << _U64(5)
        fi += need
        k = (ent >> _U64(29)) & _U64(3)
        # an absent code's symbol is 0, which advances neither li nor mbit
        v1, li, mbit = _value(M, L, li, mbit, ent & _U64(0xFF))
        v2, li, mbit = _value(M, L, li, mbit, (ent >> _U64(8)) & _U64(0xFF))
        v3, li, mbit = _value(M, L, li, mbit, (ent >> _U64(16)) & _U64(0xFF))
        _put(dst, i, _U64(i < lim), k, v1, v2, v3)
        i += _U64(1) + k
    if _U64(32) * fi - cnt != _U64(eb):
        return -1
    if li != _U64(nnz):
        return -3
    if mbit != _U64(mb):
        return -4
    return 0


@njit(**_O)
def decode_chunks(p, heads, C, lut, plut, pw, lengths, n_theta, out, out_u, acc):
    """Decode (acc=False) or accumulate (acc=True) every chunk into out (float32;
    out_u: the same memory as uint32). Returns 0 or an error code of
    :func:`_decode_chunk`."""
    ws = _dec_workspace(C, n_theta)
    for c in range(heads.shape[0]):
        s = c * C
        e = s + heads[c, 2]
        if acc:
            err = _decode_chunk(p, heads, c, ws, lut, plut, pw, lengths, n_theta, out[s:e])
        else:
            err = _decode_chunk(p, heads, c, ws, lut, plut, pw, lengths, n_theta, out_u[s:e])
        if err:
            return err
    return 0


@njit(**_O)
def hop_block(
    p, heads, lut, plut, pw, lengths, xu, xf, thr, has_thr, fixed, etab, n_theta, C, out, head
):
    """The fused hop, chunk by chunk while the chunk stays in cache: decode it
    from p, add it to the local values (xf, overwritten with the sum; xu: the
    same memory as uint32) and encode the sum into out. Returns the payload
    length, or a decode error code (negative; xf is then partly overwritten)."""
    n = xu.shape[0]
    k = (n + C - 1) // C
    pos = 32 + 24 * k
    cm = min(C, max(n, 1))
    dws = _dec_workspace(cm, n_theta)
    ews = _enc_workspace(cm, n_theta)
    for c in range(k):
        vals = heads[c, 2]
        s = c * C
        err = _decode_chunk(p, heads, c, dws, lut, plut, pw, lengths, n_theta, xf[s : s + vals])
        if err:
            return err
        nb, nnz, eb, mb = _encode_chunk(
            xu, xf, thr, has_thr, fixed, etab, s, s + vals, ews, out, pos
        )
        _chunk_header(out, c, pos, nb, vals, nnz, eb, mb)
        pos += nb
    _block_header(out, head, pos)
    return pos
