"""DynamiQ's Triton kernels (seed 000, section 4): the same bits as the reference.

Programs work on whole super-groups of a width-uniform segment (the reorder
puts every chunk in a few such runs), so a super-group's S entries live in
registers: one super-group on one warp for the encoding kernels and the
statistics (they are instruction-bound; the warp reduces without shared
memory), two super-groups on two warps for the decoding ones (memory-bound:
more bytes in flight). Measured on an H100: docs/bench/kernels.md.

* ``compress`` (ENCODE: local rows -> segment bytes),
* ``decompress`` (DECODE: bytes -> rows, the all-gather receive),
* ``decompress_accumulate`` (DECODE_ACC: rows += decode(bytes)),
* ``decompress_accumulate_recompress`` (DAR, the fused hop: the received partial
  sum is decoded, the local chunk added and the sum re-encoded without leaving
  registers; each local coordinate is read once),
* the statistics pre-pass (per super-group mean and sum of squares, the
  reference's pairwise tree order, :func:`hopq.numerics.reduce.tree_sum`).

Group and super-group maxima are in-register reductions over the bit patterns
of |x| (their order is the floats' order; a NaN's pattern tops them all, which is
how the reference's ``amax`` propagates it). Divisions are correctly rounded,
as the reference's: ``tl.div_rn``, or a correctly rounded reciprocal with one
fused multiply-add correction where the operands keep that exact (``_div_by``);
kernels launch with fp fusion off (no other multiply-add), and the hash is
lowbias32 in native uint32.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) they run on
CPU tensors; that is how CI checks them against the reference.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
from functools import lru_cache
from typing import Any

import torch

from hopq.codecs.dynamiq.segment import SegmentCall
from hopq.kernels import Mode, interpreting
from hopq.numerics.levels import search_tables
from hopq.numerics.rng import M1, M2
from hopq.numerics.rows import gather_rows, scatter_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


#: CORR, the kernels' correlated-rounding variant: none (one peer), the
#: permutation's residues by multiplication (numerators and divisors below
#: 2**16), or by integer remainders (any number of peers).
CORR_NONE, CORR_FASTMOD, CORR_REM = 0, 1, 2


def _corr(peers: int, units: int) -> int:
    if peers <= 1:
        return CORR_NONE
    return CORR_FASTMOD if max(peers, units) < 1 << 16 else CORR_REM


def available() -> bool:
    return triton is not None


if triton is not None:
    # globals a compiled kernel reads must be constexpr (the interpreter does not care)
    _ENCODE, _DECODE, _DECODE_ACC, _DAR = (
        tl.constexpr(int(v)) for v in (Mode.ENCODE, Mode.DECODE, Mode.DECODE_ACC, Mode.DAR)
    )
    _M1, _M2 = tl.constexpr(M1), tl.constexpr(M2)
    _FASTMOD = tl.constexpr(CORR_FASTMOD)
    #: Entries per thread in the encoding kernels (one 16-byte load).
    _V = tl.constexpr(4)
    #: 1 / 255, correctly rounded to float32.
    _R255 = tl.constexpr(float(torch.tensor(1.0) / torch.tensor(255.0)))

    def _stable_jit(ints: list[str], byte_ptrs: list[str]) -> Any:
        """triton.jit that compiles one variant per constexpr set: Triton
        specializes integer arguments on == 1 and % 16 == 0 and pointers on
        16-byte alignment, and a run's segment sizes and payload offsets take
        many such values, which cost a compilation each (about 0.4 s on an H100,
        seen as 5 s per all-reduce call long after the warm-up). Byte payloads
        are read and written a byte at a time anyway."""
        kw: dict[str, list[str]] = {"do_not_specialize": ints}
        if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
            kw["do_not_specialize_on_alignment"] = byte_ptrs
        return triton.jit(**kw)

    @triton.jit
    def _mix(x):
        x = x ^ (x >> 16)
        x = x * _M1
        x = x ^ (x >> 15)
        x = x * _M2
        return x ^ (x >> 16)

    @triton.jit
    def _hash(i, k0, k1):
        return _mix(_mix(i ^ k0) ^ k1)

    @triton.jit
    def _uniform(i, k0, k1):
        return (_hash(i, k0, k1) >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24

    @triton.jit
    def _div_by(a, b, rb):
        """a / b correctly rounded, given rb = 1 / b correctly rounded: one
        Markstein correction (the residual a - b q is exact in one fused
        multiply-add, and q + r rb rounds to the quotient) instead of a full
        division. Exact where a is zero or at least 2**-100 (the residual then
        has no bits below the subnormals') and b, rb and the quotient are
        normal; every caller keeps to that range or takes tl.div_rn outside it
        (see _codes; tests/test_kernels.py::test_division_by_reciprocal)."""
        q = a * rb
        e = tl.fma(-q, b, a)
        return tl.fma(e, rb, q)

    @triton.jit
    def _entry_uniforms(idx, g0, g1, p0, p1, n, rn, units, nu, cm, cm2, CORR: tl.constexpr):
        u = _uniform(idx, g0, g1)
        if CORR:
            h = _hash(idx, p0, p1)
            un = n.to(tl.uint32)
            uu = nu.to(tl.uint32)
            if CORR == _FASTMOD:
                # a % d for a, d < 2**16 as two multiplications, c = ceil(2**32 / d)
                # (Lemire, Kaser and Kurz 2019; _kernels_cpu_jit.fastmod16), the
                # two c from the host
                cu = cm.to(tl.uint32)
                cn = cm2.to(tl.uint32)
                ui = tl.umulhi(cu * (h >> 16), uu)
                shift = tl.umulhi(cn * (h & 0xFFFF), un)
            else:
                ui = (h >> 16) % uu
                shift = (h & 0xFFFF) % un
            # units holds (unit * me) % n (no 32-bit overflow for any n): the sum
            # of two residues is below 2n, one conditional subtraction reduces it
            pi = tl.load(units + ui.to(tl.int32)).to(tl.uint32) + shift
            pi = tl.where(pi >= un, pi - un, pi)
            # (pi + u) / n: pi + u is 0 or at least 2**-24 and n < 2**24, so the
            # quotient is normal and rn = 1 / n (rounded, from the host) serves
            u = _div_by(pi.to(tl.float32) + u, n.to(tl.float32), rn)
        return u

    @triton.jit
    def _decode_sg(
        inb, r, k, gidx, tab,
        NG: tl.constexpr, TOP: tl.constexpr, PER: tl.constexpr, CODE_BYTES: tl.constexpr,
        W: tl.constexpr, G: tl.constexpr, UNIT: tl.constexpr,
    ):  # fmt: skip  # type: ignore[no-untyped-def]
        """Decoded entries [NG, G // V, V] of super-group r of a segment of k."""
        b0 = tl.load(inb + 2 * r).to(tl.int32)
        b1 = tl.load(inb + 2 * r + 1).to(tl.int32)
        M = ((b0 | (b1 << 8)) << 16).to(tl.float32, bitcast=True)
        rg = tl.load(inb + 2 * k + r * NG + gidx).to(tl.float32)
        # reference.group_scales: no overflow for huge M. rg * M is exact (8-bit
        # integer times a bfloat16) and its division by 255 by reciprocal is the
        # correctly rounded one for every rg and finite bfloat16 M (checked
        # exhaustively: tests/test_kernels.py::test_division_by_reciprocal)
        sf = tl.where(
            M < 1.329227995784916e36, _div_by(rg * M, 255.0, _R255), rg * tl.div_rn(M, 255.0)
        )
        # the V * W / 8 code bytes of a thread's V entries, each loaded once
        jc = gidx[:, None, None] * G + tl.arange(0, G // _V)[None, :, None] * _V  # [NG, C, 1]
        at = inb + 2 * k + k * NG + r * CODE_BYTES + jc // PER
        word = tl.load(at).to(tl.int32)
        for i in tl.static_range(1, _V * W // 8):
            word = word | (tl.load(at + i).to(tl.int32) << (8 * i))
        c = (word >> (tl.arange(0, _V)[None, None, :] * W)) & ((1 << W) - 1)  # [NG, C, V]
        if UNIT:  # levels {0, 1}: the table's value is the code's low bit
            mag = (c & 1).to(tl.float32) * sf[:, None, None]
        else:
            mag = tl.load(tab + (c & (TOP - 1))) * sf[:, None, None]
        # the sign as a bit flip, as torch's negation: compiled Triton lowers
        # -mag to 0 - mag, which gives +0.0 where the reference has -0.0
        flip = (c >= TOP).to(tl.uint32) << 31
        return (mag.to(tl.uint32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)

    @_stable_jit(
        ["k", "row0", "g0", "g1", "p0", "p1", "n", "nu", "cm", "cm2", "s0", "s1"], ["inb", "outb"]
    )
    def _segment_kernel(
        inb, local, outf, outb, units, tab, ptab, qtab, bucket,
        k, row0, g0, g1, p0, p1, n, rn, nu, cm, cm2, s0, s1,
        W: tl.constexpr, MODE: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        NB_LOG: tl.constexpr, STEPS: tl.constexpr, CORR: tl.constexpr, UNIT: tl.constexpr,
    ):  # fmt: skip
        NG: tl.constexpr = S // G
        TOP: tl.constexpr = 1 << (W - 1)
        PER: tl.constexpr = 8 // W
        CODE_BYTES: tl.constexpr = S * W // 8
        r = tl.program_id(0)
        gidx = tl.arange(0, NG)
        # [NG, G // V, V]: a thread holds V consecutive entries (one 16-byte
        # load), so it holds entries of NG * V / 32 groups only, and the
        # per-group work (scales, their uniforms, reciprocals) is done that many
        # times per thread instead of NG; its codes pack without shuffles
        j = (
            gidx[:, None, None] * G
            + tl.arange(0, G // _V)[None, :, None] * _V
            + tl.arange(0, _V)[None, None, :]
        )
        # ENCODE and DAR (the decode modes: _decode_kernel)
        x = tl.load(local + r * S + j)
        if MODE == _DAR:
            x = x + _decode_sg(inb, r, k, gidx, tab, NG, TOP, PER, CODE_BYTES, W, G, UNIT)
        _encode_sg(
            x, outb, r, k, row0 + r, j, gidx, units, tab, ptab, qtab, bucket,
            g0.to(tl.uint32), g1.to(tl.uint32), p0.to(tl.uint32), p1.to(tl.uint32),
            n, rn, nu, cm, cm2, s0.to(tl.uint32), s1.to(tl.uint32),
            W, S, NG, TOP, PER, CODE_BYTES, NB_LOG, STEPS, CORR, UNIT,
        )  # fmt: skip

    @_stable_jit(["k"], ["inb"])
    def _decode_kernel(
        inb, local, outf, tab, k,
        W: tl.constexpr, MODE: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        B: tl.constexpr, UNIT: tl.constexpr,
    ):  # fmt: skip
        """DECODE and DECODE_ACC, B super-groups per program: the decode is
        memory-bound (the encode is not), and B super-groups put B times the
        bytes in flight. The same arithmetic as :func:`_decode_sg`, per entry."""
        NG: tl.constexpr = S // G
        TOP: tl.constexpr = 1 << (W - 1)
        PER: tl.constexpr = 8 // W
        CODE_BYTES: tl.constexpr = S * W // 8
        r = tl.program_id(0) * B + tl.arange(0, B)  # [B]
        ok = r < k
        gidx = tl.arange(0, NG)
        j = gidx[:, None] * G + tl.arange(0, G)[None, :]  # [NG, G]
        b0 = tl.load(inb + 2 * r, mask=ok, other=0).to(tl.int32)
        b1 = tl.load(inb + 2 * r + 1, mask=ok, other=0).to(tl.int32)
        M = ((b0 | (b1 << 8)) << 16).to(tl.float32, bitcast=True)[:, None]  # [B, 1]
        ok2 = ok[:, None]
        rg = tl.load(inb + 2 * k + r[:, None] * NG + gidx[None, :], mask=ok2, other=0)
        rg = rg.to(tl.float32)  # [B, NG]
        big = M >= 1.329227995784916e36  # as in _decode_sg
        sf = tl.where(big, rg * tl.div_rn(M, 255.0), _div_by(rg * M, 255.0, _R255))
        ok3 = ok[:, None, None]
        at = inb + 2 * k + k * NG + r[:, None, None] * CODE_BYTES + (j // PER)[None, :, :]
        byte = tl.load(at, mask=ok3, other=0).to(tl.int32)
        c = (byte >> ((j % PER) * W)[None, :, :]) & ((1 << W) - 1)
        if UNIT:  # levels {0, 1}, as in _decode_sg
            mag = (c & 1).to(tl.float32) * sf[:, :, None]
        else:
            mag = tl.load(tab + (c & (TOP - 1))) * sf[:, :, None]
        flip = (c >= TOP).to(tl.uint32) << 31  # the sign as in _decode_sg
        v = (mag.to(tl.uint32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)
        e = r[:, None, None] * S + j[None, :, :]
        if MODE == _DECODE_ACC:
            v = tl.load(local + e, mask=ok3, other=0.0) + v
        tl.store(outf + e, v, mask=ok3)

    @triton.jit
    def _pair(v):
        """The two float32 halves (low, high) of int64 table entries."""
        lo = v.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (v >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        return lo, hi

    @triton.jit
    def _codes(
        ax, gm, rgm, u, tab, ptab, qtab, bucket,
        TOP: tl.constexpr, NB_LOG: tl.constexpr, STEPS: tl.constexpr, FAST: tl.constexpr,
        UNIT: tl.constexpr,
    ):  # fmt: skip
        """The magnitude codes of entries |x| = ax of groups of maxima gm.
        FAST: the two divisions by reciprocals (rgm = 1 / gm per group, the
        level gaps' from qtab), for a super-group whose entries are all zero or
        at least 2**-100 and 2**-90 of their group's maximum, below 2**120 (the
        reciprocal division is the correctly rounded one there: _div_by); else
        tl.div_rn. Tables (_tables): tab the levels, ptab (tab[i], tab[i + 1])
        and qtab (the gap hi - lo, its reciprocal) as int64 pairs, one load
        each; UNIT: the levels are {0, 1}."""
        if FAST:  # noqa: SIM108 (Triton: a constexpr branch)
            y = _div_by(ax, gm, rgm)  # rgm = 0 for an all-zero group: y = 0
        else:
            y = tl.where(gm > 0.0, tl.div_rn(ax, gm), 0.0)
        if TOP == 1 or (FAST and UNIT):
            # levels {0, 1}, y in [0, 1]: the level is 0, p = y / 1 (y = 1 reaches
            # the top level with p = 0 and the same code, 1)
            code = (u < y).to(tl.int32)
        elif FAST and STEPS == 1:
            b = tl.minimum((y * (1 << NB_LOG)).to(tl.int32), (1 << NB_LOG) - 1)
            lv = tl.load(bucket + b)  # at most TOP - 2 (_tables): no clamp below
            lo, hi = _pair(tl.load(ptab + lv))
            up = hi <= y
            lv += up.to(tl.int32)
            lo = tl.where(up, hi, lo)
            # the top level's gap is +inf (1/inf = 0): the quotient comes out
            # NaN where tl.div_rn gives 0, and u < p is false for both
            d, rd = _pair(tl.load(qtab + lv))
            code = lv + (u < _div_by(y - lo, d, rd)).to(tl.int32)
        else:
            if FAST:  # y is a number in [0, 1]
                b = tl.minimum((y * (1 << NB_LOG)).to(tl.int32), (1 << NB_LOG) - 1)
            else:
                isnum = y == y
                b = tl.minimum(
                    (tl.where(isnum, y, 0.0) * (1 << NB_LOG)).to(tl.int32), (1 << NB_LOG) - 1
                )
            lv = tl.load(bucket + b)
            for _ in tl.static_range(STEPS):
                lv += (tl.load(tab + lv + 1) <= y).to(tl.int32)
            if FAST:
                lv = tl.minimum(lv, TOP - 1)
            else:
                lv = tl.where(isnum, tl.minimum(lv, TOP - 1), TOP - 1)
            lo = tl.load(tab + lv)
            d, rd = _pair(tl.load(qtab + lv))
            if FAST:  # noqa: SIM108 (Triton: a constexpr branch)
                p = _div_by(y - lo, d, rd)
            else:
                p = tl.div_rn(y - lo, d)
            code = lv + (u < p).to(tl.int32)
        return code

    @triton.jit
    def _encode_sg(
        x, outb, r, k, R, j, gidx, units, tab, ptab, qtab, bucket,
        g0, g1, p0, p1, n, rn, nu, cm, cm2, s0, s1,
        W: tl.constexpr, S: tl.constexpr, NG: tl.constexpr, TOP: tl.constexpr,
        PER: tl.constexpr, CODE_BYTES: tl.constexpr, NB_LOG: tl.constexpr, STEPS: tl.constexpr,
        CORR: tl.constexpr, UNIT: tl.constexpr,
    ):  # fmt: skip
        """Encode super-group r (row R of the working vector) from x [NG, G // V, V]."""
        codes_at = 2 * k + k * NG
        # scales: maxima on the bit patterns of |x|
        ai = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        gmi = tl.max(tl.max(ai, axis=2), axis=1)
        mi = tl.max(gmi, axis=0)
        mi = tl.where(mi > 0x7F800000, 0x7FC00000, mi)  # a NaN: amax's canonical one
        mb = (mi.to(tl.int64) + 0xFFFF) >> 16  # round_up_bf16
        mb = tl.where((mb == 0x7F80) & (mi < 0x7F800000), 0x7F7F, mb)  # finite in, finite out
        Mf = ((mb & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(outb + 2 * r, (mb & 0xFF).to(tl.uint8))
        tl.store(outb + 2 * r + 1, ((mb >> 8) & 0xFF).to(tl.uint8))
        gmax = gmi.to(tl.float32, bitcast=True)
        g = tl.where(Mf > 0.0, tl.div_rn(gmax, Mf) * 255.0, 0.0)
        g = tl.where(tl.abs(g) < float("inf"), g, 0.0)  # nan_to_num
        us = _uniform((R * NG + gidx).to(tl.uint32), s0, s1)
        fl = tl.floor(g)
        q = fl + (us < g - fl).to(tl.float32)
        q = tl.minimum(tl.maximum(q, 0.0), 255.0)
        tl.store(outb + 2 * k + r * NG + gidx, q.to(tl.uint8))
        # entries
        u = _entry_uniforms(
            (R * S + j).to(tl.uint32), g0, g1, p0, p1, n, rn, units, nu, cm, cm2, CORR
        )
        gm = gmax[:, None, None]
        ax = tl.abs(x)
        # the reciprocal path's range (see _codes): entries zero or at least
        # 2**-100 and 2**-90 of their group's maximum, the maximum below 2**120
        # (also no NaN or infinity: their bit patterns are above it)
        odd = (ai != 0) & ((ai < 0x0D800000) | (ax < gm * 8.077935669463161e-28))
        n_odd = tl.max(tl.max(tl.max(odd.to(tl.int32), axis=2), axis=1), axis=0)
        fast = (mi < 0x7B800000) & (n_odd == 0)
        if fast:
            rgm = tl.where(gmax > 0.0, tl.div_rn(1.0, gmax), 0.0)[:, None, None]
            code = _codes(ax, gm, rgm, u, tab, ptab, qtab, bucket, TOP, NB_LOG, STEPS, True, UNIT)
        else:
            code = _codes(ax, gm, gm, u, tab, ptab, qtab, bucket, TOP, NB_LOG, STEPS, False, UNIT)
        code = code | ((x < 0.0).to(tl.int32) << (W - 1))
        packed = tl.reshape(code, [S // PER, PER])
        shifts = tl.arange(0, PER) * W
        byte_out = tl.sum(packed << shifts[None, :], axis=1)
        tl.store(outb + codes_at + r * CODE_BYTES + tl.arange(0, S // PER), byte_out.to(tl.uint8))

    @_stable_jit(
        ["total", "first", "g0", "g1", "p0", "p1", "n", "nu", "cm", "cm2"], ["inb", "outb"]
    )
    def _segment16_kernel(
        inb, local, outf, outb, units, total, first, g0, g1, p0, p1, n, rn, nu, cm, cm2,
        MODE: tl.constexpr, BLOCK: tl.constexpr, CORR: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        if MODE != _ENCODE:
            b0 = tl.load(inb + 2 * i, mask=ok, other=0).to(tl.int32)
            b1 = tl.load(inb + 2 * i + 1, mask=ok, other=0).to(tl.int32)
            v = ((b0 | (b1 << 8)) << 16).to(tl.float32, bitcast=True)
        if MODE == _DECODE:
            tl.store(outf + i, v, mask=ok)
        elif MODE == _DECODE_ACC:
            tl.store(outf + i, tl.load(local + i, mask=ok, other=0.0) + v, mask=ok)
        else:
            x = tl.load(local + i, mask=ok, other=0.0)
            if MODE == _DAR:
                x = x + v
            u = _entry_uniforms(
                (first + i).to(tl.uint32),
                g0.to(tl.uint32), g1.to(tl.uint32), p0.to(tl.uint32), p1.to(tl.uint32),
                n, rn, units, nu, cm, cm2, CORR,
            )  # fmt: skip
            # bf16 rounded up with probability (low 16 bits) / 2**16, on the bits
            xb = x.to(tl.int32, bitcast=True)
            up = (xb.to(tl.int64) + (u * 65536.0).to(tl.int64)) >> 16
            up = tl.where(((up & 0x7FFF) == 0x7F80) & ((xb & 0x7FFFFFFF) < 0x7F800000), up - 1, up)
            tl.store(outb + 2 * i, (up & 0xFF).to(tl.uint8), mask=ok)
            tl.store(outb + 2 * i + 1, ((up >> 8) & 0xFF).to(tl.uint8), mask=ok)

    @triton.jit
    def _tree_sum(x, LOG: tl.constexpr):
        """Sum of [2**LOG] in the reference's order (numerics.reduce.tree_sum):
        the two halves added, LOG times."""
        for _ in tl.static_range(LOG):
            x = tl.sum(tl.reshape(x, [2, x.shape[0] // 2]), axis=0)
        return tl.sum(x, axis=0)

    @_stable_jit(["d", "m"], [])
    def _stats_kernel(x_ptr, out_ptr, d, m, S: tl.constexpr, LOG: tl.constexpr):
        j = tl.program_id(0)
        i = j * S + tl.arange(0, S)
        x = tl.load(x_ptr + i, mask=i < d, other=0.0)
        count = tl.minimum(d - j * S, S).to(tl.float32)
        total = _tree_sum(x, LOG)
        sq = _tree_sum(x * x, LOG)
        nonzero = tl.max((x != 0.0).to(tl.int32), axis=0) > 0
        sq = tl.where(nonzero & (sq == 0.0), 1.1754943508222875e-38, sq)
        tl.store(out_ptr + j, tl.div_rn(total, count))
        tl.store(out_ptr + m + j, sq)


@lru_cache(maxsize=64)
def _tables(
    width: int, eps: float, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, bool]:
    """The encoding kernels' tables: the levels (with +inf appended), int64
    pairs (level i, level i + 1) and (gap hi - lo as the reference subtracts
    it, its correctly rounded reciprocal: a float32 division on the CPU), the
    bucket table and its geometry, and whether the levels are {0, 1}."""
    ext, bucket, nb_log, steps = search_tables(width, eps)
    dtab = torch.cat([ext[1:] - ext[:-1], ext.new_full((1,), float("inf"))])  # hi - lo
    rtab = torch.ones_like(dtab) / dtab
    top = 1 << (width - 1)
    if bucket.numel() and int(bucket.max()) > max(top - 2, 0):
        raise AssertionError("bucket table above the second-highest level")

    def pairs(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        bits = torch.stack([lo, hi], dim=1).contiguous().view(torch.int32).to(torch.int64)
        return (bits[:, 0] & 0xFFFFFFFF) | (bits[:, 1] << 32)

    ptab = pairs(ext, torch.cat([ext[1:], ext[-1:]]))
    qtab = pairs(dtab, rtab)
    unit = ext.numel() == 3 and float(ext[0]) == 0.0 and float(ext[1]) == 1.0
    return (
        ext.to(device),
        ptab.to(device),
        qtab.to(device),
        bucket.to(device),
        nb_log,
        steps,
        unit,
    )


@lru_cache(maxsize=256)
def _reciprocal(n: int) -> float:
    """1 / n correctly rounded to float32 (a float32 division on the CPU),
    kept per n: the two tensors and the division cost every launch host time."""
    return float(torch.tensor(1.0) / torch.tensor(float(n)))


@lru_cache(maxsize=64)
def _units(units: tuple[int, ...], peers: int, peer: int, device: str) -> torch.Tensor:
    """(unit * peer) % peers for each unit: the kernel adds the shift to it."""
    return torch.tensor([u * peer % peers for u in units], dtype=torch.int32, device=device)


_LAUNCH = {} if interpreting() else {"enable_fp_fusion": False}
#: One warp per super-group: 8 entries per thread, its reductions within the
#: warp (H100, the same bits: the fused hop 1.3-1.6x and the statistics
#: pre-pass 2.9x faster than with 4 warps).
_ONE_WARP = {} if interpreting() else {"num_warps": 1}
#: The decode kernels: two super-groups per program on two warps (H100, 256M
#: coordinates, 2-8 bits: 48-64% -> 83-85% of copy bandwidth, the same bits).
_DECODE_SGS = 2
_DECODE_WARPS = {} if interpreting() else {"num_warps": 2}
#: The interpreter patches triton.language while a kernel runs: not thread-safe
#: (the simulator runs ranks in threads), so launches take turns there.
_INTERPRETER_LOCK = threading.Lock() if interpreting() else contextlib.nullcontext()


@lru_cache(maxsize=16)
def _dummies(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the pointers a mode does not use."""
    return (
        torch.empty(1, dtype=torch.uint8, device=device),
        torch.empty(1, dtype=torch.float32, device=device),
    )


def run_segment(call: SegmentCall) -> None:
    """The same contract as :func:`hopq.codecs.dynamiq.kernels_cpu.run_segment`."""
    tensors = (call.payload, call.local, call.out_rows, call.out_payload)
    dev = str(next(t for t in tensors if t is not None).device)
    dummy_b, dummy_f = _dummies(dev)
    inb = call.payload if call.payload is not None else dummy_b
    loc = call.local if call.local is not None else dummy_f
    outf = call.out_rows if call.out_rows is not None else dummy_f
    outb = call.out_payload if call.out_payload is not None else dummy_b
    st = call.streams
    un = _units(st.units, st.peers, st.peer, dev)
    nu = un.numel()
    # the fastmod constants ceil(2**32 / d) of the unit count and the peer count
    cm = (0xFFFFFFFF // max(nu, 1) + 1) & 0xFFFFFFFF
    cm2 = (0xFFFFFFFF // max(st.peers, 1) + 1) & 0xFFFFFFFF
    keys = (*st.gamma_key, *st.perm_key, st.peers, _reciprocal(max(st.peers, 1)), nu, cm, cm2)
    corr = _corr(st.peers, len(st.units))
    mode, width, rows, S, G = int(call.mode), call.width, call.rows, call.S, call.s
    with _INTERPRETER_LOCK:
        if width == 16:
            total, block = rows * S, 1024
            _segment16_kernel[(triton.cdiv(total, block),)](
                inb, loc, outf, outb, un, total, call.row0 * S, *keys,
                MODE=mode, BLOCK=block, CORR=corr, **_LAUNCH,
            )  # fmt: skip
            return
        tab, ptab, qtab, bucket, nb_log, steps, unit = _tables(width, call.eps, dev)
        if mode in (Mode.DECODE, Mode.DECODE_ACC):
            _decode_kernel[(triton.cdiv(rows, _DECODE_SGS),)](
                inb, loc, outf, tab, rows,
                W=width, MODE=mode, S=S, G=G, B=_DECODE_SGS, UNIT=unit, **_LAUNCH, **_DECODE_WARPS,
            )  # fmt: skip
            return
        _segment_kernel[(rows,)](
            inb, loc, outf, outb, un, tab, ptab, qtab, bucket, rows, call.row0, *keys,
            *st.scale_key,
            W=width, MODE=mode, S=S, G=G, NB_LOG=nb_log, STEPS=steps, CORR=corr, UNIT=unit,
            **_LAUNCH, **_ONE_WARP,
        )  # fmt: skip


__all__ = ["gather_rows", "run_segment", "scatter_rows", "supergroup_stats"]
# gather_rows and scatter_rows: the reference's own index operations
# (hopq.numerics.rows), memory-bound on a GPU already.


def supergroup_stats(x: torch.Tensor, S: int) -> torch.Tensor:
    """[2, m] float32: per super-group mean (over its real entries) and sum of
    squares, as the reference plan computes them before rounding to bfloat16."""
    d = x.numel()
    m = -(-d // S)
    out = torch.empty(2, m, dtype=torch.float32, device=x.device)
    if m:
        with _INTERPRETER_LOCK:
            _stats_kernel[(m,)](
                x.reshape(-1).contiguous(), out, d, m, S=S, LOG=S.bit_length() - 1,
                **_LAUNCH, **_ONE_WARP,
            )  # fmt: skip
    return out


def compile_all(arch: int = 90) -> list[str]:
    """Compile every kernel variant for a CUDA target (sm_<arch>) without a GPU
    (Triton's front end and the ptxas in its wheel) and check that divisions are
    the correctly rounded ones and no multiply-add was fused. Catches what the
    interpreter lets through (it runs the Python directly). Needs
    TRITON_INTERPRET unset when this module is imported. Returns one line per
    variant."""
    if triton is None or interpreting():
        raise RuntimeError("compile_all needs triton and TRITON_INTERPRET=0 at import")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hopq.codecs.dynamiq.config import DEFAULT_EPS

    target = GPUTarget("cuda", arch, 32)
    out = []

    def build(fn, sig: dict[str, str], const: dict[str, object], warps: int = 4) -> None:
        names = list(sig)
        src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in const.items()})
        opts = {"enable_fp_fusion": False, "num_warps": warps}
        ptx = triton.compile(src, target=target, options=opts).asm["ptx"]
        # fp fusion off: every multiply, add and subtract carries .rn, which
        # ptxas never contracts; the fused multiply-adds left are the explicit
        # ones (the reciprocal divisions' corrections)
        if "div.full" in ptx or "div.approx" in ptx or re.search(r"\b(mul|add|sub)\.f32", ptx):
            raise AssertionError(
                f"{fn.__name__} {const}: approximate division or contractible arithmetic"
            )
        out.append(f"{fn.__name__} {const}: ok")

    ptrs = {"inb": "*u8", "local": "*fp32", "outf": "*fp32", "outb": "*u8", "units": "*i32"}
    keys = {
        "g0": "i64",
        "g1": "i64",
        "p0": "i64",
        "p1": "i64",
        "n": "i32",
        "rn": "fp32",
        "nu": "i32",
        "cm": "i64",
        "cm2": "i64",
    }
    seg = {
        **ptrs, "tab": "*fp32", "ptab": "*i64", "qtab": "*i64", "bucket": "*i32",
        "k": "i32", "row0": "i32",
        **keys, "s0": "i64", "s1": "i64",
        **dict.fromkeys(("W", "MODE", "S", "G", "NB_LOG", "STEPS", "CORR", "UNIT"), "constexpr"),
    }  # fmt: skip
    seg16 = {
        **ptrs, "total": "i32", "first": "i32", **keys,
        **dict.fromkeys(("MODE", "BLOCK", "CORR"), "constexpr"),
    }  # fmt: skip
    dec = {
        "inb": "*u8", "local": "*fp32", "outf": "*fp32", "tab": "*fp32", "k": "i32",
        **dict.fromkeys(("W", "MODE", "S", "G", "B", "UNIT"), "constexpr"),
    }  # fmt: skip
    for mode in Mode:
        for corr in (CORR_NONE, CORR_FASTMOD, CORR_REM):
            for w in (2, 4, 8):
                const: dict[str, object] = {"W": w, "MODE": int(mode), "S": 256, "G": 32}
                if mode in (Mode.ENCODE, Mode.DAR):
                    _, _, _, _, nb_log, steps, unit = _tables(w, DEFAULT_EPS.get(w, 0.0), "cpu")
                    const |= {"NB_LOG": nb_log, "STEPS": steps, "CORR": corr, "UNIT": unit}
                    build(_segment_kernel, seg, const, warps=1)
                elif corr == CORR_NONE:  # the decode kernels draw no random numbers
                    unit = _tables(w, DEFAULT_EPS.get(w, 0.0), "cpu")[-1]
                    build(_decode_kernel, dec, {**const, "B": _DECODE_SGS, "UNIT": unit}, warps=2)
            build(_segment16_kernel, seg16, {"MODE": int(mode), "BLOCK": 1024, "CORR": corr})
    # the level search of several steps (tables of large eps)
    const = {"W": 4, "MODE": int(Mode.DAR), "S": 256, "G": 32, "NB_LOG": 8, "STEPS": 2}
    build(_segment_kernel, seg, {**const, "CORR": CORR_FASTMOD, "UNIT": False}, warps=1)
    build(
        _stats_kernel,
        {
            "x_ptr": "*fp32",
            "out_ptr": "*fp32",
            "d": "i32",
            "m": "i32",
            "S": "constexpr",
            "LOG": "constexpr",
        },
        {"S": 256, "LOG": 8},
        warps=1,
    )
    return out
