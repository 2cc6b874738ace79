"""Global-QSGD: unbiasedness of both codecs, the exponential reduce (exact
expectation over its events, symmetry), the per-aggregation variance growth
against the paper's 9/8, no overflow at large n, and the depth-based scaling
that lets gqsgd-exp run on a ring."""

import math
import random
from fractions import Fraction

import pytest
import torch

import hopq
from hopq.bench.gqsgd import second_moment_growth
from hopq.codecs.base import HopContext, LocalStats, ReduceOp
from hopq.codecs.gqsgd import (
    EMAX,
    GQSGDExp,
    GQSGDLinear,
    bytes_to_codes,
    codes_to_bytes,
    exp_quantize,
    exp_reduce,
    linear_layout,
    linear_scale,
)
from hopq.errors import PayloadError
from hopq.numerics.rng import hash32


def _value(code: torch.Tensor) -> torch.Tensor:
    """Signed exponent codes -> float64 values sign 2^-e (0 for 0)."""
    e = code.abs().double()
    return torch.where(code == 0, 0.0, torch.sign(code).double() * torch.exp2(-e))


def _all_pairs(lo: int = 2, hi: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of codes with exponents in [lo, hi) and zero; lo >= 2 keeps the
    sums below 1, which the codec's scaling guarantees."""
    codes = torch.tensor([0] + [s * e for e in range(lo, hi) for s in (1, -1)], dtype=torch.int32)
    a, b = torch.meshgrid(codes, codes, indexing="ij")
    return a.reshape(-1), b.reshape(-1)


# -- the exponential reduce -----------------------------------------------------------
def test_exp_reduce_is_exactly_unbiased():
    """Each result depends on one event "h < 2^32 >> j" of probability 2^-j:
    evaluate both outcomes (h = 0: the event happens, h = 2^32 - 1: it does not,
    for j >= 1) and weigh them; the expectation is the exact sum."""
    a, b = _all_pairs()
    ea, eb = a.abs(), b.abs()
    same = (a > 0) == (b > 0)
    diff = (ea - eb).abs()
    j = torch.where(same, diff, diff - 1).clamp(min=0)
    p = torch.exp2(-j.double())
    yes = _value(exp_reduce(a, b, torch.zeros_like(a, dtype=torch.int64)))
    no = _value(exp_reduce(a, b, torch.full_like(a, 2**32 - 1, dtype=torch.int64)))
    expected = p * yes + (1 - p) * no
    assert torch.equal(expected, _value(a) + _value(b))


def test_exp_reduce_symmetric_and_statistically_unbiased():
    a, b = _all_pairs(2, 8)
    g = torch.Generator().manual_seed(0)
    draws = 4000
    h = torch.randint(0, 2**32, (draws, a.numel()), generator=g, dtype=torch.int64)
    A, B = a.expand(draws, -1).reshape(-1), b.expand(draws, -1).reshape(-1)
    r1 = exp_reduce(A, B, h.reshape(-1))
    assert torch.equal(r1, exp_reduce(B, A, h.reshape(-1)))  # either partner: same bytes
    vals = _value(r1).view(draws, -1)
    exact = _value(a) + _value(b)
    se = vals.std(0) / math.sqrt(draws) + 1e-12
    assert ((vals.mean(0) - exact).abs() <= 5 * se).all()
    # the result is a neighbouring power of two of the sum (or 0 when it cancels)
    lo = vals.abs().amin(0)
    hi = vals.abs().amax(0)
    assert (hi <= 2 * exact.abs() + 1e-300).all() and (lo >= exact.abs() / 2 - 1e-300).all()


def test_exp_quantize_unbiased_including_the_bottom():
    """Natural dithering: unbiased between powers of two and below 2^-127 (0 or
    2^-127), never beyond 2^-chain."""
    chain = 3
    t = torch.tensor(
        [1.0, 0.75, 0.3, 2.0**-100, 2.0**-126, 3.0 * 2.0**-130, 0.0], dtype=torch.float64
    )
    draws = 20000
    g = torch.Generator().manual_seed(1)
    u = torch.rand((draws, t.numel()), generator=g).float()
    e = exp_quantize(t.expand(draws, -1).reshape(-1), u.reshape(-1), chain).view(draws, -1)
    assert int(e[e > 0].min()) >= chain and int(e.max()) <= EMAX
    v = torch.where(e > 0, torch.exp2(-e.double()), 0.0) * 2.0**chain
    se = v.std(0) / math.sqrt(draws)
    assert ((v.mean(0) - t).abs() <= 5 * se + 1e-300).all()
    assert torch.equal(e[:, 0], torch.full_like(e[:, 0], chain))  # the max is exact


def test_code_bytes_roundtrip():
    c = torch.tensor([0] + [s * e for e in range(1, 128) for s in (1, -1)], dtype=torch.int32)
    assert torch.equal(bytes_to_codes(codes_to_bytes(c)), c)


# -- unbiasedness end to end ------------------------------------------------------------
@pytest.mark.parametrize(("codec", "topology"), [("gqsgd-linear", "ring"), ("gqsgd-exp", "tree")])
def test_unbiased_end_to_end(codec, topology):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(256, generator=g) * torch.linspace(0.1, 3, 256) for _ in range(4)]
    exact = torch.stack(xs).double().sum(0)
    runs, acc, sq = 120, torch.zeros(256, dtype=torch.float64), 0.0
    for seed in range(runs):
        out = hopq.simulate(xs, codec, topology, seed=seed).outputs[0].double()
        acc += out
        sq += (out - exact).square().sum().item()
    # squared error of the mean against its expected value (the mean squared error / runs)
    assert (acc / runs - exact).square().sum().item() < 1.4 * sq / runs / runs


def test_linear_leaf_unbiased_4bit():
    """The 4-bit codec at n = 4 (one level per rank): rounding is still unbiased."""
    c = hopq.get_codec("gqsgd-linear", bits=4)
    x = torch.linspace(-1, 1, 64)
    acc = torch.zeros(64, dtype=torch.float64)
    runs = 3000
    for s in range(runs):
        plan = c.plan(x, LocalStats(world_size=4, seed=s))
        assert (plan.lane_bits, plan.levels) == (4, 1)
        acc += c.finish(plan, c.prepare_all(plan, x), ReduceOp.SUM, 4).double()
    # per-coordinate variance <= (N / L)^2 / 4 = 1/4: standard error of the mean 0.5 / sqrt(runs)
    assert ((acc / runs - x.double()).abs() <= 5 * 0.5 / math.sqrt(runs)).all()


# -- lanes and overflow ------------------------------------------------------------------
def test_linear_lanes_never_overflow():
    for bits in (8, 4):
        prev = None
        for n in range(1, 5000):
            lane, levels = linear_layout(bits, 1, n)
            assert n * levels <= (1 << (lane - 1)) - 1 and levels >= 1
            assert levels <= (1 << (bits - 1)) - 1
            if prev is not None:
                assert lane >= prev  # lanes only widen with n
            prev = lane
    assert linear_layout(8, 1, 4) == (8, 31)
    assert linear_layout(8, 1, 127) == (8, 1)
    assert linear_layout(8, 1, 128) == (16, 127)
    assert linear_layout(4, 1, 7) == (4, 1)
    assert linear_layout(4, 1, 8) == (8, 7)
    assert linear_layout(8, 8, 16) == (16, 127)  # min_levels 8: widen instead


def test_linear_scale_fills_the_lane_and_never_overflows():
    """The common multiplier from every rank's max |x|: rank i's integers stay
    within its cap K_i >= M_i m, the caps sum to at most the lane, no cap exceeds
    the nominal levels, it is never coarser than the plain rule L / N, and with
    equal maxima it is the plain rule to the bit."""
    rnd = random.Random(5)
    for _ in range(400):
        n = rnd.choice([1, 2, 3, 4, 5, 8, 16, 100, 127, 128, 300])
        bits = rnd.choice([4, 8])
        lane, L = linear_layout(bits, rnd.choice([1, 1, 2, 8]) if bits == 8 else 1, n)
        kind = rnd.random()
        if kind < 0.2:
            M = [1.5] * n
        elif kind < 0.3:  # some ranks all zero, one huge spread
            M = [rnd.choice([0.0, 1e-30, 1.0, 1e30]) for _ in range(n)]
            M[rnd.randrange(n)] = 2.0
        else:
            M = [rnd.lognormvariate(0, 1) for _ in range(n)]
        sc = linear_scale(M, bits, lane, L)
        C, P, N = (1 << (lane - 1)) - 1, (1 << (bits - 1)) - 1, max(M)
        assert len(sc.caps) == n and sc.limit == sum(sc.caps) <= C
        assert all(0 <= k <= P for k in sc.caps)
        m = Fraction(sc.factor)
        for Mi, k in zip(M, sc.caps, strict=True):
            assert Fraction(Mi) * m <= k * (1 + Fraction(1, 1 << 50))  # float(m): one ulp
        assert sc.factor >= L / N
        if len(set(M)) == 1:
            assert sc.factor == L / N and sc.step == N / L and sc.caps == (L,) * n


def test_linear_uses_the_ranks_spread_of_maxima():
    """Ranks with different maxima (1x to 4x): no partial sum leaves the lane even
    with every rank at its own +max, ranks stay bit-identical, the result stays
    unbiased, and it is more accurate than the plain rule's L = 31 levels."""
    n, size = 4, 4096
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(size, generator=g) * (r + 1) for r in range(n)]
    for r in range(n):  # every rank at its own max, same sign, same coordinates
        xs[r][:8] = xs[r].abs().max()
    plain = linear_scale([1.0] * n, 8, 8, 31)
    spread = linear_scale([float(x.abs().max()) for x in xs], 8, 8, 31)
    assert spread.limit <= 127 and spread.factor * float(xs[-1].abs().max()) > 1.5 * 31
    exact = torch.stack(xs).double().sum(0)
    err = 0.0
    for seed in range(8):
        res = hopq.simulate(xs, "gqsgd-linear", "ring", seed=seed)
        assert res.identical
        err += (res.outputs[0].double() - exact).square().sum().item()
    # the plain rule's error per coordinate: n ranks of (N / 31)^2 / 4 at most
    N = max(float(x.abs().max()) for x in xs)
    assert err / 8 / size < 0.5 * n * (N / 31) ** 2 / 4
    assert plain.caps == (31,) * n


@pytest.mark.parametrize(("n", "topology"), [(16, "ring"), (64, "tree")])
def test_no_overflow_with_every_rank_at_the_max(n, topology):
    """Adversarial input: every rank at +max (and at -max in half the
    coordinates). gqsgd-linear sums exactly (n x the max); gqsgd-exp never
    overshoots to exponent 0 (which would decode as zero) and stays unbiased."""
    size = 2048
    x = torch.ones(size)
    x[size // 2 :] = -1.0
    xs = [x.clone() for _ in range(n)]
    lin = hopq.simulate(xs, "gqsgd-linear", topology, seed=3)
    assert lin.identical and torch.equal(lin.outputs[0], x * n)
    for bits in (4,):
        lin4 = hopq.simulate(xs, hopq.get_codec("gqsgd-linear", bits=bits), topology, seed=3)
        assert torch.equal(lin4.outputs[0], x * n)
    ex = hopq.simulate(xs, "gqsgd-exp", topology, seed=3)
    o = ex.outputs[0].double()
    assert ex.identical and (torch.sign(o) == x.double()).all()  # never zero, never flipped
    half = o[: size // 2]
    assert abs(half.mean().item() - n) <= 5 * half.std().item() / math.sqrt(size // 2) + 1e-9


def test_exp_on_ring_is_scaled_not_broken():
    """The notes' worked example: n = 4 on a ring, every rank at +max; a 1/(2n)
    pre-scale would overshoot to e = 0 (decoding as zero). The depth-based scale
    (2^-4 on a ring of 4) keeps every exponent >= 1."""
    xs = [torch.ones(4096) for _ in range(4)]
    r = hopq.simulate(xs, "gqsgd-exp", "ring", seed=0)
    o = r.outputs[0].double()
    assert (o > 0).all()
    assert abs(o.mean().item() - 4) < 5 * o.std().item() / 64


def test_exp_refuses_too_deep_schedules_and_bad_depths():
    c = GQSGDExp()
    x = torch.randn(100)
    stats = LocalStats(world_size=65)
    stats.reduce_depth = 64  # a ring of 65
    with pytest.raises(ValueError, match="use the butterfly or tree"):
        c.plan(x, stats)
    ok = LocalStats(world_size=4)
    ok.reduce_depth = 2
    plan = c.plan(x, ok)
    assert plan.chain == 3
    work = c.prepare_all(plan, x)
    ctx = HopContext(0, 0, 0, 1, 0, 4)
    p = c.encode(plan, work.clone(), ctx)
    deep = p.clone()
    deep[0] = 3  # deeper than the schedule allows
    with pytest.raises(PayloadError, match="depth"):
        c.decode(plan, deep, ctx, torch.zeros(100))
    big = p.clone()
    big[1] = 1  # exponent 1 at depth 0: larger than a leaf can be
    with pytest.raises(PayloadError, match="exponent"):
        c.decode(plan, big, ctx, torch.zeros(100))
    # two combinations in a row are fine, a third is not
    acc = work.clone()
    c.decode_accumulate(plan, p, acc, ctx)
    q = p.clone()
    q[0] = 1
    c.decode_accumulate(plan, q, acc, ctx)
    with pytest.raises(PayloadError, match="combinations in a row"):
        c.decode_accumulate(plan, p, acc, ctx)


# -- variance growth against the paper's 9/8 ----------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_variance_growth_within_nine_eighths_per_level(n):
    growth, _ = second_moment_growth(n, seeds=6)
    levels = math.log2(n)
    assert 1.0 < growth <= (9 / 8) ** levels


# -- the numba kernel ---------------------------------------------------------------------
def _cpu_kernels():
    from hopq.codecs.gqsgd import kernels_cpu as gqsgd_cpu

    if not gqsgd_cpu.available():
        pytest.skip("numba not installed")  # the torch-only environment
    return gqsgd_cpu


def test_cpu_kernel_matches_reference_bit_for_bit():
    k = _cpu_kernels()
    g = torch.Generator().manual_seed(7)
    n = 50_000
    for emin, zeros in ((2, 0.0), (5, 0.3), (9, 0.9)):
        e = torch.randint(emin, EMAX + 1, (2, n), generator=g, dtype=torch.int32)
        s = torch.randint(0, 2, (2, n), generator=g, dtype=torch.int32) * 2 - 1
        codes = torch.where(torch.rand(2, n, generator=g) < zeros, 0, e * s)
        codes[:, :300] = codes[:, 300:600]  # ties and equal exponents
        codes[1, 600:900] = -codes[0, 600:900]  # cancellations
        a, b = codes[0], codes[1]
        key = (12345 + emin, 999)
        idx = torch.arange(77, 77 + n, dtype=torch.int64)
        ref = exp_reduce(a, b, hash32(idx, key))
        acc = a.to(torch.float32)
        out = torch.empty(n, dtype=torch.uint8)
        assert k.exp_reduce(acc, codes_to_bytes(b), key, 77, emin, out) == 0
        assert torch.equal(acc.to(torch.int32), ref)
        assert torch.equal(out, codes_to_bytes(ref))
    bad = codes_to_bytes(b).clone()
    bad[5] = 0x80  # negative zero
    bad[6] = 1  # exponent below emin
    assert k.exp_reduce(a.to(torch.float32), bad, key, 0, 9, None) == 2


@pytest.mark.parametrize("topology", ["tree", "butterfly", "ring"])
def test_simulation_with_kernel_equals_reference(topology):
    _cpu_kernels()
    g = torch.Generator().manual_seed(2)
    codecs = [
        lambda b: GQSGDExp(backend=b),
        lambda b: GQSGDLinear(backend=b),
        lambda b: GQSGDLinear(bits=4, backend=b),
        lambda b: GQSGDLinear(min_levels=64, backend=b),  # 16-bit lanes from n = 2
    ]
    for n in (3, 4, 5):
        # heavy-tailed magnitudes reach the bottom of the exponent range; signed zeros
        xs = [
            torch.randn(3001, generator=g) * torch.rand(3001, generator=g) ** 12 for _ in range(n)
        ]
        xs[0][:40] = 0.0
        xs[1][40:50] = -0.0
        xs[2][50] = -1e-38
        for make in codecs:
            ref = hopq.simulate(xs, make("reference"), topology, seed=5, microshards=2)
            got = hopq.simulate(xs, make("cpu"), topology, seed=5, microshards=2)
            assert got.identical
            assert torch.equal(ref.outputs[0].view(torch.int32), got.outputs[0].view(torch.int32))


def test_cpu_kernel_rejects_corrupt_payloads_like_the_reference():
    _cpu_kernels()
    c = GQSGDExp(backend="cpu")
    x = torch.randn(100)
    stats = LocalStats(world_size=4)
    stats.reduce_depth = 2
    plan = c.plan(x, stats)
    work = c.prepare_all(plan, x)
    ctx = HopContext(0, 0, 0, 1, 0, 4)
    p = c.encode(plan, work.clone(), ctx)
    for i, v in ((0, 3), (1, 1), (2, 0x80)):
        q = p.clone()
        q[i] = v
        with pytest.raises(PayloadError):
            c.decode_accumulate_encode(plan, q, work.clone(), ctx)


def test_training_quality_in_the_loop():
    """Table 4's machinery (hopq.bench.quality): the same seed gives the same
    start for every codec, the exact average reproduces itself, and a codec's
    bits per coordinate are measured from the all-reduces it ran."""
    from hopq.bench.gqsgd import GQSGDOptions
    from hopq.bench.quality import SimTraining, train

    cfg = SimTraining(
        workload="gpt", steps=3, workers=3, batch=1, gpt_dim=32, gpt_layers=1, context=32,
        topology="tree", held_out=2,
    )  # fmt: skip
    exact = train(cfg, None)
    again = train(cfg, None)
    assert exact.losses == again.losses and exact.held_out == again.held_out
    assert math.isnan(exact.bits)
    for name in ("gqsgd-linear", "gqsgd-exp"):
        c = train(cfg, name)
        assert c.losses[0] == exact.losses[0]  # the same weights and first batches
        assert 7.5 < c.bits < 9 and math.isfinite(c.held_out)
    with pytest.raises(ValueError, match="unknown parts"):
        GQSGDOptions(parts=("nope",))
    with pytest.raises(ValueError, match="optimizer"):
        SimTraining(optimizer="lion")


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_cpu_linear_lanes_match_the_reference_bit_for_bit(bits):
    """The kernel's hop (with and without encode), lane decode and leaf pack on
    4-, 8- and 16-bit lanes against the reference's bit packing, odd sizes, and
    the count of lanes and sums beyond the limit."""
    k = _cpu_kernels()
    from hopq.numerics.bitpack import pack_bits, sign_extend, unpack_bits

    g = torch.Generator().manual_seed(bits)
    top = (1 << (bits - 1)) - 1
    lim = top // 2
    mask = (1 << bits) - 1

    def ref_pack(t: torch.Tensor) -> torch.Tensor:
        t = t & mask
        return pack_bits(t.to(torch.uint8) if bits <= 8 else t, bits)

    for n in (1, 2, 3, 33, 10_001):
        a = torch.randint(-(lim // 2), lim // 2 + 1, (n,), generator=g).to(torch.float32)
        b = torch.randint(-(lim // 2), lim // 2 + 1, (n,), generator=g)

        body = ref_pack(b)
        assert torch.equal(k.linear_pack(b.to(torch.float32), bits), body)
        v = torch.empty(n)
        assert k.linear_unpack(body, bits, lim, v) == 0
        assert torch.equal(v, sign_extend(unpack_bits(body, bits, n).to(torch.int64), bits).float())
        acc, out = a.clone(), torch.empty_like(body)
        assert k.linear_hop(acc, body, bits, lim, out) == 0
        assert torch.equal(acc, a + b.float())
        assert torch.equal(out, ref_pack(a.long() + b))
        acc2 = a.clone()
        assert k.linear_hop(acc2, body, bits, lim) == 0 and torch.equal(acc2, acc)
        # one lane at the top of the lane, one sum past the limit
        b2 = b.clone()
        b2[0] = top
        a2 = a.clone()
        a2[-1] = lim
        b2[-1] = 1 if n > 1 else b2[-1]
        bad = k.linear_hop(a2, ref_pack(b2), bits, lim, out)
        assert bad == (2 if n > 1 else 1)
    with pytest.raises(ValueError, match="lanes of 4, 8 or 16"):
        k.linear_pack(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="take"):
        k.linear_hop(torch.zeros(5), torch.zeros(2, dtype=torch.uint8), 4, 7)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_linear_hop_rejects_sums_beyond_the_limit(backend):
    if backend == "cpu":
        _cpu_kernels()
    c = GQSGDLinear(backend=backend)
    x = torch.randn(100)
    plan = c.plan(x, LocalStats(world_size=4))
    work = c.prepare_all(plan, x)
    ctx = HopContext(0, 0, 0, 1, 0, 4)
    p = c.encode(plan, work.clone(), ctx)
    q = p.clone()
    q[3] = 127  # one lane beyond 4 ranks x 31 levels
    with pytest.raises(PayloadError):
        c.decode_accumulate_encode(plan, q, work.clone(), ctx)
    full = torch.full_like(work, float(plan.levels * 3 + 1))  # the sum overshoots
    with pytest.raises(PayloadError):
        c.decode_accumulate(plan, p.clone().fill_(plan.levels), full, ctx)
    got = c.decode_accumulate_encode(plan, p, work.clone(), ctx)
    assert torch.equal(got, c.encode(plan, work * 2, ctx))


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_kernels_saturate_like_the_reference(op):
    """Sums of values near float32's max: the kernels' decode saturates where
    the reference's does, bit for bit."""
    _cpu_kernels()
    g = torch.Generator().manual_seed(1)
    xs = [(torch.rand(2001, generator=g) * 2 - 1) * 3e38 for _ in range(4)]
    for make in (GQSGDLinear, GQSGDExp):
        ref = hopq.simulate(xs, make(backend="reference"), "tree", seed=3, op=op)
        got = hopq.simulate(xs, make(backend="cpu"), "tree", seed=3, op=op)
        assert torch.isfinite(got.outputs[0]).all()
        assert torch.equal(ref.outputs[0].view(torch.int32), got.outputs[0].view(torch.int32))


def test_paper_cost_model():
    """Section 7's model and its speed-up condition (A.5): with rho = 4, a reduce
    no slower than a float add (omega <= 4) always pays; omega = 79 (the paper's
    exponential reduce) pays only below beta = 6 gamma / 75."""
    from hopq.bench.gqsgd import paper_model, speedup_condition

    n, S, alpha, beta, gamma = 4, 1e6, 1e-5, 1e8, 1e10
    base = paper_model(n, S, alpha, beta, gamma)
    assert base == pytest.approx(4 * alpha + 4 * S / beta + 2 * S / gamma)
    fast = paper_model(n, S, alpha, beta, gamma, rho=4.0, gamma_hat=gamma)
    assert fast == pytest.approx(4 * alpha + S / beta + 0.5 * S / gamma)
    assert paper_model(n, S, alpha, beta, gamma, 4.0, gamma, delta=1e-9) == pytest.approx(
        fast + 1e-3
    )
    assert all(speedup_condition(b, gamma, 4.0, 1.0) for b in (1e3, 1e9, 1e15))
    edge = 6 * gamma / 75
    assert speedup_condition(0.99 * edge, gamma, 4.0, 79.0)
    assert not speedup_condition(1.01 * edge, gamma, 4.0, 79.0)


def test_kernels_draw_from_the_given_index_and_refuse_past_the_counter():
    """The leaf quantizers with an index start and in place equal the reference's
    draws at those indices; indices past 2^32 raise, as the reference's do."""
    k = _cpu_kernels()
    from hopq.numerics.rng import uniform

    x = torch.randn(5000) * 3
    key, start = (11, 22), 123_457
    got = x.clone()
    k.linear_quantize(got, 7.0, 31, key, start=start, out=got)
    v = x.double() * 7.0
    u = uniform(5000, key, offset=start).double()
    ref = (torch.floor(v) + (u < v - torch.floor(v)).double()).clamp(-31, 31)
    assert torch.equal(got, ref.float())
    assert torch.equal(
        k.exp_quantize(x, 5.0, 3, key, start=start),
        k.exp_quantize(x, 5.0, 3, key, start=start, out=x.clone()),
    )
    for call in (
        lambda: k.linear_quantize(x, 7.0, 31, key, start=2**32 - 10),
        lambda: k.exp_quantize(x, 5.0, 3, key, start=-1),
        lambda: uniform(5000, key, offset=2**32 - 10),
    ):
        with pytest.raises(ValueError, match="32-bit counter"):
            call()
