"""The two-tier all-reduce: N nodes x G workers (DESIGN.md, "Two tiers").

A flat schedule over all P = N x G ranks recompresses the vector on every hop,
the fast intra-node hops included. The two-tier all-reduce is a composition of
flat calls, each run by :func:`hopq.comm.engine.run` on a view of the group
(:class:`~hopq.comm.transport.SubTransport`):

1. **intra-node reduce-scatter** over the node's G ranks with the intra codec
   (default ``"fp32"``: exact float32 sums): local rank g ends with node-shard
   g of the node's sum (G near-equal shards, ``equal_shards``);
2. **inter-node all-reduce** of node-shard g among the N ranks with local rank g,
   with the call's codec, topology and gather codec: those N ranks hold
   bit-identical results;
3. **intra-node all-gather** of the node-shards as raw bytes (in the input's
   dtype when it is 16-bit, else float32, what the result is cast to anyway):
   every rank holds the same bits.

So the vector is compressed only on the inter-node hops. Before any of it, the
ranks agree over the whole group on the call and on the layout (its string is
part of the fingerprint; each rank's claim of its node rides along, and for
``"auto"`` the claims make the layout), so that ranks with different layouts
raise :class:`~hopq.MismatchError` on every rank and inconsistent claims the
same ValueError on every rank, before any data moves; the intra-node tier
then runs without an agreement of its own (the inter-node tier keeps its own:
each inter-node group has its codec's adaptive state). A layout with one node
or one worker per node has one tier: the call is the flat call over the group.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from hopq.codecs.base import Codec, ReadsOptimizer, ReduceOp
from hopq.codecs.uncompressed import Fp32
from hopq.comm import agreement, engine, framing, shm
from hopq.comm import layout as layouts
from hopq.comm.agreement import digest
from hopq.comm.call import Call
from hopq.comm.engine import RunStats
from hopq.comm.framing import Deadline, Where
from hopq.comm.layout import NodeLayout
from hopq.comm.topology import equal_shards, ring
from hopq.comm.transport import (
    DIRECT_EXCHANGE_MAX,
    SubTransport,
    Transport,
)
from hopq.errors import TransportError

#: The topology of the intra-node reduce-scatter.
INTRA_TOPOLOGY = "ring"
#: Header steps of the whole-group agreement, of the node all-gather and of the
#: shared-memory reduce-scatter's doorbells (minus the piece's index).
_AGREE_STEP, _GATHER_STEP, _SHARED_STEP = -3000, -2000, -2500


def views(transport: Transport, layout: NodeLayout) -> tuple[SubTransport, SubTransport]:
    """This rank's intra-node and inter-node views of ``transport`` (kept per
    transport and layout)."""
    # kept on the transport itself (their call counters and receive arenas live
    # as long as it does; a table beside it would keep it alive through them)
    per: dict[NodeLayout, tuple[SubTransport, SubTransport]] | None
    per = getattr(transport, "_tier_views", None)
    if per is None:
        per = {}
        transport._tier_views = per  # type: ignore[attr-defined]
    if layout not in per:
        rank = transport.rank
        per[layout] = (
            SubTransport(transport, layout.node_ranks(layout.node_of[rank])),
            SubTransport(transport, layout.peers(rank)),
        )
    return per[layout]


#: The tag of the second inter-node view (:func:`ahead_view`).
AHEAD_TAG = 1


def ahead_view(transport: Transport, layout: NodeLayout) -> SubTransport:
    """This rank's second inter-node view of ``transport``: the same ranks as
    :func:`views`' inter-node view under another tag, so that a pipeline's
    next piece can be planned on one while the current piece's hops run on
    the other (kept per transport and layout)."""
    per: dict[NodeLayout, SubTransport] | None = getattr(transport, "_ahead_views", None)
    if per is None:
        per = {}
        transport._ahead_views = per  # type: ignore[attr-defined]
    if layout not in per:
        per[layout] = SubTransport(transport, layout.peers(transport.rank), tag=AHEAD_TAG)
    return per[layout]


def _op_name(call: Call) -> str:
    return ReduceOp(call.op).value if call.premul is None else f"premul_sum({call.premul!r})"


def agree_layout(
    call: Call,
    x: torch.Tensor,
    transport: Transport,
    spec: NodeLayout | str,
    intra: Codec,
    deadline: Deadline,
) -> tuple[NodeLayout, int, float]:
    """The whole group's agreement on the call and its layout; returns the layout,
    the agreement's bytes and its seconds. Ranks whose calls or layout strings
    differ raise MismatchError (every rank); claims that do not make a layout
    raise the same ValueError on every rank."""
    t0 = time.perf_counter()
    number = transport.next_call()
    n = transport.world_size
    desc = spec if isinstance(spec, str) else spec.describe()
    what = "all_reduce" if call.gather else f"reduce_scatter over shards #{digest(call.shards):x}"
    kind = f"two-tier {what}, layout {desc}, intra codec {intra.name} {intra.config!r}"
    mine = agreement.fingerprint(
        call=number, x=x, codec=call.codec, gather_codec=call.stage_codec,
        topology=call.topology, op=_op_name(call), seed=call.seed, key=call.key, kind=kind,
        microshards=0,
    )  # fmt: skip
    # each inter-node group keeps its own adaptive state (its tier's agreement checks it)
    mine[agreement.FIELDS.index("state")] = 0
    describe = {
        "numel": str(x.numel()),
        "dtype": str(x.dtype),
        "device": x.device.type,
        "codec": call.codec.name,
        "config": repr(call.codec.config),
        "gather codec": call.stage_codec.name,
        "topology": call.topology,
        "op": _op_name(call),
        "seed": str(call.seed),
        "round": str(call.codec.round),
        "key": str(call.key),
        "kind": kind,
        "microshards": "0",
    }
    claim = torch.tensor(layouts.claim_of(spec, transport.rank, n), dtype=torch.int64)
    label = f"{what.split()[0]}({call.codec.name}, {call.topology}, layout {desc}, key={call.key})"
    extras, _ = agreement.agree(
        transport, mine, deadline, Where(label, number, _AGREE_STEP, 0, "layout agreement"),
        describe, extra=claim,
    )  # fmt: skip
    assert extras is not None
    claims = [tuple(int(v) for v in e.view(torch.int64).tolist()) for e in extras]
    lay = layouts.from_claims(claims, spec)  # type: ignore[arg-type]
    return lay, layout_agreement_bytes(n), time.perf_counter() - t0


def layout_agreement_bytes(n: int) -> int:
    """Bytes one rank sends in the whole group's agreement of a two-tier call."""
    block = 8 * (len(agreement.FIELDS) + 1) + agreement.FOLD_BYTES
    messages = n - 1 if n <= DIRECT_EXCHANGE_MAX else max(1, (n - 1).bit_length())
    return (n - 1) * block + messages * framing.header_nbytes(1)


def run(
    call: Call,
    x: torch.Tensor,
    transport: Transport,
    layout: NodeLayout | str,
    intra: Codec,
) -> tuple[torch.Tensor, RunStats]:
    """The two-tier all-reduce of the flat tensor ``x`` on this rank: the float32
    result (the same bits on every rank) and this rank's stats, whose ``tiers``
    hold the intra-node (reduce-scatter and all-gather together) and inter-node
    calls' own stats.

    ``layout``: a :class:`NodeLayout` or ``"auto"`` (torchrun's environment, else
    the hosts); ``intra``: the intra-node codec (a fresh instance per call: its
    state does not carry). ``call`` must be an all-reduce (``gather=True``,
    no ``shards``).
    """
    if not call.gather or call.shards is not None:
        raise ValueError("the two-tier call is an all-reduce (gather=True, no shards)")
    t_start, cpu_start = time.perf_counter(), time.thread_time()
    n = transport.world_size
    if n == 1:
        if isinstance(layout, NodeLayout) and layout.world_size != 1:
            raise ValueError(
                f"layout {layout.describe()} places {layout.world_size} ranks, the group has 1"
            )
        return engine.run(call, x, transport)
    deadline, lay, agree_bytes, agree_s = _start(call, x, transport, layout, intra)

    def left() -> float:
        return _left(deadline)

    if lay.flat:
        y, info = engine.run(replace(call, timeout=left()), x, transport)
        tier = replace(info)
        info.tiers = {"inter" if lay.nodes > 1 else "intra": tier}
        info.frame_bytes += agree_bytes
        info.comm_seconds += agree_s
        info.seconds = time.perf_counter() - t_start
        info.cpu_seconds = time.thread_time() - cpu_start
        return y, info
    intra_t, inter_t = views(transport, lay)
    cuts = tier_pieces(x.numel(), lay.per_node)
    tiers = _Pipeline(call, x, intra_t, inter_t, lay, intra, deadline, cuts)
    y, intra_stats, s2 = tiers.run()
    info = call_stats(
        transport.rank, n, x.numel(), intra_stats, s2, agree_bytes,
        seconds=time.perf_counter() - t_start, comm_seconds=agree_s + tiers.comm_seconds,
        cpu_seconds=time.thread_time() - cpu_start + tiers.worker_cpu + tiers.ahead_cpu,
    )  # fmt: skip
    return y, info


#: Coordinates per piece of a pipelined two-tier all-reduce, and the most pieces
#: (4 Gloo ranks as 2 emulated nodes of 2 at 200 Mbit/s, DynamiQ at 16 MiB: 1
#: piece 161-175 ms a call, 3 pieces 148-158, 4 pieces 153-158, 8 pieces of half
#: the size 174-190: each piece's inter-node call pays its own round trips).
PIECE_COORDS = 1 << 20
MAX_PIECES = 8


def intra_call(call: Call, intra: Codec, shards: tuple[int, ...], timeout: float) -> Call:
    """The intra-node reduce-scatter of a piece of ``call`` over its node-shards
    ``shards`` (offsets within the piece), with the intra-node codec ``intra``."""
    return Call(
        codec=intra, topology=INTRA_TOPOLOGY, op=ReduceOp.SUM, seed=call.seed, key=call.key,
        timeout=timeout, premul=call.premul, gather=False, shards=shards, microshards=None,
        pipeline=call.pipeline, in_place=call.in_place, agree=False,
    )  # fmt: skip


def inter_call(call: Call, a: int, b: int, timeout: float) -> Call:
    """The inter-node all-reduce of the node-shard ``[a, b)`` of ``call``'s
    vector (a sum: an average divides at the end), under its own key (what the
    optimizer gave the bucket's key, DynamiQ's step sizes or GComp's
    thresholds, is cut to the node-shard for it)."""
    key2 = shard_key(call.key, a, b)
    if isinstance(call.codec, ReadsOptimizer):
        call.codec.narrow_optimizer_input(call.key, a, b, key2)
    return replace(call, op=ReduceOp.SUM, premul=None, timeout=timeout, shards=None, key=key2)


def piece_node_shard(cuts: tuple[int, ...], j: int, per_node: int, g: int) -> tuple[int, int]:
    """``[a, b)``: local rank ``g``'s node-shard of piece ``j``, in the whole vector."""
    ns = equal_shards(cuts[j + 1] - cuts[j], per_node)
    return cuts[j] + ns[g], cuts[j] + ns[g + 1]


def tier_pieces(numel: int, per_node: int) -> tuple[int, ...]:
    """Offsets of the pieces of a two-tier all-reduce of ``numel`` entries (a
    function of the size alone, so the same on every rank and in the simulator):
    one piece below 2 x :data:`PIECE_COORDS` entries, else up to
    :data:`MAX_PIECES` near-equal pieces of at least :data:`PIECE_COORDS`. The
    pieces run as a pipeline: piece k's inter-node all-reduce while piece k + 1
    is reduced and piece k - 1 gathered inside the node."""
    k = max(1, min(MAX_PIECES, numel // PIECE_COORDS))
    if numel < k * per_node:
        k = 1
    return tuple(equal_shards(numel, k))


class _Pipeline:
    """The tiers of one two-tier all-reduce over the pieces ``cuts``.

    With one piece the tiers run one after another on the calling thread. With
    several, a worker thread runs the intra-node tier (every piece's
    reduce-scatter in order, then every piece's all-gather in order, each as
    soon as its inter-node all-reduce is done) while the calling thread runs
    the inter-node all-reduces in order. The two views share no pair of ranks,
    so their messages never meet, and each view is used by one thread. Every
    piece is its own two-tier call with the node-shards of that piece, so the
    result depends on the cuts alone, not on the timing.

    Where the codec plans ahead (``Codec.plans_ahead``) and the transport
    takes tags (Gloo, the simulator), piece k + 1's inter-node call is planned
    (its agreement and statistics exchange) on a helper thread while piece k's
    hops run, on a second inter-node view under another tag: the pieces
    alternate between the two views, and the link carries piece k + 1's
    statistics while piece k's payloads still flow. Piece k's round ends only
    after that plan, and the plan takes the round piece k's end opens, so the
    bits are those of planning the pieces one after another.

    Failures keep every rank in step: a rank whose reduce-scatter of a piece
    failed sends its inter-node peers a failure notice for that piece and every
    later one (:func:`fail_inter_agreement`), and a rank whose inter-node tier
    failed gathers every later piece with failure notices
    (:func:`node_gather`), so that every rank raises at once.
    """

    def __init__(
        self,
        call: Call,
        x: torch.Tensor,
        intra_t: SubTransport,
        inter_t: SubTransport,
        lay: NodeLayout,
        intra: Codec,
        deadline: Deadline,
        cuts: tuple[int, ...],
    ) -> None:
        self.call, self.x, self.intra_t, self.inter_t = call, x, intra_t, inter_t
        self.lay, self.intra, self.deadline, self.cuts = lay, intra, deadline, cuts
        self.k = len(cuts) - 1
        self.g, self.per = intra_t.rank, lay.per_node
        #: The node's shared memory when the intra-node tier goes through it
        #: (chosen at the first piece's reduce-scatter), else None: messages.
        self.memory: shm.NodeMemory | None = None
        self.wire = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        #: Whether each piece's result goes straight into the input's memory
        #: (the call may work there, in float32): no assembling at the end and
        #: no copy back, which shortens the call's tail.
        self.direct = call.in_place and x.dtype == torch.float32 and x.is_contiguous()
        self.reduced: queue.Queue[tuple[torch.Tensor, RunStats] | BaseException] = queue.Queue()
        self.summed: queue.Queue[torch.Tensor | None] = queue.Queue()
        self.gathered: list[list[torch.Tensor]] = []
        self.intra_failure: BaseException | None = None
        self.rs_stats: list[RunStats] = []
        self.gather_s = self.gather_cpu = self.worker_cpu = 0.0
        self.comm_seconds = 0.0
        #: Seconds the calling thread waited for the worker (its pieces' reduce-scatters and gathers).
        self.waited = 0.0
        codecs = (call.codec, call.stage_codec)
        #: The inter-node views the pieces alternate between: two where the next
        #: piece is planned while the current one's hops run, else one.
        self.inter_views: tuple[SubTransport, ...] = (inter_t,)
        if (
            self.k > 1
            and all(c.plans_ahead for c in codecs)
            and inter_t.prepost
            and inter_t.short_messages
        ):
            self.inter_views = (inter_t, ahead_view(inter_t.parent, lay))
        #: CPU seconds the helper threads spent planning pieces ahead.
        self.ahead_cpu = 0.0
        #: Set once the first piece is planned: the worker's next reduce-scatters
        #: wait for it, so as not to take the GIL from that plan, which every
        #: rank's first inter-node payloads wait for.
        self.head = threading.Event()

    def left(self) -> float:
        return _left(self.deadline)

    def shards(self, j: int) -> tuple[int, ...]:
        return tuple(equal_shards(self.cuts[j + 1] - self.cuts[j], self.per))

    # -- the intra-node tier ------------------------------------------------
    def shared(self) -> shm.NodeMemory | None:
        """The node's shared memory, when this call's intra-node tier can go
        through it (:func:`shared_memory`): the reduce-scatter's float32
        region, then the all-gather's in the wire dtype."""
        wire = self.wire.itemsize
        need = _aligned(self.x.numel() * 4) + self.x.numel() * wire
        label = f"all_reduce({self.call.codec.name}, {self.call.topology}, key={self.call.key})"
        return shared_memory(
            self.x, self.inter_t.parent, self.intra_t, self.intra, need, self.deadline, label
        )

    def reduce(self, j: int) -> tuple[torch.Tensor, RunStats]:
        """Piece j's intra-node reduce-scatter: this rank's node-shard of it."""
        lo, hi = self.cuts[j], self.cuts[j + 1]
        ns = self.shards(j)
        if j == 0:
            self.memory = self.shared()
        if self.memory is not None:
            return self.reduce_shared(j, self.memory)
        c1 = intra_call(self.call, self.intra, ns, self.left())
        y1, s1 = engine.run(c1, self.x[lo:hi], self.intra_t)
        mine = y1[ns[self.g] : ns[self.g + 1]]
        # the next piece's reduce-scatter may reuse the view's receive arena
        return (mine.clone() if self.k > 1 else mine), s1

    def contribution(self, a: int, b: int) -> torch.Tensor:
        """This rank's float32 addend for entries ``[a, b)`` (:func:`addend`)."""
        return addend(self.x, a, b, self.call.premul)

    def reduce_shared(self, j: int, memory: shm.NodeMemory) -> tuple[torch.Tensor, RunStats]:
        """Piece j's reduce-scatter through shared memory (:func:`shared_reduce`)."""
        label = f"all_reduce({self.call.codec.name}, {self.call.topology}, node reduce)"
        where = Where(label, self.inter_t.parent.calls, _SHARED_STEP - j, 0, "node reduce")
        lo = self.cuts[j]
        return shared_reduce(
            memory, self.intra_t, lo, self.shards(j), self.contribution, self.deadline, where
        )

    def gather(self, j: int, y2: torch.Tensor | None, failed: bool) -> list[torch.Tensor]:
        """Piece j's intra-node all-gather of the node-shards, raw bytes (every
        rank takes part, failed or not, so that its node's ranks raise at once)."""
        t3, c3 = time.perf_counter(), time.thread_time()
        ns = self.shards(j)
        width = ns[1] - ns[0]  # the first shard is the largest
        if y2 is not None and y2.numel() == width:
            block = y2.to(self.wire)  # no copy where the wire is the result's dtype
        else:
            block = torch.zeros(width, dtype=self.wire, device=self.x.device)
            if y2 is not None:
                block[: y2.numel()] = y2.to(self.wire)
        call = self.call
        label = f"all_reduce({call.codec.name}, {call.topology}, node all-gather, key={call.key})"
        where = Where(label, self.inter_t.parent.calls, _GATHER_STEP - j, 0, "node gather")
        try:
            if self.memory is not None:
                got = self.gather_shared(j, block, where, failed)
            else:
                got = node_gather(self.intra_t, block, self.deadline, where, failed=failed)
            if self.direct and got:
                self.put_piece(j, got)
            return got
        finally:
            self.gather_s += time.perf_counter() - t3
            self.gather_cpu += time.thread_time() - c3

    def gather_shared(
        self, j: int, block: torch.Tensor, where: Where, failed: bool
    ) -> list[torch.Tensor]:
        """Piece j's all-gather through shared memory: this rank writes its
        node-shard, rings the doorbell, and takes its node-mates' (views of
        their segments where the result goes straight into the input, else
        copies)."""
        memory, lo, ns = self.memory, self.cuts[j], self.shards(j)
        assert memory is not None
        size = self.wire.itemsize
        base = _aligned(self.x.numel() * 4)  # the gather's region follows the reduce's
        g = self.g
        if not failed:  # the block is the widest shard's size: this rank's entries only
            width = ns[g + 1] - ns[g]
            memory.region(g, base + (lo + ns[g]) * size, width, self.wire).copy_(block[:width])
        node_gather(self.intra_t, torch.ones(1, dtype=torch.uint8), self.deadline, where,
                    failed=failed)  # fmt: skip
        if failed:
            return []
        got = []
        for h in range(self.per):
            if h == g:
                got.append(block)
                continue
            view = memory.region(h, base + (lo + ns[h]) * size, ns[h + 1] - ns[h], self.wire)
            got.append(view if self.direct else view.clone())
        return got

    def put_piece(self, j: int, got: list[torch.Tensor]) -> None:
        """Piece j's gathered node-shards into the input's memory (its region
        there is no longer read) as soon as they arrive, so that the call ends
        without assembling the result or copying it back. A node-shard already
        at its place stays; one elsewhere in the input is copied out before
        any is written."""
        lo, ns, x = self.cuts[j], self.shards(j), self.x
        base = x.untyped_storage().data_ptr()
        moves = []
        for h in range(self.per):
            dst = x[lo + ns[h] : lo + ns[h + 1]]
            src = got[h][: ns[h + 1] - ns[h]]
            if src.data_ptr() == dst.data_ptr():
                continue
            moves.append((dst, src.clone() if src.untyped_storage().data_ptr() == base else src))
        for dst, src in moves:
            dst.copy_(src)

    def intra_tier(self) -> None:
        """Every piece's reduce-scatter, then every piece's all-gather."""
        for j in range(self.k):
            if j == 1:
                self.head.wait(self.left())
            try:
                self.reduced.put(self.reduce(j))
            except BaseException as e:  # noqa: BLE001 - raised on the calling thread
                self.intra_failure = e
                for _ in range(j, self.k):
                    self.reduced.put(e)
                break
        failed = self.intra_failure is not None
        for j in range(self.k):
            y2 = self.summed.get()
            try:
                self.gathered.append(self.gather(j, y2, failed or y2 is None))
            except BaseException as e:  # noqa: BLE001
                if self.intra_failure is None:
                    self.intra_failure = e
                failed = True

    def worker(self) -> None:
        c0 = time.thread_time()
        try:
            self.intra_tier()
        finally:
            self.worker_cpu = time.thread_time() - c0

    # -- the inter-node tier -------------------------------------------------
    def inter(self, j: int, y1: torch.Tensor) -> tuple[torch.Tensor, RunStats]:
        """Piece j's inter-node all-reduce of this rank's node-shard (a sum: the
        average divides at the end), under its own key: what the optimizer
        gave the bucket's key (DynamiQ's step sizes, GComp's thresholds) is
        cut to this node-shard for it."""
        a, b = piece_node_shard(self.cuts, j, self.per, self.g)
        y2, s2 = engine.run(inter_call(self.call, a, b, self.left()), y1, self.inter_t)
        return self.node_shard_result(a, y2, s2)

    def node_shard_result(
        self, a: int, y2: torch.Tensor, s2: RunStats
    ) -> tuple[torch.Tensor, RunStats]:
        """An inter-node all-reduce's result and stats for the node-shard at
        ``a``: averaged where the call averages, owned entries in the vector's."""
        if self.call.op is ReduceOp.AVG:
            y2 = y2 / self.inter_t.parent.world_size
        s2.owned = tuple((a + lo, a + hi) for lo, hi in s2.owned)
        return y2, s2

    def run(self) -> tuple[torch.Tensor, RunStats, RunStats]:
        """The result (float32, the same bits on every rank), the intra-node
        tier's stats and the inter-node tier's."""
        thread = None
        if self.k > 1:
            thread = threading.Thread(target=self.worker, name="hopq-intra-tier", daemon=True)
            thread.start()
        inter_stats: list[RunStats] = []
        if len(self.inter_views) > 1:
            failure = self.run_ahead(inter_stats)
        else:
            failure = self.run_in_turn(inter_stats, thread)
        if thread is not None:
            t_wait = time.perf_counter()
            thread.join()
            self.waited += time.perf_counter() - t_wait
        if self.intra_failure is not None and not _is_notice(self.intra_failure, failure):
            raise self.intra_failure
        if failure is not None:
            raise failure
        if self.intra_failure is not None:
            raise self.intra_failure
        return self.assemble(inter_stats)

    def run_in_turn(
        self, inter_stats: list[RunStats], thread: threading.Thread | None
    ) -> BaseException | None:
        """Every piece's inter-node all-reduce, one after another (with one
        piece, the intra-node tier in between on this thread); returns this
        tier's failure, if any."""
        self.head.set()
        failure: BaseException | None = None
        for j in range(self.k):
            if thread is None:
                try:
                    self.reduced.put(self.reduce(j))
                except Exception as e:
                    self.intra_failure = e
                    self.reduced.put(e)
            t_wait = time.perf_counter()
            got = self.reduced.get()
            self.waited += time.perf_counter() - t_wait
            if isinstance(got, BaseException) or failure is not None:
                # this piece never reaches the inter-node tier: its peers there
                # learn it from a failure notice instead of the timeout
                fail_inter_agreement(self.inter_t, self.deadline)
                self.summed.put(None)
            else:
                try:
                    y2, s2 = self.inter(j, got[0])
                except Exception as e:
                    failure = e
                    self.summed.put(None)
                else:
                    inter_stats.append(s2)
                    self.summed.put(y2)
                self.rs_stats.append(got[1])
            if thread is None:
                y2n = self.summed.get()
                try:
                    self.gathered.append(self.gather(j, y2n, y2n is None))
                except Exception as e:
                    if self.intra_failure is None:
                        self.intra_failure = e
        return failure

    # -- the inter-node tier, planned a piece ahead -------------------------------
    def view(self, j: int) -> SubTransport:
        """The inter-node view piece j runs on."""
        return self.inter_views[j % len(self.inter_views)]

    def plan_piece(
        self, j: int, behind: Codec | None, failed: bool
    ) -> tuple[engine.Planned | None, BaseException | None]:
        """Piece j's node-shard from the intra-node tier and its inter-node call
        planned on its view: (the planned call, None), or (None, the error)
        where planning failed, or (None, None) where this rank's intra-node
        tier failed or ``failed`` (an earlier piece did): its peers there get
        a failure notice instead of the agreement. Planned on the calling
        thread (``behind`` None), its wait for the worker is counted."""
        t_wait = time.perf_counter()
        got = self.reduced.get()
        if behind is None:
            self.waited += time.perf_counter() - t_wait
        if isinstance(got, BaseException) or failed:
            fail_inter_agreement(self.view(j), self.deadline)
            return None, None
        self.rs_stats.append(got[1])
        a, b = piece_node_shard(self.cuts, j, self.per, self.g)
        y1 = got[0]
        # a helper thread starts on the first GPU, not on the calling thread's
        on = torch.cuda.device(y1.device) if y1.is_cuda else contextlib.nullcontext()
        try:
            c2 = inter_call(self.call, a, b, self.left())
            with on:
                return engine.plan_call(c2, y1, self.view(j), behind), None
        except Exception as e:  # noqa: BLE001 - raised by the calling thread
            return None, e

    def run_ahead(self, inter_stats: list[RunStats]) -> BaseException | None:
        """Every piece's inter-node all-reduce, piece j + 1 planned on a helper
        thread while piece j's hops run (see the class); returns this tier's
        failure, if any."""
        failure: BaseException | None = None
        try:
            planned, error = self.plan_piece(0, None, False)
        finally:
            self.head.set()
        for j in range(self.k):
            nxt: _Ahead | None = None
            y2 = None
            if planned is None:
                failure = failure or error
            elif failure is not None:  # an earlier piece failed after this one was planned
                # its peers get notices for what this rank owed them; the earlier
                # failure is what this rank raises
                with contextlib.suppress(Exception):
                    engine.execute(planned, fail=failure)
            else:
                if j + 1 < self.k:
                    nxt = _Ahead(self, j + 1, planned.r.codec)
                try:
                    y2, s2 = self.run_piece(j, planned, nxt)
                except Exception as e:
                    failure = e
                else:
                    inter_stats.append(s2)
            self.summed.put(y2)
            if j + 1 == self.k:
                break
            if nxt is not None:
                nxt.join()
                planned, error = nxt.planned, nxt.error
                self.ahead_cpu += nxt.cpu
            else:
                planned, error = self.plan_piece(j + 1, None, failure is not None)
        return failure

    def run_piece(
        self, j: int, planned: engine.Planned, nxt: _Ahead | None
    ) -> tuple[torch.Tensor, RunStats]:
        """Piece j's hops and finish; its round ends once ``nxt``, the next
        piece's planning, has ended."""
        t0 = time.perf_counter()

        def wait_next() -> None:
            if nxt is not None:
                t = time.perf_counter()
                nxt.join()
                self.waited += time.perf_counter() - t

        y2, s2 = engine.execute(
            planned, before_finish=wait_next, after_posts=None if nxt is None else nxt.start
        )
        if j > 0:  # planned on a helper thread, overlapped with piece j - 1's hops
            s2.seconds = time.perf_counter() - t0
            s2.comm_seconds -= planned.wait_seconds
        return self.node_shard_result(piece_node_shard(self.cuts, j, self.per, self.g)[0], y2, s2)

    def assemble(self, inter_stats: list[RunStats]) -> tuple[torch.Tensor, RunStats, RunStats]:
        if self.direct:  # every piece is in the input's memory already
            y = self.x
        else:
            parts = []
            for j, got in enumerate(self.gathered):
                ns = self.shards(j)
                parts += [got[h][: ns[h + 1] - ns[h]] for h in range(self.per)]
            y = torch.cat(parts).to(torch.float32)
        intra_stats, inter = tier_stats(
            self.g, self.per, self.x.numel(), self.wire, self.cuts, self.rs_stats, inter_stats,
            self.gather_s, self.gather_cpu,
        )  # fmt: skip
        if self.k > 1:  # overlapped: the calling thread waited on the inter-node tier's
            # transport and on the worker's (the intra-node tier's)
            self.comm_seconds = inter.comm_seconds + self.waited
        else:
            self.comm_seconds = intra_stats.comm_seconds + inter.comm_seconds
        return y, intra_stats, inter


class _Ahead:
    """Piece j of a pipeline planned on a helper thread (:meth:`_Pipeline.plan_piece`),
    started once the previous piece's first messages are posted (:meth:`start`):
    a thread started earlier takes the GIL from the one about to post them, and
    the link waits."""

    def __init__(self, pipe: _Pipeline, j: int, behind: Codec) -> None:
        self.planned: engine.Planned | None = None
        self.error: BaseException | None = None
        self.cpu = 0.0
        self.started = False
        self.thread = threading.Thread(
            target=self._plan, args=(pipe, j, behind), name="hopq-plan-ahead", daemon=True
        )

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.thread.start()

    def _plan(self, pipe: _Pipeline, j: int, behind: Codec) -> None:
        c0 = time.thread_time()
        try:
            self.planned, self.error = pipe.plan_piece(j, behind, False)
        except BaseException as e:  # noqa: BLE001 - raised by the calling thread
            self.error = e
        finally:
            self.cpu = time.thread_time() - c0

    def join(self) -> None:
        """Wait for the plan (started here if the previous piece posted nothing)."""
        self.start()
        self.thread.join()


def addend(x: torch.Tensor, a: int, b: int, premul: float | None) -> torch.Tensor:
    """A rank's float32 addend for entries ``[a, b)`` of ``x`` in an intra-node
    reduce-scatter: premultiplied when the call says so, as
    :func:`hopq.comm.engine.run` does (the float32 copy times ``premul``)."""
    part = x[a:b].to(torch.float32)
    return part * float(premul) if premul is not None else part


def shared_reduce(
    memory: shm.NodeMemory,
    intra_t: SubTransport,
    lo: int,
    ns: tuple[int, ...],
    addend: Callable[[int, int], torch.Tensor],
    deadline: Deadline,
    where: Where,
) -> tuple[torch.Tensor, RunStats]:
    """The intra-node reduce-scatter of the entries ``[lo, lo + ns[-1])`` of a
    call's vector through the node's shared memory: local rank h gets the sum of
    ``[lo + ns[h], lo + ns[h + 1])``. This rank writes the float32 addends
    (``addend(a, b)``) of the slices its node-mates own into its segment, rings
    the doorbell (a one-byte node all-gather, a failure notice where writing
    failed), then sums its own slice from theirs in the ring's order (chunk g
    goes g + 1 -> g + 2 -> ... -> g, each adding its own), so the bits are the
    message path's. The stats count the bytes written for the node-mates (what
    the messages would carry) and the doorbell's frames."""
    t0, c0 = time.perf_counter(), time.thread_time()
    g, per = intra_t.rank, intra_t.world_size
    failed, written = False, 0
    try:
        for h in range(per):
            if h != g:
                a, b = lo + ns[h], lo + ns[h + 1]
                memory.region(g, a * 4, b - a, torch.float32).copy_(addend(a, b))
                written += 4 * (b - a)
    except BaseException:
        failed = True
        raise
    finally:
        t1 = time.perf_counter()
        node_gather(intra_t, torch.ones(1, dtype=torch.uint8), deadline, where, failed=failed)
        waited = time.perf_counter() - t1
    a, b = lo + ns[g], lo + ns[g + 1]
    order = [(g + 1 + t) % per for t in range(per)]  # ends with this rank
    terms = [
        addend(a, b) if q == g else memory.region(q, a * 4, b - a, torch.float32) for q in order
    ]
    mine = terms[0] + terms[1]
    for term in terms[2:]:
        mine.add_(term)
    stats = RunStats(
        rank=g, world_size=per, numel=ns[-1], payload_bytes=written,
        frame_bytes=max(1, (per - 1).bit_length()) * framing.header_nbytes(1),
        hops_per_chunk=max(ring(per).compression_chains()), phases=("reduce",),
        seconds=time.perf_counter() - t0, comm_seconds=waited,
        cpu_seconds=time.thread_time() - c0, microshards=1, owned=((ns[g], ns[g + 1]),),
    )  # fmt: skip
    return mine, stats


def shared_memory(
    x: torch.Tensor, transport: Transport, intra_t: SubTransport, intra: Codec, nbytes: int,
    deadline: Deadline, label: str,
) -> shm.NodeMemory | None:  # fmt: skip
    """The node's shared memory, when a two-tier call's intra-node tier can go
    through it: float32 sums (the default intra codec) of a CPU tensor on Gloo
    ranks that share a machine (:mod:`hopq.comm.shm`), ``nbytes`` per call's
    regions; else None (messages)."""
    if x.device.type != "cpu" or type(intra) is not Fp32:
        return None
    memory = shm.node_memory(transport, intra_t)
    if memory is None:
        return None
    return memory if memory.ensure(nbytes, intra_t, deadline, label) else None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def tier_stats(
    g: int,
    per: int,
    numel: int,
    wire: torch.dtype,
    cuts: tuple[int, ...],
    reduced: list[RunStats],
    summed: list[RunStats],
    gather_s: float = 0.0,
    gather_cpu: float = 0.0,
) -> tuple[RunStats, RunStats]:
    """One rank's intra-node stats (its pieces' reduce-scatters ``reduced`` and
    the gathers of ``wire`` node-shards) and inter-node stats (its pieces'
    all-reduces ``summed``) of a two-tier all-reduce over the pieces ``cuts``."""
    k = len(cuts) - 1
    widths = [equal_shards(cuts[j + 1] - cuts[j], per) for j in range(k)]
    gather_bytes = sum((per - 1) * (ns[1] - ns[0]) for ns in widths)
    gather_bytes *= torch.empty(0, dtype=wire).element_size()
    gather_frames = k * max(1, (per - 1).bit_length()) * framing.header_nbytes(1)
    rs = reduced
    intra = RunStats(
        rank=g, world_size=per, numel=numel,
        payload_bytes=sum(s.payload_bytes for s in rs) + gather_bytes,
        stats_bytes=sum(s.stats_bytes for s in rs),
        frame_bytes=sum(s.frame_bytes for s in rs) + gather_frames,
        hops_per_chunk=rs[0].hops_per_chunk, phases=("reduce", "gather"),
        seconds=sum(s.seconds for s in rs) + gather_s,
        comm_seconds=sum(s.comm_seconds for s in rs) + gather_s,
        cpu_seconds=sum(s.cpu_seconds for s in rs) + gather_cpu,
        microshards=rs[0].microshards, owned=rs[0].owned,
    )  # fmt: skip
    st = summed
    inter = RunStats(
        rank=st[0].rank, world_size=st[0].world_size, numel=sum(s.numel for s in st),
        payload_bytes=sum(s.payload_bytes for s in st),
        stats_bytes=sum(s.stats_bytes for s in st),
        frame_bytes=sum(s.frame_bytes for s in st),
        hops_per_chunk=max(s.hops_per_chunk for s in st), phases=st[0].phases,
        seconds=sum(s.seconds for s in st), comm_seconds=sum(s.comm_seconds for s in st),
        cpu_seconds=sum(s.cpu_seconds for s in st),
        microshards=max(s.microshards for s in st),
        owned=tuple(o for s in st for o in s.owned),
    )  # fmt: skip
    return intra, inter


def call_stats(
    rank: int,
    world_size: int,
    numel: int,
    intra: RunStats,
    inter: RunStats,
    agree_bytes: int = 0,
    seconds: float = 0.0,
    comm_seconds: float = 0.0,
    cpu_seconds: float = 0.0,
) -> RunStats:
    """A two-tier all-reduce's stats on one rank, from its tiers'."""
    return RunStats(
        rank=rank, world_size=world_size, numel=numel,
        payload_bytes=intra.payload_bytes + inter.payload_bytes,
        stats_bytes=intra.stats_bytes + inter.stats_bytes,
        frame_bytes=intra.frame_bytes + inter.frame_bytes + agree_bytes,
        hops_per_chunk=inter.hops_per_chunk, phases=("reduce", "gather"), seconds=seconds,
        comm_seconds=comm_seconds, cpu_seconds=cpu_seconds, microshards=inter.microshards,
        owned=inter.owned, tiers={"intra": intra, "inter": inter},
    )  # fmt: skip


def _is_notice(intra: BaseException, inter: BaseException | None) -> bool:
    """Whether the intra-node tier's error only echoes the inter-node tier's
    (a node-mate's failure notice after this rank's own inter-node failure)."""
    return inter is not None and isinstance(intra, TransportError)


def shard_key(key: int | None, lo: int, hi: int) -> int:
    """The key of a two-tier call's inter-node tier: the bucket's key and the
    node-shard it carries, the same on every rank of that tier and in every
    process (a digest: Python's hash of None differs between processes)."""
    return digest(("node-shard", key, lo, hi))


def _start(
    call: Call, x: torch.Tensor, transport: Transport, layout: NodeLayout | str, intra: Codec
) -> tuple[Deadline, NodeLayout, int, float]:
    """The agreement over the whole group (world size > 1): deadline, layout,
    agreement bytes and seconds."""
    for c in (call.codec, call.stage_codec, intra):
        c.warm_up(x.device)  # compiling does not count against the timeout
    deadline = Deadline(transport.call_timeout(call.timeout))
    lay, nbytes, seconds = agree_layout(call, x, transport, layout, intra, deadline)
    return deadline, lay, nbytes, seconds


def _left(deadline: Deadline) -> float:
    return max(deadline.remaining(), 1e-3)


def reduce_scatter(
    call: Call,
    x: torch.Tensor,
    transport: Transport,
    layout: NodeLayout | str,
    intra: Codec,
) -> tuple[torch.Tensor, RunStats]:
    """The two-tier reduce-scatter of the flat tensor ``x`` over rank shards
    (``call.shards``: n + 1 offsets, rank r's shard ``shards[r]:shards[r + 1]``):
    this rank's shard (float32) and its stats (``tiers`` as in :func:`run`).

    The vector is permuted so that node-shard g is the global shards of the
    ranks with local rank g, in node order; the intra-node reduce-scatter
    gives local rank g that node-shard's node sum, and the inter-node
    reduce-scatter among the ranks of local rank g gives each its own global
    shard. Only the inter-node hops compress.
    """
    if call.gather or call.shards is None:
        raise ValueError("the two-tier reduce-scatter needs gather=False and shards")
    t_start, cpu_start = time.perf_counter(), time.thread_time()
    n, rank, shards = transport.world_size, transport.rank, call.shards
    if n == 1:
        y, info = engine.run(call, x, transport)
        return y[shards[0] : shards[1]], info
    deadline, lay, agree_bytes, agree_s = _start(call, x, transport, layout, intra)
    if lay.flat:
        y, info = engine.run(replace(call, timeout=_left(deadline)), x, transport)
        info.tiers = {"inter" if lay.nodes > 1 else "intra": replace(info)}
        info.frame_bytes += agree_bytes
        info.comm_seconds += agree_s
        info.seconds = time.perf_counter() - t_start
        info.cpu_seconds = time.thread_time() - cpu_start
        return y[shards[rank] : shards[rank + 1]], info
    intra_t, inter_t = views(transport, lay)
    g, per = intra_t.rank, lay.per_node
    # node-shard h: the global shards of the ranks with local rank h, in node order
    order = [lay.node_ranks(k)[h] for h in range(per) for k in range(lay.nodes)]
    sizes = [shards[r + 1] - shards[r] for r in order]
    xp = torch.cat([x[shards[r] : shards[r + 1]] for r in order])  # our own copy
    cuts = [0]
    for sz in sizes:
        cuts.append(cuts[-1] + sz)
    node_cuts = tuple(cuts[h * lay.nodes] for h in range(per + 1))
    c1 = Call(
        codec=intra, topology=INTRA_TOPOLOGY, op=ReduceOp.SUM, seed=call.seed, key=call.key,
        timeout=_left(deadline), premul=call.premul, gather=False, shards=node_cuts,
        microshards=None, pipeline=call.pipeline, in_place=True, agree=False,
    )  # fmt: skip
    try:
        label = f"reduce_scatter({call.codec.name}, {call.topology}, key={call.key})"
        memory = shared_memory(x, transport, intra_t, intra, _aligned(xp.numel() * 4), deadline,
                               label)  # fmt: skip
        if memory is not None:
            where = Where(label, transport.calls, _SHARED_STEP, 0, "node reduce")

            def mine(a: int, b: int) -> torch.Tensor:
                return addend(xp, a, b, call.premul)

            node_shard, s1 = shared_reduce(memory, intra_t, 0, node_cuts, mine, deadline, where)
        else:
            y1, s1 = engine.run(c1, xp, intra_t)
            node_shard = y1[node_cuts[g] : node_cuts[g + 1]]
    except Exception:
        fail_inter_agreement(inter_t, deadline)
        raise
    a = node_cuts[g]
    inner = tuple(cuts[g * lay.nodes + k] - a for k in range(lay.nodes + 1))
    c2 = replace(call, op=ReduceOp.SUM, premul=None, timeout=_left(deadline), in_place=True)
    c2 = replace(c2, shards=inner)
    y2, s2 = engine.run(c2, node_shard, inter_t)
    k = inter_t.rank
    out = y2[inner[k] : inner[k + 1]]
    if call.op is ReduceOp.AVG:
        out = out / n
    s2.owned = ((shards[rank], shards[rank + 1]),)
    info = RunStats(
        rank=rank, world_size=n, numel=x.numel(),
        payload_bytes=s1.payload_bytes + s2.payload_bytes,
        stats_bytes=s1.stats_bytes + s2.stats_bytes,
        frame_bytes=s1.frame_bytes + s2.frame_bytes + agree_bytes,
        hops_per_chunk=s2.hops_per_chunk, phases=("reduce",),
        seconds=time.perf_counter() - t_start,
        comm_seconds=s1.comm_seconds + s2.comm_seconds + agree_s,
        cpu_seconds=time.thread_time() - cpu_start, microshards=s2.microshards,
        owned=s2.owned, tiers={"intra": s1, "inter": s2},
    )  # fmt: skip
    return out, info


def fail_inter_agreement(inter: Transport, deadline: Deadline) -> None:
    """This rank failed before its inter-node call: number that call, as its
    inter-node peers do, and tell them in its agreement's place (their call
    raises TransportError naming this rank instead of waiting for the timeout),
    taking what they send there, so that nothing stale is left for the next
    call (:func:`~hopq.comm.engine.notice_in_agreement`). Best effort; beyond
    :data:`~hopq.comm.transport.DIRECT_EXCHANGE_MAX` ranks (where the agreement
    is an all-gather) the peers wait for the call's timeout."""
    number = inter.next_call()  # the peers count this call too
    what = "the inter-node tier of a two-tier call"
    engine.notice_in_agreement(inter, number, what, Deadline(max(0.1, deadline.remaining())))


def node_gather(
    t: Transport, block: torch.Tensor, deadline: Deadline, where: Where, failed: bool = False
) -> list[torch.Tensor]:
    """Every rank's ``block`` in rank order (Bruck's all-gather, as
    :func:`~hopq.comm.transport.all_gather`), where a rank that failed
    (``failed``, or a peer's failure notice received here) still takes part in
    every round: it sends failure notices instead of data and receives (and
    drops) what its peers send, so that every rank of the node raises at once
    (TransportError naming the failed rank) and no stale message is left."""
    n, r = t.world_size, t.rank
    raw = block.contiguous().reshape(-1).view(torch.uint8)
    size = raw.numel()
    held = [raw]
    err: Exception | None = None
    dist_, rnd = 1, 0
    while dist_ < n:
        count = min(dist_, n - dist_)
        to, frm = (r - dist_) % n, (r + dist_) % n
        here = Where(where.what, where.call, where.step, rnd, where.phase)
        bound = count * size
        if failed or err is not None:
            head = framing.frame(here, [0], framing.SENDER_FAILED)
            parts = framing.pack(head, None, bound, not t.short_messages)
        else:
            body = torch.cat(held[:count]) if count > 1 else held[0]
            parts = framing.pack(framing.frame(here, [bound]), body, bound)
        bufs = [t.buffer(nb, raw.device) for nb in framing.expect(1, bound, t.short_messages)]
        sends, recvs = t.post([(to, p) for p in parts], [(frm, b) for b in bufs], here)
        try:
            for h in recvs:
                h.wait(Deadline(max(0.1, deadline.remaining())), here)
            head_words, got = framing.unpack(bufs, 1, bound)
            if not (failed or err is not None):
                framing.check(head_words, here, frm, r, [bound], exact=True)
                got = got[:bound].clone()
                held += [got[i * size : (i + 1) * size] for i in range(count)]
            for h in sends:
                h.wait(Deadline(max(0.1, deadline.remaining())), here)
        except Exception as e:
            if not failed and err is None:
                err = e
        dist_ *= 2
        rnd += 1
    if err is not None:
        raise err
    if failed:
        return []
    ordered = [held[(q - r) % n] for q in range(n)]
    return [b.view(block.dtype).view(block.shape) for b in ordered]
