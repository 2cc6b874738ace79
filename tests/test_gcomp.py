"""GComp: lossless round trip, truncation error bounds, the Huffman code's
properties, table rebuilds and ids, header validation, kernel == reference,
optimizer thresholds."""

import pytest
import torch

import hopq
from hopq.codecs.base import HopContext, LocalStats
from hopq.codecs.gcomp import GComp
from hopq.codecs.gcomp import format as fmt
from hopq.codecs.gcomp import reference as ref
from hopq.codecs.gcomp.huffman import ESC, build_table, canonical_codes
from hopq.codecs.gcomp.optim import thresholds
from hopq.errors import PayloadError

C = 1000  # small chunks: several per payload


def _grad(n, seed=0, zeros=0.4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) * 1e-3
    x[torch.rand(n, generator=g) < zeros] = 0
    return x


def _both(fn):
    from hopq.codecs.gcomp import kernels_cpu as gcomp_cpu

    return [fn(ref), fn(gcomp_cpu)]


def _encode_both(x, th, fixed, t):
    from hopq.codecs.gcomp import kernels_cpu as gcomp_cpu

    return ref.encode(x, th, fixed, t, C), gcomp_cpu.encode(x, th, fixed, t, C)


def test_lossless_when_truncation_is_off():
    x = _grad(5003)
    x[[1, 2, 3, 4]] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])
    x[5] = -0.0
    t = build_table(ref.histogram(x), 8)
    p = ref.encode(x, None, -1, t, C)
    y = ref.decode(p, x.numel(), t, C)
    normal = (x.abs() >= torch.finfo(torch.float32).smallest_normal) & ~x.isnan()
    assert torch.equal(x[normal].view(torch.int32), y[normal].view(torch.int32))
    assert y[1].isnan() and y[2] == float("inf") and y[3] == -float("inf")
    assert y[4].view(torch.int32) == 0 and y[5].view(torch.int32) == 0  # flushed to +0
    assert p.numel() < 0.75 * 4 * x.numel()  # zeros cost their code only


@pytest.mark.parametrize("level", [1, 2, 3])
def test_truncation_error_bounds(level):
    x = _grad(4000, seed=level, zeros=0)
    t = build_table(ref.histogram(x), 10)
    y = ref.decode(ref.encode(x, None, level, t, C), x.numel(), t, C)
    k = 6 * level
    err = (y - x).abs()
    assert (err < x.abs() * 2.0 ** (k - 23)).all()
    assert (y.abs() <= x.abs()).all()  # toward zero
    # thresholds: every value errs by less than 2^-23 |A|, and levels are used
    thr = x.abs() * 2 ** (torch.rand(x.numel(), generator=torch.Generator().manual_seed(1)) * 24)
    p = ref.encode(x, thr, -1, t, C)
    y = ref.decode(p, x.numel(), t, C)
    assert ((y - x).abs() <= thr * 2.0**-23).all()
    lv = ref.levels(x, thr, -1)
    assert set(lv.tolist()) == {0, 1, 2, 3}
    assert p.numel() < ref.encode(x, None, -1, t, C).numel()


def test_huffman_canonical_limited_escape():
    hist = [0] * 256
    for e in range(100, 131):
        hist[e] = int(1e7 * 2.0 ** -abs(e - 121))
    hist[0] = 10**7
    t = build_table(hist, 8)
    lengths = t.lengths.tolist()
    assert sum(2.0**-n for n in lengths) <= 1.0  # Kraft: a prefix code
    assert max(lengths) <= 30
    codes = canonical_codes(lengths)
    order = sorted(range(256), key=lambda s: (lengths[s], s))
    for a, b in zip(order, order[1:], strict=False):  # consecutive in (length, symbol)
        assert (codes[a] + 1) << (lengths[b] - lengths[a]) == codes[b]
    # frequent exponents get short codes, deterministic (same histogram, same id)
    assert lengths[0] <= 2 and lengths[121] <= 2
    assert build_table(hist, 8).table_id == t.table_id
    # escape: every long code becomes prefix + 8 raw bits (n_theta + 8 bits)
    longs = [s for s in range(256) if lengths[s] > 8]
    assert longs and all(int(t.enc_len[s]) == 16 for s in longs)
    assert all(int(t.enc_code[s]) >> 8 == t.esc and int(t.enc_code[s]) & 255 == s for s in longs)
    assert int(t.lut_sym[t.esc]) == ESC
    first = min(longs, key=lambda s: (lengths[s], s))
    assert t.esc == codes[first] >> (lengths[first] - 8)
    # the escape prefix is no short code's prefix (and vice versa): decodable
    for s in range(256):
        if lengths[s] <= 8:
            assert codes[s] != t.esc >> (8 - lengths[s])
    x = torch.tensor([2.0**-27, 2.0**-100, 2.0**100, 0.0]).repeat(50)  # rare exponents
    y = ref.decode(ref.encode(x, None, -1, t, C), x.numel(), t, C)
    assert torch.equal(x, y)


def test_kernel_equals_reference():
    pytest.importorskip("numba")
    from hopq.codecs.gcomp import kernels_cpu as gcomp_cpu

    for seed, n in enumerate((0, 1, 7, 999, 1000, 1001, 5003)):
        x = _grad(n, seed=seed)
        if n > 10:
            x[3], x[4], x[5] = float("nan"), -float("inf"), 1e-41
        thr = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * x.abs() * 2**19
        for nt in (6, 10, 16):
            t = build_table(ref.histogram(x[: n // 2]), nt)  # a table not fitted to x
            for th, fixed in ((None, -1), (thr, -1), (None, 3)):
                p, q = _encode_both(x, th, fixed, t)
                assert torch.equal(p, q), (n, nt, fixed)
                y = ref.decode(p, n, t, C)
                z = torch.ones(n)
                gcomp_cpu.decode(p, n, t, C, z, True)
                assert torch.equal((y + 1).view(torch.int32), z.view(torch.int32))


def test_kernel_equals_reference_on_chunks_of_several_sub_blocks():
    """Chunks longer than the encoder's sub-block (its writers carry their state
    across sub-blocks; the levels go 16 values per record, the last group
    short): encode, decode and the fused hop give the reference's bits."""
    pytest.importorskip("numba")
    from hopq.codecs.gcomp import _kernels_cpu_jit as _gcomp_cpu_jit
    from hopq.codecs.gcomp import kernels_cpu as gcomp_cpu

    big = 2 * _gcomp_cpu_jit.SUB + 905  # neither a multiple of SUB nor of 16
    n = 2 * big + 37
    x, w = _grad(n, seed=11, zeros=0.3), _grad(n, seed=12, zeros=0.01)
    thr = torch.rand(n, generator=torch.Generator().manual_seed(3)) * x.abs() * 2**19
    t = build_table(ref.histogram(x), 10)
    for th, fixed in ((None, -1), (thr, -1), (None, 1)):
        p = ref.encode(w, th, fixed, t, big)
        assert torch.equal(gcomp_cpu.encode(w, th, fixed, t, big), p), fixed
        z = torch.empty(n)
        gcomp_cpu.decode(p, n, t, big, z, False)
        want_sum = x + ref.decode(p, n, t, big)
        assert torch.equal(z.view(torch.int32), ref.decode(p, n, t, big).view(torch.int32))
        local = x.clone()
        got = gcomp_cpu.hop(p, local, th, fixed, t, big)
        assert torch.equal(got, ref.encode(want_sum, th, fixed, t, big)), fixed
        assert torch.equal(local.view(torch.int32), want_sum.view(torch.int32))


def test_kernels_equal_reference_on_random_shapes_and_bit_patterns():
    """Random lengths, chunk sizes, escape thresholds and inputs (wide magnitudes,
    half zeros, arbitrary float32 bit patterns with NaN and Inf): encode,
    decode and the fused hop give the reference's bits. The encoder's writer
    appends two values' records at once (up to 48 bits), so long codes and
    untruncated mantissas side by side are the case to hit."""
    pytest.importorskip("numba")
    from hopq.codecs.gcomp import kernels_cpu as gcomp_cpu

    g = torch.Generator().manual_seed(5)
    for case in range(24):
        n = int(torch.randint(1, 6000, (1,), generator=g))
        chunk = int(torch.randint(1, 5000, (1,), generator=g))
        nt = int(torch.randint(4, 17, (1,), generator=g))
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)
        if case % 3 == 1:
            x[torch.rand(n, generator=g) < 0.5] = 0
        if case % 3 == 2:
            bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64)
            x = bits.to(torch.int32).view(torch.float32).clone()
        t = build_table(ref.histogram(torch.randn(64, generator=g)), nt)  # escapes galore
        w = x.flip(0).clone()
        thr = torch.rand(n, generator=g) * x.abs().nan_to_num(0, 0, 0) * 2**19
        for th, fixed in ((None, -1), (thr, -1), (None, case % 4)):
            p = ref.encode(w, th, fixed, t, chunk)
            assert torch.equal(gcomp_cpu.encode(w, th, fixed, t, chunk), p), (case, fixed)
            y = ref.decode(p, n, t, chunk)
            z = torch.empty(n)
            gcomp_cpu.decode(p, n, t, chunk, z, False)
            assert torch.equal(z.view(torch.int32), y.view(torch.int32)), (case, fixed)
            local = x.clone()
            got = gcomp_cpu.hop(p, local, th, fixed, t, chunk)
            assert torch.equal(local.view(torch.int32), (x + y).view(torch.int32)), case
            assert torch.equal(got, ref.encode(x + y, th, fixed, t, chunk)), (case, fixed)


def test_accumulating_kernels_keep_signed_zeros_and_nan_bits():
    """The accumulating decoder and the hop store a pair's second sum without
    branching on whether its code was there (adding -0.0 instead): locals of
    -0.0, +0.0 and signalling NaNs, zeros among the sent values (which travel
    as zeros) and codes too long to pair give the reference's bits."""
    pytest.importorskip("numba")
    from hopq.codecs.gcomp import kernels_cpu as gcomp_cpu

    g = torch.Generator().manual_seed(9)
    n = 4099
    snan = torch.tensor([0x7F800001, -0x7EDCBB], dtype=torch.int32).view(torch.float32)
    local = torch.full((n,), -0.0)
    local[::7] = snan[0]
    local[3::11] = snan[1]
    local[1::5] = 0.0
    w = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8)
    w[torch.rand(n, generator=g) < 0.4] = -0.0
    for nt in (4, 10):
        t = build_table(ref.histogram(torch.randn(16, generator=g)), nt)  # long codes
        p = ref.encode(w, None, -1, t, 1000)
        want = local + ref.decode(p, n, t, 1000)
        z = local.clone()
        gcomp_cpu.decode(p, n, t, 1000, z, True)
        assert torch.equal(z.view(torch.int32), want.view(torch.int32)), nt
        h = local.clone()
        got = gcomp_cpu.hop(p, h, None, -1, t, 1000)
        assert torch.equal(h.view(torch.int32), want.view(torch.int32)), nt
        assert torch.equal(got, ref.encode(want, None, -1, t, 1000)), nt


def test_table_rebuilt_every_k_calls_per_key_and_ids_checked():
    codec = GComp(rebuild_every=3)
    xs = [[_grad(3000, seed=10 * s + r) * (10.0**s) for r in range(2)] for s in range(7)]
    ids, rebuilt = [], []
    for s in range(7):
        r = hopq.simulate(xs[s], codec, "ring", key=4)
        assert r.identical
        entry = codec.tables["4"]
        ids.append(tuple(entry[0]))
        rebuilt.append(r.stats[0].stats_bytes > 0)
    assert rebuilt == [True, False, False, True, False, False, True]
    assert ids[0] == ids[1] == ids[2] != ids[3]
    hopq.simulate(xs[0], codec, "ring", key=5)  # another key: its own table
    assert set(codec.tables) == {"4", "5"}
    # a payload coded with another table is refused by its id
    a, b = GComp(), GComp()
    x, w = _grad(2000, seed=1), _grad(2000, seed=2) * 1e6
    pa = a.plan(x, LocalStats(n_chunks=1))
    pb = b.plan(w, LocalStats(n_chunks=1))
    assert pa.table.table_id != pb.table.table_id
    ctx = HopContext(0, 0, 0, 0, 0, 1)
    payload = a.encode(pa, x, ctx)
    with pytest.raises(PayloadError, match="table"):
        b.decode(pb, payload, ctx, torch.zeros(2000))


def test_header_fields_validated():
    x = _grad(2500)
    t = build_table(ref.histogram(x), 10)
    good = ref.encode(x, None, -1, t, C)
    ref.decode(good, 2500, t, C)
    words = fmt.BLOCK_WORDS + 3 * fmt.CHUNK_WORDS
    for w in range(words):  # any header word changed: refused
        for delta in (1, -1, 1 << 20):
            p = good.clone()
            v = p[: 4 * words].view(torch.int32)
            v[w] += delta
            for dec in _both(lambda m: m):
                with pytest.raises(PayloadError):
                    if dec is ref:
                        ref.decode(p, 2500, t, C)
                    else:
                        dec.decode(p, 2500, t, C, torch.zeros(2500), False)
    with pytest.raises(PayloadError):
        ref.decode(good, 2499, t, C)  # the plan says another size
    with pytest.raises(PayloadError):
        ref.decode(good[:-1], 2500, t, C)


def test_stream_fuzzing_kernel_and_reference_agree():
    """Random bit flips in the streams: both decoders raise PayloadError or
    return the same values (a flip can still leave a valid stream)."""
    from hopq.codecs.gcomp import kernels_cpu as gcomp_cpu

    x = _grad(3000, seed=4)
    t = build_table(ref.histogram(x), 10)
    good = ref.encode(x, None, -1, t, C)
    head = fmt.BLOCK_BYTES + 3 * fmt.CHUNK_BYTES
    g = torch.Generator().manual_seed(0)
    raised = 0
    for _ in range(150):
        p = good.clone()
        i = int(torch.randint(head, p.numel(), (1,), generator=g))
        p[i] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
        try:
            y = ref.decode(p, 3000, t, C)
        except PayloadError:
            y = None
        z = torch.zeros(3000)
        try:
            gcomp_cpu.decode(p, 3000, t, C, z, False)
        except PayloadError:
            z = None
        assert (y is None) == (z is None)
        if y is None:
            raised += 1
        else:
            assert torch.equal(y.view(torch.int32), z.view(torch.int32))
    assert raised > 10  # most flips land in mantissas, which any bits decode


def test_optimizer_thresholds_follow_table_2():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50, dtype=torch.float64))  # exact updates
    for make in (
        lambda: torch.optim.SGD([p], lr=0.1),
        lambda: torch.optim.SGD([p], lr=0.1, weight_decay=0.01),
        lambda: torch.optim.SGD([p], lr=0.1, momentum=0.9),
        lambda: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda: torch.optim.Adam([p], lr=1e-3, weight_decay=1e-2),
        lambda: torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2),
    ):
        opt = make()
        for _ in range(3):  # build state
            p.grad = torch.randn(50, dtype=torch.float64) * 1e-3
            opt.step()
        # delta = A / g, checked against the update itself: theta_new = rest - term(g)
        # with g = 0 vs g: the g-free part over the g part equals A / g
        g = torch.randn(50, dtype=torch.float64) * 1e-3
        A = thresholds(opt, [p]).double()
        import copy

        rest = _step(copy.deepcopy(opt), p, torch.zeros(50))
        full = _step(copy.deepcopy(opt), p, g)
        if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            continue  # v_t depends on g: the threshold is the paper's approximation
        delta = rest / (rest - full)
        assert torch.allclose(delta.abs(), A / g.abs(), rtol=1e-4), type(opt).__name__
    with pytest.raises(ValueError, match="no truncation rule"):
        thresholds(torch.optim.Adagrad([p]), [p])
    # the hooks refuse it when built, not at their first bucket (on the hook's thread)
    with pytest.raises(ValueError, match="no truncation rule for Adagrad"):
        hopq.HookState(codec="gcomp", optimizer=torch.optim.Adagrad([p]))


def _step(opt, p, g):
    q = opt.param_groups[0]["params"][0]
    q.grad = g.to(q.dtype)
    saved = q.detach().clone()
    opt.step()
    out = q.detach().double().clone()
    with torch.no_grad():
        q.copy_(saved)
    return out


def test_thresholds_in_the_all_reduce_bound_the_error_of_the_average():
    """Per-hop truncation with |v| 2^k < |A|: the averaged result errs by at most
    2^-23 |A| (plus float32 rounding) on every topology, and costs fewer bytes."""
    n = 4
    xs = [_grad(6000, seed=r, zeros=0.2) for r in range(n)]
    A = torch.rand(6000, generator=torch.Generator().manual_seed(9)) * 2e-3 * 2**18
    exact = torch.stack(xs).double().mean(0)
    for topo in ("ring", "butterfly"):
        plain = hopq.simulate(xs, "gcomp", topo, op="avg")
        codec = GComp()
        codec.set_thresholds(A, key=1)
        r = hopq.simulate(xs, codec, topo, op="avg", key=1)
        assert r.identical
        mag = torch.stack(xs).double().abs().sum(0) / n
        err = (r.outputs[0].double() - exact).abs()
        assert (err <= A.double() * 2.0**-23 + 8 * 2.0**-24 * mag + 1e-37).all(), topo
        assert sum(r.bytes_sent) < 0.8 * sum(plain.bytes_sent)


def test_ddp_hook_with_optimizer_in_a_real_gloo_job():
    """HookState(codec="gcomp", optimizer=AdamW) in a 2-rank Gloo DDP job: replicas
    bit-identical, fewer payload bytes than the fp32 hook, and the training tracks
    plain DDP (truncation only drops bits the AdamW update would lose)."""
    from hopq.cluster.launch import run_workers
    from tests.workers import TinyNet
    from tests.workers_gcomp import ddp_gcomp_adamw

    steps = 6
    res = run_workers(2, ddp_gcomp_adamw, steps)
    gc, plain, f32 = res[0]["gcomp"], res[0]["None"], res[0]["fp32"]
    assert torch.equal(res[1]["gcomp"], gc)  # replicas bit-identical
    assert res[0]["gcomp/calls"] > steps  # several buckets per step went through the hook
    assert res[0]["gcomp/thresholds"]  # the optimizer's thresholds reached the codec
    for r in range(2):
        assert res[r]["gcomp/payload"] < 0.95 * res[r]["fp32/payload"]  # measured 0.89
    torch.manual_seed(0)
    init = torch.cat([p.detach().reshape(-1) for p in TinyNet().parameters()])
    update = (plain - init).norm().item()
    assert update > 1e-2
    # fp32 hook vs plain DDP: summation order only; gcomp: that plus truncations
    # within 2^-23 |A| of the averaged gradient
    assert (f32 - plain).norm().item() <= 1e-4 * update
    assert (gc - plain).norm().item() <= 1e-3 * update
    for a, b in zip(res[0]["gcomp/losses"], res[0]["None/losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)


def test_fused_hop_kernel_equals_reference_hop():
    """The kernel hop (decode, add, encode the sum, chunk by chunk) gives the
    reference's decode-accumulate-then-encode bits, sums included, and refuses
    corrupt payloads like the decoder."""
    pytest.importorskip("numba")
    from hopq.codecs.gcomp import kernels_cpu as gcomp_cpu

    for seed, n in enumerate((1, 7, 1000, 2501)):
        x, w = _grad(n, seed=seed), _grad(n, seed=seed + 50)
        if n > 10:
            x[3], w[4], w[5] = float("nan"), float("inf"), -w[6]  # a cancellation to 0
        thr = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * x.abs() * 2**19
        for nt in (6, 10):
            t = build_table(ref.histogram(torch.cat([x, w])), nt)
            for th, fixed in ((None, -1), (thr, -1), (None, 2)):
                p = ref.encode(w, th, fixed, t, C)
                want_sum = x + ref.decode(p, n, t, C)
                want = ref.encode(want_sum, th, fixed, t, C)
                local = x.clone()
                got = gcomp_cpu.hop(p, local, th, fixed, t, C)
                assert torch.equal(got, want), (n, nt, fixed)
                assert torch.equal(local.view(torch.int32), want_sum.view(torch.int32))
    x = _grad(3000, seed=8)
    t = build_table(ref.histogram(x), 10)
    good = ref.encode(x, None, -1, t, C)
    head = fmt.BLOCK_BYTES + 3 * fmt.CHUNK_BYTES
    g = torch.Generator().manual_seed(1)
    for _ in range(60):
        p = good.clone()
        i = int(torch.randint(head, p.numel(), (1,), generator=g))
        p[i] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
        try:
            y = ref.decode(p, 3000, t, C)
        except PayloadError:
            with pytest.raises(PayloadError):
                gcomp_cpu.hop(p, x.clone(), None, -1, t, C)
            continue
        assert torch.equal(
            gcomp_cpu.hop(p, x.clone(), None, -1, t, C), ref.encode(x + y, None, -1, t, C)
        )


def test_bench_gcomp_tiny(tmp_path):
    """``hopq bench gcomp`` at a tiny size: both parts, a table row per
    (workload, optimizer), sizes that are fractions, the plot written."""
    from hopq.bench.gcomp import GCompBenchOptions, run, train_sizes

    o = GCompBenchOptions(
        workloads=("gpt",),
        steps=3,
        workers=2,
        batch=2,
        rebuild_every=2,
        gpt_dim=32,
        gpt_layers=1,
        context=32,
        kernel_coords=5000,
        repeats=1,
        plot=str(tmp_path / "size.png"),
        loss_plot=str(tmp_path / "loss.png"),
        sync_every=2,
    )
    text = run(o, log=lambda _s: None)
    assert "## Kernels" in text and "fused hop" in text
    assert "| torch fp16 cast |" in text and "of its speed" in text  # what users have
    assert "## Kernels on the real gradients" in text  # sizes and kernels: both gradients
    assert "the optimizer's thresholds took" in text and "s per step on one core" in text
    lines = [" ".join(line.split()) for line in text.splitlines()]
    for run_ in ("gpt / adamw", "gpt / sgd"):
        for mode in ("thresholds", "none", "torch fp16 cast"):
            assert any(line.startswith(f"| {run_} | {mode} |") for line in lines), (run_, mode)
    assert "## Loss deviation" in text and (tmp_path / "loss.png").exists()
    assert "|      gpt |       sgd |" in text and "|      gpt |     adamw |" in text
    assert (tmp_path / "size.png").exists()
    ss = train_sizes(o, "gpt", "adamw", lambda _s: None).steps
    assert len(ss) == 3
    for s in ss:
        assert 0 < s.size <= s.lossless < 1.1
        assert s.exp_bits > 0 and s.exp_static > 0
    # step 0 builds both tables from the same gradient; step 2 rebuilt one of them
    assert ss[0].exp_bits == ss[0].exp_static
    with pytest.raises(ValueError, match="unknown parts"):
        GCompBenchOptions(parts=("nope",))
    with pytest.raises(ValueError, match="sync-every"):
        GCompBenchOptions(sync_every=1)


def test_gcomp_loss_methods_tiny():
    """Section 7.6's methods from the same start: GComp without truncation
    follows fp32 to within float rounding; the baselines deviate more."""
    from hopq.bench.gcomp import GCompBenchOptions, train_losses

    o = GCompBenchOptions(
        workloads=("gpt",), steps=3, workers=2, batch=1, gpt_dim=32, gpt_layers=1,
        context=32, sync_every=2,
    )  # fmt: skip
    curves = {m: train_losses(o, "gpt", "sgd", m, lambda _s: None) for m in
              ("fp32", "gcomp", "truncate-18", "periodic")}  # fmt: skip
    assert curves["fp32"][0] == curves["gcomp"][0] == curves["periodic"][0]  # same start
    dev = {m: abs(curves[m][-1] - curves["fp32"][-1]) for m in curves}
    assert dev["gcomp"] < 1e-4 and dev["gcomp"] <= dev["truncate-18"]


def test_bench_bias_part_stays_within_the_allowance():
    """``hopq bench gcomp --parts bias``: per-hop truncation errs toward zero and
    within one allowance 2^-23 |A| per coordinate, and it shrinks the payload."""
    from hopq.bench.gcomp import GCompBenchOptions, bias_rows

    for _topo, mean, _largest, beyond, size, lossless in bias_rows(20_000, 4):
        assert beyond == 0  # no coordinate beyond the allowance
        assert float(mean) <= 0.0
        assert float(size) < float(lossless)
    with pytest.raises(ValueError, match="bias"):
        GCompBenchOptions(parts=("kernels",), bias_coords=1000)


def test_gcomp_without_optimizer_warns_at_the_first_bucket():
    """HookState("gcomp") that never gets its optimizer says, once, that it
    truncates nothing; one set on the state before training does not warn."""
    from hopq.cluster.launch import run_workers
    from tests.workers_gcomp import gcomp_optimizer_warning

    (res,) = run_workers(1, gcomp_optimizer_warning)
    assert len([m for m in res["none"] if "without optimizer=" in m]) == 1
    assert not [m for m in res["later"] if "without optimizer=" in m]
