"""MXFP8/6/4's numba kernels against the PyTorch reference, bit for bit: encode
(with its saturation count), decode, decode-accumulate and the fused hop, for
the three formats, both scale formats, awkward values (ties, float32
subnormals, +-0, beyond FMAX, NaN, Inf) and awkward scales (0, Inf, NaN, near
float32's limit), on chunks of several blocks."""

import pytest
import torch

import hopq
from hopq.codecs.base import HopContext, LocalStats

pytest.importorskip("numba")

FORMATS = ("mxfp8", "mxfp6", "mxfp4")


def _nasty(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    k = n // 8
    idx = torch.randperm(n, generator=g)[:k]
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-40, 2.5, -5.0, 0.25, 0.75, 3.4e38, -3.4e38, 1e30, 7.0]
    )
    x[idx] = specials[torch.randint(0, specials.numel(), (k,), generator=g)]
    return x


def _pair(name: str, **kw):
    return hopq.get_codec(name, backend="cpu", **kw), hopq.get_codec(
        name, backend="reference", **kw
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("scale", ["bf16", "e8m0"])
def test_kernels_equal_the_reference(name, scale):
    kern, ref = _pair(name, scale=scale, mu_init=1.0)
    assert (
        kern.kernels(torch.device("cpu")) is not None and ref.kernels(torch.device("cpu")) is None
    )
    ctx = HopContext(0, 0, 0, 1, 0, 2)
    # 4096 and 4192: several spans of the kernels (2048 values), the last one short
    for seed, n in enumerate((32, 64, 96 * 7, 4096, 4192)):
        x = _nasty(n, seed)
        # statistics from other data: values beyond FMAX saturate
        base = _nasty(n, seed + 100) * 0.5
        if n > 64:
            base[:32] = 0.0  # a block of zeros: scale 0
            base[32] = float("inf")  # a block with an Inf scale
            base[64] = float("nan")  # and one with a NaN scale
        plans = [c.plan(base, LocalStats(n_chunks=1, world_size=2)) for c in (kern, ref)]
        assert torch.equal(_bits(plans[0].scale), _bits(plans[1].scale))
        if n == 4096:  # scales near float32's limit: v * s would overflow
            plans[0].scale[-4:] = plans[1].scale[-4:] = 3.0e38
        p = [c.encode(pl, x, ctx) for c, pl in zip((kern, ref), plans, strict=True)]
        assert torch.equal(p[0], p[1]), (name, n)
        assert kern.overflow == ref.overflow and kern.encoded == ref.encoded
        outs = [torch.empty(n), torch.empty(n)]
        for c, pl, o in zip((kern, ref), plans, outs, strict=True):
            c.decode(pl, p[0], ctx, o)
        assert torch.equal(_bits(outs[0]), _bits(outs[1]))
        accs = [x.clone(), x.clone()]
        for c, pl, a in zip((kern, ref), plans, accs, strict=True):
            c.decode_accumulate(pl, p[0], a, ctx)
        assert torch.equal(_bits(accs[0]), _bits(accs[1]))
        y = _nasty(n, seed + 7)
        locs = [y.clone(), y.clone()]
        hops = [
            c.decode_accumulate_encode(pl, p[0], loc, ctx)
            for c, pl, loc in zip((kern, ref), plans, locs, strict=True)
        ]
        assert torch.equal(hops[0], hops[1]), (name, n)
        assert torch.equal(_bits(locs[0]), _bits(locs[1]))
        assert kern.overflow == ref.overflow > 0


def test_every_magnitude_and_tie_encodes_like_the_reference():
    """All representable magnitudes, the midpoints between neighbours (ties to
    the even code) and points just beside them, through scale 1 blocks."""
    from hopq.numerics import fp_formats as fpf

    for name, fmt in (("mxfp8", fpf.E4M3), ("mxfp6", fpf.E3M2), ("mxfp4", fpf.E2M1)):
        kern, ref = _pair(name, mu_init=1.0)
        m = fpf.magnitudes(fmt)
        mid = (m[1:] + m[:-1]) / 2
        v = torch.cat([m, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(m[1:]), -m, -mid])
        v = torch.cat([v, torch.zeros((-v.numel()) % 32)])
        base = torch.full_like(v, fmt.max)  # scale = FMAX: v / s * FMAX = v
        plans = [c.plan(base, LocalStats(n_chunks=1)) for c in (kern, ref)]
        ctx = HopContext(0, 0, 0, 1, 0, 1)
        a, b = (c.encode(pl, v, ctx) for c, pl in zip((kern, ref), plans, strict=True))
        assert torch.equal(a, b), name


def test_real_all_reduce_uses_the_kernels_and_matches_the_reference():
    x = [torch.randn(3000, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    for name in FORMATS:
        outs = [
            hopq.simulate(x, hopq.get_codec(name, backend=b), "ring").outputs
            for b in ("cpu", "reference")
        ]
        for a, b in zip(*outs, strict=True):
            assert torch.equal(_bits(a), _bits(b)), name


def test_partial_blocks_pack_like_the_reference_and_lengths_are_checked():
    """Chunks the codec never makes (a partial last block) still pack as bitpack
    lays them out; a tensor of the wrong length is refused before any read."""
    from hopq.codecs.mx import MXCodec
    from hopq.codecs.mx import kernels_cpu as mx_cpu
    from hopq.errors import PayloadError

    for name in FORMATS:
        kern, ref = _pair(name, mu_init=1.0)
        assert isinstance(ref, MXCodec)
        for n in (33, 35, 37, 63):
            x = _nasty(n, n)
            padded = torch.cat([x, torch.zeros(64 - n)])
            plan = ref.plan(padded, LocalStats(n_chunks=1))
            want = ref.encode(plan, padded, HopContext(0, 0, 0, 1, 0, 1))
            got, _ = mx_cpu.encode(x, plan.scale, ref.element, 32)
            assert torch.equal(got, want[: got.numel()]), (name, n)
            out = torch.empty(n)
            mx_cpu.decode(got, plan.scale, ref.element, 32, out, False)
            full = torch.empty(64)
            ref.decode(plan, want, HopContext(0, 0, 0, 1, 0, 1), full)
            assert torch.equal(_bits(out), _bits(full[:n]))
        plan = kern.plan(torch.ones(64), LocalStats(n_chunks=1))
        with pytest.raises(PayloadError, match="of 64"):
            kern.decode(
                plan,
                torch.zeros(plan.payload_nbytes[0], dtype=torch.uint8),
                HopContext(0, 0, 0, 1, 0, 1),
                torch.empty(96),
            )


def test_a_block_the_kernels_cannot_pack_is_refused_when_asked_for():
    """Blocks of 6 six-bit codes end mid-byte: auto runs the reference, an
    explicit backend="cpu" says why it cannot."""
    x = torch.randn(36)
    assert hopq.get_codec("mxfp6", block=6).kernels(x.device) is None
    with pytest.raises(ValueError, match="multiple of 8"):
        hopq.get_codec("mxfp6", block=6, backend="cpu").kernels(x.device)
