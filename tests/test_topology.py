"""Schedules, checked as pure data for every world size 1..16; the statistics
exchange's ring over in-process ranks."""

import math

import pytest
import torch

from hopq.comm.topology import TOPOLOGIES, Phase, equal_shards, get_schedule, shard_layout


def _replay(s):
    """Replay a schedule symbolically: which contributions each rank holds per
    chunk after the reduce phase, and which final chunks each rank ends with."""
    n = s.world_size
    holds = {(r, c): {r} for r in range(n) for c in range(s.n_chunks)}
    handed_over = set()
    final = {r: set() for r in range(n)}
    for c, o in enumerate(s.owner):
        final[o].add(c)
    reduce_done = False
    for step in s.steps:
        phases = {t.phase for t in step}
        assert len(phases) == 1, "a step mixes phases"
        if Phase.GATHER in phases:
            reduce_done = True
        senders = [(t.src, t.dst) for t in step]
        assert len(senders) == len(set(senders)), "one message per pair and step"
        for t in step:
            for c in t.chunks:
                if t.phase is Phase.REDUCE:
                    assert not reduce_done
                    assert (t.src, c) not in handed_over, "a rank sends a chunk it gave away"
                    assert not holds[(t.dst, c)] & holds[(t.src, c)], "a contribution counted twice"
                    holds[(t.dst, c)] |= holds[(t.src, c)]
                    handed_over.add((t.src, c))
                else:
                    assert c in final[t.src], "a rank forwards a final chunk it does not have"
        for t in step:
            if t.phase is Phase.GATHER:
                final[t.dst] |= set(t.chunks)
    return holds, final


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", range(1, 17))
def test_schedule_reduces_everything_once(topology, n):
    s = get_schedule(topology, n)
    holds, final = _replay(s)
    for c, o in enumerate(s.owner):
        assert holds[(o, c)] == set(range(n)), f"chunk {c} reduced from {holds[(o, c)]}"
    for r in range(n):
        assert final[r] == set(range(s.n_chunks)), f"rank {r} ends with {final[r]}"


@pytest.mark.parametrize("n", range(1, 17))
def test_chain_lengths(n):
    assert max(get_schedule("ring", n).compression_chains()) == n
    chain = max(get_schedule("butterfly", n).compression_chains())
    p = 1 << (n.bit_length() - 1)
    if p == n:
        assert chain == int(math.log2(n)) + 1
    else:  # the fold adds one hop
        assert chain == int(math.log2(p)) + 2


@pytest.mark.parametrize("n", range(1, 17))
def test_tree_depth_and_steps(n):
    """Binomial aggregation to rank 0 then doubling back: ceil(log2 n) steps each
    way, chains of ceil(log2 n) + 1 compressions; for n a power of two every hop
    joins two equal-sized groups (the exponential reduce's premise)."""
    s = get_schedule("tree", n)
    K = math.ceil(math.log2(n)) if n > 1 else 0
    assert s.n_chunks == 1 and s.owner == (0,)
    assert len(s.steps) == 2 * K
    assert max(s.compression_chains()) <= K + 1
    assert s.reduce_depths() == [K]
    size = dict.fromkeys(range(n), 1)
    for step in s.steps[:K]:
        for t in step:
            if n & (n - 1) == 0:
                assert size[t.src] == size[t.dst], "unbalanced hop on a power of two"
            size[t.dst] += size[t.src]
    assert size[0] == n


@pytest.mark.parametrize("n", range(1, 17))
def test_reduce_depths(n):
    """Combinations in a row (what gqsgd-exp scales its leaves by): n - 1 on a
    ring, ceil(log2 n) on butterfly (the fold adds one) and tree."""
    K = math.ceil(math.log2(n)) if n > 1 else 0
    assert max(get_schedule("ring", n).reduce_depths()) == n - 1
    assert max(get_schedule("butterfly", n).reduce_depths()) == K
    assert max(get_schedule("tree", n).reduce_depths()) == K
    assert max(get_schedule("direct", n).reduce_depths()) == n - 1


@pytest.mark.parametrize("n", range(1, 17))
def test_direct_is_one_shot(n):
    """Direct (qgZ's all-to-all reduce-scatter, then the owners' all-gather): rank c
    owns chunk c; one reduce step in which every rank sends every other chunk
    to its owner, one gather step in which every owner sends its chunk to
    every other rank; two compressions per contribution whatever n (a ring's
    grow with n), n - 1 combinations in a row at each sink, n - 1 messages per
    rank and step."""
    s = get_schedule("direct", n)
    assert s.topology == "direct" and s.n_chunks == n and s.owner == tuple(range(n))
    if n == 1:
        assert s.steps == () and s.compression_chains() == [1]
        return
    assert len(s.steps) == 2
    reduce, gather = s.steps
    assert {(t.src, t.dst, t.chunks, t.phase) for t in reduce} == {
        (r, c, (c,), Phase.REDUCE) for r in range(n) for c in range(n) if r != c
    }
    assert {(t.src, t.dst, t.chunks, t.phase) for t in gather} == {
        (c, r, (c,), Phase.GATHER) for r in range(n) for c in range(n) if r != c
    }
    assert len(reduce) == len(gather) == n * (n - 1)
    for r in range(n):
        for step in (0, 1):
            assert len(s.sends(r, step)) == len(s.recvs(r, step)) == n - 1
        # the sink receives its chunk's contributions in rank order
        assert [t.src for t in s.recvs(r, 0)] == [q for q in range(n) if q != r]
    assert s.compression_chains() == [2] * n
    assert s.reduce_depths() == [n - 1] * n
    for c, depths in enumerate(s.encoder_depths()):
        assert depths == {r: int(r == c) for r in range(n)}  # n - 1 independent leaves


def test_direct_has_the_shortest_chain():
    """From 3 ranks on, no other schedule compresses a contribution fewer times."""
    for n in range(3, 17):
        chains = {t: max(get_schedule(t, n).compression_chains()) for t in TOPOLOGIES}
        assert chains["direct"] == 2 == min(chains.values()), (n, chains)
        assert chains["direct"] < chains["ring"]


@pytest.mark.parametrize("n", [1, 3, 4, 6, 8])
def test_butterfly_ranges_and_owners(n):
    s = get_schedule("butterfly", n)
    p = 1 << (n.bit_length() - 1)
    assert s.n_chunks == p
    assert len(set(s.owner)) == p  # each owner distinct
    # recursive halving sends contiguous chunk ranges halving in size
    core = [st for st in s.steps if len(st) == p]
    sizes = [len(st[0].chunks) for st in core]
    half = sizes[: len(sizes) // 2]
    assert half == [p >> (k + 1) for k in range(len(half))]


def test_unknown_topology():
    with pytest.raises(ValueError, match="unknown topology"):
        get_schedule("torus", 4)
    with pytest.raises(ValueError):
        get_schedule("ring", 0)


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", range(1, 17))
def test_shard_layout_gives_every_rank_its_shard(topology, n):
    """Over rank shards, each rank ends the reduce-scatter with the final sums of
    exactly its shard: the chunks it is the sink of, plus the ones delivered."""
    s = get_schedule(topology, n)
    for numel in (0, n - 1, 1000, 1003):
        shards = equal_shards(numel, n)
        assert shards[0] == 0 and shards[-1] == numel
        assert (
            max(b - a for a, b in zip(shards, shards[1:], strict=False))
            - min(b - a for a, b in zip(shards, shards[1:], strict=False))
            <= 1
        )
        lay = shard_layout(s, shards)
        b = lay.bounds
        assert len(b) == s.n_chunks + 1 and b[0] == 0 and b[-1] == numel
        assert all(x <= y for x, y in zip(b, b[1:], strict=False))
        rs = lay.reduce_scatter
        reduce_steps = [st for st in s.steps if st[0].phase is Phase.REDUCE]
        assert list(rs.steps[: len(reduce_steps)]) == reduce_steps
        assert rs.compression_chains() == s.compression_chains()
        _, final = _replay(rs)
        for r in range(n):
            have = set()
            for c in final[r]:
                have.update(range(b[c], b[c + 1]))
            assert set(range(shards[r], shards[r + 1])) <= have, (r, shards, b)
        if topology in ("ring", "semiloop", "biring", "direct") or (
            topology == "butterfly" and not n & (n - 1)
        ):
            assert not lay.deliveries  # every rank is the sink of its own shard
            for c, o in enumerate(s.owner):
                assert shards[o] <= b[c] <= b[c + 1] <= shards[o + 1]


def test_shard_layout_deliveries_and_refusals():
    lay = shard_layout(get_schedule("butterfly", 3), equal_shards(99, 3))
    assert lay.bounds == (0, 66, 99)
    assert [(t.src, t.dst, t.chunks) for t in lay.deliveries] == [(1, 0, (0,))]
    lay = shard_layout(get_schedule("tree", 4), equal_shards(8, 4))
    assert [(t.src, t.dst) for t in lay.deliveries] == [(0, 1), (0, 2), (0, 3)]
    assert equal_shards(10, 4) == (0, 3, 6, 8, 10)
    for bad in ((0, 5), (1, 5, 10), (0, 6, 5)):
        with pytest.raises(ValueError, match="shards"):
            shard_layout(get_schedule("ring", 2), bad)


@pytest.mark.parametrize("n", [3, 4, 5, 8])
@pytest.mark.parametrize("numel", [1, 2, 7, 1000])
def test_direct_all_reduce_of_statistics(n, numel):
    """Large statistics' reduce-scatter + all-gather: every rank gets the bits of
    an all-gather folded in rank order (bfloat16 makes the order visible), for
    sizes that do not divide evenly; fewer elements than ranks are refused."""
    import threading

    from hopq.comm.framing import Deadline, Where
    from hopq.comm.transport import all_gather, direct_all_reduce, make_inprocess_group

    g = torch.Generator().manual_seed(n * 1000 + numel)
    xs = [(torch.randn(2, numel, generator=g) * 1e3).to(torch.bfloat16) for _ in range(n)]

    def run(fn):
        ts = make_inprocess_group(n)
        out: list = [None] * n

        def work(r: int) -> None:
            try:
                out[r] = fn(ts[r], xs[r])
            except Exception as e:  # noqa: BLE001 - checked below
                out[r] = e
                ts[r].hub.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return out

    def add(acc, x):
        acc.add_(x)

    here = Where("test", 1, -2)
    got = run(lambda t, x: direct_all_reduce(t, x, add, Deadline(60), here))
    if 2 * numel < n:
        assert all(isinstance(o, ValueError) for o in got)
        return
    parts = run(lambda t, x: all_gather(t, x, Deadline(60), here))[0]
    want = parts[0].clone()
    for p in parts[1:]:
        want += p
    for o in got:
        assert o.shape == xs[0].shape and torch.equal(o.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("n", [2, 5, 33])
def test_exchange_gives_every_block_in_rank_order(n):
    """The agreement's exchange: one round to every peer up to 32 ranks, Bruck's
    all-gather beyond; either way every rank gets every block in rank order."""
    import threading

    from hopq.comm.framing import Deadline, Where
    from hopq.comm.transport import DIRECT_EXCHANGE_MAX, exchange, make_inprocess_group

    assert (n > DIRECT_EXCHANGE_MAX) == (n == 33)
    ts = make_inprocess_group(n)
    out: list = [None] * n

    def work(r: int) -> None:
        block = torch.full((24,), r, dtype=torch.uint8)
        out[r] = exchange(ts[r], block, Deadline(60), Where("test", 1, -1000))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for blocks in out:
        assert [int(b[0]) for b in blocks] == list(range(n))
        assert all(b.numel() == 24 and torch.all(b == b[0]) for b in blocks)


def _phases(monkeypatch, module, name, where_at):
    """Record the phase of every call of ``module.name`` (its Where is argument
    ``where_at``) in the returned list."""
    phases = []
    original = getattr(module, name)

    def counted(*a, **k):
        phases.append(a[where_at].phase)
        return original(*a, **k)

    monkeypatch.setattr(module, name, counted)
    return phases


def test_statistics_ride_with_the_agreement(monkeypatch):
    """DynamiQ's statistics of a 4 MiB call take the direct all-reduce, whose
    first round rides with the agreement: two rounds to every peer before the
    payload instead of three, with the same bits as the all-gather fold."""
    import hopq
    import hopq.comm.transport as transport
    from hopq.comm import engine

    n = 4
    xs = [torch.randn(1 << 20, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    rounds = _phases(monkeypatch, transport, "_each_peer", 4)
    riding = hopq.simulate(xs, "dynamiq", "ring", seed=2).outputs
    assert sorted(rounds) == ["agreement"] * n + ["statistics"] * n
    rounds.clear()
    monkeypatch.setattr(engine, "tails_ride", lambda t: False)
    apart = hopq.simulate(xs, "dynamiq", "ring", seed=2).outputs
    assert sorted(rounds) == ["agreement"] * n + ["statistics"] * (2 * n)
    rounds.clear()
    monkeypatch.setattr(engine, "DIRECT_STATS_BYTES", 1 << 30)  # the all-gather fold
    gathered = hopq.simulate(xs, "dynamiq", "ring", seed=2).outputs
    for a, b, c in zip(riding, apart, gathered, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_small_statistics_ride_with_the_agreement_whole(monkeypatch):
    """DynamiQ's statistics of a 256 KiB call are under DIRECT_STATS_BYTES: their
    all-gather rides with the agreement (each rank's statistics to every peer in
    the agreement's own messages), so no statistics round is left before the
    payload, and the bits are those of the separate all-gather."""
    import hopq
    import hopq.comm.transport as transport
    from hopq.comm import engine

    n = 4
    xs = [torch.randn(1 << 16, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    rounds = _phases(monkeypatch, transport, "_each_peer", 4)
    gathers = _phases(monkeypatch, engine, "all_gather", 3)
    riding = hopq.simulate(xs, "dynamiq", "ring", seed=2)
    assert sorted(rounds) == ["agreement"] * n and gathers == []
    monkeypatch.setattr(engine, "tails_ride", lambda t: False)
    apart = hopq.simulate(xs, "dynamiq", "ring", seed=2)
    assert gathers == ["statistics"] * n  # each rank's separate all-gather
    for a, b in zip(riding.outputs, apart.outputs, strict=True):
        assert torch.equal(a, b)
    assert riding.bytes_sent == apart.bytes_sent  # the same statistics bytes counted


def test_exchange_tails_reach_one_peer_each_and_room_is_left_for_them():
    """A rank sending no tails (a rank making another call than its peers) still
    receives its peers' blocks with their tails: every receive has room for one."""
    import threading

    from hopq.comm.framing import Deadline, Where
    from hopq.comm.transport import TAIL_BYTES, exchange_tails, make_inprocess_group

    n = 3
    ts = make_inprocess_group(n)
    out: list = [None] * n

    def work(r: int) -> None:
        block = torch.full((24,), r, dtype=torch.uint8)
        tails = (
            {}
            if r == 0
            else {
                q: torch.full((TAIL_BYTES - q,), 10 * r + q, dtype=torch.uint8)
                for q in range(n)
                if q != r
            }
        )
        out[r] = exchange_tails(ts[r], block, tails, Deadline(60), Where("test", 1, -1000))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r, (blocks, tails) in enumerate(out):
        assert [int(b[0]) for b in blocks] == list(range(n))
        for q, tail in tails.items():
            if q == 0:
                assert tail.numel() == 0
            else:
                assert tail.numel() == TAIL_BYTES - r and torch.all(tail == 10 * q + r)
    with pytest.raises(ValueError, match="at most"):
        exchange_tails(
            ts[1],
            torch.zeros(8, dtype=torch.uint8),
            {0: torch.zeros(TAIL_BYTES + 1, dtype=torch.uint8)},
            Deadline(1),
            Where("test", 2, -1000),
        )


def _naive_encoder_depths(s):  # the definition, one chunk at a time
    out = []
    for c in range(s.n_chunks):
        depth = dict.fromkeys(range(s.world_size), 0)
        for step in s.steps:
            for t in step:
                if t.phase is Phase.REDUCE and c in t.chunks:
                    depth[t.dst] = max(depth[t.dst], depth[t.src] + 1)
        out.append(depth)
    return out


def _naive_reduce_depths(s):
    out = []
    for c in range(s.n_chunks):
        depth = dict.fromkeys(range(s.world_size), 0)
        for step in s.steps:
            before = dict(depth)
            incoming: dict[int, list[int]] = {}
            for t in step:
                if t.phase is Phase.REDUCE and c in t.chunks:
                    incoming.setdefault(t.dst, []).append(before[t.src])
            for dst, ds in incoming.items():
                for d in sorted(ds, reverse=True):
                    depth[dst] = max(depth[dst], d) + 1
        out.append(depth[s.owner[c]])
    return out


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_what_a_schedule_keeps_equals_its_definition(topology):
    """The per-rank transfers and the chains a schedule computes once and keeps
    equal their definitions over its steps, for every topology, on the schedule
    and on a reduce-scatter's layout of it; a kept result is not changed by a
    caller changing the copy it was given."""
    for n in (1, 2, 3, 5, 8, 13):
        base = get_schedule(topology, n)
        layouts = [shard_layout(base, equal_shards(10 * n + 3, n)).reduce_scatter]
        for s in (base, *layouts):
            assert s.encoder_depths() == _naive_encoder_depths(s)
            assert s.reduce_depths() == _naive_reduce_depths(s)
            assert s.compression_chains() == [
                d[s.owner[c]] + 1 for c, d in enumerate(_naive_encoder_depths(s))
            ]
            for r in range(n):
                assert s.owned_chunks(r) == [c for c, o in enumerate(s.owner) if o == r]
                for i, step in enumerate(s.steps):
                    assert s.sends(r, i) == [t for t in step if t.src == r]
                    assert s.recvs(r, i) == [t for t in step if t.dst == r]
            assert s.reduce_steps() == [
                i for i, st in enumerate(s.steps) if any(t.phase is Phase.REDUCE for t in st)
            ]
            s.reduce_depths().append(-1)
            s.compression_chains().clear()
            s.sends(0, 0).append(None)
            assert s.reduce_depths() == _naive_reduce_depths(s)
            assert s.sends(0, 0) == [t for t in s.steps[0] if t.src == 0] if s.steps else True
        assert hash(base) == hash(get_schedule(topology, n))
