"""The codec contract (DESIGN.md, "The codec contract").

A codec is the quantizer plus its four hop operations. Per all-reduce call (a
*round*) the engine calls, on every rank:

1. ``plan = codec.plan(x, stats)``: local statistics, exchanged through
   ``stats.all_reduce``, turned into a plan identical on all ranks: how the
   working vector splits into chunks and how many payload bytes each takes.
   ``work = codec.prepare(plan, x, overwrite)`` then gives this rank's working
   vector (float32, in the plan's layout); it may use ``x``'s memory as the
   working buffer only when the engine passes ``overwrite=True`` (an in-place
   all-reduce of a contiguous float32 tensor, or the engine's own copy),
   otherwise it is fresh memory. Per part the
   engine then calls ``prepare_part(plan, work, part)`` just before it first
   uses this rank's values of the part (by default nothing).
2. ``encode(plan, chunk, ctx)``: leaf compression of a chunk.
3. ``decode_accumulate(plan, payload, acc, ctx)``: ``acc += decode(payload)``.
4. ``decode_accumulate_encode(plan, payload, local, ctx)``: the fused hop.
5. ``decode(plan, payload, ctx, out)``: all-gather receive.
6. ``finish(plan, y, op)``: undo the plan's transform; result in input layout.

Payloads are contiguous uint8 tensors that nobody modifies until they are sent
(the simulator may hand the same tensor to several ranks). A payload may be a
view of the chunk it encodes (fp32 does this): the engine sends a chunk's
payload before it touches that chunk again.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from hopq.errors import PayloadError


class ReduceOp(str, Enum):
    """Reductions a compressed all-reduce offers."""

    SUM = "sum"
    AVG = "avg"

    @classmethod
    def parse(cls, op: str | ReduceOp) -> ReduceOp:
        try:
            return cls(op)
        except ValueError:
            raise ValueError(f"op must be one of {[o.value for o in cls]}, got {op!r}") from None


class StatsOp(str, Enum):
    """Reductions of the statistics exchange (done in rank order by the engine)."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


#: Floating dtypes accepted as input; accumulation is float32 whatever the input.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class StatsExchange(Protocol):
    """What a codec sees of the world while planning a round."""

    rank: int
    world_size: int
    #: Chunks of the schedule; the plan cuts ``n_chunks * microshards`` chunks,
    #: nested (see :func:`nested_chunks`): plan chunk ``c * microshards + j`` is
    #: microshard j of schedule chunk c.
    n_chunks: int
    microshards: int
    seed: int
    round: int
    #: The caller's name for the tensor, stable across steps (the DDP hook: the
    #: bucket index), or None. Codecs may keep per-key state with it (DynamiQ
    #: splits a step's bit budget across the keys).
    key: int | None
    #: Where the caller wants the schedule chunks to start and end, as
    #: ``n_chunks + 1`` offsets into the caller's flat vector, or None (the
    #: codec cuts its own). Set by the engine for calls over rank shards
    #: (``reduce_scatter(shards=...)``); codecs with ``chunk_local`` honour it.
    bounds: tuple[int, ...] | None
    #: 2 for an all-reduce, 1 for a reduce-scatter: bits per coordinate then
    #: count (n-1)/n x d coordinates, so that a statistics exchange (an
    #: all-reduce either way) weighs twice as much per coordinate.
    phases: int

    def all_reduce(self, t: torch.Tensor, op: StatsOp) -> torch.Tensor:
        """Uncompressed all-reduce of a small tensor, the same shape on every rank.
        The result is bit-identical on every rank."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's small tensor ``t`` (the same shape on every rank), stacked
        in rank order: shape ``(world_size, *t.shape)``, the same on every rank."""
        ...


class LocalStats:
    """A statistics exchange without a group, whose all-reduce returns this
    rank's own statistics: for planning one rank's work alone (benchmarks that
    time a codec's kernels, the cost model's calibration, kernel tests).
    ``world_size`` is only what the plan is told."""

    def __init__(
        self,
        n_chunks: int = 1,
        world_size: int = 1,
        seed: int = 0,
        round: int = 0,
        key: int | None = None,
        microshards: int = 1,
        bounds: tuple[int, ...] | None = None,
        phases: int = 2,
    ) -> None:
        self.rank, self.world_size, self.n_chunks = 0, world_size, n_chunks
        self.phases = phases
        self.seed, self.round, self.key = seed, round, key
        self.microshards = microshards
        self.bounds = bounds

    def all_reduce(self, t: torch.Tensor, op: StatsOp) -> torch.Tensor:
        return t.clone()

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """As if every rank had this rank's statistics."""
        return t.unsqueeze(0).repeat(self.world_size, *([1] * t.dim()))


@dataclass(frozen=True)
class HopContext:
    """Where an encode or decode happens, for the hash RNG and correlated rounding.

    ``hop`` is the encoder's position on the chunk's aggregation tree; it is
    unique per (round, chunk) among the ``world_size`` encoders of that chunk
    (every rank encodes each chunk exactly once: as a leaf, an inner node, or
    the sink compressing the final sum).

    ``depth`` is the longest chain of compressions below this encoding; the
    ``peers`` encoders of the chunk at that depth (this one being number
    ``peer``) hold values that do not depend on each other's randomness, which
    is what lets their rounding be correlated without bias.
    """

    seed: int
    round: int
    #: The plan chunk being coded (an index into ``plan.chunks``).
    chunk: int
    hop: int
    rank: int
    world_size: int
    depth: int = 0
    peer: int = 0
    peers: int = 1
    #: The schedule chunk it belongs to, which keys the random streams: with
    #: microshards, plan chunk c * u + j belongs to schedule chunk c, and every
    #: microshard draws from its schedule chunk's streams at its own element
    #: indices, so the bits do not depend on the number of microshards.
    #: None: the same as ``chunk``.
    stream: int | None = None

    @property
    def stream_chunk(self) -> int:
        return self.chunk if self.stream is None else self.stream


@dataclass
class Plan:
    """A round's plan; identical on every rank.

    ``chunks[c]`` is the [start, end) range of chunk ``c`` in the working vector
    of ``work_numel`` float32 entries; ``payload_nbytes[c]`` its payload size.
    ``numel`` is the length of the caller's flattened tensor.
    """

    numel: int
    work_numel: int
    chunks: tuple[tuple[int, int], ...]
    payload_nbytes: tuple[int, ...]

    def chunk_view(self, work: torch.Tensor, c: int) -> torch.Tensor:
        start, end = self.chunks[c]
        return work[start:end]

    def chunk_numel(self, c: int) -> int:
        start, end = self.chunks[c]
        return end - start


def nested_chunks(
    numel: int, n_chunks: int, microshards: int = 1, align: int = 1
) -> tuple[tuple[int, int], ...]:
    """:func:`even_chunks` of [0, numel) into ``n_chunks``, each cut again into
    ``microshards`` even pieces (boundaries multiples of ``align``): the schedule
    chunks' boundaries do not depend on the number of microshards."""
    if microshards == 1:
        return even_chunks(numel, n_chunks, align)
    out: list[tuple[int, int]] = []
    for s, e in even_chunks(numel, n_chunks, align):
        out += [(s + a, s + b) for a, b in even_chunks(e - s, microshards, align)]
    return tuple(out)


def segment_starts(bounds: tuple[int, ...], block: int = 1) -> tuple[int, ...]:
    """Where each segment ``bounds[c]:bounds[c + 1]`` of the caller's vector starts
    in a working vector that pads every segment to whole blocks of ``block``
    entries (``len(bounds)`` offsets; the last is the working vector's length)."""
    out = [0]
    for a, b in zip(bounds, bounds[1:], strict=False):
        out.append(out[-1] + -(-(b - a) // block) * block)
    return tuple(out)


def split_parts(
    starts: tuple[int, ...], microshards: int = 1, align: int = 1
) -> tuple[tuple[int, int], ...]:
    """Schedule chunk c = ``starts[c]:starts[c + 1]`` cut into ``microshards``
    parts (:func:`even_chunks`, boundaries ``align`` apart from the chunk's start)."""
    out: list[tuple[int, int]] = []
    for s, e in zip(starts, starts[1:], strict=False):
        out += [(s + a, s + b) for a, b in even_chunks(e - s, microshards, align)]
    return tuple(out)


def check_bounds(stats: StatsExchange, numel: int) -> tuple[int, ...] | None:
    """``stats.bounds`` after checking that they fit this call (None: none asked)."""
    b = stats.bounds
    if b is None:
        return None
    if len(b) != stats.n_chunks + 1 or b[0] != 0 or b[-1] != numel:
        raise ValueError(
            f"chunk bounds {b} do not cut {numel} entries into {stats.n_chunks} schedule chunks"
        )
    return b


def plan_chunks(numel: int, stats: StatsExchange, align: int = 1) -> tuple[tuple[int, int], ...]:
    """The plan chunks of a codec whose working vector is the caller's own
    (:func:`nested_chunks`), or the schedule chunks the engine asks for
    (``stats.bounds``), each cut into ``stats.microshards`` parts."""
    b = check_bounds(stats, numel)
    if b is None:
        return nested_chunks(numel, stats.n_chunks, stats.microshards, align)
    return split_parts(b, stats.microshards, align)


def to_segments(
    x: torch.Tensor, bounds: tuple[int, ...], block: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``x`` flattened to ``dtype`` with every segment ``bounds[c]:bounds[c + 1]``
    zero-padded to whole blocks (the layout of :func:`segment_starts`)."""
    flat = x.reshape(-1)
    starts = segment_starts(bounds, block)
    out = torch.zeros(starts[-1], dtype=dtype, device=x.device)
    for c in range(len(bounds) - 1):
        a, b = bounds[c], bounds[c + 1]
        out[starts[c] : starts[c] + b - a] = flat[a:b]
    return out


def from_segments(y: torch.Tensor, bounds: tuple[int, ...], block: int) -> torch.Tensor:
    """The inverse of :func:`to_segments`: the caller's entries, padding dropped."""
    starts = segment_starts(bounds, block)
    parts = [y[s : s + bounds[c + 1] - bounds[c]] for c, s in enumerate(starts[:-1])]
    return torch.cat(parts) if parts else y[:0]


def even_chunks(numel: int, n_chunks: int, align: int = 1) -> tuple[tuple[int, int], ...]:
    """Split [0, numel) into ``n_chunks`` contiguous ranges whose boundaries are
    multiples of ``align`` (the last range takes the remainder); sizes differ by
    at most ``align``, earlier chunks being the larger, like ``torch.tensor_split``."""
    units = -(-numel // align) if numel else 0
    base, extra = divmod(units, n_chunks)
    bounds = []
    start = 0
    for c in range(n_chunks):
        end = min(numel, start + (base + (1 if c < extra else 0)) * align)
        bounds.append((start, end))
        start = end
    return tuple(bounds)


def view_as_dtype(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 payload bytes as ``dtype`` (copying only if misaligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if payload.numel() % size:
        raise PayloadError(f"payload of {payload.numel()} bytes is not a whole number of {dtype}")
    if payload.storage_offset() % size:
        payload = payload.clone()
    return payload.view(dtype)


def check_payload(payload: torch.Tensor, expected: int, what: str = "payload") -> None:
    """Raise PayloadError unless ``payload`` is a 1-D uint8 tensor of ``expected`` bytes."""
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise PayloadError(
            f"{what} must be a contiguous 1-D uint8 tensor, got {payload.dtype} "
            f"{tuple(payload.shape)} with strides {payload.stride()}"
        )
    if payload.numel() != expected:
        raise PayloadError(f"{what} has {payload.numel()} bytes, the plan says {expected}")


@dataclass(frozen=True)
class CodecConfig:
    """Base of every codec's frozen, validated configuration."""


P = TypeVar("P", bound=Plan)


class Codec(ABC, Generic[P]):
    """A compression scheme usable inside multi-hop all-reduce; ``P`` is its plan type.

    A codec is the quantizer plus its hop operations. Per call ("round") the
    engine calls, on every rank: :meth:`plan` (statistics exchanged into a plan
    identical on every rank), :meth:`prepare` (the working vector), then per
    chunk :meth:`encode` (a leaf), :meth:`decode_accumulate` and the fused
    :meth:`decode_accumulate_encode` (inner hops), :meth:`decode` (the
    all-gather), and finally :meth:`finish` and :meth:`end_round`. Payloads
    are contiguous ``uint8`` tensors that a receiver validates before reading
    (:class:`hopq.PayloadError`). A new codec subclasses this class, takes a
    frozen ``config_class``, and registers itself by name with
    ``hopq.codecs.register`` (docs/design.md says where it goes).

    Build instances with :func:`hopq.get_codec` (or the class itself); pass
    one instance to every call of a training run so that its state (the round
    counter that keys the RNG, adaptive parameters) carries across calls.

    Args:
        config: An instance of the codec's ``config_class``; None: the
            defaults, with ``overrides`` applied.
        **overrides: Options of ``config_class`` that replace the config's
            (or the defaults').

    Raises:
        TypeError: An option the codec does not have, or a config of another
            class.
        ValueError: An option out of range (the config's validation names it).

    Example:
        One rank's round trip through the contract, outside the engine:

        >>> import torch, hopq
        >>> from hopq.codecs.base import HopContext, LocalStats, ReduceOp
        >>> codec = hopq.get_codec("bf16")
        >>> x = torch.tensor([1.0, 2.5, -3.0])
        >>> plan = codec.plan(x, LocalStats())  # a world of one rank
        >>> work = codec.prepare_all(plan, x)
        >>> ctx = HopContext(seed=0, round=0, chunk=0, hop=0, rank=0, world_size=1)
        >>> payload = codec.encode(plan, plan.chunk_view(work, 0), ctx)
        >>> payload.dtype, payload.numel()  # three bf16 values
        (torch.uint8, 6)
        >>> out = torch.empty(plan.work_numel)
        >>> codec.decode(plan, payload, ctx, out)
        >>> codec.finish(plan, out, ReduceOp.SUM, 1)
        tensor([ 1.0000,  2.5000, -3.0000])
    """

    #: Registry name, e.g. "bf16".
    name: ClassVar[str]
    #: The frozen config dataclass this codec takes.
    config_class: ClassVar[type[CodecConfig]] = CodecConfig
    #: Whether chunk c of the working vector is chunk c of the caller's vector
    #: (no permutation or transform across chunk boundaries): reduce_scatter
    #: can then hand each rank its own slice.
    layout_preserving: ClassVar[bool] = False
    #: Whether it honours ``StatsExchange.bounds``: schedule chunk c then holds
    #: exactly the caller's entries ``bounds[c]:bounds[c + 1]`` (however the
    #: codec pads, permutes or transforms them inside the chunk), so that those
    #: entries of ``finish``'s result depend on chunk c's final payload alone.
    #: This is what a reduce-scatter over rank shards needs; a codec without it
    #: is run as an all-reduce there, and each rank keeps its shard.
    chunk_local: ClassVar[bool] = False
    #: Rounds its adaptive state needs to settle from its initial value (OmniReduce's
    #: k): benchmarks that measure one round on fixed gradients run these first.
    warmup_rounds: ClassVar[int] = 0
    #: Whether payload sizes are known only after encoding: ``plan.payload_nbytes``
    #: are then bounds, and the engine carries each payload's real size.
    variable_size: ClassVar[bool] = False
    #: Whether it can code the all-gather stage of another codec's all-reduce:
    #: it then plans from chunk sizes alone (:meth:`plan_gather`), with no
    #: statistics and no transform of the vector.
    gather_stage: ClassVar[bool] = False
    #: Bytes of the first statistics its plan exchanges, when they do not depend
    #: on the input's size: they then travel with the call's agreement (one
    #: round of messages fewer). None: they travel on their own.
    first_stats_nbytes: ClassVar[int | None] = None
    #: Whether a call's plan may run while this instance's previous call is still
    #: in its hops (the two-tier all-reduce plans piece k + 1 then, so that its
    #: statistics exchange overlaps piece k's transfers): the plan reads nothing
    #: that an earlier call's hops, :meth:`finish` or :meth:`end_round` change
    #: but the round, which it takes from ``stats.round``; the gather stage's
    #: :meth:`plan_gather` reads no state at all.
    plans_ahead: ClassVar[bool] = False
    #: Coordinates per microshard the engine aims at when the call does not say
    #: (:func:`hopq.comm.engine.auto_microshards`): the pipeline hides codec work
    #: behind transfers, at the price of one message per microshard
    #: (docs/bench/allreduce.md).
    microshard_coords: ClassVar[int] = 1 << 18

    def __init__(self, config: CodecConfig | None = None, **overrides: Any) -> None:
        known = {f.name for f in dataclasses.fields(self.config_class)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            has = f"its options are {sorted(known)}" if known else "it has no options"
            raise TypeError(
                f"codec {self.name!r} has no option {unknown[0]!r}; {has} "
                "(`hopq codecs` lists them with their defaults)"
            )
        if config is None:
            config = self.config_class(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{self.name} takes a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config
        #: Number of all-reduce calls this instance has run; part of the RNG stream key.
        self.round = 0

    # -- the contract -----------------------------------------------------
    @abstractmethod
    def plan(self, x: torch.Tensor, stats: StatsExchange) -> P:
        """This round's plan, identical on every rank.

        Computes local statistics of ``x``, exchanges them through
        ``stats.all_reduce`` / ``stats.all_gather`` (bit-identical results on
        every rank), and turns them into a plan: how the working vector splits
        into ``stats.n_chunks * stats.microshards`` chunks (honouring
        ``stats.bounds`` where the codec is ``chunk_local``) and how many
        payload bytes each chunk takes.

        Args:
            x: This rank's input, flattened, in the caller's dtype.
            stats: The statistics exchange and what the codec may know of the
                call (rank, world size, seed, round, key).

        Returns:
            The plan (a :class:`~hopq.codecs.base.Plan` or a subclass).

        Raises:
            ValueError: ``stats.bounds`` do not cut ``x`` into the schedule's
                chunks.
        """

    @abstractmethod
    def prepare(self, plan: P, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        """This rank's working vector: float32, ``plan.work_numel`` entries, in
        the plan's layout (permuted, shifted or scaled as the plan says).

        Args:
            plan: This round's plan.
            x: This rank's input, flattened.
            overwrite: Whether the codec may use ``x``'s memory as the working
                vector (the engine says so for an in-place all-reduce of a
                contiguous float32 tensor); otherwise it returns fresh memory.

        Returns:
            The working vector; per-part work may be left to
            :meth:`prepare_part`.
        """

    def prepare_part(self, plan: P, work: torch.Tensor, part: int) -> None:
        """Finish preparing part ``part`` (``plan.chunks[part]``) of the working
        vector in place. The engine calls it once per part, just before this
        rank's own values of the part are first encoded or accumulated into (and
        before ``finish`` for any part never used), so that per-coordinate work
        moved here overlaps the transfers of the parts before it; a part first
        overwritten by a gather decode is never prepared. Default: nothing
        (``prepare`` did everything). The bits must not depend on when it runs."""

    def finish_part(
        self, plan: P, work: torch.Tensor, part: int, op: ReduceOp, world_size: int
    ) -> None:
        """Part ``part`` of the working vector holds its final reduced value on
        this rank (its gather payload is decoded and nothing will accumulate into
        it again): the codec may turn it into the result in place now, so that
        this overlaps the transfers of later parts, and ``finish`` then leaves it
        as it is (the codec records which parts it did, in its plan). Called at
        most once per part, never for a part whose payloads are views of
        ``work``. Default: nothing (``finish`` does everything)."""

    def prepare_all(self, plan: P, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        """``prepare`` and then ``prepare_part`` of every part: the working vector
        as the hops see it, for callers outside the engine (tests, benchmarks)."""
        work = self.prepare(plan, x, overwrite)
        for m in range(len(plan.chunks)):
            self.prepare_part(plan, work, m)
        return work

    @abstractmethod
    def encode(self, plan: P, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        """Leaf compression of one chunk of the working vector.

        Args:
            plan: This round's plan.
            chunk: ``plan.chunk_view(work, ctx.chunk)``: float32 values in the
                plan's layout.
            ctx: Where the encoding happens (round, chunk, hop, rank), which
                keys the counter-based RNG and correlated rounding.

        Returns:
            The payload: a contiguous 1-D ``uint8`` tensor of
            ``plan.payload_nbytes[ctx.chunk]`` bytes (at most that many for a
            ``variable_size`` codec). It may be a view of ``chunk``.
        """

    def decode_accumulate(
        self, plan: P, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        """``acc += decode(payload)``; codecs override it with a fused version.

        Args:
            plan: This round's plan.
            payload: A received payload of chunk ``ctx.chunk``.
            acc: The chunk's float32 partial sum, updated in place.
            ctx: Where the payload was encoded.

        Raises:
            hopq.PayloadError: The payload fails validation.
        """
        tmp = torch.empty_like(acc)
        self.decode(plan, payload, ctx, tmp)
        acc.add_(tmp)

    def decode_accumulate_encode(
        self, plan: P, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        """The fused hop: decompress a received partial sum, add the local chunk,
        recompress. Codecs override it with a fused version (or one that
        combines codes without decoding).

        Args:
            plan: This round's plan.
            payload: The received partial sum's payload.
            local: This rank's chunk (float32); may be overwritten with the
                accumulated sum.
            ctx: Where the new payload is encoded.

        Returns:
            The payload of the new partial sum, as :meth:`encode` returns it.

        Raises:
            hopq.PayloadError: The received payload fails validation.
        """
        self.decode_accumulate(plan, payload, local, ctx)
        return self.encode(plan, local, ctx)

    @abstractmethod
    def decode(self, plan: P, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor) -> None:
        """Decode a payload into ``out`` (the all-gather receive, and the sink
        decoding its own final payload, so that every rank holds the same bits).

        Args:
            plan: This round's plan.
            payload: The chunk's final payload.
            ctx: Where the payload was encoded.
            out: The chunk's float32 view of the working vector, overwritten.

        Raises:
            hopq.PayloadError: The payload fails validation.
        """

    @abstractmethod
    def finish(self, plan: P, y: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
        """Undo the plan's transform (inverse permutation, means added back,
        scale) and apply ``op``: the result in the caller's layout.

        Args:
            plan: This round's plan.
            y: The working vector holding the decoded final sums.
            op: ``ReduceOp.SUM`` or ``ReduceOp.AVG`` (divide by ``world_size``).
            world_size: The number of ranks.

        Returns:
            A flat tensor of ``plan.numel`` entries in the caller's layout,
            float32 or the caller's dtype (the collectives cast it); it may be
            ``y`` itself.
        """

    def nonfinite_block(self) -> int:
        """A NaN or Inf at position i makes the output non-finite at i on every rank,
        and may spread to the other positions of its aligned block of this many
        entries (1: it stays where it is)."""
        return 1

    def error_bound(
        self, abs_sum: torch.Tensor, chain: int, adds: int | None = None
    ) -> torch.Tensor | None:
        """Documented worst-case |result - exact sum| per coordinate, given the sum
        over ranks of |x_i|, the longest compression chain and the most float32
        additions in a row into one partial sum (``adds``, the schedule's
        ``reduce_depths``; None: ``chain``, which no schedule but ``direct``
        exceeds: its sinks add n - 1 contributions behind one compression);
        None where the codec only promises a statistical bound (stochastic codecs)."""
        return None

    def plan_gather(self, work_numel: int, chunks: tuple[tuple[int, int], ...]) -> P:
        """A plan for coding the final sums of ``chunks`` in the all-gather stage of
        another codec's all-reduce (codecs with ``gather_stage``)."""
        raise ValueError(
            f"codec {self.name!r} cannot code a gather stage: it needs statistics or a "
            "transform of its own input"
        )

    def small_call_codec(
        self,
        numel: int,
        key: int | None = None,
        shards: tuple[int, ...] | None = None,
        phases: int = 2,
    ) -> Codec[Any] | None:
        """The codec that runs a call of ``numel`` entries in this one's place, or
        None: this one serves it. A codec that cannot serve a size well (too few
        entries for its statistics and padding to pay, as DynamiQ below a few
        super-groups) names one that can. Decided from the size and the
        configuration alone, so that every rank decides alike; the engine runs
        the whole call (both stages) with it, counts its bytes in bits per
        coordinate and names it in ``RunStats.fallback``. ``key``: the call's
        (a codec drops what was set for that call's plan, which it will not
        make); ``shards``: the rank shards' n + 1 offsets of a call over them
        (their pieces are planned apart), or None; ``phases``: 1 for a
        reduce-scatter, 2 for an all-reduce."""
        return None

    def warm_up(self, device: torch.device) -> None:
        """Compile (or load from a disk cache) the kernels that calls on
        ``device`` tensors run, once per process. The engine calls it before a
        call's timeout starts: compilation is not communication, and a first
        call that compiles for longer than its timeout must not be taken for a
        silent peer. Codecs without compiled kernels do nothing."""

    # -- state across rounds ----------------------------------------------
    def end_round(self, plan: P) -> None:
        """Called once after every round on every rank; adaptive codecs update state here."""
        self.round += 1

    def state_dict(self) -> dict[str, Any]:
        """The codec's state across rounds, for checkpoints.

        Returns:
            A dict with the round counter (part of the RNG key) and, in
            adaptive codecs, their parameters; what :meth:`load_state_dict`
            takes back.
        """
        return {"round": self.round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, so that the next round gives
        the same bits as an uninterrupted run.

        Args:
            state: What :meth:`state_dict` returned.

        Raises:
            KeyError: A key the codec needs is missing.
        """
        self.round = int(state["round"])

    def agreed_state(self) -> Any:
        """The part of the state every rank must hold identically (compared before
        every call); rank-local counters (e.g. saturations this rank saw) are left out."""
        return self.state_dict()

    def clone(self) -> Codec[P]:
        """An independent copy with the same config and state (one per virtual rank)."""
        return copy.deepcopy(self)

    def hand_over(self, copies: list[Codec[Any]]) -> None:
        """Give ``copies`` (the simulator's per-rank copies) the inputs for the next
        call that were set on this instance (DynamiQ's step sizes), as if each rank
        had set them; this instance keeps none. None set here: the copies keep
        what was set on them. Codecs without such inputs: nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


class ReadsOptimizer:
    """A codec that reads the optimizer's state before each call (GComp's
    truncation thresholds, DynamiQ's step sizes): the DDP hook calls
    ``use_optimizer`` with the bucket's parameters."""

    def optimizer_input(self, optimizer: Any, params: list[torch.Tensor]) -> torch.Tensor | None:
        """What the codec takes from ``optimizer`` for ``params`` (flattened and
        concatenated in that order), or None."""
        raise NotImplementedError

    def set_optimizer_input(self, value: torch.Tensor | None, key: int | None = None) -> None:
        """Keep ``value`` for the calls with ``key``."""
        raise NotImplementedError

    def use_optimizer(
        self,
        optimizer: Any,
        params: list[torch.Tensor],
        key: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Before a call with ``key`` that carries the gradients of ``params`` (in
        that order): take what the codec needs from ``optimizer``."""
        v = self.optimizer_input(optimizer, params)
        self.set_optimizer_input(v if v is None or device is None else v.to(device), key)

    def narrow_optimizer_input(
        self, key: int | None, lo: int, hi: int, into: int | None
    ) -> None:  # fmt: skip
        """Let the next call with ``into`` use entries ``[lo, hi)`` of what was set
        for ``key`` (a two-tier call's inter-node tier carries one node-shard of
        the bucket the optimizer input covers). The default keeps nothing."""


def optimizer_unused(codec: Codec[Any]) -> str | None:
    """Why an optimizer handed to ``codec`` would do nothing, or None when it is
    used: codecs that are ``ReadsOptimizer`` (GComp's optimizer-aware
    truncation, DynamiQ's step-size weights) take one, unless their
    ``optimizer_unused`` says why this configuration would not."""
    if not isinstance(codec, ReadsOptimizer):
        return (
            f"codec {codec.name!r} takes no optimizer (GComp's truncation and DynamiQ's "
            "allocation do)"
        )
    return getattr(codec, "optimizer_unused", None) or None


def check_takes_optimizer(codec: Codec[Any], optimizer: Any) -> None:
    """Raise ValueError unless ``optimizer``, handed to ``codec``, is used, and
    (the codec's ``check_optimizer``) is one the codec has a rule for: a hook
    refuses it when built, not at its first bucket."""
    why = optimizer_unused(codec)
    if why:
        raise ValueError(why)
    check = getattr(codec, "check_optimizer", None)
    if check is not None:
        check(optimizer)


def missing_optimizer(codec: Codec[Any], optimizer: Any, where: str) -> str | None:
    """Why ``codec`` compresses far less than its paper says when a call reaches
    it through ``where`` without ``optimizer``, or None: a codec whose
    compression depends on an optimizer's state (GComp's truncation), given
    none and no thresholds by hand, truncates no mantissa bits."""
    if not hasattr(codec, "set_thresholds"):
        return None  # without one, DynamiQ allocates as its paper does
    if optimizer is not None or optimizer_unused(codec) is not None:
        return None  # given, or one would not be used (fixed_level)
    if getattr(codec, "thresholds", None):
        return None  # thresholds set by hand
    return (
        f"{where}: codec {codec.name!r} without optimizer= truncates no mantissa bits "
        "(lossless but for zeros, so its payload stays near fp32's on gradients with few "
        "zeros); pass optimizer= (the optimizer that steps these parameters) for its "
        "optimizer-aware truncation, or fixed_level= for one level everywhere"
    )
