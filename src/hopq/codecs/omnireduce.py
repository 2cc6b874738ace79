"""OmniReduce adapted to multi-hop all-reduce (DynamiQ paper, appendix C).

Block (chunked) top-k sparsification: the vector is cut into blocks; each rank
selects its k blocks of largest norm; the union of the selections is agreed
through the statistics exchange (a max all-reduce of one byte per block), and
only the blocks of the union travel, in bfloat16, through the ordinary hops.
Blocks outside the union come out as zeros. Because the union of n local
top-k sets varies with the data, k adapts across rounds with the paper's
momentum rule k_{t+1} = g k_t + (1 - g) (K / K'_t) k_t (g = 0.8), so that the
union K'_t tracks the target K = n_blocks * b / 16 (b = 8: half the blocks).
k is codec state and identical on every rank (K'_t is global).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hopq.codecs.base import (
    CodecConfig,
    Plan,
    ReduceOp,
    StatsExchange,
    StatsOp,
    check_bounds,
    nested_chunks,
    segment_starts,
    split_parts,
    to_segments,
)
from hopq.codecs.registry import register
from hopq.codecs.uncompressed import WireCodec, working_copy
from hopq.numerics.blocks import pad_to_blocks
from hopq.numerics.div import div_
from hopq.options import check_options, option


@dataclass(frozen=True)
class OmniReduceConfig(CodecConfig):
    block: int = option(256, "entries per block (the unit of top-k selection)", lo=1, hi=1 << 20)
    #: b: the union should hold b/16 of the blocks (each travels at 16 bits).
    budget: float = option(
        8.0, "target bits per coordinate: the union holds budget/16 of the blocks", gt=0.0, hi=16.0
    )
    momentum: float = option(0.8, "momentum g of k's adaptation", lo=0.0, hi=1.0)

    def __post_init__(self) -> None:
        check_options(self, "omnireduce")


@dataclass
class OmniPlan(Plan):
    blocks: torch.Tensor  # indices of the union's blocks, ascending
    union: int
    k: int
    #: With chunk bounds: the caller's position of every working-vector entry
    #: (blocks then start at each chunk's start, its last block possibly short).
    index: torch.Tensor | None = None


@register(
    "omnireduce", "OmniReduce: block top-k, union agreed in the statistics exchange, bf16 blocks"
)
class OmniReduce(WireCodec[OmniPlan]):
    wire_dtype = torch.bfloat16
    config_class = OmniReduceConfig
    config: OmniReduceConfig
    layout_preserving: ClassVar[bool] = False
    #: With chunk bounds (a reduce-scatter over rank shards) blocks are cut
    #: inside each chunk and chunk c carries the selected blocks of the caller's
    #: chunk c: chunks then differ in size, the selection stays global.
    chunk_local: ClassVar[bool] = True
    #: k's momentum 0.8 leaves 0.8^15 = 3.5% of the initial error after 15 rounds.
    warmup_rounds: ClassVar[int] = 15

    def __init__(self, config: OmniReduceConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self.k: float | None = None
        #: Union size of the last round, for reports and tests.
        self.last_union = 0

    def target(self, n_blocks: int) -> int:
        return max(1, min(n_blocks, round(n_blocks * self.config.budget / 16)))

    def plan(self, x: torch.Tensor, stats: StatsExchange) -> OmniPlan:
        B = self.config.block
        d = x.numel()
        bounds = check_bounds(stats, d)
        nb = -(-d // B) if bounds is None else segment_starts(bounds, B)[-1] // B
        padded = pad_to_blocks(x, B) if bounds is None else to_segments(x, bounds, B).view(nb, B)
        norms = padded.square().sum(1)
        K = self.target(nb) if nb else 0
        if self.k is None:
            self.k = float(K)
        k = max(1, min(nb, round(self.k))) if nb else 0
        mask = torch.zeros(nb, dtype=torch.uint8, device=x.device)
        if k:
            mask[torch.topk(torch.nan_to_num(norms, nan=float("inf")), k, sorted=False).indices] = 1
        # a block holding a NaN or Inf is always sent, beyond k (never hidden as zeros)
        mask[~torch.isfinite(norms)] = 1
        union = stats.all_reduce(mask, StatsOp.MAX).bool()
        blocks = torch.nonzero(union).flatten()
        size = int(blocks.numel())
        if size and K:
            self.k = (
                self.config.momentum * self.k + (1 - self.config.momentum) * (K / size) * self.k
            )
        self.last_union = size
        if bounds is not None:
            return self._plan_chunks(d, bounds, blocks, stats, k)
        last = blocks.numel() and int(blocks[-1]) == nb - 1
        work = size * B - ((nb * B - d) if last else 0)
        chunks = nested_chunks(work, stats.n_chunks, stats.microshards)
        return OmniPlan(
            d, work, chunks, tuple(2 * (e - s) for s, e in chunks), blocks=blocks, union=size, k=k
        )

    def _plan_chunks(
        self,
        d: int,
        bounds: tuple[int, ...],
        blocks: torch.Tensor,
        stats: StatsExchange,
        k: int,
    ) -> OmniPlan:
        """The plan over chunk bounds: block j of chunk c covers the caller's
        ``bounds[c] + j B`` on (the chunk's last block is short); the working
        vector holds the selected blocks in order, chunk after chunk."""
        B = self.config.block
        K = len(bounds) - 1
        starts, ends, chunk_of = [], [], []
        for c in range(K):
            s = torch.arange(bounds[c], bounds[c + 1], B, dtype=torch.int64)
            starts.append(s)
            ends.append((s + B).clamp(max=bounds[c + 1]))
            chunk_of.append(torch.full_like(s, c))
        sel = blocks.cpu()
        first = torch.cat(starts)[sel] if K else sel
        ln = torch.cat(ends)[sel] - first if K else sel
        offs = torch.cumsum(ln, 0) - ln
        work = int(ln.sum())
        index = torch.repeat_interleave(first - offs, ln) + torch.arange(work)
        per_chunk = torch.zeros(K, dtype=torch.int64)
        if K:
            per_chunk.index_add_(0, torch.cat(chunk_of)[sel], ln)
        wstarts = (0, *torch.cumsum(per_chunk, 0).tolist())
        chunks = split_parts(wstarts, stats.microshards)
        return OmniPlan(
            d,
            work,
            chunks,
            tuple(2 * (e - s) for s, e in chunks),
            blocks=blocks,
            union=int(blocks.numel()),
            k=k,
            index=index.to(blocks.device),
        )

    def _rows(self, plan: OmniPlan) -> tuple[torch.Tensor, int]:
        """The selected blocks that are whole, and the length of the vector's
        short last block when it is selected (else 0)."""
        B, d = self.config.block, plan.numel
        tail = d % B
        if tail and plan.blocks.numel() and int(plan.blocks[-1]) == d // B:
            return plan.blocks[:-1], tail
        return plan.blocks, 0

    def prepare(self, plan: OmniPlan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        if plan.work_numel == plan.numel:  # every block selected: plain bf16
            return working_copy(x, overwrite)
        flat = x.reshape(-1).to(torch.float32)
        if plan.index is not None:
            return flat[plan.index.to(x.device)]
        # whole rows copied: a 64 MiB vector's gather took 0.2 s through an
        # element index (int64, twice the vector's size)
        B = self.config.block
        full = plan.numel // B
        whole, tail = self._rows(plan)
        out = flat[: full * B].view(full, B).index_select(0, whole.to(x.device)).reshape(-1)
        return torch.cat([out, flat[full * B :]]) if tail else out

    def finish(
        self, plan: OmniPlan, y: torch.Tensor, op: ReduceOp, world_size: int
    ) -> torch.Tensor:
        if plan.work_numel != plan.numel:
            out = y.new_zeros(plan.numel)
            if plan.index is not None:
                out[plan.index.to(y.device)] = y
            else:
                B = self.config.block
                full = plan.numel // B
                whole, tail = self._rows(plan)
                n = whole.numel() * B
                rows = out[: full * B].view(full, B)
                rows.index_copy_(0, whole.to(y.device), y[:n].view(-1, B))
                if tail:
                    out[full * B :] = y[n:]
            y = out
        return div_(y, world_size) if op is ReduceOp.AVG else y

    def error_bound(
        self, abs_sum: torch.Tensor, chain: int, adds: int | None = None
    ) -> torch.Tensor | None:
        return None  # dropped blocks are lost whole

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "k": self.k, "last_union": self.last_union}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.k = None if state["k"] is None else float(state["k"])
        self.last_union = int(state["last_union"])
