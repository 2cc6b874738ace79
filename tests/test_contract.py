"""Guarantees of every registered codec, checked in the simulator (no process group):
the grid is generated from the registry so that a new codec inherits it."""

import pytest
import torch

import hopq
from hopq.codecs.base import HopContext, LocalStats, ReduceOp, even_chunks
from hopq.comm.topology import TOPOLOGIES
from hopq.errors import PayloadError

CODECS = hopq.available_codecs()


def _inputs(n, size, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) * scale for _ in range(n)]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8])
def test_identical_and_accurate(codec, topology, n):
    xs = _inputs(n, 1031, seed=n)
    r = hopq.simulate(xs, codec, topology, seed=1)
    assert r.identical
    assert all(o.shape == xs[0].shape and o.dtype == xs[0].dtype for o in r.outputs)
    if n > 1:
        wire = {"fp32": 32, "bf16": 16, "fp16": 16}
        if codec in wire:
            assert r.bits_per_coord == pytest.approx(wire[codec], rel=1e-9)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    mag = torch.stack([x.double().abs() for x in xs]).sum(0)
    bound = hopq.get_codec(codec).error_bound(mag, r.hops_per_chunk)
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
