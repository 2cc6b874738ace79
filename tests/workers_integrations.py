"""Rank bodies of tests/test_integrations.py: one spawned 2-rank job per group of
frameworks, each running the examples' main() and the checks that need a group.

The ranks get the environment torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so Lightning, Fabric, Accelerate and the HF Trainer
take them as launched externally; the Gloo group is already up (hopq's
launcher), and every framework joins it instead of starting its own."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hopq
from hopq.integrations import ddp as hopq_ddp

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def as_torchrun(rank: int, n: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531",
    )  # fmt: skip


def example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"hopq_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def adopted(fn: Any, *args: Any) -> tuple[Any, list[str]]:
    """fn's result and, for every HookState it made, the class name of the
    optimizer the state holds afterwards ("" for none): the frameworks make the
    optimizer after the state, and hopq's integrations hand it over."""
    made: list[hopq.HookState] = []

    class Recorded(hopq.HookState):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            made.append(self)

    real, hopq.HookState = hopq.HookState, Recorded  # type: ignore[misc]
    try:
        out = fn(*args)
    finally:
        hopq.HookState = real  # type: ignore[misc]
    return out, [type(s.optimizer).__name__ if s.optimizer is not None else "" for s in made]


def caught(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """fn's result and the HookNotEngagedWarning messages it raised."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, [str(m.message) for m in w if issubclass(m.category, hopq.HookNotEngagedWarning)]


def _contains(pattern: str, needle: bytes) -> bool:
    files = glob.glob(pattern, recursive=True)
    return bool(files) and all(needle in Path(f).read_bytes() for f in files)


class Tiny(torch.nn.Module):
    """2,020 parameters: one DDP bucket that DynamiQ serves itself (1,348 would be
    too few for its budget, and run bf16: docs/codecs/dynamiq.md)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 96)
        self.b = torch.nn.Linear(96, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Backward(torch.nn.Module):
    """Tiny without biases, its layers registered in the order backward reaches
    them: DDP's first-step bucket layout (registration order) then equals the
    layout it rebuilds after that step (gradient-ready order), so a resumed job's
    first step sees the same buckets as an uninterrupted one."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Linear(96, 4, bias=False)
        self.a = torch.nn.Linear(16, 96, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _train(ddp: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, k: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + k)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()


# -- torch only (+ TensorBoard, W&B when installed) --------------------------------
def torch_job(rank: int, n: int, tmp: str) -> dict[str, Any]:
    as_torchrun(rank, n)
    out: dict[str, Any] = {}
    ex = example("ddp_torchrun")
    logger = "tensorboard" if importlib.util.find_spec("tensorboard") else "none"
    out["ddp"] = ex.main(["--steps", "4", "--logger", logger, "--out", f"{tmp}/tb"])
    if logger == "tensorboard":
        out["tb"] = _contains(f"{tmp}/tb/rank{rank}/events.*", b"hopq/bits_per_coordinate")
    out["ddp_bf16"] = ex.main(["--steps", "2", "--codec", "bf16", "--logger", "none"])
    if importlib.util.find_spec("wandb"):
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_SILENT"] = "true"
        ex.main(["--steps", "2", "--logger", "wandb", "--out", f"{tmp}/wb{rank}"])
        # W&B's service writes the run file after finish() returns: the test reads it
        out["wandb"] = glob.glob(f"{tmp}/wb{rank}/wandb/offline-run-*/*.wandb")
    out.update(detector(rank))
    out.update(checkpoint(rank, f"{tmp}/ckpt"))
    return out


def detector(rank: int) -> dict[str, Any]:
    """When the warning that the hook is not engaged fires, and when it must not."""
    out: dict[str, Any] = {}
    # built, asked for metrics, no training: silent
    _, out["idle"] = caught(lambda: hopq.HookState(codec="dynamiq").step_metrics())
    # registered and trained: silent
    model = Tiny()
    ddp = DDP(model)
    state = hopq.HookState(codec="bf16")
    ddp.register_comm_hook(state, hopq.ddp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def steps(ddp: Any, opt: Any, k: int) -> None:
        for i in range(k):
            _train(ddp, opt, rank, i)

    _, out["engaged"] = caught(steps, ddp, opt, hopq_ddp.UNENGAGED_STEPS + 2)
    out["engaged_metrics"] = state.step_metrics()
    # built, never registered, the model trains with DDP's own all-reduce
    lost = hopq.HookState(codec="dynamiq")
    ddp2 = DDP(Tiny())
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.1)
    _, out["unengaged_early"] = caught(steps, ddp2, opt2, hopq_ddp.UNENGAGED_STEPS - 1)
    _, out["unengaged"] = caught(steps, ddp2, opt2, 3)  # warns at the 10th step, once
    # step_metrics() after an optimizer step without a bucket warns at once
    lost2 = hopq.HookState(codec="bf16")
    _train(ddp2, opt2, rank, 0)
    _, out["unengaged_metrics"] = caught(lost2.step_metrics)
    # at exit, after one optimizer step (the function atexit runs)
    lost3 = hopq.HookState(codec="bf16")
    _train(ddp2, opt2, rank, 1)
    _, out["at_exit"] = caught(hopq_ddp._at_exit)
    del lost, lost2, lost3
    return out


def checkpoint(rank: int, path: str) -> dict[str, Any]:
    """HookState through torch.distributed.checkpoint: 3 steps, save (model,
    optimizer, hopq), a fresh job loads and takes 3 more: the same bits and
    parameters as 6 steps straight; without hopq's state they differ."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(codec: str) -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = Backward()
        ddp = DDP(model)
        state = hopq.HookState(codec=codec, seed=7)
        ddp.register_comm_hook(state, hopq.ddp_hook)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def run(ddp: Any, opt: Any, state: Any, ks: range) -> list[float]:
        sent = []
        for k in ks:
            _train(ddp, opt, rank, k)
            sent.append(state.pop_step().bytes_sent)
        return sent

    def flat(model: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    out: dict[str, Any] = {}
    for codec in ("dynamiq", "mxfp8"):
        model, ddp, state, opt = build(codec)
        straight = run(ddp, opt, state, range(6))
        out[f"{codec}/straight"] = (straight, flat(model), state.codec.state_dict())

        model, ddp, state, opt = build(codec)
        run(ddp, opt, state, range(3))
        out[f"{codec}/saved"] = state.codec.state_dict()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "hopq": state}, checkpoint_id=f"{path}/{codec}")
        for with_hopq in (True, False):
            model, ddp, state, opt = build(codec)
            msd, osd = get_state_dict(model, opt)
            sd: dict[str, Any] = {"model": msd, "optim": osd}
            if with_hopq:
                sd["hopq"] = state
            dcp.load(sd, checkpoint_id=f"{path}/{codec}")
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            loaded = state.codec.state_dict()
            resumed = run(ddp, opt, state, range(3, 6))
            out[f"{codec}/resumed/{with_hopq}"] = (resumed, flat(model), loaded)
    # counters that are each rank's own come back to their rank
    mx = hopq.HookState(codec="mxfp8")
    mx.codec.overflow = 100 + rank
    dcp.save({"hopq": mx}, checkpoint_id=f"{path}/local")
    back = hopq.HookState(codec="mxfp8")
    dcp.load({"hopq": back}, checkpoint_id=f"{path}/local")
    out["local_overflow"] = back.codec.overflow
    return out


# -- Lightning and Fabric ---------------------------------------------------------
def lightning_job(rank: int, n: int, tmp: str) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    as_torchrun(rank, n)
    out: dict[str, Any] = {}
    out["lightning"], out["lightning_opt"] = adopted(
        example("lightning_ddp").main, ["--steps", "4", "--out", f"{tmp}/lt"]
    )
    csv = glob.glob(f"{tmp}/lt/lightning_logs/version_*/metrics.csv")
    out["lightning_csv"] = Path(csv[0]).read_text().splitlines()[0] if csv else None
    # Lightning's own strategy with hopq's hook: DDP's all-reduce on CPU, and hopq says so
    from hopq.integrations.lightning import HopqDDPStrategy, HopqMetrics

    lit = example("lightning_ddp")
    x = torch.randn(1024, 32)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=32
    )

    class Plain(lit.Regressor):  # the example's module, without its own hopq logging
        def on_train_batch_end(self, *args: Any) -> None:
            pass

    def trainer(strategy: Any, steps: int, **kw: Any) -> Any:
        return L.Trainer(
            accelerator="cpu", devices=n, strategy=strategy, max_steps=steps,
            enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, **kw,
        )  # fmt: skip

    # the HopqMetrics callback logs for a module that does not (bf16, 2 steps)
    t = trainer(HopqDDPStrategy("bf16"), 2, logger=False, callbacks=[HopqMetrics()])
    t.fit(Plain(), loader)
    out["lightning_bf16"] = {k: float(v) for k, v in t.logged_metrics.items()}
    state = hopq.HookState(codec="dynamiq")
    plain = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hopq.ddp_hook)
    t = trainer(plain, hopq_ddp.UNENGAGED_STEPS, logger=False)
    _, out["plain_strategy"] = caught(t.fit, Plain(), loader)
    out["plain_strategy_calls"] = len(state.pop_stats())
    out["fabric"], out["fabric_opt"] = adopted(
        example("fabric_ddp").main, ["--steps", "4", "--out", f"{tmp}/fab"]
    )
    out["fabric_csv"] = bool(glob.glob(f"{tmp}/fab/lightning_logs/version_*/metrics.csv"))
    return out


# -- Accelerate and the HF Trainer ------------------------------------------------
def hf_job(rank: int, n: int, tmp: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    as_torchrun(rank, n)
    out: dict[str, Any] = {}
    out["accelerate"], out["accelerate_opt"] = adopted(
        example("accelerate_ddp").main, ["--steps", "4"]
    )
    # DistributedDataParallelKwargs(comm_hook=hopq.ddp_hook): Accelerate drops it
    from hopq.integrations.accelerate import register_hook

    kwargs = DistributedDataParallelKwargs(comm_hook=hopq.ddp_hook)  # type: ignore[arg-type]
    acc = Accelerator(cpu=True, kwargs_handlers=[kwargs])
    model = acc.prepare(Tiny())
    try:
        register_hook(acc, model, hopq.HookState(codec="bf16"))
        out["kwargs_refused"] = None
    except ValueError as e:
        out["kwargs_refused"] = str(e)
    out["kwargs_hooks"] = len(model._comm_hooks)  # what Accelerate registered: nothing
    acc2 = Accelerator(cpu=True)
    try:
        register_hook(acc2, Tiny(), "bf16")
        out["not_ddp"] = None
    except TypeError as e:
        out["not_ddp"] = str(e)
    report = "tensorboard" if importlib.util.find_spec("tensorboard") else "none"
    logs, out["hf_opt"] = adopted(
        example("hf_trainer").main, ["--steps", "6", "--out", f"{tmp}/hf", "--report-to", report]
    )
    out["hf_logs"] = logs
    if report == "tensorboard" and rank == 0:  # the Trainer's reporters write on rank 0
        out["hf_tb"] = _contains(f"{tmp}/hf/**/events.*", b"hopq/bits_per_coordinate")
    logs16 = example("hf_trainer").main(["--steps", "5", "--codec", "bf16", "--out", f"{tmp}/hf16"])
    out["hf_logs_bf16"] = logs16
    return out
