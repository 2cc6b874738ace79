"""A test codec whose payloads have data-dependent sizes (imported by spawned ranks).

bf16 on the wire, preceded by a 4-byte count of filler bytes that follow the
data; the filler count depends on the rank, the chunk and the hop, so payloads
of one call differ in size across ranks and hops. The plan's sizes are bounds."""

from __future__ import annotations

from typing import ClassVar

import torch

from hopq.codecs.base import HopContext, Plan, StatsExchange, nested_chunks, view_as_dtype
from hopq.codecs.uncompressed import Bf16
from hopq.errors import PayloadError

#: Most filler bytes a payload carries.
MAX_FILL = 37


def fill_count(ctx: HopContext, numel: int) -> int:
    return (7 * ctx.rank + 5 * ctx.chunk + 3 * ctx.hop + numel) % (MAX_FILL + 1)


class VarBf16(Bf16):
    variable_size: ClassVar[bool] = True
    #: Payload sizes encoded by this instance, in order (the test compares them
    #: with the engine's count of bytes sent).
    produced: list[int]

    def __init__(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **k)
        self.produced = []

    def plan(self, x: torch.Tensor, stats: StatsExchange) -> Plan:
        d = x.numel()
        chunks = nested_chunks(d, stats.n_chunks, stats.microshards)
        # bounds: generous on purpose, so that counting bounds would show
        return Plan(d, d, chunks, tuple(4 + 2 * (e - s) + MAX_FILL + 100 for s, e in chunks))

    def encode(self, plan: Plan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        body = super().encode(plan, chunk, ctx)
        k = fill_count(ctx, chunk.numel())
        head = torch.tensor([k], dtype=torch.int32).view(torch.uint8)
        out = torch.cat([head, body, torch.full((k,), 0xAB, dtype=torch.uint8)])
        self.produced.append(out.numel())
        return out

    def _wire(self, plan: Plan, payload: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < 4:
            raise PayloadError("varbf16: payload too short")
        k = int(payload[:4].clone().view(torch.int32))
        n = plan.chunk_numel(ctx.chunk)
        if not 0 <= k <= MAX_FILL or payload.numel() != 4 + 2 * n + k:
            raise PayloadError(f"varbf16: {payload.numel()} bytes do not hold {n} values + {k}")
        if not bool((payload[4 + 2 * n :] == 0xAB).all()):
            raise PayloadError("varbf16: bad filler")
        return view_as_dtype(payload[4 : 4 + 2 * n], torch.bfloat16)
