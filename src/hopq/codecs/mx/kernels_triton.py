"""MXFP8/6/4's Triton kernels: encode, decode (or accumulate) and the fused hop on
CUDA tensors, the same bits as :class:`hopq.codecs.mx.MXCodec`'s reference
(``tests/test_mx_triton.py`` holds them to it, and to the numba kernels'
protocol, :mod:`hopq.codecs.mx.kernels_cpu`).

One kernel, four modes (:class:`hopq.kernels.Mode`): ENCODE (values ->
payload, with the saturation count), DECODE, DECODE_ACC (values +=
decode(payload)) and DAR, the fused hop (decode the received partial sum, add
the local values, encode the sum without leaving registers; the local values
are read once and not written back, which the codec contract allows). It is
memory-bound: a program takes ``TILE`` consecutive values as ``[TILE / 4, 4]``
(four values per thread in a row: 16-byte loads and stores of the float32
values, and the four codes of a row packed in the thread that holds them), one
pass over the data. A row's codes take 4 bytes (FP8), 2 (FP4, two codes a
byte) or 3 (FP6: one 24-bit word, bitpack's layout). Blocks of a multiple of
4 values read one scale per row; other block sizes one per value (a cached
gather). Any block size packs: the payload of a chunk is one bit stream, so
blocks need not end on a byte as in the CPU kernels.

The arithmetic is the reference's: x / s * FMAX with ``tl.div_rn`` (correctly
rounded, as torch divides), magnitudes clamped to FMAX (NaN to FMAX), then
rounded half to even to the element format (ties to the even code, as the
reference's table search) without a table: a value in the format's normal
range by integer rounding of its float32 bits to M mantissa bits (a carry
moves into the exponent) and rebasing the exponent; a smaller one by one
float32 addition of a power of two whose ulp is the format's subnormal step.
Decoding places a code's fields in float32's and multiplies by 2^(127 - bias)
(exact; the format's subnormals come from float32 subnormals, and the sign bit
rides along, so -0.0 survives: compiled Triton lowers a negation to 0 - x);
E4M3's top code is NaN. Then v * s / FMAX, or v * (s / FMAX) where v * s
could overflow; in a tile whose scales keep v * s in range (all of them but
blocks of Inf, NaN or extreme scales) the division by FMAX is a multiplication
by its correctly rounded reciprocal and one fused multiply-add correction,
which is exact there (:func:`_div_fmax`). Kernels launch with fp fusion off
(no multiply-add contraction but the ones written). The saturation count is added on the device into a counter the
codec owns (one atomic per program that saw any), so a hop never waits for
the GPU. Compiled for sm_90 (:func:`compile_all`), the fused hop is about 50
instructions per value (FP8, FP4; 53 for FP6), encoding 33-37, decoding 17-19.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) they run on
CPU tensors; that is how CI checks them against the reference.
"""

from __future__ import annotations

import contextlib
import re
import threading
from functools import lru_cache
from typing import Any

import torch

from hopq.kernels import Mode, interpreting, register_caps
from hopq.numerics import fp_formats as fpf

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

_FLOAT_MAX = float(torch.finfo(torch.float32).max)
#: Values per program: 16 per thread on 4 warps (four 16-byte loads of float32
#: in flight per thread, enough to cover memory latency at full occupancy).
TILE = 2048
_WARPS = 4
#: Chunks are launched in pieces of at most this many values, so that every
#: offset in a kernel fits int32 (a piece starts on a block and a byte).
_PIECE = 1 << 30


def available() -> bool:
    return triton is not None


def supports(fmt: fpf.ElementFormat, block: int) -> bool:
    """Every block size: a chunk's codes are packed as one bit stream."""
    return True


if triton is not None:
    # globals a compiled kernel reads must be constexpr (the interpreter does not care)
    _ENCODE, _DECODE, _DECODE_ACC, _DAR = (
        tl.constexpr(int(v)) for v in (Mode.ENCODE, Mode.DECODE, Mode.DECODE_ACC, Mode.DAR)
    )

    @triton.jit
    def _codes(inb, pb, rows, cols, le, ok, mb, BITS: tl.constexpr, R: tl.constexpr):
        """The codes [R, 4] of the tile whose payload starts at inb + pb (mb of
        its bytes are the chunk's)."""
        if BITS == 8:
            c = tl.load(inb + pb + le, mask=ok, other=0).to(tl.int32)
        elif BITS == 4:
            bi = rows[:, None] * 2 + tl.arange(0, 2)[None, :]
            b = tl.load(inb + pb + bi, mask=bi < mb, other=0).to(tl.int32)
            c = tl.reshape(tl.join(b & 15, b >> 4), [R, 4])
        else:  # 6 bits: a row's four codes in three bytes, loaded one by one
            at = inb + pb + rows * 3
            w = tl.load(at, mask=rows * 3 < mb, other=0).to(tl.int32)
            w |= tl.load(at + 1, mask=rows * 3 + 1 < mb, other=0).to(tl.int32) << 8
            w |= tl.load(at + 2, mask=rows * 3 + 2 < mb, other=0).to(tl.int32) << 16
            c = (w[:, None] >> (cols * 6)[None, :]) & 63
        return c

    @triton.jit
    def _div_fmax(a, FMAX: tl.constexpr, RFMAX: tl.constexpr):
        """a / FMAX correctly rounded, given RFMAX = 1 / FMAX correctly rounded:
        one Markstein correction (the residual a - FMAX q is exact in one fused
        multiply-add, and q + r RFMAX rounds to the quotient; the sequence ptxas
        emits for div.rn by a constant, without its range check and branch).
        Exact where a is +-0 or 2^-100 <= |a| <= 2^110 (the residual then has
        no bits below the subnormals', the quotient is normal); the sign bit of
        a carries a zero's sign (q + r RFMAX would give +0 for -0). NaN in, NaN
        out. tests/test_mx_triton.py::test_division_by_fmax_by_reciprocal."""
        q = a * RFMAX
        r = tl.fma(q, -FMAX, a)
        d = tl.fma(r, RFMAX, q)
        sign = a.to(tl.uint32, bitcast=True) & 0x80000000
        return (d.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _decode_values(
        c, s,
        BITS: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr,
        SAFE: tl.constexpr, UP: tl.constexpr, NAN_TOP: tl.constexpr, RFMAX: tl.constexpr,
    ):  # fmt: skip
        """The values of codes c under scales s: v * s / FMAX, or v * (s / FMAX)
        where v * s could overflow float32 (the reference's two branches). A
        tile whose scales are all 0 or in [2^-90, 2^100] (every v * s then 0
        or in _div_fmax's range: the smallest nonzero element is 2^-9, the
        largest 448) divides by the reciprocal, others with tl.div_rn."""
        TOP: tl.constexpr = 1 << (BITS - 1)
        cu = c.to(tl.uint32)
        mc = cu & (TOP - 1)
        # the code's fields in float32's exponent and mantissa, its sign in the
        # sign bit: the float 2^(127 - bias) times smaller than the element (a
        # float32 subnormal for the element's subnormals), so that one exact
        # multiplication by UP = 2^(127 - bias) gives the element, +-0 included
        sign = (cu & TOP) << (32 - BITS)
        v = ((mc << (23 - MAN)) | sign).to(tl.float32, bitcast=True) * UP
        if NAN_TOP:  # the top magnitude code is NaN (the reference's -NaN for its sign)
            v = tl.where(mc == TOP - 1, (sign | 0x7FC00000).to(tl.float32, bitcast=True), v)
        fast = (s == 0.0) | ((s >= 8.077935669463161e-28) & (s <= 1.2676506002282294e30))
        if tl.min(tl.min(fast.to(tl.int32), axis=1), axis=0) == 1:
            val = _div_fmax(v * s, FMAX, RFMAX)
        else:
            val = tl.where(s <= SAFE, tl.div_rn(v * s, FMAX), v * tl.div_rn(s, FMAX))
        return val

    @triton.jit
    def _encode_values(
        x, s, BITS: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr,
        MIN_NORMAL: tl.constexpr, SUB_ADD: tl.constexpr,
    ):  # fmt: skip
        """(codes, saturated count) of values x under scales s."""
        v = tl.where(s > 0.0, tl.div_rn(x, s) * FMAX, x)
        a = tl.abs(v)
        sat = ((a > FMAX) & (a != float("inf"))).to(tl.int32)
        neg = (v < 0.0).to(tl.int32)
        a = tl.where(a <= FMAX, a, FMAX)  # NaN and beyond FMAX: FMAX
        ab = a.to(tl.int32, bitcast=True)
        # a normal element: float32's exponent and mantissa rounded half to even
        # to M bits on the integers (a carry moves into the exponent), the
        # exponent rebased from 127 to the format's bias
        SH: tl.constexpr = 23 - MAN
        up = ab + ((1 << (SH - 1)) - 1) + ((ab >> SH) & 1)
        normal = (up >> SH) - ((127 - BIAS) << MAN)
        # a subnormal one (a < 2^(1 - bias)): a + SUB_ADD, whose ulp is the
        # format's subnormal step, rounds a half to even to a multiple of it
        SUB_BITS: tl.constexpr = (151 - BIAS - MAN) << 23  # SUB_ADD's bits
        sub = (a + SUB_ADD).to(tl.int32, bitcast=True) - SUB_BITS
        code = tl.where(a < MIN_NORMAL, sub, normal) | (neg << (BITS - 1))
        return code, tl.sum(sat)

    @triton.jit
    def _mx_kernel(
        inb, local, outf, outb, scale, sat, n,
        MODE: tl.constexpr, BITS: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
        FMAX: tl.constexpr, SAFE: tl.constexpr, UP: tl.constexpr, MIN_NORMAL: tl.constexpr,
        SUB_ADD: tl.constexpr, NAN_TOP: tl.constexpr, RFMAX: tl.constexpr, B: tl.constexpr,
        TILE: tl.constexpr,
    ):  # fmt: skip
        R: tl.constexpr = TILE // 4
        base = tl.program_id(0) * TILE
        rows = tl.arange(0, R)
        cols = tl.arange(0, 4)
        le = rows[:, None] * 4 + cols[None, :]  # [R, 4], this tile's values
        m = n - base  # values of the chunk from this tile's start
        ok = le < m
        mb = (tl.minimum(m, TILE) * BITS + 7) // 8  # and the tile's payload bytes
        pb = base // 8 * BITS
        # the scales (a masked-off value's: 1, any finite one would do)
        sp = scale + base // B
        r0 = base % B
        if B % 4 == 0:  # a row in one block
            s = tl.load(sp + (r0 + rows * 4) // B, mask=rows * 4 < m, other=1.0)[:, None]
        else:
            s = tl.load(sp + (r0 + le) // B, mask=ok, other=1.0)
        if MODE != _ENCODE:
            c = _codes(inb, pb, rows, cols, le, ok, mb, BITS, R)
            val = _decode_values(c, s, BITS, MAN, BIAS, FMAX, SAFE, UP, NAN_TOP, RFMAX)
        if MODE == _DECODE:
            tl.store(outf + base + le, val, mask=ok)
        elif MODE == _DECODE_ACC:
            acc = tl.load(local + base + le, mask=ok, other=0.0)
            tl.store(outf + base + le, acc + val, mask=ok)
        else:
            x = tl.load(local + base + le, mask=ok, other=0.0)
            if MODE == _DAR:
                x = x + val
            code, cnt = _encode_values(x, s, BITS, MAN, BIAS, FMAX, MIN_NORMAL, SUB_ADD)
            if BITS == 8:
                tl.store(outb + pb + le, code.to(tl.uint8), mask=ok)
            elif BITS == 4:
                pair = tl.reshape(code, [R, 2, 2])
                byte = tl.sum(pair << (tl.arange(0, 2) * 4)[None, None, :], axis=2)
                bi = rows[:, None] * 2 + tl.arange(0, 2)[None, :]
                tl.store(outb + pb + bi, byte.to(tl.uint8), mask=bi < mb)
            else:  # a row's 24-bit word, stored byte by byte
                w = tl.sum(code << (cols * 6)[None, :], axis=1)
                at = outb + pb + rows * 3
                tl.store(at, (w & 0xFF).to(tl.uint8), mask=rows * 3 < mb)
                tl.store(at + 1, ((w >> 8) & 0xFF).to(tl.uint8), mask=rows * 3 + 1 < mb)
                tl.store(at + 2, (w >> 16).to(tl.uint8), mask=rows * 3 + 2 < mb)
            tl.atomic_add(sat, cnt.to(tl.int64), mask=cnt > 0)


_LAUNCH = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": _WARPS}
#: Registers per thread the fused hop may take (None: ptxas's choice). Left to
#: itself ptxas gives MXFP6's hop 78 and MXFP4's 72, which allows 6-7 programs
#: per SM; at 56 (no spills) eight fit. On an H200 (`hopq bench kernels`, 256M
#: values, the same bits) MXFP6's hop went from 0.700 to 0.608 ms and MXFP4's
#: from 0.620 to 0.582 ms; MXFP8's (61 registers, 56 under the cap) stayed at
#: 0.58 ms. At 40 the hops spill. Read at every call, so that a GPU run may
#: sweep it.
HOP_MAXNREG: int | None = 56


def _options(mode: Mode) -> dict[str, Any]:
    """The launch options of ``mode``'s kernel (none under the interpreter)."""
    if interpreting():
        return {}
    if mode == Mode.DAR and HOP_MAXNREG is not None and register_caps():
        return {**_LAUNCH, "maxnreg": HOP_MAXNREG}
    return _LAUNCH


#: The interpreter patches triton.language while a kernel runs: not thread-safe
#: (the simulator runs ranks in threads), so launches take turns there.
_INTERPRETER_LOCK = threading.Lock() if interpreting() else contextlib.nullcontext()


@lru_cache(maxsize=8)
def _consts(fmt: fpf.ElementFormat) -> dict[str, Any]:
    """The format's compile-time constants. SAFE is float32's FLT_MAX / FMAX as
    the reference compares it (torch rounds the Python float to float32); UP
    scales a code's fields placed in float32's to the element's value;
    SUB_ADD is the float32 power of two whose ulp is the format's subnormal
    step; RFMAX is 1 / FMAX correctly rounded."""
    safe = float(torch.tensor(_FLOAT_MAX / fmt.max, dtype=torch.float32))
    return {
        "BITS": fmt.bits,
        "MAN": fmt.man_bits,
        "BIAS": fmt.bias,
        "FMAX": float(fmt.max),
        "SAFE": safe,
        "UP": 2.0 ** (127 - fmt.bias),
        "MIN_NORMAL": 2.0 ** (1 - fmt.bias),
        "SUB_ADD": 2.0 ** (24 - fmt.bias - fmt.man_bits),
        "NAN_TOP": bool(fmt.nan_top),
        "RFMAX": float(torch.tensor(1.0) / torch.tensor(float(fmt.max))),
    }


@lru_cache(maxsize=16)
def _dummies(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the pointers a mode does not use."""
    return (
        torch.empty(1, dtype=torch.uint8, device=device),
        torch.empty(1, dtype=torch.float32, device=device),
    )


def new_counter(device: torch.device | str) -> torch.Tensor:
    """A saturation counter for :func:`encode` and :func:`hop` (int64, zero)."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def _run(
    mode: Mode,
    fmt: fpf.ElementFormat,
    block: int,
    n: int,
    scale: torch.Tensor,
    *,
    inb: torch.Tensor | None = None,
    local: torch.Tensor | None = None,
    outf: torch.Tensor | None = None,
    outb: torch.Tensor | None = None,
    sat: torch.Tensor | None = None,
) -> None:
    if n == 0:
        return
    dev = str(scale.device)
    dummy_b, dummy_f = _dummies(dev)
    if sat is None:
        sat = torch.empty(1, dtype=torch.int64, device=dev)  # the decode modes add nothing
    bits = fmt.bits
    # a piece starts on a block, a tile and a byte: its offsets into every tensor
    # are whole numbers
    step = max(1, _PIECE // (block * TILE)) * block * TILE
    const = _consts(fmt)
    ins = dummy_b if inb is None else inb
    loc = dummy_f if local is None else local
    outs = dummy_f if outf is None else outf
    outp = dummy_b if outb is None else outb
    with _INTERPRETER_LOCK:
        for lo in range(0, n, step):
            m = min(n, lo + step) - lo
            args: tuple[Any, ...] = (ins, loc, outs, outp, scale, sat, m)
            if n > step:  # views of the piece (one piece, the common case: none)
                p0, p1 = lo * bits // 8, (lo + m) * bits // 8 + 1
                args = (
                    ins if inb is None else inb[p0:p1],
                    loc if local is None else local[lo : lo + m],
                    outs if outf is None else outf[lo : lo + m],
                    outp if outb is None else outb[p0:p1],
                    scale[lo // block :],
                    sat,
                    m,
                )
            _mx_kernel[(triton.cdiv(m, TILE),)](
                *args, MODE=int(mode), B=block, TILE=TILE, **const, **_options(mode)
            )


def encode(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: fpf.ElementFormat,
    block: int,
    counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """(payload, saturated count) of the contiguous float32 chunk x, whose
    blocks' scales are ``scale``. With ``counter`` (:func:`new_counter`) the
    count is added into it on the device and 0 returned; without, it comes
    back as a one-element tensor (no wait for the device either way)."""
    n = x.numel()
    out = torch.empty((n * fmt.bits + 7) // 8, dtype=torch.uint8, device=x.device)
    sat = counter if counter is not None else new_counter(x.device)
    _run(Mode.ENCODE, fmt, block, n, scale, local=x.reshape(-1), outb=out, sat=sat)
    return out, (0 if counter is not None else sat)


def decode(
    payload: torch.Tensor,
    scale: torch.Tensor,
    fmt: fpf.ElementFormat,
    block: int,
    out: torch.Tensor,
    acc: bool,
) -> None:
    """out (contiguous float32) = the payload's values, or += with ``acc``."""
    flat = out.reshape(-1)
    mode = Mode.DECODE_ACC if acc else Mode.DECODE
    _run(mode, fmt, block, out.numel(), scale, inb=payload, local=flat, outf=flat)


def hop(
    payload: torch.Tensor,
    local: torch.Tensor,
    scale: torch.Tensor,
    fmt: fpf.ElementFormat,
    block: int,
    counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """The fused hop: the payload of local (contiguous float32, not modified) +
    decode(payload), and the saturated count as :func:`encode` returns it."""
    n = local.numel()
    out = torch.empty((n * fmt.bits + 7) // 8, dtype=torch.uint8, device=local.device)
    sat = counter if counter is not None else new_counter(local.device)
    _run(Mode.DAR, fmt, block, n, scale, inb=payload, local=local.reshape(-1), outb=out, sat=sat)
    return out, (0 if counter is not None else sat)


#: (format, block, device) whose kernels :func:`warm_up` compiled in this process.
_warm: set[tuple[str, int, str]] = set()
_WARM_LOCK = threading.Lock()


def warm_up(fmt: fpf.ElementFormat, block: int, device: torch.device) -> None:
    """Compile (or load from Triton's disk cache) the four modes' kernels for
    ``fmt`` and ``block`` on ``device`` before a call's timeout starts, on
    chunks of whole blocks of a multiple of 16 values, as the codec's are
    (another length specializes again: about a second per variant on an
    H100 host, once per process, the disk cache keeps them). Once per
    process; later calls return at once."""
    key = (fmt.name, block, str(device))
    if key in _warm:
        return
    with _WARM_LOCK:
        if key in _warm:
            return
        n = 16 * block
        x = torch.zeros(n, dtype=torch.float32, device=device)
        scale = torch.ones(1, dtype=torch.float32, device=device).expand(1 + n // block)
        scale = scale.contiguous()
        counter = new_counter(device)
        payload, _ = encode(x, scale, fmt, block, counter)
        decode(payload, scale, fmt, block, x, False)
        decode(payload, scale, fmt, block, x, True)
        hop(payload, x, scale, fmt, block, counter)
        _warm.add(key)


#: The block sizes compile_all builds: the OCP block (a scale per row) and one
#: that is not a multiple of 4 (a scale per value).
_COMPILE_BLOCKS = (32, 6)


def compile_all(arch: int = 90) -> list[str]:
    """Compile every kernel variant for a CUDA target (sm_<arch>) without a GPU
    (Triton's front end and the ptxas in its wheel) and check that divisions are
    the correctly rounded ones and no multiply-add was fused but those written
    (tl.fma). Catches what the
    interpreter lets through (it runs the Python directly). Needs
    TRITON_INTERPRET unset when this module is imported. Returns one line per
    variant."""
    if triton is None or interpreting():
        raise RuntimeError("compile_all needs triton and TRITON_INTERPRET=0 at import")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    sig = {
        "inb": "*u8", "local": "*fp32", "outf": "*fp32", "outb": "*u8", "scale": "*fp32",
        "sat": "*i64", "n": "i32",
        **dict.fromkeys(
            (
                "MODE", "BITS", "MAN", "BIAS", "FMAX", "SAFE", "UP", "MIN_NORMAL", "SUB_ADD",
                "NAN_TOP", "RFMAX", "B", "TILE",
            ),
            "constexpr",
        ),
    }  # fmt: skip
    names = list(sig)
    out = []
    for fmt in (fpf.E4M3, fpf.E3M2, fpf.E2M1):
        for mode in Mode:
            for block in _COMPILE_BLOCKS:
                const = {"MODE": int(mode), **_consts(fmt), "B": block, "TILE": TILE}
                src = ASTSource(
                    _mx_kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}
                )
                opts = _options(mode)  # what a launch takes, the fused hop's cap included
                ptx = triton.compile(src, target=target, options=opts).asm["ptx"]
                what = f"_mx_kernel {fmt.name} {mode.name} block {block}"
                if "maxnreg" in opts and f".maxnreg {HOP_MAXNREG}" not in ptx:
                    raise AssertionError(f"{what}: the register cap is not in the PTX")
                # every float operation rounds on its own (.rn: ptxas may not
                # contract it), the fused multiply-adds are the ones written
                if (
                    "div.full" in ptx
                    or "div.approx" in ptx
                    or re.search(r"\b(mul|add|sub)\.f32", ptx)
                ):
                    raise AssertionError(f"{what}: approximate division or contractible arithmetic")
                if mode in (Mode.ENCODE, Mode.DAR) and "div.rn.f32" not in ptx:
                    raise AssertionError(f"{what}: no correctly rounded division")
                out.append(f"{what}: ok")
    return out
