"""EQuARX's Triton kernels: int8, FP8 E4M3 or FP8 E5M2 codes with bfloat16 or
float32 scales, in either block geometry, one pass per stage over a part; the
same bits as the PyTorch reference (:class:`hopq.codecs.equarx.EQuARXCodec`)
and the same ``run`` protocol as the numba kernel
(:mod:`hopq.codecs.equarx.kernels_cpu`).

A program holds whole blocks in registers: the strided layout's tiles of
``rows`` x ``columns`` (scale k covering column k of a minishard) are read
as [segments, rows, columns] tiles, the contiguous layout's runs as
[runs, entries] tiles, and each block's maximum is a reduction over the
rows (axis 1 in both). So the fused hop (DAR) reads the received codes and the
local chunk once and writes the new codes once, the scales riding beside them;
the accumulated sum stays in registers (``local`` "may be overwritten", and
the engine never reads it after the hop; the numba kernel does write it). A
block longer than one tile (over ``TILE`` entries per column) takes a second
pass over its entries, which the first pass just touched (L2); the fused hop
then stores the sums in ``local`` for it.

Every float operation is the reference's, in its order: divisions are
``tl.div_rn`` (correctly rounded, as torch's), kernels launch with fp fusion
off (no multiply-add contraction), clamps are selects (a NaN passes, as in
torch's ``clamp``), rounding to nearest even is the 1.5 x 2^23 trick (exact
for |v| <= 2^22), FP8 codes are cast with integer arithmetic on the float32
bits (torch's ``Float8_e4m3fn(float)`` / ``Float8_e5m2(float)``, which its CUDA
copy kernel runs too) and decoded likewise (torch's NaN bits included), and
block maxima are taken on the bit patterns of the finite entries' |x|.

A payload's scales are checked first, by a small kernel whose programs count
the invalid ones (negative, -0.0, NaN or Inf) in their share of the scales;
every program of the main kernel sums those counts and writes nothing when the
sum is not zero, and :func:`run` returns it (one device-to-host read per
decoding call). A part takes one launch of the main kernel: its shorter last
segment is a branch of it.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels
run on CPU tensors; that is how the tests hold them to the reference.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
from functools import lru_cache
from typing import Any

import torch

from hopq.kernels import Mode, interpreting, register_caps

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

#: The kernel's number for each element format, by the torch dtype of its codes
#: (as :data:`hopq.codecs.equarx.kernels_cpu.CODES`).
CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

#: Entries per program. 2048 on 4 warps is 16 entries per thread, in each of
#: its rows four neighbouring columns (one 16-byte load of the local chunk, one
#: word of codes); the paper's geometry (64 rows of 1024 columns) makes tiles
#: of 64 rows x 32 columns. ptxas (Triton 3.6, sm_90) gives the int8 and E4M3
#: hops 63 registers, E5M2's 80, the decoding kernels 32: eight programs per
#: SM. On an H200 this setting encoded at 71-76% of copy against 54-62% for
#: 4096 entries (on 4 or 8 warps), the fused hop within noise of them.
TILE = 2048
#: Columns of a strided tile at least (a block's rows stay in one tile where
#: TILE allows): 32 float32 columns are a 128-byte line, their codes a sector.
MIN_COLUMNS = 32
#: Warps per program for a full tile (smaller tiles: fewer, at least one).
#: Both are read at every call, so a GPU run may sweep them (the same bits).
WARPS = 4
#: Registers per thread the fused hop may take (None: ptxas's choice: 63 for
#: the int8 hop, 80 for E5M2's). On an H200, 56 was no slower than no cap for
#: any element, scale or layout, the same bits, and faster for some (FP32
#: scales, contiguous E4M3); 32 spills. `hopq bench kernels` timed the int8
#: hop at 0.956 ms (40% of copy) at 256M entries with it, within the 36-44%
#: of the runs before. Read at every call, so that a GPU run may sweep it.
HOP_MAXNREG: int | None = 56
#: The validity pre-pass: scales per step, and per program (each leaves one count,
#: which every program of the main kernel sums: 16 at 16M coordinates).
CHECK_BLOCK = 2048
CHECK_PER_PROGRAM = 16384


def available() -> bool:
    return triton is not None


if triton is not None:
    _ENCODE, _DECODE, _DECODE_ACC, _DAR = (
        tl.constexpr(int(v)) for v in (Mode.ENCODE, Mode.DECODE, Mode.DECODE_ACC, Mode.DAR)
    )
    _INT8, _E4M3, _E5M2 = (tl.constexpr(v) for v in (0, 1, 2))
    _FMAX = tl.constexpr(3.4028234663852886e38)
    #: 1.5 * 2^23: (v + it) - it rounds |v| <= 2^22 to an integer, ties to even.
    _MAGIC = tl.constexpr(12582912.0)

    def _stable_jit(ints: list[str], byte_ptrs: list[str]) -> Any:
        """triton.jit that compiles one variant per constexpr set: the part's
        sizes and offsets take many values that Triton would otherwise
        specialize on (== 1, % 16 == 0), a compilation each. Byte payloads start
        anywhere in a buffer; their alignment would be one more key."""
        kw: dict[str, list[str]] = {"do_not_specialize": ints}
        if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
            kw["do_not_specialize_on_alignment"] = byte_ptrs
        return triton.jit(**kw)

    @triton.jit
    def _scale_bits(inb, k, ok, SBYTES: tl.constexpr):
        """Scale k of a payload (little-endian bfloat16 or float32) as float32 bits."""
        if SBYTES == 2:
            b0 = tl.load(inb + 2 * k, mask=ok, other=0).to(tl.int32)
            b1 = tl.load(inb + 2 * k + 1, mask=ok, other=0).to(tl.int32)
            bits = (b0 | (b1 << 8)) << 16
        else:
            b0 = tl.load(inb + 4 * k, mask=ok, other=0).to(tl.int32)
            b1 = tl.load(inb + 4 * k + 1, mask=ok, other=0).to(tl.int32)
            b2 = tl.load(inb + 4 * k + 2, mask=ok, other=0).to(tl.int32)
            b3 = tl.load(inb + 4 * k + 3, mask=ok, other=0).to(tl.int32)
            bits = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
        return bits

    @triton.jit
    def _clamp_max(v):
        """clamp(v, -max, max) of float32, a NaN kept (torch's clamp)."""
        return tl.where(v > _FMAX, _FMAX, tl.where(v < -_FMAX, -_FMAX, v))

    @triton.jit
    def _fp8_value(b, EL: tl.constexpr):
        """torch's float32 value of the FP8 code b (int32, 0..255), NaN bits too:
        E4M3fn's NaN is sign | 0x7FF00000, E5M2's NaN keeps its mantissa as
        float16 does, quieted."""
        sign = (b >> 7) << 31
        if EL == _E4M3:
            e = (b >> 3) & 15
            m = b & 7
            normal = ((e + 120) << 23) | (m << 20)
            sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m 2^-9
            bits = tl.where(e == 0, sub, normal)
            bits = tl.where((e == 15) & (m == 7), 0x7FF00000, bits)
        else:
            e = (b >> 2) & 31
            m = b & 3
            normal = ((e + 112) << 23) | (m << 21)
            sub = (m.to(tl.float32) * 1.52587890625e-05).to(tl.int32, bitcast=True)  # m 2^-16
            bits = tl.where(e == 0, sub, normal)
            special = 0x7F800000 | (m << 21) | ((m != 0).to(tl.int32) << 22)
            bits = tl.where(e == 31, special, bits)
        return (bits | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _dequant(b, f, EL: tl.constexpr):
        """The reference's _dequantize of code bytes b (int32) with factor A / Q."""
        if EL == _INT8:
            c = (b ^ 0x80) - 0x80  # the int8 value
            v = tl.where(c == -128, float("nan"), c.to(tl.float32))
            out = _clamp_max(v * f)
        else:
            v = _fp8_value(b, EL)
            out = _clamp_max(v * f)
            if EL == _E5M2:
                out = tl.where(tl.abs(v) == float("inf"), v, out)
        return out

    @triton.jit
    def _acc(x, v):
        """x + v, saturated at +-float32's maximum where two finite terms
        overflow (the reference's add_saturating)."""
        s = x + v
        fin = (tl.abs(x) < float("inf")) & (tl.abs(v) < float("inf"))
        return tl.where(fin, _clamp_max(s), s)

    @triton.jit
    def _abs_bits(s):
        """Bits of |s| for a finite s, 0 for NaN and Inf (their order is the floats')."""
        ai = s.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.where(ai < 0x7F800000, ai, 0)

    @triton.jit
    def _put_scale(outb, k, ok, mi, SBYTES: tl.constexpr):
        """Write scale k from the bits of its block's finite absmax (bf16: rounded
        up, a finite absmax beyond bfloat16's range saturates) and return its
        float32 value."""
        if SBYTES == 2:
            mb = (mi + 0xFFFF) >> 16
            mb = tl.where(mb == 0x7F80, 0x7F7F, mb)
            tl.store(outb + 2 * k, (mb & 0xFF).to(tl.uint8), mask=ok)
            tl.store(outb + 2 * k + 1, ((mb >> 8) & 0xFF).to(tl.uint8), mask=ok)
            bits = mb << 16
        else:
            tl.store(outb + 4 * k, (mi & 0xFF).to(tl.uint8), mask=ok)
            tl.store(outb + 4 * k + 1, ((mi >> 8) & 0xFF).to(tl.uint8), mask=ok)
            tl.store(outb + 4 * k + 2, ((mi >> 16) & 0xFF).to(tl.uint8), mask=ok)
            tl.store(outb + 4 * k + 3, ((mi >> 24) & 0xFF).to(tl.uint8), mask=ok)
            bits = mi
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _quant(x, a, EL: tl.constexpr, Q: tl.constexpr):
        """The reference's _quantize of entries x under (broadcast) scales a, as
        code bytes (int32 0..255)."""
        xa = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        finite = xa < 0x7F800000
        xs = tl.where(finite, x, 0.0)  # non-finite entries get their own code below
        pos = a > 0.0
        v = tl.where(pos, tl.div_rn(xs, tl.where(pos, a, 1.0)) * Q, 0.0)
        if EL == _INT8:
            v = tl.minimum(tl.maximum(v, -128.0), 128.0)
            r = (v + _MAGIC) - _MAGIC  # torch.round: to nearest, ties to even
            r = tl.minimum(tl.maximum(r, -127.0), 127.0)
            code = tl.where(finite, r.to(tl.int32), -128) & 0xFF
        else:
            v = tl.minimum(tl.maximum(v, -Q), Q)
            vb = v.to(tl.int32, bitcast=True)
            u = vb & 0x7FFFFFFF
            sign = ((vb >> 31) & 1) << 7
            if EL == _E4M3:
                # below 2^-6: a multiple of the subnormal step 2^-9
                small = ((tl.abs(v) * 512.0 + _MAGIC) - _MAGIC).to(tl.int32)
                big = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - 960
                code = tl.where(u < (121 << 23), small, big) | sign
                code = tl.where(finite, code, 0x7F)
            else:
                # below 2^-14: a multiple of the subnormal step 2^-16
                small = ((tl.abs(v) * 65536.0 + _MAGIC) - _MAGIC).to(tl.int32)
                big = ((u + 0xFFFFF + ((u >> 21) & 1)) >> 21) - 448
                code = tl.where(u < (113 << 23), small, big) | sign
                xsign = ((x.to(tl.int32, bitcast=True) >> 31) & 1) << 7
                code = tl.where(finite, code, tl.where(xa == 0x7F800000, 0x7C, 0x7F) | xsign)
        return code

    @triton.jit
    def _tile(
        i, j, c, n, seg0, cols,
        S: tl.constexpr, BLOCK: tl.constexpr, RT: tl.constexpr, RUNS: tl.constexpr,
        PARTIAL: tl.constexpr,
    ):  # fmt: skip
        """Offsets of the entries of row tile i, the reduce axis being axis 1:
        RUNS [SP, RT] (runs j of BLOCK entries) or [SP, RT, CT] (segments j,
        rows, columns c), and their mask (without the per-scale one)."""
        r = i * RT + tl.arange(0, RT)
        if RUNS:
            offs = (j * BLOCK)[:, None] + r[None, :]
            m = (r < BLOCK)[None, :]
            if PARTIAL:  # the short last run (full runs: masks constant along a run)
                m = m & (offs < n)
        elif PARTIAL:
            L = n - seg0 * (S * BLOCK)
            e = r[:, None] * cols + c[None, :]  # [RT, CT]
            offs = seg0 * (S * BLOCK) + e[None, :, :]
            m = (e < L)[None, :, :]
        else:
            offs = (j * (S * BLOCK))[:, None, None] + (r[:, None] * S + c[None, :])[None, :, :]
            m = (r < BLOCK)[None, :, None]
        return offs, m

    @triton.jit
    def _stage1(
        i, j, c, km, kms, f, cin, local, outf, n, seg0, cols,
        MODE: tl.constexpr, EL: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr,
        RT: tl.constexpr, RUNS: tl.constexpr, PARTIAL: tl.constexpr, STORE: tl.constexpr,
    ):  # fmt: skip
        """Row tile i: ENCODE loads the local entries; the decoding modes decode
        the codes (at ``cin``) and store them (DECODE) or add them to the local
        entries and store the sums (DECODE_ACC; DAR where ``STORE``). Loads
        take the mask km, stores kms (which also holds the payload's validity:
        the loads do not wait for it). Returns (the entries to encode,
        offsets, the store mask)."""
        offs, m = _tile(i, j, c, n, seg0, cols, S, BLOCK, RT, RUNS, PARTIAL)
        ms = m & kms
        m = m & km
        if MODE == _ENCODE:
            s = tl.load(local + offs, mask=m, other=0.0)
        else:
            b = tl.load(cin + offs, mask=m, other=0).to(tl.int32)
            s = _dequant(b, f, EL)
            if MODE == _DECODE:
                tl.store(outf + offs, s, mask=ms)
            else:
                s = _acc(tl.load(local + offs, mask=m, other=0.0), s)
                if STORE:
                    tl.store(local + offs, s, mask=ms)
        return s, offs, ms

    @triton.jit
    def _body(
        pid, inb, local, outf, outb, n, seg0, cols, sb, bad,
        MODE: tl.constexpr, EL: tl.constexpr, Q: tl.constexpr, SBYTES: tl.constexpr,
        S: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr, RT: tl.constexpr,
        CT: tl.constexpr, RUNS: tl.constexpr, PARTIAL: tl.constexpr, CHECK: tl.constexpr,
        A4: tl.constexpr,
    ):  # fmt: skip
        """One stage over SP runs (RUNS: the contiguous layout, one scale per run
        of BLOCK entries) or SP segments x CT columns of the strided layout
        (segments of BLOCK rows of S columns; PARTIAL: the part's shorter last
        segment, at segment index seg0, of ``cols`` columns). ``sb``: bytes of
        the payload's scales (the codes follow them); ``bad``: the number of
        invalid scales in the payload (then nothing is written)."""
        NIT: tl.constexpr = (BLOCK + RT - 1) // RT
        # the codes, after the scales; A4: both start on 4 bytes (the host checked),
        # so that a thread's neighbouring codes load and store as one word
        cin = inb + sb
        cout = outb + sb
        if A4:
            cin = tl.multiple_of(cin, 4)
            cout = tl.multiple_of(cout, 4)
        if RUNS:
            if PARTIAL:
                j = seg0 + tl.arange(0, SP)  # SP == 1
                kok = j >= 0
            else:
                j = pid * SP + tl.arange(0, SP)  # full runs, one scale each: [SP]
                kok = (j + 1) * BLOCK <= n
            c = j  # unused
            k = j
        else:
            NCT: tl.constexpr = (S + CT - 1) // CT
            c0 = tl.arange(0, CT)
            if PARTIAL:
                j = seg0 + tl.arange(0, SP)  # SP == 1
                c = pid * CT + c0
                kok = (c < cols)[None, :] & (j >= 0)[:, None]
            else:
                j = (pid // NCT) * SP + tl.arange(0, SP)
                c = (pid % NCT) * CT + c0
                kok = (c < S)[None, :] & ((j + 1) * (S * BLOCK) <= n)[:, None]  # full ones
            k = (j * S)[:, None] + c[None, :]  # [SP, CT]
        kst = kok
        if CHECK:
            # invalid scales anywhere: write nothing (the count broadcast first: the
            # interpreter refuses a mask made with a scalar boolean); the loads go
            # ahead without waiting for the count
            kst = kok & ((bad + tl.zeros_like(k)) == 0)
        km = tl.expand_dims(kok, 1)
        kms = tl.expand_dims(kst, 1)
        f = 0.0
        if MODE != _ENCODE:
            a_in = _scale_bits(inb, k, kok, SBYTES).to(tl.float32, bitcast=True)
            f = tl.expand_dims(tl.div_rn(a_in, Q), 1)
        ENC: tl.constexpr = MODE == _ENCODE or MODE == _DAR  # noqa: SIM109 (constexprs)
        if NIT == 1:  # every block in registers: one pass
            # the fused hop encodes the sums from registers: the local chunk is
            # read, not written (the engine never reads it after the hop)
            s, offs, m = _stage1(
                0, j, c, km, kms, f, cin, local, outf, n, seg0, cols,
                MODE, EL, S, BLOCK, RT, RUNS, PARTIAL, MODE != _DAR,
            )  # fmt: skip
            if ENC:
                a = _put_scale(outb, k, kst, tl.max(_abs_bits(s), axis=1), SBYTES)
                a = tl.expand_dims(a, 1)
                tl.store(cout + offs, _quant(s, a, EL, Q).to(tl.uint8), mask=m)
        else:  # blocks longer than a tile: maxima first, then the codes
            if RUNS:  # noqa: SIM108 (a constexpr branch)
                mi = tl.zeros([SP], tl.int32)
            else:
                mi = tl.zeros([SP, CT], tl.int32)
            for i in range(NIT):
                s, offs, m = _stage1(
                    i, j, c, km, kms, f, cin, local, outf, n, seg0, cols,
                    MODE, EL, S, BLOCK, RT, RUNS, PARTIAL, True,
                )  # fmt: skip
                if ENC:
                    mi = tl.maximum(mi, tl.max(_abs_bits(s), axis=1))
            if ENC:
                a = tl.expand_dims(_put_scale(outb, k, kst, mi, SBYTES), 1)
                tl.debug_barrier()  # the accumulated entries (DAR) are stored
                for i in range(NIT):
                    offs, m = _tile(i, j, c, n, seg0, cols, S, BLOCK, RT, RUNS, PARTIAL)
                    s = tl.load(local + offs, mask=m & km, other=0.0)
                    tl.store(cout + offs, _quant(s, a, EL, Q).to(tl.uint8), mask=m & kms)

    @_stable_jit(["n", "full", "last_cols", "sb", "nfp", "nparts"], ["inb", "outb"])
    def _hop_kernel(
        inb, local, outf, outb, counts, n, full, last_cols, sb, nfp, nparts,
        MODE: tl.constexpr, EL: tl.constexpr, Q: tl.constexpr, SBYTES: tl.constexpr,
        S: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr, RT: tl.constexpr,
        CT: tl.constexpr, RUNS: tl.constexpr, CHECK: tl.constexpr, A4: tl.constexpr,
    ):  # fmt: skip
        """A part in one launch: programs below ``nfp`` take SP full segments (or
        runs) each, the others the part's shorter last one (segment ``full``, of
        ``last_cols`` columns). With CHECK, the ``nparts`` counts of invalid
        scales that :func:`_check_kernel` left in ``counts`` are summed first
        (program 0 stores the sum after them, for the host)."""
        pid = tl.program_id(0)
        # the short segment's columns have a run-time stride (one address per
        # entry): a quarter of the columns per program keeps its registers below
        # the full segments' (which set the program's)
        CTP: tl.constexpr = CT // 4 if CT >= 4 else 1
        bad = tl.full((), 0, tl.int32)
        if CHECK:
            for i in range(0, nparts, 128):
                idx = i + tl.arange(0, 128)
                bad += tl.sum(tl.load(counts + idx, mask=idx < nparts, other=0), axis=0)
            if pid == 0:
                tl.store(counts + nparts, bad)
        if pid < nfp:
            _body(
                pid, inb, local, outf, outb, n, full, S, sb, bad,
                MODE, EL, Q, SBYTES, S, BLOCK, SP, RT, CT, RUNS, False, CHECK, A4,
            )  # fmt: skip
        else:
            _body(
                pid - nfp, inb, local, outf, outb, n, full, last_cols, sb, bad,
                MODE, EL, Q, SBYTES, S, BLOCK, 1, RT, CTP, RUNS, True, CHECK, A4,
            )  # fmt: skip

    @_stable_jit(["ns"], ["inb"])
    def _check_kernel(inb, counts, ns, SBYTES: tl.constexpr, B: tl.constexpr, PER: tl.constexpr):
        """counts[p]: how many of scales p PER .. (p + 1) PER - 1 are negative (sign
        bit set: -0.0 too), NaN or Inf."""
        p = tl.program_id(0)
        nbad = tl.full((), 0, tl.int32)
        for i in range(0, PER, B):
            k = p * PER + i + tl.arange(0, B)
            bits = _scale_bits(inb, k, k < ns, SBYTES)
            nbad += tl.sum(((bits < 0) | (bits >= 0x7F800000)).to(tl.int32), axis=0)
        tl.store(counts + p, nbad)


_LAUNCH = {} if interpreting() else {"enable_fp_fusion": False}
#: The interpreter patches triton.language while a kernel runs: not thread-safe
#: (the simulator runs ranks in threads), so launches take turns there.
_INTERPRETER_LOCK = threading.Lock() if interpreting() else contextlib.nullcontext()


def _codes_aligned(sb: int, *payloads: torch.Tensor | None) -> bool:
    """Whether the codes of every payload a call reads or writes (after ``sb``
    bytes of scales) start on 4 bytes: then the kernels may move a thread's
    neighbouring codes as one word (compiled once for each answer)."""
    return all((t.data_ptr() + sb) % 4 == 0 for t in payloads if t is not None)


def _pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


@lru_cache(maxsize=64)
def geometry(columns: int, block: int, tile: int, warps: int) -> tuple[int, int, int, int]:
    """(SP, RT, CT, warps) for segments of ``block`` rows x ``columns`` columns
    (``columns`` 1: runs of ``block`` entries): a program covers SP segments (or
    runs) x RT rows x CT columns, about ``tile`` entries, a block's rows in one
    tile where they fit (one pass), on ``warps`` warps for a full tile."""
    rows = _pow2(block)
    if columns == 1:
        rt = min(rows, tile)
        sp, ct = max(1, tile // rt), 1
    else:
        # a row's columns first (contiguous), at least MIN_COLUMNS of them
        ct = min(_pow2(columns), max(MIN_COLUMNS, tile // rows))
        rt = min(rows, max(1, tile // ct))
        sp = max(1, tile // (rt * ct))
    return sp, rt, ct, max(1, min(warps, sp * rt * ct * warps // tile))


@lru_cache(maxsize=16)
def _dummies(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stand-ins for the pointers a mode does not use."""
    return (
        torch.empty(1, dtype=torch.uint8, device=device),
        torch.empty(1, dtype=torch.float32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
    )


def run(
    mode: Mode,
    n: int,
    minishard: int,
    columns: int,
    block: int,
    scale_bytes: int,
    *,
    element: torch.dtype,
    q: float,
    payload: torch.Tensor | None = None,
    local: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    out_payload: torch.Tensor | None = None,
) -> int:
    """The same contract as :func:`hopq.codecs.equarx.kernels_cpu.run`, on CUDA
    tensors (CPU tensors under the interpreter): one part of ``n`` entries in
    ``mode``; returns the number of invalid scales in ``payload`` (then nothing
    was written)."""
    if n == 0:
        return 0
    tensors = (payload, local, out_rows, out_payload)
    dev = str(next(t for t in tensors if t is not None).device)
    dummy_b, dummy_f, dummy_i = _dummies(dev)
    inb = payload if payload is not None else dummy_b
    loc = local if local is not None else dummy_f
    outf = out_rows if out_rows is not None else dummy_f
    outb = out_payload if out_payload is not None else dummy_b
    S = columns
    full, rest = divmod(n, minishard)
    last_cols = min(S, -(-rest // block)) if rest else 0
    ns = full * S + last_cols
    sb = ns * scale_bytes
    if n + sb >= 1 << 31:
        raise ValueError(f"equarx: a part of {n} entries (the kernels index with int32)")
    sp, rt, ct, warps = geometry(S, block, TILE, WARPS)
    check = mode != Mode.ENCODE
    # programs: SP full segments (or runs) x CT columns each, then the short last one
    nfp = triton.cdiv(full, sp) * triton.cdiv(S, ct)
    grid = nfp + (triton.cdiv(last_cols, max(1, ct // 4)) if rest else 0)
    with _INTERPRETER_LOCK:
        counts, nparts = dummy_i, 0
        if check:
            nparts = triton.cdiv(ns, CHECK_PER_PROGRAM)
            counts = torch.empty(nparts + 1, dtype=torch.int32, device=dev)
            _check_kernel[(nparts,)](
                inb, counts, ns, SBYTES=scale_bytes, B=CHECK_BLOCK, PER=CHECK_PER_PROGRAM,
                **_LAUNCH,
            )  # fmt: skip
        _hop_kernel[(grid,)](
            inb, loc, outf, outb, counts, n, full, last_cols, sb, nfp, nparts,
            MODE=int(mode), EL=CODES[element], Q=float(q), SBYTES=scale_bytes, S=S,
            BLOCK=block, SP=sp, RT=rt, CT=ct, RUNS=S == 1, CHECK=check,
            A4=_codes_aligned(sb, payload, out_payload), **_LAUNCH,
            **({} if interpreting() else _hop_options(mode, warps)),
        )  # fmt: skip
    return int(counts[nparts].item()) if check else 0


def _hop_options(mode: Mode, warps: int) -> dict[str, int]:
    """The hop kernel's warps, and in the fused hop its register cap."""
    if mode == Mode.DAR and HOP_MAXNREG is not None and register_caps():
        return {"num_warps": warps, "maxnreg": HOP_MAXNREG}
    return {"num_warps": warps}


#: (configuration, device) pairs whose kernels :func:`warm_up` compiled.
_warmed: set[tuple[Any, str]] = set()


def warm_up(codec: Any, device: torch.device) -> None:
    """Run every mode once through ``codec`` (an EQuARX codec whose kernels are
    these) on ``device``: a full minishard and a shorter last one, so that the
    variants a call runs are compiled (or loaded from Triton's cache). Once per
    process and configuration."""
    key = (codec.config, str(device))
    if key in _warmed:
        return
    from hopq.codecs.base import HopContext, LocalStats

    x = torch.zeros(min(codec.config.minishard, 1 << 22) + 1, device=device)
    plan = codec.plan(x, LocalStats())
    ctx = HopContext(0, 0, 0, 0, 0, 1)
    p = codec.encode(plan, x, ctx)
    codec.decode(plan, p, ctx, torch.empty_like(x))
    codec.decode_accumulate(plan, p, x.clone(), ctx)
    codec.decode_accumulate_encode(plan, p, x.clone(), ctx)
    _warmed.add(key)


def compile_all(arch: int = 90) -> list[str]:
    """Compile every kernel variant (each mode, element format and scale format;
    runs, strided segments and the short last segment; one pass and two) for a
    CUDA target (sm_<arch>) without a GPU (Triton's front end and the ptxas in
    its wheel) and check that divisions are the correctly rounded ones and no
    multiply-add was fused, nor can be. Needs TRITON_INTERPRET unset when this module is
    imported. Returns one line per variant."""
    if triton is None or interpreting():
        raise RuntimeError("compile_all needs triton and TRITON_INTERPRET=0 at import")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    out = []

    def build(fn: Any, sig: dict[str, str], const: dict[str, object], warps: int) -> None:
        names = list(sig)
        src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in const.items()})
        opts: dict[str, Any] = {"enable_fp_fusion": False, "num_warps": warps}
        mode = const.get("MODE")
        if fn is _hop_kernel and isinstance(mode, int):
            opts.update(_hop_options(Mode(mode), warps))
        ptx = triton.compile(src, target=target, options=opts).asm["ptx"]
        if "maxnreg" in opts and f".maxnreg {opts['maxnreg']}" not in ptx:
            raise AssertionError(f"{fn.__name__} {const}: the register cap is not in the PTX")
        # no fused multiply-add, and every float operation rounds on its own
        # (.rn: ptxas may not contract it)
        if (
            "div.full" in ptx
            or "div.approx" in ptx
            or "fma.rn.f32" in ptx
            or re.search(r"\b(mul|add|sub)\.f32", ptx)
        ):
            raise AssertionError(
                f"{fn.__name__} {const}: approximate division or fused multiply-add"
            )
        out.append(f"{fn.__name__} {const}: ok")

    names = ("MODE", "EL", "Q", "SBYTES", "S", "BLOCK", "SP", "RT", "CT", "RUNS")
    sig = {
        "inb": "*u8", "local": "*fp32", "outf": "*fp32", "outb": "*u8", "counts": "*i32",
        **dict.fromkeys(("n", "full", "last_cols", "sb", "nfp", "nparts"), "i32"),
        **dict.fromkeys((*names, "CHECK", "A4"), "constexpr"),
    }  # fmt: skip
    qs = (127.0, 448.0, 57344.0)
    # (columns, block): the paper's strided geometry, contiguous runs of 64, and
    # blocks longer than a tile (two passes); each with its short last segment
    shapes = ((1024, 64), (1, 64), (16, 1024), (1, 8192))
    for mode in Mode:
        for el in range(3):
            for sbytes in (2, 4):
                for s, block in shapes:
                    if (s, block) != shapes[0] and (el, sbytes) != (mode % 3, 2):
                        continue  # the other shapes once per mode, with varying elements
                    sp, rt, ct, warps = geometry(s, block, TILE, WARPS)
                    const: dict[str, object] = dict(
                        zip(names, (int(mode), el, qs[el], sbytes, s, block, sp, rt, ct, s == 1),
                            strict=True),
                        CHECK=mode != Mode.ENCODE,
                    )  # fmt: skip
                    build(_hop_kernel, sig, {**const, "A4": True}, warps)
                    if (s, block, el, sbytes) == (*shapes[0], 0, 2):
                        build(_hop_kernel, sig, {**const, "A4": False}, warps)  # codes off 4 bytes
    for sbytes in (2, 4):
        build(
            _check_kernel,
            {
                "inb": "*u8",
                "counts": "*i32",
                "ns": "i32",
                **dict.fromkeys(("SBYTES", "B", "PER"), "constexpr"),
            },
            {"SBYTES": sbytes, "B": CHECK_BLOCK, "PER": CHECK_PER_PROGRAM},
            4,
        )
    return out


__all__ = ["CODES", "available", "compile_all", "geometry", "run", "warm_up"]
