"""MXFP8/6/4's Triton kernels against the PyTorch reference, bit for bit: encode
(with its saturation count), decode, decode-accumulate and the fused hop, for the
three formats, both scale formats, several block sizes, awkward values (ties,
float32 subnormals, +-0, beyond FMAX, NaN, Inf), awkward scales (0, Inf, NaN,
near float32's limit), arbitrary payload bytes (E4M3's NaN code), partial tiles
and partial blocks; under TRITON_INTERPRET=1 on CPU (tests/conftest.py sets it
before anything imports triton), compiled for sm_90 without a GPU, and compiled
on a GPU when there is one (``TRITON_INTERPRET=0``)."""

import os
import subprocess
import sys

import pytest
import torch

import hopq
from hopq.codecs.base import HopContext, LocalStats
from hopq.codecs.mx import MXCodec
from hopq.codecs.mx import kernels_triton as mx_triton
from hopq.numerics import fp_formats as fpf

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: 0/0 in where()

CUDA = torch.cuda.is_available()
INTERPRET = mx_triton.interpreting()
FORMATS = ("mxfp8", "mxfp6", "mxfp4")

interpreter = pytest.mark.skipif(
    not mx_triton.available() or not INTERPRET,
    reason="triton not installed or TRITON_INTERPRET unset (GPU tests below)",
)
gpu = pytest.mark.skipif(
    not CUDA or INTERPRET or not mx_triton.available(),
    reason="needs a CUDA GPU with triton and TRITON_INTERPRET=0",
)


def _nasty(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    k = n // 8
    idx = torch.randperm(n, generator=g)[:k]
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-40, 2.5, -5.0, 0.25, 0.75, 3.4e38, -3.4e38, 1e30, 7.0]
    )
    x[idx] = specials[torch.randint(0, specials.numel(), (k,), generator=g)]
    return x.to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns, every NaN as the canonical one (which NaN an
    operation returns is the device's choice, not the codec's)."""
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.contiguous().view(torch.int32)


def _pair(name: str, **kw):
    return (
        hopq.get_codec(name, backend="triton", **kw),
        hopq.get_codec(name, backend="reference", **kw),
    )


def _check_chunk(kern, ref, plans, c, x, y, payload=None):
    """Every mode on chunk c, kernels vs reference: encode (and its saturation
    count), decode and decode-accumulate of the reference's payload (or the
    given one), and the fused hop on y."""
    ctx = HopContext(0, 0, c, 1, 0, 2)
    p = [cd.encode(pl, x, ctx) for cd, pl in zip((kern, ref), plans, strict=True)]
    assert torch.equal(p[0], p[1]), "encode differs"
    assert kern._overflow_total() == ref.overflow, "saturation count differs"
    q = p[1] if payload is None else payload
    outs = [torch.empty_like(x), torch.empty_like(x)]
    for cd, pl, o in zip((kern, ref), plans, outs, strict=True):
        cd.decode(pl, q, ctx, o)
    assert torch.equal(_bits(outs[0]), _bits(outs[1])), "decode differs"
    accs = [y.clone(), y.clone()]
    for cd, pl, a in zip((kern, ref), plans, accs, strict=True):
        cd.decode_accumulate(pl, q, a, ctx)
    assert torch.equal(_bits(accs[0]), _bits(accs[1])), "decode_accumulate differs"
    locs = [y.clone(), y.clone()]
    hops = [
        cd.decode_accumulate_encode(pl, q, loc, ctx)
        for cd, pl, loc in zip((kern, ref), plans, locs, strict=True)
    ]
    assert torch.equal(hops[0], hops[1]), "decode_accumulate_encode differs"
    assert torch.equal(locs[0], y), "the Triton hop leaves local as it was"
    assert kern._overflow_total() == ref.overflow, "saturation count differs"


def _plans(kern, ref, base, n_chunks=1):
    stats = LocalStats(n_chunks=n_chunks, world_size=2)
    plans = [cd.plan(base, stats) for cd in (kern, ref)]
    assert torch.equal(_bits(plans[0].scale), _bits(plans[1].scale))
    return plans


@interpreter
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("scale", ["bf16", "e8m0"])
@pytest.mark.parametrize("block", [32, 6, 64])
def test_every_mode_equals_the_reference(name, scale, block):
    """Several tiles of 2,048 values (the last one partial), blocks of zeros and
    blocks with an Inf or NaN scale, scales near float32's limit, values beyond
    FMAX (saturated, counted), and two chunks."""
    kern, ref = _pair(name, scale=scale, mu_init=1.0, block=block)
    n = block * (-(-4500 // block))
    x, y = _nasty(n, 1), _nasty(n, 2)
    base = _nasty(n, 3) * 0.5  # statistics from other data: values beyond FMAX saturate
    base[: 2 * block] = 0.0  # blocks of zeros: scale 0
    base[2 * block + 1] = float("inf")  # a block with an Inf scale
    base[4 * block + 2] = float("nan")  # and one with a NaN scale
    x[5 * block + 3] = float("nan")
    x[6 * block] = float("inf")
    y[7 * block + 1] = -float("inf")
    plans = _plans(kern, ref, base, n_chunks=2)
    for pl in plans:  # scales near float32's limit: v * s would overflow
        pl.scale[-3:] = 3.0e38
    for c, (lo, hi) in enumerate(plans[1].chunks):
        _check_chunk(kern, ref, plans, c, x[lo:hi], y[lo:hi])
    assert ref.overflow > 0


@interpreter
@pytest.mark.parametrize("name", FORMATS)
def test_arbitrary_payload_bytes_decode_like_the_reference(name):
    """Every byte value (E4M3's NaN codes, -0) decodes and accumulates as the
    reference decodes it, and re-encodes in the fused hop."""
    kern, ref = _pair(name, mu_init=1.0)
    n = 2048 + 96
    plans = _plans(kern, ref, _nasty(n, 4))
    nbytes = plans[1].payload_nbytes[0]
    payload = torch.arange(nbytes, dtype=torch.int64).remainder(256).to(torch.uint8)
    payload = payload[torch.randperm(nbytes, generator=torch.Generator().manual_seed(5))]
    _check_chunk(kern, ref, plans, 0, _nasty(n, 6), _nasty(n, 7), payload=payload)


@interpreter
def test_every_magnitude_and_tie_encodes_like_the_reference():
    """All representable magnitudes, the midpoints between neighbours (ties to
    the even code) and points just beside them, through scale-1 blocks."""
    for name, fmt in (("mxfp8", fpf.E4M3), ("mxfp6", fpf.E3M2), ("mxfp4", fpf.E2M1)):
        kern, ref = _pair(name, mu_init=1.0)
        m = fpf.magnitudes(fmt)
        mid = (m[1:] + m[:-1]) / 2
        v = torch.cat([m, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(m[1:]), -m, -mid])
        v = torch.cat([v, torch.zeros((-v.numel()) % 32)])
        plans = _plans(kern, ref, torch.full_like(v, fmt.max))  # scale FMAX: x / s * FMAX = x
        _check_chunk(kern, ref, plans, 0, v, v.flip(0))


@interpreter
def test_partial_blocks_and_rows_pack_like_the_reference():
    """Chunks the codec never makes (a partial last block, lengths that end
    mid-row and mid-byte) still pack as bitpack lays them out, and decode."""
    for name in FORMATS:
        ref = hopq.get_codec(name, backend="reference", mu_init=1.0)
        assert isinstance(ref, MXCodec)
        for n in (1, 2, 3, 5, 33, 35, 37, 63):
            x = _nasty(n, n)
            padded = torch.cat([x, torch.zeros(64 - n)])
            plan = ref.plan(padded, LocalStats(n_chunks=1))
            ctx = HopContext(0, 0, 0, 1, 0, 1)
            before = ref.overflow
            want = ref.encode(plan, padded, ctx)
            got, sat = mx_triton.encode(x, plan.scale, ref.element, 32)
            assert torch.equal(got, want[: got.numel()]), (name, n)
            assert int(sat) == ref.overflow - before  # the padding saturates nothing
            out = torch.empty(n)
            mx_triton.decode(got, plan.scale, ref.element, 32, out, False)
            full = torch.empty(64)
            ref.decode(plan, want, ctx, full)
            assert torch.equal(_bits(out), _bits(full[:n])), (name, n)


@interpreter
def test_chunks_launched_in_pieces_equal_the_reference(monkeypatch):
    """A chunk too long for int32 offsets runs as several launches, each from a
    block, a tile and a byte (here forced: pieces of one block of tiles)."""
    monkeypatch.setattr(mx_triton, "_PIECE", 1)
    for name in FORMATS:
        kern, ref = _pair(name, mu_init=1.0, block=6)
        n = 6 * mx_triton.TILE + 6 * 50  # two pieces, the second short
        x, y = _nasty(n, 8), _nasty(n, 9)
        plans = _plans(kern, ref, _nasty(n, 10) * 0.5)
        _check_chunk(kern, ref, plans, 0, x, y)


@interpreter
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("topology, n", [("ring", 3), ("butterfly", 4)])
def test_simulation_with_the_kernels_equals_the_reference(name, topology, n):
    """Three rounds with both scale formats: every rank's output is
    bit-identical, and mu (steered by the saturation counts the kernels add on
    the device) follows the reference's."""
    xs = [_nasty(1500, r) for r in range(n)]
    for scale in ("bf16", "e8m0"):
        kern, ref = _pair(name, scale=scale, mu_init=0.25)
        for rnd in range(3):
            a = hopq.simulate(xs, ref, topology, seed=rnd).outputs
            b = hopq.simulate(xs, kern, topology, seed=rnd).outputs
            for ya, yb in zip(a, b, strict=True):
                assert torch.equal(_bits(ya), _bits(yb)), (scale, rnd)
            assert kern.mu == ref.mu and kern.state_dict() == ref.state_dict()


@interpreter
@pytest.mark.parametrize("name", FORMATS)
def test_shards_microshards_and_reduce_scatter_equal_the_reference(name):
    """Chunks that start their own blocks (rank shards, a partial last block),
    microshards, and the reduce-scatter alone."""
    xs = [_nasty(4099, r) for r in range(4)]
    kern, ref = _pair(name)
    for kw in ({"shards": "equal"}, {"microshards": 3}):
        a = hopq.simulate(xs, ref, "ring", seed=0, **kw).outputs
        b = hopq.simulate(xs, kern, "ring", seed=0, **kw).outputs
        for ya, yb in zip(a, b, strict=True):
            assert torch.equal(_bits(ya), _bits(yb)), kw
    a = hopq.simulate_reduce_scatter(xs, ref, "ring", seed=0).outputs
    b = hopq.simulate_reduce_scatter(xs, kern, "ring", seed=0).outputs
    for ya, yb in zip(a, b, strict=True):
        assert torch.equal(_bits(ya), _bits(yb))


@interpreter
def test_empty_and_tiny_vectors_equal_the_reference():
    """0, 1 and a few entries (chunks of none, or of one partial block)."""
    for name in FORMATS:
        for d in (0, 1, 5, 33):
            for topology, n in (("ring", 3), ("butterfly", 4), ("ring", 1)):
                xs = [_nasty(d, r) for r in range(n)]
                kern, ref = _pair(name)
                a = hopq.simulate(xs, ref, topology, seed=0).outputs
                b = hopq.simulate(xs, kern, topology, seed=0).outputs
                for ya, yb in zip(a, b, strict=True):
                    assert torch.equal(_bits(ya), _bits(yb)), (name, d, topology)


@interpreter
def test_warm_up_runs_every_mode_once_per_format_and_block():
    """The engine warms the codec up before a call's timeout starts: the Triton
    kernels of its format and block run once (compiling them on a GPU)."""
    codec = hopq.get_codec("mxfp6", backend="triton", block=16)
    key = ("e3m2", 16, "cpu")
    mx_triton._warm.discard(key)
    codec.warm_up(torch.device("cpu"))
    assert key in mx_triton._warm
    hopq.get_codec("mxfp6", backend="reference").warm_up(torch.device("cpu"))  # nothing to do


@interpreter
def test_backend_selection(monkeypatch):
    """auto picks numba for CPU tensors (triton only for CUDA ones); triton on
    CPU tensors needs the interpreter and says so at plan time; the codecs
    without Triton kernels refuse the name."""
    from hopq.codecs.mx import Backend, kernels_cpu
    from hopq.codecs.mx import codec as mx_codec
    from hopq.kernels import auto_backend

    cpu = torch.device("cpu")
    assert auto_backend("mxfp8", "cuda").name == "triton"
    assert hopq.get_codec("mxfp6", backend="triton").kernels(cpu) is mx_triton
    assert hopq.get_codec("mxfp6", backend="triton").config.backend is Backend.TRITON
    auto = hopq.get_codec("mxfp6").kernels(cpu)
    assert auto is (kernels_cpu if kernels_cpu.available() else None)
    # blocks whose codes end mid-byte: the Triton kernels take them, the CPU ones do not
    assert hopq.get_codec("mxfp6", block=6, backend="triton").kernels(cpu) is mx_triton
    with pytest.raises(ValueError, match="backend must be one of"):
        hopq.get_codec("mxfp4", backend="cuda")
    for other in ("gcomp", "thc", "gqsgd-exp"):
        with pytest.raises(ValueError, match="backend must be one of"):
            hopq.get_codec(other, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mx_codec._resolve.cache_clear()
    try:
        with pytest.raises(ValueError, match="CUDA tensors"):
            hopq.get_codec("mxfp8", backend="triton").plan(torch.ones(64), LocalStats())
    finally:
        mx_codec._resolve.cache_clear()


@interpreter
def test_division_by_fmax_by_reciprocal():
    """The decoding divides v * s by FMAX with a correctly rounded reciprocal
    and one fused multiply-add correction where every scale of a tile is 0 or
    in [2^-90, 2^100]: for every code of the three formats times every
    bfloat16 scale of that range (every plan's scale is a bfloat16 or a power
    of two), and random float32 scales, the correctly rounded quotient, +-0
    and NaN included."""
    import triton
    import triton.language as tl

    @triton.jit
    def divide(a_ptr, out_ptr, n, FMAX: tl.constexpr, RFMAX: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        a = tl.load(a_ptr + i, mask=ok, other=0.0)
        tl.store(out_ptr + i, mx_triton._div_fmax(a, FMAX, RFMAX), mask=ok)

    bf16 = (torch.arange(0x0001, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    rnd = torch.rand(1 << 16, generator=g) * 2.0 ** torch.randint(-90, 100, (1 << 16,), generator=g)
    s = torch.cat([bf16[(bf16 >= 2.0**-90) & (bf16 <= 2.0**100)], rnd, torch.zeros(1)])
    for fmt in (fpf.E4M3, fpf.E3M2, fpf.E2M1):
        v = fpf.decode(torch.arange(1 << fmt.bits, dtype=torch.int32).to(torch.uint8), fmt)
        a = (v[:, None] * s[None, :]).reshape(-1)
        consts = mx_triton._consts(fmt)
        out = torch.empty_like(a)
        n = a.numel()
        divide[(triton.cdiv(n, 1 << 20),)](
            a, out, n, FMAX=consts["FMAX"], RFMAX=consts["RFMAX"], BLOCK=1 << 20
        )
        assert torch.equal(_bits(out), _bits(a / fmt.max)), fmt.name


def test_triton_kernels_compile_for_cuda_without_a_gpu():
    """The interpreter runs the kernels' Python as is; the compiler is stricter
    (constexpr globals, types). Every variant must compile for sm_90 with
    correctly rounded divisions and no fused multiply-add."""
    if not mx_triton.available():
        pytest.skip("triton not installed")
    code = "from hopq.codecs.mx import kernels_triton as k; print(len(k.compile_all(90)))"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "24"


# -- on a GPU: compiled kernels on CUDA tensors --------------------------------
@gpu
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("scale", ["bf16", "e8m0"])
def test_gpu_kernels_match_the_reference(name, scale):
    """Four chunks of 2^20 values plus a partial tile, every mode, on the GPU
    (the reference on the GPU too: divisions exact there, hopq.numerics.div)."""
    kern, ref = _pair(name, scale=scale, mu_init=1.0)
    n = 4 * (1 << 20) + 96
    x, y = _nasty(n, 1, "cuda"), _nasty(n, 2, "cuda")
    base = _nasty(n, 3, "cuda") * 0.5
    base[:64] = 0.0
    base[65] = float("inf")
    base[130] = float("nan")
    plans = _plans(kern, ref, base, n_chunks=4)
    for pl in plans:
        pl.scale[-3:] = 3.0e38
    for c, (lo, hi) in enumerate(plans[1].chunks):
        _check_chunk(kern, ref, plans, c, x[lo:hi], y[lo:hi])
    nbytes = plans[1].payload_nbytes[0]
    g = torch.Generator().manual_seed(9)
    payload = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).cuda()
    lo, hi = plans[1].chunks[0]
    _check_chunk(kern, ref, plans, 0, x[lo:hi], y[lo:hi], payload=payload)


@gpu
@pytest.mark.parametrize("name", FORMATS)
def test_gpu_simulation_matches_the_reference(name):
    xs = [_nasty(3_000_000, r, "cuda") for r in range(4)]
    kern, ref = _pair(name)
    for rnd in range(2):
        a = hopq.simulate(xs, ref, "ring", seed=rnd).outputs
        b = hopq.simulate(xs, kern, "ring", seed=rnd).outputs
        mism = sum(int((_bits(ya) != _bits(yb)).sum()) for ya, yb in zip(a, b, strict=True))
        assert mism == 0, f"{mism} of {4 * 3_000_000} coordinates differ"
        assert kern.mu == ref.mu
