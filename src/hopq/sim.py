"""The simulator: n virtual ranks through the very same engine, in one process.

Each virtual rank runs :func:`hopq.comm.engine.run` in its own thread over an
in-process transport, with its own copy of the codec; for the same seed the
outputs are bit-identical to a real n-process run.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hopq.codecs.base import Codec, ReduceOp
from hopq.comm import engine, hierarchy
from hopq.comm.agreement import digest
from hopq.comm.call import Call
from hopq.comm.collectives import Op, check_call, check_layout, resolve_shards
from hopq.comm.layout import LayoutSpec, NodeLayout
from hopq.comm.topology import equal_shards, get_schedule
from hopq.comm.transport import SIM_TIMEOUT_S, make_inprocess_group
from hopq.errors import TransportError

#: A codec instance -> its per-virtual-rank copies, kept across calls so that
#: repeated simulations evolve every rank's own state (see :func:`simulate`).
_RANKS: weakref.WeakKeyDictionary[Codec[Any], list[Codec[Any]]] = weakref.WeakKeyDictionary()


def virtual_ranks(codec: Codec[Any]) -> list[Codec[Any]]:
    """The per-rank copies the simulator keeps for ``codec`` (empty before its
    first simulation): what each virtual rank's codec holds after the last call."""
    return _RANKS.get(codec, [])


@dataclass
class SimResult:
    """What :func:`simulate` returns: every virtual rank's output and statistics.

    Attributes:
        outputs: Every virtual rank's output, in the inputs' shape and dtype.
        vnmse: ``||out - exact||^2 / ||exact||^2`` of rank 0's output, with the
            exact sum (or mean) in float64.
        bytes_sent: Bytes each rank sent (payload, and the statistics exchange
            counted as a ring).
        bits_per_coord: 8 x bytes / (2(n-1)/n x d), averaged over ranks: 16
            for bf16 on any topology.
        hops_per_chunk: Longest chain of compressions any contribution went
            through.
        identical: Whether all ranks hold the same bits (the contract says
            they do).
        stats: Every rank's :class:`hopq.RunStats`.
        shards: The rank shards the chunks were cut at (``shards=``), or None.

    Example:
        >>> import torch, hopq
        >>> r = hopq.simulate([torch.ones(6), 2 * torch.ones(6)], codec="fp32")
        >>> r.outputs[1]
        tensor([3., 3., 3., 3., 3., 3.])
        >>> r.identical, r.vnmse, r.bits_per_coord
        (True, 0.0, 32.0)
    """

    #: Every virtual rank's output, in the inputs' shape and dtype.
    outputs: list[torch.Tensor]
    #: ||out - exact||^2 / ||exact||^2 with the exact sum (or mean) in float64.
    vnmse: float
    #: Bytes each rank sent (payload + statistics exchange counted as a ring).
    bytes_sent: list[float]
    #: 8 x bytes / (2(n-1)/n x d), averaged over ranks (DESIGN.md's definition).
    bits_per_coord: float
    #: Longest chain of compressions any contribution went through.
    hops_per_chunk: int
    #: Whether all ranks hold the same bits.
    identical: bool
    stats: list[engine.RunStats]
    #: The rank shards the chunks were cut at, or None.
    shards: tuple[int, ...] | None = None


def simulate(
    tensors: Sequence[torch.Tensor],
    codec: str | Codec[Any] = "bf16",
    topology: str = "ring",
    seed: int = 0,
    op: Op = "sum",
    key: int | None = None,
    *,
    gather_codec: str | Codec[Any] | None = None,
    microshards: int | None = None,
    pipeline: bool = True,
    timeout: float = SIM_TIMEOUT_S,
    shards: str | Sequence[int] | None = None,
    layout: LayoutSpec = None,
    intra_codec: str | Codec[Any] = "fp32",
) -> SimResult:
    """All-reduce ``tensors[i]`` as the input of virtual rank i.

    Each virtual rank runs the same engine as :func:`hopq.all_reduce` in its
    own thread over an in-process transport; for the same seed the outputs are
    bit-identical to a real n-process run. No process group is needed.

    A codec instance is cloned per rank and, after the call, takes rank 0's
    state (round counter, adaptive parameters). The per-rank clones are kept with
    the instance, so that repeated calls evolve every virtual rank's own state
    (e.g. the saturation counts each rank measured) exactly as a real run would.

    Args:
        tensors: One tensor per virtual rank (n = ``len(tensors)``), all of
            the same shape, floating dtype and device; left unchanged.
        codec: A registered name or a :class:`hopq.Codec` instance, as in
            :func:`hopq.all_reduce`.
        topology: The schedule, as in :func:`hopq.all_reduce`.
        seed: Seeds the RNG of stochastic codecs.
        op: ``"sum"``, ``"avg"``, or torch's ``ReduceOp`` (``SUM``, ``AVG``,
            ``PREMUL_SUM``).
        key: Names the tensor as :func:`hopq.all_reduce`'s does (a DDP bucket
            index).
        gather_codec: Codes the all-gather stage with another codec, as in
            :func:`hopq.all_reduce`.
        microshards: Forces the number of messages per chunk and step
            (default: by size, as a real run).
        pipeline: Overlap codec work with transfers, as in
            :func:`hopq.all_reduce` (the same bits either way).
        timeout: Seconds a virtual rank waits for a peer.
        shards: ``"equal"`` or n + 1 offsets: cut the schedule's chunks at rank
            shards, as ``hopq.reduce_scatter(shards=...)`` does (see
            :func:`simulate_reduce_scatter`); None: the codec's own chunks.
        layout: A two-tier call, as :func:`hopq.all_reduce`'s ``layout``:
            ``"NxG"``, ``(N, G)`` or a :class:`~hopq.comm.layout.NodeLayout`
            (not ``"auto"``: the virtual ranks share one host); None: flat.
        intra_codec: The intra-node codec of a two-tier call (default
            ``"fp32"``).

    Returns:
        A :class:`SimResult`: every rank's output, the error against the exact
        float64 result, bytes and bits per coordinate.

    Raises:
        TypeError: As in :func:`hopq.all_reduce` (a non-float dtype, a dtype
            the codec does not take, an option of the wrong type).
        ValueError: No tensors, tensors that differ in shape, dtype or device,
            a topology that cannot serve n ranks, ``shards="topology"``,
            ``layout="auto"`` or a layout with ``shards``, or the reasons of
            :func:`hopq.all_reduce`.
        hopq.TransportError: A virtual rank did not answer within ``timeout``.
        hopq.PayloadError: A payload failed validation (the failing rank's
            error is raised, not its peers').
        hopq.CodecError: The codec broke its contract.

    Example:
        >>> import torch, hopq
        >>> g = torch.Generator().manual_seed(0)
        >>> grads = [torch.randn(10_000, generator=g) for _ in range(4)]
        >>> r = hopq.simulate(grads, codec="dynamiq", topology="butterfly")
        >>> r.identical, round(r.bits_per_coord, 2)
        (True, 4.95)
        >>> r.vnmse < 0.05  # i.i.d. Gaussians; real gradients do far better
        True
    """
    return _simulate(
        tensors, codec, topology, seed, op, key, gather_codec=gather_codec,
        microshards=microshards, pipeline=pipeline, timeout=timeout, shards=shards, gather=True,
        layout=layout, intra_codec=intra_codec,
    )  # fmt: skip


@dataclass
class SimShards:
    """What :func:`simulate_reduce_scatter` returns: every virtual rank's shard.

    Attributes:
        outputs: Every virtual rank's shard of the reduced vector, in the
            inputs' dtype.
        shards: n + 1 offsets: rank r's shard is ``shards[r]:shards[r + 1]``
            of the flattened vector.
        vnmse: ``||out - exact||^2 / ||exact||^2`` over the concatenated
            shards.
        bytes_sent: Bytes each rank sent (payload and statistics).
        bits_per_coord: 8 x bytes / ((n-1)/n x d), averaged over ranks (16
            for bf16).
        stats: Every rank's :class:`hopq.RunStats`.

    Example:
        >>> import torch, hopq
        >>> s = hopq.simulate_reduce_scatter([torch.arange(6.0)] * 2, codec="fp32")
        >>> s.shards, s.outputs
        ((0, 3, 6), [tensor([0., 2., 4.]), tensor([ 6.,  8., 10.])])
    """

    #: Every virtual rank's shard of the reduced vector, in the inputs' dtype.
    outputs: list[torch.Tensor]
    #: n + 1 offsets: rank r's shard is ``shards[r]:shards[r + 1]`` of the flat vector.
    shards: tuple[int, ...]
    #: ||out - exact||^2 / ||exact||^2 over the concatenated shards.
    vnmse: float
    bytes_sent: list[float]
    #: 8 x bytes / ((n-1)/n x d), averaged over ranks (16 for bf16).
    bits_per_coord: float
    stats: list[engine.RunStats]


def simulate_reduce_scatter(
    tensors: Sequence[torch.Tensor],
    codec: str | Codec[Any] = "bf16",
    topology: str = "ring",
    seed: int = 0,
    op: Op = "sum",
    key: int | None = None,
    *,
    shards: str | Sequence[int] = "equal",
    microshards: int | None = None,
    pipeline: bool = True,
    timeout: float = SIM_TIMEOUT_S,
    layout: LayoutSpec = None,
    intra_codec: str | Codec[Any] = "fp32",
) -> SimShards:
    """``hopq.reduce_scatter(tensors[i], shards=shards)`` on n virtual ranks: rank
    r's output is its shard of the flattened, reduced vector (codec state
    handled as in :func:`simulate`).

    Args:
        tensors: One tensor per virtual rank, all of the same shape, floating
            dtype and device.
        codec: A registered name or a :class:`hopq.Codec` instance.
        topology: The schedule, as in :func:`hopq.all_reduce`.
        seed: Seeds the RNG of stochastic codecs.
        op: ``"sum"``, ``"avg"``, or torch's ``ReduceOp``.
        key: Names the tensor, as in :func:`hopq.all_reduce`.
        shards: ``"equal"`` (rank r gets the r-th of n near-equal slices,
            torch's layout) or n + 1 offsets.
        microshards: Forces the number of messages per chunk and step.
        pipeline: Overlap codec work with transfers (the same bits).
        timeout: Seconds a virtual rank waits for a peer.
        layout: A two-tier reduce-scatter, as ``hopq.reduce_scatter``'s
            ``layout`` (not ``"auto"``); None: flat.
        intra_codec: The intra-node codec of a two-tier call (default
            ``"fp32"``).

    Returns:
        A :class:`SimShards`: every rank's shard, the offsets, the error and
        bits per coordinate of a reduce-scatter ((n-1)/n x d coordinates, so
        that bf16 is 16).

    Raises:
        TypeError: As in :func:`simulate`.
        ValueError: As in :func:`simulate`; also ``shards="topology"`` or
            offsets that do not cut the tensor into n shards.
        hopq.TransportError: A virtual rank did not answer within ``timeout``.
        hopq.PayloadError: A payload failed validation.
        hopq.CodecError: The codec broke its contract.

    Example:
        >>> import torch, hopq
        >>> s = hopq.simulate_reduce_scatter([torch.ones(10)] * 4, codec="bf16", op="avg")
        >>> s.shards, s.outputs[3], s.bits_per_coord
        ((0, 3, 6, 8, 10), tensor([1., 1.]), 16.0)
    """
    res = _simulate(
        tensors, codec, topology, seed, op, key, gather_codec=None, microshards=microshards,
        pipeline=pipeline, timeout=timeout, shards=shards, gather=False, layout=layout,
        intra_codec=intra_codec,
    )  # fmt: skip
    assert res.shards is not None
    return SimShards(
        outputs=res.outputs,
        shards=res.shards,
        vnmse=res.vnmse,
        bytes_sent=res.bytes_sent,
        # a reduce-scatter's denominator, even where a codec without chunk_local
        # ran a whole all-reduce
        bits_per_coord=sum(
            engine.bits_per_coordinate(s.bytes_sent, len(tensors), s.numel, phases=1)
            for s in res.stats
        )
        / len(tensors),
        stats=res.stats,
    )


#: Above this many virtual ranks a two-tier all-reduce is simulated tier by tier
#: (:func:`_simulate_tiers`: each node's reduce-scatter, then each local rank's
#: inter-node all-reduce) instead of one thread per rank: the same bits with
#: a node's or a local rank's threads at a time (128 x 8 ranks on one host).
TIER_BY_TIER_RANKS = 64


def _run_ranks(
    work: Callable[[int], tuple[torch.Tensor, engine.RunStats]], transports: list[Any]
) -> list[tuple[torch.Tensor, engine.RunStats]]:
    """``work(r)`` for every virtual rank of ``transports``, one thread each; the
    first rank's error that is not a lost peer is raised."""
    n = len(transports)
    results: list[tuple[torch.Tensor, engine.RunStats] | None] = [None] * n
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = work(r)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            transports[r].hub.abort()

    if n == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    if errors:
        # the rank that failed first, not the peers that lost it
        raise next((e for e in errors if not isinstance(e, TransportError)), errors[0])
    return [r for r in results if r is not None]


def _simulate_tiers(
    calls: list[Call], flats: list[torch.Tensor], lay: NodeLayout, intra: Codec[Any]
) -> list[tuple[torch.Tensor, engine.RunStats]]:
    """A two-tier all-reduce of ``flats`` (one flat tensor per rank, ``calls[r]``
    rank r's call) tier by tier: piece by piece, each node's intra-node
    reduce-scatter, then each local rank's inter-node all-reduce over the node
    sums, then the node gather as raw bytes (what :func:`hierarchy.run` does on
    every rank at once, the same calls in the same order per rank: the same bits)."""
    n, per, nodes = lay.world_size, lay.per_node, lay.nodes
    d, dtype = flats[0].numel(), flats[0].dtype
    wire = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    cuts = hierarchy.tier_pieces(d, per)
    timeout = calls[0].timeout if calls[0].timeout is not None else SIM_TIMEOUT_S
    intras = [intra.clone() for _ in range(n)]
    reduced: list[list[engine.RunStats]] = [[] for _ in range(n)]
    summed: list[list[engine.RunStats]] = [[] for _ in range(n)]
    out = [torch.empty(d, dtype=wire) for _ in range(nodes)]

    def tier(
        tier_calls: list[Call], inputs: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, engine.RunStats]]:
        transports = make_inprocess_group(len(tier_calls))
        return _run_ranks(lambda k: engine.run(tier_calls[k], inputs[k], transports[k]), transports)

    for j in range(len(cuts) - 1):
        lo, hi = cuts[j], cuts[j + 1]
        ns = tuple(equal_shards(hi - lo, per))
        sums: list[list[torch.Tensor]] = []  # [node][local rank]: its node-shard's sum
        for node in range(nodes):
            mates = list(lay.node_ranks(node))
            got = tier(
                [hierarchy.intra_call(calls[r], intras[r], ns, timeout) for r in mates],
                [flats[r][lo:hi] for r in mates],
            )
            sums.append([y[ns[g] : ns[g + 1]].clone() for g, (y, _) in enumerate(got)])
            for g, (_, s1) in enumerate(got):
                reduced[mates[g]].append(s1)
        for g in range(per):
            a, b = hierarchy.piece_node_shard(cuts, j, per, g)
            peers = [lay.node_ranks(node)[g] for node in range(nodes)]
            got = tier(
                [hierarchy.inter_call(calls[r], a, b, timeout) for r in peers],
                [sums[node][g] for node in range(nodes)],
            )
            for node, (y2, s2) in enumerate(got):
                if calls[0].op is ReduceOp.AVG:
                    y2 = y2 / n
                out[node][a:b] = y2.to(wire)
                s2.owned = tuple((a + u, a + v) for u, v in s2.owned)
                summed[peers[node]].append(s2)
    results = []
    for r in range(n):
        node, g = lay.node_of[r], lay.node_ranks(lay.node_of[r]).index(r)
        tier_intra, tier_inter = hierarchy.tier_stats(g, per, d, wire, cuts, reduced[r], summed[r])
        info = hierarchy.call_stats(
            r, n, d, tier_intra, tier_inter, hierarchy.layout_agreement_bytes(n)
        )
        results.append((out[node].to(torch.float32), info))
    return results


def _simulate(
    tensors: Sequence[torch.Tensor],
    codec: str | Codec[Any],
    topology: str,
    seed: int,
    op: Op,
    key: int | None,
    *,
    gather_codec: str | Codec[Any] | None,
    microshards: int | None,
    pipeline: bool,
    timeout: float,
    shards: str | Sequence[int] | None,
    gather: bool,
    layout: LayoutSpec = None,
    intra_codec: str | Codec[Any] = "fp32",
) -> SimResult:
    n = len(tensors)
    if n < 1:
        raise ValueError("simulate needs at least one worker tensor")
    shape, dtype = tensors[0].shape, tensors[0].dtype
    for t in tensors:
        if t.shape != shape or t.dtype != dtype or t.device != tensors[0].device:
            raise ValueError("all worker tensors must share shape, dtype and device")
    call = check_call(
        tensors[0], codec, topology, op, seed, key, timeout, gather_codec,
        gather=gather, microshards=microshards, pipeline=pipeline,
    )  # fmt: skip
    proto, gproto, red = call.codec, call.gather_codec, call.op
    spec, intra = check_layout(tensors[0], layout, intra_codec)
    if spec == "auto":
        raise ValueError(
            "the simulator's virtual ranks share one host: pass an explicit layout "
            "('NxG', (N, G) or a NodeLayout), not 'auto'"
        )
    if spec is not None and gather and shards is not None:
        raise ValueError("a two-tier call is an all-reduce: pass layout or shards, not both")
    get_schedule(topology, n)  # a topology that cannot serve n ranks raises here
    bounds = None
    if shards is not None:
        bounds = resolve_shards(shards, tensors[0].numel(), n)
        if bounds is None:
            raise ValueError("the simulator takes shards='equal' or n + 1 offsets")
        call = replace(call, shards=bounds)
    codecs = _RANKS.get(proto, [])
    if len(codecs) != n or digest(codecs[0].state_dict()) != digest(proto.state_dict()):
        codecs = [proto.clone() for _ in range(n)]
    proto.hand_over(codecs)
    gcodecs = None if gproto is None else [gproto.clone() for _ in range(n)]
    if isinstance(spec, NodeLayout) and gather and n > TIER_BY_TIER_RANKS and not spec.flat:
        if spec.world_size != n:
            raise ValueError(f"layout {spec.describe()} places {spec.world_size} ranks, not {n}")
        calls = [
            replace(call, codec=codecs[r], gather_codec=None if gcodecs is None else gcodecs[r])
            for r in range(n)
        ]
        results = _simulate_tiers(calls, [t.reshape(-1) for t in tensors], spec, intra)
    else:
        transports = make_inprocess_group(n)

        def work(r: int) -> tuple[torch.Tensor, engine.RunStats]:
            mine = replace(
                call, codec=codecs[r], gather_codec=None if gcodecs is None else gcodecs[r]
            )
            flat = tensors[r].reshape(-1)
            if spec is None:
                return engine.run(mine, flat, transports[r])
            if gather:
                return hierarchy.run(mine, flat, transports[r], spec, intra.clone())
            return hierarchy.reduce_scatter(mine, flat, transports[r], spec, intra.clone())

        results = _run_ranks(work, transports)
    done = results
    proto.load_state_dict(codecs[0].state_dict())
    if gproto is not None and gcodecs is not None:
        gproto.load_state_dict(gcodecs[0].state_dict())
    _RANKS[proto] = codecs
    stats = [s for _, s in done]
    if n <= TIER_BY_TIER_RANKS:
        exact = torch.stack([t.reshape(-1).double() for t in tensors])
        if call.premul is not None:
            exact = exact * call.premul
        exact = exact.sum(0)
    else:  # one worker at a time: 1024 float64 copies of the inputs would not fit
        exact = torch.zeros(tensors[0].numel(), dtype=torch.float64, device=tensors[0].device)
        for t in tensors:
            term = t.reshape(-1).double()
            exact += term if call.premul is None else term * call.premul
    if red is ReduceOp.AVG:
        exact /= n
    if gather:
        outputs = [y.view(shape).to(dtype) for y, _ in done]
        got = done[0][0]
        bits0 = done[0][0].view(torch.int32)  # bitwise: NaN payloads compare too
        identical = all(torch.equal(bits0, y.view(torch.int32)) for y, _ in done[1:])
    else:  # each rank's shard
        outputs = [
            y.to(dtype) if spec is not None else torch.cat([y[a:b] for a, b in s.owned]).to(dtype)
            for y, s in done
        ]
        got = torch.cat(outputs).double()
        identical = True
    err = (got.double() - exact).square().sum().item()
    ref = exact.square().sum().item()
    vnmse = err / ref if ref else (0.0 if err == 0 else float("inf"))
    bits = sum(s.bits_per_coord for s in stats) / n
    return SimResult(
        outputs=outputs,
        vnmse=vnmse,
        bytes_sent=[s.bytes_sent for s in stats],
        bits_per_coord=bits,
        hops_per_chunk=stats[0].hops_per_chunk,
        identical=identical,
        stats=stats,
        shards=bounds,
    )
