"""The engine: runs any schedule with any codec on one rank.

:func:`run` takes one :class:`~hopq.comm.call.Call` and goes through four steps:

1. **Agreement** (:mod:`hopq.comm.agreement`): all ranks check that they make the
   same call; any difference raises :class:`~hopq.MismatchError` on every rank
   before anything else is sent. A call without statistics whose signature the
   ranks agreed on before skips the round: its headers carry its identity, each
   peer's first message is checked before anything else from that peer is
   received, and a difference found there is settled
   (:mod:`hopq.comm.settle`) before every rank raises the same error.
2. **Plan**: the codec's statistics exchange (an all-gather reduced in rank
   order; large statistics reduce-scattered first, that round riding with the
   agreement's) and its plan, identical on every rank. The plan cuts the
   working vector into ``n_chunks * u`` parts: *microshard* j of schedule
   chunk c is part ``c * u + j``.
3. **Stages** (the hops): per chunk, a rank plays one role per phase, read off
   the schedule:

   * leaf: it sends the chunk before receiving any of it -> ``encode``;
   * inner node: it receives partial sums from its children, then sends ->
     ``decode_accumulate`` for all children but the last, the fused
     ``decode_accumulate_encode`` for the last one;
   * sink (the chunk's owner): like an inner node, but the fused hop's output is
     the final payload, which it decodes itself, so that every rank ends with
     the same bytes decoded the same way;
   * gather: every payload received in the all-gather is decoded (and forwarded
     unchanged when the schedule says so).

   With a separate gather-stage codec (``gather_codec``), the sink accumulates
   its last child without recompressing and encodes the final sum with the
   gather codec instead.
4. **Finish**: the codec undoes its transform.

**Pipelining.** Every step moves its u microshards as separate messages. On Gloo
and in the simulator, the receives of the next step are posted while this one
runs, a microshard's next-step message is encoded and sent as soon as it is
processed, and the codec works on one microshard while the others travel. With
``Call.pipeline=False`` the same messages run one after another (each waited before
the next is coded). Both give the same bits, and the bits do not depend on u:
the plan's schedule chunks are the same for every u, and microshards draw from
their schedule chunk's random streams (``HopContext.stream``).

Messages are framed (:mod:`hopq.comm.framing`): a receiver checks every header
(call, step, sizes) and never reads bytes it did not receive; a rank whose
codec fails tells the peers it still owes messages, so they raise at once
instead of waiting for the timeout.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from hopq.codecs.base import Codec, HopContext, Plan, ReduceOp, StatsOp
from hopq.comm import agreement, framing, settle
from hopq.comm.agreement import digest
from hopq.comm.call import Call
from hopq.comm.framing import Deadline, Where
from hopq.comm.topology import (
    Phase,
    Schedule,
    ShardLayout,
    Transfer,
    get_schedule,
    shard_layout,
)
from hopq.comm.transport import (
    DIRECT_EXCHANGE_MAX,
    TAIL_BYTES,
    Handle,
    Transport,
    all_gather,
    check_held,
    direct_all_reduce,
    direct_pieces,
    tails_ride,
)
from hopq.errors import CodecError, MismatchError, TransportError

#: Coordinates per microshard, when a codec does not set its own
#: (``Codec.microshard_coords``): a schedule chunk of d/n coordinates moves as
#: ceil(d / n / coords) messages (at most MAX_MICROSHARDS). Measured with
#: ``hopq bench allreduce --microshards 1 2 4 8 16`` (4 ranks, ring, 200 Mbit/s
#: emulated link, docs/bench/allreduce.md): at 16 and 64 MiB, EQuARX and DynamiQ
#: gain 10-20% from 1 to 4-8 messages per chunk, and bf16 and fp32 5-7% from 1
#: to 4 (21 alternating calls each: otherwise the link idles while a whole
#: chunk is added and re-encoded); on plain loopback, where a message costs
#: about a millisecond here and nothing waits on a link, 4 cost the casts
#: 17-20% more than 1. The network-bound case sets the default.
MICROSHARD_COORDS: int | None = None  # tests set it to force deep pipelines
MAX_MICROSHARDS = 8
#: Statistics of at least this many bytes take a direct reduce-scatter and
#: all-gather (:func:`~hopq.comm.transport.direct_all_reduce`: 2(n-1)/n of the
#: bytes per rank in two rounds, the same bits) instead of an all-gather (n-1
#: copies in ceil(log2 n) rounds), at n >= 3. DynamiQ's statistics of a 16 MiB
#: tensor are 64 KiB: 4 ranks at 200 Mbit/s spent 7-8 ms gathering them (192
#: KiB per rank) before any payload moved; a ring all-reduce (six rounds) took
#: 11 ms there. The reduce-scatter's pieces ride with the call's agreement when
#: they fit (:data:`~hopq.comm.transport.TAIL_BYTES` per peer): one round fewer
#: before the plan (DynamiQ at 16 MiB: 186-191 against 190-193 ms a call).
DIRECT_STATS_BYTES = 16 * 1024
#: Whether calls start with the agreement. Only ``hopq bench allreduce
#: --agreement-cost`` turns it off, to measure what it costs; never in use.
AGREEMENT = True
#: Whether a call whose signature the ranks agreed on before skips its agreement
#: round (:mod:`hopq.comm.settle`). Only ``hopq bench allreduce
#: --agreement-cost`` turns it off, to time the round in every call.
SKIP_AGREED = True
#: Signatures a transport remembers (the first ones agreed; DDP's buckets are
#: a few to a few hundred).
AGREED_MAX = 1024


def auto_microshards(numel: int, n_chunks: int, world_size: int, coords: int = 1 << 18) -> int:
    """Microshards per schedule chunk for a call of ``numel`` coordinates, aiming
    at ``coords`` coordinates each (``MICROSHARD_COORDS`` overrides it)."""
    if world_size == 1 or n_chunks == 0:
        return 1
    per = numel / n_chunks
    c = MICROSHARD_COORDS if MICROSHARD_COORDS is not None else coords
    return int(max(1, min(MAX_MICROSHARDS, -(-per // c))))


@dataclass
class RunStats:
    """What one rank did in one call.

    Returned by :func:`hopq.all_reduce`, kept per call by the DDP hook and
    :class:`hopq.FSDPReduceScatter` (``pop_stats()``), and per virtual rank in
    :attr:`hopq.SimResult.stats`. Bits per coordinate count every byte this
    rank sent, statistics included, relative to an uncompressed ring, so that
    bf16 is 16 on any topology (DESIGN.md, "Stated bit budget").

    Attributes:
        rank: This rank's index in the group.
        world_size: The group's size n.
        numel: Entries d of the reduced tensor.
        payload_bytes: Payload bytes this rank sent in the main all-reduce.
        stats_bytes: Bytes of the codec's statistics exchange, counted as if it
            ran as a ring all-reduce.
        frame_bytes: Framing and agreement bytes (transport overhead, not in
            bits per coordinate).
        hops_per_chunk: Longest chain of compressions any contribution went
            through.
        phases: ``("reduce", "gather")`` for an all-reduce, ``("reduce",)`` for
            a reduce-scatter.
        seconds: Wall-clock seconds of the whole call on this rank (agreement,
            statistics, codec, transfers).
        comm_seconds: Of those, seconds spent waiting on the transport.
        cpu_seconds: CPU seconds of the calling thread over the call (codec
            kernels, hopq's Python, socket calls; not time spent waiting).
        microshards: Microshards per schedule chunk (messages per chunk and
            step).
        owned: ``[start, end)`` ranges of the working vector whose final sum
            this rank owns (a reduce-scatter: this rank's shard).
        tiers: A two-tier call's tiers (``hopq.all_reduce(layout=...)``):
            ``"intra"`` and ``"inter"``, each a RunStats of its own group;
            empty for a flat call.
        fallback: The codec that ran the call in place of the call's own,
            which cannot serve its size (DynamiQ below a few super-groups runs
            ``"bf16"``), or None.

    Example:
        >>> import torch, hopq
        >>> s = hopq.simulate([torch.ones(1000), torch.ones(1000)], codec="bf16").stats[0]
        >>> s.payload_bytes, s.bits_per_coord  # 500 bf16 entries sent per phase
        (2000, 16.0)
    """

    rank: int
    world_size: int
    numel: int
    #: Payload bytes this rank sent in the main all-reduce.
    payload_bytes: int = 0
    #: Bytes of the statistics exchange, counted as if it ran as a ring all-reduce.
    stats_bytes: float = 0.0
    #: Framing and agreement bytes (transport overhead, not in bits per coordinate).
    frame_bytes: int = 0
    #: Longest chain of compressions any contribution went through.
    hops_per_chunk: int = 0
    phases: tuple[str, ...] = field(default=("reduce", "gather"))
    #: Wall-clock seconds of the whole call on this rank (agreement, statistics,
    #: codec, transfers).
    seconds: float = 0.0
    #: Of those, seconds spent waiting on the transport (the agreement and the
    #: statistics exchange included); the rest is the codec's own work.
    comm_seconds: float = 0.0
    #: CPU seconds of the calling thread over the whole call (``time.thread_time``,
    #: user and system): the codec's kernels, hopq's own Python and the socket
    #: calls the transport makes on this thread; not the transport's own threads,
    #: and not the time waited. On a machine whose cores are all busy computing, this is
    #: what the call costs the compute however well it overlaps.
    cpu_seconds: float = 0.0
    #: Microshards per schedule chunk.
    microshards: int = 1
    #: [start, end) ranges of the working vector whose final sum this rank owns
    #: (a call over rank shards: this rank's shard of the result).
    owned: tuple[tuple[int, int], ...] = ()
    #: A two-tier call's tiers ("intra": the node's reduce-scatter and all-gather;
    #: "inter": the all-reduce between nodes), each with its own group size and
    #: coordinates; empty for a flat call.
    tiers: dict[str, RunStats] = field(default_factory=dict)
    #: The codec that ran this call in place of the call's own, which cannot
    #: serve its size (``Codec.small_call_codec``: DynamiQ below a few
    #: super-groups runs bf16), or None; its bytes are the ones counted.
    fallback: str | None = None

    @property
    def inter_bits_per_coord(self) -> float:
        """Bits per coordinate on the inter-node network: the inter tier's own
        (relative to an uncompressed ring among the N nodes over the node-shard),
        0 when every hop stayed inside one node, and for a flat call, where any
        hop may cross nodes, :attr:`bits_per_coord`."""
        if "inter" in self.tiers:
            return self.tiers["inter"].bits_per_coord
        return 0.0 if self.tiers else self.bits_per_coord

    @property
    def bytes_sent(self) -> float:
        """Payload and statistics bytes: what bits per coordinate count."""
        return self.payload_bytes + self.stats_bytes

    @property
    def codec_seconds(self) -> float:
        """Seconds of the call not spent waiting on the transport (codec work)."""
        return self.seconds - self.comm_seconds

    @property
    def coords_moved(self) -> float:
        """The coordinates an uncompressed ring moves per rank in this kind of
        call: 2(n-1)/n x d for an all-reduce, (n-1)/n x d for a reduce-scatter."""
        return coords_moved(self.world_size, self.numel, len(self.phases))

    @property
    def bits_per_coord(self) -> float:
        """8 x :attr:`bytes_sent` / :attr:`coords_moved`: 16 for bf16; NaN when
        nothing needs to move (one rank, or an empty tensor)."""
        m = self.coords_moved
        return 8 * self.bytes_sent / m if m else float("nan")


def coords_moved(world_size: int, numel: int, phases: int = 2) -> float:
    """(n-1)/n x d per phase: what one rank of an uncompressed ring sends."""
    return phases * (world_size - 1) / world_size * numel


def bits_per_coordinate(bytes_sent: float, world_size: int, numel: int, phases: int = 2) -> float:
    """8 x bytes sent / (2(n-1)/n x d): 16 for uncompressed bf16 on any topology
    (DESIGN.md, "Stated bit budget"); for a reduce-scatter (``phases=1``) the
    denominator is (n-1)/n x d, so that bf16 is 16 there too. NaN when nothing
    needs to move (n = 1 or d = 0)."""
    denom = coords_moved(world_size, numel, phases)
    return 8 * bytes_sent / denom if denom else float("nan")


class _Agreement:
    """The call's agreement, run once: on its own, or carrying the codec's first
    statistics when they have the fixed size the codec declares
    (``first_stats_nbytes``), which saves that exchange its own round."""

    def __init__(
        self, transport: Transport, mine: list[int], deadline: Deadline, where: Where,
        describe: Callable[[], dict[str, str]], fold: int | None,
    ) -> None:  # fmt: skip
        self.transport, self.mine, self.deadline = transport, mine, deadline
        self.where, self._describe, self.fold = where, describe, fold
        self.done = not AGREEMENT or transport.world_size == 1
        #: The agreement itself raised: every peer's agreement fails alike (each
        #: waits for every block before it checks), so none waits for this rank.
        self.failed = False
        self.seconds = 0.0
        self.bytes = 0
        #: The call's identity (every header of its hops carries it), its
        #: signature (what the ranks agree on once) and schedule, and whether
        #: the call may skip its round once its signature was agreed.
        self.ident = digest(tuple(mine))
        self.sig = 0
        self.pattern: tuple[str, str] = ("", "")
        self.may_skip = False
        #: The call skipped its round (its signature was agreed before).
        self.skipped = False

    @property
    def describe(self) -> dict[str, str]:
        """This rank's readable value of each field (built when a message needs it)."""
        return self._describe()

    def skip(self) -> bool:
        """Skip the round when the ranks agreed on this call's signature before
        (every rank decides alike: they hold the same signatures)."""
        if self.may_skip and self.sig in self.transport.agreed:
            self.done = self.skipped = True
        return self.skipped

    def remember(self) -> None:
        """The round found every fingerprint equal: later calls of this signature
        may skip it, when they run the schedule of those that do."""
        t = self.transport
        if not self.may_skip or len(t.agreed) >= AGREED_MAX:
            return
        if t.agreed_pattern is None:
            t.agreed_pattern = self.pattern
        if t.agreed_pattern == self.pattern:
            t.agreed.add(self.sig)

    def run(
        self, extra: torch.Tensor | None = None, tails: dict[int, torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor] | None, dict[int, torch.Tensor]]:
        """Agree (raising MismatchError on every rank when the calls differ);
        ``extra`` and ``tails`` ride along (:func:`~hopq.comm.agreement.agree`)."""
        self.done = True
        t0 = time.perf_counter()
        try:
            out = agreement.agree(
                self.transport, self.mine, self.deadline, self.where, self.describe, extra, tails
            )
        except BaseException:
            self.failed = True
            raise
        finally:
            self.seconds += time.perf_counter() - t0
        n = self.transport.world_size
        block = 8 * (len(agreement.FIELDS) + 1) + agreement.FOLD_BYTES
        direct = n <= DIRECT_EXCHANGE_MAX
        messages = n - 1 if direct else max(1, (n - 1).bit_length())
        self.bytes += (n - 1) * block + messages * framing.header_nbytes(1)
        return out


class _StatsExchange:
    """The codec's view of the statistics exchange: a framed all-gather, then a
    reduction in rank order, or for large statistics a direct reduce-scatter and
    all-gather (:data:`DIRECT_STATS_BYTES`) with the same bits; bit-identical
    on every rank and in the simulator.
    Its first exchange may ride with the call's agreement (:class:`_Agreement`)."""

    def __init__(
        self,
        transport: Transport,
        n_chunks: int,
        microshards: int,
        seed: int,
        round: int,
        key: int | None,
        deadline: Deadline,
        where: Where,
        agreement: _Agreement,
    ) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.n_chunks = n_chunks
        self.microshards = microshards
        self.seed = seed
        self.round = round
        self.key = key
        self.deadline = deadline
        self.where = where
        self.agreement = agreement
        #: The schedule chunks' bounds the call asks the codec for (rank shards).
        self.bounds: tuple[int, ...] | None = None
        #: 2 for an all-reduce, 1 for a reduce-scatter (set by run()).
        self.phases = 2
        #: The most pairwise combinations in a row on the schedule
        #: (``Schedule.reduce_depths``; codecs whose combination can double a
        #: magnitude, like gqsgd-exp, scale their leaves by it); set by run().
        self.reduce_depth = transport.world_size - 1
        self.calls = 0
        self.bytes = 0.0
        self.frame_bytes = 0
        self.seconds = 0.0

    def all_reduce(self, t: torch.Tensor, op: StatsOp) -> torch.Tensor:
        op = StatsOp(op)
        n = self.world_size
        nbytes = t.numel() * t.element_size()
        if not self._folds() and n > 1 and t.numel():
            direct = n > 2 and nbytes >= DIRECT_STATS_BYTES and t.numel() >= n
            held = None
            if not self.agreement.done:
                pieces = direct_pieces(t, n) if direct else []
                if (
                    direct
                    and tails_ride(self.transport)
                    and all(p.numel() * p.element_size() <= TAIL_BYTES for p in pieces)
                ):
                    # the direct all-reduce's first round rides with the agreement
                    _, held = self.agreement.run(
                        tails={q: p for q, p in enumerate(pieces) if q != self.rank}
                    )
                elif direct:
                    self.agreement.run()
                # else the all-gather below rides with the agreement where it fits
            if direct:
                self.bytes += 2 * (n - 1) / n * nbytes
                self.calls += 1
                here = Where(self.where.what, self.where.call, -1 - self.calls, 0, "statistics")
                rounds = 1 if held is not None else 2
                self.frame_bytes += rounds * (n - 1) * framing.header_nbytes(1)
                t0 = time.perf_counter()
                try:
                    return direct_all_reduce(
                        self.transport, t, lambda acc, mine: _combine(acc, mine, op),
                        self.deadline, here, held,
                    )  # fmt: skip
                finally:
                    self.seconds += time.perf_counter() - t0
        parts = self._parts(t, 2 * (n - 1) / n * nbytes)
        if parts is None:  # same shape on every rank: nothing to exchange
            return t.clone()
        acc = parts[0].clone()
        for p in parts[1:]:
            _combine(acc, p, op)
        return acc

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        n = self.world_size
        parts = self._parts(t, (n - 1) * t.numel() * t.element_size())
        if parts is None:
            return t.unsqueeze(0).clone()
        return torch.stack(parts)

    def _folds(self) -> bool:
        """Whether this exchange rides with the pending agreement: the codec's first,
        of the size it declared."""
        return (
            not self.agreement.done
            and self.agreement.fold is not None
            and self.calls == 0
            and self.world_size > 1
        )

    def _parts(self, t: torch.Tensor, wire_bytes: float) -> list[torch.Tensor] | None:
        """Every rank's ``t`` in rank order (riding with the agreement when it is
        the codec's first exchange), or None with one rank or an empty ``t``."""
        n = self.world_size
        nbytes = t.numel() * t.element_size()
        if self._folds():
            if nbytes != self.agreement.fold:
                raise CodecError(
                    f"the codec declared {self.agreement.fold} bytes of first statistics, "
                    f"its plan exchanged {nbytes}"
                )
            self.calls += 1
            self.bytes += wire_bytes
            extras, _ = self.agreement.run(t)
            assert extras is not None
            return [e.view(t.dtype).view(t.shape).to(t.device) for e in extras]
        # the all-gather rides with the agreement where it fits: this rank's
        # statistics go to every peer in the agreement's own messages (one round,
        # not ceil(log2 n) more); the same parts, so the same bits
        ride = (
            not self.agreement.done
            and n > 1
            and 0 < nbytes <= TAIL_BYTES
            and tails_ride(self.transport)
        )
        if not self.agreement.done and not ride:
            self.agreement.run()
        if t.numel() == 0 or n == 1:
            return None
        self.bytes += wire_bytes
        self.calls += 1
        if ride:
            flat = t.detach().contiguous().reshape(-1)
            _, held = self.agreement.run(tails={q: flat for q in range(n) if q != self.rank})
            check_held(held, nbytes, self.rank, self.where)
            return [
                t if q == self.rank else held[q].view(t.dtype).view(t.shape).to(t.device)
                for q in range(n)
            ]
        here = Where(self.where.what, self.where.call, -1 - self.calls, 0, "statistics")
        self.frame_bytes += max(1, (n - 1).bit_length()) * framing.header_nbytes(1)
        t0 = time.perf_counter()
        try:
            return all_gather(self.transport, t, self.deadline, here)
        finally:
            self.seconds += time.perf_counter() - t0


def _combine(acc: torch.Tensor, p: torch.Tensor, op: StatsOp) -> None:
    """acc = op(acc, p), in place."""
    if op is StatsOp.SUM:
        acc.add_(p)
    elif op is StatsOp.MAX:
        torch.maximum(acc, p, out=acc)
    else:
        torch.minimum(acc, p, out=acc)


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
def _last_reduce_recv(schedule: Schedule, rank: int) -> dict[int, tuple[int, int]]:
    """chunk -> (step, sender) of this rank's last REDUCE receive of it. A step may
    bring one chunk from two senders (the semi-loop ring's sink, odd n): the later
    one in the step's order is the last, and takes the fused hop."""
    last: dict[int, tuple[int, int]] = {}
    for s, step in enumerate(schedule.steps):
        for t in step:
            if t.dst == rank and t.phase is Phase.REDUCE:
                for c in t.chunks:
                    last[c] = (s, t.src)
    return last


@dataclass
class _Recv:
    """A transfer's receives in one step and microshard."""

    t: Transfer
    where: Where
    bounds: list[int]
    total: int
    #: Byte sizes of its receives (:func:`~hopq.comm.framing.expect`).
    shapes: list[int]
    bufs: list[torch.Tensor] = field(default_factory=list)
    handles: list[Handle] = field(default_factory=list)
    #: Its first receive is the peer's first of the call, posted large, not yet
    #: checked (a call that skipped its agreement round).
    probe: bool = False


class _Foreign(Exception):
    """A peer's message that is not this call's (a call that skipped its
    agreement round): another call's, or the peer's END or refusal."""

    def __init__(self, peer: int, words: list[int], where: Where) -> None:
        super().__init__(f"a message from rank {peer} in {where.describe()} is not of this call")
        self.peer, self.words, self.where = peer, words, where

    @property
    def status(self) -> int:
        """This rank's END after it: END_FAILED after a peer's failure or refusal,
        else END_MISMATCH."""
        st = framing.status_of(self.words[3])
        return (
            framing.END_FAILED
            if st in (framing.END_FAILED, framing.SENDER_FAILED)
            else (framing.END_MISMATCH)
        )


class _Hops:
    """One rank's state during the hops of one call."""

    def __init__(
        self,
        codec: Codec[Any],
        gcodec: Codec[Any],
        plan: Plan,
        gplan: Plan,
        work: torch.Tensor,
        schedule: Schedule,
        transport: Transport,
        seed: int,
        u: int,
        deadline: Deadline,
        what: str,
        call: int,
        info: RunStats,
    ) -> None:
        self.codec, self.gcodec, self.plan, self.gplan = codec, gcodec, plan, gplan
        self.same = gcodec is codec
        self.work, self.schedule, self.transport = work, schedule, transport
        self.u, self.deadline, self.what, self.call, self.info = u, deadline, what, call, info
        self.rank, self.n = transport.rank, transport.world_size
        self.device = work.device
        classes = _peer_classes(schedule, self.rank)
        self.ctxs = [
            HopContext(
                seed,
                codec.round,
                c * u + j,
                (self.rank - schedule.owner[c]) % self.n,
                self.rank,
                self.n,
                *classes[c],
                stream=c,
            )
            for c in range(schedule.n_chunks)
            for j in range(u)
        ]
        self.last_recv = _last_reduce_recv(schedule, self.rank)
        self.outgoing: dict[int, torch.Tensor] = {}  # REDUCE payloads produced by a fused hop
        self.final: dict[int, torch.Tensor] = {}  # final (gather) payloads this rank holds
        self.pending_by_part: dict[int, list[Handle]] = {}  # sends that read work memory
        #: every posted send (with its message, kept alive until waited)
        self.sends: list[tuple[Handle, Where, list[torch.Tensor]]] = []
        self.posted: set[tuple[int, int, int]] = set()  # (step, microshard, peer) sent
        self.recvs: dict[tuple[int, int], list[_Recv]] = {}
        #: The call skipped its agreement round (see :meth:`post_recvs`), and its
        #: identity, which every header carries.
        self.fast = False
        self.ident = 0
        #: Peers whose first message passed (:meth:`_validated`), those with a
        #: first receive posted, and the receives that wait for it.
        self.validated: set[int] = set()
        self.probed: set[int] = set()
        self.deferred: dict[int, list[_Recv]] = {}
        #: Per peer: receives posted and not yet read (in order), receives posted,
        #: messages sent (what settling a failed call needs, :mod:`hopq.comm.settle`).
        self.fifo: dict[int, deque[tuple[Handle, torch.Tensor]]] = {}
        self.posted_n: dict[int, int] = {}
        self.sent_n: dict[int, int] = {}
        self.received: set[tuple[int, int]] = set()  # (step, microshard) processed
        self.prepared: set[int] = set()  # parts passed through Codec.prepare_part
        self.finished: set[int] = set()  # parts passed through Codec.finish_part
        self.op = ReduceOp.SUM  # the call's op, for Codec.finish_part
        #: What runs once this rank's first messages are posted (:func:`execute`).
        self.after_posts: Callable[[], None] | None = None

    def posted_first(self) -> None:
        """This rank's first step's messages are posted: run ``after_posts`` (once)."""
        if self.after_posts is not None:
            run, self.after_posts = self.after_posts, None
            run()

    def own(self, m: int) -> torch.Tensor:
        """Part m holding this rank's own values, prepared on first use
        (``Codec.prepare_part``), after any send that reads it has left."""
        v = self.writable(m)
        if m not in self.prepared:
            self.prepared.add(m)
            self.codec.prepare_part(self.plan, self.work, m)
        return v

    # -- sizes -----------------------------------------------------------------
    def part(self, c: int, j: int) -> int:
        return c * self.u + j

    def bound(self, t: Transfer, j: int) -> list[int]:
        p = self.gplan if t.phase is Phase.GATHER else self.plan
        return [p.payload_nbytes[self.part(c, j)] for c in t.chunks]

    def exact(self, t: Transfer) -> bool:
        return not (self.gcodec if t.phase is Phase.GATHER else self.codec).variable_size

    def where(self, s: int, j: int, phase: Phase) -> Where:
        return Where(self.what, self.call, s, j, phase.value)

    def view(self, m: int) -> torch.Tensor:
        return self.plan.chunk_view(self.work, m)

    def writable(self, m: int) -> torch.Tensor:
        """Part m of the working vector, after any send that reads it has left."""
        for h in self.pending_by_part.pop(m, []):
            self._wait(h, Where(self.what, self.call, -1, 0, "send"))
        return self.view(m)

    def _wait(self, h: Handle, where: Where) -> None:
        t0 = time.perf_counter()
        try:
            h.wait(self.deadline, where)
        finally:
            self.info.comm_seconds += time.perf_counter() - t0

    # -- receives ----------------------------------------------------------------
    def post_recvs(self, s: int, only: int | None = None) -> None:
        """Post the receives of step s (microshard ``only``, else all). In a call
        that skipped its agreement round, only one receive from a peer is posted
        until that peer's first message proved it makes this call (a
        :data:`~hopq.comm.framing.ANY_FIRST` receive, which any peer's first
        message fits); the others wait (:meth:`_validated`)."""
        for j in range(self.u) if only is None else (only,):
            if (s, j) in self.recvs:
                continue
            entries = []
            for t in self.schedule.recvs(self.rank, s):
                bounds = self.bound(t, j)
                total = sum(bounds)
                shapes = framing.expect(len(t.chunks), total, self.transport.short_messages)
                e = _Recv(t, self.where(s, j, t.phase), bounds, total, shapes)
                if not self.fast or t.src in self.validated:
                    self._post(e, shapes)
                elif t.src not in self.probed:
                    self.probed.add(t.src)
                    e.probe = True
                    self._post(e, [max(shapes[0], framing.ANY_FIRST)])
                else:
                    self.deferred.setdefault(t.src, []).append(e)
                entries.append(e)
            self.recvs[(s, j)] = entries

    def _post(self, e: _Recv, shapes: list[int]) -> None:
        src = e.t.src
        bufs = [self.transport.buffer(nb, self.device) for nb in shapes]
        _, handles = self.transport.post([], [(src, b) for b in bufs], e.where)
        e.bufs += bufs
        e.handles += handles
        self.fifo.setdefault(src, deque()).extend(zip(handles, bufs, strict=True))
        self.posted_n[src] = self.posted_n.get(src, 0) + len(bufs)

    def _take(self, e: _Recv, i: int) -> None:
        """Wait for e's i-th receive (the oldest still posted from its peer)."""
        h, _ = self.fifo[e.t.src].popleft()
        if h is not e.handles[i]:
            raise RuntimeError("hopq internal error: receives from a peer read out of order")
        self._wait(h, e.where)

    def _validated(self, e: _Recv) -> None:
        """A call that skipped its agreement round: check the header of e's first
        message against this rank's call (call number, identity, step);
        anything else (another call's message, a peer's END or refusal) raises
        :class:`_Foreign`. A peer's first message that passes lets the receives
        that waited for it be posted: the probe's body (when it travels apart),
        then the others, in order."""
        src = e.t.src
        words = framing.peek(e.bufs[0])
        if words is None:
            raise TransportError(
                f"rank {self.rank}: message from rank {src} in {e.where.describe()} is not a "
                "hopq message (bad header)"
            )
        ok = (
            framing.status_of(words[3]) == framing.OK
            and words[1] == self.call
            and words[2] == e.where.tag()
            and words[4] == self.ident
        )
        if not ok:
            raise _Foreign(src, words, e.where)
        if e.probe:
            e.probe = False
            self.validated.add(src)
            if len(e.shapes) == 2:  # its body travels apart: receive it now
                e.bufs[0] = e.bufs[0][: e.shapes[0]]
                self._post(e, e.shapes[1:])
            for d in self.deferred.pop(src, []):
                self._post(d, d.shapes)

    def process_recvs(self, s: int, j: int) -> None:
        self.received.add((s, j))
        for e in self.recvs.pop((s, j)):
            t, where, bounds, total = e.t, e.where, e.bounds, e.total
            self._take(e, 0)
            if self.fast:
                self._validated(e)
            for i in range(1, len(e.handles)):
                self._take(e, i)
            head, body = framing.unpack(e.bufs, len(t.chunks), total)
            lengths = framing.check(head, where, t.src, self.rank, bounds, self.exact(t))
            offset = 0
            for c, size in zip(t.chunks, lengths, strict=True):
                payload = body[offset : offset + size]
                offset += size
                self.process_payload(c, j, (s, t.src), t.phase, payload)

    def process_payload(
        self, c: int, j: int, s: tuple[int, int], phase: Phase, payload: torch.Tensor
    ) -> None:
        """Payload of part (c, j) received at (step, sender) ``s``."""
        m = self.part(c, j)
        ctx = self.ctxs[m]
        if phase is Phase.GATHER:
            self.finalize(m, payload)
            return
        local = self.own(m)
        owner = self.schedule.owner[c] == self.rank
        if self.last_recv[c] != s:
            self.codec.decode_accumulate(self.plan, payload, local, ctx)
        elif owner and not self.same:
            self.codec.decode_accumulate(self.plan, payload, local, ctx)
            self.finalize(m, self.gcodec.encode(self.gplan, local, ctx))
        else:
            out = self.codec.decode_accumulate_encode(self.plan, payload, local, ctx)
            if owner:
                self.finalize(m, out)
            else:
                self.outgoing[m] = out

    def finalize(self, m: int, payload: torch.Tensor) -> None:
        self.final[m] = payload
        self.prepared.add(m)  # overwritten by the decode: nothing left to prepare
        self.gcodec.decode(self.gplan, payload, self.ctxs[m], self.writable(m))
        if m not in self.finished and not _shares_memory(payload, self.work):
            self.finished.add(m)
            self.codec.finish_part(self.plan, self.work, m, self.op, self.n)

    # -- sends -------------------------------------------------------------------
    def build_and_post(self, s: int, j: int) -> None:
        """Encode and post this rank's messages of step s, microshard j."""
        for t in self.schedule.sends(self.rank, s):
            if (s, j, t.dst) in self.posted:
                continue
            where = self.where(s, j, t.phase)
            bounds = self.bound(t, j)
            payloads, reads = [], []
            for c in t.chunks:
                m = self.part(c, j)
                if t.phase is Phase.GATHER:
                    p = self.final[m]
                else:
                    p = (
                        self.outgoing.pop(m)
                        if m in self.outgoing
                        else (
                            self.codec.encode(self.plan, self.own(m), self.ctxs[m])  # leaf
                        )
                    )
                    reads.append(m)  # the payload may be a view of the chunk (fp32)
                payloads.append(p)
            lengths = [int(p.numel()) for p in payloads]
            exact = self.exact(t)
            for i, (nb, b) in enumerate(zip(lengths, bounds, strict=True)):
                if nb > b or (exact and nb != b):
                    raise CodecError(
                        f"rank {self.rank}: codec {self.codec.name!r} produced {nb} bytes for "
                        f"part {i} of {where.describe()}, the plan says {b}"
                    )
            body = payloads[0] if len(payloads) == 1 else torch.cat(payloads)
            header = framing.frame(where, lengths, ident=self.ident)
            pad = not exact and not self.transport.short_messages
            msg = framing.pack(header, body, sum(bounds), pad)
            handles, _ = self.transport.post([(t.dst, p) for p in msg], [], where)
            self.sent_n[t.dst] = self.sent_n.get(t.dst, 0) + len(msg)
            self.posted.add((s, j, t.dst))
            # the bytes that travel: the real sizes, or the bounds where padded
            self.info.payload_bytes += sum(bounds) if pad else int(body.numel())
            self.info.frame_bytes += int(header.numel())
            for h in handles:
                self.sends.append((h, where, msg))
                for m in reads:
                    self.pending_by_part.setdefault(m, []).append(h)

    def fail_remaining(self, steps: list[int], micro: int | None = None) -> None:
        """After a failure on this rank: tell every peer this rank still owes a
        message that it failed (a header with no payload), without waiting
        (``micro``: that microshard's messages only)."""
        for s in steps:
            for j in range(self.u) if micro is None else (micro,):
                for t in self.schedule.sends(self.rank, s):
                    if (s, j, t.dst) in self.posted:
                        continue
                    self.posted.add((s, j, t.dst))
                    where = self.where(s, j, t.phase)
                    header = framing.frame(where, [0] * len(t.chunks), framing.SENDER_FAILED)
                    msg = framing.pack(
                        header, None, sum(self.bound(t, j)), not self.transport.short_messages
                    )
                    try:
                        handles, _ = self.transport.post([(t.dst, p) for p in msg], [], where)
                    except Exception:  # noqa: BLE001 - best effort: that peer is gone
                        continue
                    self.sends += [(h, where, msg) for h in handles]

    def drain(self, steps: list[int], grace_s: float = 10.0) -> None:
        """After a failure: receive (and drop) every message the peers still send in
        this call (their data or their own failure notices), so that no stale
        message or posted receive is left to confuse the next call. Every rank
        posts all it still sends and receives before it waits on any of it, so
        the failing ranks cannot wait on each other."""
        grace = Deadline(max(0.1, min(grace_s, self.deadline.remaining())))
        try:
            for s in steps:
                for j in range(self.u):
                    # NCCL: the notices and receives of a microshard in one group, as
                    # its peers post theirs (a group of receives alone would wait for
                    # sends queued behind it)
                    # a peer whose pair is closed refuses the post: the others'
                    # receives are posted all the same, or their senders would wait
                    # the whole grace for this rank (Gloo sends when a receive is posted)
                    try:
                        with self.transport.batch():
                            if not self.transport.prepost:
                                self.fail_remaining([s], j)
                            if (s, j) not in self.received:
                                self.post_recvs(s, j)
                    except TransportError:
                        continue
            for (_s, _j), entries in sorted(self.recvs.items()):
                for e in entries:
                    for h in e.handles:
                        h.wait(grace, e.where)
            for h, where, _ in self.sends:
                h.wait(grace, where)
        except Exception:  # noqa: BLE001 - a peer is gone: the group is broken anyway
            pass
        self.recvs.clear()
        self.sends.clear()

    def wait_sends(self) -> None:
        for h, where, _ in self.sends:
            self._wait(h, where)
        self.sends.clear()
        self.pending_by_part.clear()


def run(call: Call, x: torch.Tensor, transport: Transport) -> tuple[torch.Tensor, RunStats]:
    """One compressed all-reduce (or, with ``call.gather=False``, reduce-scatter) of
    the flat tensor ``x`` on this rank. Returns the float32 result in ``x``'s layout
    (for reduce-scatter, valid only on the chunks this rank owns) and the stats.

    ``call.shards`` (n + 1 offsets into ``x``) lays the schedule over rank shards:
    rank r's result is ``shards[r]:shards[r + 1]`` of the reduced vector
    (:func:`~hopq.comm.topology.shard_layout`): the codec is asked to cut its
    schedule chunks there (``StatsExchange.bounds``), a reduce-scatter
    delivers to each rank the final payloads of its shard that another rank
    is the sink of, and ``info.owned`` is the rank's shard. A codec without
    ``chunk_local`` runs the whole all-reduce instead (each rank then holds
    everything). With ``gather=True`` the all-reduce runs over those chunks
    (its result, cut to a shard, is what the reduce-scatter gives that rank).
    ``call.premul``: reduce ``premul * x`` (torch's PREMUL_SUM), scaled before
    anything else.
    """
    return execute(plan_call(call, x, transport))


@dataclass
class Planned:
    """A call whose agreement and plan are done (:func:`plan_call`); its hops
    come next (:func:`execute`)."""

    r: _Resolved
    agreed: _Agreement
    stats: _StatsExchange
    plan: Plan
    gplan: Plan
    #: When the call began, and the CPU seconds its planning took (on the
    #: thread that planned it).
    t_start: float
    cpu_seconds: float

    @property
    def wait_seconds(self) -> float:
        """Seconds the planning waited on the transport (agreement, statistics)."""
        return self.stats.seconds + self.agreed.seconds


def plan_call(
    call: Call, x: torch.Tensor, transport: Transport, behind: Codec[Any] | None = None
) -> Planned:
    """The first half of :func:`run`: the call's agreement, statistics exchange
    and plan. ``behind``: a codec whose previous call on this rank is still
    running (its round not yet ended), for a caller that plans a call while the
    one before it is in its hops (the two-tier pipeline); this call's
    statistics then see the round that call's end opens, so its bits are those
    of planning after it (the codec must declare ``plans_ahead``)."""
    t_start = time.perf_counter()
    cpu_start = time.thread_time()
    calls = transport.calls
    try:
        r = _resolve(call, x, transport)
    except Exception:
        if transport.calls == calls:  # refused before it was numbered
            refuse(transport, call.timeout, f"all_reduce({call.codec.name})")
        raise
    if behind is not None and not (r.codec.plans_ahead and r.gcodec.plans_ahead):
        raise ValueError(f"{r.codec.name} cannot plan a call while its previous one runs")
    agreed = _agreement(r)
    try:
        stats, plan, gplan = _plan(r, agreed, 1 if behind is r.codec else 0)
    except BaseException as e:
        if agreed.skipped and not isinstance(e, KeyboardInterrupt):
            _settle_call(r, agreed, e)
        if not agreed.done and not isinstance(e, KeyboardInterrupt):
            # the plan failed before this rank's agreement message went out: the
            # peers learn it in that message's place instead of at their timeout
            # (peers whose call skips the round are settled at the next call)
            what = f"{r.label} failed on rank {transport.rank}"
            skips = agreed.may_skip and agreed.sig in transport.agreed
            notice_in_agreement(transport, r.number, what, None if skips else r.deadline)
        if (
            agreed.done
            and not agreed.failed
            and not isinstance(e, KeyboardInterrupt | MismatchError)
        ):
            _fail_peers(r)
        raise
    return Planned(r, agreed, stats, plan, gplan, t_start, time.thread_time() - cpu_start)


def execute(
    p: Planned,
    before_finish: Callable[[], None] | None = None,
    fail: BaseException | None = None,
    after_posts: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, RunStats]:
    """The second half of :func:`run`: the planned call's hops, then its finish.
    ``before_finish`` runs between the two (the codec's round is still open);
    ``after_posts`` once this rank's first messages are on their way (its
    first step's first microshard posted; with no messages, before the
    finish), for a caller that starts other work there rather than before
    them; ``fail``: this rank gives the call up instead of running its hops (it failed
    elsewhere after planning it): its peers get failure notices for what it
    owes them and what they send is drained, then ``fail`` is raised, as when
    a hop fails."""
    cpu_start = time.thread_time()
    r = p.r
    st = _stages(r, p.plan, p.gplan, p.agreed, fail, after_posts)
    if st.after_posts is not None:
        st.after_posts()
    if before_finish is not None:
        before_finish()
    y = _finish(r, st, p.stats, p.agreed)
    r.info.seconds = time.perf_counter() - p.t_start
    r.info.cpu_seconds = p.cpu_seconds + time.thread_time() - cpu_start
    return y, r.info


@dataclass(frozen=True)
class _Resolved:
    """A call as this rank runs it: the call's options resolved against the input
    and the transport (schedule, shard layout, microshards, call number)."""

    call: Call
    codec: Codec[Any]
    #: The all-gather stage's codec (``codec`` itself when there is none).
    gcodec: Codec[Any]
    #: The input (premultiplied when the call says so).
    x: torch.Tensor
    #: Whether the codec may work in ``x``'s memory.
    in_place: bool
    transport: Transport
    #: The topology's schedule for this world size.
    schedule: Schedule
    #: The schedule whose steps run: ``schedule``, or for a reduce-scatter over
    #: rank shards the layout's (the reduce phase, then the deliveries).
    steps: Schedule
    layout: ShardLayout | None
    #: The schedule chunks' bounds the codec is asked for (rank shards), or None.
    bounds: tuple[int, ...] | None
    #: False for a reduce-scatter (a codec without chunk_local runs an all-reduce).
    gather: bool
    #: The kind of call the ranks agree on ("all_reduce", "reduce_scatter", with the shards).
    kind: str
    #: The reduction the ranks agree on (with the PREMUL_SUM factor).
    op_name: str
    #: The transport's call number (every rank's same call has the same number).
    number: int
    label: str
    deadline: Deadline
    #: Microshards per schedule chunk.
    u: int
    info: RunStats


def _resolve(call: Call, x: torch.Tensor, transport: Transport) -> _Resolved:
    """Check the call against the input and settle what the engine runs: refusals
    raise here, before the transport numbers the call."""
    codec, gcodec = call.codec, call.stage_codec
    # a codec that cannot serve this size names one that can, for the whole call
    # (from the size alone: every rank decides alike, and agrees on it below)
    fallback = codec.small_call_codec(x.numel(), call.key, call.shards, 2 if call.gather else 1)
    if fallback is not None:
        codec = gcodec = fallback
    n = transport.world_size
    schedule = get_schedule(call.topology, n)
    if gcodec is not codec and not gcodec.gather_stage:
        gcodec.plan_gather(0, ())  # raises its reason
    gather, layout, shards = call.gather, None, call.shards
    if shards is not None:
        if shards[-1:] != (x.numel(),):
            raise ValueError(f"shards {shards} do not end at the tensor's {x.numel()} entries")
        layout = shard_layout(schedule, shards)
        if not codec.chunk_local:  # the fallback: an all-reduce, each rank keeps its shard
            gather = True
    bounds = layout.bounds if layout is not None and codec.chunk_local else None
    steps = schedule
    if layout is not None and bounds is not None and not gather:
        steps = layout.reduce_scatter
    kind = "all_reduce" if gather else "reduce_scatter"
    in_place, premul = call.in_place, call.premul
    if premul is not None:
        premul = float(premul)
        x = x.to(torch.float32) * premul
        in_place = True  # our own copy
    for c in {id(codec): codec, id(gcodec): gcodec}.values():
        c.warm_up(x.device)  # compiling does not count against the timeout
    _note_long_chain(codec.name, schedule)  # before the number: a warning made an error refuses
    deadline = Deadline(transport.call_timeout(call.timeout))
    number = transport.next_call(deadline)
    u = (
        call.microshards
        if call.microshards is not None
        else auto_microshards(x.numel(), schedule.n_chunks, n, codec.microshard_coords)
    )
    return _Resolved(
        call=call,
        codec=codec,
        gcodec=gcodec,
        x=x,
        in_place=in_place,
        transport=transport,
        schedule=schedule,
        steps=steps,
        layout=layout,
        bounds=bounds,
        gather=gather,
        kind=kind if shards is None else f"{kind} over shards #{digest(shards):x}",
        op_name=ReduceOp(call.op).value if premul is None else f"premul_sum({premul!r})",
        number=number,
        label=f"{kind}({codec.name}, {schedule.topology}, key={call.key})",
        deadline=deadline,
        u=u,
        info=RunStats(
            transport.rank,
            n,
            x.numel(),
            hops_per_chunk=max(schedule.compression_chains()),
            fallback=None if fallback is None else fallback.name,
        ),
    )


def refuse(transport: Transport, timeout: float | None, what: str) -> None:
    """This rank refused a call before its agreement (its arguments): number it,
    as the peers number the call they make, and tell them in the agreement's
    place (a failure notice where the fingerprint goes), so that their call
    raises TransportError naming this rank at once, and this rank's next call
    pairs with their next call. Nothing waits here: the notices and the
    receives of the peers' agreement messages (dropped) complete at this
    transport's next call (:meth:`~hopq.comm.transport.Transport.next_call`).
    Beyond :data:`~hopq.comm.transport.DIRECT_EXCHANGE_MAX` ranks (where the
    agreement is an all-gather) only the number counts. Best effort."""
    ok = isinstance(timeout, int | float) and 0 < timeout < float("inf")
    try:
        deadline = Deadline(transport.call_timeout(timeout if ok else None))
        number = transport.next_call(deadline)
    except Exception:  # noqa: BLE001 - the refusal's own error is what the caller sees
        return
    notice_in_agreement(transport, number, f"{what} refused on rank {transport.rank}")


def notice_in_agreement(
    transport: Transport, number: int, what: str, deadline: Deadline | None = None
) -> None:
    """Tell every peer, in the place of call ``number``'s agreement message, that
    this rank gave the call up before its agreement (:func:`refuse`). With
    ``deadline`` the peers are in that call's agreement round (the call did not
    skip it, so neither did theirs): their messages are taken here, within it."""
    n = transport.world_size
    if n == 1 or n > DIRECT_EXCHANGE_MAX:
        return
    where = Where(what, number, -1000, 0, "agreement")
    block = 8 * (len(agreement.FIELDS) + 1) + agreement.FOLD_BYTES
    bound = block + TAIL_BYTES if tails_ride(transport) else block
    header = framing.frame(where, [0], framing.SENDER_FAILED)
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    # peers whose call skipped its agreement round send the call's messages
    # instead: the first fits a receive of ANY_FIRST, the rest are settled then
    settles = transport.skips_agreement and deadline is None
    for q in range(n):
        if q != transport.rank:
            sends += [
                (q, p) for p in framing.pack(header, None, bound, not transport.short_messages)
            ]
            shapes = framing.expect(1, bound, transport.short_messages)
            if settles:
                shapes = [max(shapes[0], framing.ANY_FIRST)]
            recvs += [(q, torch.empty(nb, dtype=torch.uint8)) for nb in shapes]
    try:
        with transport.batch():
            sh, rh = transport.post(sends, recvs, where)
    except Exception:  # noqa: BLE001 - a peer is gone: its own call fails anyway
        return
    if deadline is not None:
        for h in [*rh, *sh]:
            with contextlib.suppress(Exception):  # best effort, as the notices
                h.wait(deadline, where)
        return
    transport.owed += [(h, where) for h in sh]
    if settles:
        transport.unsettled = (
            where,
            {q: (h, b) for (q, b), h in zip(recvs, rh, strict=True)},
        )
    else:
        transport.owed += [(h, where) for h in rh]


def _agreement(r: _Resolved) -> _Agreement:
    """Step 1: what every rank must make the same of this call. It runs when the
    codec's statistics first move (riding with them) or, for a codec without
    statistics, on its own right after the plan."""
    call, codec, x = r.call, r.codec, r.x
    mine = agreement.fingerprint(
        call=r.number, x=x, codec=codec, gather_codec=r.gcodec, topology=r.schedule.topology,
        op=r.op_name, seed=call.seed, key=call.key, kind=r.kind, microshards=r.u,
    )  # fmt: skip
    rnd = codec.round

    def describe() -> dict[str, str]:  # for a MismatchError's message only
        return {
            "numel": str(x.numel()),
            "dtype": str(x.dtype),
            "device": x.device.type,
            "codec": codec.name,
            "config": repr(codec.config),
            "gather codec": r.gcodec.name,
            "topology": r.schedule.topology,
            "op": r.op_name,
            "seed": str(call.seed),
            "round": str(rnd),
            "key": str(call.key),
            "kind": r.kind,
            "microshards": str(r.u),
        }

    fold = codec.first_stats_nbytes
    agreed = _Agreement(
        r.transport, mine, r.deadline, Where(r.label, r.number, -1000, 0, "agreement"), describe,
        fold if fold is not None and fold <= agreement.FOLD_BYTES else None,
    )  # fmt: skip
    agreed.done = agreed.done or not call.agree  # the caller agreed on it (a tier)
    t = r.transport
    agreed.may_skip = (
        SKIP_AGREED
        and not agreed.done
        and t.skips_agreement
        and 1 < t.world_size <= DIRECT_EXCHANGE_MAX
        and codec.first_stats_nbytes is None
        and _stateless(codec)
        and _stateless(r.gcodec)
    )
    if agreed.may_skip:
        fields = dict(zip(agreement.FIELDS, mine, strict=True))
        gname = digest((r.gcodec.name, repr(r.gcodec.config))) if r.gcodec is not codec else 0
        agreed.sig = digest(
            tuple(
                v for f, v in fields.items() if f not in ("call", "state", "gather codec", "round")
            )
            + (gname,)
        )
        agreed.pattern = (r.schedule.topology, r.kind)
    return agreed


def _stateless(codec: Codec[Any]) -> bool:
    """Whether a codec's agreed state is its round counter alone (no adaptive state
    that could change its messages from call to call)."""
    return bool(codec.agreed_state() == {"round": codec.round})


def _plan(r: _Resolved, agreed: _Agreement, ahead: int = 0) -> tuple[_StatsExchange, Plan, Plan]:
    """Step 2: the codec's statistics exchange and its plan (and the gather
    stage's), identical on every rank. ``ahead``: rounds the codec's counter
    is behind this call's (:func:`plan_call`)."""
    call, codec, schedule, u = r.call, r.codec, r.schedule, r.u
    r.info.microshards = u
    stats = _StatsExchange(
        r.transport, schedule.n_chunks, u, call.seed, codec.round + ahead, call.key, r.deadline,
        Where(r.label, r.number, -1, 0, "statistics"), agreed,
    )  # fmt: skip
    stats.reduce_depth = max(schedule.reduce_depths(), default=0)
    stats.bounds = r.bounds
    stats.phases = 2 if r.gather else 1
    plan = codec.plan(r.x, stats)
    if not agreed.done and not agreed.skip():  # a codec without statistics: on its own
        agreed.run()
        agreed.remember()
    if len(plan.chunks) != r.steps.n_chunks * u:
        raise RuntimeError(
            f"{codec.name} planned {len(plan.chunks)} chunks, the schedule needs "
            f"{r.steps.n_chunks} x {u} microshards"
        )
    gplan = plan if r.gcodec is codec else r.gcodec.plan_gather(plan.work_numel, plan.chunks)
    if codec.variable_size and not r.transport.short_messages and codec.name not in _PADDED:
        _PADDED.add(codec.name)
        bits = 8 * sum(plan.payload_nbytes) / max(1, plan.work_numel)
        warnings.warn(
            f"{codec.name}: this backend (NCCL) takes receives of the exact size only, so its "
            f"variable-size payloads travel padded to their bound, {bits:.0f} bits per "
            "coordinate whatever they compress to; over Gloo they travel at their size",
            RuntimeWarning,
            stacklevel=3,
        )
    return stats, plan, gplan


def _stages(
    r: _Resolved,
    plan: Plan,
    gplan: Plan,
    agreed: _Agreement,
    fail: BaseException | None = None,
    after_posts: Callable[[], None] | None = None,
) -> _Hops:
    """Step 3: the schedule's steps, reduce and gather stages, on the codec's
    working vector. On a failure this rank tells its peers what it still owes
    them and drains what they still send, then raises; in a call that skipped
    its agreement round, it settles with every peer instead
    (:func:`_settle_call`). ``fail``: such a failure before the first step."""
    codec, gcodec, schedule, transport, u = r.codec, r.gcodec, r.steps, r.transport, r.u
    try:
        work = codec.prepare(plan, r.x, r.in_place)
    except BaseException as e:
        if agreed.skipped and not isinstance(e, KeyboardInterrupt):
            _settle_call(r, agreed, e)  # the peers are in their hops already
        raise
    st = _Hops(
        codec, gcodec, plan, gplan, work, schedule, transport, r.call.seed, u, r.deadline,
        r.label, r.number, r.info,
    )  # fmt: skip
    st.op = r.call.op
    st.fast, st.ident = agreed.skipped, agreed.ident
    st.after_posts = after_posts
    # a reduce-scatter skips the gather steps, but for the deliveries to rank shards
    active = (
        list(range(len(schedule.steps)))
        if r.gather or r.bounds is not None
        else schedule.reduce_steps()
    )
    probes = 0
    if st.fast:  # one receive per peer posted ANY_FIRST large
        srcs = {t.src for i in active for t in schedule.recvs(transport.rank, i)}
        probes = len(srcs) * (framing.ANY_FIRST + 64)
    transport.reserve(_recv_bytes(st, active) + probes, work.device)
    try:
        for c in schedule.owned_chunks(transport.rank):
            if c not in st.last_recv:  # a sink with no children (world size 1)
                for j in range(u):
                    m = st.part(c, j)
                    st.finalize(m, gcodec.encode(gplan, st.own(m), st.ctxs[m]))
        if fail is not None:
            raise fail
        _hops(st, active, r.call.pipeline and transport.prepost)
    except BaseException as e:
        if st.fast and not isinstance(e, KeyboardInterrupt):
            _settle_call(r, agreed, e, st)
        if not isinstance(e, KeyboardInterrupt):
            if transport.prepost:
                st.fail_remaining(active)
            # on NCCL it sends the notices too, batched with its receives; after a
            # peer's failure, briefly: the peers may have failed before their hops
            st.drain(active, DRAIN_AFTER_PEER_S if isinstance(e, TransportError) else DRAIN_S)
        raise
    st.wait_sends()
    if st.outgoing:
        raise RuntimeError(
            f"schedule left partial sums unsent on rank {transport.rank}: "
            f"parts {sorted(st.outgoing)}"
        )
    return st


def _note_long_chain(codec: str, schedule: Schedule) -> None:
    """Say once per codec, schedule and world size when the schedule's chain of
    recompressions makes a lossy codec's error grow far beyond a short chain's
    (:func:`hopq.comm.plan.long_chain_note`): a flat ring over a large cluster
    would otherwise degrade the gradient without a word."""
    key = (codec, schedule.topology, schedule.world_size)
    if schedule.world_size <= 8 or key in _LONG_CHAINS:
        return
    _LONG_CHAINS.add(key)
    from hopq.comm.plan import long_chain_note  # plan -> cost -> hierarchy -> engine

    chain = max(schedule.compression_chains())
    note = long_chain_note(codec, schedule.topology, schedule.world_size, chain)
    if note is not None:
        warnings.warn(note, RuntimeWarning, stacklevel=5)


_LONG_CHAINS: set[tuple[str, str, int]] = set()


#: Seconds a failed rank waits, at most, for the messages its peers still send in
#: the call (:meth:`_Hops.drain`), so that the group stays usable; after a peer's
#: failure (a TransportError) less: peers that failed before their hops
#: (:func:`_fail_peers`) send nothing more, and the wait only delays the error.
DRAIN_S = 10.0
DRAIN_AFTER_PEER_S = 1.0


def _fail_peers(r: _Resolved) -> None:
    """This rank failed after the agreement began and before its hops (a peer
    died in the statistics exchange, its codec's plan raised): tell every peer,
    without waiting, so that a peer still waiting for a message from this rank
    (a statistics round, a step) raises at once instead of at its timeout.
    The notice takes the place of whatever the peer's next receive from this
    rank expects: a header that says this rank failed, then one byte for a
    receive whose body is posted apart. Only where receives take shorter
    messages (Gloo, the simulator); on NCCL the peers wait for their timeout."""
    transport = r.transport
    if transport.world_size == 1 or not (transport.prepost and transport.short_messages):
        return
    where = Where(r.label, r.number, -1, 0, "statistics")
    # a header, then one byte: SPLIT says so (what a settling peer reads by)
    header = framing.set_split(framing.frame(where, [0], framing.SENDER_FAILED))
    for q in range(transport.world_size):
        if q != transport.rank:
            try:  # best effort: a peer that is gone refuses the post
                transport.post([(q, header), (q, torch.zeros(1, dtype=torch.uint8))], [], where)
            except Exception:  # noqa: BLE001, S112
                continue


def _settle_call(
    r: _Resolved, agreed: _Agreement, error: BaseException, st: _Hops | None = None
) -> None:
    """A call that skipped its agreement round failed on this rank (``error``):
    a peer's message was not of this call, a peer ended or refused it, or this
    rank failed. Settle the call's messages with every peer
    (:mod:`hopq.comm.settle`), then raise what every rank raises: after a
    disagreement, MismatchError from an agreement round (naming the fields, as
    the round at the start of the call would have); after a refusal or a
    failure, TransportError naming the rank (this rank's own error where it
    failed)."""
    transport, rank = r.transport, r.transport.rank
    status = error.status if isinstance(error, _Foreign) else framing.END_FAILED
    origin = -1 if isinstance(error, TransportError) else rank  # a peer's, or this rank's
    streams: dict[int, settle.Stream] = {}
    for q in range(transport.world_size):
        if q == rank:
            continue
        s = settle.Stream(q)
        if st is not None:
            s.pending = st.fifo.get(q, deque())
            s.sent, s.posted = st.sent_n.get(q, 0), st.posted_n.get(q, 0)
        if isinstance(error, _Foreign) and error.peer == q:
            settle.note(s, error.words, first=False)
            origin = s.origin
        streams[q] = s
    where = Where(r.label, r.number, -1, 0, "settling")
    sends = [h for h, _, _ in st.sends] if st is not None else []
    try:
        ends = settle.settle(transport, streams, status, r.deadline, where, sends, origin)
    except Exception as e:  # noqa: BLE001 - a peer is gone: its error, or this rank's own
        if isinstance(error, _Foreign | KeyboardInterrupt):
            raise e from error
        raise error from None
    if st is not None:
        st.sends.clear()
        st.recvs.clear()
    refused = sorted(q for q, v in ends.items() if v == framing.SENDER_FAILED)
    if refused:
        raise TransportError(
            f"rank {rank}: rank {refused[0]} failed in {r.label}, call {r.number}, and sent "
            f"no payload (see rank {refused[0]}'s error)"
        ) from None
    if framing.END_MISMATCH in {status, *ends.values()}:
        agreement.agree(
            transport, agreed.mine, r.deadline, agreed.where, agreed.describe, settled=True
        )
    if not isinstance(error, _Foreign | TransportError):
        raise error
    # the ranks that failed, as every END_FAILED reports them (the same everywhere)
    failed = sorted(
        {s.origin for s in streams.values() if s.ended == framing.END_FAILED and s.origin >= 0}
        | ({origin} if origin >= 0 else set())
    )
    who = f"rank {failed[0]}" if failed else "a rank"
    raise TransportError(
        f"rank {rank}: {who} failed in {r.label}, call {r.number}, and sent no more "
        f"payload (see {'its' if failed else 'their'} error)"
    ) from None


def _finish(r: _Resolved, st: _Hops, stats: _StatsExchange, agreed: _Agreement) -> torch.Tensor:
    """Step 4: account the call in ``r.info``, and let the codec undo its transform."""
    info, plan, schedule, rank = r.info, st.plan, r.steps, r.transport.rank
    info.stats_bytes = stats.bytes
    info.frame_bytes += stats.frame_bytes + agreed.bytes
    info.comm_seconds += stats.seconds + agreed.seconds
    info.owned = tuple(
        plan.chunks[st.part(c, j)] for c in schedule.owned_chunks(rank) for j in range(r.u)
    )
    if r.layout is not None:
        info.owned = ((r.layout.shards[rank], r.layout.shards[rank + 1]),)
    if not r.gather:
        info.phases = ("reduce",)
    for m in range(len(plan.chunks)):
        if m not in st.prepared:  # e.g. parts a reduce-scatter never moves
            st.own(m)
    y = r.codec.finish(plan, st.work, r.call.op, r.transport.world_size)
    r.codec.end_round(plan)
    if r.gcodec is not r.codec:
        r.gcodec.end_round(st.gplan)
    return y


#: Codecs already warned that their payloads travel padded (NCCL).
_PADDED: set[str] = set()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' storages are the same (a payload that is a view of the
    working vector must not see the vector change under it)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _recv_bytes(st: _Hops, active: list[int]) -> int:
    total = 0
    for s in active:
        for t in st.schedule.recvs(st.rank, s):
            for j in range(st.u):
                for nb in framing.expect(
                    len(t.chunks), sum(st.bound(t, j)), st.transport.short_messages
                ):
                    total += (nb + 63) // 64 * 64
    return total


def _hops(st: _Hops, active: list[int], pipelined: bool) -> None:
    """Run the steps. Pipelined: the next step's receives are posted ahead, every
    message of a step is sent before any of its receives is processed, and a
    microshard's next-step message leaves as soon as that microshard is done.
    Serial: post, wait and process each (step, microshard) in turn, its
    receives and sends as one group (NCCL needs that; see Transport.batch)."""
    u = st.u
    if not pipelined:
        for s in active:
            for j in range(u):
                with st.transport.batch():
                    st.post_recvs(s, j)
                    try:
                        st.build_and_post(s, j)
                    except BaseException:
                        st.fail_remaining([s], j)  # the notices ride in this group
                        raise
                st.posted_first()
                st.process_recvs(s, j)
                st.wait_sends()
        return
    if active:
        st.post_recvs(active[0])
    for idx, s in enumerate(active):
        nxt = active[idx + 1] if idx + 1 < len(active) else None
        if nxt is not None:
            st.post_recvs(nxt)
        for j in range(u):
            st.build_and_post(s, j)
            st.posted_first()
        for j in range(u):
            st.process_recvs(s, j)
            if nxt is not None:
                st.build_and_post(nxt, j)  # its parts are ready: send it now
