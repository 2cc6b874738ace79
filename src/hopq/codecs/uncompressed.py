"""Uncompressed baselines fp32, bf16 and fp16 through the codec contract.

Payload = the chunk in the wire dtype; accumulation in float32. fp32 is exact
in the sense of the schedule's summation order; bf16 and fp16 round once per
hop (and once at the sink), like an all-reduce that keeps partial sums in that
dtype.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import torch

from hopq.codecs.base import (
    Codec,
    HopContext,
    P,
    Plan,
    ReduceOp,
    StatsExchange,
    check_payload,
    plan_chunks,
    view_as_dtype,
)
from hopq.codecs.registry import register
from hopq.numerics.div import div_
from hopq.numerics.fp_formats import keep_finite


def working_copy(x: torch.Tensor, overwrite: bool) -> torch.Tensor:
    """``x`` flattened as float32: ``x``'s own memory when the engine allows it
    (``overwrite``) and no conversion is needed, else a copy."""
    flat = x.reshape(-1)
    if overwrite and flat.dtype == torch.float32:
        return flat
    return flat.to(torch.float32, copy=True)


def _within(x: torch.Tensor, limit: float) -> bool:
    """Whether every entry of ``x`` lies in [-limit, limit] (False with a NaN): then
    none rounds to Inf in a wire dtype whose largest value is ``limit``. One
    vectorized pass; ``torch.isinf`` on a bfloat16 tensor costs 7x more."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return -limit <= lo.item() and hi.item() <= limit  # False with a NaN


class WireCodec(Codec[P]):
    """Chunks travel as ``wire_dtype`` (rounded to nearest), accumulation in
    float32; subclasses decide what the working vector holds.

    A finite partial sum beyond the wire dtype's range (fp16: 65504; bf16:
    3.39e38) saturates at its largest finite value instead of becoming Inf
    (finite in, finite out), is counted in ``saturated`` and warned about once;
    NaN and Inf inputs travel as they are."""

    wire_dtype: ClassVar[torch.dtype]

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self._max = float(torch.finfo(self.wire_dtype).max)
        #: Entries this rank saturated (rank-local).
        self.saturated = 0
        self._warned = False

    def _wire(self, plan: P, payload: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        check_payload(payload, plan.payload_nbytes[ctx.chunk])
        return view_as_dtype(payload, self.wire_dtype)

    def encode(self, plan: P, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        y = chunk.to(self.wire_dtype, copy=True)
        if (
            self.wire_dtype != torch.float32
            and not _within(chunk, self._max)
            and bool(torch.isinf(y).any())
        ):
            fixed = keep_finite(y.float(), chunk, self._max)
            over = int((torch.isinf(y) & torch.isfinite(chunk)).sum())
            if over:
                self.saturated += over
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"{self.name}: {over} partial sums exceed the range of "
                        f"{self.wire_dtype} and saturate at its largest value",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                y = fixed.to(self.wire_dtype)
        return y.view(torch.uint8)

    def decode_accumulate(
        self, plan: P, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        acc.add_(self._wire(plan, payload, ctx))

    def decode(self, plan: P, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor) -> None:
        out.copy_(self._wire(plan, payload, ctx))


class Uncompressed(WireCodec[Plan]):
    """Send each chunk as ``wire_dtype``; no statistics exchange."""

    layout_preserving = True
    chunk_local = True
    plans_ahead = True
    gather_stage = True

    def plan_gather(self, work_numel: int, chunks: tuple[tuple[int, int], ...]) -> Plan:
        size = torch.empty((), dtype=self.wire_dtype).element_size()
        return Plan(work_numel, work_numel, chunks, tuple((e - s) * size for s, e in chunks))

    def plan(self, x: torch.Tensor, stats: StatsExchange) -> Plan:
        d = x.numel()
        chunks = plan_chunks(d, stats)
        size = torch.empty((), dtype=self.wire_dtype).element_size()
        return Plan(d, d, chunks, tuple((e - s) * size for s, e in chunks))

    def prepare(self, plan: Plan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        return working_copy(x, overwrite)

    def finish(self, plan: Plan, y: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
        return div_(y, world_size) if op is ReduceOp.AVG else y

    def error_bound(
        self, abs_sum: torch.Tensor, chain: int, adds: int | None = None
    ) -> torch.Tensor | None:
        """Each compression rounds a partial sum (|partial| <= sum |x_i|) to nearest in
        the wire dtype: at most half an ulp, i.e. u |partial| for normal numbers and
        half the subnormal spacing below; float32 accumulation adds u32 per addition
        in a row (``adds``, by default one per hop)."""
        fi = torch.finfo(self.wire_dtype)
        u32 = torch.finfo(torch.float32).eps / 2
        k = chain if adds is None else adds
        return chain * (fi.eps / 2 * abs_sum + fi.smallest_normal * fi.eps / 2) + k * u32 * abs_sum


@register("fp32", "uncompressed float32 (exact up to summation order)", baseline=True)
class Fp32(Uncompressed):
    wire_dtype = torch.float32

    def encode(self, plan: Plan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        # The chunk's own bytes: the engine sends them before it writes the chunk
        # again, and saves a pass over memory per hop (see the payload contract).
        return chunk.view(torch.uint8)


@register("bf16", "uncompressed bfloat16 payloads, float32 accumulation")
class Bf16(Uncompressed):
    wire_dtype = torch.bfloat16


@register("fp16", "uncompressed float16 payloads, float32 accumulation", baseline=True)
class Fp16(Uncompressed):
    wire_dtype = torch.float16
