"""The planner: which codec, bit budget and schedule suit a cluster, and why.

:func:`plan` runs every candidate (each codec, DynamiQ at several bit budgets,
each schedule, flat or two-tier) through the calibrated cost model of
:mod:`hopq.comm.cost`, once per gradient bucket, and through a table of measured
errors; it picks the fastest candidate whose error stays within the budget. The
uncompressed codecs (fp32, as DDP's own all-reduce, and fp16/bf16, as torch's
compression hooks) are candidates too, so "nothing compressed pays" is a
possible answer. A pure function of plain data: no process group, no timing
(``hopq plan --measure`` times this machine's codec kernels first).

What it reads, by default:

* **codec speeds**: :data:`DEFAULT_SPEEDS`, seconds per coordinate of each
  kernel on one CPU core, measured with ``hopq.bench.cost_model.calibrate``
  (docs/bench/model.md);
* **errors**: :data:`VNMSE_AT_4`, each codec's vNMSE on real gradients at its
  defaults (docs/bench/vnmse.md, "Every codec on the same gradients": the worse
  of MiniLM and the GPT, 4 ranks on a ring, a chain of 4 compressions), scaled
  to the candidate's chain of recompressions by :data:`VNMSE_GROWTH` (the same
  page's "vNMSE against the world size");
* **training loss**: :data:`LOSS_GAP`, each codec's final held-out loss against
  torch's fp16 hook in the same run (docs/bench/train.md, the GPT over 4 workers,
  60 steps).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from hopq.codecs.registry import available_codecs, codec_info
from hopq.comm.cost import CodecCost, Network, predict
from hopq.comm.topology import TOPOLOGIES

#: Seconds per coordinate (plan+prepare+finish, encode, fused hop, decode, in ns)
#: and bits per coordinate of each codec on one CPU core: ``calibrate(codec,
#: 1 << 20)`` of ``hopq.bench.cost_model`` on an AMD EPYC (2 cores, torch 2.13
#: CPU). GComp's and OmniReduce's bits are those of training (docs/bench/train.md);
#: on the calibration's random vector GComp sends 30 bits.
DEFAULT_SPEEDS: dict[str, tuple[float, float, float, float, float]] = {
    "dynamiq": (1.82, 1.69, 2.37, 0.81, 5.0),
    "fp32": (0.14, 0.0, 0.23, 0.12, 32.0),
    "bf16": (0.10, 0.29, 0.63, 0.10, 16.0),
    "fp16": (0.12, 0.25, 0.61, 0.08, 16.0),
    "equarx": (0.16, 0.42, 0.65, 0.16, 8.25),
    "gcomp": (1.63, 2.30, 5.97, 3.18, 23.52),
    "gqsgd-linear": (3.85, 0.10, 0.50, 0.34, 8.0),
    "gqsgd-exp": (9.45, 1.19, 1.08, 7.44, 8.0),
    "mxfp8": (0.87, 1.24, 2.57, 1.54, 8.5),
    "mxfp6": (0.88, 1.50, 2.81, 1.38, 6.5),
    "mxfp4": (0.90, 1.34, 2.69, 2.17, 4.5),
    "omnireduce": (1.27, 0.46, 0.88, 0.19, 6.49),
    "thc": (8.61, 0.30, 0.83, 0.43, 8.0),
}

#: Final held-out loss against torch's fp16 hook, percent (docs/bench/train.md:
#: the GPT, 4 workers, 60 steps; fp32 is torch's DDP, fp16 the hook itself).
LOSS_GAP: dict[str, float] = {
    "fp32": -0.03,
    "fp16": 0.0,
    "bf16": -0.03,
    "gcomp": -0.03,
    "mxfp8": -0.02,
    "mxfp6": 0.48,
    "mxfp4": -0.89,
    "dynamiq": 0.17,
    "equarx": 0.57,
    "gqsgd-exp": 0.58,
    "gqsgd-linear": 1.08,
    "omnireduce": 3.20,
    "thc": 3.17,
}

#: vNMSE at each codec's defaults, 4 ranks on a ring (docs/bench/vnmse.md, "Every
#: codec on the same gradients": the worse of MiniLM and the GPT).
VNMSE_AT_4: dict[str, float] = {
    "dynamiq": 1.95e-3,
    "fp32": 1.84e-15,
    "bf16": 7.25e-6,
    "fp16": 1.15e-7,
    "equarx": 2.6e-4,
    "gcomp": 1.84e-15,
    "gqsgd-linear": 1.42,
    "gqsgd-exp": 0.266,
    "mxfp8": 1.88e-3,
    "mxfp6": 7.34e-3,
    "mxfp4": 0.119,
    "omnireduce": 9.46e-3,
    "thc": 0.163,
}

#: vNMSE against the chain of compressions, relative to a chain of 4: (chain,
#: factor) points from docs/bench/vnmse.md's "vNMSE against the world size" (a
#: ring of n ranks, a chain of n; the worse of MiniLM and the GPT at each n;
#: a butterfly of the same chain had less error there). Beyond 64 the last
#: segment's slope goes on, the error held at 1 (what sending nothing gives).
#: Codecs without a row keep their error (fp16 follows bf16, EQuARX MXFP8).
VNMSE_GROWTH: dict[str, tuple[tuple[int, float], ...]] = {
    "dynamiq": (
        (2, 0.628),
        (3, 0.825),
        (4, 1.0),
        (6, 1.46),
        (8, 1.79),
        (16, 2.87),
        (32, 4.3),
        (64, 5.87),
    ),
    "mxfp8": (
        (2, 0.542),
        (3, 0.754),
        (4, 1.0),
        (6, 1.27),
        (8, 1.66),
        (16, 2.66),
        (32, 4.73),
        (64, 19.8),
    ),
    "mxfp6": (
        (2, 0.556),
        (3, 0.785),
        (4, 1.0),
        (6, 1.3),
        (8, 1.73),
        (16, 2.65),
        (32, 6.78),
        (64, 27.1),
    ),
    "mxfp4": (
        (2, 0.22),
        (3, 0.495),
        (4, 1.0),
        (6, 1.55),
        (8, 2.12),
        (16, 4.98),
        (32, 7.0),
        (64, 7.0),
    ),
    "bf16": (
        (2, 0.567),
        (3, 0.761),
        (4, 1.0),
        (6, 1.29),
        (8, 1.64),
        (16, 2.72),
        (32, 4.78),
        (64, 9.18),
    ),
    "omnireduce": (
        (2, 0.993),
        (3, 1.04),
        (4, 1.0),
        (6, 0.975),
        (8, 0.955),
        (16, 0.937),
        (32, 0.835),
        (64, 0.745),
    ),
    "thc": (
        (2, 0.689),
        (3, 0.737),
        (4, 1.0),
        (6, 0.689),
        (8, 0.627),
        (16, 0.487),
        (32, 0.666),
        (64, 0.694),
    ),
}
VNMSE_GROWTH["fp16"] = VNMSE_GROWTH["bf16"]
VNMSE_GROWTH["equarx"] = VNMSE_GROWTH["mxfp8"]

#: DynamiQ's vNMSE at each bit budget relative to 5 bits (docs/bench/vnmse.md,
#: "Bit budget", the worse of MiniLM and the GPT, 4 ranks, ring).
DYNAMIQ_BUDGET_FACTOR: dict[float, float] = {
    3.0: 38.9,
    4.0: 6.88,
    5.0: 1.0,
    6.0: 0.284,
    7.0: 0.123,
    8.0: 0.066,
}

#: Codecs that return the exact sum: fp32, and GComp without an optimizer (no
#: mantissa truncation).
LOSSLESS = ("fp32", "gcomp")
#: What torch itself offers: DDP's all-reduce (fp32) and its compression hooks.
UNCOMPRESSED = ("fp32", "fp16", "bf16")

#: Other schedules are walked step by step up to this many ranks (a butterfly
#: of 1024 takes seconds); beyond, only their two-tier forms are candidates.
WALK_UP_TO = 256


@dataclass(frozen=True)
class PlanInputs:
    """What the planner plans for: the cluster, the buckets and the error budget.

    Attributes:
        nodes: N, the machines.
        per_node: G, the workers of each machine.
        inter_gbit: Each node's uplink to the other nodes, Gbit/s per direction.
        intra_gbit: Each worker's link to the workers of its node, Gbit/s.
        inter_latency_us: Latency of a step between nodes, microseconds.
        intra_latency_us: Latency of a step inside a node, microseconds.
        cores_per_node: CPU cores a node's workers share for codec work (None:
            one per worker, as with GPUs).
        duplex: How much longer two ranks sending to each other take than one
            way (1: full-duplex links).
        params: Gradient coordinates of the model (float32), split into
            buckets as DDP does (one of ``first_bucket_mb``, then
            ``bucket_mb`` each); ignored when ``buckets`` is given.
        bucket_mb: DDP's ``bucket_cap_mb``.
        first_bucket_mb: DDP's first bucket.
        buckets: Coordinates of each bucket, in the order the backward pass
            makes them ready; empty: from ``params``.
        compute_s: Seconds of the backward pass, over which the buckets become
            ready evenly by size (None: no overlap modelled; the pick is then
            the fastest synchronization).
        lossless: Only codecs that return the exact sum (fp32, GComp).
        max_loss_gap: Percent of final training loss above torch's fp16 hook a
            codec may have had (docs/bench/train.md); None: no such limit.
            Codecs never trained (DynamiQ below 5 bits) exceed any limit.
        max_vnmse: The largest predicted vNMSE allowed; None: no limit.
        max_vnmse_ratio: The largest predicted vNMSE allowed relative to
            DynamiQ's at 5 bits on the same chain of recompressions (its
            measured error on real gradients, grown with the chain as
            measured): 1 (the default) admits no codec noisier than DynamiQ's
            default at that world size and schedule, so codecs whose error
            grows faster with the hops (MXFP4, MXFP6, then MXFP8) fall out as
            the world grows; larger values loosen it (about 60 admits MXFP4 at
            4 ranks); None: no such limit.
        codecs: Codecs to consider; empty: every registered one that has a
            speed.
        schedules: Flat topologies (``"ring"``, ``"butterfly"``, ...) and
            two-tier ones (``"hier:<topology>"``, only when N > 1 and G > 1).
            Schedules other than the ring are walked step by step up to
            :data:`WALK_UP_TO` ranks; beyond, they are left out.
        budgets: DynamiQ's bit budgets to consider.
        speeds: Codec -> (plan, encode, fused hop, decode in ns per coordinate
            on one core, bits per coordinate), over :data:`DEFAULT_SPEEDS`.
        vnmse: Codec -> vNMSE at a chain of 4, over :data:`VNMSE_AT_4`.

    Example:
        >>> from hopq import PlanInputs, plan
        >>> inp = PlanInputs(nodes=2, per_node=8, inter_gbit=25, params=125_000_000)
        >>> len(inp.bucket_sizes()), inp.bucket_sizes()[0]  # DDP's 1 MiB, then 25 MiB each
        (21, 262144)
        >>> PlanInputs.from_dict(inp.to_dict()) == inp
        True
        >>> plan(inp, compute_s=0.3).inputs.compute_s
        0.3
    """

    nodes: int = 1
    per_node: int = 1
    inter_gbit: float = 10.0
    intra_gbit: float = 100.0
    inter_latency_us: float = 20.0
    intra_latency_us: float = 2.0
    cores_per_node: int | None = None
    duplex: float = 1.0
    params: int = 25_000_000
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    buckets: tuple[int, ...] = ()
    compute_s: float | None = None
    lossless: bool = False
    max_loss_gap: float | None = 0.5
    max_vnmse: float | None = 0.1
    max_vnmse_ratio: float | None = 1.0
    codecs: tuple[str, ...] = ()
    schedules: tuple[str, ...] = ("ring", "butterfly", "hier:ring", "hier:butterfly")
    budgets: tuple[float, ...] = (4.0, 5.0, 6.0, 8.0)
    speeds: dict[str, tuple[float, ...]] = field(default_factory=dict)
    vnmse: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the network checks its own fields
        self.network()
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))
        object.__setattr__(self, "codecs", tuple(self.codecs))
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "budgets", tuple(float(b) for b in self.budgets))
        speeds = {k: tuple(float(x) for x in v) for k, v in self.speeds.items()}
        object.__setattr__(self, "speeds", speeds)
        object.__setattr__(self, "vnmse", {k: float(v) for k, v in self.vnmse.items()})
        if not isinstance(self.params, int) or self.params < 0:
            raise ValueError(f"params must be an int >= 0, got {self.params!r}")
        if any(b < 0 for b in self.buckets):
            raise ValueError(f"bucket sizes must be >= 0, got {self.buckets}")
        for name in ("bucket_mb", "first_bucket_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_vnmse_ratio is not None and not self.max_vnmse_ratio > 0:
            raise ValueError(
                f"max_vnmse_ratio must be positive or None, got {self.max_vnmse_ratio!r}"
            )
        if self.compute_s is not None and not self.compute_s >= 0:
            raise ValueError(f"compute_s must be >= 0 or None, got {self.compute_s!r}")
        for name, v in speeds.items():
            if len(v) != 5 or any(not (x >= 0) for x in v) or not v[4] > 0:
                raise ValueError(
                    f"speeds[{name!r}]: expected (plan, encode, hop, decode ns/coord, bits), got {v}"
                )
        if not self.schedules:
            raise ValueError("schedules: give at least one")
        for sched in self.schedules:
            if sched.removeprefix("hier:") not in TOPOLOGIES:
                raise ValueError(
                    f"schedule {sched!r}: expected one of {list(TOPOLOGIES)} or hier:<topology>"
                )
        for b in self.budgets:
            if not 1 <= b <= 16:
                raise ValueError(f"DynamiQ budgets must lie in 1..16 bits, got {b}")
        known = set(available_codecs())
        bad = [c for c in self.codecs if c not in known]
        if bad:
            raise ValueError(f"unknown codecs {bad}; available: {sorted(known)}")

    def network(self) -> Network:
        """The cluster as :class:`hopq.comm.cost.Network`."""
        return Network(
            self.nodes,
            self.per_node,
            self.inter_gbit,
            self.intra_gbit,
            self.inter_latency_us,
            self.intra_latency_us,
            self.cores_per_node,
            self.duplex,
        )

    def bucket_sizes(self) -> tuple[int, ...]:
        """Coordinates per bucket: ``buckets``, or ``params`` cut as DDP cuts it."""
        if self.buckets:
            return self.buckets
        first = max(1, int(self.first_bucket_mb * (1 << 20) / 4))
        cap = max(1, int(self.bucket_mb * (1 << 20) / 4))
        left = self.params
        out = [min(left, first)] if left else []
        left -= out[0] if out else 0
        while left > 0:
            out.append(min(left, cap))
            left -= cap
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        d["speeds"] = {k: list(v) for k, v in self.speeds.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanInputs:
        """The inputs back from :meth:`to_dict`."""
        kw = dict(d)
        for k in ("buckets", "codecs", "schedules", "budgets"):
            if k in kw:
                kw[k] = tuple(kw[k])
        return cls(**kw)


@dataclass(frozen=True)
class Candidate:
    """One candidate's predicted time and error.

    Attributes:
        codec: The registered codec name.
        config: Its options (DynamiQ's ``budget``).
        schedule: ``"ring"``, ``"butterfly"``, ... or ``"hier:<topology>"``.
        bits: Bits per coordinate on the wire.
        sync_s: Seconds to synchronize every bucket, one after the other.
        exposed_s: Seconds of that beyond the backward pass (None without
            ``compute_s``).
        recompressions: The longest chain of compressions.
        vnmse: Predicted vNMSE.
        loss_gap: Measured final loss against torch's fp16 hook, percent (None:
            never trained).
        excluded: Why the error budget leaves it out ("" when it is within).
    """

    codec: str
    config: dict[str, Any]
    schedule: str
    bits: float
    sync_s: float
    exposed_s: float | None
    recompressions: int
    vnmse: float
    loss_gap: float | None
    excluded: str = ""

    @property
    def label(self) -> str:
        """``codec`` or ``codec(budget=6)``."""
        if not self.config:
            return self.codec
        return self.codec + "(" + ",".join(f"{k}={v:g}" for k, v in self.config.items()) + ")"

    @property
    def time_s(self) -> float:
        """What the pick minimizes: exposed seconds, else synchronization seconds."""
        return self.sync_s if self.exposed_s is None else self.exposed_s


@dataclass(frozen=True)
class Plan:
    """The planner's pick, its reason, and every candidate it weighed.

    Print :meth:`table` to read it; keep :meth:`to_json` to pin it, and pass
    :meth:`hook_kwargs` to :class:`hopq.HookState` (or :meth:`all_reduce_kwargs`
    to :func:`hopq.all_reduce`).

    Attributes:
        codec: The picked codec.
        codec_config: Its options (e.g. ``{"budget": 6.0}`` for DynamiQ).
        topology: The schedule between the ranks (two-tier: between the nodes).
        layout: ``"NxG"`` for a two-tier all-reduce, None for a flat one.
        reason: One line: why this pick.
        inputs: What it planned for.
        candidates: Every candidate, fastest first.

    Example:
        >>> import hopq
        >>> p = hopq.plan(nodes=2, per_node=2, inter_gbit=0.2, params=3_000_000)
        >>> p.codec != "fp32", p.layout
        (True, '2x2')
        >>> hopq.Plan.from_json(p.to_json()) == p
        True
    """

    codec: str
    codec_config: dict[str, Any]
    topology: str
    layout: str | None
    reason: str
    inputs: PlanInputs
    candidates: tuple[Candidate, ...]

    @property
    def schedule(self) -> str:
        """``topology``, or ``"hier:<topology>"`` for a two-tier pick."""
        return f"hier:{self.topology}" if self.layout else self.topology

    @property
    def pick(self) -> Candidate:
        """The picked candidate."""
        for c in self.candidates:
            if (c.codec, c.config, c.schedule) == (self.codec, self.codec_config, self.schedule):
                return c
        raise LookupError("the pick is not among the candidates")

    def hook_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`hopq.HookState` for this pick.

        Returns:
            ``codec``, ``topology``, ``layout`` and the codec's options.

        Example:
            >>> import hopq
            >>> p = hopq.plan(nodes=1, per_node=4, intra_gbit=0.1, params=1 << 20)
            >>> print(*sorted(p.hook_kwargs())[:3])
            codec layout topology
        """
        return {
            "codec": self.codec,
            "topology": self.topology,
            "layout": self.layout,
            **self.codec_config,
        }

    def all_reduce_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`hopq.all_reduce` for this pick.

        Returns:
            ``codec`` (an instance with the pick's options when it has any),
            ``topology`` and ``layout``.
        """
        from hopq.codecs.registry import get_codec

        codec: Any = get_codec(self.codec, **self.codec_config) if self.codec_config else self.codec
        return {"codec": codec, "topology": self.topology, "layout": self.layout}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready).

        Returns:
            The pick, its reason, the inputs and every candidate.
        """
        return {
            "codec": self.codec,
            "codec_config": dict(self.codec_config),
            "topology": self.topology,
            "layout": self.layout,
            "reason": self.reason,
            "inputs": self.inputs.to_dict(),
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The plan back from :meth:`to_dict`.

        Args:
            d: What :meth:`to_dict` returned.

        Returns:
            An equal plan.
        """
        return cls(
            d["codec"],
            dict(d["codec_config"]),
            d["topology"],
            d["layout"],
            d["reason"],
            PlanInputs.from_dict(d["inputs"]),
            tuple(Candidate(**c) for c in d["candidates"]),
        )

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON.

        Returns:
            A JSON string.
        """
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan back from :meth:`to_json`.

        Args:
            text: What :meth:`to_json` returned.

        Returns:
            An equal plan.
        """
        return cls.from_dict(json.loads(text))

    def table(self, limit: int | None = None) -> str:
        """The candidates as a markdown table, fastest first, and the pick.

        Args:
            limit: Show at most this many rows (None: all).

        Returns:
            The table and a last line naming the pick and why.
        """
        fp16 = _best_of(self.candidates, "fp16")
        rows = []
        shown = self.candidates if limit is None else self.candidates[:limit]
        for c in shown:
            rows.append(
                [
                    ("**" + c.label + "**") if c == self.pick else c.label,
                    c.schedule,
                    f"{c.bits:.2f}",
                    f"{c.sync_s * 1e3:.1f}",
                    "" if c.exposed_s is None else f"{c.exposed_s * 1e3:.1f}",
                    f"{c.time_s / fp16.time_s:.2f}x" if fp16 and fp16.time_s > 0 else "",
                    c.recompressions,
                    f"{c.vnmse:.2g}",
                    "" if c.loss_gap is None else f"{c.loss_gap:+.2f}%",
                    c.excluded or "yes",
                ]
            )
        header = [
            "candidate",
            "schedule",
            "bits/coord",
            "sync (ms)",
            "exposed (ms)",
            "vs fp16",
            "recompressions",
            "vNMSE",
            "loss vs fp16",
            "within budget",
        ]
        return _table(header, rows) + f"\n\nPick: {self.reason}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header, *[[str(x) for x in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def _best_of(cands: tuple[Candidate, ...], codec: str) -> Candidate | None:
    mine = [c for c in cands if c.codec == codec]
    return min(mine, key=lambda c: c.time_s) if mine else None


def _growth(codec: str, chain: int) -> float:
    """VNMSE_GROWTH at ``chain``: log-log between points, flat beyond the ends."""
    pts = VNMSE_GROWTH.get(codec)
    if not pts or chain <= 0:
        return 1.0
    if chain <= pts[0][0]:
        return pts[0][1]
    if chain >= pts[-1][0]:
        (c0, f0), (c1, f1) = pts[-2], pts[-1]
        return f1 * (chain / c1) ** (math.log(f1 / f0) / math.log(c1 / c0))
    for (c0, f0), (c1, f1) in zip(pts, pts[1:], strict=False):
        if c0 <= chain <= c1:
            t = math.log(chain / c0) / math.log(c1 / c0)
            return math.exp(math.log(f0) + t * (math.log(f1) - math.log(f0)))
    return pts[-1][1]  # pragma: no cover


def _cost(
    name: str, speeds: dict[str, tuple[float, ...]], bits: float | None = None
) -> CodecCost | None:
    v = speeds.get(name, DEFAULT_SPEEDS.get(name))
    if v is None:
        return None
    p, e, h, d, b = v
    return CodecCost(name, p * 1e-9, e * 1e-9, h * 1e-9, d * 1e-9, b if bits is None else bits)


def _applies(codec: str, schedule: str, net: Network) -> bool:
    if schedule.startswith("hier:"):
        if net.nodes < 2 or net.per_node < 2:
            return False
        topology = schedule.split(":", 1)[1]
        if topology != "ring" and net.nodes > WALK_UP_TO:
            return False
    else:
        topology = schedule
        if topology != "ring" and net.world_size > WALK_UP_TO:
            return False
    allowed = codec_info(codec).topologies
    return allowed is None or topology in allowed


def _exposed(times: list[float], sizes: tuple[int, ...], compute_s: float) -> float:
    """Buckets ready evenly by size over the backward pass, synchronized one
    after the other: the seconds the last one ends after the pass."""
    total = sum(sizes) or 1
    end = done = 0.0
    for t, s in zip(times, sizes, strict=True):
        done += s
        end = max(end, compute_s * done / total) + t
    return max(0.0, end - compute_s)


def plan(inputs: PlanInputs | None = None, **fields: Any) -> Plan:
    """Pick the codec, bit budget and schedule for a cluster, and say why.

    Every registered codec with a known speed (and DynamiQ at each budget of
    ``budgets``) on every schedule of ``schedules`` is timed by the calibrated
    cost model (:func:`hopq.comm.cost.predict`) for each bucket, and given a
    predicted vNMSE and its measured training loss; the fastest within the
    error budget wins (with ``compute_s``: the least exposed). Torch's own
    options (fp32, fp16, bf16) are candidates, so the pick may be uncompressed.
    Pure: no process group, no timing.

    Args:
        inputs: The inputs; None: :class:`PlanInputs` defaults.
        **fields: :class:`PlanInputs` fields that replace those of ``inputs``
            (``nodes=8, per_node=8, inter_gbit=25, params=125_000_000``).

    Returns:
        The :class:`Plan`: the pick (``codec``, ``codec_config``,
        ``topology``, ``layout``), a one-line ``reason``, and every candidate
        with its predicted time and error.

    Raises:
        ValueError: An input out of range, an unknown codec, or no candidate
            within the error budget (say which limit to loosen).
        TypeError: A field :class:`PlanInputs` does not have.

    Example:
        >>> import hopq
        >>> slow = hopq.plan(nodes=4, inter_gbit=0.15, params=3_000_000)
        >>> slow.codec in ("fp32", "fp16", "bf16")
        False
        >>> fast = hopq.plan(nodes=8, inter_gbit=10, params=3_000_000)
        >>> fast.codec in ("fp32", "fp16", "bf16")  # nothing compressed pays on CPU workers
        True
        >>> hopq.plan(nodes=4, inter_gbit=0.15, lossless=True).codec in ("fp32", "gcomp")
        True
    """
    base = inputs if inputs is not None else PlanInputs()
    if fields:
        base = dataclasses.replace(base, **fields)
    net = base.network()
    sizes = base.bucket_sizes()
    exact = _cost("fp32", base.speeds) or CodecCost("fp32", 0.0, 0.0, 0.0, 0.0, 32.0)
    names = list(base.codecs) or [c for c in available_codecs()]
    if base.lossless:
        names = [c for c in names if c in LOSSLESS]
    variants: list[tuple[str, dict[str, Any], CodecCost]] = []
    for name in names:
        if name == "dynamiq":  # one candidate per bit budget
            for b in base.budgets:
                cost = _cost(name, base.speeds, b)
                if cost is not None:
                    variants.append((name, {} if b == 5.0 else {"budget": b}, cost))
            continue
        cost = _cost(name, base.speeds)
        if cost is not None:
            variants.append((name, {}, cost))
    if not variants:
        raise ValueError(f"no codec with a known speed among {names}; give speeds=")
    cands: list[Candidate] = []
    for name, config, cost in variants:
        for sched in base.schedules:
            if not _applies(name, sched, net):
                continue
            preds = {s: predict(cost, sched, net, s, exact) for s in set(sizes) if s}
            times = [preds[s].seconds if s else 0.0 for s in sizes]
            chain = max((q.recompressions for q in preds.values()), default=0)
            cands.append(
                _candidate(base, name, config, cost, sched, sum(times), times, sizes, chain)
            )
    if not cands:
        raise ValueError(f"no codec runs on the schedules {list(base.schedules)}")
    cands.sort(key=lambda c: (c.time_s, c.vnmse))
    ok = [c for c in cands if not c.excluded]
    if not ok:
        raise ValueError(
            "no candidate within the error budget: loosen max_loss_gap or max_vnmse "
            f"(fastest left out: {cands[0].label}, {cands[0].excluded})"
        )
    best = ok[0]
    reason = _reason(best, tuple(cands), net, len(ok))
    topology = (
        best.schedule.split(":", 1)[1] if best.schedule.startswith("hier:") else best.schedule
    )
    layout = f"{net.nodes}x{net.per_node}" if best.schedule.startswith("hier:") else None
    return Plan(best.codec, dict(best.config), topology, layout, reason, base, tuple(cands))


def _candidate(
    inp: PlanInputs,
    name: str,
    config: dict[str, Any],
    cost: CodecCost,
    sched: str,
    sync: float,
    times: list[float],
    sizes: tuple[int, ...],
    chain: int,
) -> Candidate:
    base = inp.vnmse.get(name, VNMSE_AT_4.get(name, math.nan))
    if name == "dynamiq":
        base *= _budget_factor(cost.bits)
    vnmse = _grown(name, base, chain)
    ref = _grown("dynamiq", inp.vnmse.get("dynamiq", VNMSE_AT_4["dynamiq"]), chain)
    gap = LOSS_GAP.get(name)
    if name == "dynamiq" and cost.bits < 5.0:
        gap = None  # trained at 5 bits only
    why = ""
    if inp.lossless and name not in LOSSLESS:
        why = "not lossless"
    elif inp.max_loss_gap is not None and gap is None:
        why = "never trained"
    elif inp.max_loss_gap is not None and gap is not None and gap > inp.max_loss_gap:
        why = f"loss +{gap:.2f}% > {inp.max_loss_gap:g}%"
    elif inp.max_vnmse is not None and not vnmse <= inp.max_vnmse:
        why = f"vNMSE {vnmse:.2g} > {inp.max_vnmse:g}"
    elif inp.max_vnmse_ratio is not None and not vnmse <= inp.max_vnmse_ratio * ref * (1 + 1e-9):
        ratio = "" if inp.max_vnmse_ratio == 1 else f"{inp.max_vnmse_ratio:g}x "
        why = f"vNMSE {vnmse:.2g} > {ratio}DynamiQ's {ref:.2g}"
    exposed = None if inp.compute_s is None else _exposed(times, sizes, inp.compute_s)
    return Candidate(name, config, sched, cost.bits, sync, exposed, chain, vnmse, gap, why)


def _grown(name: str, base: float, chain: int) -> float:
    """``base`` (the vNMSE at a chain of 4) at a chain of ``chain`` compressions."""
    vnmse = base * _growth(name, chain)
    if chain > 64:
        vnmse = min(vnmse, max(1.0, base * _growth(name, 64)))
    return vnmse


#: A chain of recompressions over which a lossy codec's error grows this many
#: times beyond that of a chain of 8 (a ring of 8 ranks), by :data:`VNMSE_GROWTH`,
#: is said to the user (:func:`long_chain_note`): DynamiQ from a chain of about
#: 24, MXFP8 from about 22, MXFP4 from 16.
LONG_CHAIN_GROWTH = 2.0


def long_chain_note(codec: str, topology: str, world_size: int, chain: int) -> str | None:
    """What to tell a user whose schedule recompresses a lossy codec's
    contributions ``chain`` times, where :data:`VNMSE_GROWTH` puts the error
    over :data:`LONG_CHAIN_GROWTH` times that of a chain of 8; None where it
    does not, and for the 16-bit formats and the lossless codecs, whose error
    stays small.

    Args:
        codec: The codec's registry name.
        topology: The schedule's name.
        world_size: Ranks on the schedule.
        chain: The longest chain of compressions a contribution goes through.

    Returns:
        One sentence for a warning, or None.

    Example:
        >>> long_chain_note("dynamiq", "ring", 8, 8) is None
        True
    """
    if chain <= 8 or codec in LOSSLESS or codec in ("bf16", "fp16") or codec not in VNMSE_GROWTH:
        return None
    factor = _growth(codec, chain) / _growth(codec, 8)
    if factor <= LONG_CHAIN_GROWTH:
        return None
    return (
        f"{codec} on a {topology} of {world_size} ranks recompresses a contribution up to "
        f"{chain} times, and its error grows with that chain: about {factor:.1f}x that of a "
        "ring of 8 on real gradients, more on i.i.d. data (a ring of 128 errs more than "
        "sending nothing there). topology='butterfly', or a two-tier layout= across "
        "machines, keeps the chain short (docs/integrations/multinode.md)"
    )


def _budget_factor(bits: float) -> float:
    pts = sorted(DYNAMIQ_BUDGET_FACTOR.items())
    if bits <= pts[0][0]:
        return pts[0][1]
    if bits >= pts[-1][0]:
        return pts[-1][1]
    for (b0, f0), (b1, f1) in zip(pts, pts[1:], strict=False):
        if b0 <= bits <= b1:
            t = (bits - b0) / (b1 - b0)
            return math.exp(math.log(f0) + t * (math.log(f1) - math.log(f0)))
    return 1.0  # pragma: no cover


def _reason(best: Candidate, cands: tuple[Candidate, ...], net: Network, n_ok: int) -> str:
    what = "exposed" if best.exposed_s is not None else "to synchronize"
    fp16 = _best_of(cands, "fp16")
    vs = (
        f", {best.time_s / fp16.time_s:.2f}x of fp16's {fp16.time_s * 1e3:.1f} ms"
        if fp16 is not None and fp16.time_s > 0 and best.codec != "fp16"
        else ""
    )
    head = (
        f"{best.label} on {best.schedule} ({net.nodes}x{net.per_node}): "
        f"{best.time_s * 1e3:.1f} ms {what} per step{vs}"
    )
    if best.codec in UNCOMPRESSED:
        comp = [c for c in cands if c.codec not in UNCOMPRESSED and not c.excluded]
        tail = (
            f"; nothing compressed pays (fastest: {comp[0].label} on {comp[0].schedule}, "
            f"{comp[0].time_s * 1e3:.1f} ms)"
            if comp
            else "; no compressed codec within the error budget"
        )
    else:
        gap = "" if best.loss_gap is None else f", training loss {best.loss_gap:+.2f}% vs fp16"
        tail = f"; predicted vNMSE {best.vnmse:.2g}{gap}"
    return head + tail + f" ({n_ok} of {len(cands)} candidates within the error budget)"


#: PlanInputs fields that ``codec="auto"`` uses over the probe's and the
#: defaults (e.g. ``speeds`` of GPU kernels, ``max_vnmse``); the same on every
#: rank (a different pick on some rank is a MismatchError).
AUTO_OVERRIDES: dict[str, Any] = {}
#: Per process group (held weakly: a destroyed group is freed): the agreed
#: probe, and the pick per tensor size.
_PROBES: weakref.WeakKeyDictionary[Any, tuple[float, float]] = weakref.WeakKeyDictionary()
_PICKS: weakref.WeakKeyDictionary[Any, dict[Any, tuple[str, dict[str, Any], str, Any]]] = (
    weakref.WeakKeyDictionary()
)
_log = logging.getLogger("hopq")

#: The probe: all-reduces of 1 float (latency) and of this many (the rate).
PROBE_NUMEL = 1 << 18
#: On a fast link the rate is timed again on 4x larger all-reduces while the
#: last one took under this many seconds, up to :data:`PROBE_MAX_NUMEL`
#: floats: a small all-reduce there is mostly fixed costs, and reads the link
#: slower than the buckets see it.
PROBE_GROW_S = 0.02
PROBE_MAX_NUMEL = 1 << 24


def _once(tensor: Any, group: Any) -> float:
    """Seconds of one all-reduce of ``tensor`` (on CUDA, synchronized)."""
    import torch
    import torch.distributed as dist

    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    t0 = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - t0


def _timed(tensor: Any, group: Any, reps: int) -> float:
    """The best of ``reps`` all-reduces of ``tensor`` after an untimed one:
    what the link and the backend can do (the noise of processes that share
    cores only adds)."""
    times = [_once(tensor, group) for _ in range(reps + 1)]
    return min(times[1:])


def _agreed_max(values: list[float], group: Any, device: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.cpu()]


def probe_link(group: Any = None, device: Any = "cpu") -> tuple[float, float]:
    """Time a few small all-reduces on ``group`` (every rank must call it):
    (latency per ring step in seconds, link rate in Gbit/s), the slowest rank's
    timings, so every rank returns the same numbers.

    The rate is the slope between the two largest all-reduces timed: one of
    :data:`PROBE_NUMEL` floats against one float on a slow link, where the
    latency is one float's all-reduce. On a fast one (under
    :data:`PROBE_GROW_S`) sizes grow 4x, each agreed before the next, and the
    latency is the intercept of the line through the two largest."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    small = _timed(torch.zeros(1, device=device), group, 5)
    numel = PROBE_NUMEL
    big = _timed(torch.zeros(numel, device=device), group, 3)
    small, big = _agreed_max([small, big], group, device)
    prev_numel, prev = 1, small
    while big < PROBE_GROW_S and numel * 4 <= PROBE_MAX_NUMEL:
        t = _agreed_max([_timed(torch.zeros(numel * 4, device=device), group, 2)], group, device)[0]
        if t <= big:  # no slower: noise, keep what was timed
            break
        prev_numel, prev, numel, big = numel, big, numel * 4, t
    steps = 2 * max(1, n - 1)
    per = 2 * (n - 1) / n * 4 if n > 1 else 4.0  # bytes a rank sends per float
    slope = max(big - prev, 1e-9) / (numel - prev_numel)  # seconds per float
    # grown: the line through the two largest, whose intercept (the fixed costs
    # of a call of megabytes: allocation, chunking) is the latency, not one
    # float's round trip
    fixed = max(small, big - slope * numel) if prev_numel > 1 else small
    return fixed / steps, per * 8 / slope / 1e9


#: The seed of codec="auto"'s first message ("auto" in ASCII): an fp32
#: all-reduce of one float whose agreement a named codec's call never matches.
AUTO_SEED = 0x6175746F


def _layout_key(layout: Any) -> int:
    """The key of the first message: the layout asked for (None, "auto", NxG),
    so that ranks that ask for different layouts disagree there."""
    from hopq.comm.agreement import digest
    from hopq.comm.layout import NodeLayout

    spec = layout.node_of if isinstance(layout, NodeLayout) else layout
    return digest(("codec='auto'", spec)) % (1 << 62)


def _device(tensor: Any, group: Any) -> Any:
    """Where the probe's tensors live: the tensor's GPU over NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    nccl = "nccl" in str(dist.get_backend(group)).lower()
    return tensor.device if nccl else torch.device("cpu")


def agree_auto(tensor: Any, group: Any, layout: Any) -> tuple[tuple[float, float], Any]:
    """The start of ``codec="auto"`` on a group, on every rank: first an fp32
    all-reduce of one float through hopq's agreement, whose fingerprint says
    "auto" (seed :data:`AUTO_SEED`, a key naming the layout), so that a rank that
    passed a named codec, or another layout, makes every rank raise
    :class:`hopq.MismatchError` instead of waiting; then :func:`probe_link`;
    then, with a layout, the agreed :class:`~hopq.comm.layout.NodeLayout`.
    Returns ((latency per step s, Gbit/s), the layout or None)."""
    import torch
    import torch.distributed as dist

    from hopq.comm.collectives import all_reduce
    from hopq.comm.layout import NodeLayout, claim_of, from_claims, resolve_spec
    from hopq.errors import MismatchError

    spec = resolve_spec(layout)
    dev = _device(tensor, group)
    try:
        all_reduce(torch.ones(1, device=dev), "fp32", "ring", "sum", group, AUTO_SEED,
                   _layout_key(spec))  # fmt: skip
    except MismatchError as e:
        raise MismatchError(
            f"codec='auto' on rank {dist.get_rank(group)}: its first message (an fp32 "
            f"all-reduce of one float, seed {AUTO_SEED}) met another call: every rank must "
            f"pass codec='auto', with the same layout ({e})"
        ) from e
    probe = probe_link(group, dev)
    if spec is None:
        return probe, None
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if isinstance(spec, NodeLayout):
        return probe, from_claims([(0, 0, 0)] * n, spec)
    mine = torch.tensor(claim_of(spec, rank, n), dtype=torch.int64, device=dev)
    got = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(got, mine, group=group)
    claims = [(int(t[0]), int(t[1]), int(t[2])) for t in got]
    return probe, from_claims(claims, spec)


#: Coordinates ``codec="auto"`` times each candidate codec's kernels on, and
#: the timed calls of each kernel (after an untimed one; the best counts).
SPEED_PROBE_COORDS = 1 << 17
SPEED_PROBE_REPS = 2
#: Coordinates of each timed codec's first, untimed pass before its timing:
#: its kernels' first calls, which load them from numba's on-disk cache (about
#: 1 s for DynamiQ and MXFP8 on 4 ranks sharing 2 cores) or, on a cold cache,
#: compile them (DynamiQ 6.3 s, MXFP8 4.0 s on one idle core).
SPEED_WARM_COORDS = 1 << 12


#: Codecs whose fastest candidate the default speeds put within this factor
#: of the fastest are timed by :func:`agree_speeds`; the others are scaled.
SPEED_WITHIN = 3.0


def agree_speeds(
    numel: int,
    n: int,
    probe: tuple[float, float],
    lay: Any,
    group: Any,
    device: Any,
    first_calls: list[float] | None = None,
) -> dict[str, tuple[float, ...]]:
    """The kernel speeds of the codecs a plan of ``numel`` coordinates could
    pick (those within the error budget with the default speeds), the slowest
    rank's: the ``speeds`` of :class:`PlanInputs`, the same on every rank.

    The codecs whose fastest candidate the default speeds predict within
    :data:`SPEED_WITHIN` of the fastest are timed on this rank as it runs now
    (:func:`hopq.comm.cost.time_codec`, on :data:`SPEED_PROBE_COORDS`
    coordinates, on a GPU the bucket's size up to 16M): every rank times at
    once, so workers that share cores measure that, and ``cores_per_node``
    should stay None. The others keep their default speeds times the median
    ratio of measured to default speed of the timed ones. Empty when
    :data:`AUTO_OVERRIDES` gives speeds. The timed codecs first make one
    untimed pass on :data:`SPEED_WARM_COORDS` coordinates (their kernels'
    first calls, :func:`_first_calls`); its seconds are appended to
    ``first_calls`` when given."""
    import torch
    import torch.distributed as dist

    from hopq.comm.cost import time_codec

    if "speeds" in AUTO_OVERRIDES:
        return {}
    first = plan_call(numel, n, probe, lay)
    ok = [c for c in first.candidates if not c.excluded]  # fastest first
    names = list(dict.fromkeys(c.codec for c in ok))
    timed = list(dict.fromkeys(c.codec for c in ok if c.time_s <= SPEED_WITHIN * ok[0].time_s))
    # on a GPU a small call times the launch: a bucket's size, up to 16M
    coords = SPEED_PROBE_COORDS
    if torch.device(device).type == "cuda":
        coords = max(coords, min(numel, 1 << 24))
    t0 = time.perf_counter()
    _first_calls(timed, device, group)
    if first_calls is not None:
        first_calls.append(time.perf_counter() - t0)
    rows = []
    for name in timed:
        c = time_codec(name, coords, device, reps=SPEED_PROBE_REPS)
        rows.append([c.plan, c.enc, c.hop, c.dec])
    t = torch.tensor(rows, dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out = {
        name: (*(v * 1e9 for v in row), DEFAULT_SPEEDS[name][4])
        for name, row in zip(timed, t.cpu().tolist(), strict=True)
    }
    ratios = [sum(out[k][:4]) / sum(DEFAULT_SPEEDS[k][:4]) for k in timed]
    scale = statistics.median(ratios) if ratios else 1.0
    for name in names:
        if name not in out:
            d = DEFAULT_SPEEDS[name]
            out[name] = (*(v * scale for v in d[:4]), d[4])
    return out


def _first_calls(timed: list[str], device: Any, group: Any) -> None:
    """The first, untimed calls of the ``timed`` codecs' kernels: on the
    lowest rank of each host first, then on the others. On a cold cache the
    first rank compiles the kernels and writes numba's on-disk cache, and its
    host's other ranks load them from it instead of each compiling them at
    once (4 ranks on 2 cores, DynamiQ and MXFP8: 26 s each compiling, against
    about 10 s)."""
    import torch
    import torch.distributed as dist

    from hopq.comm.cost import time_codec
    from hopq.comm.layout import host_claim

    def run() -> None:
        for name in timed:
            time_codec(name, SPEED_WARM_COORDS, device, reps=1)

    n = dist.get_world_size(group)
    if n == 1:
        run()
        return
    host = torch.tensor([host_claim()[0] % (1 << 62)], device=device)
    hosts = [torch.zeros_like(host) for _ in range(n)]
    dist.all_gather(hosts, host, group=group)
    me = dist.get_rank(group)
    first = min(r for r in range(n) if int(hosts[r]) == int(host))
    if me == first:
        run()
    done = torch.zeros(1, device=device)
    dist.all_reduce(done, group=group)  # every host's first rank has its kernels
    if me != first:
        run()


def plan_call(
    numel: int,
    n: int,
    probe: tuple[float, float],
    lay: Any = None,
    speeds: dict[str, tuple[float, ...]] | None = None,
) -> Plan:
    """The plan of one call of ``numel`` coordinates on ``n`` ranks from the
    agreed probe (and layout: the two-tier schedules are candidates too; and
    measured ``speeds``: :func:`agree_speeds`), with :data:`AUTO_OVERRIDES`: a
    pure function of agreed values, so the same on every rank."""
    latency, gbit = probe
    fields: dict[str, Any] = {
        "nodes": n,
        "inter_gbit": gbit,
        "inter_latency_us": latency * 1e6,
        "buckets": (max(numel, 1),),
        "schedules": ("ring", "butterfly"),
    }
    if speeds:
        fields["speeds"] = speeds
    if lay is not None and lay.nodes > 1 and lay.per_node > 1:
        fields.update(
            nodes=lay.nodes,
            per_node=lay.per_node,
            intra_gbit=max(gbit, PlanInputs.intra_gbit),
            schedules=("ring", "butterfly", "hier:ring", "hier:butterfly"),
        )
    return plan(PlanInputs(**{**fields, **AUTO_OVERRIDES}))


def _built(p: Plan, lay: Any) -> tuple[Any, str, Any]:
    """(a fresh codec, topology, layout) of a plan's pick."""
    from hopq.codecs.registry import get_codec

    return get_codec(p.codec, **p.codec_config), p.topology, lay if p.layout else None


def auto(tensor: Any, group: Any, layout: Any) -> tuple[Any, str, Any]:
    """``codec="auto"`` of :func:`hopq.all_reduce`: (codec, topology, layout)
    for this call, planned once per group, layout and size from a probe of the
    group's link (:func:`agree_auto`, on the first call per group) and the
    default speeds and errors; every rank computes the same plan from the
    agreed probe. A two-tier pick (with ``layout``) returns the agreed layout;
    a flat one None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized (call init_process_group)")
    n = dist.get_world_size(group)
    key = group if group is not None else dist.group.WORLD
    numel = int(tensor.numel())
    picks = _PICKS.setdefault(key, {})
    where = (numel, _layout_key(layout) if layout is not None else None)
    got = picks.get(where)
    if got is None:
        if n == 1:
            got = ("fp32", {}, "ring", None)
        else:
            first = key not in _PROBES or where[1] is not None and key not in _LAYOUTS
            if first:
                probe, lay = agree_auto(tensor, group, layout)
                _PROBES[key] = probe
                if lay is not None:
                    _LAYOUTS[key] = lay
                dev = _device(tensor, group)
                _SPEEDS[key] = agree_speeds(numel, n, probe, lay, group, dev)
            latency, gbit = _PROBES[key]
            lay = _LAYOUTS.get(key) if layout is not None else None
            p = plan_call(numel, n, _PROBES[key], lay, _SPEEDS.get(key))
            got = (p.codec, dict(p.codec_config), p.topology, lay if p.layout else None)
            (_log.info if first else _log.debug)(
                "hopq codec='auto': %d ranks, probed %.3g Gbit/s and %.0f us per step; %s",
                n,
                gbit,
                latency * 1e6,
                p.reason,
            )
        picks[where] = got
    name, config, topology, lay = got
    if config:
        from hopq.codecs.registry import get_codec

        return get_codec(name, **config), topology, lay
    return name, topology, lay


def auto_pick(
    numel: int, group: Any = None, layout: Any = None
) -> tuple[str, dict[str, Any], str, Any] | None:
    """What ``codec="auto"`` picked for calls of ``numel`` entries on ``group``
    with ``layout`` (as passed to :func:`hopq.all_reduce`): (codec, its
    options, topology, the agreed layout or None), or None before such a call."""
    import torch.distributed as dist

    key = group if group is not None else dist.group.WORLD
    where = (int(numel), _layout_key(layout) if layout is not None else None)
    return _PICKS.get(key, {}).get(where)


def auto_probe(group: Any = None) -> tuple[float, float] | None:
    """The link probe ``codec="auto"`` agreed on for ``group``: (seconds per
    step, Gbit/s), or None before its first call."""
    import torch.distributed as dist

    return _PROBES.get(group if group is not None else dist.group.WORLD)


#: Per process group: the codec speeds that codec="auto" measured and agreed on.
_SPEEDS: weakref.WeakKeyDictionary[Any, dict[str, tuple[float, ...]]] = weakref.WeakKeyDictionary()
#: Per process group: the layout that codec="auto" agreed on.
_LAYOUTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


@dataclass
class _Bucket:
    numel: int
    codec: Any
    topology: str
    layout: Any
    plan: Plan
    predicted: float
    #: Whether torch's own all-reduce runs it (an uncompressed flat pick in the
    #: DDP hook: what DDP or torch's compression hooks do).
    native: bool = False


#: The size (floats) of the all-reduces that time torch's own 16-bit
#: all-reduce against its fp32 one (at most; a smaller bucket's own size).
NATIVE_PROBE_NUMEL = 1 << 20
#: Timed calls of each dtype, alternated.
NATIVE_PROBE_REPS = 3

#: What an uncompressed flat pick runs as in the DDP hook: torch's own
#: all-reduce of the bucket in that dtype (DDP's default, ``fp16_compress_hook``,
#: ``bf16_compress_hook``).
NATIVE_LABELS = {"fp32": "torch:ddp", "fp16": "torch:fp16", "bf16": "torch:bf16"}


def _with_pick(p: Plan, c: Candidate, why: str) -> Plan:
    """``p`` with ``c`` (one of its candidates) as its pick."""
    hier = c.schedule.startswith("hier:")
    return dataclasses.replace(
        p,
        codec=c.codec,
        codec_config=dict(c.config),
        topology=c.schedule.split(":", 1)[1] if hier else c.schedule,
        layout=f"{p.inputs.nodes}x{p.inputs.per_node}" if hier else None,
        reason=why,
    )


def challenger(p: Plan, compressed: bool, codec: str | None = None, flat: bool = False) -> Plan:
    """``p`` with its fastest candidate within the error budget of the kind
    asked for (compressed or not; ``codec``: that codec only; ``flat``: no
    two-tier schedule) as its pick; ``p`` itself when its pick is of that kind
    already or none is."""
    mine = (p.codec not in UNCOMPRESSED) == compressed and codec in (None, p.codec)
    if mine and not (flat and p.layout):
        return p
    for c in p.candidates:  # fastest first
        if c.excluded or (c.codec not in UNCOMPRESSED) != compressed:
            continue
        if flat and c.schedule.startswith("hier:"):
            continue
        if codec is None or c.codec == codec:
            return _with_pick(p, c, f"a challenger of {p.pick.label} on {p.schedule}")
    return p


class AutoPlanner:
    """``codec="auto"`` of :class:`hopq.HookState` and
    :class:`hopq.FSDPReduceScatter`: one plan per bucket (key) and size, from an
    agreed probe of the link at the first call, tried against its challengers
    by measurement, re-planned when the measured call times drift from the
    prediction.

    Every rank sees the same calls in the same order (DDP's buckets, FSDP's
    modules), so a key seen again starts a new step; at each step's end the
    ranks agree, in one all-reduce of a few floats, on the step's slowest span
    (from its first call to the end of its last: the backward pass that the
    plan's codec work shares the cores with, and the synchronization it leaves
    exposed) and on its synchronization time: the sum over its calls of each
    call's shortest time over the ranks. That is the time of the rank that
    started the call last; the others also waited for it, which is the
    compute's imbalance, not the link's or the codec's, and not what the cost
    model predicts.

    **The measured trial.** The cost model does not see everything (workers
    that share cores with their compute, a backend faster than hopq's
    uncompressed rings), so the first plan is weighed against its challengers
    by measurement: the fastest plan of the other kind (uncompressed when the
    pick compresses, compressed when it does not) and, in the DDP hook, torch's
    own fp32 all-reduce, each one predicted within :data:`TRIAL_WITHIN` of the
    pick. Each runs :data:`WARMUP_STEPS` + :data:`COMPARE_STEPS` steps; the one
    of the shortest median span stays (logged once, counted in ``trials``);
    when it is not the model's pick, the plan is pinned: no re-plans.

    **Drift.** After the trial, the prediction is scaled once by the first
    measured step (the cost model's calibration to this machine;
    :data:`WARMUP_STEPS` steps after a plan are left out, where kernels
    compile). More than :data:`DRIFT` off for :data:`DRIFT_STEPS` consecutive
    steps: a re-plan (logged, counted in ``replans``), from a new probe at the
    next call; the re-planned buckets' codecs start fresh. A re-plan is then
    judged by measurement: after :data:`COMPARE_STEPS` steps its median step
    time is compared with that of each plan it replaced, and when it is more
    than :data:`WORSE` slower than the best of them, that plan comes back
    (logged, counted in ``reverts``) and stays.

    In the DDP hook (``native``), an uncompressed flat pick runs as torch's own
    all-reduce of the bucket in that dtype (:data:`NATIVE_LABELS`): what DDP and
    torch's compression hooks do, without hopq's per-hop work.

    Args:
        layout: The layout asked for (None: flat plans only; a layout adds the
            two-tier candidates).
        owner: Who plans, for the log line.
        native: Whether uncompressed flat picks run as torch's own all-reduce.
    """

    #: How far (a fraction) a step's measured time may drift from the calibrated prediction.
    DRIFT = 0.25
    #: Consecutive drifting steps that re-plan.
    DRIFT_STEPS = 3
    #: Steps after a (re-)plan left out of the calibration (kernels compile there).
    WARMUP_STEPS = 1
    #: Measured steps of a plan in a trial, and of a re-plan before it is
    #: compared with the plans it replaced.
    COMPARE_STEPS = 5
    #: How much slower (a fraction) a re-plan may measure than the best plan it
    #: replaced before that plan comes back.
    WORSE = 0.05
    #: A challenger is tried when its predicted time is at most this many times
    #: the pick's.
    TRIAL_WITHIN = 2.0

    def __init__(self, layout: Any = None, owner: str = "HookState", native: bool = False) -> None:
        self.layout = layout
        self.owner = owner
        self.native = native
        #: Re-plans so far.
        self.replans = 0
        #: The last step's measured time over the calibrated prediction, minus 1.
        self.drift = 0.0
        #: Re-plans undone because they measured slower than a plan they replaced.
        self.reverts = 0
        #: Challengers tried by measurement against the first plan.
        self.trials = 0
        #: The trial's plans: (label, median step span in seconds).
        self.trial_results: list[tuple[str, float]] = []
        #: Seconds spent probing the link (and agreeing on the layout), and
        #: timing the codecs' kernels.
        self.probe_seconds = self.speed_seconds = 0.0
        #: Of speed_seconds: the timed codecs' first calls (a cold cache compiles
        #: their kernels then; a one-time cost of an environment).
        self.first_call_seconds = 0.0
        #: The last measured steps: (the step's synchronization seconds: the sum
        #: over its calls of each call's shortest time over the ranks, that of
        #: the rank that started it last; the plans' predicted seconds).
        self.predictions: collections.deque[tuple[float, float]] = collections.deque(maxlen=1000)
        #: The last steps' call seconds of the slowest rank (its calls' times
        #: summed, waits for later ranks included).
        self.slowest: collections.deque[float] = collections.deque(maxlen=1000)
        #: Replaced plans: (median measured step seconds, plans, probe, layout,
        #: speeds).
        self._tried: list[tuple[float, dict[int, Plan], Any, Any, Any]] = []
        #: Whether a revert fixed the plan for good.
        self._pinned = False
        #: Whether the first plan's trial is over (or none was due).
        self._trial_done = False
        #: The trial's challengers not yet run, and what was measured.
        self._pending: list[dict[int, Plan]] | None = None
        self._measured: list[tuple[float, str, dict[int, Plan], dict[Any, _Bucket]]] = []
        self._first = self._last = 0.0
        self._seen: set[Any] = set()
        self._device: Any = None
        #: The previous plan's measured steps (see ``_restart``).
        self._before: list[tuple[float, float, float]] = []
        self._since: list[tuple[float, float, float]] = []
        self._reset()

    #: The clock of step spans (tests replace it).
    clock = staticmethod(time.perf_counter)

    def _reset(self) -> None:
        self._probe: tuple[float, float] | None = None
        #: A 16-bit dtype's measured all-reduce time over fp32's, per codec name.
        self._native_ratio: dict[str, float] = {}
        self._speeds: dict[str, tuple[float, ...]] = {}
        self._lay: Any = None
        self._plans: dict[int, Plan] = {}
        self._buckets: dict[Any, _Bucket] = {}
        self._restart()
        self._logged = False

    def _restart(self) -> None:
        """Start measuring the current plans afresh."""
        self._step_keys: set[Any] = set()
        self._times: dict[Any, float] = {}
        self._scale: float | None = None
        self._warm = self.WARMUP_STEPS
        self._drifted = 0
        #: This plan's measured step seconds and spans (after its warm-up),
        #: and whether it was compared with the plans it replaced.
        self._recent: list[float] = []
        self._spans: list[float] = []
        self._compared = False
        #: This plan's measured steps: (synchronization seconds, predicted, the
        #: slowest rank's calls), and the previous plan's when this one has none.
        if self._since:
            self._before = self._since
        self._since = []

    def pick(self, tensor: Any, group: Any, key: Any) -> tuple[Any, str, Any]:
        """(codec instance, topology, layout) of this call; every rank calls it
        with the same keys in the same order."""
        import torch.distributed as dist

        if key in self._step_keys:
            self._end_step(group)
        if not self._step_keys:
            self._first = self.clock()
        self._step_keys.add(key)
        numel = int(tensor.numel())
        b = self._buckets.get(key)
        if b is None or b.numel != numel:
            n = dist.get_world_size(group)
            self._device = _device(tensor, group)
            if self._probe is None and n > 1:
                t0 = time.perf_counter()
                self._probe, self._lay = agree_auto(tensor, group, self.layout)
                self.probe_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                firsts: list[float] = []
                self._speeds = agree_speeds(
                    numel, n, self._probe, self._lay, group, self._device, firsts
                )
                self.speed_seconds += time.perf_counter() - t0
                self.first_call_seconds += sum(firsts)
            p = self._plans.get(numel)
            if p is None:
                probe = self._probe if self._probe is not None else (1e-6, 1e3)
                p = self._plans[numel] = plan_call(numel, n, probe, self._lay, self._speeds)
            codec, topology, lay = _built(p, self._lay)
            native = self.native and p.codec in NATIVE_LABELS and not p.layout and n > 1
            predicted = p.pick.sync_s
            if native and p.codec != "fp32":
                predicted = self._native_time(p, group)
            b = _Bucket(numel, codec, topology, lay, p, predicted, native)
            self._buckets[key] = b
            # new buckets (DDP rebuilds its buckets after the first step): recalibrate
            self._scale, self._warm, self._drifted = None, self.WARMUP_STEPS, 0
            self._spans, self._recent = [], []
        return b.codec, b.topology, b.layout

    def _native_time(self, p: Plan, group: Any) -> float:
        """The predicted seconds of torch's own all-reduce of the plan's bucket
        in its 16-bit dtype: the model's fp32 ring time of that size times the
        measured ratio of the two dtypes' all-reduces (a backend may sum 16-bit
        values far slower than its wire moves them: Gloo converts each one).
        The ratio is timed once per dtype and probe, agreed (every rank plans
        alike, so every rank comes here at the same call)."""
        import torch

        fp32 = [c for c in p.candidates if c.codec == "fp32" and c.schedule == "ring"]
        if not fp32:  # nothing to scale (the codecs were narrowed): the model's own
            return p.pick.sync_s
        ratio = self._native_ratio.get(p.codec)
        if ratio is None:
            t0 = time.perf_counter()
            dtype = torch.float16 if p.codec == "fp16" else torch.bfloat16
            numel = max(1, min(p.inputs.bucket_sizes()[0], NATIVE_PROBE_NUMEL))
            dev = self._device
            # alternated after one untimed call each, so that a change in the
            # machine's load (the backward pass) hits both alike
            pair = [torch.zeros(numel, device=dev), torch.zeros(numel, dtype=dtype, device=dev)]
            times: list[list[float]] = [[], []]
            for rep in range(NATIVE_PROBE_REPS + 1):
                for x, got in zip(pair, times, strict=True):
                    t = _once(x, group)
                    if rep:
                        got.append(t)
            t32, t16 = _agreed_max([min(times[0]), min(times[1])], group, dev)
            ratio = self._native_ratio[p.codec] = t16 / max(t32, 1e-9)
            self.probe_seconds += time.perf_counter() - t0
        return fp32[0].sync_s * ratio

    def is_native(self, key: Any) -> bool:
        """Whether the call ``key`` (just picked) runs as torch's own all-reduce."""
        b = self._buckets.get(key)
        return b is not None and b.native

    def observe(self, key: Any, seconds: float) -> None:
        """This rank's measured seconds of the call ``key`` just made."""
        self._times[key] = self._times.get(key, 0.0) + float(seconds)
        self._last = self.clock()

    def _end_step(self, group: Any) -> None:
        import torch
        import torch.distributed as dist

        span = max(0.0, self._last - self._first)
        times, self._times, self._step_keys = self._times, {}, set()
        if not times:
            return
        self._seen = set(times)
        # one MAX all-reduce: the slowest rank's total and span, and each call's
        # shortest time (negated; every rank made the same calls, in an order
        # of their keys that does not depend on which call ended first)
        t = torch.tensor(
            [sum(times.values()), span, *(-times[k] for k in sorted(times, key=repr))],
            dtype=torch.float64,
            device=self._device,
        )
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        got = t.cpu().tolist()
        slowest, span = got[0], got[1]
        # a call's shortest time is the rank that started it last: the others'
        # extra is waiting for it (the compute's imbalance), not synchronizing
        measured = -sum(got[2:])
        self.slowest.append(slowest)
        predicted = sum(self._buckets[k].predicted for k in times if k in self._buckets)
        if not self._logged:
            self._logged = True
            _log.info("%s", self.describe(measured))
        if self._warm > 0:
            self._warm -= 1
            return
        self._recent.append(measured)
        if predicted > 0:
            self.predictions.append((measured, predicted))
            self._since.append((measured, predicted, slowest))
        if span > 0:
            self._spans.append(span)
        if self._trial():
            return
        if self._judge():
            return
        if self._scale is None:
            self._scale = measured / predicted if predicted > 0 and measured > 0 else 1.0
            return
        if self._pinned:
            return
        expect = self._scale * predicted
        self.drift = measured / expect - 1 if expect > 0 else 0.0
        self._drifted = self._drifted + 1 if abs(self.drift) > self.DRIFT else 0
        if self._drifted >= self.DRIFT_STEPS:
            self.replans += 1
            _log.info(
                "hopq codec='auto' (%s): re-planning (%d so far): the last %d steps took "
                "%+.0f%% against the prediction (the last %.3g ms, expected %.3g ms); the "
                "next call probes the link again and the re-planned buckets' codecs start fresh",
                self.owner,
                self.replans,
                self._drifted,
                100 * self.drift,
                measured * 1e3,
                expect * 1e3,
            )
            if self._recent:
                self._tried.append(
                    (
                        statistics.median(self._recent),
                        self._plans,
                        self._probe,
                        self._lay,
                        self._speeds,
                    )
                )
            self._reset()

    def _challengers(self) -> list[dict[int, Plan]]:
        """The first plan's challengers (plans per size), each predicted within
        :data:`TRIAL_WITHIN` of it."""
        live = [b for k, b in self._buckets.items() if k in self._seen]
        sizes = {b.numel for b in live}
        if not sizes or self._probe is None:
            return []
        plans = {m: self._plans[m] for m in sizes}
        compressed = any(p.codec not in UNCOMPRESSED for p in plans.values())
        alts = [{m: challenger(p, not compressed) for m, p in plans.items()}]
        if self.native:  # torch's own fp32 all-reduce (DDP's), flat
            alts.append({m: challenger(p, False, "fp32", flat=True) for m, p in plans.items()})

        def predicted(ps: dict[int, Plan]) -> float:
            return sum(ps[b.numel].pick.sync_s for b in live)

        now = predicted(plans)
        out: list[dict[int, Plan]] = []
        for alt in alts:
            same = all(alt[m] is plans[m] for m in sizes)
            if same or alt in out or predicted(alt) > self.TRIAL_WITHIN * now:
                continue
            out.append(alt)
        return out

    def _trial(self) -> bool:
        """The first plan's measured trial (the class docstring); True while it
        runs or when it just switched plans (no drift is judged then)."""
        if self._trial_done or self._pinned:
            return False
        if self._pending is None:
            self._pending = self._challengers()
            if not self._pending:
                self._trial_done = True
                return False
        if len(self._spans) < self.COMPARE_STEPS:
            return True
        self._measured.append(
            (statistics.median(self._spans), self.summary(), self._plans, self._buckets)
        )
        if self._pending:
            self.trials += 1
            self._plans = {**self._plans, **self._pending.pop(0)}
            self._buckets = {}
            self._restart()
            return True
        self._trial_done = True
        if len(self._measured) == 1:
            return False
        self.trial_results = [(label, med) for med, label, _, _ in self._measured]
        best = min(range(len(self._measured)), key=lambda i: self._measured[i][0])
        _, _, plans, buckets = self._measured[best]
        _log.info(
            "hopq codec='auto' (%s): measured %s%s",
            self.owner,
            self.trial_note(),
            "" if best == 0 else " (the cost model's pick measured slower here: no re-plans)",
        )
        if best != len(self._measured) - 1:  # its codecs resume where they paused
            self._plans, self._buckets = plans, buckets
        self._pinned = best != 0
        self._measured = []  # the other plans' codecs go
        self._restart()
        return True

    def _judge(self) -> bool:
        """After :data:`COMPARE_STEPS` measured steps of a re-plan, bring back the
        best plan it replaced if it measured more than :data:`WORSE` faster
        (every rank decides alike: the step times are agreed). True when it did."""
        if (
            self._pinned
            or self._compared
            or not self._tried
            or len(self._recent) < self.COMPARE_STEPS
        ):
            return False
        self._compared = True
        now = statistics.median(self._recent)
        best = min(self._tried, key=lambda t: t[0])
        if now <= best[0] * (1 + self.WORSE):
            return False
        self.reverts += 1
        _log.info(
            "hopq codec='auto' (%s): the re-plan measured %.3g ms a step against %.3g ms for "
            "the plan it replaced: that plan comes back and stays (no more re-plans)",
            self.owner,
            now * 1e3,
            best[0] * 1e3,
        )
        self._reset()
        _, self._plans, self._probe, self._lay, self._speeds = best
        self._pinned = True
        return True

    def trial_note(self) -> str:
        """One line: the measured trial's plans and their median step spans,
        and what stayed ("" when no trial ran)."""
        if not self.trial_results:
            return ""
        best = min(self.trial_results, key=lambda r: r[1])
        spans = ", ".join(f"{lab} {med * 1e3:.4g} ms" for lab, med in self.trial_results)
        return (
            f"the cost model's pick and its challengers, each for {self.COMPARE_STEPS} steps "
            f"(median span of a step, from its first bucket's call to its last one's end): "
            f"{spans}; kept {best[0]}"
        )

    def _judged(self) -> list[tuple[float, float, float]]:
        """The steps the prediction is judged on: those of the plan running now
        since it started (or came back), else those of the plan before it."""
        return self._since or self._before

    def prediction_error(self) -> float | None:
        """The median of the measured steps' synchronization time over the
        cost model's prediction, minus 1 (None before a measured step), over
        the steps of the plan running now: its prediction error on this
        machine."""
        steps = self._judged()
        if not steps:
            return None
        return statistics.median(m / p for m, p, _ in steps) - 1

    def report(self, wall_s: float | None = None) -> str:
        """One line: the trial, the prediction's error and the probe's cost
        (as a share of ``wall_s``, the training seconds, when given)."""
        parts = [f"the plan at the end: {self.plan_line()}"]
        if self.trial_results:
            parts.append(self.trial_note())
        elif self.trials:
            parts.append(
                f"its trial had not ended ({self.trials} challenger(s) started, "
                f"{self.WARMUP_STEPS + self.COMPARE_STEPS} steps each): the pick named is the "
                "one running at the end"
            )
        if self.replans:
            parts.append(
                f"re-planned {self.replans} time(s) on drift, {self.reverts} undone by measurement"
            )
        err = self.prediction_error()
        if err is not None:
            steps = self._judged()
            m, p, slow = (statistics.median(v) for v in zip(*steps, strict=True))
            parts.append(
                f"synchronization per step {m * 1e3:.4g} ms measured (each call's rank that "
                f"started it last) against {p * 1e3:.4g} ms predicted (median over "
                f"{len(steps)} steps, those of the "
                f"{'plan at the end' if self._since else 'plan before the last change'}; "
                "the model off by "
                f"{err:+.0%}; the slowest rank's calls, waits for later ranks included, "
                f"{slow * 1e3:.4g} ms)"
            )
        spent = self.probe_seconds + self.speed_seconds
        share = f", {spent / wall_s:.1%} of the training time" if wall_s else ""
        first = self.first_call_seconds
        if first > 0:
            warm = f"{(spent - first) / wall_s:.1%} without them" if wall_s else ""
            share += (
                f"; of it {first:.2f} s the timed kernels' first calls, which load them from "
                "numba's cache or, where this environment has none yet, compile them"
                f"{', ' + warm if warm else ''}"
            )
        parts.append(
            f"the probes took {spent:.2f} s (the link {self.probe_seconds:.2f} s, the codecs' "
            f"kernels {self.speed_seconds:.2f} s{share})"
        )
        return "; ".join(parts)

    @staticmethod
    def _label(b: _Bucket) -> str:
        if b.native:
            return NATIVE_LABELS[b.plan.codec]
        return f"{b.plan.pick.label}@{b.plan.schedule}"

    def plan_line(self) -> str:
        """The probe and each bucket's pick with its predicted time."""
        if self._probe is None:
            head = "1 rank" if self._buckets else "nothing planned yet"
        else:
            head = f"probed {self._probe[1]:.3g} Gbit/s and {self._probe[0] * 1e6:.0f} us per step"
        for name, ratio in self._native_ratio.items():
            head += f", torch's {name} all-reduce {ratio:.2f}x of its fp32 one's time"
        parts = [
            f"{k}: {b.numel:,} coords -> {self._label(b)} ({b.predicted * 1e3:.3g} ms predicted)"
            for k, b in self._buckets.items()
        ]
        return "; ".join([head, *parts])

    def describe(self, measured: float | None = None) -> str:
        """One line: the probe and each bucket's pick."""
        tail = "" if measured is None else f"; the first step took {measured * 1e3:.3g} ms"
        return f"hopq codec='auto' ({self.owner}): {self.plan_line()}{tail}"

    def metrics(self, prefix: str = "hopq/") -> dict[str, float]:
        """``{prefix}plan/<key>/<codec>@<schedule>`` (or ``torch:ddp``, ...):
        each bucket's pick (the value: its predicted seconds),
        ``{prefix}replans``, ``{prefix}plan_reverts`` (re-plans undone by
        measurement), ``{prefix}plan_trials`` (challengers measured against the
        first plan) and ``{prefix}plan_drift`` (the last step's drift from the
        prediction)."""
        out = {
            f"{prefix}plan/{k}/{self._label(b)}": float(b.predicted)
            for k, b in self._buckets.items()
        }
        out[f"{prefix}replans"] = float(self.replans)
        out[f"{prefix}plan_reverts"] = float(self.reverts)
        out[f"{prefix}plan_trials"] = float(self.trials)
        out[f"{prefix}plan_drift"] = float(self.drift)
        return out

    def summary(self) -> str:
        """The picks, shortest: ``dynamiq@ring`` or ``0: bf16@ring, 1: dynamiq@ring``."""
        picks = {self._label(b) for b in self._buckets.values()}
        if len(picks) <= 1:
            return next(iter(picks), "nothing planned")
        return ", ".join(f"{k}: {self._label(b)}" for k, b in self._buckets.items())
