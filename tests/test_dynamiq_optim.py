"""DynamiQ's allocation weighed by the optimizer's step sizes (optim.py)."""

from __future__ import annotations

import pytest
import torch

import hopq
from hopq.codecs.dynamiq.optim import step_sizes
from hopq.sim import virtual_ranks


def _stepped(opt_cls, **kw):
    """Two parameters and ``opt_cls`` after two steps on fixed gradients."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7))]
    opt = opt_cls(ps, **kw)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) * torch.linspace(0.01, 3, p.numel()).view(
                p.shape
            )
        opt.step()
    return ps, opt


@pytest.mark.parametrize(
    "cls, kw",
    [
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {}),
        (torch.optim.AdamW, {"amsgrad": True}),
        (torch.optim.NAdam, {}),
    ],
)
def test_adam_step_sizes_follow_the_formula(cls, kw):
    ps, opt = _stepped(cls, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, **kw)
    r = step_sizes(opt, ps)
    assert r is not None and r.dtype == torch.float32 and r.numel() == 22
    want = []
    for p in ps:
        st = opt.state[p]
        v = st["max_exp_avg_sq" if kw else "exp_avg_sq"].double() / (1 - 0.95 ** float(st["step"]))
        want.append((3e-3 / (v.sqrt() + 1e-6)).reshape(-1))
    torch.testing.assert_close(r.double(), torch.cat(want), rtol=1e-6, atol=0)


def _f32(x):
    """float64 values rounded to float32 (one IEEE operation's result)."""
    return x.float().double()


def test_step_sizes_are_correctly_rounded_so_a_gpu_gives_the_same_bits():
    """Every operation of the step size is IEEE's correctly rounded float32 one,
    as on a GPU: torch's CPU float32 sqrt is not (0.7% one ulp off), and torch's
    CUDA division by a Python number multiplies by its reciprocal. Without
    hopq.numerics, 7% of AdamW's step sizes differed between an H100 and the
    CPU (tools/gpu_check.py)."""
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.zeros(200_000))
    opt = torch.optim.AdamW([p], lr=3e-4, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(3):
        p.grad = torch.randn(p.numel(), generator=g) * torch.logspace(-6, 1, p.numel())
        opt.step()
    r = step_sizes(opt, [p])
    v = opt.state[p]["exp_avg_sq"].double()
    bc2 = _f32(torch.tensor(1 - 0.999 ** float(opt.state[p]["step"]), dtype=torch.float64))
    want = _f32(v / bc2)  # each step rounded once, as IEEE float32 arithmetic does
    want = _f32(want.sqrt())
    want = _f32(want + _f32(torch.tensor(1e-8, dtype=torch.float64)))
    want = _f32(1.0 / want)
    want = _f32(want * _f32(torch.tensor(3e-4, dtype=torch.float64)))
    assert torch.equal(r, want.float())


def test_rmsprop_adagrad_and_sgd_step_sizes():
    ps, opt = _stepped(torch.optim.RMSprop, lr=1e-2, eps=1e-8, centered=True)
    r = step_sizes(opt, ps)
    st = opt.state[ps[0]]
    v = st["square_avg"] - st["grad_avg"].square()
    torch.testing.assert_close(r[:15], (1e-2 / (v.clamp(min=0).sqrt() + 1e-8)).reshape(-1))
    ps, opt = _stepped(torch.optim.Adagrad, lr=0.1, lr_decay=0.5, eps=1e-10)
    r = step_sizes(opt, ps)
    st = opt.state[ps[1]]
    clr = 0.1 / (1 + (float(st["step"]) - 1) * 0.5)
    torch.testing.assert_close(r[15:], clr / (st["sum"].sqrt() + 1e-10))
    # SGD: the learning rate; one for all -> nothing to weigh
    ps, opt = _stepped(torch.optim.SGD, lr=0.1, momentum=0.9)
    assert step_sizes(opt, ps) is None
    opt = torch.optim.SGD([{"params": [ps[0]], "lr": 0.1}, {"params": [ps[1]], "lr": 0.01}])
    r = step_sizes(opt, ps)
    assert r is not None and torch.equal(r, torch.tensor([0.1] * 15 + [0.01] * 7))


def test_parameters_without_state_take_the_mean_step_size():
    """A parameter the optimizer has not stepped yet (no gradient so far: unused,
    or newly unfrozen) beside stepped ones: the mean r of the rest, not a call
    without weights."""
    ps, opt = _stepped(torch.optim.AdamW, lr=1e-3)
    fresh = torch.nn.Parameter(torch.ones(4))
    opt.add_param_group({"params": [fresh]})
    r = step_sizes(opt, [ps[0], fresh, ps[1]])
    full = step_sizes(opt, ps)
    assert r is not None and full is not None and r.numel() == 26
    torch.testing.assert_close(torch.cat([r[:15], r[19:]]), full)
    torch.testing.assert_close(r[15:19], full.double().mean().float().expand(4))


def test_no_step_sizes_before_the_first_step_and_refusals():
    p = torch.nn.Parameter(torch.ones(4))
    assert step_sizes(torch.optim.AdamW([p]), [p]) is None  # no second moments yet
    with pytest.raises(ValueError, match="Adamax"):
        step_sizes(torch.optim.Adamax([p]), [p])
    with pytest.raises(ValueError, match="Adamax"):
        hopq.HookState("dynamiq", optimizer=torch.optim.Adamax([p]))
    with pytest.raises(ValueError, match="not in the optimizer"):
        step_sizes(torch.optim.AdamW([p]), [torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="optimizer_weights=False"):
        hopq.HookState("dynamiq", optimizer=torch.optim.AdamW([p]), optimizer_weights=False)
    codec = hopq.get_codec("dynamiq")
    with pytest.raises(ValueError, match=">= 0"):
        codec.set_step_sizes(torch.tensor([1.0, float("nan")]))
    codec.set_step_sizes(torch.ones(10), key=2)
    with pytest.raises(ValueError, match="cover 10 coordinates, this call has 12"):
        hopq.simulate([torch.ones(12)] * 2, codec, key=2)
    with pytest.raises(ValueError, match="at every call"):
        hopq.FSDPReduceScatter("dynamiq", optimizer=torch.optim.AdamW([p]), thresholds_every=4)
    hopq.FSDPReduceScatter("dynamiq", optimizer=torch.optim.AdamW([p]))  # its weights: taken


def test_supergroup_weights_stand_for_the_step_sizes():
    """Weights per super-group (what FSDP's ranks exchange) give the bits of the
    step sizes they come from: on an all-reduce, and on a reduce-scatter over
    equal shards, whose super-groups start at every shard (weights shard after
    shard). Padding (real = 0) stays out of a super-group's mean."""
    n, d = 3, 3 * 1000  # shards of 1000: 4 super-groups each, the last of 232
    xs = _workers(n, d, 5)
    g = torch.Generator().manual_seed(6)
    r = torch.rand(d, generator=g).pow(3) * 1e-2
    for simulate, spans in (
        (hopq.simulate, [(0, d)]),
        (hopq.simulate_reduce_scatter, [(i * 1000, (i + 1) * 1000) for i in range(n)]),
    ):
        codec = hopq.get_codec("dynamiq")
        codec.set_step_sizes(r, key=1)
        want = simulate(xs, codec, "ring", seed=2, key=1).outputs
        codec = hopq.get_codec("dynamiq")
        w = torch.cat([codec.supergroup_weights(r[a:b]) for a, b in spans])
        codec.set_supergroup_weights(w, key=1)
        got = simulate(xs, codec, "ring", seed=2, key=1).outputs
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # what the exchange cost (spent_bits) comes out of the call's budget
    big = _workers(n, 3 << 15, 7)
    rb = torch.rand(3 << 15, generator=g) * 1e-2
    costs = []
    for spent in (0.0, 0.125):
        codec = hopq.get_codec("dynamiq")
        codec.set_supergroup_weights(codec.supergroup_weights(rb), spent_bits=spent)
        costs.append(hopq.simulate(big, codec, "ring", seed=2).bits_per_coord)
    assert costs[0] - costs[1] == pytest.approx(0.125, abs=0.01)
    with pytest.raises(ValueError, match="spent_bits"):
        codec.set_supergroup_weights(torch.ones(1), spent_bits=-1.0)
    codec = hopq.get_codec("dynamiq")
    real = torch.ones(600)
    real[500:] = 0  # 2 super-groups of 256 and one of 88: 244 real, then 12 real
    w = codec.supergroup_weights(torch.cat([r[:500], torch.zeros(100)]), real)
    torch.testing.assert_close(w[1], r[256:500].square().mean())
    assert w[2] == 0  # padding alone
    with pytest.raises(ValueError, match="cover 5 super-groups, this call has 4"):
        codec.set_supergroup_weights(torch.ones(5), key=2)
        hopq.simulate([torch.ones(1000)] * 2, codec, key=2)
    codec.set_step_sizes(torch.ones(1000), key=3)
    codec.set_supergroup_weights(torch.ones(4), key=3)
    with pytest.raises(ValueError, match="set one"):
        hopq.simulate([torch.ones(1000)] * 2, codec, key=3)
    with pytest.raises(ValueError, match=">= 0"):
        codec.set_supergroup_weights(torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="one entry per step size"):
        codec.supergroup_weights(torch.ones(10), torch.ones(9))
    with pytest.raises(ValueError, match="optimizer_weights=False"):
        hopq.get_codec("dynamiq", optimizer_weights=False).set_supergroup_weights(torch.ones(1))


def _workers(n, d, seed):
    """Half the coordinates loud, half quiet (1e-3 of it): vNMSE's allocation
    gives the quiet half the fewest bits."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(d)
    scale[d // 2 :] = 1e-3
    return [torch.randn(d, generator=g) * scale for _ in range(n)]


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_step_sizes_move_the_bits_to_where_the_update_is(topology):
    """With Adam-like step sizes (large where the gradient is quiet) the error of
    the update, sum (r e)^2, falls, at the same measured bits; every rank
    holds the same bits."""
    n, d = 4, 1 << 15
    for seed in range(3):
        xs = _workers(n, d, seed)
        exact = torch.stack(xs).double().sum(0)
        r = torch.ones(d)
        r[d // 2 :] = 1e3
        plain_codec = hopq.get_codec("dynamiq")
        plain = hopq.simulate(xs, plain_codec, topology, seed=seed)
        codec = hopq.get_codec("dynamiq")
        codec.set_step_sizes(r)
        weighed = hopq.simulate(xs, codec, topology, seed=seed)
        assert weighed.identical and plain.identical
        assert weighed.bits_per_coord <= 5.0 + 1e-9
        assert abs(weighed.bits_per_coord - plain.bits_per_coord) < 0.05

        def update_err(res, exact=exact, r=r):
            return float(((res.outputs[0].double() - exact) * r).square().sum())

        assert update_err(weighed) < 0.5 * update_err(plain), seed
        assert weighed.vnmse > plain.vnmse  # the price: the gradient's own error
        assert not codec._step_sizes  # used by that call only
        # the next call goes without them: as the unweighted codec's second call
        again = hopq.simulate(xs, codec, topology, seed=seed)
        plain2 = hopq.simulate(xs, plain_codec, topology, seed=seed)
        assert torch.equal(again.outputs[0], plain2.outputs[0])


def test_ranks_with_different_step_sizes_still_agree():
    """The energies are exchanged already weighed: ranks whose step sizes differ
    (they should not, but nothing checks it) allocate alike and end bit-identical."""
    n, d = 3, 5000
    xs = _workers(n, d, 7)
    codec = hopq.get_codec("dynamiq")
    hopq.simulate(xs, codec, key=1)  # makes the per-rank copies
    for k, c in enumerate(virtual_ranks(codec)):
        c.set_step_sizes(torch.linspace(1, 10 ** (k + 1), d), key=1)
    res = hopq.simulate(xs, codec, key=1)
    assert res.identical and res.bits_per_coord <= 5.0 + 1e-9


def test_ddp_hook_with_adamw_weighs_the_allocation_in_a_real_gloo_job():
    """HookState(codec="dynamiq", optimizer=AdamW) in a 2-rank Gloo DDP job:
    replicas bit-identical, the step sizes reach the codec (the training differs
    from the run without the optimizer) and are used up, at the same bits."""
    from hopq.cluster.launch import run_workers
    from tests.workers_gcomp import ddp_dynamiq_adamw

    res = run_workers(2, ddp_dynamiq_adamw, 4)
    for key in ("none", "opt"):
        assert torch.equal(res[0][key], res[1][key])  # replicas bit-identical
        assert res[0][f"{key}/bits"] <= 5.0 + 1e-6  # DynamiQ's calls; small buckets run bf16
        assert res[0][f"{key}/fallbacks"] > 0
        assert res[0][f"{key}/pending"] == 0
    assert not torch.equal(res[0]["none"], res[0]["opt"])


def test_frameworks_hand_over_the_optimizer_only_when_it_is_clear():
    """adopt_optimizer (Lightning, Fabric, Accelerate, the HF Trainer): the one
    optimizer, unwrapped, to a codec that reads it and has none; a warning
    where it cannot tell which or the codec has no rule for it."""
    import warnings

    from hopq.integrations.ddp import adopt_optimizer

    p = torch.nn.Parameter(torch.ones(3))
    a, b = torch.optim.AdamW([p]), torch.optim.SGD([p], lr=0.1)

    class Wrapped:  # Accelerate's AcceleratedOptimizer holds the torch one
        optimizer = a

    s = hopq.HookState("dynamiq")
    adopt_optimizer(s, [Wrapped()], "here")
    assert s.optimizer is a
    adopt_optimizer(s, [b], "here")  # the framework made another (a second fit): no stale one
    assert s.optimizer is b
    given = hopq.HookState("dynamiq", optimizer=a)
    adopt_optimizer(given, [b], "here")  # the user's stays
    assert given.optimizer is a
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = hopq.HookState("bf16")  # reads no optimizer: nothing, silently
        adopt_optimizer(plain, [a], "here")
        assert plain.optimizer is None
    s = hopq.HookState("dynamiq")
    with pytest.warns(UserWarning, match="here: 2 optimizers"):
        adopt_optimizer(s, [a, b], "here")
    with pytest.warns(UserWarning, match="no step-size rule for Adamax"):
        adopt_optimizer(s, [torch.optim.Adamax([p])], "here")
    assert s.optimizer is None
