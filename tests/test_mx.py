"""MXFP8/6/4: formats checked exhaustively, blocks of zeros and subnormals,
saturation counting and the adaptive scale."""

import math

import pytest
import torch

import hopq
from hopq.codecs.mx import MXConfig
from hopq.numerics import fp_formats as fpf
from hopq.numerics.bitpack import pack_bits, unpack_bits


def _spec_value(code: int, e_bits: int, m_bits: int, bias: int) -> float:
    """The OCP MX element value of a code, written out independently."""
    sign = -1.0 if code >> (e_bits + m_bits) else 1.0
    e = (code >> m_bits) & ((1 << e_bits) - 1)
    m = code & ((1 << m_bits) - 1)
    if e == 0:
        return sign * (m / 2**m_bits) * 2.0 ** (1 - bias)
    return sign * (1 + m / 2**m_bits) * 2.0 ** (e - bias)


@pytest.mark.parametrize(
    "fmt, eb, mb, bias", [(fpf.E4M3, 4, 3, 7), (fpf.E3M2, 3, 2, 3), (fpf.E2M1, 2, 1, 1)]
)
def test_every_code_decodes_to_its_value(fmt, eb, mb, bias):
    codes = torch.arange(0, 1 << fmt.bits, dtype=torch.uint8)
    got = fpf.decode(codes, fmt).tolist()
    for c, v in zip(range(1 << fmt.bits), got, strict=True):
        if fmt is fpf.E4M3 and (c & 0x7F) == 0x7F:
            assert math.isnan(v)  # e4m3fn: S.1111.111 is NaN
        else:
            assert v == _spec_value(c, eb, mb, bias), (fmt.name, c)
    # and encoding every representable value gives its code back (+-0 aside)
    vals = torch.tensor(got)
    back = fpf.encode(vals, fmt)
    finite = ~torch.isnan(vals) & (vals != 0)
    assert torch.equal(back[finite], codes[finite])


def test_e4m3_matches_torch_float8():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float()
    ours = fpf.decode(codes, fpf.E4M3)
    assert torch.equal(torch.isnan(ref), torch.isnan(ours))
    assert torch.equal(ref[~torch.isnan(ref)], ours[~torch.isnan(ours)])
    x = torch.randn(10000) * 100
    assert torch.equal(
        fpf.encode(x, fpf.E4M3), x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    )


def test_round_to_nearest_even_and_saturation():
    # E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: 2.5 ties between 2 (even code) and 3
    v = torch.tensor([2.5, 5.0, 0.25, 0.75, 100.0, -100.0, 1.2])
    got = fpf.decode(fpf.encode(v, fpf.E2M1), fpf.E2M1).tolist()
    assert got == [2.0, 4.0, 0.0, 1.0, 6.0, -6.0, 1.0]
    assert fpf.decode(fpf.encode(torch.tensor([29.0, 27.0]), fpf.E3M2), fpf.E3M2).tolist() == [
        28.0,
        28.0,
    ]


def test_pack6_roundtrip():
    for n in (0, 1, 3, 4, 5, 17):
        c = torch.randint(0, 64, (n,), dtype=torch.int64).to(torch.uint8)
        packed = pack_bits(c, 6)
        assert packed.numel() == (n * 6 + 7) // 8
        assert torch.equal(unpack_bits(packed, 6, n), c)


def test_scale_rounding():
    m = torch.tensor([0.0, 1.0, 1.5, 3.0, 1e-30, float("inf")])
    assert fpf.round_up_pow2(m).tolist() == [0.0, 1.0, 2.0, 4.0, 2.0**-99, float("inf")]
    r = fpf.round_up_bf16(torch.tensor([1.0 + 2**-20, 3.0])).float()
    assert r[0] > 1.0 and r[1] == 3.0


@pytest.mark.parametrize("codec", ["mxfp8", "mxfp6", "mxfp4"])
@pytest.mark.parametrize("scale", ["bf16", "e8m0"])
def test_zero_and_subnormal_blocks(codec, scale):
    x = torch.zeros(96)
    x[32:64] = 1e-40  # a block whose maximum is float32-subnormal
    x[64:96] = torch.randn(32)
    r = hopq.simulate([x, x.clone(), -x], hopq.get_codec(codec, scale=scale), "ring")
    out = r.outputs[0]
    assert torch.isfinite(out).all()
    assert torch.equal(out[:32], torch.zeros(32))
    assert r.identical


def test_accuracy_order_and_bits():
    xs = [torch.randn(32 * 1024) for _ in range(4)]
    res = {c: hopq.simulate(xs, c, "ring") for c in ("mxfp8", "mxfp6", "mxfp4")}
    assert res["mxfp8"].vnmse < res["mxfp6"].vnmse < res["mxfp4"].vnmse
    # elements plus the bfloat16 block maxima of the statistics exchange
    for c, bits in (("mxfp8", 8.5), ("mxfp6", 6.5), ("mxfp4", 4.5)):
        assert res[c].bits_per_coord == pytest.approx(bits, abs=0.05)


def test_mu_adapts_to_overflow():
    xs = [torch.randn(4096) for _ in range(4)]
    codec = hopq.get_codec("mxfp8", mu_init=0.25)  # scale below the block max: saturates
    hopq.simulate(xs, codec, "ring")
    assert codec.mu == 0.25
    hopq.simulate(xs, codec, "ring")  # sees last round's overflow ratio
    assert codec.last_overflow_ratio > 1e-5 and codec.mu == 0.5
    quiet = hopq.get_codec("mxfp8")  # mu = n: nothing saturates, mu shrinks slowly
    for _ in range(3):
        hopq.simulate(xs, quiet, "ring")
    assert quiet.last_overflow_ratio == 0.0
    assert quiet.mu == pytest.approx(4 * MXConfig().shrink ** 2)
    clone = hopq.get_codec("mxfp8")
    clone.load_state_dict(quiet.state_dict())
    assert clone.mu == quiet.mu and clone.round == quiet.round == 3


def test_invalid_config():
    with pytest.raises(ValueError, match="scale"):
        hopq.get_codec("mxfp8", scale="fp32")
    with pytest.raises(ValueError, match="mu_init"):
        hopq.get_codec("mxfp4", mu_init=0)
    for bad in (-0.1, 1.0):  # mu would double every round, or never
        with pytest.raises(ValueError, match="overflow_threshold"):
            hopq.get_codec("mxfp8", overflow_threshold=bad)
