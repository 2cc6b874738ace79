"""Rank bodies of tests/test_integrations_state.py: hopq's state through each
framework's own checkpoint (save at step k, resume in fresh processes), FSDP's
reduce-scatter through torch.distributed.checkpoint, and one HookState per model.

Every model is ``Backward`` (tests/workers_integrations.py): its first-step DDP
bucket layout equals the one DDP rebuilds after that step, so a resumed job's
first step sees the same buckets as an uninterrupted one and the two runs can be
compared bit for bit."""

from __future__ import annotations

import gc
import glob
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hopq
from tests import workers_integrations as wi

#: Steps before the checkpoint, and in all.
SAVE_AT, STEPS = 3, 6


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(96, 16, generator=g), torch.randn(96, 4, generator=g)


# -- Lightning ---------------------------------------------------------------------
def lightning_ckpt(rank: int, n: int, tmp: str, resume: bool) -> dict[str, Any]:
    """3 epochs of 3 steps; the straight run saves a checkpoint after each epoch;
    the resumed one loads epoch 0's (``fit(ckpt_path=...)``)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from hopq.integrations.lightning import HopqDDPStrategy

    wi.as_torchrun(rank, n)
    out: dict[str, Any] = {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = wi.Backward()

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Probe(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            out["at_start"] = trainer.strategy.hook_state.codec.state_dict()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == SAVE_AT:
                out["at_save"] = trainer.strategy.hook_state.codec.state_dict()

    x, y = _data(rank)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    state = hopq.HookState(codec="dynamiq", seed=5)
    trainer = L.Trainer(
        accelerator="cpu", devices=n, strategy=HopqDDPStrategy(state), max_epochs=3,
        callbacks=[ModelCheckpoint(dirpath=f"{tmp}/lt", save_top_k=-1, every_n_epochs=1), Probe()],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Module()
    ckpt = sorted(glob.glob(f"{tmp}/lt/epoch=0-*.ckpt"))[0] if resume else None
    trainer.fit(module, loader, ckpt_path=ckpt)
    out["end"] = state.codec.state_dict()
    out["params"] = flat(module)
    out["steps"] = trainer.global_step
    return out


def lightning_by_name(rank: int, n: int) -> dict[str, Any]:
    """``Trainer(strategy="hopq_ddp")`` trains with hopq's hook (DynamiQ)."""
    import lightning as L

    import hopq.integrations.lightning as hl

    wi.as_torchrun(rank, n)
    x, y = _data(rank)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = wi.Backward()

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu", devices=n, strategy="hopq_ddp", max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Module(), loader)
    s = trainer.strategy
    return {
        "type": type(s).__name__,
        "is_hopq": isinstance(s, hl.HopqDDPStrategy),
        "codec": s.hook_state.codec.name,
        "buckets": s.hook_state.pop_step().buckets,
    }


# -- the HF Trainer ------------------------------------------------------------------
class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = wi.Backward()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, y), "logits": out}


def hf_ckpt(rank: int, n: int, tmp: str, resume: bool) -> dict[str, Any]:
    """6 steps, a checkpoint every 3; the resumed job ``train(resume_from_checkpoint=
    checkpoint-3)``."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hopq.integrations.transformers import attach

    wi.as_torchrun(rank, n)
    out: dict[str, Any] = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            out["at_start"] = state.codec.state_dict()

        def on_step_end(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            if st.global_step == SAVE_AT:
                out["at_save"] = state.codec.state_dict()

    x, y = _data(rank)
    data = [{"x": a, "y": b} for a, b in zip(x, y, strict=True)]
    targs = TrainingArguments(
        output_dir=f"{tmp}/hf", max_steps=STEPS, per_device_train_batch_size=8,
        learning_rate=0.1, lr_scheduler_type="constant", optim="sgd", save_strategy="steps",
        save_steps=SAVE_AT, report_to="none", use_cpu=True, disable_tqdm=True,
        logging_steps=100, seed=0,
    )  # fmt: skip
    model = _Regressor()
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    state = attach(trainer, hopq.HookState(codec="dynamiq", seed=5))
    trainer.add_callback(Probe())
    trainer.train(resume_from_checkpoint=f"{tmp}/hf/checkpoint-{SAVE_AT}" if resume else None)
    out["end"] = state.codec.state_dict()
    out["params"] = flat(model)
    out["files"] = sorted(
        p.rsplit("/", 1)[1] for p in glob.glob(f"{tmp}/hf/checkpoint-{SAVE_AT}/hopq_*")
    )
    return out


# -- Accelerate ----------------------------------------------------------------------
def accelerate_ckpt(
    rank: int, n: int, tmp: str, resume: bool, codec: str = "dynamiq"
) -> dict[str, Any]:
    """6 steps, ``save_state`` after 3; the resumed job ``load_state``s it. The
    script registers nothing for checkpointing itself: register_hook does."""
    from accelerate import Accelerator

    from hopq.integrations.accelerate import register_hook

    wi.as_torchrun(rank, n)
    out: dict[str, Any] = {}
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = wi.Backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    state = register_hook(acc, model, hopq.HookState(codec=codec, seed=5))
    out["registered"] = sum(getattr(o, "obj", None) is state for o in acc._custom_objects)
    if resume:
        acc.load_state(f"{tmp}/acc")
        out["at_start"] = state.codec.state_dict()
    for k in range(SAVE_AT if resume else 0, STEPS):
        if not resume and k == SAVE_AT:
            acc.save_state(f"{tmp}/acc")
            out["at_save"] = state.codec.state_dict()
        wi._train(model, opt, rank, k)
    out["end"] = state.codec.state_dict()
    out["params"] = flat(model)
    return out


# -- Lightning Fabric ----------------------------------------------------------------
def fabric_ckpt(
    rank: int,
    n: int,
    tmp: str,
    resume: bool,
    codec: str = "dynamiq",
    steps: int = 4,
    as_dict: bool = False,
) -> dict[str, Any]:
    """Fabric with ``HopqDDPStrategy`` (``codec``), the state in what ``fabric.save``
    and ``fabric.load`` get, as docs/integrations/frameworks.md says. The first
    job (``resume=False``) trains ``steps`` steps uninterrupted (``"straight"``),
    then, with a new Fabric, model and HookState, ``steps // 2`` steps and
    ``fabric.save`` (``"saving"``). The second job, in fresh processes, builds a
    new Fabric, model and HookState, ``fabric.load``s the checkpoint and trains
    the other half: with ``"hopq"`` in the loaded dict (``"resumed"``) and
    without it (``"no_hopq"``). ``as_dict``: the first job saves the hook
    state's ``state_dict()`` instead of the object."""
    from lightning.fabric import Fabric

    from hopq.integrations.fabric import HopqDDPStrategy

    wi.as_torchrun(rank, n)
    half, path = steps // 2, f"{tmp}/fabric.ckpt"

    def run(first: int, last: int, save: bool = False, load: str | None = None) -> dict:
        res: dict[str, Any] = {}
        state = hopq.HookState(codec=codec, seed=5)
        fabric = Fabric(accelerator="cpu", devices=n, strategy=HopqDDPStrategy(state))
        fabric.launch()
        torch.manual_seed(0)
        model = wi.Backward()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = fabric.setup(model, opt)
        objects: dict[str, Any] = {"model": model, "optimizer": opt}
        if load is not None:
            if load == "with":
                objects["hopq"] = state
            res["remainder"] = sorted(fabric.load(path, objects))
            res["at_start"] = state.codec.state_dict()
        for k in range(first, last):
            g = torch.Generator().manual_seed(100 * rank + k)
            x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
            opt.zero_grad()
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
        if save:
            hopq_entry = state.state_dict() if as_dict else state
            fabric.save(path, {"model": model, "optimizer": opt, "hopq": hopq_entry})
            res["own_local"] = state.state_dict().get("codec_local")
        res["end"] = state.codec.state_dict()
        res["params"] = flat(model)
        return res

    if resume:
        return {"resumed": run(half, steps, load="with"), "no_hopq": run(half, steps, load="no")}
    return {"straight": run(0, steps), "saving": run(0, half, save=True)}


# -- FSDP through torch.distributed.checkpoint ---------------------------------------
def fsdp_dcp(rank: int, n: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from tests import workers_fsdp as wf

    model = wf.build(n)
    comm = hopq.FSDPReduceScatter("dynamiq", seed=3)
    comm.install(model)
    wf.train(model, rank, 3, comm)
    saved = comm.codec.state_dict()
    dcp.save({"hopq": comm}, checkpoint_id=path)
    fresh = hopq.FSDPReduceScatter("dynamiq")
    dcp.load({"hopq": fresh}, checkpoint_id=path)
    return {"saved": saved, "loaded": fresh.codec.state_dict(), "seed": fresh.seed}


# -- one HookState per model ---------------------------------------------------------
def one_state_per_model(rank: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    d, g = DDP(wi.Tiny()), DDP(wi.Tiny())
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    shared = hopq.HookState(codec="dynamiq")
    d.register_comm_hook(shared, hopq.ddp_hook)
    g.register_comm_hook(shared, hopq.ddp_hook)
    for k in range(2):  # the critic alone: fine
        wi._train(d, opt_d, rank, k)
    try:
        wi._train(g, opt_g, rank, 0)
        out["shared"] = None
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["shared"] = f"{type(e).__name__}: {e}"
    # one state per model: a GAN-style alternation trains, each state its own round
    torch.manual_seed(0)
    d, g = DDP(wi.Tiny()), DDP(wi.Tiny())
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    sd, sg = hopq.HookState(codec="dynamiq"), hopq.HookState(codec="dynamiq")
    d.register_comm_hook(sd, hopq.ddp_hook)
    g.register_comm_hook(sg, hopq.ddp_hook)
    for k in range(3):
        wi._train(d, opt_d, rank, k)
        wi._train(d, opt_d, rank, k + 10)
        wi._train(g, opt_g, rank, k)
    out["rounds"] = (sd.codec.state_dict()["round"], sg.codec.state_dict()["round"])
    # a state whose model is gone may serve a new one (a second run in one process)
    del d, opt_d
    gc.collect()
    torch.manual_seed(1)
    again = DDP(wi.Tiny())
    opt_a = torch.optim.SGD(again.parameters(), lr=0.1)
    again.register_comm_hook(sd, hopq.ddp_hook)
    wi._train(again, opt_a, rank, 0)
    out["reused_after_free"] = sd.codec.state_dict()["round"]
    return out
