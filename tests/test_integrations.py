"""The framework integrations (hopq.integrations.lightning, fabric, accelerate,
transformers), the examples that show them, step_metrics(), the warning when a
hook is not engaged, and checkpoints through torch.distributed.checkpoint.

Each framework group runs in one spawned 2-rank Gloo job (a module-scoped
fixture) that several tests read; a group whose packages are missing is skipped."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import pytest
import torch

import hopq
from hopq.cluster.launch import run_workers
from hopq.comm.engine import RunStats
from hopq.integrations import ddp as hopq_ddp
from tests import workers
from tests import workers_integrations as wi

#: DynamiQ's default budget (bits per coordinate, statistics included).
DYNAMIQ_BUDGET = 5.0


def assert_codec_bits(m: dict, codec: str) -> None:
    """The step's bits per coordinate and bytes are what the codec says."""
    assert m["hopq/buckets"] >= 1, m
    bits, numel, sent = m["hopq/bits_per_coordinate"], m["hopq/numel"], m["hopq/bytes_sent"]
    if codec == "bf16":  # 2 ranks, ring: each rank sends half the vector twice, 2 bytes each
        assert bits == 16.0 and sent == 2 * numel, m
    else:
        assert 0.9 * DYNAMIQ_BUDGET <= bits <= DYNAMIQ_BUDGET + 0.05, m
        assert sent == pytest.approx(bits * numel / 8)  # 2(n-1)/n = 1 for n = 2


# -- step_metrics ----------------------------------------------------------------
def _stats(numel: int, sent: int, seconds: float = 0.01, comm: float = 0.004) -> RunStats:
    return RunStats(
        rank=0, world_size=2, numel=numel, payload_bytes=sent, seconds=seconds,
        comm_seconds=comm, cpu_seconds=0.005,
    )  # fmt: skip


def test_step_metrics_is_a_flat_dict_weighted_by_size():
    state = hopq.HookState(codec="bf16")
    state._record(_stats(1000, 2000))  # 16 bits per coordinate
    state._record(_stats(3000, 1500))  # 4
    m = state.step_metrics()
    assert set(m) == {
        "hopq/bits_per_coordinate", "hopq/bytes_sent", "hopq/codec_seconds",
        "hopq/comm_seconds", "hopq/cpu_seconds", "hopq/buckets", "hopq/numel",
    }  # fmt: skip
    assert all(isinstance(v, float) for v in m.values())
    assert m["hopq/bits_per_coordinate"] == 8 * 3500 / 4000  # by size, not the mean of 16 and 4
    assert m["hopq/bytes_sent"] == 3500 and m["hopq/buckets"] == 2 and m["hopq/numel"] == 4000
    assert m["hopq/codec_seconds"] == pytest.approx(0.012)
    assert m["hopq/comm_seconds"] == pytest.approx(0.008)
    assert m["hopq/cpu_seconds"] == pytest.approx(0.010)
    # popped: the next step starts empty; no bucket: NaN bits, not an error
    empty = state.step_metrics(prefix="")
    assert empty["buckets"] == 0 and math.isnan(empty["bits_per_coordinate"])
    assert state.calls == []


def test_step_metrics_windows_vnmse_and_bounded_records():
    state = hopq.HookState(codec="bf16")
    state._record(_stats(1000, 2000), err_sq=1.0, ref_sq=100.0)
    a = state.pop_step()
    state._record(_stats(1000, 500), err_sq=3.0, ref_sq=100.0)
    b = state.pop_step()
    w = (a + b).as_dict()
    assert w["hopq/vnmse"] == pytest.approx(0.02)
    assert w["hopq/bytes_sent"] == 1250  # per step over the window
    assert w["hopq/bits_per_coordinate"] == 8 * 2500 / 2000
    assert "hopq/vnmse" not in a.as_dict() or a.ref_sq > 0
    # more buckets than the kept records: the totals stay exact, memory bounded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(hopq_ddp.MAX_KEPT_CALLS + 10):
            state._record(_stats(10, 20))
    assert len(state.calls) == hopq_ddp.MAX_KEPT_CALLS
    assert state.step_metrics()["hopq/buckets"] == hopq_ddp.MAX_KEPT_CALLS + 10


def test_update_error_is_the_error_weighed_by_the_step_sizes():
    """measure_error with an optimizer: the hook's update vNMSE is the error of
    the averaged gradient weighed by the optimizer's step sizes, for a codec that
    reads the optimizer and one that does not; with SGD it is the vNMSE."""
    out = run_workers(2, workers.ddp_update_error, timeout=300)
    for res in out:
        for name in ("adamw/mxfp4", "adamw/dynamiq", "sgd/mxfp4"):
            (vn, uv), want = res[name], res[f"{name}/want"]
            assert vn == pytest.approx(want[0], rel=1e-9) and vn > 0
            assert uv == pytest.approx(want[1], rel=1e-6)
            assert res[f"{name}/metrics"]["hopq/update_vnmse"] == pytest.approx(uv, rel=1e-12)
        # AdamW's steps weigh the coordinates unevenly: the two errors differ
        assert res["adamw/mxfp4/uniform"] is False
        assert res["adamw/mxfp4"][1] != pytest.approx(res["adamw/mxfp4"][0], rel=1e-3)
        assert res["sgd/mxfp4/uniform"] is True
        assert res["sgd/mxfp4"][1] == res["sgd/mxfp4"][0]
        # before AdamW's first step there are no step sizes: no update error
        vn, uv = res["adamw/mxfp4/first"]
        assert vn > 0 and math.isnan(uv)
        assert "hopq/update_vnmse" not in res["adamw/mxfp4/first metrics"]
        assert "hopq/vnmse" in res["adamw/mxfp4/first metrics"]
    assert out[0]["adamw/dynamiq"] == out[1]["adamw/dynamiq"]  # bit-identical replicas
    for res in out:  # an error optimizer without every parameter: said once, not measured
        vn, uv = res["partial"]
        assert vn > 0 and math.isnan(uv)
        said = [w for w in res["partial/warnings"] if "update_vnmse" in w]
        assert len(said) == 1 and "not in the optimizer" in said[0]


def test_error_optimizer_needs_a_step_size_rule():
    state = hopq.HookState(codec="bf16")
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="Adamax"):
        state.error_optimizer = torch.optim.Adamax([p])
    state.error_optimizer = torch.optim.Adam([p])
    assert state.error_optimizer is not None


def test_state_dict_is_opaque_and_checks_the_codec():
    state = hopq.HookState(codec="dynamiq", seed=3)
    sd = state.state_dict()
    assert sd["codec_name"] == "dynamiq" and sd["seed"] == 3 and isinstance(sd["codec"], bytes)
    assert "codec_local" not in sd  # DynamiQ's whole state is agreed across ranks
    other = hopq.HookState(codec="dynamiq")
    other.load_state_dict(sd)
    assert other.seed == 3 and other.codec.state_dict() == state.codec.state_dict()
    other.load_state_dict({"codec": {"round": 4}, "seed": 1})  # the older plain form
    assert other.codec.round == 4
    mx = hopq.HookState(codec="mxfp8").state_dict()
    assert set(mx["codec_local"]) == {"0"}  # saturation counts: this rank's own
    with pytest.raises(ValueError, match="mxfp8"):
        other.load_state_dict(mx)


def test_no_warning_without_a_group():
    """A state built and stepped past in one process (no group, or a group of
    one) is never 'not engaged': there is nothing to average."""
    state = hopq.HookState(codec="bf16")
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hopq.HookNotEngagedWarning)
        for _ in range(hopq_ddp.UNENGAGED_STEPS + 1):
            p.grad = torch.ones(3)
            opt.step()
        state.step_metrics()
    assert state._steps_unengaged == hopq_ddp.UNENGAGED_STEPS + 1


def test_other_models_steps_do_not_make_a_hook_look_unengaged(monkeypatch):
    """Steps are counted per optimizer: 14 models trained in turn in one process
    (``hopq train``'s contenders), each stepping once before the last one's
    first backward, leave a registered hook quiet; ten steps of one optimizer
    without a call still warn."""
    state = hopq.HookState(codec="bf16")
    monkeypatch.setattr(state, "_world_size", lambda: 2)  # as on a group of 2 ranks
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(14)]
    opts = [torch.optim.SGD([p], lr=0.1) for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("error", hopq.HookNotEngagedWarning)
        for _ in range(hopq_ddp.UNENGAGED_STEPS - 1):  # rounds in which its turn never came
            for p, opt in zip(params, opts, strict=True):
                p.grad = torch.ones(3)
                opt.step()
    assert state._steps_unengaged == hopq_ddp.UNENGAGED_STEPS - 1
    with pytest.warns(hopq.HookNotEngagedWarning, match="after 10 steps of one optimizer"):
        params[0].grad = torch.ones(3)
        opts[0].step()


# -- torch only: DDP example, loggers, the detector, DCP -------------------------------
@pytest.fixture(scope="module")
def torch_job(tmp_path_factory):
    return run_workers(2, wi.torch_job, str(tmp_path_factory.mktemp("torch")), timeout=600)


def test_ddp_example_and_loggers(torch_job):
    for r in range(2):
        assert_codec_bits(torch_job[r]["ddp"], "dynamiq")
        assert_codec_bits(torch_job[r]["ddp_bf16"], "bf16")
        if "tb" in torch_job[r]:
            assert torch_job[r]["tb"], "no hopq scalars in the TensorBoard event file"
    if "wandb" not in torch_job[0]:
        pytest.skip("wandb is not installed (the TensorBoard part ran)")
    files = torch_job[0]["wandb"] + torch_job[1]["wandb"]
    assert len(files) == 2, files
    deadline = time.monotonic() + 30  # W&B's service finishes the files on its own time
    while not all(b"hopq/bits_per_coordinate" in Path(f).read_bytes() for f in files):
        assert time.monotonic() < deadline, "no hopq metrics in the W&B offline runs"
        time.sleep(0.5)


def test_not_engaged_warning(torch_job):
    for r in range(2):
        res = torch_job[r]
        assert res["idle"] == [] and res["engaged"] == [] and res["unengaged_early"] == []
        assert res["engaged_metrics"]["hopq/buckets"] >= 1
        assert len(res["unengaged"]) == 1, res["unengaged"]  # loud, once
        msg = res["unengaged"][0]
        assert "not engaged" in msg and "2 ranks" in msg and "register_comm_hook" in msg
        assert f"{hopq_ddp.UNENGAGED_STEPS} steps of one optimizer" in msg
        assert len(res["unengaged_metrics"]) == 1
        assert "step_metrics" in res["unengaged_metrics"][0]
        (msg,) = res["at_exit"]
        assert "end of the program" in msg


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def same(a, b) -> bool:
    """Equal nested states, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_checkpoint_through_dcp_resumes_bit_exact(torch_job):
    for r in range(2):
        res = torch_job[r]
        for codec in ("dynamiq", "mxfp8"):
            sent, params, _ = res[f"{codec}/straight"]
            rsent, rparams, loaded = res[f"{codec}/resumed/True"]
            assert rsent == sent[3:], codec
            assert torch.equal(_bits(rparams), _bits(params)), codec
            # the whole state came back: DynamiQ's round counter, budget shares and
            # statistics; MX's adaptive scale and this rank's own saturation counts
            assert loaded["round"] > 0 and same(loaded, res[f"{codec}/saved"]), codec
            _, fparams, floaded = res[f"{codec}/resumed/False"]
            assert floaded["round"] == 0
        assert res["dynamiq/saved"]["shares"]
        # without hopq's state DynamiQ restarts its random streams: other bits
        fparams = res["dynamiq/resumed/False"][1]
        assert not torch.equal(_bits(fparams), _bits(res["dynamiq/straight"][1]))
    # MX's saturation counts are each rank's own, and each rank got its own back
    assert [torch_job[r]["local_overflow"] for r in range(2)] == [100, 101]
    # the replicas agree
    assert torch.equal(
        torch_job[0]["dynamiq/resumed/True"][1], torch_job[1]["dynamiq/resumed/True"][1]
    )


# -- Lightning and Fabric ------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory):
    pytest.importorskip("lightning")
    return run_workers(2, wi.lightning_job, str(tmp_path_factory.mktemp("lt")), timeout=600)


def test_lightning_strategy(lightning_job):
    for r in range(2):
        m = lightning_job[r]["lightning"]
        assert "loss" in m  # the module's own log beside hopq's
        assert_codec_bits(m, "dynamiq")
        assert_codec_bits(lightning_job[r]["lightning_bf16"], "bf16")
    assert "hopq/bits_per_coordinate" in lightning_job[0]["lightning_csv"]


def test_the_strategies_hand_the_optimizer_to_the_codec(lightning_job):
    """The optimizer Lightning (configure_optimizers) or Fabric (setup) makes after
    the HookState reaches DynamiQ, which weighs its allocation by it."""
    for r in range(2):
        assert lightning_job[r]["lightning_opt"] == ["SGD"]
        assert lightning_job[r]["fabric_opt"] == ["SGD"]


def test_lightning_plain_strategy_on_cpu_is_caught(lightning_job):
    """Lightning's DDPStrategy(ddp_comm_hook=hopq.ddp_hook) on CPU never registers
    the hook; hopq warns, naming the strategy that does."""
    for r in range(2):
        assert lightning_job[r]["plain_strategy_calls"] == 0
        (msg,) = lightning_job[r]["plain_strategy"]
        assert "HopqDDPStrategy" in msg


def test_fabric_strategy(lightning_job):
    for r in range(2):
        assert_codec_bits(lightning_job[r]["fabric"], "dynamiq")
    assert lightning_job[0]["fabric_csv"]


def test_strategies_refuse_a_second_hook():
    pytest.importorskip("lightning")
    from hopq.integrations import fabric, lightning

    for mod in (lightning, fabric):
        with pytest.raises(TypeError, match="ddp_comm_hook"):
            mod.HopqDDPStrategy(hopq.HookState(), ddp_comm_hook=hopq.ddp_hook)
        s = mod.HopqDDPStrategy("bf16")
        assert s.hook_state.codec.name == "bf16"
    # Lightning keeps model_averaging_period for post-local SGD's own state only:
    # with hopq's hook it would be stored and never used
    with pytest.raises(TypeError, match="model_averaging_period"):
        lightning.HopqDDPStrategy("bf16", model_averaging_period=4)


# -- Accelerate and the HF Trainer -------------------------------------------------
@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    return run_workers(2, wi.hf_job, str(tmp_path_factory.mktemp("hf")), timeout=600)


def test_accelerate_recipe(hf_job):
    for r in range(2):
        assert_codec_bits(hf_job[r]["accelerate"], "dynamiq")
        assert hf_job[r]["kwargs_hooks"] == 0  # Accelerate dropped comm_hook=hopq.ddp_hook
        assert "silently ignored" in hf_job[r]["kwargs_refused"]
        assert "DDP model" in hf_job[r]["not_ddp"]


def test_accelerate_and_the_hf_trainer_hand_the_optimizer_to_the_codec(hf_job):
    """register_hook takes the optimizer accelerator.prepare wrapped; the HF
    Trainer's callback the one the Trainer made: DynamiQ gets it."""
    for r in range(2):
        assert hf_job[r]["accelerate_opt"] == ["SGD"]
        assert hf_job[r]["hf_opt"] == ["AdamW"]


def test_hf_trainer_callback(hf_job):
    for r in range(2):
        for key, codec in (("hf_logs", "dynamiq"), ("hf_logs_bf16", "bf16")):
            logs = hf_job[r][key]
            assert logs, key
            for entry in logs:  # the Trainer's own entries, hopq's metrics merged in
                assert "loss" in entry and "learning_rate" in entry
                assert_codec_bits(entry, codec)
    if "hf_tb" in hf_job[0]:
        assert hf_job[0]["hf_tb"], "the Trainer's TensorBoard reporter did not get hopq's metrics"


def test_a_ddp_model_on_another_group_than_the_hook_is_refused(monkeypatch):
    """DDP(model, process_group=pg) with a HookState on the default group: the
    hook would average over its own group and DDP's would do nothing, so the
    integrations refuse it before registering (check_same_group)."""
    import types

    from hopq.integrations import ddp as hd

    a, b = object(), object()
    ranks = {id(a): [0, 1], id(b): [0, 1, 2, 3]}
    monkeypatch.setattr(hd.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(hd.dist, "get_process_group_ranks", lambda g: ranks[id(g)])
    with pytest.raises(ValueError, match=r"averages over ranks \[0, 1, 2, 3\]"):
        hd.check_same_group(
            types.SimpleNamespace(process_group=b), hopq.HookState("bf16", process_group=a)
        )
    hd.check_same_group(
        types.SimpleNamespace(process_group=a), hopq.HookState("bf16", process_group=a)
    )
    same = object()
    ranks[id(same)] = [1, 0]  # another handle on the same ranks
    hd.check_same_group(
        types.SimpleNamespace(process_group=same), hopq.HookState("bf16", process_group=a)
    )
