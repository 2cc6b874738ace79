"""Pure all-reduce schedules: who sends which chunks to whom at each step.

A schedule is data, computed from (topology, world size) alone and tested
without any process group. Each step is a set of transfers that run
concurrently; a transfer moves a set of chunks in one message, either as
partial sums (REDUCE, the reduce-scatter phase) or as final compressed sums
(GATHER, the all-gather phase).

Semantics the engine gives a REDUCE transfer: the sender hands over everything
it has accumulated for those chunks (its own contribution plus what its
children sent) and is done with them until the gather phase. A chunk's *sink*
(``owner``) is the rank that ends the reduce phase holding it; it compresses
the final sum once and every rank, itself included, decodes those bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any


class Phase(str, Enum):
    REDUCE = "reduce"
    GATHER = "gather"


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    chunks: tuple[int, ...]
    phase: Phase


@dataclass(frozen=True)
class Schedule:
    """A schedule: its steps, each a tuple of concurrent transfers, and each
    chunk's sink. What the engine asks of it on every call (a rank's sends and
    receives per step, the chains of compressions) is computed once per
    schedule and kept (:func:`get_schedule` keeps the schedules): a ring of n
    ranks has 2(n - 1) steps of n transfers, and scanning them on every call
    would cost a rank about 0.1 s per call at n = 64."""

    topology: str
    world_size: int
    n_chunks: int
    steps: tuple[tuple[Transfer, ...], ...]
    #: owner[c]: the sink of chunk c, the rank that holds its final sum first.
    owner: tuple[int, ...]

    def __hash__(self) -> int:  # kept: the engine's caches are keyed by schedules
        return self._memo(
            "hash",
            lambda: hash((self.topology, self.world_size, self.n_chunks, self.steps, self.owner)),
        )

    def _memo(self, key: Any, make: Callable[[], Any]) -> Any:
        # derived data in the instance's own dict (not a field: equality, repr
        # and dataclasses.replace ignore it); a frozen dataclass still has one
        memo = self.__dict__.setdefault("_memo_", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]

    def _by_rank(self, rank: int, sends: bool) -> dict[int, list[Transfer]]:
        def make() -> dict[int, list[Transfer]]:
            out: dict[int, list[Transfer]] = {}
            for i, step in enumerate(self.steps):
                mine = [t for t in step if (t.src if sends else t.dst) == rank]
                if mine:
                    out[i] = mine
            return out

        return self._memo(("sends" if sends else "recvs", rank), make)

    def sends(self, rank: int, step: int) -> list[Transfer]:
        return list(self._by_rank(rank, True).get(step, ()))

    def recvs(self, rank: int, step: int) -> list[Transfer]:
        return list(self._by_rank(rank, False).get(step, ()))

    def owned_chunks(self, rank: int) -> list[int]:
        return list(
            self._memo(("owned", rank), lambda: [c for c, o in enumerate(self.owner) if o == rank])
        )

    def reduce_steps(self) -> list[int]:
        """The steps that move partial sums (any REDUCE transfer)."""
        return list(
            self._memo(
                "reduce_steps",
                lambda: [
                    i
                    for i, step in enumerate(self.steps)
                    if any(t.phase is Phase.REDUCE for t in step)
                ],
            )
        )

    def encoder_depths(self) -> list[dict[int, int]]:
        """Per chunk: rank -> the longest chain of compressions below that rank's
        encoding of the chunk (0 for a leaf; each rank encodes each chunk once).
        Encoders of equal depth sit in disjoint subtrees: what they encode does
        not depend on each other's rounding. Computed once; do not modify."""

        def make() -> list[dict[int, int]]:
            depth = [[0] * self.world_size for _ in range(self.n_chunks)]
            for step in self.steps:  # in order, as the transfers of a step run
                for t in step:
                    if t.phase is Phase.REDUCE:
                        for c in t.chunks:
                            d = depth[c]
                            d[t.dst] = max(d[t.dst], d[t.src] + 1)
            return [dict(enumerate(d)) for d in depth]

        return self._memo("encoder_depths", make)

    def reduce_depths(self) -> list[int]:
        """Per chunk: the most pairwise combinations in a row that any partial sum
        of it goes through. A rank that receives k children combines k times, its
        sum after each being one deeper than both its previous sum and that child
        (children of one step taken deepest first: the worst order). A codec whose
        combination can double a magnitude (gqsgd-exp) scales its leaves by it."""

        def make() -> list[int]:
            depth = [[0] * self.world_size for _ in range(self.n_chunks)]
            for step in self.steps:
                incoming: dict[tuple[int, int], list[int]] = {}
                for t in step:  # every read before any write: the depths before the step
                    if t.phase is Phase.REDUCE:
                        for c in t.chunks:
                            incoming.setdefault((c, t.dst), []).append(depth[c][t.src])
                for (c, dst), ds in incoming.items():
                    for d in sorted(ds, reverse=True):
                        depth[c][dst] = max(depth[c][dst], d) + 1
            return [depth[c][self.owner[c]] for c in range(self.n_chunks)]

        return list(self._memo("reduce_depths", make))

    def compression_chains(self) -> list[int]:
        """Per chunk: the longest chain of compressions any contribution goes
        through (each REDUCE hop recompresses; the sink compresses once more)."""
        return list(
            self._memo(
                "chains",
                lambda: [d[self.owner[c]] + 1 for c, d in enumerate(self.encoder_depths())],
            )
        )


def ring(n: int) -> Schedule:
    """Ring: n chunks; chunk c travels c+1 -> c+2 -> ... -> c (its sink), then
    circulates once more as the final sum (reduce-scatter, then all-gather)."""
    _check_n(n)
    steps: list[tuple[Transfer, ...]] = []
    for s in range(n - 1):
        steps.append(
            tuple(Transfer(r, (r + 1) % n, ((r - s - 1) % n,), Phase.REDUCE) for r in range(n))
        )
    for s in range(n - 1):
        steps.append(
            tuple(Transfer(r, (r + 1) % n, ((r - s) % n,), Phase.GATHER) for r in range(n))
        )
    return Schedule("ring", n, n, tuple(steps), tuple(range(n)))


def butterfly(n: int) -> Schedule:
    """Butterfly: recursive-halving reduce-scatter, recursive-doubling all-gather
    over p = 2**floor(log2 n) core ranks and p chunks. For n not a power of two,
    the standard fold: for i < r = n - p, rank 2i hands its whole vector to rank
    2i+1 before, and gets the final result from it after."""
    _check_n(n)
    p = 1 << (n.bit_length() - 1)
    r = n - p

    def real(q: int) -> int:
        return 2 * q + 1 if q < r else q + r

    steps: list[tuple[Transfer, ...]] = []
    everything = tuple(range(p))
    if r:
        steps.append(tuple(Transfer(2 * i, 2 * i + 1, everything, Phase.REDUCE) for i in range(r)))
    ranges = {q: (0, p) for q in range(p)}
    dists = []
    dist = p >> 1
    while dist:
        dists.append(dist)
        step = []
        new = {}
        for q in range(p):
            lo, hi = ranges[q]
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if not q & dist else ((mid, hi), (lo, mid))
            step.append(Transfer(real(q), real(q ^ dist), tuple(range(*give)), Phase.REDUCE))
            new[q] = keep
        ranges = new
        steps.append(tuple(step))
        dist >>= 1
    for dist in reversed(dists):
        step = []
        new = {}
        for q in range(p):
            lo, hi = ranges[q]
            step.append(Transfer(real(q), real(q ^ dist), tuple(range(lo, hi)), Phase.GATHER))
            plo, phi = ranges[q ^ dist]
            new[q] = (min(lo, plo), max(hi, phi))
        ranges = new
        steps.append(tuple(step))
    if r:
        steps.append(tuple(Transfer(2 * i + 1, 2 * i, everything, Phase.GATHER) for i in range(r)))
    return Schedule("butterfly", n, p, tuple(steps), tuple(real(q) for q in range(p)))


def semiloop(n: int) -> Schedule:
    """EQuARX's semi-loop bidirectional ring (section III-C, Fig. 5): both link
    directions at once, n // 2 reduce steps, a balanced adder chain.

    Chunk s ends at rank s (its sink), fed by two chains that run concurrently:
    a backward chain s+b -> ... -> s+1 -> s of b = n // 2 hops (at reduce step
    k = 1..b, rank r sends chunk (r - b + k - 1) mod n to r - 1) and a forward
    chain s-f -> ... -> s-1 -> s of f = (n - 1) // 2 hops (at step k = 1..f, rank
    r sends chunk (r + f - k + 1) mod n to r + 1). Every rank other than the sink
    sits on exactly one chain (b + f = n - 1), so the deepest contribution goes
    through b = n // 2 recompressions before the sink's, instead of n - 1.

    Even n is the paper's construction (n = 4: A0 + A3 + (A1 + A2)): the forward
    chain is one hop shorter and ends a step before the backward one. Odd n
    (which the paper leaves open) is the symmetric case b = f: both chains reach
    the sink in the last reduce step, where it adds both (the engine's fused hop
    takes the last of them). The all-gather mirrors the reduce: the sink's final
    sum goes b ranks forward and f ranks backward, both directions at once.
    n = 2 degenerates to one step of one direction (the two neighbours coincide).
    """
    _check_n(n)
    b, f = n // 2, (n - 1) // 2
    steps: list[tuple[Transfer, ...]] = []
    for k in range(1, b + 1):
        step = [Transfer(r, (r - 1) % n, ((r - b + k - 1) % n,), Phase.REDUCE) for r in range(n)]
        if k <= f:
            step += [
                Transfer(r, (r + 1) % n, ((r + f - k + 1) % n,), Phase.REDUCE) for r in range(n)
            ]
        steps.append(tuple(step))
    for k in range(1, b + 1):
        # forward: chunk r - k + 1 (from its sink r - k + 1) goes on to r + 1;
        # backward: chunk r + k - 1 goes on to r - 1 (f hops only)
        step = [Transfer(r, (r + 1) % n, ((r - k + 1) % n,), Phase.GATHER) for r in range(n)]
        if k <= f:
            step += [Transfer(r, (r - 1) % n, ((r + k - 1) % n,), Phase.GATHER) for r in range(n)]
        steps.append(tuple(step))
    return Schedule("semiloop", n, n, tuple(steps), tuple(range(n)))


def biring(n: int) -> Schedule:
    """Two counter-rotating full-loop rings, each carrying half of the vector: the
    schedule that EQuARX's reduce-scatter bound (N-1)D/(2NB) assumes (both link
    directions busy all the time). Rank c owns chunks 2c and 2c + 1 (one
    contiguous slice, as in the ring): chunk 2c runs the clockwise ring
    (c+1 -> c+2 -> ... -> c), chunk 2c + 1 the counter-clockwise one
    (c-1 -> c-2 -> ... -> c). At n = 2 both rings use the same pair of ranks:
    one message carries both."""
    _check_n(n)
    steps: list[tuple[Transfer, ...]] = []
    for phase, shift in ((Phase.REDUCE, 1), (Phase.GATHER, 0)):
        for s in range(n - 1):
            step = []
            for r in range(n):
                cw = 2 * ((r - s - shift) % n)
                ccw = 2 * ((r + s + shift) % n) + 1
                if n == 2:
                    step.append(Transfer(r, (r + 1) % n, (cw, ccw), phase))
                else:
                    step.append(Transfer(r, (r + 1) % n, (cw,), phase))
                    step.append(Transfer(r, (r - 1) % n, (ccw,), phase))
            steps.append(tuple(step))
    return Schedule("biring", n, 2 * n, tuple(steps), tuple(c // 2 for c in range(2 * n)))


def tree(n: int) -> Schedule:
    """Tree (Global-QSGD section 8): recursive aggregation of the whole vector to
    rank 0 along a binomial tree, then recursive doubling back out; one chunk,
    ceil(log2 n) steps each way, for any n. Reduce step k: rank r with
    r mod 2^(k+1) = 2^k hands its partial sum to r - 2^k; gather step k (k from
    the top down): rank r with r mod 2^(k+1) = 0 forwards the final sum to
    r + 2^k when that rank exists. For n a power of two every hop adds two
    partial sums over equal-sized groups (what the exponential reduce needs);
    for any n the root combines ceil(log2 n) times in a row (``reduce_depths``),
    as on a power-of-two butterfly, and no chain is longer than ceil(log2 n) + 1
    compressions."""
    _check_n(n)
    K = (n - 1).bit_length()  # ceil(log2 n)
    steps: list[tuple[Transfer, ...]] = []
    for k in range(K):
        half = 1 << k
        steps.append(
            tuple(Transfer(r, r - half, (0,), Phase.REDUCE) for r in range(half, n, 2 * half))
        )
    for k in reversed(range(K)):
        half = 1 << k
        steps.append(
            tuple(Transfer(r, r + half, (0,), Phase.GATHER) for r in range(0, n - half, 2 * half))
        )
    return Schedule("tree", n, 1, tuple(steps), (0,))


def direct(n: int) -> Schedule:
    """Direct (one-shot, as ZeRO++'s qgZ): a reduce-scatter by all-to-all, then an
    all-gather from each owner. n chunks, rank c the sink of chunk c. Reduce
    step: every rank r compresses each chunk c != r once and sends it straight
    to c, which adds the n - 1 decoded contributions to its own in float32
    (senders in rank order, the last taking the fused hop) and compresses the
    final sum once. Gather step: each sink sends those same bytes to every
    other rank. Two steps for any n, and every contribution goes through two
    compressions (``compression_chains``), however large n; a sink combines
    n - 1 times in a row (``reduce_depths``), as on a ring. Each rank sends
    n - 1 messages per step."""
    _check_n(n)
    if n == 1:
        return Schedule("direct", 1, 1, (), (0,))
    reduce = tuple(Transfer(r, c, (c,), Phase.REDUCE) for r in range(n) for c in range(n) if c != r)
    gather = tuple(Transfer(c, r, (c,), Phase.GATHER) for c in range(n) for r in range(n) if r != c)
    return Schedule("direct", n, n, (reduce, gather), tuple(range(n)))


@dataclass(frozen=True)
class ShardLayout:
    """A schedule laid over caller-chosen shards: rank r wants the final sums of
    ``shards[r]:shards[r + 1]`` of the caller's flat vector (in rank order).

    ``bounds`` (n_chunks + 1 offsets) cut the vector into the schedule's chunks so
    that the chunks a rank is the sink of lie inside its own shard wherever the
    schedule allows: with owners in rank order (ring, semi-loop, bidirectional
    ring, direct) a rank's chunks split its shard and nothing more moves after
    the reduce phase. A rank that owns no chunk (butterfly's folded ranks, the tree's
    non-roots) has its shard joined to the next owning rank's chunks (the last
    owner's, at the end), and ``reduce_scatter``'s last step delivers those
    chunks' final payloads to it (``deliveries``: one direct transfer per sink
    and receiver)."""

    shards: tuple[int, ...]
    bounds: tuple[int, ...]
    #: The reduce phase of the schedule, then one GATHER step of the deliveries
    #: (none when every rank is the sink of its whole shard).
    reduce_scatter: Schedule
    deliveries: tuple[Transfer, ...]


@lru_cache(maxsize=256)
def shard_layout(schedule: Schedule, shards: tuple[int, ...]) -> ShardLayout:
    """Chunk boundaries and the reduce-scatter schedule that give rank r the
    final sums of ``shards[r]:shards[r + 1]`` (see :class:`ShardLayout`)."""
    n, K = schedule.world_size, schedule.n_chunks
    if (
        len(shards) != n + 1
        or shards[0] != 0
        or any(a > b for a, b in zip(shards, shards[1:], strict=False))
    ):
        raise ValueError(
            f"shards must be {n + 1} non-decreasing offsets from 0 (rank r gets "
            f"shards[r]:shards[r + 1]), got {shards}"
        )
    owner = schedule.owner
    bounds: list[int]
    if all(a <= b for a, b in zip(owner, owner[1:], strict=False)):
        owning = sorted(set(owner))
        # the span of each owning rank: its shard and the shards of the chunkless
        # ranks joined to it (those before it down to the previous owner, and
        # after the last owner, those at the end)
        start = {
            q: shards[prev + 1] if i else 0
            for i, (q, prev) in enumerate(zip(owning, [-1, *owning], strict=False))
        }
        end = {q: shards[q + 1] for q in owning}
        end[owning[-1]] = shards[n]
        bounds = [0]
        for q in owning:
            mine = schedule.owned_chunks(q)
            lo, hi = start[q], end[q]
            units, extra = divmod(hi - lo, len(mine))
            for i in range(len(mine)):
                lo += units + (1 if i < extra else 0)
                bounds.append(lo)
    else:  # owners out of rank order: even chunks, and deliver what is elsewhere
        total = shards[n]
        base, extra = divmod(total, K)
        bounds = [0]
        for c in range(K):
            bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    pairs: dict[tuple[int, int], list[int]] = {}
    for c in range(K):
        for r in range(n):
            if r != owner[c] and max(shards[r], bounds[c]) < min(shards[r + 1], bounds[c + 1]):
                pairs.setdefault((owner[c], r), []).append(c)
    deliveries = tuple(
        Transfer(src, dst, tuple(cs), Phase.GATHER) for (src, dst), cs in sorted(pairs.items())
    )
    reduce_steps = tuple(schedule.steps[i] for i in schedule.reduce_steps())
    rs = Schedule(
        schedule.topology,
        n,
        K,
        reduce_steps + ((deliveries,) if deliveries else ()),
        owner,
    )
    return ShardLayout(tuple(shards), tuple(bounds), rs, deliveries)


def equal_shards(numel: int, world_size: int) -> tuple[int, ...]:
    """Offsets of ``world_size`` rank-ordered shards of near-equal size (like
    ``torch.tensor_split``: earlier shards one larger; equal when ``numel`` is a
    multiple of the world size, as FSDP pads it)."""
    base, extra = divmod(numel, world_size)
    out = [0]
    for r in range(world_size):
        out.append(out[-1] + base + (1 if r < extra else 0))
    return tuple(out)


TOPOLOGIES: dict[str, Callable[[int], Schedule]] = {
    "ring": ring,
    "butterfly": butterfly,
    "semiloop": semiloop,
    "biring": biring,
    "tree": tree,
    "direct": direct,
}


@lru_cache(maxsize=256)
def get_schedule(topology: str, world_size: int) -> Schedule:
    """The schedule of ``topology`` for ``world_size`` ranks (cached)."""
    try:
        make = TOPOLOGIES[topology]
    except KeyError:
        raise ValueError(
            f"unknown topology {topology!r}; available: {sorted(TOPOLOGIES)}"
        ) from None
    return make(world_size)


def _check_n(n: int) -> None:
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
