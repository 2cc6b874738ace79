"""Microscaling formats MXFP8 / MXFP6 / MXFP4 for multi-hop all-reduce.

Elements E4M3, E3M2 and E2M1 (OCP MX v1.0) in blocks of 32 sharing one scale.
The MX spec defines no summation, so, like the DynamiQ paper (appendix C), we
follow FP8-LM's method: per block j the ranks agree on the global maximum
gm_j = max_i max|g_ij| (a max all-reduce in the statistics exchange) and on a
factor mu, the scale is s_j = mu * gm_j (bfloat16 rounded up, or the OCP
power-of-two E8M0 scale), and every hop encodes its partial sum p as
p / s_j * FMAX in the element format (FMAX its largest value), saturating
beyond it. The scale never travels with the payload, which holds the elements
only. mu starts at n (so the full sum fits) and adapts across rounds from the
overflow ratio measured in the previous round, summed over every hop of every
rank: above ``overflow_threshold`` mu doubles, otherwise it shrinks by
``shrink`` (close to 1), as in FP8-LM's automatic scaling.

Non-finite input: its block maximum, hence the block's scale, is NaN or Inf,
so the whole block of 32 comes out non-finite on every rank.
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
    StatsOp,
    check_bounds,
    check_payload,
    from_segments,
    nested_chunks,
    segment_starts,
    split_parts,
    to_segments,
)
from hopq.codecs.registry import register
from hopq.errors import PayloadError
from hopq.kernels import resolve
from hopq.numerics import fp_formats as fpf
from hopq.numerics.bitpack import pack_bits, packed_nbytes, unpack_bits
from hopq.numerics.blocks import pad_to_blocks
from hopq.numerics.div import div, div_
from hopq.options import check_options, option

_FLOAT_MAX = float(torch.finfo(torch.float32).max)


class Backend(str, Enum):
    """The ``backend`` option: which implementation runs encode, decode and the
    fused hop (the same bits)."""

    #: The Triton kernels for CUDA tensors when triton is installed, the numba
    #: kernels for CPU tensors when numba is, else the reference.
    AUTO = "auto"
    REFERENCE = "reference"
    #: :mod:`hopq.codecs.mx.kernels_triton` (CUDA tensors; CPU tensors only
    #: under TRITON_INTERPRET=1).
    TRITON = "triton"
    #: :mod:`hopq.codecs.mx.kernels_cpu` (CPU tensors, numba).
    CPU = "cpu"


class ScaleFormat(str, Enum):
    BF16 = "bf16"  # the DynamiQ paper's setting
    E8M0 = "e8m0"  # the OCP standard's power of two


@dataclass(frozen=True)
class MXConfig(CodecConfig):
    block: int = option(32, "elements sharing one scale (the OCP MX block is 32)", lo=1, hi=1 << 20)
    scale: ScaleFormat = option(ScaleFormat.BF16, "scale format")
    #: Initial mu; None: the world size (the sum of n blocks then cannot overflow).
    #: At least 2^-8: below 1 a block's own maximum saturates and mu doubles
    #: back one round at a time (8 rounds from 2^-8; 66 from 1e-20, all of them
    #: near zero); at most 2^16 (the world size it serves): above, the scales put
    #: most entries below the element format's smallest value, and the output is
    #: zero while mu shrinks by 2^(-1/1000) per round.
    mu_init: float | None = option(
        None, "initial scale factor mu; default: the world size", lo=2.0**-8, hi=float(1 << 16)
    )
    #: FP8-LM: more than 0.001% saturated entries double mu.
    overflow_threshold: float = option(
        1e-5, "saturated share above which mu doubles", lo=0.0, lt=1.0
    )
    #: Otherwise mu shrinks by this factor per round (FP8-LM's 2^(-1/1000)).
    shrink: float = option(
        2 ** (-1 / 1000), "per-round shrink factor of mu otherwise", gt=0.0, hi=1.0
    )
    backend: Backend = option(
        Backend.AUTO,
        "implementation of encode, decode and the fused hop (same bits)",
        choices=Backend,
    )

    def __post_init__(self) -> None:
        # overflow_threshold: negative, mu would double every round; 1 or more, never
        check_options(self, "mx")


@dataclass
class MXPlan(Plan):
    scale: torch.Tensor  # float32 per block of the working vector
    mu: float
    #: The caller's schedule-chunk bounds when the engine asked for them: every
    #: chunk then starts its own blocks (its last block may be partial, padded
    #: with zeros in the working vector). None: blocks from the vector's start.
    bounds: tuple[int, ...] | None = None


class MXCodec(Codec[MXPlan]):
    """Shared implementation; subclasses fix the element format."""

    element: ClassVar[fpf.ElementFormat]
    config_class = MXConfig
    config: MXConfig
    layout_preserving: ClassVar[bool] = True
    chunk_local: ClassVar[bool] = True
    #: mu moves by a factor 2^(-1/1000) per quiet round: it settles over thousands of
    #: training rounds, which a one-round benchmark does not emulate (it measures mu = n).
    warmup_rounds: ClassVar[int] = 0
    #: Its first statistics: last round's saturation counts, two float64.
    first_stats_nbytes: ClassVar[int | None] = 16

    def __init__(self, config: MXConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self.mu: float | None = None
        self.overflow = 0  # saturated entries this rank encoded in the current round
        self.encoded = 0
        #: The GPU kernels' share of ``overflow``, counted on the device (no
        #: hop waits for it); read once per round, by the next plan.
        self._device_overflow: torch.Tensor | None = None
        #: The global overflow ratio of the last completed round (for reports).
        self.last_overflow_ratio = 0.0

    def nonfinite_block(self) -> int:
        return self.config.block

    def _payload_nbytes(self, n: int) -> int:
        return packed_nbytes(n, self.element.bits)

    def plan(self, x: torch.Tensor, stats: StatsExchange) -> MXPlan:
        cfg = self.config
        d = x.numel()
        B = cfg.block
        bounds = check_bounds(stats, d)
        nb = -(-d // B) if bounds is None else segment_starts(bounds, B)[-1] // B
        # last round's saturation, summed over every encode of every rank
        if cfg.backend not in (Backend.AUTO, Backend.REFERENCE):
            self.kernels(x.device)  # a backend that cannot take these tensors says so now
        counts = torch.tensor(
            [float(self._overflow_total()), float(self.encoded)],
            dtype=torch.float64,
            device=x.device,
        )
        glob = stats.all_reduce(counts, StatsOp.SUM).tolist()
        if self.mu is None:
            self.mu = float(cfg.mu_init if cfg.mu_init is not None else stats.world_size)
        elif glob[1] > 0:
            self.last_overflow_ratio = glob[0] / glob[1]
            self.mu *= 2.0 if self.last_overflow_ratio > cfg.overflow_threshold else cfg.shrink
        self.overflow = self.encoded = 0
        self._device_overflow = None
        blocks = pad_to_blocks(x, B) if bounds is None else to_segments(x, bounds, B).view(nb, B)
        amax = blocks.abs().amax(1)
        # rounded up to bfloat16, saturating rather than overflowing (finite in,
        # finite out); a NaN or Inf block keeps its poison
        local_max = fpf.round_up_bf16(amax, saturate=True)
        gm = stats.all_reduce(local_max, StatsOp.MAX).float()
        raw = gm * self.mu
        if cfg.scale is ScaleFormat.E8M0:
            scale = fpf.keep_finite(fpf.round_up_pow2(raw), gm, fpf.POW2_MAX)
        else:
            scale = fpf.keep_finite(fpf.round_up_bf16(raw).float(), gm, fpf.BF16_MAX)
        chunks = (
            nested_chunks(nb * B, stats.n_chunks, stats.microshards, align=B)
            if bounds is None
            else split_parts(segment_starts(bounds, B), stats.microshards, align=B)
        )
        return MXPlan(
            numel=d,
            work_numel=nb * B,
            chunks=chunks,
            payload_nbytes=tuple(self._payload_nbytes(e - s) for s, e in chunks),
            scale=scale,
            mu=self.mu,
            bounds=bounds,
        )

    def prepare(self, plan: MXPlan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        if plan.bounds is not None:
            return to_segments(x, plan.bounds, self.config.block)
        out = torch.zeros(plan.work_numel, dtype=torch.float32, device=x.device)
        out[: plan.numel] = x.reshape(-1)
        return out

    def _block_scale(self, plan: MXPlan, c: int, n: int) -> torch.Tensor:
        return self._scales(plan, c, n).repeat_interleave(self.config.block)[:n]

    def _scales(self, plan: MXPlan, c: int, n: int) -> torch.Tensor:
        """The scales of the blocks of chunk c (n entries, from a block start)."""
        B = self.config.block
        start = plan.chunks[c][0] // B
        return plan.scale[start : start - (-n // B)].contiguous()

    def _kernel_scales(
        self, plan: MXPlan, c: int, t: torch.Tensor, payload: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Chunk c's block scales for a kernel call on t (and ``payload``), after
        the checks the kernels rely on: they read scales and bytes for t's
        length, so it must be the chunk's, and the payload the plan's size."""
        if payload is not None:
            check_payload(payload, plan.payload_nbytes[c], f"{self.name} chunk {c} payload")
        s, e = plan.chunks[c]
        if t.numel() != e - s:
            raise PayloadError(
                f"{self.name}: a tensor of {t.numel()} values for chunk {c} of {e - s}"
            )
        return self._scales(plan, c, t.numel())

    def _overflow_total(self) -> int:
        """Saturated entries this round, the device's count included (waits for it)."""
        dev = self._device_overflow
        return self.overflow + (0 if dev is None else int(dev.item()))

    def _counter(self, k: Any, t: torch.Tensor) -> dict[str, Any]:
        """The keyword that makes kernels with a device counter (the Triton ones)
        add their saturation count into this codec's; none for the others."""
        if not hasattr(k, "new_counter"):
            return {}
        dev = self._device_overflow
        if dev is None or dev.device != t.device:
            if dev is not None:
                self.overflow += int(dev.item())
            dev = self._device_overflow = k.new_counter(t.device)
        return {"counter": dev}

    def kernels(self, device: torch.device) -> Any:
        """The kernel module on ``device`` (:mod:`hopq.codecs.mx.kernels_triton` for
        CUDA tensors, :mod:`hopq.codecs.mx.kernels_cpu` for CPU ones), or None for
        the reference (the same bits). A block whose codes do not end on a byte
        has no CPU kernel: ``backend="cpu"`` then raises rather than run the
        reference unasked (the Triton kernels take any block)."""
        k = _resolve(self.name, self.config.backend.value, device.type)
        if k is None or k.supports(self.element, self.config.block):
            return k
        if self.config.backend is Backend.CPU:
            raise ValueError(
                f"{self.name}: the CPU kernels need block x {self.element.bits} bits to be a "
                f"multiple of 8, got block {self.config.block}; use backend='auto' or 'reference'"
            )
        return None

    def warm_up(self, device: torch.device) -> None:
        """Compile the Triton kernels this codec runs on ``device`` (about a
        second each on first use; :meth:`Codec.warm_up
        <hopq.codecs.base.Codec.warm_up>`). The numba kernels compile on import."""
        warm = getattr(self.kernels(device), "warm_up", None)
        if warm is not None:
            warm(self.element, self.config.block, device)

    def _kernels_for(self, t: torch.Tensor) -> Any:
        """:meth:`kernels` for a tensor: the kernels take contiguous float32 only."""
        if t.dtype != torch.float32 or not t.is_contiguous():
            return None
        return self.kernels(t.device)

    def encode(self, plan: MXPlan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        fmt = self.element
        k = self._kernels_for(chunk)
        if k is not None:
            scales = self._kernel_scales(plan, ctx.chunk, chunk)
            out, sat = k.encode(chunk, scales, fmt, self.config.block, **self._counter(k, chunk))
            self.overflow += sat
            self.encoded += chunk.numel()
            return out
        s = self._block_scale(plan, ctx.chunk, chunk.numel())
        v = torch.where(s > 0, chunk / s * fmt.max, chunk)
        sat = torch.isfinite(v) & (v.abs() > fmt.max)
        self.overflow += int(sat.sum())
        self.encoded += chunk.numel()
        codes = fpf.encode(v, fmt)
        return codes if fmt.bits == 8 else pack_bits(codes, fmt.bits)

    def decode(
        self, plan: MXPlan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor
    ) -> None:
        check_payload(
            payload, plan.payload_nbytes[ctx.chunk], f"{self.name} chunk {ctx.chunk} payload"
        )
        fmt, n = self.element, out.numel()
        k = self._kernels_for(out)
        if k is not None:
            scales = self._kernel_scales(plan, ctx.chunk, out)
            k.decode(payload, scales, fmt, self.config.block, out, False)
            return
        codes = payload if fmt.bits == 8 else unpack_bits(payload, fmt.bits, n)
        s = self._block_scale(plan, ctx.chunk, n)
        v = fpf.decode(codes, fmt)
        # v * s / FMAX, or v * (s / FMAX) where v * s would overflow float32
        safe = s <= _FLOAT_MAX / fmt.max
        out.copy_(torch.where(safe, div(v * s, fmt.max), v * div(s, fmt.max)))

    def decode_accumulate(
        self, plan: MXPlan, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        k = self._kernels_for(acc)
        if k is None:
            super().decode_accumulate(plan, payload, acc, ctx)
            return
        scales = self._kernel_scales(plan, ctx.chunk, acc, payload)
        k.decode(payload, scales, self.element, self.config.block, acc, True)

    def decode_accumulate_encode(
        self, plan: MXPlan, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        """With the kernels: block by block, decode, add and encode the sum (the
        CPU kernels leave the sum in ``local``, the Triton ones leave ``local``
        as it was: the contract allows either)."""
        k = self._kernels_for(local)
        if k is None:
            return super().decode_accumulate_encode(plan, payload, local, ctx)
        scales = self._kernel_scales(plan, ctx.chunk, local, payload)
        B = self.config.block
        out, sat = k.hop(payload, local, scales, self.element, B, **self._counter(k, local))
        self.overflow += sat
        self.encoded += local.numel()
        return out

    def finish(self, plan: MXPlan, y: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
        y = (
            y[: plan.numel]
            if plan.bounds is None
            else from_segments(y, plan.bounds, self.config.block)
        )
        return div_(y, world_size) if op is ReduceOp.AVG else y

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "mu": self.mu,
            "overflow": self._overflow_total(),
            "encoded": self.encoded,
            "last_overflow_ratio": self.last_overflow_ratio,
        }

    def agreed_state(self) -> Any:
        # the saturation counts are this rank's own until the next plan sums them
        return {"round": self.round, "mu": self.mu}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.mu = None if state["mu"] is None else float(state["mu"])
        self.overflow = int(state["overflow"])
        self._device_overflow = None
        self.encoded = int(state["encoded"])
        self.last_overflow_ratio = float(state["last_overflow_ratio"])

    def error_bound(
        self, abs_sum: torch.Tensor, chain: int, adds: int | None = None
    ) -> torch.Tensor | None:
        return None  # saturation makes the worst case data-dependent; see the vNMSE tables


@lru_cache(maxsize=16)
def _resolve(codec: str, choice: str, device_type: str) -> Any:
    return resolve(codec, choice, device_type)


@register(
    "mxfp8", "MXFP8: E4M3 elements, blocks of 32, FP8-LM summation with an adaptive global scale"
)
class MXFP8(MXCodec):
    element = fpf.E4M3


@register(
    "mxfp6", "MXFP6: E3M2 elements, blocks of 32, FP8-LM summation with an adaptive global scale"
)
class MXFP6(MXCodec):
    element = fpf.E3M2


@register(
    "mxfp4", "MXFP4: E2M1 elements, blocks of 32, FP8-LM summation with an adaptive global scale"
)
class MXFP4(MXCodec):
    element = fpf.E2M1
