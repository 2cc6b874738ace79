"""Bounded per-call statistics that the framework integrations keep (the DDP
hook's buckets, FSDP's reduce-scatters), summed per training step."""

from __future__ import annotations

import io
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from hopq.comm.engine import RunStats

#: Records kept when nobody pops them (``calls`` must not grow forever).
MAX_KEPT_CALLS = 4096


@dataclass(frozen=True)
class StepMetrics:
    """This rank's communication in one training step, summed over its calls
    (DDP buckets, FSDP reduce-scatters), or over several steps: ``a + b``.
    ``as_dict()`` gives the flat scalars that ``step_metrics()`` returns, ready
    for any logger.

    Returned by ``pop_step()`` of :class:`hopq.HookState` and
    :class:`hopq.FSDPReduceScatter`.

    Attributes:
        steps: Training steps summed here (1 for one ``pop_step()``).
        buckets: Calls summed here (DDP buckets or FSDP reduce-scatters).
        numel: Coordinates reduced, over the calls.
        bytes_sent: Bytes this rank sent (payload and statistics).
        seconds: Seconds the communication thread (or the hook) worked on the
            calls.
        comm_seconds: Of those, seconds spent waiting on the network.
        coords_moved: The coordinates an uncompressed ring would have sent
            for these calls (2(n-1)/n x d per all-reduce, (n-1)/n x d per
            reduce-scatter).
        err_sq: Squared error against the exact average, summed over calls
            (``HookState.measure_error``; 0 when not measured).
        ref_sq: Squared norm of the exact average, summed over calls.
        cpu_seconds: CPU seconds the communication thread (or the hook) used
            on the calls (waiting is not counted).
        uerr_sq: ``err_sq`` with every coordinate weighed by the optimizer's
            step size (``HookState.error_optimizer``); 0 when not measured.
        uref_sq: ``ref_sq`` weighed the same way.
        inter_bytes: Bytes this rank sent between nodes in two-tier calls
            (``layout=``; 0 for flat calls).
        inter_coords: The coordinates an uncompressed ring among the nodes
            would have sent for those calls' node-shards.

    Example:
        >>> import hopq
        >>> a = hopq.StepMetrics(buckets=2, numel=1000, bytes_sent=2000.0, coords_moved=1000.0)
        >>> b = hopq.StepMetrics(buckets=1, numel=1000, bytes_sent=1000.0, coords_moved=1000.0)
        >>> total = a + b  # two steps
        >>> total.steps, total.bits_per_coordinate
        (2, 12.0)
        >>> total.as_dict()["hopq/bytes_sent"]  # per step
        1500.0
    """

    #: Training steps summed here (1 for one ``pop_step()``).
    steps: int = 1
    buckets: int = 0
    numel: int = 0
    #: Bytes this rank sent (payload and statistics).
    bytes_sent: float = 0.0
    #: Seconds the communication thread (or the hook) worked on the calls.
    seconds: float = 0.0
    #: Of those, seconds spent waiting on the network.
    comm_seconds: float = 0.0
    #: The coordinates an uncompressed ring would have sent for these calls
    #: (2(n-1)/n x d per all-reduce, (n-1)/n x d per reduce-scatter).
    coords_moved: float = 0.0
    #: Squared error and squared norm of the exact average, summed over calls
    #: (``HookState.measure_error``; 0 when not measured).
    err_sq: float = 0.0
    ref_sq: float = 0.0
    #: CPU seconds the communication thread (or the hook) used on the calls
    #: (``RunStats.cpu_seconds``: waiting is not counted). Where every core is
    #: busy computing, this is what the calls take from the compute.
    cpu_seconds: float = 0.0
    #: The same error and norm with every coordinate weighed by the
    #: optimizer's step size (``HookState.error_optimizer``): the error of the
    #: update the optimizer makes from the gradient; 0 when not measured.
    uerr_sq: float = 0.0
    uref_sq: float = 0.0
    #: Bytes sent between nodes by two-tier calls (``layout=``), and the
    #: coordinates an uncompressed ring among the nodes moves for them.
    inter_bytes: float = 0.0
    inter_coords: float = 0.0

    @classmethod
    def of(
        cls,
        info: RunStats,
        err_sq: float = 0.0,
        ref_sq: float = 0.0,
        uerr_sq: float = 0.0,
        uref_sq: float = 0.0,
    ) -> StepMetrics:
        """One call's record (``steps`` 0: it is part of a step)."""
        inter = info.tiers.get("inter")
        return cls(
            0, 1, info.numel, info.bytes_sent, info.seconds, info.comm_seconds,
            info.coords_moved, err_sq, ref_sq, info.cpu_seconds, uerr_sq, uref_sq,
            inter.bytes_sent if inter is not None else 0.0,
            inter.coords_moved if inter is not None else 0.0,
        )  # fmt: skip

    @property
    def bits_per_coordinate(self) -> float:
        """8 x bytes sent / the coordinates an uncompressed ring moves, over all
        the calls together (weighted by size): 16 for bf16. NaN when no call
        went through (a gradient-accumulation micro-step)."""
        return 8 * self.bytes_sent / self.coords_moved if self.coords_moved else float("nan")

    @property
    def inter_bits_per_coordinate(self) -> float:
        """Bits per coordinate between nodes, over the two-tier calls: 8 x
        :attr:`inter_bytes` / :attr:`inter_coords` (NaN without such calls)."""
        return 8 * self.inter_bytes / self.inter_coords if self.inter_coords else float("nan")

    @property
    def codec_seconds(self) -> float:
        """Seconds not spent waiting on the network (the codec's work)."""
        return self.seconds - self.comm_seconds

    @property
    def vnmse(self) -> float:
        """||result - exact||^2 / ||exact||^2 over the calls; NaN when not measured."""
        return self.err_sq / self.ref_sq if self.ref_sq > 0 else float("nan")

    @property
    def update_vnmse(self) -> float:
        """The vNMSE with each coordinate weighed by the optimizer's step size
        (the error of the update, not of the gradient); NaN when not measured."""
        return self.uerr_sq / self.uref_sq if self.uref_sq > 0 else float("nan")

    def __add__(self, other: StepMetrics) -> StepMetrics:
        if not isinstance(other, StepMetrics):
            return NotImplemented
        return StepMetrics(
            self.steps + other.steps,
            self.buckets + other.buckets,
            self.numel + other.numel,
            self.bytes_sent + other.bytes_sent,
            self.seconds + other.seconds,
            self.comm_seconds + other.comm_seconds,
            self.coords_moved + other.coords_moved,
            self.err_sq + other.err_sq,
            self.ref_sq + other.ref_sq,
            self.cpu_seconds + other.cpu_seconds,
            self.uerr_sq + other.uerr_sq,
            self.uref_sq + other.uref_sq,
            self.inter_bytes + other.inter_bytes,
            self.inter_coords + other.inter_coords,
        )

    def as_dict(self, prefix: str = "hopq/") -> dict[str, float]:
        """Flat scalars, per step (means over ``steps``): ``bits_per_coordinate``
        (from the bytes, weighted by call size), ``bytes_sent``,
        ``codec_seconds``, ``comm_seconds``, ``cpu_seconds``, ``buckets``, ``numel``,
        ``vnmse`` when it was measured and ``update_vnmse`` when it was weighed
        by an optimizer's step sizes. Keys start with ``prefix``."""
        k = max(self.steps, 1)
        out = {
            "bits_per_coordinate": self.bits_per_coordinate,
            "bytes_sent": self.bytes_sent / k,
            "codec_seconds": self.codec_seconds / k,
            "comm_seconds": self.comm_seconds / k,
            "cpu_seconds": self.cpu_seconds / k,
            "buckets": self.buckets / k,
            "numel": self.numel / k,
        }
        if self.ref_sq > 0:
            out["vnmse"] = self.vnmse
        if self.uref_sq > 0:
            out["update_vnmse"] = self.update_vnmse
        if self.inter_coords > 0:
            out["inter_bits_per_coordinate"] = self.inter_bits_per_coordinate
        return {prefix + key: float(v) for key, v in out.items()}


class CallRecords:
    """The calls of a state: a lock-protected list of :class:`~hopq.RunStats`
    (the most recent ``MAX_KEPT_CALLS`` when nobody pops them) and their running
    sum for the step (O(1) memory, exact even when records are dropped)."""

    #: Who keeps them, for the warning when records are dropped.
    records_owner = "the state"

    def _init_records(self) -> None:
        #: Stats of every call since the last pop.
        self.calls: list[RunStats] = []
        self._dropped = 0
        self._lock = threading.Lock()
        self._step = StepMetrics()

    def _record(self, info: RunStats, **errors: float) -> None:
        """Add one call's record; ``errors``: :meth:`StepMetrics.of`'s squared
        errors and norms, when measured."""
        one = StepMetrics.of(info, **errors)
        with self._lock:
            self._step = self._step + one
            self.calls.append(info)
            if len(self.calls) > MAX_KEPT_CALLS:
                drop = len(self.calls) - MAX_KEPT_CALLS
                del self.calls[:drop]
                self._dropped += drop
                if self._dropped == drop:
                    warnings.warn(
                        f"hopq: {self.records_owner} keeps the last {MAX_KEPT_CALLS} call "
                        "records; call pop_stats() or step_metrics() once per step",
                        stacklevel=3,
                    )

    def pop_stats(self) -> list[RunStats]:
        """The stats of every call since the last pop (e.g. one training step),
        one ``RunStats`` each; ``step_metrics()`` sums them for you."""
        with self._lock:
            out, self.calls = self.calls, []
        return out

    def pop_step(self) -> StepMetrics:
        """The calls since the last ``pop_step()`` / ``step_metrics()`` summed
        into one record, and popped (the records of ``pop_stats()`` too). Add
        records (``a + b``) to log over several steps."""
        with self._lock:
            out, self._step = self._step, StepMetrics()
            self.calls = []
        return out

    def step_metrics(self, prefix: str = "hopq/") -> dict[str, float]:
        """This step's communication as flat scalars for any logger (and popped):
        call it once per training step, after the optimizer step.
        ``pop_step()`` gives the same as a :class:`~hopq.StepMetrics` record.

        Args:
            prefix: Prepended to every key.

        Returns:
            Per-step means over the calls since the last pop. Keys (with
            ``prefix``): ``bits_per_coordinate``, ``bytes_sent``,
            ``codec_seconds``, ``comm_seconds``, ``cpu_seconds``, ``buckets``,
            ``numel``, ``vnmse`` (``update_vnmse``) when measured, and
            ``inter_bits_per_coordinate`` when the calls were two-tier
            (``layout=``): what the network between nodes carried.
            ``bits_per_coordinate`` is NaN for a step without calls (a
            gradient-accumulation micro-step). With ``codec="auto"`` also
            ``plan/<key>/<codec>@<schedule>`` per bucket (the value: its
            predicted seconds), ``replans`` and ``plan_drift``.

        Example:
            ```python
            loss.backward()
            opt.step()
            wandb.log(state.step_metrics())  # {"hopq/bits_per_coordinate": 4.9, ...}
            ```
        """
        out = self.pop_step().as_dict(prefix)
        planner = getattr(self, "auto", None)  # codec="auto"'s picks
        if planner is not None:
            out.update(planner.metrics(prefix))
        return out


def reads_no_optimizer(codec: Any) -> str | None:
    """Why ``codec`` reads no optimizer at all (bf16, MX, EQuARX, Global-QSGD, ...),
    or None for the codecs that read one (GComp, DynamiQ). An optimizer handed to
    the former is accepted and ignored (said once), so that changing only the
    codec's name never breaks a script; a configuration of the latter that would
    leave it unused (GComp's ``fixed_level``) is still refused."""
    from hopq.codecs.base import ReadsOptimizer, optimizer_unused

    return None if isinstance(codec, ReadsOptimizer) else optimizer_unused(codec)


# -- checkpoints -------------------------------------------------------------------
# The DDP hook's state and FSDP's reduce-scatter save their codec the same way: the
# codec's state is one opaque entry (bytes), because its structure grows during
# training (DynamiQ's shares and statistics per key) and torch.distributed.checkpoint
# loads only the keys a fresh instance has; rank-local counters go under their rank.


def pack_codec_state(codec: Any, seed: int, rank: int) -> dict[str, Any]:
    """``{"codec_name", "seed", "codec"}`` (the codec's agreed state as bytes) and,
    where the codec has rank-local counters, ``{"codec_local": {str(rank): bytes}}``."""
    full = codec.state_dict()
    agreed = codec.agreed_state()
    shared, local = full, {}
    if isinstance(agreed, dict) and set(agreed) <= set(full):
        shared = {k: full[k] for k in agreed}
        local = {k: v for k, v in full.items() if k not in agreed}
    out: dict[str, Any] = {"codec_name": codec.name, "seed": seed, "codec": _pack(shared)}
    if local:
        out["codec_local"] = {str(rank): _pack(local)}
    return out


def unpack_codec_state(codec: Any, state: dict[str, Any], rank: int, owner: str) -> int:
    """Load :func:`pack_codec_state`'s output (or the older form with the codec's
    state as a plain dict) into ``codec`` and return the seed. Rank-local counters
    come from ``rank``'s entry; without one they keep their current values."""
    name = state.get("codec_name")
    if name is not None and name != codec.name:
        raise ValueError(f"this checkpoint holds codec {name!r}, this {owner} runs {codec.name!r}")
    shared = state["codec"]
    if isinstance(shared, (bytes, bytearray)):
        merged = codec.state_dict()
        merged.update(_unpack(bytes(shared)))
        local = (state.get("codec_local") or {}).get(str(rank))
        if local is not None:
            merged.update(_unpack(bytes(local)))
        shared = merged
    codec.load_state_dict(shared)
    return int(state["seed"])


def gathered_state(obj: Any, group: Any = None) -> dict[str, Any]:
    """``obj.state_dict()`` (a HookState's or FSDPReduceScatter's) with every
    rank's rank-local counters gathered in, for the frameworks that call it on
    every rank and write rank 0's: a collective on ``group``."""
    return gather_packed(obj.state_dict(), group)


def gather_packed(mine: dict[str, Any], group: Any = None) -> dict[str, Any]:
    """This rank's :func:`pack_codec_state` output with every rank's rank-local
    counters gathered in (a collective on ``group``; itself without a group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        mine = merge_local(every)
    return mine


def is_packed_state(v: Any) -> bool:
    """Whether ``v`` is a :func:`pack_codec_state` output (a HookState's or
    FSDPReduceScatter's ``state_dict()``)."""
    return isinstance(v, dict) and {"codec_name", "seed", "codec"} <= set(v)


class Gathered:
    """A checkpointable view of a HookState or FSDPReduceScatter whose
    ``state_dict`` gathers every rank's rank-local counters
    (:func:`gathered_state`); loading restores the object, each rank its own."""

    def __init__(self, obj: Any, group: Any = None) -> None:
        self.obj, self.group = obj, group

    def state_dict(self) -> dict[str, Any]:
        return gathered_state(self.obj, self.group)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)


def merge_local(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state from every rank's :func:`pack_codec_state` (gathered where a
    framework saves one file for all ranks): rank 0's, with every rank's
    rank-local counters."""
    out = dict(states[0])
    local: dict[str, Any] = {}
    for s in states:
        local.update(s.get("codec_local") or {})
    if local:
        out["codec_local"] = local
    return out


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)
