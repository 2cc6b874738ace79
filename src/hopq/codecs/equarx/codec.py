"""EQuARX: dynamic block-wise quantization of every hop (Ahmed et al., "EQuARX:
Efficient Quantized AllReduce in XLA", sections III-A, III-B and IV).

Whatever a hop is about to send (a leaf's own chunk, an inner node's partial
sum, the sink's final sum) is quantized with scales computed from that very
data: per block, the absolute maximum A of its finite entries, and every entry
becomes round(x / A * Q) in the element format (int8: Q = 127; FP8 E4M3 /
E5M2: Q = the format's largest value). The receiver dequantizes to float32,
adds its own float32 chunk, and quantizes the sum again: nothing is added in
low precision. No statistics are exchanged; every payload carries its scales,
first (the paper sends them before the microshards).

Block geometry (``layout``):

* ``strided`` (the paper's): a chunk is cut into minishards of
  ``scales * block`` entries (the last one shorter); a minishard is a run of
  tiles of ``scales`` = 1024 = 8x128 entries and scale k covers entry k of
  every tile, i.e. entries k, k + 1024, k + 2048, ... (blocks of ``block``
  entries strided across the tiles). The paper's minishard count m follows
  from the block size: m = ceil(shard / (1024 block)). A shorter last minishard
  of r entries gets min(1024, ceil(r / block)) scales, so no block ever has
  more than ``block`` entries.
* ``contiguous``: runs of ``block`` consecutive entries share a scale.

Geometry is relative to the start of a schedule chunk, and the engine's
microshards of a chunk are cut at minishard boundaries, so the bits do not
depend on the number of microshards.

hopq's choices, where the paper says nothing (section IV leaves them open):

* **Scale format** ``bf16`` by default: the absolute maximum rounded *up* to
  bfloat16 (16 bits: 8.25 bits per coordinate at block 64). Rounding up keeps
  |x| <= A, so no entry ever clips; the price is a step at most 2^-7 larger
  than the exact absmax would give. ``fp32`` stores the exact absmax (8.5
  bits per coordinate at block 64); docs/codecs/equarx.md measures both.
  ``none`` is the naive FP8 cast of Fig. 7 (no scale at all; FP8 elements only):
  finite values beyond the format's range saturate at its largest value.
* **Clamp range** int8 codes are symmetric, -127..127; the spare code -128 marks
  a non-finite entry (decoded as NaN). FP8 elements use their own NaN (E4M3)
  and Inf/NaN (E5M2) codes. So NaN and Inf stay exactly where they were
  (``nonfinite_block`` = 1), while the block's scale comes from its finite
  entries and its other entries are coded as usual.
* **Rounding** to nearest, ties to even (deterministic; the paper never
  mentions stochastic rounding). Per hop the error of an entry is at most
  A/254 for int8, A 2^-4 for E4M3, A 2^-3 for E5M2 (A <= (1 + 2^-7) absmax).
* **Zero block** (A = 0): scale 0 and all codes 0, decoded as exact zeros.
* **Finite in, finite out**: a finite absmax beyond the largest bfloat16
  (3.39e38) saturates the scale there (entries beyond it clip to +-127 codes);
  a decoded value is clamped to the float32 range, and so is a partial sum of
  two finite terms (a decoded partial sum and the local chunk) that overflows:
  with a sum of magnitudes just below float32's maximum, the quantization
  error of a hop could otherwise carry it past the range into Inf, which the
  next hop codes as non-finite (NaN).

A payload whose scales are negative, NaN or Inf, or whose size differs from the
plan's, raises :class:`hopq.PayloadError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any, ClassVar

import torch

from hopq.codecs.base import (
    Codec,
    CodecConfig,
    HopContext,
    Plan,
    ReduceOp,
    StatsExchange,
    check_bounds,
    check_payload,
    even_chunks,
    split_parts,
    view_as_dtype,
)
from hopq.codecs.registry import register
from hopq.codecs.uncompressed import working_copy
from hopq.errors import PayloadError
from hopq.kernels import Mode, resolve
from hopq.numerics import fp_formats as fpf
from hopq.numerics.div import div, div_
from hopq.options import changed_options, check_options, option

_FLOAT_MAX = float(torch.finfo(torch.float32).max)
#: int8 codes are symmetric; -128 marks a non-finite entry.
_INT8_MAX = 127
_INT8_NONFINITE = -128


class Element(str, Enum):
    INT8 = "int8"  # every result the paper reports
    E4M3 = "e4m3"
    E5M2 = "e5m2"


class Layout(str, Enum):
    STRIDED = "strided"  # the paper's: scale k covers entry k of every 8x128 tile
    CONTIGUOUS = "contiguous"  # runs of `block` consecutive entries


class Backend(str, Enum):
    #: The first available kernel backend for the tensor's device (:mod:`hopq.kernels`):
    #: Triton on CUDA, numba on CPU; else the reference.
    AUTO = "auto"
    REFERENCE = "reference"
    #: hopq.codecs.equarx.kernels_triton (CUDA tensors; on CPU only under TRITON_INTERPRET=1).
    TRITON = "triton"
    #: hopq.codecs.equarx.kernels_cpu (CPU tensors, numba).
    CPU = "cpu"


class ScaleFormat(str, Enum):
    BF16 = "bf16"  # absmax rounded up to bfloat16
    FP32 = "fp32"  # exact absmax
    NONE = "none"  # the naive FP8 cast (Fig. 7's baseline): no scale


_ELEMENT_DTYPE = {
    Element.INT8: torch.int8,
    Element.E4M3: torch.float8_e4m3fn,
    Element.E5M2: torch.float8_e5m2,
}
#: The element format's largest finite value, Q in x / A * Q.
_QMAX = {Element.INT8: 127.0, Element.E4M3: fpf.E4M3.max, Element.E5M2: 57344.0}
#: Worst rounding error of one entry as a share of its block's scale A (round to
#: nearest: half a step; FP8: half an ulp of the top binade relative to Q).
_REL_STEP = {Element.INT8: 1 / 254, Element.E4M3: 2.0**-4, Element.E5M2: 2.0**-3}
_SCALE_BYTES = {ScaleFormat.BF16: 2, ScaleFormat.FP32: 4, ScaleFormat.NONE: 0}


@dataclass(frozen=True)
class EQuARXConfig(CodecConfig):
    element: Element = option(Element.INT8, "element format")
    layout: Layout = option(Layout.STRIDED, "block geometry: the paper's strided blocks or runs")
    #: Fig. 7's block size.
    block: int = option(64, "entries per scale", lo=1, hi=1 << 20)
    #: 8x128: the TPU register tile the paper's scales follow (section III-B).
    scales: int = option(
        1024, "scales per minishard (strided layout): the tile size", lo=1, hi=1 << 16
    )
    scale: ScaleFormat = option(ScaleFormat.BF16, "scale format ('none': naive FP8 cast)")
    backend: Backend = option(
        Backend.AUTO,
        "implementation of encode and decode (same bits; the naive cast runs the reference)",
        choices=Backend,
    )

    def __post_init__(self) -> None:
        check_options(self, "equarx")
        if self.scale is ScaleFormat.NONE and self.element is Element.INT8:
            raise ValueError("equarx: scale 'none' (the naive cast) needs an FP8 element")
        if self.layout is Layout.CONTIGUOUS and "scales" in changed_options(self):
            raise ValueError(
                "equarx: scales sets the strided layout's tile; contiguous blocks "
                "(layout 'contiguous') have one scale per block and would ignore it"
            )
        if self.scale is ScaleFormat.NONE and self.backend in (Backend.CPU, Backend.TRITON):
            raise ValueError(
                f"equarx: the naive cast (scale 'none') has no {self.backend.value.upper()} "
                "kernel, only the reference: use backend 'auto' or 'reference'"
            )

    @property
    def minishard(self) -> int:
        """Entries per minishard (strided) or per block (contiguous)."""
        return self.block * self.scales if self.layout is Layout.STRIDED else self.block

    @property
    def per_minishard(self) -> int:
        return self.scales if self.layout is Layout.STRIDED else 1

    def n_scales(self, n: int) -> int:
        """Scales of a part of n entries."""
        if self.scale is ScaleFormat.NONE:
            return 0
        full, rest = divmod(n, self.minishard)
        return full * self.per_minishard + (min(self.per_minishard, -(-rest // self.block)))

    def payload_nbytes(self, n: int) -> int:
        return self.n_scales(n) * _SCALE_BYTES[self.scale] + n


def equarx_chunks(
    numel: int, n_chunks: int, microshards: int, align: int
) -> tuple[tuple[int, int], ...]:
    """Schedule chunks as :func:`even_chunks` (independent of the microshards), each
    cut into ``microshards`` parts at multiples of ``align`` (a minishard) from the
    chunk's start, so every part starts a minishard."""
    out: list[tuple[int, int]] = []
    for s, e in even_chunks(numel, n_chunks):
        out += [(s + a, s + b) for a, b in even_chunks(e - s, microshards, align)]
    return tuple(out)


class EQuARXCodec(Codec[Plan]):
    """Shared implementation; the registered variants differ in their defaults."""

    config_class = EQuARXConfig
    config: EQuARXConfig
    layout_preserving: ClassVar[bool] = True
    chunk_local: ClassVar[bool] = True
    plans_ahead: ClassVar[bool] = True
    gather_stage: ClassVar[bool] = True

    # -- plan ----------------------------------------------------------------
    def _plan(self, work_numel: int, chunks: tuple[tuple[int, int], ...]) -> Plan:
        cfg = self.config
        return Plan(
            work_numel, work_numel, chunks, tuple(cfg.payload_nbytes(e - s) for s, e in chunks)
        )

    def plan(self, x: torch.Tensor, stats: StatsExchange) -> Plan:
        b = check_bounds(stats, x.numel())
        chunks = (
            equarx_chunks(x.numel(), stats.n_chunks, stats.microshards, self.config.minishard)
            if b is None
            else split_parts(b, stats.microshards, self.config.minishard)
        )
        return self._plan(x.numel(), chunks)

    def plan_gather(self, work_numel: int, chunks: tuple[tuple[int, int], ...]) -> Plan:
        """Coding another codec's all-gather: blocks start at each part's start (so
        here the bits follow that codec's microshard cuts)."""
        return self._plan(work_numel, chunks)

    def prepare(self, plan: Plan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        return working_copy(x, overwrite)

    def finish(self, plan: Plan, y: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
        return div_(y, world_size) if op is ReduceOp.AVG else y

    # -- kernels -------------------------------------------------------------
    def kernels(self, device: torch.device) -> Any:
        """The kernel module on ``device`` (:mod:`hopq.codecs.equarx.kernels_triton` for
        CUDA tensors, :mod:`hopq.codecs.equarx.kernels_cpu` for CPU ones), or None for
        the reference (the naive cast, no triton or numba)."""
        cfg = self.config
        if cfg.scale is ScaleFormat.NONE:
            return None
        return _resolve(cfg.backend.value, device.type)

    def warm_up(self, device: torch.device) -> None:
        """Compile the Triton kernels calls on ``device`` run (a second or so each on
        first use), once per process and configuration, before a call's timeout
        starts (:meth:`Codec.warm_up <hopq.codecs.base.Codec.warm_up>`). The numba
        kernel compiles on first use and is cached on disk."""
        warm = getattr(self.kernels(device), "warm_up", None)
        if device.type == "cuda" and warm is not None:
            warm(self, device)

    def _kernel(self, mode: Mode, n: int, device: torch.device, **tensors: Any) -> int | None:
        """Run the kernel on a part of ``n`` entries, or None where the reference must
        (no kernel, or a tensor that is not contiguous float32)."""
        k = self.kernels(device)
        if k is None or any(
            t is not None and not (t.is_contiguous() and t.dtype in (torch.float32, torch.uint8))
            for t in tensors.values()
        ):
            return None
        cfg = self.config
        return int(
            k.run(
                mode,
                n,
                cfg.minishard,
                cfg.per_minishard,
                cfg.block,
                _SCALE_BYTES[cfg.scale],
                element=_ELEMENT_DTYPE[cfg.element],
                q=_QMAX[cfg.element],
                **tensors,
            )
        )

    def _check_decoded(self, plan: Plan, payload: torch.Tensor, n: int, ctx: HopContext) -> None:
        check_payload(payload, plan.payload_nbytes[ctx.chunk], f"{self.name} part {ctx.chunk}")
        if self.config.payload_nbytes(n) != payload.numel():
            raise PayloadError(f"{self.name}: payload of {payload.numel()} bytes for {n} entries")

    def _bad_scales(self, bad: int | None) -> bool:
        """Whether the kernel ran (raises for invalid scales, as the reference)."""
        if bad:
            raise PayloadError(f"{self.name}: a scale is negative, NaN or Inf ({bad} of them)")
        return bad is not None

    def decode_accumulate(
        self, plan: Plan, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        self._check_decoded(plan, payload, acc.numel(), ctx)
        bad = self._kernel(
            Mode.DECODE_ACC, acc.numel(), acc.device, payload=payload.contiguous(), local=acc
        )
        if not self._bad_scales(bad):
            tmp = torch.empty_like(acc)
            self.decode(plan, payload, ctx, tmp)
            add_saturating(acc, tmp)

    def decode_accumulate_encode(
        self, plan: Plan, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        n = local.numel()
        self._check_decoded(plan, payload, n, ctx)
        out = torch.empty(self.config.payload_nbytes(n), dtype=torch.uint8, device=local.device)
        bad = self._kernel(
            Mode.DAR, n, local.device, payload=payload.contiguous(), local=local, out_payload=out
        )
        if self._bad_scales(bad):
            return out
        return super().decode_accumulate_encode(plan, payload, local, ctx)

    # -- geometry ------------------------------------------------------------
    def _views(self, v: torch.Tensor) -> list[torch.Tensor]:
        """``v`` (one part, any dtype) as 3-D blocks (segments, rows, scales):
        scale k of a segment covers column k. Full minishards are a view; the
        short last one is a zero-padded copy."""
        cfg = self.config
        n, M, S = v.numel(), cfg.minishard, cfg.per_minishard
        full, rest = divmod(n, M)
        out = []
        if full:
            out.append(v[: full * M].view(full, M // S, S))
        if rest:
            s2 = min(S, -(-rest // cfg.block))
            rows = -(-rest // s2)
            pad = v.new_zeros(rows * s2)
            pad[:rest] = v[full * M :]
            out.append(pad.view(1, rows, s2))
        return out

    # -- encode --------------------------------------------------------------
    def _quantize(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Entries ``x`` with scales ``a`` (broadcast) -> element codes."""
        el = self.config.element
        q = _QMAX[el]
        finite = torch.isfinite(x)
        if self.config.scale is ScaleFormat.NONE:
            v = x
        else:
            v = torch.where(a > 0, x / a * q, torch.zeros_like(x))
        if el is Element.INT8:
            codes = torch.round(v).clamp_(-_INT8_MAX, _INT8_MAX)
            codes = torch.where(finite, codes, torch.full_like(codes, _INT8_NONFINITE))
            return codes.to(torch.int8)
        v = torch.where(finite, v.clamp(-q, q), x)  # finite saturates, NaN/Inf stay
        out = v.to(_ELEMENT_DTYPE[el])
        return _e4m3_nan(out, x) if el is Element.E4M3 else out

    def encode(self, plan: Plan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        cfg = self.config
        n = chunk.numel()
        if cfg.scale is ScaleFormat.NONE:
            return self._quantize(chunk, chunk).view(torch.uint8).reshape(-1)
        if chunk.dtype == torch.float32:
            out = torch.empty(cfg.payload_nbytes(n), dtype=torch.uint8, device=chunk.device)
            if self._kernel(Mode.ENCODE, n, chunk.device, local=chunk, out_payload=out) is not None:
                return out
        scales: list[torch.Tensor] = []
        codes: list[torch.Tensor] = []
        for blk in self._views(chunk):
            finite_abs = torch.where(torch.isfinite(blk), blk.abs(), torch.zeros_like(blk))
            amax = finite_abs.amax(1, keepdim=True)  # (segments, 1, scales)
            if cfg.scale is ScaleFormat.BF16:
                wire = fpf.round_up_bf16(amax, saturate=True)
                a = wire.float()
            else:
                wire = a = amax
            scales.append(wire.reshape(-1))
            codes.append(self._quantize(blk, a).reshape(-1))
        if not codes:
            return torch.empty(0, dtype=torch.uint8, device=chunk.device)
        code_bytes = torch.cat([c.view(torch.uint8) for c in codes])[:n]
        scale_bytes = torch.cat([s.contiguous().view(torch.uint8) for s in scales])
        return torch.cat([scale_bytes, code_bytes])

    # -- decode --------------------------------------------------------------
    def _dequantize(self, codes: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
        el = self.config.element
        if el is Element.INT8:
            v = codes.float()
            v = torch.where(codes == _INT8_NONFINITE, torch.full_like(v, float("nan")), v)
        else:
            v = codes.float()
        if a is None:
            return v
        # a finite code may round just past the float32 range: clamp it (an
        # E5M2 Inf code stays Inf)
        out = (v * div(a, _QMAX[el])).clamp_(-_FLOAT_MAX, _FLOAT_MAX)
        return out if el is not Element.E5M2 else torch.where(torch.isinf(v), v, out)

    def decode(self, plan: Plan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor) -> None:
        cfg = self.config
        n = out.numel()
        self._check_decoded(plan, payload, n, ctx)
        if out.dtype == torch.float32 and self._bad_scales(
            self._kernel(Mode.DECODE, n, out.device, payload=payload.contiguous(), out_rows=out)
        ):
            return
        dtype = _ELEMENT_DTYPE[cfg.element]
        ns = cfg.n_scales(n)
        sb = ns * _SCALE_BYTES[cfg.scale]
        codes = payload[sb:].view(dtype)
        if cfg.scale is ScaleFormat.NONE:
            out.copy_(self._dequantize(codes, None))
            return
        wire = view_as_dtype(
            payload[:sb], torch.bfloat16 if cfg.scale is ScaleFormat.BF16 else torch.float32
        )
        scales = wire.float()
        if bool(((scales < 0) | ~torch.isfinite(scales) | torch.signbit(scales)).any()):
            raise PayloadError(f"{self.name}: a scale is negative, NaN or Inf")
        # decode block by block, in the encoder's geometry (views of `out` where whole)
        pos = spos = 0
        full, rest = divmod(n, cfg.minishard)
        S = cfg.per_minishard
        if full:
            m = full * cfg.minishard
            a = scales[: full * S].view(full, 1, S)
            blk = codes[:m].view(full, cfg.minishard // S, S)
            out[:m].view(full, cfg.minishard // S, S).copy_(self._dequantize(blk, a))
            pos, spos = m, full * S
        if rest:
            s2 = ns - spos
            rows = -(-rest // s2)
            pad = codes.new_zeros(rows * s2)
            pad[:rest] = codes[pos:]
            a = scales[spos:].view(1, s2)
            out[pos:].copy_(self._dequantize(pad.view(rows, s2), a).reshape(-1)[:rest])

    # -- guarantees ----------------------------------------------------------
    def error_bound(
        self, abs_sum: torch.Tensor, chain: int, adds: int | None = None
    ) -> torch.Tensor | None:
        """Per hop an entry moves by at most _REL_STEP x its block's scale A, with
        A <= (1 + 2^-7) x the block's absmax (bfloat16 rounded up), and the absmax
        of a partial sum is at most max(sum |x_i|) plus the error so far; float32
        accumulation adds 2^-24 of the partial sum per hop, and per addition in a
        row beyond one a hop (``adds`` > ``chain``: the direct schedule's sinks).
        The geometry is the plan's, so the bound uses the global maximum."""
        if self.config.scale is ScaleFormat.NONE:
            return None  # saturation beyond the FP8 range makes it data-dependent
        top = float(abs_sum.max()) if abs_sum.numel() else 0.0
        rel = _REL_STEP[self.config.element]
        err = 0.0
        for _ in range(chain):
            amax = (top + err) * (1 + 2.0**-7)
            err += rel * amax * (1 + 2.0**-20) + 2.0**-23 * (top + err) + 1e-37
        if adds is not None and adds > chain:
            err += (adds - chain) * 2.0**-23 * (top + err)
        return torch.full_like(abs_sum, err)


def add_saturating(acc: torch.Tensor, v: torch.Tensor) -> None:
    """``acc += v``, where two finite terms whose sum overflows saturate at
    +-float32's maximum: a partial sum whose exact value is finite may exceed the
    range by its quantization error, and an Inf there would come out as NaN (the
    int8 code of a non-finite entry). NaN and Inf terms keep their sum. The
    kernels' ``_acc`` does the same per entry."""
    s = acc + v
    over = torch.isinf(s)
    if bool(over.any()):
        over &= torch.isfinite(acc) & torch.isfinite(v)
        s = torch.where(over, s.clamp(-_FLOAT_MAX, _FLOAT_MAX), s)
    acc.copy_(s)


@lru_cache(maxsize=8)
def _resolve(choice: str, device_type: str) -> Any:
    return resolve("equarx", choice, device_type)


def _e4m3_nan(codes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """E4M3fn has no Inf (torch's cast saturates it): NaN for every non-finite entry."""
    nan = torch.tensor(float("nan"), dtype=torch.float32, device=x.device).to(codes.dtype)
    return torch.where(torch.isfinite(x), codes, nan)


@register(
    "equarx",
    "EQuARX: int8 block-wise quantization of every hop, 1024 strided scales per minishard",
)
class EQuARX(EQuARXCodec):
    pass
