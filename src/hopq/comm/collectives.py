"""Public collectives over a torch.distributed process group."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from hopq.codecs.base import FLOAT_DTYPES, Codec, ReduceOp
from hopq.codecs.registry import codec_info, get_codec
from hopq.comm import engine, hierarchy
from hopq.comm.call import Call
from hopq.comm.layout import LayoutSpec, NodeLayout, resolve_spec
from hopq.comm.topology import equal_shards, get_schedule
from hopq.comm.transport import DistTransport
from hopq.options import check_finite, check_int, check_timeout

#: One transport per live process group, held weakly: once
#: ``destroy_process_group`` drops torch's references, the group (and Gloo's
#: threads and sockets) goes at once, while the interpreter is fully alive. A
#: group kept until interpreter exit is torn down during finalization, where a
#: Gloo thread that needs the GIL ends the process with SIGABRT ("terminate
#: called without an active exception") after the job finished.
_TRANSPORTS: weakref.WeakKeyDictionary[Any, DistTransport] = weakref.WeakKeyDictionary()


def _transport(group: torch.distributed.ProcessGroup | None) -> DistTransport:
    """One transport per process group: its receive arena is reused, and its call
    counter numbers the calls every rank makes on that group."""
    import torch.distributed as dist

    key = group if group is not None else dist.group.WORLD
    if key is None:  # no process group: the transport says why
        return DistTransport(group)
    t = _TRANSPORTS.get(key)
    if t is None:
        t = _TRANSPORTS[key] = DistTransport(group)
        _exit_cleanly_at_exit()
    return t


#: What ``op`` may be: hopq's names, or torch.distributed's ReduceOp.
Op = Any


def parse_op(op: Op) -> tuple[ReduceOp, float | None]:
    """``op`` as (hopq reduction, pre-multiplier): ``"sum"``, ``"avg"``, a
    :class:`~hopq.codecs.base.ReduceOp`, or torch's ``dist.ReduceOp.SUM``,
    ``AVG`` and ``PREMUL_SUM(factor)`` (the sum of ``factor * x``, which FSDP
    passes with a gradient divide factor). Other torch ops raise ValueError:
    hopq's compressed reductions are sums."""
    if isinstance(op, str | ReduceOp):
        return ReduceOp.parse(op), None
    red = getattr(op, "op", op)  # a dist.ReduceOp object wraps a RedOpType
    name = getattr(red, "name", None)
    if type(red).__name__ == "RedOpType" and name in ("SUM", "AVG"):
        return ReduceOp(name.lower()), None
    if name == "PREMUL_SUM":
        factor = op.factor
        f = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
        check_finite("PREMUL_SUM factor", f)
        return ReduceOp.SUM, f
    raise ValueError(
        "hopq's compressed reductions are sums: op must be 'sum', 'avg', or torch's "
        f"ReduceOp.SUM, ReduceOp.AVG or ReduceOp.PREMUL_SUM(factor); got {op!r}"
    )


def check_call(
    tensor: torch.Tensor,
    codec: str | Codec[Any],
    topology: str,
    op: Op,
    seed: int,
    key: int | None,
    timeout: float | None,
    gather_codec: str | Codec[Any] | None = None,
    *,
    gather: bool = True,
    microshards: int | None = None,
    pipeline: bool = True,
) -> Call:
    """The :class:`~hopq.comm.call.Call` of these arguments (``gather=False``: a
    reduce-scatter). Refuses bad input before anything is sent: TypeError for
    types and dtypes, ValueError otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"hopq reduces floating-point tensors {[str(d) for d in FLOAT_DTYPES]}; got {tensor.dtype}"
        )
    c = get_codec(codec)
    g = None if gather_codec is None else get_codec(gather_codec)
    get_schedule(topology, 1)  # unknown topology -> ValueError
    for which in (c, g):
        if which is None:
            continue
        refusal = codec_info(which.name).refusal(
            dtype=tensor.dtype, device=tensor.device, topology=topology
        )
        if refusal is not None:
            raise refusal.exception()
    if g is not None and not g.gather_stage:
        g.plan_gather(0, ())  # raises why it cannot
    seed = check_int("seed", seed, lo=0, hi=(1 << 63) - 1)
    if key is not None:
        key = check_int("key", key, lo=0, hi=(1 << 62) - 1)
    timeout = check_timeout(timeout)
    red, premul = parse_op(op)
    return Call(
        codec=c, topology=topology, op=red, seed=seed, key=key, timeout=timeout,
        gather_codec=g, premul=premul, gather=gather, microshards=microshards,
        pipeline=pipeline,
    )  # fmt: skip


def all_reduce(
    tensor: torch.Tensor,
    codec: str | Codec[Any] = "bf16",
    topology: str = "ring",
    op: Op = "sum",
    group: torch.distributed.ProcessGroup | None = None,
    seed: int = 0,
    key: int | None = None,
    *,
    timeout: float | None = None,
    gather_codec: str | Codec[Any] | None = None,
    pipeline: bool = True,
    microshards: int | None = None,
    layout: LayoutSpec = None,
    intra_codec: str | Codec[Any] = "fp32",
) -> engine.RunStats:
    """Compressed all-reduce of ``tensor`` in place over ``group`` (default: WORLD).

    Every rank ends with bit-identical values. Before any payload moves, the
    ranks check that they all make the same call (size, dtype, codec and its
    configuration and state, topology, op, seed, key, call number), so a
    disagreement is an error on every rank, never a wrong sum.

    Args:
        tensor: The floating-point tensor (float32, bfloat16, float16 or
            float64) to reduce, the same shape and dtype on every rank;
            overwritten with the result. Non-contiguous tensors work (through
            a copy).
        codec: A registered name (a fresh instance per call; see
            :func:`hopq.available_codecs`), a :class:`hopq.Codec` instance,
            whose state (e.g. the round counter that keys the RNG) carries
            across calls, or ``"auto"``: the planner picks the codec, its
            budget and the topology (with ``layout``, also flat or two-tier)
            from a short probe of the group's link at the first such call,
            the same on every rank (docs/plan.md); every rank must pass
            ``"auto"`` then, or all raise :class:`hopq.MismatchError`.
        topology: The schedule: ``"ring"``, ``"butterfly"``, ``"semiloop"``,
            ``"biring"``, ``"tree"`` or ``"direct"``.
        op: ``"sum"`` or ``"avg"``, or torch's ``dist.ReduceOp.SUM``,
            ``AVG`` or ``PREMUL_SUM(factor)``.
        group: The process group; None: the default group.
        seed: Seeds the counter-based RNG of stochastic codecs; the same on
            every rank.
        key: Names the tensor when a step reduces several (the DDP hook
            passes the bucket index): the same on every rank, stable from step
            to step. DynamiQ then splits the step's bit budget across the keys
            (``share_budget``).
        timeout: Seconds to wait for a peer. None: the group's own timeout
            (torch's default: 30 minutes on Gloo; 10 on NCCL, where hopq takes
            90% of it so that it raises before NCCL's watchdog).
        gather_codec: Codes the all-gather stage with another codec (e.g.
            ``"bf16"``: only the reduce-scatter is compressed); None: ``codec``.
        pipeline: Overlap codec work with transfers (the same bits either
            way) on Gloo; on NCCL every step's messages go as one batched group
            after their codec work, so it changes nothing there.
        microshards: Messages per schedule chunk and step; None: chosen by
            size. The bits do not depend on it.
        layout: The nodes the group's ranks run on, for a two-tier call
            (docs/integrations/multinode.md): ``"NxG"`` (e.g. ``"2x4"``: N nodes of G
            consecutive ranks), ``(N, G)``, a
            :class:`~hopq.comm.layout.NodeLayout`, or ``"auto"`` (torchrun's
            environment, else the hosts). The call then reduce-scatters
            inside each node with ``intra_codec``, all-reduces each node-shard
            between the nodes with ``codec`` and ``topology``, and gathers
            inside each node: only inter-node hops compress. None: one flat
            schedule over all ranks.
        intra_codec: The intra-node reduce-scatter's codec of a two-tier call
            (default ``"fp32"``: exact float32 sums).

    Returns:
        This rank's :class:`hopq.RunStats`: bytes sent, bits per coordinate,
        seconds; for a two-tier call, each tier's own in ``tiers`` and the
        inter-node bits per coordinate in ``inter_bits_per_coord``.

    Raises:
        TypeError: ``tensor`` is not a floating-point tensor, its dtype is one
            the codec does not take, ``codec`` is neither a name nor a Codec,
            or an option has the wrong type.
        ValueError: An unknown codec or topology, a codec that refuses the
            device or topology, a ``gather_codec`` that cannot code a gather
            stage, an ``op`` other than a sum or average, or an option out of
            range; a ``layout`` that is not one, or (on every rank) whose ranks'
            nodes are unequal or contradict it.
        RuntimeError: ``torch.distributed`` is not initialized.
        hopq.MismatchError: The ranks make different calls (a different
            ``layout`` included); raised on every rank before any payload
            moves, and the group stays usable.
        hopq.TransportError: A peer did not answer within ``timeout``, left,
            or failed (the message names it). After a timeout the group is
            unusable (Gloo closes the connection it waited on), as after
            torch's own collectives time out.
        hopq.PayloadError: A received payload failed validation.
        hopq.CodecError: The codec broke its contract on this rank.

    Example:
        Under ``torchrun --nproc_per_node 4``:

        ```python
        import torch, torch.distributed as dist, hopq

        dist.init_process_group("gloo")
        grad = torch.randn(1_000_000)
        info = hopq.all_reduce(grad, codec="dynamiq", topology="butterfly", op="avg")
        print(info.bits_per_coord, info.seconds)  # about 5 bits per coordinate
        ```

        Two nodes of four GPUs (``torchrun --nnodes 2 --nproc_per_node 4``):
        only the hops between the nodes compress.

        ```python
        info = hopq.all_reduce(grad, codec="dynamiq", op="avg", layout="auto")
        print(info.inter_bits_per_coord)  # what the network between nodes carries
        ```
    """
    if isinstance(codec, str) and codec == "auto":  # codec and topology planned: docs/plan.md
        from hopq.comm.plan import auto

        codec, topology, layout = auto(tensor, group, layout)
    try:
        call = check_call(
            tensor, codec, topology, op, seed, key, timeout, gather_codec,
            microshards=microshards, pipeline=pipeline,
        )  # fmt: skip
        spec, intra = check_layout(tensor, layout, intra_codec)
    except Exception:
        _refused(group, timeout, "all_reduce")
        raise
    transport = _transport(group)
    flat = tensor.detach().reshape(-1)  # a view when contiguous: then the work can be in place
    in_place = tensor.is_contiguous()
    if call.in_place != in_place:
        call = replace(call, in_place=in_place)
    if spec is None:
        y, info = engine.run(call, flat, transport)
    else:
        y, info = hierarchy.run(call, flat, transport, spec, intra)
    if not (in_place and y.data_ptr() == tensor.data_ptr() and y.dtype == tensor.dtype):
        with torch.no_grad():
            tensor.copy_(y.view(tensor.shape))
    return info


def check_layout(
    tensor: torch.Tensor, layout: LayoutSpec, intra_codec: str | Codec[Any]
) -> tuple[NodeLayout | str | None, Codec[Any]]:
    """``layout=`` and ``intra_codec=`` checked before anything is sent: the
    layout (None, "auto" or a NodeLayout) and a fresh intra-node codec."""
    spec = resolve_spec(layout)
    intra = get_codec(intra_codec)
    if spec is not None:
        refusal = codec_info(intra.name).refusal(
            dtype=tensor.dtype, device=tensor.device, topology=hierarchy.INTRA_TOPOLOGY
        )
        if refusal is not None:
            raise refusal.exception()
    return spec, intra


def reduce_scatter(
    tensor: torch.Tensor,
    codec: str | Codec[Any] = "bf16",
    topology: str = "ring",
    op: Op = "sum",
    group: torch.distributed.ProcessGroup | None = None,
    seed: int = 0,
    *,
    key: int | None = None,
    timeout: float | None = None,
    shards: str | Sequence[int] = "equal",
    layout: LayoutSpec = None,
    intra_codec: str | Codec[Any] = "fp32",
) -> torch.Tensor:
    """Compressed reduce-scatter: this rank's shard of the reduced, flattened tensor,
    in the tensor's dtype.

    The shard equals that slice of :func:`all_reduce`'s result over the same
    chunks bit for bit (``hopq.simulate(..., shards=...)``).
    :func:`reduce_scatter_with_stats` also returns this rank's
    :class:`~hopq.RunStats`.

    Args:
        tensor: The floating-point tensor to reduce, the same shape and dtype
            on every rank; left unchanged.
        codec: A registered name or a :class:`hopq.Codec` instance, as in
            :func:`all_reduce`.
        topology: The schedule, as in :func:`all_reduce`.
        op: ``"sum"``, ``"avg"`` or torch's ``SUM``, ``AVG``,
            ``PREMUL_SUM(factor)``, as in :func:`all_reduce`.
        group: The process group; None: the default group.
        seed: Seeds the RNG of stochastic codecs; the same on every rank.
        key: Names the tensor across steps, as in :func:`all_reduce`.
        timeout: Seconds to wait for a peer; None: the group's own timeout.
        shards: Which slice this rank gets (see below): ``"equal"``, n + 1
            offsets, or ``"topology"``.
        layout: The nodes the ranks run on, for a two-tier reduce-scatter, as
            in :func:`all_reduce`: an intra-node reduce-scatter with
            ``intra_codec`` (of the vector permuted so that local rank g's
            node-shard holds the shards of every node's rank g), then an
            inter-node reduce-scatter with ``codec`` and ``topology`` that
            leaves every rank its own shard; only inter-node hops compress.
            Takes ``shards="equal"`` or offsets. None: flat.
        intra_codec: The intra-node codec of a two-tier reduce-scatter
            (default ``"fp32"``).

    Returns:
        This rank's shard, a 1-D tensor in ``tensor``'s dtype (empty for a
        rank that owns nothing under ``shards="topology"``).

    Raises:
        TypeError: As in :func:`all_reduce`.
        ValueError: As in :func:`all_reduce`; also ``shards`` that are not
            ``"equal"``, ``"topology"`` or n + 1 non-decreasing offsets from 0
            to the tensor's size, and ``shards="topology"`` with a codec that
            permutes the vector across chunks.
        RuntimeError: ``torch.distributed`` is not initialized.
        hopq.MismatchError: The ranks make different calls (every rank).
        hopq.TransportError: A peer did not answer within ``timeout``, left,
            or failed.
        hopq.PayloadError: A received payload failed validation.
        hopq.CodecError: The codec broke its contract on this rank.

    ``shards`` says which shard:

    * ``"equal"`` (the default, as in :func:`hopq.simulate_reduce_scatter`):
      rank r gets the r-th of n rank-ordered, near-equal slices
      (equal when n divides the size, as FSDP pads it; otherwise earlier ranks
      get one more, like ``torch.tensor_split``), torch's ``reduce_scatter``
      layout. Every codec works: the engine asks the codec to cut its chunks
      at the shards (``Codec.chunk_local``; a codec without it runs an
      all-reduce and each rank keeps its slice), and a rank that is not the
      sink of its whole shard on this topology (butterfly's folded ranks for
      a world size that is not a power of two; every rank but the root on the
      tree) receives the final payloads of the rest from their sinks.
    * n + 1 offsets: rank r gets ``shards[r]:shards[r + 1]``, as for "equal".
    * ``"topology"``: the slice the topology makes this rank own
      (ring: the r-th of n near-equal slices; butterfly with a world size that
      is not a power of two: the folded ranks own nothing and get an empty
      tensor), with nothing sent after the reduce phase. Needs a
      layout-preserving codec (one that does not permute across chunks).
      With ``layout``, ``"topology"`` is refused (ValueError).

    Example:
        Under ``torchrun --nproc_per_node 4``, with a tensor of 1000 entries:

        ```python
        shard = hopq.reduce_scatter(grad, codec="dynamiq", op="avg")
        # rank r holds entries 250 r to 250 (r + 1) of the average
        assert shard.numel() == 250
        ```
    """
    return reduce_scatter_with_stats(
        tensor, codec, topology, op, group, seed, key=key, timeout=timeout, shards=shards,
        layout=layout, intra_codec=intra_codec,
    )[0]  # fmt: skip


def reduce_scatter_with_stats(
    tensor: torch.Tensor,
    codec: str | Codec[Any] = "bf16",
    topology: str = "ring",
    op: Op = "sum",
    group: torch.distributed.ProcessGroup | None = None,
    seed: int = 0,
    *,
    key: int | None = None,
    timeout: float | None = None,
    shards: str | Sequence[int] = "equal",
    layout: LayoutSpec = None,
    intra_codec: str | Codec[Any] = "fp32",
) -> tuple[torch.Tensor, engine.RunStats]:
    """:func:`reduce_scatter`, and this rank's statistics (bits per coordinate of
    a reduce-scatter count (n-1)/n x d coordinates, so that bf16 is 16)."""
    try:
        call = check_call(tensor, codec, topology, op, seed, key, timeout, gather=False)
        spec, intra = check_layout(tensor, layout, intra_codec)
        if spec is not None and shards == "topology":
            raise ValueError(
                "a two-tier reduce-scatter (layout=) takes shards='equal' or n + 1 offsets, "
                "not 'topology'"
            )
        if spec is None and shards == "topology" and not call.codec.layout_preserving:
            raise ValueError(
                f"codec {call.codec.name!r} permutes the vector across chunks, so a rank's "
                "shard of the caller's layout is spread over other ranks' chunks; use "
                "shards='equal' (every codec works there) or all_reduce"
            )
        transport = _transport(group)
        bounds = resolve_shards(shards, tensor.numel(), transport.world_size)
    except Exception:
        _refused(group, timeout, "reduce_scatter")
        raise
    if spec is not None:
        out, stats = hierarchy.reduce_scatter(
            replace(call, shards=bounds), tensor.detach().reshape(-1), transport, spec, intra
        )
        return out.to(tensor.dtype), stats
    y, stats = engine.run(replace(call, shards=bounds), tensor.detach().reshape(-1), transport)
    if not stats.owned:
        return tensor.new_empty(0), stats
    return torch.cat([y[s:e] for s, e in stats.owned]).to(tensor.dtype), stats


def _refused(group: torch.distributed.ProcessGroup | None, timeout: Any, what: str) -> None:
    """A call refused on this rank before anything was sent still counts on its
    group and tells the peers (:func:`hopq.comm.engine.refuse`): it never pairs
    with their next call. Nothing to tell without a process group."""
    try:
        transport = _transport(group)
    except Exception:  # noqa: BLE001 - no group (or not one): nobody to tell
        return
    engine.refuse(transport, timeout, what)


def resolve_shards(
    shards: str | Sequence[int], numel: int, world_size: int
) -> tuple[int, ...] | None:
    """``reduce_scatter``'s ``shards`` as n + 1 offsets (None: the topology's)."""
    if isinstance(shards, str):
        if shards == "topology":
            return None
        if shards == "equal":
            return equal_shards(numel, world_size)
        raise ValueError(
            f"shards must be 'equal', 'topology' or {world_size + 1} offsets, got {shards!r}"
        )
    out = tuple(check_int("shards", s, lo=0) for s in shards)
    if (
        len(out) != world_size + 1
        or out[0] != 0
        or out[-1] != numel
        or any(a > b for a, b in zip(out, out[1:], strict=False))
    ):
        raise ValueError(
            f"shards must be {world_size + 1} non-decreasing offsets from 0 to {numel} "
            f"(rank r gets shards[r]:shards[r + 1]), got {out}"
        )
    return out


_EXIT_HOOKED = False


def _exit_cleanly_at_exit() -> None:
    """Install (once) hopq's exit handler; see :mod:`hopq.comm.shutdown`."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        from hopq.comm import shutdown

        shutdown.install()
        _EXIT_HOOKED = True
