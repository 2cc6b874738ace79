"""DynamiQ's own guarantees (the registry grid covers the generic ones)."""

import itertools
import math

import pytest
import torch

import hopq
from hopq.codecs.dynamiq import DynamiQ, DynamiQConfig, allocation


def _grads(n, d, seed=0, skew=True):
    """Gradient-like inputs: super-groups whose scales span orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 0, (d + 255) // 256)[torch.randperm((d + 255) // 256, generator=g)]
    scale = scale.repeat_interleave(256)[:d] if skew else torch.ones(d)
    return [torch.randn(d, generator=g) * scale for _ in range(n)]


def _bias_ratio(codec_kw, n, topology, runs=150):
    """||mean of runs - exact||^2 over what pure variance predicts (~1 if unbiased)."""
    xs = _grads(n, 700, seed=1)
    exact = torch.stack(xs).double().sum(0)
    acc = torch.zeros(700, dtype=torch.float64)
    sq = 0.0
    for seed in range(runs):
        out = hopq.simulate(xs, DynamiQ(**codec_kw), topology, seed=seed).outputs[0].double()
        acc += out
        sq += (out - exact).square().sum().item()
    return (acc / runs - exact).square().sum().item() / (sq / runs / runs)


@pytest.mark.parametrize("n, topology", [(3, "ring"), (4, "butterfly"), (6, "butterfly")])
def test_unbiased(n, topology):
    # 700 coordinates: the ratio of an unbiased codec is ~ chi2_700 / 700 = 1 +- 0.06
    assert _bias_ratio({}, n, topology) < 1.3


def test_paper_path_correlation_is_biased():
    """The paper's u_i = (pi_i + gamma_i)/n over the whole path correlates a hop with
    the rounding its own input carries: documented as biased, and measurably so."""
    assert _bias_ratio({"rounding": "path"}, 3, "ring") > 2.0


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"budget": 3.0},
        {"budget": 8.0},
        {"allocation": "exact"},
        {"allocation": "fixed"},
        {"widths": (2, 4, 8, 16), "budget": 9.0},
        {"scales": "full", "budget": 6.0},
        {"zero_class": True},
        {"group_size": 32, "supergroup_size": 512},
    ],
)
@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_budget_is_kept(cfg, topology):
    xs = _grads(4, 64 * 1024 + 37)
    r = hopq.simulate(xs, DynamiQ(**cfg), topology, seed=2)
    assert r.identical
    budget = DynamiQConfig(**cfg).budget
    assert r.bits_per_coord <= budget + 1e-9
    assert r.bits_per_coord >= budget - 1.0  # and the budget is actually used
    assert r.vnmse < 0.3  # b = 3 puts nearly everything at 2 bits


def test_budget_orders_error():
    xs = _grads(4, 32 * 1024)
    errs = [hopq.simulate(xs, DynamiQ(budget=b), "ring", seed=0).vnmse for b in (3, 4, 5, 6, 8)]
    assert errs == sorted(errs, reverse=True)


def test_variable_beats_fixed_on_skewed_gradients():
    xs = _grads(4, 64 * 1024)
    fixed = hopq.simulate(xs, DynamiQ(allocation="fixed"), "ring").vnmse
    var = hopq.simulate(xs, DynamiQ(), "ring").vnmse
    assert var < fixed / 2


def _buckets(n, seed):
    """Three "DDP buckets" of one step: a small loud one, a larger quiet one, and a
    large one with a few loud super-groups (the shape of a transformer's gradient)."""
    g = torch.Generator().manual_seed(seed)
    loud = [torch.randn(8 * 1024, generator=g) for _ in range(n)]
    quiet = [1e-3 * torch.randn(40 * 1024 + 5, generator=g) for _ in range(n)]
    mixed = _grads(n, 64 * 1024, seed=seed)
    return [loud, quiet, mixed]


def _keyed_steps(codec, n, steps, topology="ring"):
    """Per step: (error, reference norm, bits) summed over the buckets."""
    out = []
    for step in range(steps):
        err = ref = bits = d = 0.0
        for key, xs in enumerate(_buckets(n, seed=step)):
            r = hopq.simulate(xs, codec, topology, seed=step, key=key)
            assert r.identical
            exact = torch.stack(xs).double().sum(0)
            err += (r.outputs[0].double() - exact).square().sum().item()
            ref += exact.square().sum().item()
            bits += r.bits_per_coord * xs[0].numel()
            d += xs[0].numel()
        out.append((err / ref, bits / d))
    return out


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_shared_budget_across_keyed_calls(topology):
    """Keyed calls (DDP buckets) share the step's budget: the first step, with no
    statistics yet, gives every bucket the budget; from the second step on the
    buckets' bits differ but the step as a whole stays within the budget, every
    rank holds the same bits, and the error drops well below per-bucket budgets'."""
    shared = _keyed_steps(DynamiQ(), 4, 3, topology)
    alone = _keyed_steps(DynamiQ(share_budget=False), 4, 3, topology)
    assert shared[0] == alone[0]  # step 0: nothing to share from yet
    for (e_s, b_s), (e_a, _) in zip(shared[1:], alone[1:], strict=True):
        assert 4.9 <= b_s <= 5.0 + 1e-9
        assert e_s < e_a / 3
    # unkeyed calls keep the per-call budget whatever the setting
    xs = _grads(3, 10_000)
    c = DynamiQ()
    for _ in range(2):
        a = hopq.simulate(xs, c, topology, seed=1)
    b = hopq.simulate(xs, DynamiQ(share_budget=False), topology, seed=1)
    assert a.bits_per_coord == b.bits_per_coord


def test_shared_budget_follows_the_layout():
    """A key whose size changed (DDP rebuilds its buckets after the first step)
    takes the plain budget instead of a share computed for another size."""
    c = DynamiQ()
    xs = _buckets(3, 0)
    for key, x in enumerate(xs):
        hopq.simulate(x, c, "ring", key=key)
    resized = [t[:-1000] for t in xs[1]]
    r = hopq.simulate(resized, c, "ring", key=1)
    plain = hopq.simulate(resized, DynamiQ(share_budget=False), "ring")
    assert r.bits_per_coord == plain.bits_per_coord
    r0 = hopq.simulate(xs[0], c, "ring", key=0)  # unchanged size: its share
    assert r0.bits_per_coord > 6


@pytest.mark.parametrize("d", [1, 15, 17, 255, 257, 1000, 4099])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_ragged_sizes(d, n):
    xs = _grads(n, d, seed=d)
    r = hopq.simulate(xs, "dynamiq", "butterfly" if n != 3 else "ring", seed=d)
    assert r.identical and r.outputs[0].shape == (d,)
    assert all(torch.isfinite(o).all() for o in r.outputs)
    # below ~1000 entries a padded super-group's scales alone exceed the budget: the
    # plan stays at the narrowest width (over_budget), so accuracy is checked above it
    if d >= 1000:
        assert r.vnmse < 0.05


def test_all_zero_and_zero_class_is_exact():
    xs = [torch.zeros(3000) for _ in range(3)]
    r = hopq.simulate(xs, "dynamiq")
    assert all(torch.equal(o, torch.zeros(3000)) for o in r.outputs)
    ys = _grads(3, 4096)
    for y in ys:
        y[1024:2048] = 0.0  # four super-groups zero on every rank
    r = hopq.simulate(ys, DynamiQ(zero_class=True), "ring")
    assert torch.equal(r.outputs[0][1024:2048], torch.zeros(1024))
    off = hopq.simulate(ys, DynamiQ(zero_class=False), "ring")
    assert r.bits_per_coord < off.bits_per_coord or r.vnmse < off.vnmse


def test_single_huge_outlier():
    from hopq.codecs.dynamiq import PAPER

    rest = torch.ones(4096, dtype=torch.bool)
    rest[0:256] = False

    def errors(xs, **config):
        codec = hopq.get_codec("dynamiq", **config)
        out = hopq.simulate(xs, codec, "ring").outputs[0].double()
        exact = torch.stack(xs).double().sum(0)
        rest_err = ((out - exact)[rest].square().sum() / exact[rest].square().sum()).item()
        return out, exact, rest_err, ((out - exact).square().sum() / exact.square().sum()).item()

    xs = _grads(4, 4096, skew=False)
    _, _, clean, _ = errors(xs, **PAPER)
    xs[1][123] = 1e6
    out, exact, err, whole_paper = errors(xs, **PAPER)
    assert abs(out[123].item() - exact[123].item()) < 1e6 * 0.02
    # the paper's allocation: the outlier's super-group pays, the rest keeps its accuracy
    assert err < 1.5 * clean
    # hopq's default (exact allocation, 16-bit class) may spend more of the budget on
    # the outlier's super-group, but only where that lowers the error of the whole
    out, exact, _, whole = errors(xs)
    assert abs(out[123].item() - exact[123].item()) < 1e6 * 0.02
    assert whole <= whole_paper


def test_mean_is_restored():
    xs = [torch.randn(2048) * 0.01 + 3.0 for _ in range(4)]  # large common offset
    for op, div in (("sum", 1), ("avg", 4)):
        r = hopq.simulate(xs, "dynamiq", op=op)
        exact = torch.stack(xs).double().sum(0) / div
        assert (r.outputs[0].double() - exact).abs().max() < 0.01 * 4 / div


def test_heuristic_thresholds_follow_appendix_a():
    """With W = {2, 4, 8}: T_{2,4} = 17/512 T_{4,8}."""
    codec = DynamiQ(budget=8.0)  # budget large enough to matter little
    F = torch.logspace(-20, 20, 4001, base=2.0, dtype=torch.float64)
    live = torch.ones_like(F, dtype=torch.bool)
    cost = {w: codec.config.sg_bits(w) for w in (2, 4, 8)}
    budget = 4.3 * 256 * F.numel()
    w = allocation.heuristic(F, live, [2, 4, 8], cost, budget)
    t24 = F[(w >= 4).nonzero()[0]].item()
    t48 = F[(w >= 8).nonzero()[0]].item()
    assert t24 / t48 == pytest.approx(17 / 512, rel=0.03)  # grid step 2^0.01
    assert sum(cost[int(v)] for v in w) <= budget


def test_exact_allocation_uses_the_budget_greedily():
    F = torch.tensor([1e-6, 1.0, 1e3, 1e6], dtype=torch.float64)
    live = torch.ones(4, dtype=torch.bool)
    codec = DynamiQ()
    cost = {w: codec.config.sg_bits(w) for w in (2, 4, 8)}
    w = allocation.exact(F, live, [2, 4, 8], cost, budget=4 * cost[4])
    assert w.tolist()[0] <= w.tolist()[1] <= w.tolist()[2] <= w.tolist()[3]
    assert sum(cost[int(v)] for v in w) <= 4 * cost[4]


def _exact_by_stable_sort(F, live, W, cost, budget):
    """The exact allocation's definition: every upgrade step ranked by gain in
    one stable sort (ties in (step, super-group) order), the running cost's
    prefix within the budget taken."""

    def err(w):
        return 2.0**-18 if w == 16 else 1.0 / ((1 << (w - 1)) - 1) ** 2

    idx = torch.nonzero(live).flatten()
    Fl = torch.nan_to_num(F[idx], posinf=1e300)
    gains, costs, owners, levels = [], [], [], []
    for k in range(len(W) - 1):
        dc = float(cost[W[k + 1]] - cost[W[k]])
        gains.append(Fl * ((err(W[k]) - err(W[k + 1])) / dc))
        costs.append(torch.full((idx.numel(),), dc, dtype=torch.float64))
        owners.append(idx)
        levels.append(torch.full((idx.numel(),), k + 1, dtype=torch.int64))
    level = torch.zeros(F.numel(), dtype=torch.int64)
    if gains:
        order = torch.sort(-torch.cat(gains), stable=True).indices
        csum = torch.cumsum(torch.cat(costs)[order], 0) + float(cost[W[0]]) * idx.numel()
        take = order[csum <= budget]
        level.scatter_reduce_(0, torch.cat(owners)[take], torch.cat(levels)[take], reduce="amax")
    return torch.tensor(W, dtype=torch.int64)[level]


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "torch-only"])
@pytest.mark.parametrize("kind", ["distinct", "few values", "bf16", "zeros and huge"])
def test_exact_allocation_equals_the_stable_sort_of_all_steps(kind, numpy, monkeypatch):
    """The exact allocation takes whole groups of equal gain and orders only the
    group where the budget runs out: the widths are those of the stable sort of
    every step, at every budget from nothing to everything, with ties (bfloat16
    statistics), zeros, +-0 and huge statistics, live and dead super-groups."""
    g = torch.Generator().manual_seed(len(kind))
    for m in (1, 2, 7, 300, 16384):
        if kind == "distinct":
            F = torch.rand(m, generator=g, dtype=torch.float64)
        elif kind == "few values":
            F = torch.randint(0, 4, (m,), generator=g).double()
        elif kind == "bf16":
            F = (torch.randn(m, generator=g) * 3).exp().to(torch.bfloat16).double()
        else:
            F = torch.randint(0, 3, (m,), generator=g).double()
            F[::7], F[1::11], F[2::13] = 0.0, -0.0, math.inf
        live = torch.rand(m, generator=g) > 0.1
        for W in ([2, 4, 8], [2, 4, 8, 16], [4], [2, 3, 4, 5, 6, 8]):
            cost = {w: DynamiQ().config.sg_bits(w) for w in W}
            lo, hi = cost[W[0]] * m, cost[W[-1]] * m
            for budget in [lo - 1, lo, hi, hi + 1] + torch.linspace(lo, hi, 23).tolist()[1:-1]:
                want = _exact_by_stable_sort(F, live, W, cost, budget)
                got = allocation.exact(F, live, W, cost, budget)
                assert torch.equal(got, want), (kind, m, W, budget)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"budget": 2.0}, "below the metadata cost"),
        ({"group_size": 24}, "power of two"),
        ({"group_size": 512, "supergroup_size": 256}, "does not divide"),
        ({"widths": (3, 4)}, "widths"),
        ({"widths": ()}, "widths"),
        ({"levels": "log"}, "levels"),
        ({"allocation": "magic"}, "allocation"),
        # an eps no level table has is refused, not ignored
        ({"eps": ((2, 5.0),)}, "4- and 8-bit level tables only"),
        ({"eps": ((16, 0.1),)}, "4- and 8-bit level tables only"),
        # an eps that the other options would ignore is refused too
        ({"eps": ((4, 0.3),), "levels": "uniform"}, "uniform"),
        ({"widths": (2, 4), "eps": ((8, 0.2),)}, "not among the widths"),
    ],
)
def test_invalid_configs(kw, words):
    with pytest.raises(ValueError, match=words):
        DynamiQ(**kw)


def test_correlated_rounding_is_no_worse_on_butterfly():
    # equal inputs: the correlated leaves round the same values, so their errors
    # cancel; but on a butterfly the last stages' roundings (of sums up to n times
    # larger) dominate the error, so the gain is small (0.2% here, 1-3% on real
    # gradients in docs/bench/vnmse.md) and 4 seeds cannot resolve it: the
    # guarantee tested is that correlating costs nothing beyond noise
    xs = _grads(1, 8192, skew=False) * 8
    corr = sum(
        hopq.simulate(xs, DynamiQ(rounding="correlated"), "butterfly", seed=s).vnmse
        for s in range(8)
    )
    ind = sum(
        hopq.simulate(xs, DynamiQ(rounding="independent"), "butterfly", seed=s).vnmse
        for s in range(8)
    )
    assert corr < 1.01 * ind


def test_payload_validation():
    xs = _grads(2, 1024)
    codec = DynamiQ()
    r = hopq.simulate(xs, codec)
    assert r.identical and not math.isnan(r.vnmse)


def test_chunk_local_layout_keeps_the_whole_vector_error():
    """Over FSDP's rank shards (the reduce-scatter's chunk-local layout: the
    reorder confined to each shard, the allocation global), vNMSE stays that of
    the whole-vector DynamiQ at the same accounting (measured 0.99x here; the
    full table: docs/codecs/dynamiq.md), and the reduce-scatter keeps its budget
    under its own accounting, the statistics weighing double."""
    from hopq.bench.shards import fsdp_input, synthetic_layers

    xs = [fsdp_input(w[:12], 4) for w in synthetic_layers(4, 1)]
    whole = hopq.simulate(xs, "dynamiq", "ring", op="avg")
    local = hopq.simulate(xs, "dynamiq", "ring", op="avg", shards="equal")
    rs = hopq.simulate_reduce_scatter(xs, "dynamiq", "ring", op="avg")
    assert local.vnmse < 1.1 * whole.vnmse
    assert 4.95 < rs.bits_per_coord <= 5.0 + 1e-6
    assert 4.95 < local.bits_per_coord <= 5.0 + 1e-6
    # fewer payload bits (the statistics weigh double): a little more error
    assert local.vnmse < rs.vnmse < 1.5 * local.vnmse


@pytest.mark.parametrize("seed", range(6))
def test_layout_follows_its_definition(seed):
    """The plan's layout, written as loops over super-groups (the definition):
    super-groups stably sorted by width (within each caller chunk), chunks cut
    where a super-group's byte midpoint passes c / n of the bytes, segments the
    runs of one width inside each chunk."""
    from hopq.codecs.dynamiq.layout import build_plan

    g = torch.Generator().manual_seed(seed)
    cfg = DynamiQConfig()
    m = int(torch.randint(0, 300, (1,), generator=g))
    widths = [(0, 2, 4, 8, 16)[int(i)] for i in torch.randint(0, 5, (m,), generator=g)]
    n, micro = 1 + seed % 4, 1 + seed % 3
    chunked = seed % 2 == 1 and m > 4
    starts = (0, m // 3, m // 2, m) if chunked else ()
    bounds = tuple(s * cfg.supergroup_size for s in starts) if chunked else None

    def cut(sizes, parts):
        total, acc, k, out = sum(sizes), 0, 0, [0]
        for c in range(1, parts):
            while k < len(sizes) and acc + sizes[k] / 2 <= total * c / parts:
                acc, k = acc + sizes[k], k + 1
            out.append(k)
        return [*zip(out, [*out[1:], len(sizes)], strict=True)]

    ranges = list(itertools.pairwise(starts)) if chunked else [(0, m)]
    order = [j for lo, hi in ranges for j in sorted(range(lo, hi), key=lambda j: widths[j])]
    sw = [widths[j] for j in order]
    nbytes = [cfg.sg_bits(w) // 8 for w in sw]
    chunks = []
    for lo, hi in ranges:
        for a, b in cut(nbytes[lo:hi], 1 if chunked else n):
            chunks += [(lo + a + p, lo + a + q) for p, q in cut(nbytes[lo + a : lo + b], micro)]
    plan = build_plan(cfg, m * 256, widths, n, torch.zeros(m), 5.0, micro, bounds, starts)
    assert plan.perm.tolist() == order and list(plan.widths) == sw
    assert plan.chunks == tuple((a * 256, b * 256) for a, b in chunks)
    for (lo, hi), segs in zip(chunks, plan.segments, strict=True):
        runs = [
            (k, e)
            for k, e in itertools.pairwise(
                [lo, *[k for k in range(lo + 1, hi) if sw[k] != sw[k - 1]], hi]
            )
            if e > k
        ]
        assert [(s.lo, s.hi, s.width, s.nbytes) for s in segs] == [
            (k, e, sw[k], sum(nbytes[k:e])) for k, e in runs
        ]


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "torch-only"])
def test_plan_orders_super_groups_by_width_stably(numpy, monkeypatch):
    """The plan reorders super-groups by width, ties in position order (the
    stable sort), with numpy's radix sort and on a torch-only install."""
    from hopq.codecs.dynamiq.layout import _stable_order

    if not numpy:
        monkeypatch.setitem(__import__("sys").modules, "numpy", None)
    g = torch.Generator().manual_seed(3)
    for m in (0, 1, 5, 16384):
        w = torch.tensor([0, 2, 4, 8, 16])[torch.randint(0, 5, (m,), generator=g)]
        assert torch.equal(_stable_order(w), torch.argsort(w, stable=True))
