"""The engine: runs any schedule with any codec on one rank.

Per chunk, a rank plays one role per phase, read off the schedule:

* leaf: it sends the chunk before receiving any of it -> ``encode``;
* inner node: it receives partial sums from its children, then sends ->
  ``decode_accumulate`` for all children but the last, the fused
  ``decode_accumulate_encode`` for the last one;
* sink (the chunk's owner): like an inner node, but the fused hop's output is
  the final payload, which it decodes itself, so that every rank ends with the
  same bytes decoded the same way;
* gather: every payload received in the all-gather is decoded (and forwarded
  when the schedule says so, unchanged).

Messages to the same peer in one step are concatenated into one buffer; the
receiver splits it with the payload sizes of the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from hopq.codecs.base import Codec, HopContext, ReduceOp, StatsOp
from hopq.comm.topology import Phase, Schedule
from hopq.comm.transport import Transport


@dataclass
class RunStats:
    """What one rank did in one call."""

    rank: int
    world_size: int
    numel: int
    #: Payload bytes this rank sent in the main all-reduce.
    payload_bytes: int = 0
    #: Bytes of the statistics exchange, counted as if it ran as a ring all-reduce.
    stats_bytes: float = 0.0
    #: Longest chain of compressions any contribution went through.
    hops_per_chunk: int = 0
    phases: tuple[str, ...] = field(default=("reduce", "gather"))
    #: Wall-clock seconds of the whole call on this rank (stats exchange, codec, transfers).
    seconds: float = 0.0
    #: Of those, seconds spent waiting in the transport (statistics exchange included);
    #: the rest is the codec's own work (compression overhead).
    comm_seconds: float = 0.0
    #: [start, end) ranges of the working vector whose final sum this rank owns.
    owned: tuple[tuple[int, int], ...] = ()

    @property
    def bytes_sent(self) -> float:
        return self.payload_bytes + self.stats_bytes

    @property
    def bits_per_coord(self) -> float:
        return bits_per_coordinate(self.bytes_sent, self.world_size, self.numel)


def bits_per_coordinate(bytes_sent: float, world_size: int, numel: int) -> float:
    """8 x bytes sent / (2(n-1)/n x d): 16 for uncompressed bf16 on any topology
    (DESIGN.md, "Stated bit budget"). NaN when nothing needs to move (n = 1 or d = 0)."""
    denom = 2 * (world_size - 1) / world_size * numel
    return 8 * bytes_sent / denom if denom else float("nan")


class _StatsExchange:
    """The codec's view of the statistics exchange: all-gather, then a reduction
    in rank order (bit-identical on every rank and in the simulator)."""

    def __init__(
        self, transport: Transport, n_chunks: int, seed: int, round: int, key: int | None = None
    ) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.n_chunks = n_chunks
        self.seed = seed
        self.round = round
        self.key = key
        self.bytes = 0.0
        self.seconds = 0.0

    def all_reduce(self, t: torch.Tensor, op: StatsOp) -> torch.Tensor:
        n = self.world_size
        if t.numel() == 0:  # same shape on every rank: nothing to exchange
            return t.clone()
        self.bytes += 2 * (n - 1) / n * t.numel() * t.element_size()
        t0 = time.perf_counter()
        parts = self.transport.all_gather(t)
        self.seconds += time.perf_counter() - t0
        op = StatsOp(op)
        acc = parts[0].clone()
        for p in parts[1:]:
            if op is StatsOp.SUM:
                acc.add_(p)
            elif op is StatsOp.MAX:
                torch.maximum(acc, p, out=acc)
            else:
                torch.minimum(acc, p, out=acc)
        return acc


@lru_cache(maxsize=1024)
def _peer_classes(schedule: Schedule, rank: int) -> list[tuple[int, int, int]]:
    """Per chunk: (depth, index among the encoders of that depth, their number)."""
    out = []
    for depths in schedule.encoder_depths():
        mine = depths[rank]
        same = sorted(r for r, d in depths.items() if d == mine)
        out.append((mine, same.index(rank), len(same)))
    return out


@lru_cache(maxsize=1024)
def _last_reduce_recv(schedule: Schedule, rank: int) -> dict[int, int]:
    """chunk -> the step of this rank's last REDUCE receive of it."""
    last: dict[int, int] = {}
    for s, step in enumerate(schedule.steps):
        for t in step:
            if t.dst == rank and t.phase is Phase.REDUCE:
                for c in t.chunks:
                    last[c] = s
    return last


def run(
    codec: Codec[Any],
    x: torch.Tensor,
    schedule: Schedule,
    transport: Transport,
    *,
    seed: int = 0,
    op: ReduceOp = ReduceOp.SUM,
    gather: bool = True,
    scratch: bool = False,
    key: int | None = None,
) -> tuple[torch.Tensor, RunStats]:
    """One compressed all-reduce (or, with ``gather=False``, reduce-scatter) of the
    flat tensor ``x`` on this rank. Returns the float32 result in ``x``'s layout
    (for reduce-scatter, valid only on the chunks this rank owns) and the stats.
    With ``scratch=True`` the codec may work in ``x``'s memory (and return it).
    ``key`` names the tensor across steps (see ``StatsExchange.key``)."""
    t_start = time.perf_counter()
    rank, n = transport.rank, transport.world_size
    if schedule.world_size != n:
        raise ValueError(f"schedule is for {schedule.world_size} ranks, the group has {n}")
    device = x.device
    stats = _StatsExchange(transport, schedule.n_chunks, seed, codec.round, key)
    plan = codec.plan(x, stats)
    if len(plan.chunks) != schedule.n_chunks:
        raise RuntimeError(
            f"{codec.name} planned {len(plan.chunks)} chunks, the schedule has {schedule.n_chunks}"
        )
    work = codec.prepare(plan, x, scratch)
    info = RunStats(rank, n, x.numel(), hops_per_chunk=max(schedule.compression_chains()))

    classes = _peer_classes(schedule, rank)

    def ctx(c: int) -> HopContext:
        depth, peer, peers = classes[c]
        return HopContext(
            seed, codec.round, c, (rank - schedule.owner[c]) % n, rank, n, depth, peer, peers
        )

    last_recv = _last_reduce_recv(schedule, rank)
    active = [
        i
        for i, st in enumerate(schedule.steps)
        if gather or any(t.phase is Phase.REDUCE for t in st)
    ]
    transport.reserve(
        sum(
            (plan.payload_nbytes[c] + 63) // 64 * 64
            for i in active
            for t in schedule.steps[i]
            if t.dst == rank
            for c in t.chunks
        ),
        device,
    )
    outgoing: dict[int, torch.Tensor] = {}  # REDUCE payloads produced by a fused hop
    final: dict[int, torch.Tensor] = {}  # final (gather) payloads this rank holds

    def finalize(c: int, payload: torch.Tensor) -> None:
        final[c] = payload
        codec.decode(plan, payload, ctx(c), plan.chunk_view(work, c))

    for c in schedule.owned_chunks(rank):
        if c not in last_recv:  # a sink with no children (world size 1)
            finalize(c, codec.encode(plan, plan.chunk_view(work, c), ctx(c)))

    for s in active:
        step = schedule.steps[s]
        mine_out = [t for t in step if t.src == rank]
        mine_in = [t for t in step if t.dst == rank]
        sends = []
        for t in mine_out:
            parts = []
            for c in t.chunks:
                if t.phase is Phase.GATHER:
                    parts.append(final[c])
                elif c in outgoing:
                    parts.append(outgoing.pop(c))
                else:  # leaf
                    parts.append(codec.encode(plan, plan.chunk_view(work, c), ctx(c)))
            msg = parts[0] if len(parts) == 1 else torch.cat(parts)
            info.payload_bytes += msg.numel()
            sends.append((t.dst, msg))
        recvs = [(t.src, sum(plan.payload_nbytes[c] for c in t.chunks)) for t in mine_in]
        t_comm = time.perf_counter()
        received = transport.exchange(sends, recvs, device)
        info.comm_seconds += time.perf_counter() - t_comm
        for t, buf in zip(mine_in, received, strict=True):
            offset = 0
            for c in t.chunks:
                size = plan.payload_nbytes[c]
                payload = buf[offset : offset + size]
                offset += size
                if t.phase is Phase.GATHER:
                    finalize(c, payload)
                elif last_recv[c] == s:
                    out = codec.decode_accumulate_encode(
                        plan, payload, plan.chunk_view(work, c), ctx(c)
                    )
                    if schedule.owner[c] == rank:
                        finalize(c, out)
                    else:
                        outgoing[c] = out
                else:
                    codec.decode_accumulate(plan, payload, plan.chunk_view(work, c), ctx(c))
    if outgoing:
        raise RuntimeError(
            f"schedule left partial sums unsent on rank {rank}: chunks {sorted(outgoing)}"
        )
    info.stats_bytes = stats.bytes
    info.comm_seconds += stats.seconds
    info.owned = tuple(plan.chunks[c] for c in schedule.owned_chunks(rank))
    if not gather:
        info.phases = ("reduce",)
    y = codec.finish(plan, work, op, n)
    codec.end_round(plan)
    info.seconds = time.perf_counter() - t_start
    return y, info
