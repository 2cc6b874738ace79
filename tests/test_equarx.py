"""EQuARX: the codec's geometry and error bound, the semi-loop and bidirectional
rings, and stage choice (a compressed reduce-scatter, all-gather, or both) for
every codec, in the simulator and in real Gloo runs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import hopq
from hopq.codecs.base import HopContext, LocalStats
from hopq.codecs.equarx import EQuARX, EQuARXConfig
from hopq.comm.topology import Phase, get_schedule
from hopq.errors import PayloadError

CTX = HopContext(0, 0, 0, 0, 0, 1)


def _inputs(n: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


def _roundtrip(codec: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One encode/decode of ``x`` as a single part: (decoded, payload)."""
    plan = codec.plan(x, LocalStats())
    payload = codec.encode(plan, x.clone(), CTX)
    out = torch.empty_like(x)
    codec.decode(plan, payload, CTX, out)
    return out, payload


def _block_ids(cfg: EQuARXConfig, n: int) -> torch.Tensor:
    """Block (scale index) of every entry, written from the docstring's geometry
    with plain loops: minishards of scales * block entries; in one of r entries,
    s = min(scales, ceil(r / block)) scales, entry i -> scale i mod s (strided);
    contiguous: entry i -> block i // block."""
    if cfg.layout.value == "contiguous":
        return torch.arange(n) // cfg.block
    ids, base, start = [], 0, 0
    M = cfg.scales * cfg.block
    while start < n:
        r = min(M, n - start)
        s = min(cfg.scales, math.ceil(r / cfg.block))
        ids += [base + i % s for i in range(r)]
        base += s
        start += r
    return torch.tensor(ids, dtype=torch.long)


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
@pytest.mark.parametrize("scale", ["bf16", "fp32"])
@pytest.mark.parametrize("n", [0, 1, 5, 63, 64, 65, 640, 1000, 1700])
def test_geometry_scales_and_per_hop_bound(layout, scale, n):
    """The payload's scales are the blocks' absmax (bf16: rounded up, never below
    it), each entry is within A/254 of its value, and the byte count is
    entries + scales x scale bytes."""
    tile = {"scales": 16} if layout == "strided" else {}  # minishard 64
    cfg = EQuARXConfig(layout=layout, scale=scale, block=4, **tile)
    codec = EQuARX(cfg)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 10.0 ** (n % 7 - 3)
    if n > 3:
        x[3] = 0.0
    out, payload = _roundtrip(codec, x)
    ids = _block_ids(cfg, n)
    nb = int(ids.max()) + 1 if n else 0
    sb = 2 if scale == "bf16" else 4
    assert payload.numel() == n + nb * sb
    wire = payload[: nb * sb].clone().view(torch.bfloat16 if scale == "bf16" else torch.float32)
    amax = torch.zeros(nb).scatter_reduce(0, ids, x.abs(), "amax") if n else torch.zeros(0)
    scale_a = wire.float()
    if scale == "bf16":
        assert (scale_a >= amax).all() and (scale_a <= amax * (1 + 2**-7)).all()
    else:
        assert torch.equal(scale_a, amax)
    err = (out - x).abs()
    assert (err <= scale_a[ids] / 254 * (1 + 2**-20)).all()
    # ties to even, codes symmetric: |code| <= 127, and the block's max reaches 127
    codes = payload[nb * sb :].view(torch.int8).long()
    assert codes.abs().max().item() <= 127 if n else True
    if scale == "fp32" and n:
        top = torch.zeros(nb, dtype=torch.long).scatter_reduce(0, ids, codes.abs(), "amax")
        assert (top[amax > 0] == 127).all()


def test_strided_and_contiguous_differ_and_both_roundtrip():
    """The same data through both layouts: different payloads (the blocks differ),
    both within their bound; a spike hurts only its own block's entries, which are
    strided in one layout and a run in the other."""
    x = torch.randn(64 * 16, generator=torch.Generator().manual_seed(1))
    x[100] = 1000.0
    outs = {}
    for layout in ("strided", "contiguous"):
        tile = {"scales": 64} if layout == "strided" else {}  # one minishard
        cfg = EQuARXConfig(layout=layout, block=16, **tile)
        out, _ = _roundtrip(EQuARX(cfg), x)
        outs[layout] = out
        coarse = (out - x).abs() > 1e-1  # entries quantized with the spike's step
        hit = torch.nonzero(coarse).flatten()
        if layout == "strided":
            assert ((hit % 64) == 100 % 64).all()  # scale 36 of every tile
        else:
            assert ((hit // 16) == 100 // 16).all()  # the run 96..111
    assert not torch.equal(outs["strided"], outs["contiguous"])


def test_zero_nonfinite_and_huge_blocks():
    codec = hopq.get_codec("equarx", block=8, scales=4)
    x = torch.zeros(100)
    out, payload = _roundtrip(codec, x)
    assert torch.equal(out, x) and payload[:26].eq(0).all()  # 13 scales of 0
    x = torch.randn(100)
    x[5], x[50] = float("inf"), float("nan")
    out, _ = _roundtrip(codec, x)
    assert torch.isnan(out[5]) and torch.isnan(out[50])
    mask = torch.ones(100, dtype=torch.bool)
    mask[[5, 50]] = False
    assert torch.isfinite(out[mask]).all()
    assert ((out - x)[mask].abs() < 0.1).all()  # scales come from the finite entries
    for el in ("e4m3", "e5m2"):
        out, _ = _roundtrip(hopq.get_codec("equarx", element=el, block=8, scales=4), x)
        assert not torch.isfinite(out[5]) and torch.isnan(out[50])
        assert torch.isfinite(out[mask]).all()
    out, _ = _roundtrip(hopq.get_codec("equarx", element="e5m2", block=8, scales=4), x)
    assert out[5] == float("inf")  # E5M2 keeps Inf itself
    big = torch.full((10,), 3.4e38)
    big[1] = -3.4028e38
    for scale in ("bf16", "fp32"):
        out, _ = _roundtrip(hopq.get_codec("equarx", scale=scale), big)
        assert torch.isfinite(out).all()


def test_payload_validation():
    codec = hopq.get_codec("equarx", block=8, scales=4)
    x = torch.randn(100)
    plan = codec.plan(x, LocalStats())
    good = codec.encode(plan, x.clone(), CTX)
    out = torch.empty(100)
    for bad in (good[:-1], torch.cat([good, good[:1]]), good.to(torch.int16)):
        with pytest.raises(PayloadError):
            codec.decode(plan, bad, CTX, out)
    for b in (0x7F, 0xFF):  # a scale's high byte: NaN or a negative number
        p = good.clone()
        p[1] = b
        p[0] = 0xC0
        with pytest.raises(PayloadError, match="scale"):
            codec.decode(plan, p, CTX, out)


def test_bad_configs():
    with pytest.raises(ValueError, match="naive"):
        hopq.get_codec("equarx", scale="none")
    with pytest.raises(ValueError):
        hopq.get_codec("equarx", block=0)
    with pytest.raises(ValueError):
        hopq.get_codec("equarx", layout="diagonal")
    # contiguous blocks have no tile: a scales setting would be ignored
    with pytest.raises(ValueError, match="would ignore it"):
        hopq.get_codec("equarx", layout="contiguous", scales=16)
    # the naive cast has no kernel: backend="cpu" would silently run the reference
    with pytest.raises(ValueError, match="no CPU kernel"):
        hopq.get_codec("equarx", scale="none", element="e5m2", backend="cpu")
    assert (
        hopq.get_codec("equarx", scale="none", element="e5m2").kernels(torch.device("cpu")) is None
    )


@pytest.mark.parametrize("topology", ["ring", "semiloop", "biring", "butterfly"])
def test_bits_per_coordinate_from_bytes(topology):
    """8 + scale bits / block, counted from the bytes the ranks sent, when every
    part is whole minishards (and 8 exactly for the naive cast)."""
    n, d = 4, 4 * 2 * 1024 * 8  # biring's half chunks are whole minishards too
    xs = _inputs(n, d)
    want = {
        (("block", 8),): 8 + 16 / 8,
        (("block", 8), ("scale", "fp32")): 8 + 32 / 8,
        (("block", 16), ("layout", "contiguous")): 8 + 16 / 16,
        (("element", "e5m2"), ("scale", "none")): 8.0,
    }
    for cfg, bits in want.items():
        r = hopq.simulate(xs, hopq.get_codec("equarx", **dict(cfg)), topology)
        assert r.identical
        assert r.bits_per_coord == pytest.approx(bits, rel=1e-12), cfg


@pytest.mark.parametrize("topology", ["ring", "semiloop", "biring"])
def test_error_within_bound_every_format(topology):
    """The codec's documented bound holds end to end for int8 and both FP8
    formats (bf16 and fp32 scales), on 5 and 8 ranks."""
    for n in (5, 8):
        xs = _inputs(n, 5000, seed=n)
        exact = torch.stack([x.double() for x in xs]).sum(0)
        mag = torch.stack([x.double().abs() for x in xs]).sum(0)
        for el in ("int8", "e4m3", "e5m2"):
            for scale in ("bf16", "fp32"):
                c = hopq.get_codec("equarx", element=el, scale=scale, block=16, scales=32)
                r = hopq.simulate(xs, c, topology)
                assert r.identical
                bound = c.error_bound(mag, r.hops_per_chunk)
                assert ((r.outputs[0].double() - exact).abs() <= bound).all(), (n, el, scale)


def test_microshards_cut_at_minishards():
    """Microshards of a schedule chunk start at minishard boundaries, so the bits
    do not depend on their number (the contract grid's sizes are below one
    default minishard; here the minishard is 64 entries)."""
    c = hopq.get_codec("equarx", block=4, scales=16)
    for topology in ("ring", "semiloop"):
        xs = _inputs(3, 6007, seed=2)
        ref = hopq.simulate(xs, c, topology, microshards=1, pipeline=False).outputs[0]
        for u in (2, 5):
            r = hopq.simulate(xs, c, topology, microshards=u)
            assert torch.equal(ref.view(torch.int32), r.outputs[0].view(torch.int32))
    plan = c.plan(torch.zeros(6007), LocalStats(n_chunks=3, microshards=5))
    starts = [s for s, _ in plan.chunks]
    chunk_starts = [plan.chunks[5 * k][0] for k in range(3)]
    for k in range(3):
        for s in starts[5 * k : 5 * k + 5]:
            assert (s - chunk_starts[k]) % 64 == 0


# -- schedules ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 17))
def test_semiloop_structure(n):
    """n // 2 reduce steps, both directions in use (one direction at n = 2), each
    rank sends at most one message per direction and step, and the longest adder
    chain is n // 2 + 1 compressions (the ring's is n)."""
    s = get_schedule("semiloop", n)
    reduce = [st for st in s.steps if st[0].phase is Phase.REDUCE]
    gather = [st for st in s.steps if st[0].phase is Phase.GATHER]
    assert len(reduce) == len(gather) == n // 2
    assert max(s.compression_chains()) == n // 2 + 1
    for st in s.steps:
        for r in range(n):
            dsts = [t.dst for t in st if t.src == r]
            assert len(dsts) == len(set(dsts)) <= 2
            assert all((d - r) % n in (1, n - 1) for d in dsts)  # neighbours only
            assert all(len(t.chunks) == 1 for t in st)
    if n >= 3:
        assert all({(t.dst - t.src) % n for t in reduce[0]} == {1, n - 1} for _ in [0])
    # every chunk's final sum is the sink's own plus two chains: the backward one
    # of n // 2 ranks and the forward one of (n - 1) // 2 (the paper: A0 + A3 + (A1 + A2))
    depths = s.encoder_depths()
    for c in range(n):
        assert depths[c][c] == n // 2
    if n == 4:
        assert [(t.src, t.dst) for st in reduce for t in st if 0 in t.chunks] == [
            (2, 1),
            (3, 0),
            (1, 0),
        ]


@pytest.mark.parametrize("n", range(1, 17))
def test_biring_structure(n):
    """Two counter-rotating rings, each carrying half: every rank sends one chunk
    (1/(2n) of the vector) per direction and step, 2(n - 1) steps, chain n."""
    s = get_schedule("biring", n)
    assert s.n_chunks == 2 * n and len(s.steps) == 2 * (n - 1)
    assert max(s.compression_chains(), default=1) == n
    assert s.owner == tuple(c // 2 for c in range(2 * n))
    for st in s.steps:
        for r in range(n):
            sent = [c for t in st if t.src == r for c in t.chunks]
            assert sorted(c % 2 for c in sent) == [0, 1]


def test_semiloop_odd_n_sums_both_chains_exactly():
    """Odd n: both chains reach the sink in the last reduce step; the engine adds
    both (small integers: fp32 is exact, so any lost or doubled contribution shows)."""
    for n in (3, 5, 7):
        xs = [torch.randint(-8, 9, (1001,), generator=torch.Generator().manual_seed(r)).float() for r in range(n)]  # fmt: skip
        r = hopq.simulate(xs, "fp32", "semiloop")
        assert r.identical and torch.equal(r.outputs[0], sum(xs))


def test_semiloop_fewer_hops_lower_error():
    """The balanced adder chain requantizes fewer times: lower error than the
    full-loop ring at n = 8 (the paper's direction)."""
    xs = _inputs(8, 1 << 15, seed=3)
    ring = hopq.simulate(xs, "equarx", "ring")
    semi = hopq.simulate(xs, "equarx", "semiloop")
    assert semi.hops_per_chunk == 5 and ring.hops_per_chunk == 8
    assert semi.vnmse < ring.vnmse


# -- stages --------------------------------------------------------------------------------


def test_stage_choice_every_codec():
    """Any codec's reduce-scatter with an uncompressed all-gather (bf16, fp32), and
    an uncompressed reduce-scatter with a compressed all-gather from every codec
    that can code one: identical ranks, and the compressed-AG-only error is below
    the compressed-both error."""
    xs = _inputs(3, 3001, seed=7)
    for codec in hopq.available_codecs():
        for topology in ("ring", "semiloop"):
            for g in ("fp32", "bf16"):
                r = hopq.simulate(xs, codec, topology, gather_codec=g)
                assert r.identical, (codec, topology, g)
            if hopq.get_codec(codec).gather_stage:
                ag = hopq.simulate(xs, "fp32", topology, gather_codec=codec)
                both = hopq.simulate(xs, codec, topology)
                assert ag.identical
                assert ag.vnmse <= both.vnmse, (codec, topology)


def test_equarx_stage_errors_order():
    """RS + AG quantized has the most error; each stage alone has less; bits per
    coordinate: ~8.25 for both, ~(8.25 + 32) / 2 with one fp32 stage."""
    xs = _inputs(8, 1 << 15, seed=4)
    both = hopq.simulate(xs, "equarx", "ring")
    rs = hopq.simulate(xs, "equarx", "ring", gather_codec="fp32")
    ag = hopq.simulate(xs, "fp32", "ring", gather_codec="equarx")
    assert both.vnmse > rs.vnmse > ag.vnmse > 0
    assert rs.bits_per_coord == pytest.approx(ag.bits_per_coord)
    assert rs.bits_per_coord == pytest.approx((8.25 + 32) / 2, rel=2e-3)


def _stages_worker(rank: int, n: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for topology in ("ring", "semiloop", "biring"):
        for codec, g in (("equarx", "fp32"), ("fp32", "equarx"), ("equarx", None), ("mxfp8", "bf16")):  # fmt: skip
            for size in (1, 7, 30011):
                x = _inputs(n, size, seed=size)[rank]
                info = hopq.all_reduce(x, codec, topology, seed=2, gather_codec=g)
                out[(topology, codec, g, size)] = (x, info.bytes_sent)
    return out


def test_stages_real_run_equals_simulator():
    """Compressed RS + fp32 AG and fp32 RS + compressed AG in real Gloo runs: every
    rank bit-identical, and equal to the simulator, bytes included."""
    from hopq.cluster.launch import run_workers

    n = 3
    res = run_workers(n, _stages_worker)
    for key, (x, _) in res[0].items():
        topology, codec, g, size = key
        for r in range(1, n):
            assert torch.equal(res[r][key][0].view(torch.int32), x.view(torch.int32)), key
        sim = hopq.simulate(_inputs(n, size, seed=size), codec, topology, seed=2, gather_codec=g)
        assert torch.equal(sim.outputs[0].view(torch.int32), x.view(torch.int32)), key
        assert sim.bytes_sent == [res[r][key][1] for r in range(n)], key


# -- the numba kernel ---------------------------------------------------------------------
def _kernel_or_skip() -> None:
    from hopq.codecs.equarx import kernels_cpu as equarx_cpu

    if not equarx_cpu.available():
        pytest.skip("numba not installed")  # the torch-only environment


def _hard_data(n: int, seed: int) -> torch.Tensor:
    """Magnitudes over many binades, NaN, +-Inf, signed zeros, a zero block and
    values at the top of float32's range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 6
    for i, v in zip(
        (3, 7, 11, 13, 41, 42),
        (math.nan, math.inf, -math.inf, -0.0, 3.3e38, -3.4028e38),
        strict=True,
    ):
        if i < n:
            x[i] = v
    x[20:90] = 0.0
    return x


@pytest.mark.parametrize("element", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["strided", "contiguous"])
@pytest.mark.parametrize("scale", ["bf16", "fp32"])
@pytest.mark.parametrize("geometry", [(1, 1), (3, 5), (64, 1024)])
def test_cpu_kernel_matches_reference_bit_for_bit(element, layout, scale, geometry):
    """Encode, decode, decode-accumulate and the fused hop of the numba kernel give
    the reference's bytes and floats, for every element format, geometry and
    awkward part size."""
    _kernel_or_skip()
    block, scales = geometry
    kw = dict(element=element, layout=layout, scale=scale, block=block)
    if layout == "strided":  # contiguous blocks have no tile
        kw["scales"] = scales
    ref, cpu = EQuARX(backend="reference", **kw), EQuARX(backend="cpu", **kw)
    assert cpu.kernels(torch.device("cpu")) is not None
    for i, n in enumerate((1, 2, 63, 65, 1607, 70001)):
        x, y = _hard_data(n, i), _hard_data(n, i + 50).flip(0)
        plan = ref.plan(x, LocalStats())
        p = ref.encode(plan, x.clone(), CTX)
        assert torch.equal(cpu.encode(plan, x.clone(), CTX), p)
        got = []
        for c in (ref, cpu):
            out, acc, loc = torch.empty(n), y.clone(), y.clone()
            c.decode(plan, p, CTX, out)
            c.decode_accumulate(plan, p, acc, CTX)
            q = c.decode_accumulate_encode(plan, p, loc, CTX)
            got.append((out.view(torch.int32), acc.view(torch.int32), loc.view(torch.int32), q))
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b), (n, kw)


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_cpu_kernel_fp8_cast_is_torchs_at_every_tie(element):
    """The kernel's FP8 cast against torch's on every code's value, every midpoint
    between neighbouring codes (ties to even), one float32 ulp either side of
    each, in both signs, subnormals included."""
    _kernel_or_skip()
    import numpy as np

    from hopq.codecs.equarx import _kernels_cpu_jit as jit
    from hopq.codecs.equarx.codec import _ELEMENT_DTYPE, _QMAX, Element
    from hopq.codecs.equarx.kernels_cpu import CODES

    dtype, q = _ELEMENT_DTYPE[Element(element)], _QMAX[Element(element)]
    el = CODES[dtype]
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    pos = torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2  # exact in float32
    pts = torch.cat([pos, mids])
    pts = torch.cat(
        [pts, torch.nextafter(pts, torch.tensor(0.0)), torch.nextafter(pts, torch.tensor(q))]
    )
    pts = pts[pts <= q]
    v = torch.cat([pts, -pts])
    want = v.to(dtype).view(torch.uint8)
    vb = v.view(torch.int32).numpy()
    got = [
        jit._fp8(np.float32(a), np.int32(b), np.int32(b), el) & 0xFF
        for a, b in zip(v.numpy(), vb, strict=True)
    ]
    assert torch.equal(torch.tensor(got, dtype=torch.uint8), want)


@pytest.mark.parametrize("element", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("scale", ["bf16", "fp32"])
def test_cpu_kernel_decodes_any_valid_payload_like_the_reference(element, scale):
    """Random codes (every byte: int8's non-finite marker -128, FP8's NaN and Inf
    codes and subnormals) under zero, tiny and huge scales: the same floats."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    kw = dict(element=element, scale=scale)
    ref, cpu = EQuARX(backend="reference", **kw), EQuARX(backend="cpu", **kw)
    n = 3 * 65536 + 999
    plan = ref.plan(torch.empty(n), LocalStats())
    ns, sb = ref.config.n_scales(n), 2 if scale == "bf16" else 4
    p = torch.randint(0, 256, (ref.config.payload_nbytes(n),), dtype=torch.uint8, generator=g)
    sc = torch.rand(ns, generator=g) * 10
    sc[::3], sc[1], sc[2] = 0.0, 3.38e38, 1e-40
    if scale == "fp32":
        sc[4] = 3.4028e38  # code 127 decodes past float32's range: clamped
    p[: ns * sb] = sc.to(torch.bfloat16 if scale == "bf16" else torch.float32).view(torch.uint8)
    a, b = torch.empty(n), torch.empty(n)
    ref.decode(plan, p, CTX, a)
    cpu.decode(plan, p, CTX, b)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    acc_a, acc_b = torch.randn(n, generator=g), None
    acc_b = acc_a.clone()
    ref.decode_accumulate(plan, p, acc_a, CTX)
    cpu.decode_accumulate(plan, p, acc_b, CTX)
    assert torch.equal(acc_a.view(torch.int32), acc_b.view(torch.int32))


def test_cpu_kernel_rejects_bad_scales_before_writing():
    _kernel_or_skip()
    codec = EQuARX(backend="cpu", block=8, scales=4)
    x = torch.randn(100)
    plan = codec.plan(x, LocalStats())
    good = codec.encode(plan, x.clone(), CTX)
    for v in (math.nan, math.inf, -1.0, -0.0):
        p = good.clone()
        p[6:8] = torch.tensor([v], dtype=torch.bfloat16).view(torch.uint8)  # scale 3
        y = torch.ones(100)
        for method, args in (
            (codec.decode, (plan, p, CTX, y)),
            (codec.decode_accumulate, (plan, p, y, CTX)),
            (codec.decode_accumulate_encode, (plan, p, y, CTX)),
        ):
            with pytest.raises(PayloadError, match="scale"):
                method(*args)
            assert torch.equal(y, torch.ones(100))


@pytest.mark.parametrize("topology", ["ring", "semiloop", "butterfly"])
def test_simulation_with_kernel_equals_reference(topology):
    _kernel_or_skip()
    xs = [_hard_data(70001, s) for s in range(5)]
    for kw in (
        {},
        {"layout": "contiguous", "scale": "fp32"},
        {"element": "e4m3"},
        {"element": "e5m2"},
    ):
        ref = hopq.simulate(xs, EQuARX(backend="reference", **kw), topology, microshards=3)
        got = hopq.simulate(xs, EQuARX(backend="cpu", **kw), topology, microshards=3)
        assert got.identical
        assert torch.equal(ref.outputs[0].view(torch.int32), got.outputs[0].view(torch.int32))


def test_bench_equarx_reports_every_part():
    """`hopq bench equarx` end to end at toy sizes: Fig. 7's error table, Fig. 6's
    timing against bf16 (2 Gloo ranks) and the kernels against the reference."""
    _kernel_or_skip()
    from hopq.bench.equarx import EquarxOptions, run, timed_methods

    o = EquarxOptions(
        parts=("error", "timing", "kernels"), world_size=2, size=64, block=8,
        min_bytes=4096, max_bytes=4096, budget_s=0.01, kernel_coords=5000, repeats=1,
    )  # fmt: skip
    report = run(o)
    for section in ("## Error", "## Time relative to bf16", "## Kernels"):
        assert section in report
    # the timing part runs EQuARX at the block asked for (it used the default)
    assert "EQuARX's block 8" in report.split("## Time relative to bf16")[1]
    assert [dict(m.config).get("block") for m in timed_methods(8)] == [None, 8, 8, 8, 8, 8, None]
    rows = [r for r in report.split("## Kernels")[1].splitlines() if "|    fused hop" in r]
    assert len(rows) == 6  # int8, E4M3, E5M2, each strided and contiguous
    for r in rows:
        assert float(r.split("|")[-2].strip().rstrip("x")) > 0
    with pytest.raises(ValueError):
        EquarxOptions(kernel_coords=0)
