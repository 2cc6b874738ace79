"""Rank bodies of tests/test_integrations_fsdp.py: hopq's FSDP2 reduce-scatter
reached through a framework, on spawned 2-rank Gloo CPU jobs (the ranks get the
environment torchrun gives, so the frameworks join hopq's group)."""

from __future__ import annotations

import os
from typing import Any

import torch

import hopq

WIDTHS = (32, 128, 32)


def as_torchrun(rank: int, n: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29547",
    )  # fmt: skip


def net() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTHS[0], WIDTHS[1]),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTHS[1], WIDTHS[2]),
    )


def shard(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def data(rows: int = 256) -> Any:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, WIDTHS[0], generator=g)
    y = torch.randn(rows, WIDTHS[-1], generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in module.state_dict().items()}


# -- Lightning --------------------------------------------------------------------
def lightning_fsdp_job(rank: int, n: int, steps: int, tmp: str) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from hopq.integrations.lightning import HopqDDPStrategy, HopqFSDP, HopqMetrics, install_fsdp

    as_torchrun(rank, n)

    class Module(L.LightningModule):
        def __init__(self, comm: Any = None) -> None:
            super().__init__()
            self.net = net()
            self.comm = comm
            self.losses: list[float] = []
            self.steps: list[dict[str, float]] = []

        def configure_model(self) -> None:
            mesh = self._device_mesh
            if mesh is None:  # not ModelParallelStrategy: a mesh of its own
                from torch.distributed.device_mesh import init_device_mesh

                shard(self.net, init_device_mesh("cpu", (n,)))
                return
            shard(self.net, mesh["data_parallel"])
            if self.comm is not None:
                self.comm = install_fsdp(self, self.comm)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def on_train_batch_end(self, *args: Any) -> None:
            if self.comm is not None:
                self.steps.append(self.comm.step_metrics())  # pops the step

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(module: Any, strategy: Any, **kw: Any) -> Any:
        t = L.Trainer(
            accelerator="cpu", devices=n, strategy=strategy, max_steps=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            **kw,
        )  # fmt: skip
        t.fit(module, data())
        return t

    def mp() -> Any:
        return ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1)

    out: dict[str, Any] = {}
    m = Module()
    fit(m, mp())
    out["native"] = {"losses": m.losses, "params": full(m.net)}
    # the callback: installs at fit start, logs the step metrics
    cb = HopqFSDP(hopq.FSDPReduceScatter("bf16"))
    m = Module()
    t = fit(m, mp(), callbacks=[cb])
    logged = {k: float(v) for k, v in t.logged_metrics.items()}
    out["callback"] = {"losses": m.losses, "params": full(m.net), "metrics": logged}
    # the helper in configure_model, DynamiQ
    m = Module(hopq.FSDPReduceScatter("dynamiq"))
    fit(m, mp())
    out["helper"] = {
        "losses": m.losses, "params": full(m.net), "steps": m.steps,
    }  # fmt: skip
    # Lightning's checkpoint carries the callback's comm state: 2 steps, saved,
    # resumed for 2 more, equals 4 (an epoch is one batch: Lightning's resume of a
    # plain DataLoader does not continue an epoch's order)
    half = steps // 2
    rows = n * 16  # one batch of 16 rows on each rank

    def resumable(comm_steps: int, ckpt: str | None = None, save: str | None = None) -> Any:
        m = Module()
        t = L.Trainer(
            accelerator="cpu", devices=n, strategy=mp(), max_steps=comm_steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[HopqFSDP(hopq.FSDPReduceScatter("dynamiq"), log=False)],
        )  # fmt: skip
        t.fit(m, data(rows), ckpt_path=ckpt)
        if save is not None:
            t.save_checkpoint(save)
        return full(m.net)

    out["uninterrupted"] = resumable(2 * half)
    resumable(half, save=f"{tmp}/half.ckpt")
    out["resumed"] = resumable(2 * half, ckpt=f"{tmp}/half.ckpt")
    # hopq's DDP strategy, or its DDP metrics callback, with a fully_shard model:
    # refused naming the FSDP2 way (DDP alone fails on the sharded parameters)
    for name, strategy, cbs in (
        ("ddp_strategy", HopqDDPStrategy("bf16"), []),
        ("ddp_metrics", mp(), [HopqMetrics()]),
    ):
        try:
            fit(Module(), strategy, callbacks=cbs)
            out[name] = None
        except TypeError as e:
            out[name] = str(e)
    return out


def _train(model: Any, opt: Any, rank: int, steps: int, backward: Any, comm: Any) -> dict:
    losses, metrics = _train_from(model, opt, rank, 0, steps, backward, comm)
    return {"losses": losses, "steps": metrics, "params": full(model)}


# -- Accelerate -------------------------------------------------------------------
def accelerate_fsdp_job(rank: int, n: int, steps: int) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from hopq.integrations.accelerate import register_fsdp, register_hook

    as_torchrun(rank, n)
    out: dict[str, Any] = {}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    # on CPU Accelerate drops the plugin and prepares DDP: register_fsdp says so
    out["cpu_type"] = str(acc.distributed_type)
    ddp = acc.prepare(net())
    try:
        register_fsdp(acc, ddp, "bf16")
        out["cpu_refused"] = None
    except ValueError as e:
        out["cpu_refused"] = str(e)
    # Accelerate's own FSDP2 preparation (fsdp2_prepare_model), which runs on CPU
    # once the state says FSDP, as it does on GPUs (set before each prepare: the
    # state goes back to MULTI_CPU meanwhile)
    for name, codec in (("native", None), ("hopq", "dynamiq")):
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
        model = net()
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        comm = None if codec is None else register_fsdp(acc, model, hopq.FSDPReduceScatter(codec))
        fsdp2 = type(model).__name__.startswith("FSDP")
        out[name] = _train(model, opt, rank, steps, acc.backward, comm)
        out[name]["fsdp2"] = fsdp2
    try:
        register_hook(acc, model, "bf16")
        out["hook_refused"] = None
    except TypeError as e:
        out["hook_refused"] = str(e)
    return out


def accelerate_fsdp_ckpt_job(
    rank: int, n: int, steps: int, tmp: str, resume: bool
) -> dict[str, Any]:
    """Accelerate's FSDP2 path (its state set to FSDP by hand, as in
    :func:`accelerate_fsdp_job`) through ``save_state``/``load_state``. The first
    job (``resume=False``) trains ``steps`` steps uninterrupted (``"straight"``),
    then, with a new Accelerator, model and FSDPReduceScatter, ``steps // 2``
    steps and ``save_state`` (``"saving"``). The second job, in fresh processes,
    builds a new Accelerator, model and FSDPReduceScatter, ``register_fsdp``,
    ``load_state`` and trains the other half (``"resumed"``); then once more
    with the reduce-scatter installed but not registered, loading a copy of the
    checkpoint without hopq's ``custom_checkpoint_0.pkl`` (``"no_hopq"``), after
    trying the checkpoint itself (``"mismatch"``: Accelerate's message)."""
    import shutil

    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from hopq.integrations.accelerate import register_fsdp

    as_torchrun(rank, n)
    half, ckpt = steps // 2, f"{tmp}/acc"

    def run(first: int, last: int, save: bool = False, load: str | None = None) -> dict:
        res: dict[str, Any] = {}
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        acc = Accelerator(cpu=True, fsdp_plugin=plugin)

        def as_fsdp() -> None:  # what the state says on GPUs (on CPU it goes back)
            acc.state.distributed_type = DistributedType.FSDP
            acc.state.fsdp_plugin = plugin

        as_fsdp()
        model = net()
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        comm = hopq.FSDPReduceScatter("dynamiq", seed=5)
        if load == "without":
            comm.install(model)  # not registered: save_state/load_state leave it out
            as_fsdp()
            try:
                acc.load_state(ckpt)
                res["mismatch"] = None
            except RuntimeError as e:
                res["mismatch"] = str(e)
            if rank == 0:
                shutil.copytree(ckpt, f"{tmp}/acc_model_only")
                os.remove(f"{tmp}/acc_model_only/custom_checkpoint_0.pkl")
            acc.wait_for_everyone()
            as_fsdp()
            acc.load_state(f"{tmp}/acc_model_only")
        else:
            register_fsdp(acc, model, comm)
            if load == "with":
                as_fsdp()
                acc.load_state(ckpt)
        res["at_start"] = comm.codec.state_dict()
        res["train"], _ = _train_from(model, opt, rank, first, last, acc.backward)
        if save:
            as_fsdp()
            acc.save_state(ckpt)
            res["files"] = sorted(os.listdir(ckpt))
        res["end"] = comm.codec.state_dict()
        res["params"] = full(model)
        return res

    if resume:
        return {
            "resumed": run(half, steps, load="with"),
            "no_hopq": run(half, steps, load="without"),
        }
    return {"straight": run(0, steps), "saving": run(0, half, save=True)}


def _train_from(
    model: Any, opt: Any, rank: int, first: int, last: int, backward: Any, comm: Any = None
) -> tuple[list[float], list[dict[str, float]]]:
    """Steps ``first`` to ``last - 1``, each on its own batch (seeded by rank and
    step, so that a resumed run sees the batches an uninterrupted one does): the
    losses, and with ``comm`` its step metrics after each step."""
    losses, metrics = [], []
    for k in range(first, last):
        g = torch.Generator().manual_seed(100 * rank + k)
        x, y = torch.randn(8, WIDTHS[0], generator=g), torch.randn(8, WIDTHS[-1], generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if comm is not None:
            metrics.append(comm.step_metrics())
    return losses, metrics


# -- HF Trainer -----------------------------------------------------------------
class Regressor(torch.nn.Module):
    """The network as a Trainer model: a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


def hf_fsdp_job(rank: int, n: int, steps: int, tmp: str) -> dict[str, Any]:
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainingArguments

    from hopq.integrations.transformers import attach

    as_torchrun(rank, n)
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(256, WIDTHS[0], generator=g)
    ys = torch.randn(256, WIDTHS[-1], generator=g)
    data = [{"x": x, "labels": y} for x, y in zip(xs, ys, strict=True)]

    def trainer(name: str) -> Any:
        targs = TrainingArguments(
            output_dir=f"{tmp}/{name}", max_steps=steps, per_device_train_batch_size=8,
            learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
            report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
            fsdp=True, fsdp_config={"fsdp_version": 2},
        )  # fmt: skip
        return Trainer(model=Regressor(), args=targs, train_dataset=data)

    out: dict[str, Any] = {}
    # on CPU Accelerate applies no FSDP: the Trainer uses DDP, and an
    # FSDPReduceScatter attached there is refused naming the way that works
    t = trainer("cpu")
    out["cpu_type"] = str(t.accelerator.distributed_type)
    attach(t, hopq.FSDPReduceScatter("bf16"))
    try:
        t.train()
        out["cpu_refused"] = None
    except TypeError as e:
        out["cpu_refused"] = str(e)
    # the Trainer's FSDP2 path (Accelerate's fsdp2_prepare_model), which runs on CPU
    # once Accelerate's state says FSDP, as it does on GPUs
    for name, codec in (("native", None), ("hopq", "dynamiq")):
        t = trainer(name)
        t.accelerator.state.distributed_type = DistributedType.FSDP
        t.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        t.is_fsdp_enabled = True
        if codec is not None:
            attach(t, hopq.FSDPReduceScatter(codec))
        t.train()
        logs = [e for e in t.state.log_history if "loss" in e]
        out[name] = {
            "losses": [e["loss"] for e in logs], "logs": logs, "params": full(t.model_wrapped),
            "fsdp2": type(t.model_wrapped).__name__,
        }  # fmt: skip
    return out


def hf_fsdp_ckpt_job(rank: int, n: int, steps: int, tmp: str, resume: bool) -> dict[str, Any]:
    """The Trainer's FSDP2 path with DynamiQ attached, through the Trainer's own
    checkpoint. The first job (``resume=False``) trains ``steps`` steps
    uninterrupted (``"straight"``), then ``steps`` steps saving a checkpoint every
    ``steps // 2`` (``"saving"``); the second job, in fresh processes, builds a new
    Trainer with a fresh FSDPReduceScatter and ``train(resume_from_checkpoint=
    checkpoint-<steps // 2>)`` (``"resumed"``)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hopq.integrations.transformers import attach

    as_torchrun(rank, n)
    half = steps // 2
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(256, WIDTHS[0], generator=g)
    ys = torch.randn(256, WIDTHS[-1], generator=g)
    data = [{"x": x, "labels": y} for x, y in zip(xs, ys, strict=True)]

    def run(name: str, save: bool, resume_from: str | None = None) -> dict[str, Any]:
        res: dict[str, Any] = {}
        targs = TrainingArguments(
            output_dir=f"{tmp}/{name}", max_steps=steps, per_device_train_batch_size=8,
            learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
            report_to="none", use_cpu=True, disable_tqdm=True, fsdp=True,
            fsdp_config={"fsdp_version": 2}, save_strategy="steps" if save else "no",
            save_steps=half,
        )  # fmt: skip
        t = Trainer(model=Regressor(), args=targs, train_dataset=data)
        t.accelerator.state.distributed_type = DistributedType.FSDP
        t.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        t.is_fsdp_enabled = True
        comm = attach(t, hopq.FSDPReduceScatter("dynamiq"))

        class Probe(TrainerCallback):  # after HopqCallback, which attach puts first
            def on_train_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
                res["at_start"] = comm.codec.state_dict()

            def on_step_end(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
                if st.global_step == half:
                    res["at_save"] = comm.codec.state_dict()

        t.add_callback(Probe())
        t.train(resume_from_checkpoint=resume_from)
        res["end"] = comm.codec.state_dict()
        res["params"] = full(t.model_wrapped)
        res["losses"] = [e["loss"] for e in t.state.log_history if "loss" in e]
        return res

    if resume:
        return {"resumed": run("resumed", False, f"{tmp}/saving/checkpoint-{half}")}
    out = {"straight": run("straight", False), "saving": run("saving", True)}
    out["files"] = sorted(os.listdir(f"{tmp}/saving/checkpoint-{half}"))
    return out


# -- torchtitan -------------------------------------------------------------------
def torchtitan_job(rank: int, n: int) -> dict[str, Any]:
    """The recipe's parts as far as CPU allows: torchtitan's llama3 debug model (two
    layers) sharded by torchtitan's own apply_fsdp_to_decoder on a CPU mesh, hopq's
    reduce-scatter installed on it, and a forward pass (FlexAttention has no
    backward on CPU, and torchtitan's varlen attention is CUDA only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.llama3 import llama3_configs

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:2]
    with torch.device("meta"):
        model = cfg.build()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("fsdp",))
    f32 = torch.float32
    apply_fsdp_to_decoder(model, mesh, param_dtype=f32, reduce_dtype=f32, pp_enabled=False)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    comm = hopq.FSDPReduceScatter("dynamiq")
    installed = comm.install(model)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 2048, (2, 32), generator=g)
    positions = torch.arange(32).expand(2, 32)
    masks = model.get_attention_masks(positions=positions)
    with torch.no_grad():
        logits = model(tokens, positions=positions, attention_masks=masks)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    fsdp = sum(isinstance(m, FSDPModule) for m in model.modules())
    return {"installed": installed, "fsdp_modules": fsdp, "loss": loss.item()}


class CausalSDPA(torch.nn.Module):
    """A stand-in for torchtitan's inner attention on CPU: causal
    scaled_dot_product_attention on its (batch, length, heads, head dim) layout
    (FlexAttention has no backward on CPU, and varlen attention is CUDA only)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_masks: Any = None,
        scale: float | None = None, enable_gqa: bool = False, **_: Any,
    ) -> torch.Tensor:  # fmt: skip
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=enable_gqa,
        )  # fmt: skip
        return out.transpose(1, 2)


class TitanTrainState:
    """What the recipe's ``HopqTrainer`` checkpoints: torchtitan's train state
    (``Trainer.state_dict``: the step) with hopq's packed state beside it, a DCP
    Stateful as torchtitan's CheckpointManager saves it under ``train_state``."""

    def __init__(self, comm: Any) -> None:
        self.step, self.comm = 0, comm

    def state_dict(self) -> dict[str, Any]:
        if self.comm is None:  # as torchtitan's own Trainer.state_dict
            return {"step": self.step}
        return {"step": self.step, "hopq": self.comm.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        if self.comm is not None:
            self.comm.load_state_dict(state["hopq"])


def torchtitan_train_job(
    rank: int, n: int, steps: int, save_at: int, tmp: str, resume: bool
) -> dict[str, Any]:
    """torchtitan's llama3 debug model (two layers, CausalSDPA for its attention),
    sharded by its own apply_fsdp_to_decoder, trained with AdamW: natively, with
    hopq's DynamiQ reduce-scatter uninterrupted, and with it saved at ``save_at``
    through torch.distributed.checkpoint as torchtitan saves (model, optimizer and
    the train state carrying hopq's); or, with ``resume``, resumed from that
    checkpoint in fresh processes and trained to ``steps``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.llama3 import llama3_configs

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("fsdp",))
    ckpt = f"{tmp}/step-{save_at}"

    def build() -> Any:
        cfg = llama3_configs["debugmodel"](attn_backend="flex")
        cfg.layers = cfg.layers[:2]
        with torch.device("meta"):
            model = cfg.build()
        for layer in model.layers.values():
            layer.attention.inner_attention = CausalSDPA()
        f32 = torch.float32
        apply_fsdp_to_decoder(model, mesh, param_dtype=f32, reduce_dtype=f32, pp_enabled=False)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights(buffer_device=torch.device("cpu"))
        return model

    def run(
        codec: str | None, first: int, last: int, save: bool, resume: bool, carry_hopq: bool = True
    ) -> dict[str, Any]:
        model = build()
        kw = {"lr": 1e-3, "weight_decay": 0.1}
        adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kw)
        cfg = OptimizersContainer.Config(param_groups=[adamw], implementation="for-loop")
        opt = OptimizersContainer(cfg, model_parts=[model])
        comm = hopq.FSDPReduceScatter(codec) if codec else None
        installed = comm.install(model) if comm else 0
        if comm is None:  # torchtitan's divide factor makes FSDP ask for PREMUL_SUM,
            # which Gloo lacks: natively, sums with FSDP's own division
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        train_state = TitanTrainState(comm if carry_hopq else None)
        # what torchtitan's CheckpointManager hands to DCP
        states = {"model": ModelWrapper(model), "optimizer": opt, "train_state": train_state}
        if resume:
            dcp.load(states, checkpoint_id=ckpt)
        losses, bits = [], []
        for step in range(first, last):
            g = torch.Generator().manual_seed(100 * rank + step)
            tokens = torch.randint(0, 2048, (2, 33), generator=g)
            inp, target = tokens[:, :-1], tokens[:, 1:]
            positions = torch.arange(32).expand(2, 32)
            logits = model(inp, positions=positions, attention_masks=None)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if comm is not None:
                bits.append(comm.step_metrics()["hopq/bits_per_coordinate"])
            train_state.step = step + 1
            if save and step + 1 == save_at:
                dcp.save(states, checkpoint_id=ckpt)
        return {
            "losses": losses, "bits": bits, "installed": installed, "params": full(model),
            "codec": comm.codec.state_dict() if comm else None, "step": train_state.step,
        }  # fmt: skip

    if resume:  # fresh processes: from the checkpoint the first job saved
        return {
            "resumed": run("dynamiq", save_at, steps, save=False, resume=True),
            # torchtitan's own train state alone: hopq's codec starts afresh
            "without_hopq_state": run(
                "dynamiq", save_at, steps, save=False, resume=True, carry_hopq=False
            ),
        }
    return {
        "native": run(None, 0, steps, save=False, resume=False),
        "uninterrupted": run("dynamiq", 0, steps, save=True, resume=False),
    }
