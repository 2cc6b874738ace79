"""codec="auto" in the integrations: HookState and FSDPReduceScatter plan per
bucket from an agreed probe, the same on every rank, log it once, report it in
step_metrics and re-plan once on a forced drift; a rank in auto mode beside one
with a named codec raises MismatchError on both; ``hopq train`` takes ``auto``
as a contender."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hopq
from hopq.cluster.launch import run_workers

#: The training step the workers are at (the patched timings read it).
STEP = [0]


def _keep_log() -> list[str]:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    log = logging.getLogger("hopq")
    log.addHandler(Keep(level=logging.INFO))
    log.setLevel(logging.INFO)
    return records


def _default_speeds() -> None:
    """Plan from the calibrated default speeds and a fixed link latency, not
    from timing this machine's kernels and link (whose load would change the
    picks the tests assert: small buckets are latency-bound)."""
    from hopq.comm import plan as pm

    pm.AUTO_OVERRIDES["speeds"] = dict(pm.DEFAULT_SPEEDS)
    pm.AUTO_OVERRIDES["inter_latency_us"] = 100.0


def _forced_timings(drift_at: int) -> None:
    """Every call takes 10 ms, 30 ms from step ``drift_at`` on: the same on
    every rank and free of the machine's noise. No measured trial of the first
    plan (its step spans are the machine's)."""
    from hopq.comm import plan as pm

    pm.AutoPlanner.TRIAL_WITHIN = 0.0
    _default_speeds()
    real = pm.AutoPlanner.observe

    def observe(self: Any, key: Any, seconds: float) -> None:
        real(self, key, 0.01 * (3.0 if STEP[0] >= drift_at else 1.0))

    pm.AutoPlanner.observe = observe  # type: ignore[method-assign]


def ddp_worker(rank: int, n: int, steps: int, drift_at: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hopq.comm import plan as pm

    records = _keep_log()
    _forced_timings(drift_at)
    pm.AUTO_OVERRIDES["inter_gbit"] = 0.05  # a slow link: the large buckets compress
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = hopq.HookState(codec="auto")
    ddp.register_comm_hook(state, hopq.ddp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    metrics = []
    for s in range(steps):
        STEP[0] = s
        loss = (ddp(torch.randn(16, 64, generator=g)) - 1).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        metrics.append(state.step_metrics())
    state.close()
    assert state.auto is not None
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "metrics": metrics,
        "replans": state.auto.replans,
        "summary": state.auto.summary(),
        "log": [m for m in records if "codec='auto'" in m],
        "report": state.auto.report(),
        "judged": state.auto._judged(),
    }


def test_hook_auto_on_gloo_ranks() -> None:
    res = run_workers(2, ddp_worker, 12, 5, timeout=300)
    a, b = res
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(p, q)  # the same plan and bits on both ranks
    assert a["summary"] == b["summary"] and a["summary"] != "nothing planned"
    for r in res:
        last = r["metrics"][-1]
        plans = [k for k in last if k.startswith("hopq/plan/")]
        assert plans and all("@" in k or "/torch:" in k for k in plans)
        assert last["hopq/replans"] == 1.0  # one re-plan for one forced drift
        assert r["replans"] == 1
        info = [m for m in r["log"] if m.startswith("INFO")]
        assert sum("re-planning" in m for m in info) == 1
        assert "probed" in info[0]  # the plan, in one line, at the first step's end
        assert "re-planned 1 time(s) on drift, 0 undone" in r["report"]
        assert r["report"].startswith("the plan at the end: probed")
        # the prediction is judged on the plan at the end: the steps after the drift
        assert r["judged"] and all(m == pytest.approx(r["judged"][0][0]) for m, *_ in r["judged"])
    assert a["metrics"][-1].keys() == b["metrics"][-1].keys()


def optimizer_worker(rank: int, n: int) -> dict[str, Any]:
    """codec="auto" with an optimizer: handed to the planned DynamiQ (its step
    sizes), without a warning; the ranks stay bit-identical."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hopq.codecs.dynamiq import DynamiQ
    from hopq.comm import plan as pm

    pm.AUTO_OVERRIDES.update(inter_gbit=0.05, codecs=("dynamiq",))
    _default_speeds()
    handed: list[int] = []
    real = DynamiQ.use_optimizer

    def use_optimizer(self: Any, optimizer: Any, params: Any, key: Any, device: Any) -> None:
        handed.append(key)
        real(self, optimizer, params, key, device)

    DynamiQ.use_optimizer = use_optimizer  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        state = hopq.HookState(codec="auto", optimizer=opt)
    ddp.register_comm_hook(state, hopq.ddp_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        (ddp(torch.randn(16, 64, generator=g)) - 1).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "handed": handed}


def test_auto_report_says_apart_the_kernels_first_calls() -> None:
    """A cold cache compiles the timed codecs' kernels in their first calls: the
    report gives those seconds apart and the share without them."""
    from hopq.comm.plan import AutoPlanner

    p = AutoPlanner()
    p.probe_seconds, p.speed_seconds, p.first_call_seconds = 1.5, 26.0, 25.0
    line = p.report(300.0)
    assert "the probes took 27.50 s" in line and "9.2% of the training time" in line
    assert "25.00 s the timed kernels' first calls" in line and "0.8% without them" in line
    p.first_call_seconds = 0.0  # speeds given, not timed
    assert "first calls" not in p.report(300.0)


def test_hook_auto_hands_the_optimizer_to_a_planned_dynamiq() -> None:
    a, b = run_workers(2, optimizer_worker, timeout=300)
    assert a["handed"] and a["handed"] == b["handed"]  # every planned bucket, every step
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(p, q)


def revert_worker(rank: int, n: int) -> dict[str, Any]:
    """A re-plan that measures slower than the plan it replaced is undone."""
    from hopq.comm import plan as pm

    _forced_timings(drift_at=4)  # 10 ms a call, 30 ms from step 4 on: a drift, then slower
    pm.AUTO_OVERRIDES["inter_gbit"] = 0.05
    records = _keep_log()
    model = torch.nn.Linear(64, 64)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, bucket_cap_mb=0.01)
    state = hopq.HookState(codec="auto")
    ddp.register_comm_hook(state, hopq.ddp_hook)
    g = torch.Generator().manual_seed(rank)
    first = last = None
    for s in range(22):
        STEP[0] = s
        ddp(torch.randn(8, 64, generator=g)).square().mean().backward()
        if s == 2:
            first = state.auto.summary()  # type: ignore[union-attr]
    last = state.step_metrics()
    state.close()
    assert state.auto is not None
    return {
        "replans": state.auto.replans,
        "reverts": state.auto.reverts,
        "first": first,
        "final": state.auto.summary(),
        "metrics": last,
        "log": [m for m in records if "comes back" in m],
    }


def test_auto_undoes_a_replan_that_measures_slower() -> None:
    res = run_workers(2, revert_worker, timeout=300)
    for r in res:
        # the drift re-planned once; the re-plan measured 3x slower, so the first
        # plan came back and stayed (the drift goes on, no more re-plans)
        assert r["replans"] == 1 and r["reverts"] == 1, r
        assert r["final"] == r["first"]
        assert r["metrics"]["hopq/plan_reverts"] == 1.0
        assert len(r["log"]) == 1
    assert res[0]["final"] == res[1]["final"]


#: Forced seconds from one bucket's call to the next under each plan (rank 1's
#: a little longer: the ranks decide on the slowest rank's).
TRIAL_COSTS = {"dynamiq": 0.01, "torch:bf16": 0.02, "torch:ddp": 0.02}


def trial_worker(rank: int, n: int, costs: dict[str, float]) -> dict[str, Any]:
    """The first plan (DynamiQ on a slow link) against its challengers
    (torch's bf16 and fp32 all-reduce), with forced timings: ``costs`` per
    bucket call under each."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hopq.comm import plan as pm

    records = _keep_log()
    _default_speeds()
    now = [0.0]
    pm.AutoPlanner.clock = staticmethod(lambda: now[0])  # type: ignore[method-assign]
    real = pm.AutoPlanner.observe

    def observe(self: Any, key: Any, seconds: float) -> None:
        b = self._buckets[key]
        now[0] += costs[self._label(b).split("@")[0].split("(")[0]] * (1 + 0.1 * rank)
        real(self, key, seconds)

    pm.AutoPlanner.observe = observe  # type: ignore[method-assign]
    pm.AUTO_OVERRIDES.update(inter_gbit=0.05, codecs=("dynamiq", "fp32", "bf16"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = hopq.HookState(codec="auto")
    assert state.auto is not None
    state.auto.TRIAL_WITHIN = 1e9  # every challenger is tried
    ddp.register_comm_hook(state, hopq.ddp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    seen = []
    for _ in range(24):
        (ddp(torch.randn(16, 64, generator=g)) - 1).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append(state.auto.summary())
    metrics = state.step_metrics()
    state.close()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "seen": seen,
        "trials": state.auto.trials,
        "results": state.auto.trial_results,
        "metrics": metrics,
        "log": [m for m in records if "measured" in m],
    }


@pytest.mark.parametrize("fastest", ["dynamiq", "torch:bf16", "torch:ddp"])
def test_auto_weighs_its_pick_against_torch_by_measurement(fastest: str) -> None:
    costs = {**TRIAL_COSTS, fastest: 0.005}
    a, b = run_workers(2, trial_worker, costs, timeout=300)
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(p, q)  # every rank ran the same plans
    assert a["seen"] == b["seen"] and a["results"] == b["results"]
    assert a["seen"][3].startswith("dynamiq")  # the cost model's pick first
    assert {"torch:bf16", "torch:ddp"} <= set(a["seen"])  # both challengers ran
    assert a["trials"] == 2 and a["metrics"]["hopq/plan_trials"] == 2
    assert len(a["log"]) == 1 and [r[0] for r in a["results"]][1:] == ["torch:bf16", "torch:ddp"]
    # the plan of the shortest step stays, pinned when it overrules the model
    assert a["seen"][-1].startswith(fastest), a["seen"]
    assert ("no re-plans" in a["log"][0]) == (fastest != "dynamiq")


def native_worker(rank: int, n: int, codec: str) -> dict[str, Any]:
    """An uncompressed plan runs as torch's own all-reduce: the same gradients
    as DDP with torch's own hook of that dtype."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hopq.comm import plan as pm

    _default_speeds()
    pm.AUTO_OVERRIDES.update(codecs=(codec,))
    hooks = {
        "fp32": default_hooks.allreduce_hook,
        "bf16": default_hooks.bf16_compress_hook,
        "fp16": default_hooks.fp16_compress_hook,
    }
    grads = []
    for auto in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 4))
        ddp = DDP(model, bucket_cap_mb=0.02)
        state = None
        if auto:
            state = hopq.HookState(codec="auto")
            ddp.register_comm_hook(state, hopq.ddp_hook)
        else:
            ddp.register_comm_hook(None, hooks[codec])
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ddp.zero_grad()
            (ddp(torch.randn(16, 64, generator=g)) - 1).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if state is not None:
            summary = state.auto.summary()  # type: ignore[union-attr]
            state.close()
    return {"grads": grads, "summary": summary}


@pytest.mark.parametrize("codec", ["fp32", "fp16"])  # torch's bf16 hook needs NCCL
def test_auto_uncompressed_plans_run_torchs_own_all_reduce(codec: str) -> None:
    for r in run_workers(2, native_worker, codec, timeout=300):
        assert r["summary"] == {"fp32": "torch:ddp", "fp16": "torch:fp16"}[codec]
        for mine, torchs in zip(*r["grads"], strict=True):
            assert torch.equal(mine, torchs)


def mixed_worker(rank: int, n: int) -> dict[str, Any]:
    x = torch.ones(1000)
    try:
        hopq.all_reduce(x, codec="auto" if rank == 0 else "dynamiq")
        raised = ""
    except hopq.MismatchError as e:
        raised = str(e)
    y = torch.ones(10)
    hopq.all_reduce(y, codec="bf16")  # the group is still usable
    return {"raised": raised, "y": y}


def test_auto_beside_a_named_codec_raises_on_every_rank() -> None:
    res = run_workers(2, mixed_worker, timeout=120)
    assert all(r["raised"] for r in res)
    assert "codec='auto'" in res[0]["raised"]
    assert all(torch.equal(r["y"], torch.full((10,), 2.0)) for r in res)


def fsdp_worker(rank: int, n: int, steps: int) -> dict[str, Any]:
    from tests.workers_fsdp import build, train

    records = _keep_log()
    model = build(n)
    comm = hopq.FSDPReduceScatter("auto")
    comm.install(model)
    out = train(model, rank, steps, comm)
    return {
        "params": out["params"],
        "metrics": comm.step_metrics(),
        "log": [m for m in records if "codec='auto'" in m],
    }


def test_fsdp_auto_on_gloo_ranks() -> None:
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    a, b = run_workers(2, fsdp_worker, 3, timeout=300)
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k])
    plans = [k for k in a["metrics"] if k.startswith("hopq/plan/")]
    assert plans and plans == [k for k in b["metrics"] if k.startswith("hopq/plan/")]
    assert sum(m.startswith("INFO") for m in a["log"]) == 1


def fsdp_optimizer_worker(rank: int, n: int) -> dict[str, Any]:
    """FSDPReduceScatter("auto", optimizer=AdamW): the planned DynamiQ gets
    the optimizer's step-size weights, without a warning."""
    import warnings

    from hopq.codecs.dynamiq import DynamiQ
    from hopq.comm import plan as pm
    from tests.workers_fsdp import build

    pm.AUTO_OVERRIDES.update(inter_gbit=0.05, codecs=("dynamiq",))
    _default_speeds()
    weighed: list[Any] = []
    real = DynamiQ.set_supergroup_weights

    def set_supergroup_weights(self: Any, w: Any, key: Any, spent: float) -> None:
        weighed.append(key)
        real(self, w, key, spent)

    DynamiQ.set_supergroup_weights = set_supergroup_weights  # type: ignore[method-assign]
    model = build(n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        comm = hopq.FSDPReduceScatter("auto", optimizer=opt)
    comm.install(model)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        (model(torch.randn(8, 40, generator=g)) - 1).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return {"params": params, "weighed": weighed, "metrics": comm.step_metrics()}


def test_fsdp_auto_hands_the_optimizer_to_a_planned_dynamiq() -> None:
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    a, b = run_workers(2, fsdp_optimizer_worker, timeout=300)
    assert any("dynamiq" in k for k in a["metrics"] if k.startswith("hopq/plan/"))
    # the weights exist once AdamW has stepped: modules of steps 2 and 3
    assert a["weighed"] and a["weighed"] == b["weighed"]
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k])


def test_train_takes_auto_as_a_contender() -> None:
    from hopq.train.contenders import is_auto, resolve_contenders
    from hopq.train.job import TrainOptions

    names = ("torch:fp16", "auto", "dynamiq", "bf16")
    o = TrainOptions(codecs=names)
    assert o.resolved_codecs() == list(names)
    assert o.codec_config("auto") == {}
    assert is_auto("auto") and not is_auto("dynamiq")
    assert "torch:ddp" in resolve_contenders(("auto",))  # alone: the default set
    with pytest.raises(TypeError, match="plans the codec"):
        hopq.HookState(codec="auto", budget=4)
    assert hopq.HookState(codec="auto").auto is not None


def measured_worker(rank: int, n: int) -> dict[str, Any]:
    """Each call's time differs per rank: rank 0 waits 20 ms more on even
    buckets (it started them first), rank 1 on odd ones."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hopq.comm import plan as pm

    pm.AutoPlanner.TRIAL_WITHIN = 0.0
    _default_speeds()
    real = pm.AutoPlanner.observe

    def observe(self: Any, key: Any, seconds: float) -> None:
        wait = 0.02 if int(key) % 2 == rank else 0.0
        real(self, key, 0.01 * (1 + int(key)) + wait)

    pm.AutoPlanner.observe = observe  # type: ignore[method-assign]
    torch.manual_seed(0)
    # over DDP's 1 MiB first bucket: several buckets
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 512),
        torch.nn.Tanh(), torch.nn.Linear(512, 4),
    )  # fmt: skip
    ddp = DDP(model, bucket_cap_mb=0.1)
    state = hopq.HookState(codec="auto")
    ddp.register_comm_hook(state, hopq.ddp_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        ddp.zero_grad()
        (ddp(torch.randn(16, 64, generator=g)) - 1).square().mean().backward()
    auto = state.auto
    keys = len(auto._buckets)  # type: ignore[union-attr]
    state.close()
    assert auto is not None
    return {"keys": keys, "predictions": list(auto.predictions), "slowest": list(auto.slowest)}


def test_auto_measures_each_call_on_the_rank_that_started_it_last() -> None:
    """The synchronization a plan is judged by: per call, the shortest time over
    the ranks (the others also waited for the last one to start it)."""
    for r in run_workers(2, measured_worker, timeout=300):
        k = r["keys"]
        assert k >= 2 and r["predictions"]
        quickest = sum(0.01 * (1 + key) for key in range(k))
        for measured, predicted in r["predictions"]:
            assert measured == pytest.approx(quickest) and predicted > 0
        waits = max(len(range(0, k, 2)), len(range(1, k, 2))) * 0.02
        assert r["slowest"][-1] == pytest.approx(quickest + waits)


def probe_worker(rank: int, n: int) -> dict[str, Any]:
    from hopq.comm import plan as pm

    out = {}
    for name, per_float in (("fast", 1e-9), ("slow", 1e-7)):
        sizes: list[int] = []

        def timed(
            tensor: Any, group: Any, reps: int, per: float = per_float, sizes: list[int] = sizes
        ) -> float:
            sizes.append(tensor.numel())
            fixed = 1e-3 if tensor.numel() == 1 else 2e-3  # megabytes cost more than a float
            return fixed + tensor.numel() * per * (1 + 0.1 * rank)

        pm._timed = timed  # type: ignore[assignment]
        out[name] = (pm.probe_link(), sizes)
    return out


def test_the_link_probe_grows_its_size_on_a_fast_link() -> None:
    """A small all-reduce on a fast link is mostly fixed costs: the probe times
    4x larger ones while they take under PROBE_GROW_S, and reads the rate off
    the last two, the slowest rank's timings."""
    from hopq.comm import plan as pm

    a, b = run_workers(2, probe_worker, timeout=120)
    assert a == b  # agreed
    (lat, gbit), sizes = a["fast"]
    assert sizes == [1] + [pm.PROBE_NUMEL * 4**k for k in range(4)]
    assert 64 * pm.PROBE_NUMEL == pm.PROBE_MAX_NUMEL
    # rank 1's 1.1e-9 s per float; a rank of 2 sends 4 bytes per float
    assert gbit == pytest.approx(4 * 8 / 1.1e-9 / 1e9)
    assert lat == pytest.approx(2e-3 / 2)  # the line's intercept
    (lat, gbit), sizes = a["slow"]
    assert lat == pytest.approx((1e-3 + 1.1e-7) / 2)  # one float's all-reduce
    assert sizes == [1, pm.PROBE_NUMEL]  # 28 ms: no growth
    slope = (1e-3 + (pm.PROBE_NUMEL - 1) * 1.1e-7) / (pm.PROBE_NUMEL - 1)  # against one float
    assert gbit == pytest.approx(4 * 8 / slope / 1e9)
