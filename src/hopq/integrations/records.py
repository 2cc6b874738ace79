"""Bounded per-call statistics that the framework integrations keep (the DDP
hook's buckets, FSDP's reduce-scatters), summed per training step."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

from hopq.comm.engine import RunStats

#: Records kept when nobody pops them (``calls`` must not grow forever).
MAX_KEPT_CALLS = 4096


@dataclass(frozen=True)
class StepMetrics:
    """One training step's communication, summed over its calls (DDP buckets,
    FSDP reduce-scatters)."""

    buckets: int
    numel: int
    #: Bytes this rank sent (payload and statistics).
    bytes_sent: float
    #: 8 x bytes sent / the coordinates an uncompressed ring would move (2(n-1)/n
    #: x d for an all-reduce, (n-1)/n x d for a reduce-scatter): 16 for bf16.
    bits_per_coordinate: float
    #: Seconds the communication thread (or the hook) worked on the calls.
    seconds: float
    #: Of those, seconds spent waiting on the network.
    comm_seconds: float

    @property
    def codec_seconds(self) -> float:
        return self.seconds - self.comm_seconds


class CallRecords:
    """A lock-protected list of :class:`~hopq.RunStats`, the most recent
    ``MAX_KEPT_CALLS`` when nobody pops them."""

    #: Who keeps them, for the warning when records are dropped.
    records_owner = "the state"

    def _init_records(self) -> None:
        #: Stats of every call since the last pop.
        self.calls: list[RunStats] = []
        self._dropped = 0
        self._lock = threading.Lock()

    def _record(self, info: RunStats) -> None:
        with self._lock:
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
        """The stats of every call since the last pop (e.g. one training step)."""
        with self._lock:
            out, self.calls = self.calls, []
        return out

    def step_metrics(self) -> StepMetrics:
        """The calls since the last pop summed into one record (and popped):
        call it once per training step, e.g. to log bits per coordinate."""
        return summarize(self.pop_stats())


def summarize(calls: list[RunStats], phases: int | None = None) -> StepMetrics:
    """``calls`` summed; bits per coordinate over the coordinates each call's kind
    moves (``phases``: count every call as 1 = reduce-scatter or 2 = all-reduce)."""
    numel = sum(c.numel for c in calls)
    sent = sum(c.bytes_sent for c in calls)
    moved = sum(
        c.coords_moved if phases is None else phases * (c.world_size - 1) / c.world_size * c.numel
        for c in calls
    )
    return StepMetrics(
        len(calls),
        numel,
        sent,
        8 * sent / moved if moved else float("nan"),
        sum(c.seconds for c in calls),
        sum(c.comm_seconds for c in calls),
    )
