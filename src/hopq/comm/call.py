"""One collective call, as the engine runs it.

:class:`Call` holds everything about a call but the tensor's data and the process
group (the transport): the codecs, the topology, the reduction and the options
that shape the messages. ``hopq.comm.collectives.check_call`` builds one from a
user's arguments (validating them); :func:`hopq.comm.engine.run` runs one on
this rank; the simulator runs one per virtual rank, each with its own codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hopq.codecs.base import Codec, ReduceOp


@dataclass(frozen=True)
class Call:
    """A collective call: all-reduce (``gather=True``) or reduce-scatter."""

    codec: Codec[Any]
    topology: str = "ring"
    op: ReduceOp = ReduceOp.SUM
    seed: int = 0
    #: Names the tensor across steps (``StatsExchange.key``; the DDP hook's bucket).
    key: int | None = None
    #: Seconds the whole call may take before a missing peer raises
    #: TransportError (None: the transport's, for a process group its own timeout).
    timeout: float | None = None
    #: The codec of the all-gather stage (None: ``codec``).
    gather_codec: Codec[Any] | None = None
    #: Reduce ``premul * x`` (torch's PREMUL_SUM; ``op`` is then SUM), or None.
    premul: float | None = None
    #: False: a reduce-scatter, the result valid only on the chunks this rank owns.
    gather: bool = True
    #: n + 1 offsets laying the schedule over rank shards (see
    #: :func:`hopq.comm.engine.run`), or None.
    shards: tuple[int, ...] | None = None
    #: Messages per schedule chunk and step (None: by size).
    microshards: int | None = None
    #: Overlap codec work with transfers (the same bits either way).
    pipeline: bool = True
    #: The codec may work in the input tensor's memory (and return it).
    in_place: bool = False
    #: Start with the ranks' agreement; False where the caller has established
    #: it (the intra-node tier of a two-tier call, which the whole group agreed on).
    agree: bool = True

    def __post_init__(self) -> None:
        m = self.microshards
        if m is not None and not (isinstance(m, int) and m >= 1):
            raise ValueError(f"microshards must be a positive int or None, got {m!r}")
        if self.shards is not None:
            object.__setattr__(self, "shards", tuple(int(s) for s in self.shards))

    @property
    def stage_codec(self) -> Codec[Any]:
        """The codec of the all-gather stage: ``gather_codec`` or ``codec``."""
        return self.codec if self.gather_codec is None else self.gather_codec
