"""hopq's FSDP2 reduce-scatter reached through the frameworks (Lightning's
ModelParallelStrategy, ...): engaged (the codec's bits per coordinate on the
wire), every rank's parameters identical, the loss close to native FSDP, and
the FSDP1 paths refused with a message naming the way that works."""

from __future__ import annotations

import pytest
import torch

from hopq.cluster.launch import run_workers
from tests import workers_integrations_fsdp as wf

pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")

STEPS = 4
#: DynamiQ's default budget (bits per coordinate, statistics included).
DYNAMIQ_BUDGET = 5.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _same_on_every_rank(res: list, name: str) -> None:
    for k, v in res[0][name]["params"].items():
        assert torch.equal(_bits(v), _bits(res[1][name]["params"][k])), (name, k)


def _same_state(a, b) -> None:
    """Equal nested codec states, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        for k in a:
            _same_state(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_state(x, y)
    else:
        assert a == b, (a, b)


def _dynamiq_bits(bits: list[list[float]]) -> None:
    """Per step, each rank's bits per coordinate (what it sent) near DynamiQ's budget,
    their mean at it."""
    for step in zip(*bits, strict=True):
        assert all(0.8 * DYNAMIQ_BUDGET <= b <= 1.2 * DYNAMIQ_BUDGET for b in step), step
        assert sum(step) / len(step) == pytest.approx(DYNAMIQ_BUDGET, abs=0.1), step


def _close_to_native(res: list, name: str, tol: float) -> None:
    for r in range(2):
        nat, got = res[r]["native"]["losses"], res[r][name]["losses"]
        assert len(got) == len(nat) == STEPS
        for a, b in zip(got, nat, strict=True):
            assert abs(a - b) <= tol * abs(b), (name, got, nat)


@pytest.fixture(scope="module")
def lightning_fsdp(tmp_path_factory):
    pytest.importorskip("lightning")
    tmp = str(tmp_path_factory.mktemp("lt_fsdp"))
    return run_workers(2, wf.lightning_fsdp_job, STEPS, tmp, timeout=600)


def test_lightning_callback_engages_the_reduce_scatter(lightning_fsdp):
    for r in range(2):
        m = lightning_fsdp[r]["callback"]["metrics"]
        assert m["hopq/buckets"] >= 1, m
        assert m["hopq/bits_per_coordinate"] == 16.0, m  # bf16
    _same_on_every_rank(lightning_fsdp, "callback")
    _close_to_native(lightning_fsdp, "callback", 0.01)


def test_lightning_install_fsdp_in_configure_model(lightning_fsdp):
    for r in range(2):
        steps = lightning_fsdp[r]["helper"]["steps"]
        assert len(steps) == STEPS
        for m in steps:  # the two Linear modules (the root has no parameters)
            assert m["hopq/buckets"] == 2, m
            assert 0.9 * DYNAMIQ_BUDGET <= m["hopq/bits_per_coordinate"] <= DYNAMIQ_BUDGET + 0.2, m
    _same_on_every_rank(lightning_fsdp, "helper")
    _close_to_native(lightning_fsdp, "helper", 0.1)


def test_lightning_checkpoint_resumes_the_codec_bit_exact(lightning_fsdp):
    """Lightning's checkpoint carries HopqFSDP's comm state: 2 steps, saved, 2 more
    after fit(ckpt_path=...) give the parameters of 4 uninterrupted steps."""
    for r in range(2):
        a, b = lightning_fsdp[r]["uninterrupted"], lightning_fsdp[r]["resumed"]
        for k, v in a.items():
            assert torch.equal(_bits(v), _bits(b[k])), k


def test_lightning_ddp_strategy_and_metrics_name_the_fsdp2_way(lightning_fsdp):
    for r in range(2):
        for name in ("ddp_strategy", "ddp_metrics"):
            msg = lightning_fsdp[r][name]
            assert msg is not None and "HopqFSDP" in msg, (name, msg)


def test_lightning_fsdp_strategy_is_refused_by_the_callback():
    """Lightning's FSDPStrategy (FSDP1, which Lightning and torch run on GPUs only)."""
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from hopq.integrations.lightning import HopqFSDP

    with pytest.raises(TypeError, match="ModelParallelStrategy"):
        HopqFSDP("bf16").setup(SimpleNamespace(strategy=FSDPStrategy()), None, "fit")


# -- Accelerate -------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerate_fsdp():
    pytest.importorskip("accelerate")
    return run_workers(2, wf.accelerate_fsdp_job, STEPS, timeout=600)


def test_accelerate_register_fsdp(accelerate_fsdp):
    for r in range(2):
        assert accelerate_fsdp[r]["native"]["fsdp2"] and accelerate_fsdp[r]["hopq"]["fsdp2"]
        steps = accelerate_fsdp[r]["hopq"]["steps"]
        assert len(steps) == STEPS
        assert all(m["hopq/buckets"] >= 1 for m in steps), steps
    _dynamiq_bits(
        [[m["hopq/bits_per_coordinate"] for m in r["hopq"]["steps"]] for r in accelerate_fsdp]
    )
    _same_on_every_rank(accelerate_fsdp, "hopq")
    _close_to_native(accelerate_fsdp, "hopq", 0.1)


def test_accelerate_fsdp_save_state_resumes_the_codec_bit_exact(tmp_path):
    """Accelerate's FSDP2 path (its state set to FSDP by hand, as on GPUs) through
    ``save_state``/``load_state``: Accelerate's sharded model and optimizer
    (``pytorch_model_fsdp_0``/``optimizer_0``, through DCP) beside hopq's
    ``custom_checkpoint_0.pkl``, which ``register_fsdp`` registered. 4 steps
    uninterrupted; 2 steps and ``save_state``; in fresh processes a new
    Accelerator, model and FSDPReduceScatter, ``register_fsdp``, ``load_state``
    and 2 more: the codec starts from the saved round, budget shares and
    statistics and ends, with the losses and parameters, bit for bit where the
    uninterrupted run does. Without hopq's entry (an unregistered reduce-scatter:
    Accelerate refuses the checkpoint for its extra custom object, and a copy
    without it loads the model and optimizer alone) the codec restarts at round 0
    and the parameters differ after the first resumed step."""
    pytest.importorskip("accelerate")
    first = run_workers(2, wf.accelerate_fsdp_ckpt_job, STEPS, str(tmp_path), False, timeout=600)
    second = run_workers(2, wf.accelerate_fsdp_ckpt_job, STEPS, str(tmp_path), True, timeout=600)
    half = STEPS // 2
    files = set(first[0]["saving"]["files"])
    assert {"custom_checkpoint_0.pkl", "pytorch_model_fsdp_0", "optimizer_0"} <= files, files
    for r in range(2):
        s, v = first[r]["straight"], first[r]["saving"]
        z, o = second[r]["resumed"], second[r]["no_hopq"]
        assert s["end"]["round"] == STEPS and v["end"]["round"] == half  # one a step
        assert v["end"]["shares"] and v["end"]["step_stats"], v["end"]
        assert v["train"] == s["train"][:half]
        # the codec's state at the resume is the one saved, tensors bit for bit
        _same_state(z["at_start"], v["end"])
        # and the resumed run ends where the uninterrupted one does, bit for bit
        _same_state(z["end"], s["end"])
        assert z["train"] == s["train"][half:]
        assert s["params"].keys() == z["params"].keys()
        for k, p in s["params"].items():
            assert torch.equal(_bits(p), _bits(z["params"][k])), k
        # without hopq's entry: the model and optimizer resume (the first loss
        # agrees), the codec restarts at round 0, and the run ends elsewhere
        assert "does not match the number of registered objects" in o["mismatch"]
        assert o["at_start"]["round"] == 0 and o["end"]["round"] == half
        assert o["train"][0] == s["train"][half] and o["train"][1:] != s["train"][half + 1 :]
        assert not any(torch.equal(p, o["params"][k]) for k, p in s["params"].items())
    _same_on_every_rank([second[0], second[1]], "resumed")


def test_accelerate_fsdp_on_cpu_and_ddp_hooks_are_refused_by_name(accelerate_fsdp):
    for r in range(2):
        assert accelerate_fsdp[r]["cpu_type"] == "DistributedType.MULTI_CPU"
        assert "register_hook" in accelerate_fsdp[r]["cpu_refused"]
        assert "register_fsdp" in accelerate_fsdp[r]["hook_refused"]


# -- HF Trainer -------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_fsdp(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = str(tmp_path_factory.mktemp("hf_fsdp"))
    return run_workers(2, wf.hf_fsdp_job, STEPS, tmp, timeout=600)


def test_hf_trainer_attaches_the_reduce_scatter(hf_fsdp):
    for r in range(2):
        assert hf_fsdp[r]["native"]["fsdp2"].startswith("FSDP")
        logs = hf_fsdp[r]["hopq"]["logs"]
        assert len(logs) == STEPS and all(e["hopq/buckets"] >= 1 for e in logs), logs
        assert "loss" in logs[0]  # the Trainer's own entry, hopq's beside it
    _dynamiq_bits([[e["hopq/bits_per_coordinate"] for e in r["hopq"]["logs"]] for r in hf_fsdp])
    _same_on_every_rank(hf_fsdp, "hopq")
    _close_to_native(hf_fsdp, "hopq", 0.01)


def test_hf_trainer_fsdp_on_cpu_is_refused_naming_the_way(hf_fsdp):
    """On CPU Accelerate applies no FSDP; the Trainer uses DDP."""
    for r in range(2):
        assert hf_fsdp[r]["cpu_type"] == "DistributedType.MULTI_CPU"
        msg = hf_fsdp[r]["cpu_refused"]
        assert msg is not None and "fsdp_version" in msg and "HookState" in msg


def test_hf_trainer_fsdp_checkpoint_resumes_the_codec_bit_exact(tmp_path):
    """The Trainer's own checkpoint under FSDP2 (Accelerate's sharded model and
    optimizer, ``pytorch_model_fsdp_0``/``optimizer_0``, beside hopq's
    ``hopq_state_rank<r>.pt``): 4 steps uninterrupted; in the same processes 4
    steps saving at step 2; in fresh processes a new Trainer with a fresh
    FSDPReduceScatter ``train(resume_from_checkpoint=checkpoint-2)``. The resumed
    codec starts from the saved round, budget shares and statistics, and the run
    ends bit for bit where the uninterrupted one does: codec state, losses and
    parameters (with hopq's state left out, the codec restarts at round 0 and the
    parameters differ from step 3 on)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests.test_integrations import same

    first = run_workers(2, wf.hf_fsdp_ckpt_job, STEPS, str(tmp_path), False, timeout=600)
    second = run_workers(2, wf.hf_fsdp_ckpt_job, STEPS, str(tmp_path), True, timeout=600)
    half = STEPS // 2
    files = set(first[0]["files"])
    assert {"hopq_state_rank0.pt", "hopq_state_rank1.pt"} <= files, files
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= files, files  # the Trainer's own
    for r in range(2):
        s, v, z = first[r]["straight"], first[r]["saving"], second[r]["resumed"]
        # saving does not change the run
        assert same(v["end"], s["end"]) and v["losses"] == s["losses"]
        # the codec's state at the resume is the one saved (one reduce-scatter a step)
        assert v["at_save"]["round"] == half and v["at_save"]["shares"], v["at_save"]
        assert same(z["at_start"], v["at_save"])
        # and the resumed run ends where the uninterrupted one does, bit for bit
        assert s["end"]["round"] == STEPS
        assert same(z["end"], s["end"])
        assert z["losses"] == s["losses"]  # the checkpoint's log history, then steps 3-4
        assert s["params"].keys() == z["params"].keys()
        for k, p in s["params"].items():
            assert torch.equal(_bits(p), _bits(v["params"][k])), k
            assert torch.equal(_bits(p), _bits(z["params"][k])), k
    for k, p in second[0]["resumed"]["params"].items():  # every rank the same
        assert torch.equal(_bits(p), _bits(second[1]["resumed"]["params"][k])), k


# -- torchtitan -------------------------------------------------------------------
def test_torchtitan_recipe_installs_on_its_fsdp2_model():
    """docs/integrations/fsdp.md's torchtitan recipe, as far as CPU allows: the
    reduce-scatter set on every FSDP module torchtitan's own sharding made, and
    the sharded model runs forward."""
    pytest.importorskip("torchtitan.models.llama3")
    res = run_workers(2, wf.torchtitan_job, timeout=300)
    for r in range(2):
        assert res[r]["installed"] == res[r]["fsdp_modules"] >= 3, res[r]
        assert 0.0 < res[r]["loss"] < 20.0, res[r]


@pytest.fixture(scope="module")
def torchtitan_runs(tmp_path_factory):
    pytest.importorskip("torchtitan.models.llama3")
    tmp = str(tmp_path_factory.mktemp("titan"))
    first = run_workers(2, wf.torchtitan_train_job, STEPS, STEPS // 2, tmp, False, timeout=600)
    again = run_workers(2, wf.torchtitan_train_job, STEPS, STEPS // 2, tmp, True, timeout=600)
    return [{**a, **b} for a, b in zip(first, again, strict=True)]


def test_torchtitan_trains_with_the_reduce_scatter(torchtitan_runs):
    """torchtitan's model, sharding (apply_fsdp_to_decoder) and optimizer container,
    attention computed by SDPA on CPU: DynamiQ engaged on every FSDP module, the
    ranks identical, the losses within 1% of native FSDP's."""
    for r in range(2):
        run = torchtitan_runs[r]["uninterrupted"]
        assert run["installed"] >= 3, run["installed"]
    _dynamiq_bits([r["uninterrupted"]["bits"][1:] for r in torchtitan_runs])  # after warm-up
    _same_on_every_rank(torchtitan_runs, "uninterrupted")
    _close_to_native(torchtitan_runs, "uninterrupted", 0.01)


def test_torchtitan_checkpoint_resumes_the_codec_bit_exact(torchtitan_runs):
    """The recipe's train state carries hopq's through DCP as torchtitan saves it:
    resumed in fresh processes at step 2, the codec's state and the parameters at
    step 4 are the uninterrupted run's bit for bit; without hopq's state they are not."""
    for r in range(2):
        a, b = torchtitan_runs[r]["uninterrupted"], torchtitan_runs[r]["resumed"]
        assert b["step"] == a["step"] == STEPS
        _same_state(b["codec"], a["codec"])
        assert b["losses"] == a["losses"][STEPS // 2 :]
        for k, v in a["params"].items():
            assert torch.equal(_bits(v), _bits(b["params"][k])), k
        lost = torchtitan_runs[r]["without_hopq_state"]
        assert lost["codec"]["round"] != a["codec"]["round"]
        assert any(not torch.equal(v, lost["params"][k]) for k, v in a["params"].items())


def test_torchtitan_trainer_has_what_the_recipe_overrides():
    """Read from its source: importing torchtitan.trainer needs its data packages
    (torchdata, datasets), which a CPU check does without."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.origin is None:
        pytest.skip("torchtitan is not installed")
    src = (Path(spec.origin).parent / "trainer.py").read_text()
    assert "def __init__(self, config: Config):" in src
    assert "def train_step(\n        self, data_iterator" in src
    assert "self.model_parts = [model]" in src
    assert 'states={"train_state": self}' in src  # what the CheckpointManager saves
    assert "def state_dict(self) -> dict[str, Any]:" in src
    assert "def load_state_dict(self, state_dict: dict[str, Any]):" in src
