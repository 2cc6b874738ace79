"""A two-tier cost model of one compressed all-reduce, read off the schedules.

The network is N nodes x G workers: workers of one node talk over a fast local
link (NVLink, PCIe, shared memory), nodes over a slower network through one
uplink each. A schedule is data (:mod:`hopq.comm.topology`), so the model walks
its steps instead of using one closed form per topology, and every schedule, flat
or two-tier, is modelled the same way (alpha-beta-gamma, Thakur, Rabenseifner and
Gropp, with the codec's work per hop):

* **wire**: per step, every transfer carries its chunks' share of the d
  coordinates at the codec's bits per coordinate; the bytes a node sends to or
  receives from other nodes share its uplink (full duplex: the larger of the two
  directions counts; ``duplex`` times that when two ranks exchange with each
  other in one step, a factor measured on the network at hand), the bytes a
  worker sends to its own node share its local link. A step lasts the slower of
  the two tiers, plus that tier's latency.
* **codec work** per rank, from its roles: a leaf encodes, an inner rank runs the
  fused hop on what it forwards, a chunk's sink decodes and accumulates what it
  receives and encodes the final sum once, and every rank decodes what the
  all-gather brings. The slowest rank counts; ``overload`` (workers per core)
  scales it when workers share cores.
* **statistics**: codecs with an exchange of statistics (those under 15.5 bits per
  coordinate) pay one more ring's latency among the ranks that run the codec.

A *hierarchical* call (``"hier:<topology>"``) is the composition of
:mod:`hopq.comm.hierarchy`: an exact (float32) reduce-scatter inside each node,
the codec's all-reduce of each node-shard among the N nodes with ``topology``
(the G workers of a node run theirs at once, sharing the uplink), and an
all-gather inside each node. Only the inter-node hops recompress. A large call
runs as a pipeline of pieces (:func:`hopq.comm.hierarchy.tier_pieces`): the
tier inside the nodes is exposed for the first piece's reduce-scatter and the
last piece's gather only, and each piece pays the statistics' latency.

Pure functions of their inputs: no process group, no timing, except
:func:`time_codec`, which times a codec's kernels on this machine (what
``hopq bench model`` calibrates with, and ``codec="auto"`` measures at its
start). The check against the emulated network lives in ``hopq bench model``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from hopq.codecs.base import HopContext, LocalStats, ReduceOp
from hopq.codecs.registry import get_codec
from hopq.comm import hierarchy
from hopq.comm.topology import Phase, Schedule, get_schedule

#: Bits per coordinate of the exact tier inside a node (float32 partial sums).
EXACT_BITS = 32.0
#: Codecs below this many bits per coordinate exchange statistics first.
STATS_BELOW_BITS = 15.5


@dataclass(frozen=True)
class CodecCost:
    """A codec's speed on one core (seconds per coordinate of each kernel) and
    the bits per coordinate it puts on the wire."""

    codec: str
    plan: float
    enc: float
    hop: float
    dec: float
    bits: float


def best_seconds(
    fn: Callable[..., Any],
    reps: int = 3,
    setup: Callable[[], Any] | None = None,
    sync: Callable[[], Any] | None = None,
) -> float:
    """Best time of ``reps`` calls after an untimed one; with ``setup``, each call
    is ``fn(setup())``, the setup untimed; ``sync`` (e.g. a CUDA synchronize)
    runs before the clock starts and before it stops."""
    times = []
    for _ in range(reps + 1):
        arg = setup() if setup is not None else None
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn(arg) if setup is not None else fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def calibration_vector(coords: int) -> torch.Tensor:
    """The vector codecs are timed on: Gaussian entries scaled over three
    decades (as gradients spread), the same on every call."""
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(coords, generator=g)
        * torch.logspace(-3, 0, coords)[torch.randperm(coords, generator=g)]
    )


def time_codec(
    codec_name: str,
    coords: int,
    device: str | torch.device = "cpu",
    bits: float = 0.0,
    reps: int = 3,
) -> CodecCost:
    """Time a codec's kernels on ``coords`` coordinates with its own API, as
    this thread runs them now (its torch threads, and whatever else shares the
    cores), its tensors on ``device`` (on CUDA each timing synchronized):
    seconds per coordinate of plan + prepare + finish, encode, the fused hop
    and decode (each the best of ``reps`` calls after an untimed one), with
    ``bits`` as the cost's bits per coordinate."""
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    x = calibration_vector(coords).to(dev)
    codec = get_codec(codec_name)
    n_chunks = 4
    plan = codec.plan(x, LocalStats(n_chunks, world_size=n_chunks))
    work = codec.prepare_all(plan, x)
    codec.finish(plan, work.clone(), ReduceOp.SUM, 1)

    def plan_prepare_finish() -> None:
        p = codec.plan(x, LocalStats(n_chunks, world_size=n_chunks))
        w = codec.prepare_all(p, x)
        codec.finish(p, w, ReduceOp.SUM, 1)

    t_plan = best_seconds(plan_prepare_finish, reps, sync=sync)
    c = max(range(n_chunks), key=plan.chunk_numel)
    chunk = plan.chunk_view(work, c).clone()
    ctx = HopContext(0, 0, c, 1, 1, 4, 0, 0, 1)
    payload = codec.encode(plan, chunk, ctx)
    out = torch.empty_like(chunk)

    def fresh() -> Any:  # a plan may keep state across hops (gqsgd-exp counts them)
        return codec.plan(x, LocalStats(n_chunks, world_size=n_chunks))

    t_enc = best_seconds(lambda p: codec.encode(p, chunk, ctx), reps, setup=fresh, sync=sync)
    t_hop = best_seconds(
        lambda p: codec.decode_accumulate_encode(p, payload, chunk.clone(), ctx),
        reps,
        setup=fresh,
        sync=sync,
    )
    t_dec = best_seconds(lambda p: codec.decode(p, payload, ctx, out), reps, setup=fresh, sync=sync)
    m = chunk.numel()
    return CodecCost(codec_name, t_plan / coords, t_enc / m, t_hop / m, t_dec / m, bits)


@dataclass(frozen=True)
class Network:
    """N nodes x G workers per node and the two tiers' links.

    Attributes:
        nodes: N, the machines.
        per_node: G, the workers of each machine.
        inter_gbit: Each node's uplink to the other nodes, Gbit/s per direction
            (a machine with one NIC per GPU: G times one NIC's rate).
        intra_gbit: Each worker's link to the workers of its own node, Gbit/s.
        inter_latency_us: Latency of a step that crosses nodes.
        intra_latency_us: Latency of a step inside a node.
        cores_per_node: CPU cores each node's workers share for codec work (GPU
            workers: one per worker).
        duplex: How much longer a step takes when two ranks send to each other
            at once than a one-way transfer (1 on full-duplex links; Gloo on the
            emulated network measured near 2).
    """

    nodes: int
    per_node: int = 1
    inter_gbit: float = 10.0
    intra_gbit: float = 100.0
    inter_latency_us: float = 20.0
    intra_latency_us: float = 2.0
    cores_per_node: int | None = None
    duplex: float = 1.0

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Network.{name} must be a positive int, got {v!r}")
        for name in ("inter_gbit", "intra_gbit", "duplex"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"Network.{name} must be positive, got {v!r}")
        for name in ("inter_latency_us", "intra_latency_us"):
            v = getattr(self, name)
            if not v >= 0:
                raise ValueError(f"Network.{name} must be at least 0, got {v!r}")
        c = self.cores_per_node
        if c is not None and (not isinstance(c, int) or c < 1):
            raise ValueError(f"Network.cores_per_node must be a positive int or None, got {c!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def overload(self) -> float:
        """Workers per core on a node (at least 1)."""
        cores = self.cores_per_node or self.per_node
        return max(1.0, self.per_node / cores)


@dataclass(frozen=True)
class Prediction:
    """Modelled seconds of one all-reduce and where they go.

    Attributes:
        schedule: ``"ring"``, ``"butterfly"``, ... (flat over all ranks) or
            ``"hier:<topology>"``.
        seconds: The whole call.
        inter_seconds: Steps bounded by the uplinks (their latency included).
        intra_seconds: Steps bounded by the links inside the nodes.
        codec_seconds: Codec work on the slowest rank (``overload`` applied).
        uplink_bytes: Bytes the busiest node sends through its uplink.
        recompressions: The longest chain of compressions any contribution goes
            through (its error grows with it).
    """

    schedule: str
    seconds: float
    inter_seconds: float
    intra_seconds: float
    codec_seconds: float
    uplink_bytes: float
    recompressions: int


@dataclass(frozen=True)
class _Walk:
    inter: float
    intra: float
    uplink: float
    #: per rank: coordinates (in units of d) encoded, fused, decode-accumulated, decoded
    work: tuple[tuple[float, float, float, float], ...]
    #: the longest chain of compressions (Schedule.compression_chains, in one pass)
    chain: int


@lru_cache(maxsize=64)
def _walk(schedule: Schedule, per_node: int, flows: int, duplex: float) -> _Walk:
    """Walk a schedule once per (schedule, node size): wire bytes per step in units
    of d x bits / 8, and each rank's codec work in units of d. ``flows``: how many
    copies of this schedule share each uplink at once (a hierarchical call's G)."""
    n_chunks = schedule.n_chunks
    share = 1.0 / n_chunks

    def node(r: int) -> int:
        return r // per_node

    inter = intra = uplink = 0.0
    held: dict[tuple[int, int], int] = {}  # (rank, chunk) -> receives not yet forwarded
    depth: dict[tuple[int, int], int] = {}  # (rank, chunk) -> compressions below it
    enc = [0.0] * schedule.world_size
    hop = [0.0] * schedule.world_size
    acc = [0.0] * schedule.world_size
    dec = [0.0] * schedule.world_size
    for step in schedule.steps:
        up: dict[int, float] = defaultdict(float)
        down: dict[int, float] = defaultdict(float)
        local: dict[int, float] = defaultdict(float)
        pairs = set()
        for t in step:
            size = len(t.chunks) * share
            a, b = node(t.src), node(t.dst)
            if a != b:
                up[a] += size * flows
                down[b] += size * flows
                pairs.add((t.src, t.dst))
            else:
                local[t.src] += size
            if t.phase is Phase.REDUCE:
                for c in t.chunks:
                    got = held.pop((t.src, c), 0)
                    if got:  # an inner rank forwards: the fused hop on the last
                        hop[t.src] += share  # receive, decode-and-add on the others
                        acc[t.src] += (got - 1) * share
                    else:
                        enc[t.src] += share  # a leaf
            else:
                dec[t.dst] += size
        for t in step:  # receives land after the step's sends are coded
            if t.phase is Phase.REDUCE:
                for c in t.chunks:
                    held[(t.dst, c)] = held.get((t.dst, c), 0) + 1
                    below = depth.get((t.src, c), 0) + 1
                    if below > depth.get((t.dst, c), 0):
                        depth[(t.dst, c)] = below
        if up or down:
            worst = max([*up.values(), *down.values()])
            both = any((b, a) in pairs for a, b in pairs)
            inter += worst * (duplex if both else 1.0)
            uplink += max(up.values(), default=0.0)
        if local:
            intra += max(local.values())
    # the sinks: what they received for their chunks is decoded and added, once
    # each, and the final sum encoded once (a hop they do not forward)
    for c, owner in enumerate(schedule.owner):
        acc[owner] += held.get((owner, c), 0) * share
        enc[owner] += share
    work = tuple(zip(enc, hop, acc, dec, strict=True))
    chain = max((depth.get((o, c), 0) + 1 for c, o in enumerate(schedule.owner)), default=0)
    return _Walk(inter, intra, uplink, work, chain if schedule.world_size > 1 else 0)


def _steps_crossing(schedule: Schedule, per_node: int) -> tuple[int, int]:
    """(steps with a transfer between nodes, steps with only local transfers)."""
    cross = local = 0
    for step in schedule.steps:
        if any(t.src // per_node != t.dst // per_node for t in step):
            cross += 1
        elif step:
            local += 1
    return cross, local


#: Flat rings larger than this use their closed form instead of walking them.
_WALK_RING_UP_TO = 64


def _ring_closed(
    cost: CodecCost, net: Network, n: int, numel: float, flows: int, per_node: int
) -> tuple[float, float, float, float, float, int]:
    """cost._flat's terms for a ring of n ranks in closed form (a ring of
    thousands of ranks is slow to walk step by step): every step each rank sends
    a 1/n chunk to the next, the last rank of each node (``per_node``
    consecutive ranks) across to the next node, ``flows`` rings at once; each
    rank encodes 2 chunks (leaf and sink), runs the fused hop on n - 2,
    decode-adds 1 and decodes n - 1."""
    nodes = n // per_node
    steps = 2 * (n - 1)
    nbytes = numel * cost.bits / 8
    cross = steps if nodes > 1 else 0
    local = 0 if nodes > 1 else steps
    both = n == 2 and nodes == 2
    w_inter = steps / n * flows * (net.duplex if both else 1.0) if nodes > 1 else 0.0
    w_intra = steps / n if per_node > 1 else 0.0
    inter = cross * net.inter_latency_us * 1e-6 + w_inter * nbytes / (net.inter_gbit * 1e9 / 8)
    intra = local * net.intra_latency_us * 1e-6 + w_intra * nbytes / (net.intra_gbit * 1e9 / 8)
    per = cost.plan + (2 * cost.enc + (n - 2) * cost.hop + cost.dec + (n - 1) * cost.dec) / n
    codec = net.overload * numel * per
    stats = 0.0
    if cost.bits < STATS_BELOW_BITS:
        lat = net.inter_latency_us if cross else net.intra_latency_us
        stats = 2 * (n - 1) * lat * 1e-6
    up = (steps / n * flows if nodes > 1 else 0.0) * nbytes
    return inter, intra, codec, up, stats, n


@lru_cache(maxsize=64)
def _shape(
    topology: str, world: int, per_node: int, flows: int, duplex: float
) -> tuple[_Walk, int, int]:
    """A schedule's walk and its (crossing, local) step counts, cached by plain
    keys (a large Schedule is slow to hash on every lookup)."""
    s = get_schedule(topology, world)
    return (_walk(s, per_node, flows, duplex), *_steps_crossing(s, per_node))


def _flat(
    cost: CodecCost,
    topology: str,
    world: int,
    net: Network,
    d: float,
    flows: int,
    per_node: int,
) -> tuple[float, float, float, float, float, int]:
    """(inter s, intra s, codec s, uplink bytes, stats s, chain) of one flat schedule."""
    if topology == "ring" and world > _WALK_RING_UP_TO:
        return _ring_closed(cost, net, world, d, flows, per_node)
    w, cross, local = _shape(topology, world, per_node, flows, net.duplex)
    nbytes = d * cost.bits / 8
    beta_inter = net.inter_gbit * 1e9 / 8
    beta_intra = net.intra_gbit * 1e9 / 8
    inter = cross * net.inter_latency_us * 1e-6 + w.inter * nbytes / beta_inter
    intra = local * net.intra_latency_us * 1e-6 + w.intra * nbytes / beta_intra
    codec = net.overload * max(
        d * (cost.plan + e * cost.enc + h * cost.hop + a * cost.dec + g * cost.dec)
        for e, h, a, g in w.work
    )
    n = world
    stats = 0.0
    if cost.bits < STATS_BELOW_BITS and n > 1:
        lat = net.inter_latency_us if cross else net.intra_latency_us
        stats = 2 * (n - 1) * lat * 1e-6
    return inter, intra, codec, w.uplink * nbytes, stats, w.chain


def predict(
    cost: CodecCost,
    schedule: str,
    net: Network,
    numel: int,
    exact: CodecCost | None = None,
) -> Prediction:
    """Modelled time of one all-reduce of ``numel`` float32 coordinates.

    Args:
        cost: The codec's speed and bits per coordinate.
        schedule: A flat topology over all ranks (``"ring"``, ``"butterfly"``,
            ...; nodes hold consecutive ranks) or ``"hier:<topology>"``.
        net: The cluster.
        numel: Coordinates of the tensor.
        exact: The uncompressed codec of the tier inside the nodes (fp32's
            speed; None: free).

    Returns:
        The prediction, split by tier.

    Raises:
        ValueError: An unknown topology.

    Example:
        >>> c = CodecCost("bf16", 0.0, 1e-9, 2e-9, 1e-9, 16.0)
        >>> net = Network(nodes=2, per_node=2, inter_gbit=0.2, intra_gbit=10.0)
        >>> flat = predict(c, "ring", net, 1 << 22)
        >>> hier = predict(c, "hier:ring", net, 1 << 22)
        >>> round(hier.uplink_bytes / flat.uplink_bytes, 3)  # 2/3 of the bytes leave a node
        0.667
    """
    if schedule.startswith("hier:"):
        return _hierarchical(cost, schedule, net, numel, exact)
    inter, intra, codec, up, stats, chain = _flat(
        cost, schedule, net.world_size, net, numel, 1, net.per_node
    )
    return Prediction(
        schedule, inter + intra + codec + stats, inter + stats, intra, codec, up, chain
    )


def _hierarchical(
    cost: CodecCost, schedule: str, net: Network, numel: int, exact: CodecCost | None
) -> Prediction:
    topology = schedule.split(":", 1)[1]
    n, g = net.nodes, net.per_node
    free = CodecCost("fp32", 0.0, 0.0, 0.0, 0.0, EXACT_BITS)
    ex = exact or free
    ex = CodecCost(ex.codec, ex.plan, ex.enc, ex.hop, ex.dec, EXACT_BITS)
    # inside a node: a ring's reduce-scatter and all-gather over G, exact
    inter = intra = codec = up = stats = 0.0
    local_s = 0.0  # the tier inside the nodes: transfers and the exact codec's work
    if g > 1:
        i_inter, i_intra, i_codec, _, _, _ = _flat(ex, "ring", g, net, numel, 1, g)
        intra += i_inter + i_intra  # one node: every transfer is local
        codec += i_codec
        local_s = i_inter + i_intra + i_codec
    pieces = len(hierarchy.tier_pieces(numel, g)) - 1 if n > 1 and g > 1 else 1
    if n > 1:
        # G node-shards of numel / G, each all-reduced among the N nodes at once
        o_inter, o_intra, o_codec, o_up, o_stats, chain = _flat(
            cost, topology, n, net, numel / g, g, 1
        )
        inter += o_inter
        intra += o_intra
        codec += o_codec
        up += o_up
        stats += o_stats
    else:
        chain = 1 if g > 1 else 0
    total = inter + intra + codec + stats
    if pieces > 1:
        # a pipeline of pieces: each pays the inter-node tier's statistics
        # latency; inside the node only the first piece's reduce-scatter and
        # the last piece's gather are exposed, the rest runs under the
        # inter-node tier unless it takes longer
        stats *= pieces
        remote = total - local_s - stats / pieces + stats
        total = local_s / pieces + max(remote, local_s * (pieces - 1) / pieces)
    return Prediction(schedule, total, inter + stats, intra, codec, up, chain)
