"""Hugging Face Accelerate: register the hopq hook on the model ``prepare`` wrapped.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own
enum of torch's built-in hooks; any other value (``hopq.ddp_hook``) is looked
up, not found, and silently dropped. Register on the prepared model instead::

    from hopq.integrations.accelerate import register_hook
    accelerator = Accelerator(cpu=True)          # or on GPUs
    model, opt, data = accelerator.prepare(model, opt, data)
    state = register_hook(accelerator, model, hopq.HookState(codec="dynamiq"))
    ...
    accelerator.log(state.step_metrics(), step=step)

``register_hook`` also registers the state for checkpointing
(``accelerator.register_for_checkpointing``), so ``accelerator.save_state`` saves
the codec's round counter and adaptive state and ``accelerator.load_state``
restores them (call ``register_hook`` before ``load_state``, in the same order
relative to your own registered objects).

Several CPU processes, with ``Accelerator(cpu=True)`` in the script:
``accelerate launch --multi_gpu --num_processes 2 --num_machines 1 script.py``
(despite its name, ``--multi_gpu`` picks Accelerate's torchrun launcher, which
starts the processes; they run on Gloo as ``MULTI_CPU``), or ``torchrun
--nproc_per_node 2 script.py``. ``accelerate launch --cpu --num_processes 2``
starts one process (several CPU processes through it need ``mpirun`` and
``--mpirun_hostfile``), and Accelerate has no ``--multi_cpu`` flag.

FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``): the model
``prepare`` returns carries FSDP2's reduce-scatter, which :func:`register_fsdp`
replaces with hopq's (:class:`hopq.FSDPReduceScatter`)::

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(fsdp_plugin=plugin)
    model, opt = accelerator.prepare(model, opt)
    comm = register_fsdp(accelerator, model, hopq.FSDPReduceScatter("dynamiq"))

Accelerate applies FSDP on accelerators only: its ``AcceleratorState`` turns
``fsdp_plugin`` into ``DistributedType.FSDP`` for ``MULTI_GPU`` (and NPU, XPU,
HPU, ...) runs, while a CPU run (``MULTI_CPU``) drops the plugin and
``prepare`` wraps the model in DDP; ``register_fsdp`` then raises, naming
``register_hook``. FSDP1 (``fsdp_version=1``) takes no custom reduce-scatter
and is refused, naming ``fsdp_version=2``.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from hopq.integrations.ddp import HookState, adopt_optimizer, check_same_group, ddp_hook
from hopq.integrations.fsdp import FSDPReduceScatter
from hopq.integrations.records import Gathered

try:
    from accelerate.utils import DDPCommunicationHookType
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hopq.integrations.accelerate needs Accelerate: pip install accelerate "
        "(or pip install 'hopq[integrations]')"
    ) from e


def check_kwargs(accelerator: Any) -> None:
    """Raise if the accelerator's ``DistributedDataParallelKwargs`` names a hook
    Accelerate will ignore (anything but its ``DDPCommunicationHookType``), or
    one of its built-in hooks, which would then hold DDP's only hook slot."""
    handler = getattr(accelerator, "ddp_handler", None)
    hook = getattr(handler, "comm_hook", DDPCommunicationHookType.NO)
    if hook == DDPCommunicationHookType.NO:
        return
    if not isinstance(hook, DDPCommunicationHookType):
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_hook={getattr(hook, '__qualname__', hook)}) is "
            "silently ignored by Accelerate (it takes only DDPCommunicationHookType values): "
            "leave comm_hook out and call hopq.integrations.accelerate.register_hook(accelerator, "
            "model, state) after accelerator.prepare"
        )
    raise ValueError(
        f"DistributedDataParallelKwargs(comm_hook={hook}) registers torch's own hook, and DDP "
        "takes one hook per model: leave comm_hook out to use hopq's"
    )


def register_hook(accelerator: Any, model: Any, state: HookState | str = "dynamiq") -> HookState:
    """Register hopq's hook on ``model`` as ``accelerator.prepare`` returned it
    (DDP-wrapped when there are several processes) and return the state.

    Raises when the model is not DDP (FSDP, DeepSpeed: those do not use DDP
    hooks) in a multi-process run, or when the accelerator's kwargs carry a
    hook (see :func:`check_kwargs`). In a single process there is nothing to
    average and no hook is registered. The state is registered for
    checkpointing (``accelerator.register_for_checkpointing``, once), so
    ``save_state`` / ``load_state`` carry it. An FSDP2 model is refused,
    naming :func:`register_fsdp`.
    """
    if isinstance(state, str):
        state = HookState(codec=state)
    if not isinstance(state, HookState):
        raise TypeError(f"expected a hopq.HookState or a codec name, got {state!r}")
    check_kwargs(accelerator)
    kind = _fsdp_kind(model)
    if kind == 2:
        raise TypeError(
            "register_hook: this model is FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2)), "
            "which takes no DDP hook: call hopq.integrations.accelerate.register_fsdp(accelerator, "
            "model, hopq.FSDPReduceScatter(...)) instead"
        )
    if kind == 1:
        raise TypeError(FSDP1_MESSAGE)
    if isinstance(model, DistributedDataParallel):
        check_same_group(model, state)
        model.register_comm_hook(state, ddp_hook)
        # the optimizer prepare() wrapped, for the codecs that read it
        adopt_optimizer(state, getattr(accelerator, "_optimizers", []), "register_hook")
        _checkpointed(accelerator, state, state.process_group)
        return state
    if accelerator.num_processes > 1:
        raise TypeError(
            f"register_hook needs the DDP model accelerator.prepare returns; got "
            f"{type(model).__name__} (distributed type {accelerator.distributed_type}). "
            "Pass the prepared model; FSDP and DeepSpeed do not use DDP hooks"
        )
    _checkpointed(accelerator, state, state.process_group)
    return state


def _checkpointed(accelerator: Any, obj: Any, group: Any = None) -> None:
    """``save_state`` / ``load_state`` carry ``obj`` (a HookState or an
    FSDPReduceScatter, registered once). Accelerate calls ``state_dict`` on every
    rank and writes rank 0's: the registered view gathers every rank's rank-local
    counters (MX's, THC's), and each rank loads its own."""
    registered = getattr(accelerator, "_custom_objects", [])
    if not any(o is obj or getattr(o, "obj", None) is obj for o in registered):
        accelerator.register_for_checkpointing(Gathered(obj, group))


#: Why FSDP1 cannot carry hopq, and what does.
FSDP1_MESSAGE = (
    "Accelerate's FSDP1 (FullyShardedDataParallelPlugin(fsdp_version=1), the "
    "FullyShardedDataParallel wrapper) takes no custom reduce-scatter, so hopq cannot "
    "compress its gradients: use FullyShardedDataParallelPlugin(fsdp_version=2) and "
    "hopq.integrations.accelerate.register_fsdp(accelerator, model, comm)"
)


def _fsdp_kind(model: Any) -> int:
    """2 when ``model`` holds FSDP2 modules, 1 for FSDP1's wrapper, 0 otherwise."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    mods = list(model.modules()) if hasattr(model, "modules") else []
    if any(isinstance(m, FSDPModule) for m in mods):
        return 2
    if any(isinstance(m, FullyShardedDataParallel) for m in mods):
        return 1
    return 0


def register_fsdp(
    accelerator: Any, model: Any, comm: FSDPReduceScatter | str = "dynamiq"
) -> FSDPReduceScatter:
    """Make hopq's reduce-scatter FSDP2's in the model ``accelerator.prepare``
    returned under ``FullyShardedDataParallelPlugin(fsdp_version=2)``.

    The reduce-scatter is registered for checkpointing
    (``accelerator.register_for_checkpointing``, once), so ``save_state`` /
    ``load_state`` carry its codec state.

    Args:
        accelerator: The ``Accelerator`` that prepared ``model``.
        model: The prepared model (its FSDP2 modules get hopq's reduce-scatter).
        comm: A :class:`hopq.FSDPReduceScatter`, or a codec name for its defaults.

    Returns:
        The installed ``FSDPReduceScatter`` (log ``comm.step_metrics()`` once a step).

    Raises:
        TypeError: ``model`` is FSDP1 (``fsdp_version=1``), or ``comm`` is neither
            an ``FSDPReduceScatter`` nor a codec name.
        ValueError: ``model`` holds no FSDP2 module (on CPU Accelerate drops the
            plugin and prepares DDP: use :func:`register_hook` there).

    Example:
        ```python
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        model, opt = accelerator.prepare(model, opt)
        comm = register_fsdp(accelerator, model, hopq.FSDPReduceScatter("dynamiq"))
        ```
    """
    if isinstance(comm, str):
        comm = FSDPReduceScatter(comm)
    if not isinstance(comm, FSDPReduceScatter):
        raise TypeError(f"expected a hopq.FSDPReduceScatter or a codec name, got {comm!r}")
    kind = _fsdp_kind(model)
    if kind == 1:
        raise TypeError(FSDP1_MESSAGE)
    if kind == 0:
        raise ValueError(
            f"register_fsdp found no FSDP2 module in the prepared {type(model).__name__} "
            f"(distributed type {accelerator.distributed_type}). Accelerate applies "
            "FullyShardedDataParallelPlugin(fsdp_version=2) on GPUs (and NPUs, XPUs, ...) "
            "only; on CPU it drops the plugin and prepares DDP: use "
            "hopq.integrations.accelerate.register_hook there"
        )
    comm.install(model)
    _checkpointed(accelerator, comm)
    return comm
