"""Public collectives over a torch.distributed process group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hopq.codecs.base import FLOAT_DTYPES, Codec, ReduceOp
from hopq.codecs.registry import codec_info, get_codec
from hopq.comm import engine
from hopq.comm.topology import get_schedule
from hopq.comm.transport import DistTransport
from hopq.options import check_finite, check_int

_TRANSPORTS: dict[object, DistTransport] = {}


def _transport(group: torch.distributed.ProcessGroup | None) -> DistTransport:
    """One transport per process group: its receive arena is reused, and its call
    counter numbers the calls every rank makes on that group."""
    import torch.distributed as dist

    key = group if group is not None else dist.group.WORLD
    t = _TRANSPORTS.get(key)
    if t is None:
        t = _TRANSPORTS[key] = DistTransport(group)
        _exit_cleanly_at_exit()
    return t


@dataclass(frozen=True)
class Call:
    """A validated call: everything but the process group and the tensor's data."""

    codec: Codec[Any]
    gather_codec: Codec[Any] | None
    topology: str
    op: ReduceOp
    seed: int
    key: int | None
    timeout: float


def check_call(
    tensor: torch.Tensor,
    codec: str | Codec[Any],
    topology: str,
    op: str | ReduceOp,
    seed: int,
    key: int | None,
    timeout: float,
    gather_codec: str | Codec[Any] | None = None,
) -> Call:
    """Refuse bad input before anything is sent: TypeError for types and dtypes,
    ValueError otherwise."""
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
    timeout = check_finite("timeout", timeout, positive=True)
    return Call(c, g, topology, ReduceOp.parse(op), seed, key, timeout)


def all_reduce(
    tensor: torch.Tensor,
    codec: str | Codec[Any] = "bf16",
    topology: str = "ring",
    op: str | ReduceOp = "sum",
    group: torch.distributed.ProcessGroup | None = None,
    seed: int = 0,
    key: int | None = None,
    *,
    timeout: float = engine.DEFAULT_TIMEOUT_S,
    gather_codec: str | Codec[Any] | None = None,
    pipeline: bool = True,
) -> engine.RunStats:
    """Compressed all-reduce of ``tensor`` in place over ``group`` (default: WORLD).

    ``codec`` is a registered name (a fresh instance per call) or a Codec instance
    (its state, e.g. the round counter that keys the RNG, carries across calls).
    ``op`` is ``"sum"`` (the default) or ``"avg"``. Every rank ends with
    bit-identical values. Returns this rank's statistics.

    Before any payload moves, the ranks check that they all make the same call;
    if not, :class:`hopq.MismatchError` is raised on every rank and the group
    stays usable. A peer that does not answer within ``timeout`` seconds raises
    :class:`hopq.TransportError` naming it.

    ``key`` names the tensor when a step reduces several (the DDP hook passes the
    bucket index): the same key on every rank, stable from step to step. DynamiQ
    then splits the step's bit budget across the keys (``share_budget``).
    ``gather_codec`` codes the all-gather stage with another codec (e.g. "bf16":
    only the reduce-scatter is compressed). ``pipeline`` overlaps codec work with
    transfers (the same bits either way).
    """
    call = check_call(tensor, codec, topology, op, seed, key, timeout, gather_codec)
    transport = _transport(group)
    schedule = get_schedule(call.topology, transport.world_size)
    flat = tensor.detach().reshape(-1)  # a view when contiguous: then the work can be in place
    in_place = tensor.is_contiguous()
    y, info = engine.run(
        call.codec, flat, schedule, transport, seed=call.seed, op=call.op, scratch=in_place,
        key=call.key, timeout=call.timeout, gather_codec=call.gather_codec, pipeline=pipeline,
    )  # fmt: skip
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
    *,
    key: int | None = None,
    timeout: float = engine.DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """Compressed reduce-scatter: this rank's shard of the reduced, flattened tensor.

    The shard is the slice of ``tensor.flatten()`` that the topology makes this
    rank own (ring: the r-th of n near-equal slices; butterfly with a world size
    that is not a power of two: the folded ranks own nothing and get an empty
    tensor). It equals that slice of :func:`all_reduce`'s result bit for bit.
    Needs a layout-preserving codec (one that does not permute across chunks).
    """
    call = check_call(tensor, codec, topology, op, seed, key, timeout)
    if not call.codec.layout_preserving:
        raise ValueError(
            f"codec {call.codec.name!r} permutes the vector across chunks, so a rank's shard of "
            "the caller's layout is spread over other ranks' chunks; use all_reduce"
        )
    transport = _transport(group)
    schedule = get_schedule(call.topology, transport.world_size)
    y, info = engine.run(
        call.codec, tensor.detach().reshape(-1), schedule, transport, seed=call.seed,
        op=call.op, gather=False, key=call.key, timeout=call.timeout,
    )  # fmt: skip
    if not info.owned:
        return tensor.new_empty(0)
    return torch.cat([y[s:e] for s, e in info.owned]).to(tensor.dtype)


_EXIT_HOOKED = False


def _exit_cleanly_at_exit() -> None:
    """Install (once) hopq's exit handler; see :mod:`hopq.comm.shutdown`."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        from hopq.comm import shutdown

        shutdown.install()
        _EXIT_HOOKED = True
