"""hopq's state in each framework's own checkpoint (Lightning's strategy, the HF
Trainer's callback, Accelerate's save_state), FSDP's reduce-scatter through
torch.distributed.checkpoint, and the rough edges of the integrations: an
optimizer given to a codec that reads none, one HookState on two models, a spawned
copy of a module-level state, ``Trainer(strategy="hopq_ddp")``, codec names in any
case.

A checkpoint test runs an uninterrupted 2-rank job that saves at step k, then a
second job in fresh processes that resumes from it: the codec's state at the
resume equals the saved one, and the resumed training ends bit for bit where the
uninterrupted one does (the models keep one DDP bucket layout from the first step
on; see tests/workers_state.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hopq
from hopq.cluster.launch import run_workers
from hopq.integrations.ddp import adopt_optimizer
from tests import workers_state as ws
from tests.test_integrations import same

ROOT = Path(__file__).resolve().parent.parent


def assert_resumed(straight: list, resumed: list) -> None:
    for r in range(2):
        s, z = straight[r], resumed[r]
        # the codec's state at the resume is the one saved: round, budget shares,
        # statistics of the step under way
        assert s["at_save"]["round"] > 0 and s["at_save"]["shares"]
        assert same(z["at_start"], s["at_save"])
        # and the resumed training ends where the uninterrupted one does, bit for bit
        assert same(z["end"], s["end"])
        assert torch.equal(z["params"].view(torch.int32), s["params"].view(torch.int32))
    assert torch.equal(resumed[0]["params"], resumed[1]["params"])  # replicas agree


# -- checkpoints --------------------------------------------------------------------
def test_lightning_checkpoint_carries_the_codec_state(tmp_path):
    pytest.importorskip("lightning")
    straight = run_workers(2, ws.lightning_ckpt, str(tmp_path), False, timeout=600)
    resumed = run_workers(2, ws.lightning_ckpt, str(tmp_path), True, timeout=600)
    assert straight[0]["steps"] == resumed[0]["steps"] == 9
    assert straight[0]["end"]["round"] == 9  # one bucket per step
    assert_resumed(straight, resumed)
    # a checkpoint saved without hopq's state leaves it as it is
    ckpt = next(tmp_path.glob("lt/epoch=0-*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)["hopq"]
    assert saved["codec_name"] == "dynamiq" and saved["seed"] == 5


def test_hf_trainer_checkpoint_carries_the_codec_state(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    straight = run_workers(2, ws.hf_ckpt, str(tmp_path), False, timeout=600)
    resumed = run_workers(2, ws.hf_ckpt, str(tmp_path), True, timeout=600)
    assert straight[0]["files"] == ["hopq_state_rank0.pt", "hopq_state_rank1.pt"]
    assert straight[0]["end"]["round"] == ws.STEPS
    assert_resumed(straight, resumed)


def test_accelerate_save_state_carries_the_codec_state(tmp_path):
    pytest.importorskip("accelerate")
    straight = run_workers(2, ws.accelerate_ckpt, str(tmp_path), False, timeout=600)
    resumed = run_workers(2, ws.accelerate_ckpt, str(tmp_path), True, timeout=600)
    assert [r["registered"] for r in straight] == [1, 1]  # by register_hook, once
    assert straight[0]["end"]["round"] == ws.STEPS
    assert_resumed(straight, resumed)


def test_accelerate_save_state_carries_every_ranks_own_counters(tmp_path):
    """Accelerate writes rank 0's file for all ranks: MX's per-rank counters of
    every rank travel in it, and each rank resumes with its own (without the
    gather, rank 1's would restart at 0)."""
    pytest.importorskip("accelerate")
    args = (ws.accelerate_ckpt, str(tmp_path))
    straight = run_workers(2, *args, False, "mxfp8", timeout=600)
    resumed = run_workers(2, *args, True, "mxfp8", timeout=600)
    saved = torch.load(tmp_path / "acc" / "custom_checkpoint_0.pkl", weights_only=False)
    assert sorted(saved["codec_local"]) == ["0", "1"]
    assert all(r["at_save"]["encoded"] > 0 for r in straight)
    for r in range(2):
        s, z = straight[r], resumed[r]
        assert same(z["at_start"], s["at_save"])  # this rank's own counters
        assert same(z["end"], s["end"])
        assert torch.equal(z["params"].view(torch.int32), s["params"].view(torch.int32))


def test_fabric_save_gathers_every_ranks_counters_from_a_state_dict_too(tmp_path):
    """A user who saves ``strategy.hook_state.state_dict()`` instead of the
    object gets every rank's own counters in the one file Fabric writes, as
    with the object (MXFP8's saturation counters are each rank's)."""
    pytest.importorskip("lightning")
    first = run_workers(
        2, ws.fabric_ckpt, str(tmp_path), False, "mxfp8", 4, True, timeout=600
    )  # fmt: skip
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)
    local = saved["hopq"]["codec_local"]
    assert sorted(local) == ["0", "1"]
    for r in range(2):  # each rank's entry is the one that rank held
        assert local[str(r)] == first[r]["saving"]["own_local"][str(r)]


@pytest.mark.parametrize("codec", ["dynamiq", "mxfp8"])
def test_fabric_save_and_load_carry_the_codec_state(tmp_path, codec):
    """docs/integrations/frameworks.md's Fabric recipe: ``fabric.save(path, {"model",
    "optimizer", "hopq": strategy.hook_state})``, then in fresh processes a new
    Fabric, model and HookState ``fabric.load(path, {...same...})``. 4 steps
    uninterrupted; 2 steps and save; load and 2 more: the codec starts from the
    saved state (DynamiQ's round, budget shares and statistics; MX's scale and
    each rank's own saturation counters, which the strategy gathers into the one
    file Fabric writes) and ends, with the parameters, bit for bit where the
    uninterrupted run does. Loaded without ``"hopq"``, the codec restarts at
    round 0 (DynamiQ's parameters then differ; MX's agree over these two
    steps)."""
    pytest.importorskip("lightning")
    first = run_workers(2, ws.fabric_ckpt, str(tmp_path), False, codec, timeout=600)
    second = run_workers(2, ws.fabric_ckpt, str(tmp_path), True, codec, timeout=600)
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)
    assert sorted(saved) == ["hopq", "model", "optimizer"]
    assert saved["hopq"]["codec_name"] == codec and saved["hopq"]["seed"] == 5
    if codec == "mxfp8":  # every rank's counters, though rank 0 wrote the file
        assert sorted(saved["hopq"]["codec_local"]) == ["0", "1"]
    for r in range(2):
        s, v = first[r]["straight"], first[r]["saving"]
        z, o = second[r]["resumed"], second[r]["no_hopq"]
        assert s["end"]["round"] == 4 and v["end"]["round"] == 2  # one bucket a step
        if codec == "dynamiq":
            assert v["end"]["shares"] and v["end"]["step_stats"]
        else:
            assert v["end"]["mu"] is not None and v["end"]["encoded"] > 0, v["end"]
        # the codec's state at the resume is the one saved, tensors bit for bit
        assert z["remainder"] == [] and z["at_start"]["round"] == 2
        assert same(z["at_start"], v["end"])
        # and the resumed run ends where the uninterrupted one does, bit for bit
        assert same(z["end"], s["end"])
        assert torch.equal(z["params"].view(torch.int32), s["params"].view(torch.int32))
        # without hopq's entry: the codec restarts (and DynamiQ's run ends elsewhere)
        assert o["remainder"] == ["hopq"] and o["at_start"]["round"] == 0
        assert o["end"]["round"] == 2 and not same(o["end"], s["end"])
        if codec == "dynamiq":
            assert not torch.equal(o["params"], s["params"])
    assert torch.equal(second[0]["resumed"]["params"], second[1]["resumed"]["params"])


def test_fsdp_state_survives_dcp(tmp_path):
    from hopq.integrations import fsdp

    if not fsdp.HAVE_FSDP_API:
        pytest.skip("this torch has no FSDP2 custom reduce-scatter")
    out = run_workers(2, ws.fsdp_dcp, str(tmp_path / "dcp"), timeout=600)
    for res in out:
        saved, loaded = res["saved"], res["loaded"]
        # round: FSDP's reduce-scatters over 3 steps; DynamiQ's shares and statistics per key
        assert saved["round"] >= 3 and saved["shares"] and saved["step_stats"]
        assert same(loaded, saved) and res["seed"] == 3


# -- an optimizer given to a codec that reads none ------------------------------------
@pytest.mark.parametrize("codec", ["bf16", "mxfp8", "equarx", "gqsgd-exp"])
def test_an_optimizer_is_ignored_by_codecs_that_read_none(codec):
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.warns(UserWarning, match=f"codec '{codec}' takes no optimizer.*ignored") as w:
        state = hopq.HookState(codec=codec, optimizer=opt)
    assert state.optimizer is None
    assert sum("takes no optimizer" in str(m.message) for m in w) == 1


def test_integrations_say_once_that_they_ignore_the_optimizer(caplog):
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    state = hopq.HookState(codec="bf16")
    with caplog.at_level(logging.INFO, logger="hopq"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a framework handed it: a log record, no warning
        adopt_optimizer(state, [opt], "HopqDDPStrategy")
        adopt_optimizer(state, [opt], "HopqDDPStrategy")
    said = [r.getMessage() for r in caplog.records if "takes no optimizer" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("HopqDDPStrategy:")
    assert state.optimizer is None


def test_a_configuration_that_leaves_the_optimizer_unused_is_still_refused():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fixed_level=0 truncates every value"):
        hopq.HookState("gcomp", optimizer=opt, fixed_level=0)


# -- one HookState per model -----------------------------------------------------------
def test_one_hook_state_on_two_models_is_refused():
    out = run_workers(2, ws.one_state_per_model, timeout=300)
    for res in out:
        msg = res["shared"]
        assert msg is not None and "two DDP models" in msg and "one HookState per model" in msg
        assert res["rounds"] == (6, 3)  # one state per model: each its own round
        assert res["reused_after_free"] == 7


# -- a module-level state under start_method="spawn" -----------------------------------
def test_spawned_copy_of_a_module_level_state_does_not_warn():
    pytest.importorskip("lightning")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "lightning_spawn_script.py")],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-3000:]
    # the strategy's copy served every step on both ranks ...
    assert "BUCKETS rank=0 calls=12" in text and "BUCKETS rank=1 calls=12" in text, text[-3000:]
    # ... and the module-level copies each spawned process rebuilt stay silent
    assert "not engaged" not in text, text[-3000:]


# -- names ------------------------------------------------------------------------------
def test_lightning_strategy_by_name():
    pytest.importorskip("lightning")
    out = run_workers(2, ws.lightning_by_name, timeout=300)
    for res in out:
        assert res["is_hopq"] and res["codec"] == "dynamiq"
        assert res["buckets"] >= 1


def test_codec_names_in_any_case_and_close_names():
    assert hopq.get_codec("DynamiQ").name == "dynamiq"
    assert hopq.HookState(codec="BF16").codec.name == "bf16"
    with pytest.raises(ValueError, match=r"unknown codec 'dynamik' \(did you mean 'dynamiq'\?\)"):
        hopq.get_codec("dynamik")
    with pytest.raises(ValueError, match="unknown codec 'nothing like it'; available"):
        hopq.get_codec("nothing like it")
