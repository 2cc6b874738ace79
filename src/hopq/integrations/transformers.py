"""Hugging Face ``transformers.Trainer``: a callback that registers the hopq hook
when training begins and adds hopq's metrics to the Trainer's own log entries.

The Trainer has no option for a DDP communication hook and wraps the model in
DDP only inside ``train()``. :func:`attach` adds a :class:`HopqCallback` that
registers the hook on ``trainer.model_wrapped`` in ``on_train_begin`` and, in
``on_log``, merges the communication since the last log entry into the entry
being logged, so the Trainer's loss stays and every reporter (TensorBoard,
W&B, ...) gets ``hopq/bits_per_coordinate`` and the rest beside it::

    from hopq.integrations.transformers import attach
    trainer = Trainer(model=model, args=args, train_dataset=data)
    attach(trainer, hopq.HookState(codec="dynamiq"))
    trainer.train()

The Trainer's checkpoints carry hopq's state: at every save the callback writes
``hopq_state_rank<r>.pt`` (:meth:`hopq.HookState.state_dict`) into the
checkpoint's folder, and ``trainer.train(resume_from_checkpoint=...)`` restores
it, so the codec's round counter and adaptive state (DynamiQ's budget shares and
statistics) continue where they stopped.

FSDP2 (``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})``):
attach a :class:`hopq.FSDPReduceScatter` instead of a ``HookState``; the callback
installs it on the FSDP2 modules the Trainer's Accelerate made, at train begin::

    comm = attach(trainer, hopq.FSDPReduceScatter("dynamiq"))

FSDP1 (``fsdp_version`` 1) takes no custom reduce-scatter and is refused, naming
``fsdp_version: 2``. On CPU Accelerate applies no FSDP (it drops the plugin and
the Trainer wraps the model in DDP): attach a ``HookState`` there.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hopq.integrations.ddp import (
    HookState,
    StepMetrics,
    adopt_optimizer,
    check_same_group,
    ddp_hook,
)
from hopq.integrations.fsdp import FSDPReduceScatter

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hopq.integrations.transformers needs transformers: pip install transformers "
        "(or pip install 'hopq[integrations]')"
    ) from e


class HopqCallback(TrainerCallback):
    """Registers ``state``'s hook on ``trainer.model_wrapped`` at train begin and
    merges the metrics (per optimizer step, averaged over the steps since the
    last log entry; this rank's) into the Trainer's training log entries.

    Use :func:`attach`, which also puts the callback first, so that its
    ``on_log`` runs before the reporting callbacks read the entry, and lets
    ``train(resume_from_checkpoint=...)`` restore hopq's state from the
    checkpoint's folder (written by ``on_save``).
    """

    #: The file of each rank's state in a checkpoint's folder.
    file_pattern = "hopq_state_rank{rank}.pt"

    def __init__(
        self, state: HookState | FSDPReduceScatter, trainer: Any, prefix: str = "hopq/"
    ) -> None:
        if not isinstance(state, HookState | FSDPReduceScatter):
            raise TypeError(f"expected a hopq.HookState or a hopq.FSDPReduceScatter, got {state!r}")
        self.state = state
        self.prefix = prefix
        self._trainer = weakref.ref(trainer)
        self._hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._window: StepMetrics | None = None
        #: The checkpoint folder the Trainer resumes from (set by :func:`attach`'s
        #: wrapper of the Trainer's loading), read at ``on_train_begin``.
        self.resume_dir: str | None = None

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write this rank's hopq state into the checkpoint the Trainer just saved."""
        trainer = self._trainer()
        out = getattr(trainer, "_get_output_dir", None)
        root = out(trial=None) if callable(out) else args.output_dir
        folder = os.path.join(root, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, self.file_pattern.format(rank=self._rank()))
        torch.save(self.state.state_dict(), path)

    def _restore(self, args: Any, state: Any) -> None:
        folder, self.resume_dir = self.resume_dir, None
        if folder is None and state.global_step > 0:  # resumed, the folder not seen
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if folder is None:
            return
        for rank in (self._rank(), 0):  # this rank's counters, else rank 0's state
            path = os.path.join(folder, self.file_pattern.format(rank=rank))
            if os.path.isfile(path):
                self.state.load_state_dict(torch.load(path, weights_only=True))
                return
        warnings.warn(
            f"HopqCallback: resuming from {folder}, which holds no hopq state (saved "
            "without HopqCallback): the codec starts from its initial state, so the "
            "resumed run is not bit-identical to an uninterrupted one",
            UserWarning,
            stacklevel=2,
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError("HopqCallback: its Trainer is gone")
        model = trainer.model_wrapped
        kind = _fsdp_kind(model)
        if kind == 1:
            raise TypeError(FSDP1_MESSAGE)
        if isinstance(self.state, FSDPReduceScatter):
            if kind != 2:
                raise TypeError(
                    f"HopqCallback: a hopq.FSDPReduceScatter needs the Trainer's FSDP2 model, got "
                    f"{type(model).__name__}: set TrainingArguments(fsdp='full_shard', "
                    "fsdp_config={'fsdp_version': 2}) on GPUs (on CPU Accelerate applies no FSDP "
                    "and the Trainer uses DDP: attach a hopq.HookState there)"
                )
            if model not in self._hooked:  # a second train() reuses the wrapped model
                self.state.install(model)
                self._hooked.add(model)
        elif kind == 2:
            raise TypeError(
                "HopqCallback: the Trainer's model is FSDP2, which takes no DDP hook: attach a "
                "hopq.FSDPReduceScatter instead of a HookState (attach(trainer, "
                "hopq.FSDPReduceScatter('dynamiq')))"
            )
        elif isinstance(model, DistributedDataParallel):
            if model not in self._hooked:  # a second train() reuses the wrapped model
                check_same_group(model, self.state)
                model.register_comm_hook(self.state, ddp_hook)
                self._hooked.add(model)
            opt = kwargs.get("optimizer") or trainer.optimizer
            if opt is not None:  # for the codecs that read it
                adopt_optimizer(self.state, [opt], "HopqCallback")
        elif args.world_size > 1:
            raise TypeError(
                f"HopqCallback: the Trainer wrapped the model in {type(model).__name__}, not "
                "DDP (FSDP and DeepSpeed do not use DDP hooks)"
            )
        self._window = None
        self._restore(args, state)
        handler = trainer.callback_handler
        if handler.callbacks[0] is not self:  # a new list: call_event's loop is unaffected
            handler.callbacks = [self] + [c for c in handler.callbacks if c is not self]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = self.state.pop_step()
        self._window = step if self._window is None else self._window + step

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs is None or "loss" not in logs or self._window is None:
            return  # evaluation entries and the final summary keep their own keys
        metrics = self._window.as_dict(self.prefix)
        self._window = None
        logs.update(metrics)
        # Trainer.log stored a copy in log_history before calling the callbacks
        hist = state.log_history
        if hist and hist[-1].get("step") == state.global_step and "loss" in hist[-1]:
            hist[-1].update(metrics)


def attach(
    trainer: Any, state: HookState | FSDPReduceScatter | str = "dynamiq", prefix: str = "hopq/"
) -> Any:
    """Add a :class:`HopqCallback` to ``trainer`` (first among its callbacks) and
    return the state; call before ``trainer.train()``. The Trainer's checkpoints
    then carry hopq's state, and ``train(resume_from_checkpoint=...)`` restores it.
    A :class:`hopq.FSDPReduceScatter` (for a Trainer under FSDP2) is installed
    on the model's FSDP2 modules at train begin and returned."""
    if isinstance(state, str):
        state = HookState(codec=state)
    cb = HopqCallback(state, trainer, prefix)
    trainer.callback_handler.callbacks.insert(0, cb)
    # the Trainer loads the optimizer from the folder it resumes from before
    # on_train_begin: note the folder there (any path, not only output_dir's)
    load = getattr(trainer, "_load_optimizer_and_scheduler", None)
    if callable(load):

        def load_and_note(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
            if checkpoint is not None:
                cb.resume_dir = str(checkpoint)
            return load(checkpoint, *args, **kwargs)

        trainer._load_optimizer_and_scheduler = load_and_note
    return state


#: Why FSDP1 cannot carry hopq, and what does.
FSDP1_MESSAGE = (
    "HopqCallback: the Trainer wrapped the model in FSDP1 (FullyShardedDataParallel), which "
    "takes no custom reduce-scatter, so hopq cannot compress its gradients: set "
    "TrainingArguments(fsdp='full_shard', fsdp_config={'fsdp_version': 2}) and "
    "attach(trainer, hopq.FSDPReduceScatter('dynamiq'))"
)


def _fsdp_kind(model: Any) -> int:
    """2 when ``model`` holds FSDP2 modules, 1 for FSDP1's wrapper, 0 otherwise."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    mods = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    if any(isinstance(m, FSDPModule) for m in mods):
        return 2
    if any(isinstance(m, FullyShardedDataParallel) for m in mods):
        return 1
    return 0
