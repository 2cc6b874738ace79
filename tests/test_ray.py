"""hopq.integrations.ray: Ray Train's TorchTrainer with 2 CPU workers (Gloo) and
DynamiQ, on a local Ray cluster started and shut down by this module."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import hopq
from hopq.integrations import ray as hopq_ray

#: DynamiQ's default budget (bits per coordinate, statistics included).
DYNAMIQ_BUDGET = 5.0
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ray_train.py"


def _digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def checked_train(config: dict[str, Any]) -> dict[str, Any]:
    """Each worker: the example's training, then what the test checks, returned
    from rank 0 (Ray hands it to the driver as ``result.return_value``)."""
    import ray.train
    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("hopq_example_ray_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    given = ray.train.get_checkpoint()
    resumed: dict[str, Any] = {}
    if given is not None:  # what the example resumes from
        with given.as_directory() as d:
            resumed["resumed_epoch"] = torch.load(Path(d) / "train.pt", weights_only=True)["epoch"]
            loaded = hopq.HookState(codec="dynamiq")
            hopq_ray.load_state(loaded, d)
            resumed["resumed_hopq"] = hashlib.sha256(loaded.state_dict()["codec"]).hexdigest()
    model, state = example.train(config)
    mine = (_digest(model.parameters()), hashlib.sha256(state.state_dict()["codec"]).hexdigest())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {"params": [p for p, _ in gathered], "hopq": [h for _, h in gathered], **resumed}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray Train is not installed: pip install 'ray[train]'")
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # the controller polls the workers every 2 s by default; 0.25 s took one fit
        # on 2 shared cores from 30 s to 23 s
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


def _fit(storage: Path, epochs: int) -> Any:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        checked_train,
        train_loop_config={"codec": "dynamiq", "epochs": epochs, "steps": 3},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="hopq", storage_path=str(storage)),
    ).fit()


@pytest.fixture(scope="module")
def first_run(ray_cluster, tmp_path_factory):
    """One epoch of the example on 2 workers; its storage, for the resumed run."""
    storage = tmp_path_factory.mktemp("ray")
    return _fit(storage, epochs=1), storage


def test_torch_trainer_reports_hopq_and_the_workers_agree(first_run):
    """hopq's metrics reach ray.train.report, the workers end with the same
    bits, and the checkpoint holds the model and each rank's hopq state."""
    result, _ = first_run
    m, out = result.metrics, result.return_value
    assert m["epoch"] == 0 and m["hopq/buckets"] == 1, m  # per step: the one bucket
    assert 0.9 * DYNAMIQ_BUDGET <= m["hopq/bits_per_coordinate"] <= DYNAMIQ_BUDGET + 0.05, m
    assert len(out["params"]) == 2 and len(set(out["params"])) == 1, out  # bit-identical
    assert len(set(out["hopq"])) == 1, out  # the codec's shared state agrees
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["hopq-rank0.pt", "hopq-rank1.pt", "train.pt"]
        saved = torch.load(Path(d) / "train.pt", weights_only=True)
        fresh = hopq.HookState(codec="dynamiq")
        hopq_ray.load_state(fresh, d)
    assert _digest(saved["model"].values()) == out["params"][0]  # the final parameters
    assert hashlib.sha256(fresh.state_dict()["codec"]).hexdigest() == out["hopq"][0]
    assert fresh.state_dict() != hopq.HookState(codec="dynamiq").state_dict()


def test_a_second_run_of_the_same_name_resumes_hopq(first_run):
    """Ray hands the latest checkpoint to the next run of the same name and
    storage; each rank loads hopq's state from it and training goes on."""
    first, storage = first_run
    second = _fit(storage, epochs=2)
    again = second.return_value
    assert again["resumed_epoch"] == 0, again
    assert again["resumed_hopq"] == first.return_value["hopq"][0], again
    assert second.metrics["epoch"] == 1, second.metrics  # epoch 0 is not trained again
    assert (
        0.9 * DYNAMIQ_BUDGET <= second.metrics["hopq/bits_per_coordinate"] <= DYNAMIQ_BUDGET + 0.05
    )
    assert len(set(again["params"])) == 1 and again["params"][0] != first.return_value["params"][0]


def test_prepare_model_refuses_what_it_cannot_hook(monkeypatch, tmp_path):
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed")
    import ray.train
    import ray.train.torch

    with pytest.raises(ValueError, match="parallel_strategy='ddp'"):
        hopq_ray.prepare_model(torch.nn.Linear(2, 2), "dynamiq", parallel_strategy="fsdp")

    class OneWorker:
        def get_world_size(self) -> int:
            return 1

    # one worker: Ray returns the plain module
    monkeypatch.setattr(ray.train.torch, "prepare_model", lambda m, **k: m)
    monkeypatch.setattr(ray.train, "get_context", lambda: OneWorker())
    with pytest.raises(TypeError, match="num_workers >= 2"):
        hopq_ray.prepare_model(torch.nn.Linear(2, 2), hopq.HookState(codec="dynamiq"))
    with pytest.raises(FileNotFoundError, match="save_state"):
        hopq_ray.load_state(hopq.HookState(codec="dynamiq"), tmp_path)
    with pytest.raises(TypeError, match="HookState or a codec name"):
        hopq_ray.prepare_model(torch.nn.Linear(2, 2), object())  # type: ignore[arg-type]
    # a state whose hook was never registered names Ray's remedy
    from hopq.integrations.ddp import not_engaged_message

    msg = not_engaged_message(hopq.HookState(codec="dynamiq"), 2, "after 10 steps")
    assert "hopq.integrations.ray.prepare_model" in msg, msg
