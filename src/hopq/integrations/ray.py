"""Ray Train: register the hopq hook on the model ``ray.train.torch.prepare_model`` wraps.

Ray Train's ``TorchTrainer`` starts one process per worker and sets up the
process group (Gloo on CPU, NCCL on GPU); ``ray.train.torch.prepare_model``
then wraps the model in ``DistributedDataParallel``, with no option for a
communication hook. :func:`prepare_model` does the same and registers hopq's
hook on the result. Inside the training function::

    from hopq.integrations.ray import prepare_model

    state = hopq.HookState(codec="dynamiq")
    model = prepare_model(model, state)
    ...
    ray.train.report({"loss": loss.item(), **state.step_metrics()})

:func:`save_state` and :func:`load_state` put the state into a Ray checkpoint's
directory and take it back, so a resumed run continues the codec's random
streams and adaptive state. Ray is imported on first use: ``import hopq`` and
this module work without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from hopq.integrations.ddp import HookState, check_same_group, ddp_hook

__all__ = ["STATE_FILE", "load_state", "prepare_model", "save_state"]

#: The file :func:`save_state` writes in a checkpoint directory, one per rank of
#: the hook's group (Ray merges the directories the workers report into one
#: checkpoint).
STATE_FILE = "hopq-rank{rank}.pt"


def _ray_train_torch() -> Any:
    try:
        import ray.train.torch as ray_train_torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "hopq.integrations.ray needs Ray Train: pip install 'ray[train]' "
            "(or pip install 'hopq[integrations]')"
        ) from e
    return ray_train_torch


def _state(state: HookState | str) -> HookState:
    if isinstance(state, str):
        return HookState(codec=state)
    if not isinstance(state, HookState):
        raise TypeError(f"expected a hopq.HookState or a codec name, got {state!r}")
    return state


def prepare_model(
    model: torch.nn.Module, state: HookState | str = "dynamiq", **ray_kwargs: Any
) -> DistributedDataParallel:
    """Wrap ``model`` with ``ray.train.torch.prepare_model`` and register hopq's hook on it.

    Call it inside the training function ``TorchTrainer`` runs on every worker,
    where Ray has set up the process group. The hook averages over the default
    group, which is the one Ray's DDP uses. Codecs that read the optimizer
    (DynamiQ's step-size weights, GComp) take it as ``HookState(optimizer=opt)``:
    an optimizer built on ``model.parameters()`` before this call steps the same
    parameters as one built after it.

    Args:
        model: The plain ``torch.nn.Module``.
        state: A :class:`hopq.HookState` (keep a reference: it carries the
            metrics and the checkpoint state), or a codec name for its defaults.
        **ray_kwargs: ``ray.train.torch.prepare_model``'s other arguments
            (``move_to_device``, ``parallel_strategy_kwargs`` for DDP such as
            ``bucket_cap_mb`` or ``find_unused_parameters``).
            ``parallel_strategy`` may only be ``"ddp"``.

    Returns:
        The ``DistributedDataParallel`` model with hopq's hook registered.

    Raises:
        ValueError: ``parallel_strategy`` other than ``"ddp"`` (FSDP does not use
            DDP hooks), or a DDP model over another group than ``state``'s.
        TypeError: ``state`` is neither a HookState nor a codec name, or Ray did
            not wrap the model in DDP (a single worker: with nothing to average,
            train with ``ray.train.torch.prepare_model`` alone).
        ImportError: Ray Train is not installed.

    Example:
        ```python
        import hopq
        import ray.train
        from hopq.integrations.ray import prepare_model

        def train_func(config):
            state = hopq.HookState(codec="dynamiq")
            model = prepare_model(torch.nn.Linear(32, 1), state)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in batches:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                ray.train.report({**state.step_metrics()})

        TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2)).fit()
        ```
    """
    state = _state(state)
    strategy = ray_kwargs.get("parallel_strategy", "ddp")
    if strategy != "ddp":
        raise ValueError(
            f"parallel_strategy={strategy!r}: hopq's hook is a DDP communication hook; "
            "use parallel_strategy='ddp' (hopq's FSDP2 reduce-scatter is "
            "hopq.FSDPReduceScatter, see docs/integrations/fsdp.md)"
        )
    wrapped = _ray_train_torch().prepare_model(model, **ray_kwargs)
    if not isinstance(wrapped, DistributedDataParallel):
        import ray.train

        world = ray.train.get_context().get_world_size()
        raise TypeError(
            f"ray.train.torch.prepare_model returned {type(wrapped).__name__}, not "
            f"DistributedDataParallel (world size {world}): Ray wraps the model in DDP only "
            "with ScalingConfig(num_workers >= 2); with one worker there is nothing to "
            "average, so call ray.train.torch.prepare_model without hopq"
        )
    check_same_group(wrapped, state)
    wrapped.register_comm_hook(state, ddp_hook)
    return wrapped


def save_state(state: HookState, directory: str | os.PathLike[str]) -> Path:
    """Write ``state.state_dict()`` into a checkpoint directory, as this rank's file.

    Call it on every rank that reports the checkpoint, before
    ``ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))``.
    Ray merges the workers' directories, so the checkpoint holds one file per
    rank; the codec's shared state is the same in each, and codecs with
    rank-local counters (MX, THC) keep each rank's. Reporting from rank 0 alone
    is enough to restore the shared state on every rank.

    Args:
        state: The hook's state.
        directory: The directory that becomes the Ray checkpoint.

    Returns:
        The path of the file written (``STATE_FILE`` with this rank).

    Raises:
        TypeError: ``state`` is not a :class:`hopq.HookState`.

    Example:
        ```python
        with tempfile.TemporaryDirectory() as d:
            torch.save(model.module.state_dict(), os.path.join(d, "model.pt"))
            save_state(state, d)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        ```
    """
    if not isinstance(state, HookState):
        raise TypeError(f"expected a hopq.HookState, got {state!r}")
    path = Path(directory) / STATE_FILE.format(rank=state._rank())
    torch.save(state.state_dict(), path)
    return path


def load_state(state: HookState, directory: str | os.PathLike[str]) -> None:
    """Load what :func:`save_state` wrote into ``state``: this rank's file, or
    rank 0's when the checkpoint has none for this rank (rank 0 alone reported
    it, or the world grew). The shared codec state is the same in every file;
    from another rank's file, rank-local counters keep their current values.

    Args:
        state: A fresh :class:`hopq.HookState` with the same codec.
        directory: The checkpoint's directory, e.g. from
            ``ray.train.get_checkpoint().as_directory()``.

    Raises:
        TypeError: ``state`` is not a :class:`hopq.HookState`.
        FileNotFoundError: The directory holds no hopq state.
        ValueError: The checkpoint holds another codec than ``state`` runs.

    Example:
        ```python
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                load_state(state, d)
        ```
    """
    if not isinstance(state, HookState):
        raise TypeError(f"expected a hopq.HookState, got {state!r}")
    root, mine = Path(directory), state._rank()
    for rank in dict.fromkeys((mine, 0)):
        path = root / STATE_FILE.format(rank=rank)
        if path.is_file():
            state.load_state_dict(torch.load(path, weights_only=True))
            return
    raise FileNotFoundError(
        f"no hopq state in {root} ({STATE_FILE.format(rank=mine)} or "
        f"{STATE_FILE.format(rank=0)}): save it with hopq.integrations.ray.save_state"
    )
