"""Public collectives over a torch.distributed process group."""

from __future__ import annotations

from typing import Any

import torch

from hopq.codecs.base import FLOAT_DTYPES, Codec, ReduceOp
from hopq.codecs.registry import codec_info, get_codec
from hopq.comm import engine
from hopq.comm.topology import get_schedule
from hopq.comm.transport import DistTransport

_TRANSPORTS: dict[object, DistTransport] = {}


def _transport(group: torch.distributed.ProcessGroup | None) -> DistTransport:
    """One transport per process group, kept so that its receive arena is reused."""
    import torch.distributed as dist

    key = group if group is not None else dist.group.WORLD
    t = _TRANSPORTS.get(key)
    if t is None:
        t = _TRANSPORTS[key] = DistTransport(group)
    return t


def check_input(tensor: torch.Tensor, codec: Codec[Any], topology: str) -> None:
    """Refuse bad input before anything is sent: TypeError for dtypes, ValueError otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"hopq reduces floating-point tensors {[str(d) for d in FLOAT_DTYPES]}; got {tensor.dtype}"
        )
    get_schedule(topology, 1)  # unknown topology -> ValueError
    refusal = codec_info(codec.name).refusal(
        dtype=tensor.dtype, device=tensor.device, topology=topology
    )
    if refusal is not None:
        raise refusal.exception()


def all_reduce(
    tensor: torch.Tensor,
    codec: str | Codec[Any] = "bf16",
    topology: str = "ring",
    op: str | ReduceOp = "sum",
    group: torch.distributed.ProcessGroup | None = None,
    seed: int = 0,
    key: int | None = None,
) -> engine.RunStats:
    """Compressed all-reduce of ``tensor`` in place over ``group`` (default: WORLD).

    ``codec`` is a registered name (a fresh instance per call) or a Codec instance
    (its state, e.g. the round counter that keys the RNG, carries across calls).
    Every rank ends with bit-identical values. Returns this rank's statistics.

    ``key`` names the tensor when a step reduces several (the DDP hook passes the
    bucket index): the same key on every rank, stable from step to step. DynamiQ
    then splits the step's bit budget across the keys (``share_budget``).
    """
    op = ReduceOp.parse(op)
    c = get_codec(codec)
    check_input(tensor, c, topology)
    transport = _transport(group)
    schedule = get_schedule(topology, transport.world_size)
    flat = tensor.detach().reshape(-1)  # a view when contiguous: then the work can be in place
    in_place = tensor.is_contiguous()
    y, info = engine.run(c, flat, schedule, transport, seed=seed, op=op, scratch=in_place, key=key)
    if not (in_place and y.data_ptr() == tensor.data_ptr() and y.dtype == tensor.dtype):
        with torch.no_grad():
            tensor.copy_(y.view(tensor.shape))
    return info


def reduce_scatter(
    tensor: torch.Tensor,
    codec: str | Codec[Any] = "bf16",
    topology: str = "ring",
    op: str | ReduceOp = "sum",
    group: torch.distributed.ProcessGroup | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Compressed reduce-scatter: this rank's shard of the reduced, flattened tensor.

    The shard is the slice of ``tensor.flatten()`` that the topology makes this
    rank own (ring: the r-th of n near-equal slices; butterfly with a world size
    that is not a power of two: the folded ranks own nothing and get an empty
    tensor). It equals that slice of :func:`all_reduce`'s result bit for bit.
    Needs a layout-preserving codec (one that does not permute across chunks).
    """
    op = ReduceOp.parse(op)
    c = get_codec(codec)
    check_input(tensor, c, topology)
    if not c.layout_preserving:
        raise ValueError(
            f"codec {c.name!r} permutes the vector across chunks, so a rank's shard of the "
            "caller's layout is spread over other ranks' chunks; use all_reduce"
        )
    transport = _transport(group)
    schedule = get_schedule(topology, transport.world_size)
    y, info = engine.run(
        c, tensor.detach().reshape(-1), schedule, transport, seed=seed, op=op, gather=False
    )
    if not info.owned:
        return tensor.new_empty(0)
    return torch.cat([y[s:e] for s, e in info.owned]).to(tensor.dtype)
