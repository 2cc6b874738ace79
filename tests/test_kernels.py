"""DynamiQ's kernels against the reference, bit for bit (DESIGN: the reference is
the specification). The numba CPU kernels and the Triton kernels (under
TRITON_INTERPRET=1 on CPU, compiled on a GPU when there is one) must give the
reference's payload bytes and float bits for every kernel, width, ragged tail,
all-zero group, outlier, seed and hop."""

import os

import pytest
import torch

import hopq
from hopq.codecs.base import HopContext, LocalStats
from hopq.codecs.dynamiq import DynamiQ, reference
from hopq.codecs.dynamiq import kernels_cpu as cpu_kernels
from hopq.codecs.dynamiq import kernels_triton as triton_kernels
from hopq.codecs.dynamiq.segment import SegmentCall
from hopq.kernels import Mode

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: 0/0 in where()

CUDA = torch.cuda.is_available()
INTERPRET = triton_kernels.interpreting()

BACKENDS = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed")
    ),
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not triton_kernels.available() or not INTERPRET,
            reason="triton not installed or TRITON_INTERPRET unset (GPU tests below)",
        ),
    ),
]


def _data(d, kind, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    m = -(-d // 256)
    scale = torch.logspace(-6, 2, m)[torch.randperm(m, generator=g)].repeat_interleave(256)[:d]
    x = torch.randn(d, generator=g) * scale
    if kind == "zeros":  # all-zero groups and a whole zero super-group
        x[16:48] = 0
        x[256:512] = 0
        x[600:603] = -0.0
    elif kind == "outliers":
        x[5] = 3e4
        x[300] = -1e-30  # below every other entry of its group by far
        x[301:316] = 1e-38  # subnormal-sized neighbours
        x[700] = -7e3
    elif kind == "nonfinite":
        x[10] = float("nan")
        x[400] = float("inf")
        x[401] = -float("inf")
    return x.to(device)


def _bits(t):
    """float32 bit patterns, every NaN as the canonical one: which operand's NaN
    payload an addition propagates is the CPU's choice, not the codec's."""
    if t.dtype != torch.float32:
        return t
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.contiguous().view(torch.int32)


def _check_all_kernels(backend, cfg, x, n, seeds, device="cpu"):
    """encode, decode, decode_accumulate and the fused hop of every chunk, with
    several seeds and hop contexts, kernels vs reference."""
    ref = DynamiQ(backend="reference", **cfg)
    ker = DynamiQ(backend=backend, **cfg)
    for seed in seeds:
        stats = LocalStats(n_chunks=n, world_size=n, seed=seed)
        plan = ref.plan(x, stats)
        kplan = ker.plan(x, stats)  # the statistics pre-pass, where the backend has one
        assert kplan.widths == plan.widths and torch.equal(kplan.perm, plan.perm)
        assert torch.equal(_bits(kplan.mu), _bits(plan.mu))
        work = ref.prepare(plan, x)
        other = ref.prepare(plan, x.flip(0) * 0.5)
        for c in range(n):
            lo, hi = plan.chunks[c]
            ctxs = [
                HopContext(seed, 3, c, hop, 0, n, depth, peer, peers)
                for hop, depth, peer, peers in ((0, 0, 0, 1), (1, 0, 1, n), (n - 1, 2, 0, 2))
            ]
            for ctx in ctxs:
                chunk = work[lo:hi]
                p_ref = ref.encode(plan, chunk, ctx)
                p_ker = ker.encode(plan, chunk, ctx)
                assert torch.equal(p_ker, p_ref), f"encode differs (chunk {c}, {ctx})"
                a, b = torch.empty_like(chunk), torch.empty_like(chunk)
                ref.decode(plan, p_ref, ctx, a)
                ker.decode(plan, p_ref, ctx, b)
                assert torch.equal(_bits(a), _bits(b)), "decode differs"
                a, b = other[lo:hi].clone(), other[lo:hi].clone()
                ref.decode_accumulate(plan, p_ref, a, ctx)
                ker.decode_accumulate(plan, p_ref, b, ctx)
                assert torch.equal(_bits(a), _bits(b)), "decode_accumulate differs"
                q_ref = ref.decode_accumulate_encode(plan, p_ref, other[lo:hi].clone(), ctx)
                q_ker = ker.decode_accumulate_encode(plan, p_ref, other[lo:hi].clone(), ctx)
                assert torch.equal(q_ker, q_ref), "decode_accumulate_encode differs"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [2, 4, 8, 16])
def test_one_segment_call_for_every_implementation(backend, width):
    """The reference, numba and Triton each run the same SegmentCall object, and
    give its outputs the same bits, in every mode (correlated rounding, a segment
    that starts past row 0)."""
    kern = cpu_kernels if backend == "cpu" else triton_kernels
    cfg = DynamiQ(widths=(width,), budget=width + 1.0, allocation="fixed").config
    S, s, k = cfg.supergroup_size, cfg.group_size, 3
    x = _data(k * S, "outliers", seed=width)
    other = _data(k * S, "zeros", seed=width + 1)
    st = reference.streams(cfg, HopContext(5, 2, 1, 1, 0, 3, 0, 1, 3))
    nbytes = sum(p.numel() for p in reference.encode_rows(cfg, x.view(k, S), width, 7, st))

    def run(impl, mode, **tensors):
        call = SegmentCall(mode, width, k, S, s, 7, cfg.eps_for(width), st, **tensors)
        if impl == "reference":
            reference.run_segment(cfg, call)
        else:
            kern.run_segment(call)

    def out_of(mode, impl, payload):
        if mode in (Mode.ENCODE, Mode.DAR):
            out = torch.empty(nbytes, dtype=torch.uint8)
            local = x.clone()
            run(impl, mode, payload=payload, local=local, out_payload=out)
            assert torch.equal(local, x), "local changed"
            return out
        acc = mode is Mode.DECODE_ACC
        out = other.clone() if acc else torch.empty_like(x)
        run(impl, mode, payload=payload, local=out if acc else None, out_rows=out)
        return _bits(out)

    payload = out_of(Mode.ENCODE, "reference", None)
    for mode in Mode:
        p = None if mode is Mode.ENCODE else payload
        want, got = out_of(mode, "reference", p), out_of(mode, "kernel", p)
        assert torch.equal(got, want), f"{mode.name} differs"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [2, 4, 8, 16])
@pytest.mark.parametrize("kind", ["gaussian", "zeros", "outliers"])
def test_every_kernel_matches_reference_per_width(backend, width, kind):
    cfg = {"widths": (width,), "budget": width + 1.0, "allocation": "fixed"}
    x = _data(3 * 256 + 77, kind, seed=width)  # ragged tail: 77 entries in the last super-group
    _check_all_kernels(backend, cfg, x, n=2, seeds=(0, 11))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"widths": (2, 4, 8, 16), "budget": 7.0},
        {"group_size": 32, "supergroup_size": 512, "budget": 4.0},
        {"levels": "uniform", "zero_class": True},
        {"rounding": "path"},
        {"rounding": "independent"},
        # an 8-bit table whose bucket search takes three steps (the default: one)
        {"widths": (8,), "budget": 9.0, "allocation": "fixed", "eps": ((8, 0.2),)},
    ],
)
def test_mixed_segments_match_reference(backend, cfg):
    """Chunks made of several width runs (and the zero class), other layouts and
    rounding modes; three chunks, contexts with correlated peers."""
    x = _data(9 * 256 + 5, "zeros", seed=3)
    _check_all_kernels(backend, cfg, x, n=3, seeds=(5,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [4, 16])
def test_correlated_rounding_any_peer_count(backend, width):
    """The permutation draw of correlated rounding takes different routes in the
    CPU kernel (powers of two, other counts below 2^16, larger counts): every
    route equals the reference, for the first and the last peer."""
    cfg = {"widths": (width,), "budget": width + 1.0, "allocation": "fixed"}
    ref, ker = DynamiQ(backend="reference", **cfg), DynamiQ(backend=backend, **cfg)
    x = _data(2 * 256 + 77, "gaussian", seed=width)
    stats = LocalStats(n_chunks=1, world_size=2, seed=7)
    plan = ref.plan(x, stats)
    work = ref.prepare(plan, x)
    for peers in (2, 4, 6, 8, 12, 64, 1 << 15, (1 << 15) + 2, 40000, 1 << 16, 70001):
        for peer in (0, peers - 1):
            ctx = HopContext(7, 3, 0, 1, 0, 2, 1, peer, peers)
            p_ref, p_ker = ref.encode(plan, work, ctx), ker.encode(plan, work, ctx)
            assert torch.equal(p_ker, p_ref), f"encode differs ({peers} peers, peer {peer})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [4, 8])  # the counted and the bucket level search
def test_nonfinite_input_matches_reference(backend, width):
    """NaN and Inf poison their super-group identically in both implementations."""
    cfg = {"widths": (width,), "budget": width + 1.0, "allocation": "fixed"}
    _check_all_kernels(backend, cfg, _data(2 * 256, "nonfinite", seed=1), n=2, seeds=(0,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology, n", [("ring", 3), ("butterfly", 4)])
def test_simulation_with_kernels_equals_reference(backend, topology, n):
    """A multi-step, multi-round simulation: every rank's output is bit-identical."""
    xs = [_data(2000, "gaussian", seed=r) for r in range(n)]
    for rnd in range(2):
        a = hopq.simulate(xs, DynamiQ(backend="reference"), topology, seed=rnd).outputs
        b = hopq.simulate(xs, DynamiQ(backend=backend), topology, seed=rnd).outputs
        for ya, yb in zip(a, b, strict=True):
            assert torch.equal(_bits(ya), _bits(yb))


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba is not installed")
@pytest.mark.parametrize("avg", [False, True])
def test_row_scatter_saturates_like_the_reference(avg):
    """The CPU row scatter with ``saturate`` (DynamiQ finishes part by part with
    it) equals the reference scatter followed by ``saturate_finite_rows``: sums
    past float32's limit saturate in rows with a finite mean, Inf and NaN rows
    keep their poison; a scatter a part at a time gives the same bits."""
    from hopq.codecs.dynamiq.codec import saturate_finite_rows
    from hopq.numerics.rows import scatter_rows

    S, m, d, n = 256, 12, 12 * 256 - 100, 4
    g = torch.Generator().manual_seed(3)
    y = torch.randn(m * S, generator=g) * 3e38
    mu = torch.randn(m, generator=g) * 1e38
    mu[2], mu[5], mu[7] = float("inf"), float("nan"), -float("inf")
    y[S * 4 + 3] = float("inf")
    y[S * 6 + 1] = -float("inf")
    perm = torch.randperm(m, generator=g)
    want = saturate_finite_rows(scatter_rows(y, perm, mu, S, n, avg, d), mu, S)
    assert not torch.isfinite(want).all() and (want.abs() == torch.finfo(torch.float32).max).any()
    whole = cpu_kernels.scatter_rows(y, perm, mu, S, n, avg, d, saturate=True)
    parts = torch.empty(d)
    for lo, hi in ((0, 5), (5, 6), (6, 12)):
        cpu_kernels.scatter_rows(
            y[lo * S : hi * S], perm[lo:hi], mu, S, n, avg, d, out=parts, saturate=True
        )
    for got in (whole, parts):
        assert torch.equal(_bits(got), _bits(want))


def test_backend_selection(monkeypatch):
    x = torch.randn(1000)
    stats = LocalStats(n_chunks=2, world_size=2)
    if cpu_kernels.available():
        assert DynamiQ().kernels(x.device) is cpu_kernels  # auto on CPU
    assert DynamiQ(backend="reference").kernels(x.device) is None
    assert DynamiQ(scales="full").kernels(x.device) is None  # auto: reference there
    with pytest.raises(ValueError, match="hierarchical"):
        DynamiQ(backend="cpu", scales="full").plan(x, stats)
    with pytest.raises(ValueError, match="backend must be one of"):
        DynamiQ(backend="cuda")
    if triton_kernels.available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="CUDA tensors"):
            DynamiQ(backend="triton").plan(x, stats)


def test_codec_that_ran_kernels_still_copies():
    """The kernel module a codec resolved stays out of copies: an instance that
    already ran can be cloned (the simulator's ranks) and pickled."""
    import pickle

    c = DynamiQ()
    xs = [torch.randn(3000) for _ in range(2)]
    hopq.simulate(xs, c, "ring", seed=1)
    assert c.kernels(torch.device("cpu")) is not None or not cpu_kernels.available()
    copy = hopq.simulate(xs, c.clone(), "ring", seed=1)  # same round, same bits
    assert torch.equal(copy.outputs[0], hopq.simulate(xs, c, "ring", seed=1).outputs[0])
    assert pickle.loads(pickle.dumps(c)).config == c.config


def test_level_search_tables_find_the_searched_level():
    from hopq.codecs.dynamiq.config import DynamiQConfig
    from hopq.numerics.levels import level_table, search_tables, stochastic_level

    cfg = DynamiQConfig()  # the default tables: one step up from the bucket's level
    assert all(search_tables(w, cfg.eps_for(w))[3] == 1 for w in (2, 4, 8))

    for w, eps in ((2, 0.0), (4, 0.3), (4, 0.0), (4, 1.0), (8, 0.08), (8, 0.2)):
        ext, bucket, nb_log, steps = search_tables(w, eps)
        assert steps <= 8
        table = level_table(w, eps)
        top = table.numel() - 1
        y = torch.cat([torch.rand(20000), table, torch.nextafter(table, torch.zeros(()))]).clamp(
            0, 1
        )
        b = (y * (1 << nb_log)).long().clamp(max=(1 << nb_log) - 1)
        lv = bucket[b].long()
        for _ in range(steps):
            lv += (ext[lv + 1] <= y).long()
        lv = lv.clamp(max=max(top - 1, 0))
        expect = stochastic_level(y, table, torch.ones_like(y))  # u = 1: never rounds up
        assert torch.equal(lv, expect)
    # levels too uneven for the bucket search: kernels step aside for the reference
    with pytest.raises(ValueError, match="search steps"):
        search_tables(8, 0.5)
    uneven = {"eps": ((8, 0.5),)}
    assert DynamiQ(**uneven).kernels(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="bucket search"):
        DynamiQ(backend="cpu", **uneven).kernels(torch.device("cpu"))


@pytest.mark.skipif(
    not triton_kernels.available() or not INTERPRET, reason="triton interpreter needed"
)
def test_division_by_reciprocal():
    """The encoding kernels divide by a correctly rounded reciprocal with one
    fused multiply-add correction where the operands allow it: the scale's
    rg * M / 255 for every 8-bit rg and finite bfloat16 M (exhaustively), and
    quotients (pi + u) / n and a / b in the range the kernels keep to, against
    torch's correctly rounded division."""
    import triton
    import triton.language as tl

    @triton.jit
    def divide(a_ptr, b_ptr, rb_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        a = tl.load(a_ptr + i, mask=ok, other=0.0)
        b = tl.load(b_ptr + i, mask=ok, other=1.0)
        rb = tl.load(rb_ptr + i, mask=ok, other=1.0)
        tl.store(out_ptr + i, triton_kernels._div_by(a, b, rb), mask=ok)

    def check(a, b):
        out = torch.empty_like(a)
        rb = torch.ones_like(b) / b
        n = a.numel()
        divide[(triton.cdiv(n, 1 << 20),)](a, b, rb, out, n, BLOCK=1 << 20)
        assert torch.equal(out.view(torch.int32), (a / b).view(torch.int32))

    m = (torch.arange(0x0001, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    rg = torch.arange(256, dtype=torch.float32)
    a = (rg[:, None] * m[None, :]).reshape(-1)
    a = a[a.isfinite()]
    check(a, torch.full_like(a, 255.0))
    g = torch.Generator().manual_seed(0)
    n = torch.randint(2, 1 << 16, (1 << 20,), generator=g).float()
    pi = (torch.rand(1 << 20, generator=g) * n).floor()
    u = torch.randint(0, 1 << 24, (1 << 20,), generator=g).float() * 2.0**-24
    check(pi + u, n)
    b = (torch.rand(1 << 20, generator=g) + 0.5) * 2.0 ** torch.randint(
        -60, 60, (1 << 20,), generator=g
    )
    a = b * torch.rand(1 << 20, generator=g) * 2.0 ** -torch.randint(0, 80, (1 << 20,), generator=g)
    # the range the kernels keep to: dividends of at least 2**-100 (the
    # residual a - b q then has no bits below the subnormals'), normal quotients
    normal = (a >= 2.0**-100) & (a / b >= 2.0**-126)
    assert normal.float().mean() > 0.5
    check(a[normal], b[normal])


# -- on a GPU (the device tool): compiled kernels on CUDA tensors ---------------
gpu = pytest.mark.skipif(
    not CUDA or INTERPRET or not triton_kernels.available(),
    reason="needs a CUDA GPU with triton and TRITON_INTERPRET=0",
)


@gpu
@pytest.mark.parametrize("width", [2, 4, 8, 16])
def test_gpu_kernels_match_reference(width):
    cfg = {"widths": (width,), "budget": width + 1.0, "allocation": "fixed"}
    x = _data(1 << 20, "gaussian", seed=width, device="cuda") + 0.0
    _check_all_kernels("triton", cfg, x, n=4, seeds=(0,), device="cuda")


@gpu
def test_gpu_simulation_matches_reference():
    xs = [_data(3_000_000, "gaussian", seed=r, device="cuda") for r in range(4)]
    a = hopq.simulate(xs, DynamiQ(backend="reference"), "ring", seed=1).outputs
    b = hopq.simulate(xs, DynamiQ(backend="triton"), "ring", seed=1).outputs
    mism = sum(int((_bits(ya) != _bits(yb)).sum()) for ya, yb in zip(a, b, strict=True))
    assert mism == 0, f"{mism} of {4 * 3_000_000} coordinates differ"


def test_bench_kernels_reports_every_kernel(tmp_path):
    from hopq.bench.kernels import KernelOptions, run

    text = run(
        KernelOptions(sizes=(1024,), widths=(2, 16), repeats=1, plot=str(tmp_path / "k.png")),
        log=None,
    )
    for name in ("copy (ceiling)", "bf16 hop", "compress", "decompress_accumulate_recompress"):
        assert name in text
    if not CUDA:
        assert "not measured" in text  # CPU run: GPU rows say so
    with pytest.raises(ValueError, match="widths"):
        KernelOptions(widths=(3,))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_replay_timer_takes_the_hosts_work_out():
    """The replayed time of a call is its kernels' alone: a short kernel behind
    2 ms of host work replays in microseconds, a copy in about do_bench's time;
    a call that synchronizes with the host is refused, not captured."""
    import time

    from hopq.bench.kernels import replay_timer, timer

    x = torch.randn(1 << 24, device="cuda")
    y = torch.empty_like(x)
    replay = replay_timer(3)
    t_copy = replay(lambda: y.copy_(x))
    assert t_copy is not None
    assert 0.5 < t_copy / timer(torch.device("cuda"), 3)(lambda: y.copy_(x)) < 1.5

    def behind_the_host() -> None:
        time.sleep(0.002)
        y[:256].add_(1.0)

    t = replay(behind_the_host)
    assert t is not None and t < 2e-4
    assert replay(lambda: y[:256].sum().item()) is None


@pytest.mark.skipif(not triton_kernels.available(), reason="triton not installed")
def test_triton_kernels_compile_for_cuda_without_a_gpu():
    """The interpreter runs the kernels' Python as is; the compiler is stricter
    (constexpr globals, types). Every variant must compile for sm_90 with
    correctly rounded divisions and no fused multiply-add."""
    import subprocess
    import sys

    code = "from hopq.codecs.dynamiq import kernels_triton as k; print(len(k.compile_all(90)))"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "38"
