"""EQuARX's Triton kernels against the PyTorch reference, bit for bit (DESIGN: the
reference is the specification): under TRITON_INTERPRET=1 on CPU (tests/conftest.py
sets it before the kernels are imported) and compiled on a GPU when there is
one. Encode, decode, decode-accumulate and the fused hop give the reference's
payload bytes and float bits (NaN payloads included) for every element format,
scale format, block geometry and awkward part size, with non-finite entries,
and write nothing outside their part nor anything at all under invalid scales."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import hopq
from hopq.codecs.base import HopContext, LocalStats
from hopq.codecs.equarx import EQuARX
from hopq.codecs.equarx import kernels_triton as triton_kernels
from hopq.errors import PayloadError

CTX = HopContext(0, 0, 0, 0, 0, 1)
CUDA = torch.cuda.is_available()
INTERPRET = triton_kernels.interpreting()

interpreted = pytest.mark.skipif(
    not triton_kernels.available() or not INTERPRET,
    reason="triton not installed or TRITON_INTERPRET unset (GPU tests below)",
)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's 0/0 in where()

#: (block, scales): single entries, a geometry that divides nothing, the paper's,
#: and blocks longer than a program's tile (two passes).
GEOMETRIES = [(1, 1), (3, 5), (64, 1024), (300, 16)]
#: Part sizes; the largest holds a full minishard of the paper's geometry.
SIZES = (1, 2, 63, 65, 1607, 70001)


def _hard_data(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Magnitudes over many binades, NaN, +-Inf, signed zeros, a zero block and
    values at the top of float32's range (as tests/test_equarx.py's)."""
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
    return x.to(device)


def _bits(t: torch.Tensor, canonical: bool) -> torch.Tensor:
    """float32 bit patterns; with ``canonical`` every NaN as one (a GPU's
    arithmetic gives its own NaN, as the reference's on that GPU does, but a
    copy keeps the payload: which operand's NaN a sum keeps is the hardware's)."""
    if t.dtype != torch.float32:
        return t
    if canonical:
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.contiguous().view(torch.int32)


def _guarded(t: torch.Tensor, pad: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    """(a view of ``t``'s values inside a larger buffer of sentinels, the buffer)."""
    fill = 0x5A if t.dtype == torch.uint8 else -7.25
    buf = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype, device=t.device)
    view = buf[pad : pad + t.numel()]
    view.copy_(t)
    return view, buf


def _untouched(buf: torch.Tensor, n: int, pad: int = 37) -> bool:
    fill = 0x5A if buf.dtype == torch.uint8 else -7.25
    return bool((buf[:pad] == fill).all() and (buf[pad + n :] == fill).all())


def _check_every_mode(ref, tri, n: int, seed: int, device: str = "cpu", canonical=False):
    """encode, decode, decode_accumulate and the fused hop: the kernels (writing
    into views inside guarded buffers) against the reference."""
    x, y = _hard_data(n, seed, device), _hard_data(n, seed + 50, device).flip(0)
    plan = ref.plan(x, LocalStats())
    p = ref.encode(plan, x.clone(), CTX)
    xv, xbuf = _guarded(x)
    q = tri.encode(plan, xv, CTX)
    assert torch.equal(q, p), f"encode differs (n {n})"
    assert torch.equal(xv, x) or torch.equal(_bits(xv, True), _bits(x, True)), "encode wrote x"
    assert _untouched(xbuf, n)
    pv, pbuf = _guarded(p)
    for name in ("decode", "decode_accumulate", "decode_accumulate_encode"):
        want = y.clone()
        if name == "decode":
            ref.decode(plan, p, CTX, want)
        elif name == "decode_accumulate":
            ref.decode_accumulate(plan, p, want, CTX)
        else:
            q_ref = ref.decode_accumulate_encode(plan, p, want, CTX)
        got, gbuf = _guarded(y)
        if name == "decode":
            tri.decode(plan, pv, CTX, got)
        elif name == "decode_accumulate":
            tri.decode_accumulate(plan, pv, got, CTX)
        else:
            q_tri = tri.decode_accumulate_encode(plan, pv, got, CTX)
            assert torch.equal(q_tri, q_ref), f"fused hop's payload differs (n {n})"
            # local "may be overwritten" with the sum: the reference writes it, the
            # kernels keep the sum in registers (blocks longer than a tile store it)
            if torch.equal(_bits(got, True), _bits(y, True)):
                want = y
        assert torch.equal(_bits(got, canonical), _bits(want, canonical)), f"{name} differs (n {n})"
        assert _untouched(gbuf, n), f"{name} wrote outside its part"
        assert _untouched(pbuf, p.numel()) and torch.equal(pv, p), f"{name} wrote its payload"


@interpreted
@pytest.mark.parametrize("element", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["strided", "contiguous"])
@pytest.mark.parametrize("scale", ["bf16", "fp32"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_kernels_match_reference_bit_for_bit(element, layout, scale, geometry):
    block, scales = geometry
    kw = dict(element=element, layout=layout, scale=scale, block=block)
    if layout == "strided":  # contiguous blocks have no tile
        kw["scales"] = scales
    ref, tri = EQuARX(backend="reference", **kw), EQuARX(backend="triton", **kw)
    assert tri.kernels(torch.device("cpu")) is triton_kernels
    for i, n in enumerate(SIZES):
        if n > 9001 and ref.config.minishard < 9001:
            n = 9001  # several minishards already (the interpreter is slow)
        _check_every_mode(ref, tri, n, i)


@interpreted
@pytest.mark.parametrize("tile", [256, 16384])
def test_other_tile_sizes_give_the_same_bits(monkeypatch, tile):
    """The program's tile is a speed setting: smaller (the paper's blocks in two
    passes, several short-segment programs) or larger, the same bits."""
    monkeypatch.setattr(triton_kernels, "TILE", tile)
    monkeypatch.setattr(triton_kernels, "WARPS", 8)
    for kw in (
        {"block": 16, "scales": 64},
        {"layout": "contiguous", "element": "e4m3", "block": 100},
        {"block": 3, "scales": 5, "scale": "fp32"},
    ):
        ref, tri = EQuARX(backend="reference", **kw), EQuARX(backend="triton", **kw)
        for i, n in enumerate((65, 3001)):
            _check_every_mode(ref, tri, n, i)


@interpreted
@pytest.mark.parametrize("element", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("scale", ["bf16", "fp32"])
def test_kernels_decode_any_valid_payload_like_the_reference(element, scale):
    """Random codes (every byte: int8's non-finite marker -128, FP8's NaN and Inf
    codes and subnormals) under zero, tiny, huge and unit-factor scales: the
    same floats, NaN bits included."""
    g = torch.Generator().manual_seed(3)
    kw = dict(element=element, scale=scale, block=8, scales=64)
    ref, tri = EQuARX(backend="reference", **kw), EQuARX(backend="triton", **kw)
    q = {"int8": 127.0, "e4m3": 448.0, "e5m2": 57344.0}[element]
    n = 3 * 512 + 99
    plan = ref.plan(torch.empty(n), LocalStats())
    ns, sb = ref.config.n_scales(n), 2 if scale == "bf16" else 4
    wire = torch.bfloat16 if scale == "bf16" else torch.float32
    p = torch.randint(0, 256, (ref.config.payload_nbytes(n),), dtype=torch.uint8, generator=g)
    sc = torch.rand(ns, generator=g) * 10
    sc[::3], sc[1], sc[2], sc[5] = 0.0, 3.38e38, 1e-40, q
    if scale == "fp32":
        sc[4] = 3.4028e38  # code 127 decodes past float32's range: clamped
    p[: ns * sb] = sc.to(wire).view(torch.uint8)
    for acc in (False, True):
        a = torch.randn(n, generator=g)
        b = a.clone()
        if acc:
            ref.decode_accumulate(plan, p, a, CTX)
            tri.decode_accumulate(plan, p, b, CTX)
        else:
            ref.decode(plan, p, CTX, a)
            tri.decode(plan, p, CTX, b)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@interpreted
def test_every_fp8_code_decodes_to_torchs_value():
    """The kernels compute FP8 values from the bits: each of the 256 codes of
    both formats gives torch's float32 value, NaN bits included."""
    for element, q in (("e4m3", 448.0), ("e5m2", 57344.0)):
        kw = dict(element=element, scale="fp32", layout="contiguous", block=256)
        ref, tri = EQuARX(backend="reference", **kw), EQuARX(backend="triton", **kw)
        p = torch.cat(
            [torch.tensor([q]).view(torch.uint8), torch.arange(256, dtype=torch.uint8)]
        )  # one block, scale Q: factor 1
        plan = ref.plan(torch.empty(256), LocalStats())
        a, b = torch.empty(256), torch.empty(256)
        ref.decode(plan, p, CTX, a)
        tri.decode(plan, p, CTX, b)
        dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
        want = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        assert torch.equal(b.view(torch.int32), want.view(torch.int32)), element
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), element


@interpreted
@pytest.mark.parametrize("element", ["int8", "e4m3", "e5m2"])
def test_fp8_and_int8_casts_round_like_torch_at_every_tie(element):
    """Entries at every code's value, every midpoint between neighbours (ties),
    one float32 ulp either side, both signs, subnormals included, in a block
    whose absmax is Q (fp32 scale: x / A * Q lands on or next to each of them):
    the kernels' codes are the reference's (torch's round and float8 casts)."""
    q = {"int8": 127.0, "e4m3": 448.0, "e5m2": 57344.0}[element]
    if element == "int8":
        pos = torch.arange(128, dtype=torch.float32)
    else:
        dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
        vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        pos = torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2
    pts = torch.cat([pos, mids])
    pts = torch.cat(
        [pts, torch.nextafter(pts, torch.tensor(0.0)), torch.nextafter(pts, torch.tensor(q))]
    )
    pts = pts[pts <= q]
    v = torch.cat([pts, -pts, torch.tensor([q])])  # the block's absmax is Q: factor 1
    kw = dict(element=element, scale="fp32", layout="contiguous", block=v.numel())
    ref, tri = EQuARX(backend="reference", **kw), EQuARX(backend="triton", **kw)
    plan = ref.plan(v, LocalStats())
    assert torch.equal(tri.encode(plan, v.clone(), CTX), ref.encode(plan, v.clone(), CTX))


@interpreted
def test_invalid_scales_raise_and_write_nothing():
    codec = EQuARX(backend="triton", block=8, scales=4)
    x = torch.randn(100)
    plan = codec.plan(x, LocalStats())
    good = codec.encode(plan, x.clone(), CTX)
    for v in (math.nan, math.inf, -1.0, -0.0):
        for scale in (3, 12):  # a full minishard's, the short last one's
            p = good.clone()
            p[2 * scale : 2 * scale + 2] = torch.tensor([v], dtype=torch.bfloat16).view(torch.uint8)
            y = torch.ones(100)
            for method, args in (
                (codec.decode, (plan, p, CTX, y)),
                (codec.decode_accumulate, (plan, p, y, CTX)),
                (codec.decode_accumulate_encode, (plan, p, y, CTX)),
            ):
                with pytest.raises(PayloadError, match="scale"):
                    method(*args)
                assert torch.equal(y, torch.ones(100))


@interpreted
def test_warm_up_runs_every_mode_once():
    codec = EQuARX(backend="triton", block=8, scales=64, element="e5m2")
    assert codec.warm_up(torch.device("cpu")) is None  # CPU: nothing to compile
    triton_kernels.warm_up(codec, torch.device("cpu"))  # what it runs on CUDA
    assert (codec.config, "cpu") in triton_kernels._warmed


@interpreted
@pytest.mark.parametrize("topology", ["ring", "semiloop", "butterfly"])
def test_simulation_with_triton_equals_reference(topology):
    xs = [_hard_data(6001, s) for s in range(4)]
    for kw in (
        {},
        {"layout": "contiguous", "scale": "fp32", "element": "e5m2"},
        {"element": "e4m3", "block": 8, "scales": 64},
    ):
        ref = hopq.simulate(xs, EQuARX(backend="reference", **kw), topology, microshards=3)
        got = hopq.simulate(xs, EQuARX(backend="triton", **kw), topology, microshards=3)
        assert got.identical
        assert torch.equal(ref.outputs[0].view(torch.int32), got.outputs[0].view(torch.int32))


def test_backend_option_and_selection(monkeypatch):
    from hopq.codecs.equarx import kernels_cpu

    cpu = torch.device("cpu")
    if kernels_cpu.available():
        assert EQuARX().kernels(cpu) is kernels_cpu  # auto on CPU: numba, never the interpreter
    assert EQuARX(backend="reference").kernels(cpu) is None
    with pytest.raises(ValueError, match="backend must be one of"):
        EQuARX(backend="cuda")
    with pytest.raises(ValueError, match="no TRITON kernel"):
        EQuARX(scale="none", element="e4m3", backend="triton")
    assert hopq.get_codec("equarx", backend="triton").config.backend.value == "triton"
    if triton_kernels.available():
        from hopq.codecs.equarx import codec as equarx_codec

        monkeypatch.setenv("TRITON_INTERPRET", "0")
        equarx_codec._resolve.cache_clear()
        try:
            with pytest.raises(ValueError, match="CUDA tensors"):
                EQuARX(backend="triton").kernels(cpu)
        finally:
            equarx_codec._resolve.cache_clear()


@pytest.mark.skipif(not triton_kernels.available(), reason="triton not installed")
def test_triton_kernels_compile_for_cuda_without_a_gpu():
    """The interpreter runs the kernels' Python as is; the compiler is stricter
    (constexpr globals, types, layouts). Every variant must compile for sm_90
    with correctly rounded divisions, no fused multiply-add and nothing
    ptxas could contract."""
    code = "from hopq.codecs.equarx import kernels_triton as k; print(len(k.compile_all(90)))"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "42"


@pytest.mark.skipif(not triton_kernels.available(), reason="triton not installed")
def test_only_the_fused_hop_takes_the_register_cap(monkeypatch):
    """The cap applies to the fused hop alone (the other modes keep ptxas's
    choice), and a Triton without the option launches every mode without it."""
    from hopq.kernels import Mode, register_caps

    if not register_caps():
        pytest.skip("this Triton takes no register cap")
    cap = triton_kernels.HOP_MAXNREG
    assert triton_kernels._hop_options(Mode.DAR, 4) == {"num_warps": 4, "maxnreg": cap}
    for mode in (Mode.ENCODE, Mode.DECODE, Mode.DECODE_ACC):
        assert triton_kernels._hop_options(mode, 4) == {"num_warps": 4}
    monkeypatch.setattr(triton_kernels, "register_caps", lambda: False)
    assert triton_kernels._hop_options(Mode.DAR, 4) == {"num_warps": 4}


# -- on a GPU: compiled kernels on CUDA tensors -----------------------------------------
gpu = pytest.mark.skipif(
    not CUDA or INTERPRET or not triton_kernels.available(),
    reason="needs a CUDA GPU with triton and TRITON_INTERPRET=0",
)


@gpu
@pytest.mark.parametrize(
    "element, layout, scale",
    [(e, "strided", s) for e in ("int8", "e4m3", "e5m2") for s in ("bf16", "fp32")]
    + [("e4m3", "contiguous", "bf16")],
)
def test_gpu_kernels_match_reference(element, layout, scale):
    """Each compiled variant a default run takes (every element and scale format,
    both layouts), a few million entries, against the reference on the GPU."""
    kw = dict(element=element, layout=layout, scale=scale)
    ref, tri = EQuARX(backend="reference", **kw), EQuARX(**kw)  # auto: triton on CUDA
    assert tri.kernels(torch.device("cuda")) is triton_kernels
    tri.warm_up(torch.device("cuda"))  # what the engine calls before a call's timeout
    assert (tri.config, "cuda") in triton_kernels._warmed or (tri.config, "cuda:0") in (
        triton_kernels._warmed
    )
    for i, n in enumerate((1, 65, 70001, 3_000_017)):
        _check_every_mode(ref, tri, n, i, device="cuda", canonical=True)


@gpu
@pytest.mark.parametrize(
    "geometry, kw",
    [((3, 5), {"scale": "fp32"}), ((300, 16), {"element": "e5m2"})],
)
def test_gpu_odd_geometries_match_reference(geometry, kw):
    """Several segments per program, and blocks longer than a tile (two passes)."""
    block, scales = geometry
    ref = EQuARX(backend="reference", block=block, scales=scales, **kw)
    tri = EQuARX(backend="triton", block=block, scales=scales, **kw)
    for i, n in enumerate((1607, 1_000_003)):
        _check_every_mode(ref, tri, n, i, device="cuda", canonical=True)


@gpu
def test_gpu_simulation_matches_reference():
    xs = [_hard_data(3_000_000, r, device="cuda") for r in range(4)]
    for kw in ({}, {"element": "e4m3", "layout": "contiguous"}):
        a = hopq.simulate(xs, EQuARX(backend="reference", **kw), "ring", seed=1).outputs
        b = hopq.simulate(xs, EQuARX(backend="triton", **kw), "ring", seed=1).outputs
        mism = sum(
            int((_bits(ya, True) != _bits(yb, True)).sum()) for ya, yb in zip(a, b, strict=True)
        )
        assert mism == 0, f"{mism} of {4 * 3_000_000} coordinates differ ({kw})"


def test_bench_kernels_times_equarx_on_cpu(capsys):
    """`hopq bench kernels --codecs equarx` end to end on CPU at a toy size: the
    copy and bf16 rows, EQuARX's four kernels (its payload's 8.25 bits), no
    DynamiQ rows; options that would do nothing are refused."""
    from hopq.bench.kernels import KernelOptions
    from hopq.cli import main

    argv = ["bench", "kernels", "--device", "cpu", "--codecs", "equarx", "--sizes", "4096"]
    assert main([*argv, "--repeats", "1", "--plot", ""]) == 0
    text = capsys.readouterr().out
    for name in ("copy (ceiling)", "bf16 hop", "equarx compress", "equarx decompress |"):
        assert name in text, name
    assert "equarx decompress_accumulate_recompress" in text and "| 8.25 |" in text
    assert "stats pre-pass" not in text and "| compress " not in text
    assert "Codec kernels (CPU, one core; backends: equarx " in text
    with pytest.raises(ValueError, match="codecs must be among"):
        KernelOptions(codecs=("thc",))
    with pytest.raises(ValueError, match="--widths only acts with --codecs dynamiq"):
        KernelOptions(codecs=("equarx",), widths=(2,))
