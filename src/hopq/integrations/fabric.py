"""Lightning Fabric: a DDP strategy that registers the hopq hook.

Fabric's ``DDPStrategy`` passes every extra argument to DDP's constructor, so
``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` fails with
``TypeError: unexpected keyword argument 'ddp_comm_state'``; it has no hook
option. :class:`HopqDDPStrategy` registers the hook on the module
``fabric.setup`` wraps::

    from hopq.integrations.fabric import HopqDDPStrategy
    fabric = Fabric(accelerator="cpu", devices=2, strategy=HopqDDPStrategy(hopq.HookState(codec="dynamiq")))
    model, opt = fabric.setup(model, opt)
    ...
    fabric.log_dict(fabric.strategy.hook_state.step_metrics())

Checkpoints: put the state in what ``fabric.save`` and ``fabric.load`` get::

    fabric.save(path, {"model": model, "optimizer": opt, "hopq": strategy.hook_state})
    fabric.load(path, {"model": model, "optimizer": opt, "hopq": strategy.hook_state})

Fabric writes rank 0's dictionary; the strategy adds every rank's rank-local
counters (MX's saturation counts, THC's overflow tally) to the state it saves,
and each rank loads its own.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from hopq.integrations.ddp import HookState, adopt_optimizer, check_same_group, ddp_hook
from hopq.integrations.records import gather_packed, gathered_state, is_packed_state

try:
    from lightning.fabric.strategies import DDPStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hopq.integrations.fabric needs Lightning: pip install lightning "
        "(or pip install 'hopq[integrations]')"
    ) from e


class HopqDDPStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` with hopq's DDP hook on the module it wraps.

    ``state``: a :class:`hopq.HookState` (or a codec name, for its defaults).
    Other arguments are ``DDPStrategy``'s (DDP's own options among them). One
    state serves one model: a second ``fabric.setup`` while the first model is
    alive raises (the codec keys its adaptive state by bucket index, which two
    models would share); give each model its own strategy or call
    ``register_comm_hook`` yourself.
    """

    def __init__(self, state: HookState | str = "dynamiq", **kwargs: Any) -> None:
        taken = [k for k in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper") if k in kwargs]
        if taken:
            raise TypeError(
                f"HopqDDPStrategy registers hopq's hook itself; do not pass {', '.join(taken)}"
            )
        super().__init__(**kwargs)
        if isinstance(state, str):
            state = HookState(codec=state)
        if not isinstance(state, HookState):
            raise TypeError(f"expected a hopq.HookState or a codec name, got {state!r}")
        self.hook_state = state
        self._wrapped: weakref.ref[Module] | None = None

    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self._wrapped is not None and self._wrapped() is not None:
            raise RuntimeError(
                "HopqDDPStrategy: its HookState already serves another model; one state per model"
            )
        ddp = super().setup_module(module)
        check_same_group(ddp, self.hook_state)
        ddp.register_comm_hook(self.hook_state, ddp_hook)
        self._wrapped = weakref.ref(ddp)
        return ddp

    def setup_optimizer(self, optimizer: Any) -> Any:
        # fabric.setup(model, optimizer): the codecs that read the optimizer get it
        adopt_optimizer(self.hook_state, [optimizer], "HopqDDPStrategy")
        return super().setup_optimizer(optimizer)

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: Any = None,  # noqa: A002 - Fabric's name
    ) -> None:
        """Save as ``DDPStrategy`` does, with the hook state in ``state`` (``"hopq":
        strategy.hook_state``, or its ``state_dict()``) saved with every rank's
        rank-local counters gathered: Fabric calls this on every rank and writes
        rank 0's dictionary."""
        group = self.hook_state.process_group
        out: dict[str, Any] = {}
        for k, v in state.items():  # every rank passes the same keys: it gathers alike
            if v is self.hook_state:
                out[k] = gathered_state(v, group)
            elif is_packed_state(v):  # a state_dict() holds this rank's counters only
                out[k] = gather_packed(v, group)
            else:
                out[k] = v
        super().save_checkpoint(path, out, storage_options=storage_options, filter=filter)

    def __getstate__(self) -> dict[str, Any]:  # the spawn launcher pickles the strategy
        d = self.__dict__.copy()
        d["_wrapped"] = None
        return d
