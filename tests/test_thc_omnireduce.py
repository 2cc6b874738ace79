"""THC: unbiasedness, exact homomorphic integer sums, lane overflow reported.
OmniReduce: equals bf16 when every block fits, k converges to its target."""

import warnings

import pytest
import torch

import hopq
from hopq.codecs.base import ReduceOp
from hopq.codecs.thc import THC, THCConfig, fwht
from hopq.sim import virtual_ranks


def test_fwht_is_orthonormal_and_involutive():
    x = torch.randn(3, 64, dtype=torch.float64)
    y = fwht(x)
    assert torch.allclose(fwht(y), x, atol=1e-12)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1))
    h = fwht(torch.eye(8, dtype=torch.float64))
    assert torch.allclose(h.abs(), torch.full((8, 8), 8**-0.5, dtype=torch.float64))


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

    def prepare(self, plan, x, scratch=False):  # type: ignore[no-untyped-def]
        work = super().prepare(plan, x, scratch)
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
