"""THC: unbiasedness, exact homomorphic integer sums, lane overflow reported.
OmniReduce: equals bf16 when every block fits, k converges to its target."""

import math
import warnings

import pytest
import torch

import hopq
from hopq.codecs.base import ReduceOp
from hopq.codecs.thc import THC, THCConfig, fwht
from hopq.codecs.thc import kernels_cpu as thc_cpu
from hopq.sim import virtual_ranks


def test_fwht_is_orthonormal_and_involutive():
    x = torch.randn(3, 64, dtype=torch.float64)
    y = fwht(x)
    assert torch.allclose(fwht(y), x, atol=1e-12)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1))
    h = fwht(torch.eye(8, dtype=torch.float64))
    assert torch.allclose(h.abs(), torch.full((8, 8), 8**-0.5, dtype=torch.float64))


@pytest.mark.skipif(not thc_cpu.available(), reason="numba is not installed")
def test_thc_kernels_match_the_reference_bit_for_bit():
    """The CPU kernel's signs, uniforms and Hadamard transform are the reference's
    (float32 and float64, every block size kind, large magnitudes)."""
    from hopq.numerics.rng import hash32, stream_key, uniform

    key = stream_key(7, 3, 0xFFFF0, 0)
    idx = torch.arange(100003, dtype=torch.int64)
    want = 1.0 - 2.0 * (hash32(idx, key) & 1).to(torch.float32)
    assert torch.equal(thc_cpu.signs(100003, key), want)
    for off in (0, 5, 2**32 - 1000):
        assert torch.equal(thc_cpu.uniform(1000, key, off), uniform(1000, key, offset=off))
    with pytest.raises(ValueError, match="32-bit counter"):
        thc_cpu.uniform(10, key, 2**32 - 5)
    g = torch.Generator().manual_seed(1)
    for H in (1, 2, 8, 4096, 65536):
        for dt, mag in ((torch.float32, 1e30), (torch.float64, 1e200)):
            x = torch.randn(3, H, generator=g, dtype=dt) * mag
            x[0, 0] = float("nan") if H > 1 else x[0, 0]
            a, b = fwht(x), thc_cpu.fwht(x)
            assert a.dtype == b.dtype and torch.equal(a.view(-1).isnan(), b.view(-1).isnan())
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (H, dt)


@pytest.mark.skipif(not thc_cpu.available(), reason="numba is not installed")
@pytest.mark.parametrize("topology, n", [("ring", 4), ("butterfly", 3)])
def test_thc_with_kernels_equals_the_reference(topology, n):
    """Whole calls with the kernel equal the reference's: all-reduce, average,
    a reduce-scatter over rank shards (chunk-wise rotation), float64 rotation."""
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(70001, generator=g) for _ in range(n)]
    wide = [x * 1e37 for x in xs]  # rotated in float64; the sums stay below 3.4e38
    for inputs, kw in ((xs, {}), (xs, {"op": "avg"}), (wide, {})):
        a = hopq.simulate(inputs, THC(backend="reference"), topology, seed=2, **kw).outputs
        b = hopq.simulate(inputs, THC(backend="cpu"), topology, seed=2, **kw).outputs
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        assert all(torch.isfinite(p).all() for p in a)  # finite in, finite out
    a = hopq.simulate_reduce_scatter(xs, THC(backend="reference"), topology, shards="equal")
    b = hopq.simulate_reduce_scatter(xs, THC(backend="cpu"), topology, shards="equal")
    assert all(torch.equal(p, q) for p, q in zip(a.outputs, b.outputs, strict=True))


def test_thc_unbiased():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(512, generator=g) * torch.linspace(0.1, 3, 512) for _ in range(3)]
    exact = torch.stack(xs).double().sum(0)
    runs, acc, sq = 200, torch.zeros(512, dtype=torch.float64), 0.0
    for seed in range(runs):
        out = hopq.simulate(xs, "thc", "ring", seed=seed).outputs[0].double()
        acc += out
        sq += (out - exact).square().sum().item()
    assert (acc / runs - exact).square().sum().item() < 1.3 * sq / runs / runs


class _Capture(THC):
    """THC that records this rank's integers (prepare) and the integer sums it
    decodes (finish)."""

    def prepare(self, plan, x, overwrite=False):  # type: ignore[no-untyped-def]
        work = super().prepare(plan, x, overwrite)
        self.local = work.clone()  # the engine accumulates into work
        return work

    def finish(self, plan, y, op, world_size):  # type: ignore[no-untyped-def]
        self.ints = y.clone()
        return super().finish(plan, y, op, world_size)


@pytest.mark.parametrize("n, topology", [(3, "ring"), (4, "butterfly"), (5, "butterfly")])
def test_thc_integer_sums_are_exact(n, topology):
    xs = [torch.randn(3000) for _ in range(n)]
    codec = _Capture()
    hopq.simulate(xs, codec, topology, seed=7)
    ranks = virtual_ranks(codec)
    total = torch.stack([c.local for c in ranks]).sum(0)
    assert torch.equal(total, torch.round(total))
    for c in ranks:
        assert torch.equal(c.ints, total)  # lanes added exactly, no decompression


def test_thc_lanes():
    assert THCConfig().lanes_for(8) == 8
    assert THCConfig().lanes_for(9) == 12
    assert THCConfig().lanes_for(64) == 12
    # sums of n ranks lie in [-7 n, 7 n]: signed 12-bit lanes hold them up to n = 292
    assert THCConfig().lanes_for(292) == 12
    assert THCConfig().lanes_for(293) == 16
    # other level counts: q = 8 (L = 127) needs 2 * 127 * n + 1 values per lane
    assert THCConfig(q=8).lanes_for(1) == 8
    assert THCConfig(q=8).lanes_for(2) == 12
    assert THCConfig(q=8).lanes_for(9) == 12  # 2287 values
    assert THCConfig(q=8).lanes_for(17) == 16  # 4319 values
    assert THCConfig(q=2).lanes_for(200) == 12
    with pytest.raises(ValueError, match="lanes"):
        THCConfig(q=8).lanes_for(70_000)
    xs = [torch.randn(1000) for _ in range(16)]
    r = hopq.simulate(xs, "thc", "ring")  # 12-bit lanes round trip
    assert r.identical and r.vnmse < 0.5
    assert r.bits_per_coord == pytest.approx(12, rel=0.1)


def test_thc_lane_overflow_is_reported():
    xs = [torch.ones(1000) + 0.01 * torch.randn(1000) for _ in range(20)]
    codec = THC(lane_bits=8)  # 20 ranks: sums reach 7 * 20 = 140 > 127
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        r = hopq.simulate(xs, codec, "ring")
    assert any("saturate" in str(x.message) for x in w)
    assert sum(c.overflows for c in virtual_ranks(codec)) > 0
    assert r.identical  # saturation, not wrap-around: still the same on every rank
    assert (r.outputs[0] > 0).float().mean() > 0.9


def test_omnireduce_full_budget_equals_bf16():
    for n, topo in ((2, "ring"), (3, "butterfly"), (4, "ring")):
        xs = [torch.randn(5000) for _ in range(n)]
        a = hopq.simulate(xs, hopq.get_codec("omnireduce", budget=16), topo)
        b = hopq.simulate(xs, "bf16", topo)
        assert torch.equal(a.outputs[0], b.outputs[0])
        assert a.bits_per_coord == pytest.approx(b.bits_per_coord, abs=0.05)


def test_omnireduce_k_converges_to_target():
    g = torch.Generator().manual_seed(1)
    scale = torch.rand(128, generator=g).repeat_interleave(256)
    xs = [torch.randn(128 * 256, generator=g) * scale for _ in range(4)]
    codec = hopq.get_codec("omnireduce")
    target = codec.target(128)
    unions = []
    for _ in range(25):
        hopq.simulate(xs, codec, "ring")
        unions.append(codec.last_union)
    assert abs(unions[-1] - target) <= abs(unions[0] - target)
    assert abs(unions[-1] - target) <= 0.15 * target
    r = hopq.simulate(xs, codec, "ring")
    assert r.bits_per_coord == pytest.approx(8, abs=1.5)


def test_omnireduce_drops_small_blocks_only():
    x = torch.zeros(8 * 256)
    x[:256] = 5.0  # one big block, the rest tiny
    x[256:] = 1e-3
    r = hopq.simulate([x, x.clone()], hopq.get_codec("omnireduce", budget=2), "ring")
    assert torch.allclose(r.outputs[0][:256], torch.full((256,), 10.0), rtol=1e-2)
    assert ReduceOp.parse("sum") is ReduceOp.SUM


@pytest.mark.skipif(not thc_cpu.available(), reason="numba is not installed")
def test_thc_fused_rotation_quantization_and_inverse_equal_the_reference():
    """The fused kernels (rotation with its maximum, stochastic rounding, the
    inverse rotation) at the largest Hadamard block, a length that pads, and
    an average: plan, prepare and finish give the reference's bits."""
    from hopq.codecs.base import LocalStats
    from hopq.codecs.base import ReduceOp as Op

    x = torch.randn((1 << 20) + 12345, generator=torch.Generator().manual_seed(3))
    ref, ker = THC(backend="reference"), THC(backend="cpu")
    plans = [c.plan(x, LocalStats(n_chunks=4, world_size=4, seed=5, round=2)) for c in (ref, ker)]
    assert plans[0].block == 65536 and plans[0].work_numel > x.numel()
    assert torch.equal(plans[0].rotated, plans[1].rotated) and plans[0].step == plans[1].step
    works = [c.prepare(p, x) for c, p in zip((ref, ker), plans, strict=True)]
    assert torch.equal(works[0], works[1])
    y = works[0] * 3 - 1  # integer sums of some ranks
    for op in (Op.SUM, Op.AVG):
        outs = [c.finish(p, y.clone(), op, 4) for c, p in zip((ref, ker), plans, strict=True)]
        assert torch.equal(outs[0], outs[1]), op
    x[777] = float("nan")  # the fused rotation's maximum is NaN, as torch's amax
    st = LocalStats(n_chunks=4, world_size=4, seed=5, round=2)
    steps = [c.plan(x, st).step for c in (ref, ker)]
    assert all(math.isnan(s) for s in steps), steps
