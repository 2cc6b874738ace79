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

import time
from dataclasses import replace

import torch

from hopq.codecs.base import Codec, ReadsOptimizer, ReduceOp
from hopq.comm import agreement, engine, framing
from hopq.comm import layout as layouts
from hopq.comm.agreement import digest
from hopq.comm.call import Call
from hopq.comm.engine import RunStats
from hopq.comm.framing import Deadline, Where
from hopq.comm.layout import NodeLayout
from hopq.comm.topology import equal_shards
from hopq.comm.transport import (
    DIRECT_EXCHANGE_MAX,
    TAIL_BYTES,
    SubTransport,
    Transport,
    tails_ride,
)

#: The topology of the intra-node reduce-scatter.
INTRA_TOPOLOGY = "ring"
#: Header steps of the whole-group agreement and of the node all-gather.
_AGREE_STEP, _GATHER_STEP = -3000, -2000


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
    block = 8 * (len(agreement.FIELDS) + 1) + agreement.FOLD_BYTES
    messages = n - 1 if n <= DIRECT_EXCHANGE_MAX else max(1, (n - 1).bit_length())
    nbytes = (n - 1) * block + messages * framing.header_nbytes(1)
    return lay, nbytes, time.perf_counter() - t0


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
    g, per = intra_t.rank, lay.per_node
    d = x.numel()
    node_shards = equal_shards(d, per)
    a, b = node_shards[g], node_shards[g + 1]
    failure: Exception | None = None
    # 1. intra-node reduce-scatter: this rank's node-shard of the node's sum
    c1 = Call(
        codec=intra, topology=INTRA_TOPOLOGY, op=ReduceOp.SUM, seed=call.seed, key=call.key,
        timeout=left(), premul=call.premul, gather=False, shards=node_shards,
        microshards=None, pipeline=call.pipeline, in_place=call.in_place, agree=False,
    )  # fmt: skip
    try:
        y1, s1 = engine.run(c1, x, intra_t)
    except Exception as e:
        failure = e
        fail_inter_agreement(inter_t, deadline)
    else:
        # 2. inter-node all-reduce of the node-shard (a sum: the average divides at the end)
        # its own key: what the optimizer gave the bucket's key (DynamiQ's step
        # sizes, GComp's thresholds) is cut to this node-shard for it
        key2 = shard_key(call.key, a, b)
        if isinstance(call.codec, ReadsOptimizer):
            call.codec.narrow_optimizer_input(call.key, a, b, key2)
        c2 = replace(
            call, op=ReduceOp.SUM, premul=None, timeout=left(), in_place=call.in_place,
            shards=None, key=key2,
        )  # fmt: skip
        try:
            y2, s2 = engine.run(c2, y1[a:b], inter_t)
        except Exception as e:
            failure = e
    # 3. intra-node all-gather of the node-shards, raw bytes (every rank takes
    # part, failed or not, so that its node's ranks raise at once)
    t3, c3 = time.perf_counter(), time.thread_time()
    wire = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    width = node_shards[1] - node_shards[0]  # the first shard is the largest
    block = torch.zeros(width, dtype=wire, device=x.device)
    if failure is None:
        if call.op is ReduceOp.AVG:
            y2 = y2 / n
        block[: b - a] = y2.to(wire)
    label = f"all_reduce({call.codec.name}, {call.topology}, node all-gather, key={call.key})"
    where = Where(label, transport.calls, _GATHER_STEP, 0, "node gather")
    got = node_gather(intra_t, block, deadline, where, failed=failure is not None)
    if failure is not None:
        raise failure
    y = torch.cat([got[k][: node_shards[k + 1] - node_shards[k]] for k in range(per)])
    y = y.to(torch.float32)
    gather_s, gather_cpu = time.perf_counter() - t3, time.thread_time() - c3
    gather_bytes = (per - 1) * width * block.element_size()
    gather_frames = max(1, (per - 1).bit_length()) * framing.header_nbytes(1)
    intra_stats = RunStats(
        rank=g, world_size=per, numel=d,
        payload_bytes=s1.payload_bytes + gather_bytes, stats_bytes=s1.stats_bytes,
        frame_bytes=s1.frame_bytes + gather_frames, hops_per_chunk=s1.hops_per_chunk,
        phases=("reduce", "gather"), seconds=s1.seconds + gather_s,
        comm_seconds=s1.comm_seconds + gather_s, cpu_seconds=s1.cpu_seconds + gather_cpu,
        microshards=s1.microshards, owned=s1.owned,
    )  # fmt: skip
    s2.owned = tuple((a + lo, a + hi) for lo, hi in s2.owned)
    info = RunStats(
        rank=transport.rank, world_size=n, numel=d,
        payload_bytes=intra_stats.payload_bytes + s2.payload_bytes,
        stats_bytes=intra_stats.stats_bytes + s2.stats_bytes,
        frame_bytes=intra_stats.frame_bytes + s2.frame_bytes + agree_bytes,
        hops_per_chunk=s2.hops_per_chunk, phases=("reduce", "gather"),
        seconds=time.perf_counter() - t_start,
        comm_seconds=intra_stats.comm_seconds + s2.comm_seconds + agree_s,
        cpu_seconds=time.thread_time() - cpu_start, microshards=s2.microshards, owned=s2.owned,
        tiers={"intra": intra_stats, "inter": s2},
    )  # fmt: skip
    return y, info


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
        y1, s1 = engine.run(c1, xp, intra_t)
    except Exception:
        fail_inter_agreement(inter_t, deadline)
        raise
    a, b = node_cuts[g], node_cuts[g + 1]
    inner = tuple(cuts[g * lay.nodes + k] - a for k in range(lay.nodes + 1))
    c2 = replace(call, op=ReduceOp.SUM, premul=None, timeout=_left(deadline), in_place=True)
    c2 = replace(c2, shards=inner)
    y2, s2 = engine.run(c2, y1[a:b], inter_t)
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
    """This rank failed before its inter-node call: tell its inter-node peers
    (their call's agreement raises TransportError naming this rank, instead of
    waiting for the timeout) and receive what they send there, so that nothing
    stale is left for the next call. Best effort; beyond
    :data:`~hopq.comm.transport.DIRECT_EXCHANGE_MAX` ranks (where the agreement is
    an all-gather) the peers wait for the call's timeout."""
    n = inter.world_size
    number = inter.next_call()  # the peers count this call too
    if n == 1 or n > DIRECT_EXCHANGE_MAX:
        return
    where = Where("the inter-node tier of a two-tier call", number, -1000, 0, "agreement")
    block = 8 * (len(agreement.FIELDS) + 1) + agreement.FOLD_BYTES
    bound = block + TAIL_BYTES if tails_ride(inter) else block
    header = framing.frame(where, [0], framing.SENDER_FAILED)
    sends, recvs = [], []
    for q in range(n):
        if q != inter.rank:
            sends += [(q, p) for p in framing.pack(header, None, bound, not inter.short_messages)]
            recvs += [(q, torch.empty(nb, dtype=torch.uint8)) for nb in framing.expect(1, bound)]
    try:
        with inter.batch():
            sh, rh = inter.post(sends, recvs, where)
        for h in [*rh, *sh]:
            h.wait(Deadline(max(0.1, deadline.remaining())), where)
    except Exception:  # noqa: BLE001 - best effort: the call has failed already
        pass


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
        bufs = [t.buffer(nb, raw.device) for nb in framing.expect(1, bound)]
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
