"""Guarantees of every registered codec, checked in the simulator (no process group):
the grid is generated from the registry so that a new codec inherits it."""

import dataclasses
from typing import Any

import pytest
import torch

import hopq
from hopq.codecs.base import HopContext, LocalStats, ReduceOp, even_chunks
from hopq.comm.topology import TOPOLOGIES, equal_shards, get_schedule, shard_layout
from hopq.errors import PayloadError

CODECS = hopq.available_codecs()


def _inputs(n, size, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) * scale for _ in range(n)]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8])
def test_identical_and_accurate(codec, topology, n):
    xs = _inputs(n, 1237, seed=n)  # DynamiQ serves 1,237 entries itself (no bf16 fallback)
    r = hopq.simulate(xs, codec, topology, seed=1)
    assert r.identical
    assert all(o.shape == xs[0].shape and o.dtype == xs[0].dtype for o in r.outputs)
    if n > 1:
        wire = {"fp32": 32, "bf16": 16, "fp16": 16}
        if codec in wire:
            assert r.bits_per_coord == pytest.approx(wire[codec], rel=1e-9)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    mag = torch.stack([x.double().abs() for x in xs]).sum(0)
    adds = max(get_schedule(topology, n).reduce_depths())
    bound = hopq.get_codec(codec).error_bound(mag, r.hops_per_chunk, adds)
    if bound is not None:
        assert ((r.outputs[0].double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("codec", CODECS)
def test_avg_and_sizes(codec):
    for size in (0, 1, 7, 64):
        xs = _inputs(3, size)
        s = hopq.simulate(xs, codec, "ring", op="sum")
        a = hopq.simulate(xs, codec, "ring", op="avg")
        assert a.identical and s.identical
        if codec == "fp32":
            assert torch.equal(a.outputs[0], s.outputs[0] / 3)


@pytest.mark.parametrize("codec", CODECS)
def test_nonfinite_is_not_hidden(codec):
    block = hopq.get_codec(codec).nonfinite_block()
    unit = min(block, 256)  # THC's poison covers the whole vector
    size = 4 * unit
    xs = _inputs(4, size)
    nan_at, inf_at = unit + 17 % unit, 3 * unit - 1
    xs[2][nan_at] = float("nan")
    xs[1][inf_at] = float("inf")
    r = hopq.simulate(xs, codec, "butterfly")
    poisoned = {nan_at // block, inf_at // block}
    clean = [i for i in range(size) if i // block not in poisoned]
    for o in r.outputs:
        assert not torch.isfinite(o[nan_at])
        assert not torch.isfinite(o[inf_at])
        assert torch.isfinite(o[clean]).all()


def test_input_dtypes_and_refusals():
    xs = [torch.arange(5), torch.arange(5)]
    with pytest.raises(TypeError, match="floating"):
        hopq.simulate(xs, "bf16")
    with pytest.raises(TypeError):
        hopq.simulate([torch.zeros(3, dtype=torch.complex64)] * 2, "bf16")
    with pytest.raises(ValueError, match="unknown codec"):
        hopq.simulate(_inputs(2, 4), "zstd")
    with pytest.raises(ValueError, match="unknown topology"):
        hopq.simulate(_inputs(2, 4), "bf16", "torus")
    with pytest.raises(ValueError, match="op must be"):
        hopq.simulate(_inputs(2, 4), "bf16", op="prod")
    with pytest.raises(ValueError, match="share shape"):
        hopq.simulate([torch.zeros(3), torch.zeros(4)])
    # half-precision inputs come back in their dtype, float32 accumulation inside
    hs = [x.to(torch.bfloat16) for x in _inputs(3, 50)]
    r = hopq.simulate(hs, "fp32")
    assert r.outputs[0].dtype == torch.bfloat16


def test_payload_validation():
    codec = hopq.get_codec("bf16")

    plan = codec.plan(torch.zeros(10), LocalStats(n_chunks=2, world_size=2))
    ctx = HopContext(0, 0, 0, 0, 0, 2)
    acc = torch.zeros(5)
    with pytest.raises(PayloadError):
        codec.decode_accumulate(plan, torch.zeros(9, dtype=torch.uint8), acc, ctx)
    with pytest.raises(PayloadError):
        codec.decode(plan, torch.zeros(10, dtype=torch.int8), ctx, acc)
    codec.decode_accumulate(plan, codec.encode(plan, torch.ones(5), ctx), acc, ctx)
    assert torch.equal(acc, torch.ones(5))


def test_even_chunks():
    assert even_chunks(10, 3) == ((0, 4), (4, 7), (7, 10))
    assert even_chunks(0, 3) == ((0, 0), (0, 0), (0, 0))
    assert even_chunks(10, 4, align=4) == ((0, 4), (4, 8), (8, 10), (10, 10))


def test_codec_state_roundtrip_and_clone():
    c = hopq.get_codec("bf16")
    hopq.simulate(_inputs(2, 8), c)
    hopq.simulate(_inputs(2, 8), c)
    assert c.round == 2  # the simulator hands rank 0's state back
    d = hopq.get_codec("bf16")
    d.load_state_dict(c.state_dict())
    assert d.round == 2
    assert ReduceOp.parse("avg") is ReduceOp.AVG


@pytest.mark.parametrize("codec", [c for c in CODECS if not hopq.get_codec(c).variable_size])
def test_direct_sends_what_a_ring_sends(codec):
    """The direct schedule moves the bytes of a ring (each rank sends (n - 1)/n of
    the vector per phase, on average over ranks when the chunks are uneven)
    with two compressions per contribution instead of n."""
    xs = _inputs(5, 1237, seed=5)
    ring = hopq.simulate(xs, codec, "ring", seed=2)
    direct = hopq.simulate(xs, codec, "direct", seed=2)
    assert direct.identical
    assert direct.bits_per_coord == pytest.approx(ring.bits_per_coord, rel=1e-12)
    assert (ring.hops_per_chunk, direct.hops_per_chunk) == (5, 2)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", [2, 3, 5])
def test_pipelined_equals_serial_for_any_microshards(codec, topology, n):
    """Microshards and pipelining change how messages move, never the bits."""
    xs = _inputs(n, 6007, seed=n)
    ref = hopq.simulate(xs, codec, topology, seed=4, microshards=1, pipeline=False).outputs
    for u in (2, 3):
        for pipeline in (True, False):
            got = hopq.simulate(xs, codec, topology, seed=4, microshards=u, pipeline=pipeline)
            assert got.identical and got.stats[0].microshards == u
            for a, b in zip(ref, got.outputs, strict=True):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (u, pipeline)


@pytest.mark.parametrize("codec", CODECS)
def test_finite_in_finite_out(codec):
    """No codec turns finite input into NaN or Inf while the sums stay finite in
    float32: one huge entry (either sign) among ordinary ones, up to 3.3e38; and
    every entry huge (THC's float64 rotation once rounded back to float32 there)."""
    for mag in (1e5, 1e30, 1e36, 1e37, 3.3e38):
        xs = _inputs(4, 3000, seed=1)
        xs[1][100] = mag
        xs[2][2500] = -mag
        for topo in ("ring", "butterfly"):
            r = hopq.simulate(xs, codec, topo, seed=2)
            assert all(torch.isfinite(o).all() for o in r.outputs), (mag, topo)
    base = _inputs(4, 3000, seed=1)
    for mag in (1e30, 1.2e38, 3.2e38):  # the largest entry times n = 4 stays below mag
        xs = [x * (mag / 4 / float(x.abs().max())) for x in base]
        for topo in ("ring", "butterfly"):
            r = hopq.simulate(xs, codec, topo, seed=2)
            assert all(torch.isfinite(o).all() for o in r.outputs), ("all", mag, topo)


def test_omnireduce_never_hides_nonfinite_blocks():
    """More non-finite blocks than its k: every one of them still travels."""
    xs = _inputs(3, 64 * 256, seed=3)
    for b in range(0, 64, 2):  # half the blocks, beyond the default k of a quarter
        xs[b % 3][b * 256 + 7] = float("nan") if b % 4 else float("inf")
    r = hopq.simulate(xs, hopq.get_codec("omnireduce", budget=4), "ring")
    for b in range(0, 64, 2):
        assert not torch.isfinite(r.outputs[0][b * 256 + 7])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # garbage sums saturate THC's lanes
def test_decoders_reject_or_survive_corrupt_payloads(codec):
    """Fuzzed payloads (random bytes, truncated, extended, wrong dtype, strided):
    every decode either works or raises PayloadError; nothing else escapes."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    c = hopq.get_codec(codec)
    x = _inputs(1, 2000, seed=5)[0]
    plan = c.plan(x, LocalStats(n_chunks=2, world_size=2))
    work = c.prepare_all(plan, x)
    ctx = HopContext(0, 0, 0, 1, 0, 2)
    good = c.encode(plan, plan.chunk_view(work, 0).clone(), ctx)
    n = plan.chunk_numel(0)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(["random", "truncate", "extend", "flip", "dtype", "strided"]),
        st.integers(0, 2**31),
    )
    def fuzz(mode, seed):
        g = torch.Generator().manual_seed(seed)
        p = good.clone()
        if mode == "random":
            p = torch.randint(0, 256, p.shape, generator=g, dtype=torch.int64).to(torch.uint8)
        elif mode == "truncate":
            p = p[: int(torch.randint(0, max(1, p.numel()), (1,), generator=g))]
        elif mode == "extend":
            p = torch.cat([p, torch.zeros(1 + seed % 9, dtype=torch.uint8)])
        elif mode == "flip" and p.numel():
            i = int(torch.randint(0, p.numel(), (1,), generator=g))
            p[i] ^= 1 << (seed % 8)
        elif mode == "dtype":
            p = p.to(torch.int32)
        elif mode == "strided":
            p = torch.stack([p, p], 1).reshape(-1)[::2]
        for op in ("decode", "decode_accumulate", "decode_accumulate_encode"):
            out = torch.zeros(n)
            try:
                if op == "decode":
                    c.decode(plan, p, ctx, out)
                elif op == "decode_accumulate":
                    c.decode_accumulate(plan, p, out, ctx)
                else:
                    c.decode_accumulate_encode(plan, p, out, ctx)
            except PayloadError:
                pass

    fuzz()


def test_bad_configurations_fail_at_construction():
    """The validation gaps found by fault testing: each is a clear error up front."""
    from hopq.codecs.dynamiq import DynamiQ

    for bad, err in (
        ({"budget": float("inf")}, ValueError),
        ({"supergroup_size": 2**24}, ValueError),
        ({"widths": "248"}, TypeError),
        ({"eps": ((8, 50.0),)}, ValueError),
        ({"eps": "0.3"}, TypeError),
        ({"eps": 0.3}, TypeError),
    ):
        with pytest.raises(err):
            DynamiQ(**bad)
    with pytest.raises(ValueError, match="mu_init"):
        hopq.get_codec("mxfp8", mu_init=float("inf"))
    with pytest.raises(TypeError, match="seed"):
        hopq.simulate(_inputs(2, 8), "bf16", seed=1.5)
    with pytest.raises(TypeError, match="key"):
        hopq.simulate(_inputs(2, 8), "bf16", key="bucket")
    with pytest.raises(ValueError, match="timeout"):
        hopq.simulate(_inputs(2, 8), "bf16", timeout=0)
    with pytest.raises(ValueError, match="unknown topology"):
        hopq.HookState(codec="bf16", topology="butterfy")
    with pytest.raises(ValueError, match="gather stage"):
        hopq.simulate(_inputs(2, 8), "bf16", gather_codec="dynamiq")
    with pytest.raises(TypeError, match="process_group="):
        hopq.HookState(codec="dynamiq", group=None)
    with pytest.raises(TypeError, match="own_group must be"):
        hopq.HookState(own_group="yes")
    with pytest.raises(ValueError, match="with overlap=False"):  # it would do nothing
        hopq.HookState(overlap=False, own_group=True)


@pytest.mark.parametrize("codec", CODECS)
def test_an_unknown_option_names_the_codec_and_its_options(codec):
    """A misspelt option (through get_codec, HookState or all_reduce's codec
    name) says which codec refused it and lists the ones it has."""
    with pytest.raises(TypeError, match=f"codec '{codec}' has no option 'bugdet'") as e:
        hopq.get_codec(codec, bugdet=4)
    for name in dataclasses.fields(hopq.get_codec(codec).config_class):
        assert name.name in str(e.value)
    with pytest.raises(TypeError, match="has no option 'bugdet'"):
        hopq.HookState(codec=codec, bugdet=4)


# -- reduce-scatter over rank shards (FSDP's layout) ------------------------------
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_reduce_scatter_equal_shards(codec, topology, n):
    """Rank r gets the r-th equal slice, bit for bit the all-reduce over the same
    chunks, for every codec (permuting ones included) and topology. DynamiQ's
    plan differs there: a reduce-scatter's statistics weigh double in its budget,
    so it is compared with an all-reduce whose budget leaves the same payload."""
    xs = _inputs(n, 1237, seed=10 + n)
    rs = hopq.simulate_reduce_scatter(xs, hopq.get_codec(codec), topology, seed=2, op="avg")
    same = {}
    if codec == "dynamiq":  # 32 more bits per super-group: the same payload bits
        bounds = shard_layout(get_schedule(topology, n), equal_shards(1237, n)).bounds
        m = sum(-(-(b - a) // 256) for a, b in zip(bounds, bounds[1:], strict=False))
        same = {"budget": hopq.get_codec(codec).config.budget - 32 * m / 1237}
    full = hopq.simulate(
        xs, hopq.get_codec(codec, **same), topology, seed=2, op="avg", shards="equal"
    )
    assert full.identical
    assert rs.shards == equal_shards(1237, n)
    for r in range(n):
        a, b = rs.shards[r], rs.shards[r + 1]
        assert rs.outputs[r].shape == (b - a,)
        assert torch.equal(rs.outputs[r].view(torch.int32), full.outputs[r][a:b].view(torch.int32))
        assert rs.stats[r].phases == ("reduce",)
    assert rs.vnmse == pytest.approx(full.vnmse, rel=1e-12, abs=1e-30)
    mag = torch.stack([x.double().abs() for x in xs]).sum(0) / n
    adds = max(get_schedule(topology, n).reduce_depths())
    bound = hopq.get_codec(codec).error_bound(mag, full.hops_per_chunk, adds)
    if bound is not None:
        exact = torch.stack([x.double() for x in xs]).sum(0) / n
        assert ((torch.cat(rs.outputs).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("codec", [c for c in CODECS if hopq.get_codec(c).layout_preserving])
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduce_scatter_is_the_all_reduce_slice(codec, topology, n):
    """A layout-preserving codec's equal shards are slice r of the plain all-reduce
    bit for bit where the topology's own chunks are the shards (a size that every
    alignment divides; butterfly's fold moves chunks for n = 3)."""
    if topology == "butterfly" and n & (n - 1):
        pytest.skip("the fold gives chunks of 2/3 and 1/3: no plain all-reduce cuts at n shards")
    d = 64 * 3 * n
    xs = _inputs(n, d, seed=n)
    rs = hopq.simulate_reduce_scatter(xs, hopq.get_codec(codec), topology, seed=5)
    full = hopq.simulate(xs, hopq.get_codec(codec), topology, seed=5)
    for r in range(n):
        a, b = r * d // n, (r + 1) * d // n
        assert torch.equal(rs.outputs[r].view(torch.int32), full.outputs[0][a:b].view(torch.int32))


def test_reduce_scatter_bits_and_deliveries():
    xs = _inputs(4, 4000)
    for codec, bits in (("fp32", 32), ("bf16", 16), ("fp16", 16)):
        for topo in ("ring", "semiloop", "biring", "butterfly"):
            r = hopq.simulate_reduce_scatter(xs, codec, topo)
            assert r.bits_per_coord == pytest.approx(bits, rel=1e-9), (codec, topo)
    # three ranks on a butterfly: folded rank 0 gets its shard from rank 1
    r = hopq.simulate_reduce_scatter(xs[:3], "bf16", "butterfly")
    sent = [s.payload_bytes for s in r.stats]
    assert sent[1] > sent[2] and sent[0] > 0
    # the tree's root sends every rank the whole final payload
    r = hopq.simulate_reduce_scatter(xs[:3], "fp32", "tree")
    assert r.stats[0].payload_bytes == 2 * 4 * 4000


def test_reduce_scatter_shards_and_ops():
    import torch.distributed as dist

    xs = _inputs(3, 100)
    exact = torch.stack(xs).sum(0)
    # explicit shards, empty ones included
    r = hopq.simulate_reduce_scatter(xs, "fp32", "ring", shards=(0, 0, 70, 100))
    assert [o.numel() for o in r.outputs] == [0, 70, 30]
    assert torch.allclose(torch.cat(r.outputs), exact, atol=1e-5)
    for bad in ((0, 50, 100), (0, 60, 50, 100), (1, 2, 3, 100), "rank"):
        with pytest.raises(ValueError, match="shards"):
            hopq.simulate_reduce_scatter(xs, "fp32", "ring", shards=bad)
    # torch's ops: SUM, AVG, PREMUL_SUM(f) = sum of f x_i; others refused
    ref = hopq.simulate_reduce_scatter(xs, "fp32", "ring", op="avg").outputs
    got = hopq.simulate_reduce_scatter(xs, "fp32", "ring", op=dist.ReduceOp.AVG).outputs
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    got = hopq.simulate_reduce_scatter(xs, "fp32", "ring", op=dist.ReduceOp(dist.ReduceOp.SUM))
    assert torch.allclose(torch.cat(got.outputs), exact, atol=1e-5)
    pre = hopq.simulate(xs, "fp32", "ring", op=dist.ReduceOp.PREMUL_SUM(0.25))
    scaled = hopq.simulate([x * 0.25 for x in xs], "fp32", "ring", op="sum")
    assert torch.equal(pre.outputs[0], scaled.outputs[0]) and pre.vnmse < 1e-12
    t = hopq.simulate(xs, "fp32", "ring", op=dist.ReduceOp.PREMUL_SUM(torch.tensor(0.25)))
    assert torch.equal(t.outputs[0], scaled.outputs[0])
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT, "max"):
        with pytest.raises(ValueError, match="op must be"):
            hopq.simulate(xs, "fp32", "ring", op=op)
    # the topology's own shards need a layout-preserving codec
    with pytest.raises(ValueError, match="shards='equal'"):
        hopq.reduce_scatter(xs[0], "dynamiq", shards="topology")


def test_reduce_scatter_chunk_local_plans():
    """What each codec does with chunk bounds (FSDP shards of 40 entries)."""
    x = torch.randn(80)
    st = LocalStats(n_chunks=2, world_size=2, bounds=(0, 40, 80))
    # MX: blocks of 32 start at each shard; a shard's last block is partial
    p = hopq.get_codec("mxfp8").plan(x, st)
    assert p.chunks == ((0, 64), (64, 128)) and p.work_numel == 128
    # THC: each shard rotated on its own (padded to whole Hadamard blocks)
    p = hopq.get_codec("thc").plan(x, st)
    assert p.chunks == ((0, p.work_numel // 2), (p.work_numel // 2, p.work_numel))
    # DynamiQ: super-groups start at each shard and are reordered inside it
    big = torch.randn(3000) * torch.logspace(-3, 1, 3000)
    st = LocalStats(n_chunks=2, world_size=2, bounds=(0, 1000, 3000))
    p = hopq.get_codec("dynamiq").plan(big, st)
    assert p.sg_starts == (0, 4, 12) and p.chunks[0] == (0, 4 * 256)
    assert sorted(p.perm[:4].tolist()) == [0, 1, 2, 3]
    assert sorted(p.perm[4:].tolist()) == list(range(4, 12))
    # OmniReduce: blocks cut inside each shard, chunk c = shard c's selected blocks
    p = hopq.get_codec("omnireduce", block=16).plan(x, LocalStats(2, 2, bounds=(0, 40, 80)))
    idx = p.index
    first = p.chunks[0][1]
    assert (idx[:first] < 40).all() and (idx[first:] >= 40).all()
    # a codec that ignores bounds must not be asked: bounds must fit the call
    with pytest.raises(ValueError, match="bounds"):
        hopq.get_codec("bf16").plan(x, LocalStats(n_chunks=2, bounds=(0, 80)))


@pytest.mark.parametrize("codec", CODECS)
def test_reduce_scatter_microshards_change_nothing(codec):
    """Over rank shards too, microshards and pipelining never change the bits."""
    xs = _inputs(3, 6007, seed=3)
    for topo in ("ring", "butterfly"):
        ref = hopq.simulate_reduce_scatter(xs, codec, topo, microshards=1, pipeline=False)
        for u, pipeline in ((3, True), (2, False)):
            got = hopq.simulate_reduce_scatter(xs, codec, topo, microshards=u, pipeline=pipeline)
            assert got.stats[0].microshards == u
            for a, b in zip(ref.outputs, got.outputs, strict=True):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (topo, u)


@pytest.mark.parametrize("codec", ["gqsgd-linear", "gqsgd-exp", "dynamiq"])
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", [1, 3, 4])
def test_engine_prepares_each_part_once_before_its_first_use(codec, topology, n):
    """Codec.prepare_part: once per part and rank, before the part's own values
    are encoded or accumulated into; a codec that defers its preparation there
    and finishes parts as they complete (Global-QSGD's finish_part) gets the
    bits of preparing everything up front and finishing at the end."""
    base: Any = type(hopq.get_codec(codec))
    log: list[tuple[int, str, int]] = []  # (id of the rank's plan, event, part)

    class Watched(base):
        def prepare_part(self, plan, work, part):
            log.append((id(plan), "prepare", part))
            super().prepare_part(plan, work, part)

        def encode(self, plan, chunk, ctx):
            log.append((id(plan), "use", ctx.chunk))
            return super().encode(plan, chunk, ctx)

        def decode_accumulate(self, plan, payload, acc, ctx):
            log.append((id(plan), "use", ctx.chunk))
            super().decode_accumulate(plan, payload, acc, ctx)

        def decode_accumulate_encode(self, plan, payload, local, ctx):
            log.append((id(plan), "use", ctx.chunk))
            return super().decode_accumulate_encode(plan, payload, local, ctx)

    class UpFront(base):
        def prepare(self, plan, x, overwrite=False):
            work = super().prepare(plan, x, overwrite)
            for m in range(len(plan.chunks)):
                super().prepare_part(plan, work, m)
            return work

        def prepare_part(self, plan, work, part):
            pass

        def finish_part(self, plan, work, part, op, world_size):
            pass  # finish() converts everything at the end

    xs = _inputs(n, 3001, seed=2)
    for op in ("sum", "avg"):
        log.clear()
        got = hopq.simulate(xs, Watched(), topology, seed=1, microshards=2, op=op)
        ref = hopq.simulate(xs, UpFront(), topology, seed=1, microshards=2, op=op)
        assert all(torch.equal(a, b) for a, b in zip(got.outputs, ref.outputs, strict=True))
        for r in dict.fromkeys(key for key, _, _ in log):  # one plan per rank
            events = [(what, m) for key, what, m in log if key == r]
            prepared = [m for what, m in events if what == "prepare"]
            assert len(prepared) == len(set(prepared))  # at most once
            for i, (what, m) in enumerate(events):
                if what == "use" and ("prepare", m) not in events[:i]:
                    # the part was used (leaf encode or the first accumulate) unprepared
                    raise AssertionError(f"rank {r}: part {m} used before prepare_part")


def test_pipeline_depth_follows_the_codec():
    """Without ``microshards`` the engine cuts chunks at the codec's
    ``microshard_coords``: 256K coordinates by default (casts included: on a
    link, a whole-chunk message leaves it idle while the chunk is added), and
    whatever a codec class sets instead."""
    xs = _inputs(4, 1 << 22, seed=3)  # 1M coordinates per ring chunk
    depth = {c: hopq.simulate(xs, c, "ring").stats[0].microshards for c in ("bf16", "equarx")}
    assert depth == {"bf16": 4, "equarx": 4}

    class Coarse(type(hopq.get_codec("bf16"))):  # type: ignore[misc]
        microshard_coords = 1 << 20

    assert hopq.simulate(xs, Coarse(), "ring").stats[0].microshards == 1
    assert hopq.simulate(xs, "bf16", "ring", microshards=3).stats[0].microshards == 3
