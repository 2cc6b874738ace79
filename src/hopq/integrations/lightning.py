"""Lightning (``lightning.pytorch``): a DDP strategy that registers the hopq hook.

Lightning's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers
communication hooks only when the root device is CUDA; on CPU it trains with
DDP's uncompressed all-reduce and says nothing. :class:`HopqDDPStrategy`
registers the hook on every device type, right after Lightning wraps the model::

    from hopq.integrations.lightning import HopqDDPStrategy
    trainer = Trainer(strategy=HopqDDPStrategy(hopq.HookState(codec="dynamiq")), ...)

or ``Trainer(strategy="hopq_ddp")`` (registered with Lightning's
``StrategyRegistry`` when this module is imported; DynamiQ with its defaults).

Log the communication from the LightningModule with
``self.log_dict(trainer.strategy.hook_state.step_metrics())`` in
``on_train_batch_end``, or add :class:`HopqMetrics` to the callbacks.

Lightning's own checkpoints carry hopq's state: the strategy adds
``checkpoint["hopq"]`` (:meth:`hopq.HookState.state_dict`, with every rank's
rank-local counters) when it saves, and restores it when ``fit(ckpt_path=...)``
loads one, so a resumed job continues with the codec's round counter and
adaptive state (DynamiQ's budget shares and statistics) where it stopped.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hopq.integrations.ddp import HookState, adopt_optimizer, check_same_group, ddp_hook
from hopq.integrations.records import merge_local

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hopq.integrations.lightning needs Lightning: pip install lightning "
        "(or pip install 'hopq[integrations]')"
    ) from e


def _state(state: HookState | str) -> HookState:
    if isinstance(state, str):
        return HookState(codec=state)
    if not isinstance(state, HookState):
        raise TypeError(f"expected a hopq.HookState or a codec name, got {state!r}")
    return state


class HopqDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with hopq's DDP hook, on CPU and GPU alike.

    ``state``: a :class:`hopq.HookState` (or a codec name, for its defaults).
    Every other argument is ``DDPStrategy``'s (``find_unused_parameters``,
    ``static_graph``, ``bucket_cap_mb``, ``process_group_backend``,
    ``start_method``, ...), except the hook arguments, which this strategy
    owns. With ``start_method="spawn"`` each process gets its own copy of the
    state: read the metrics in the training processes (the LightningModule or
    a callback), not in the launching one. Lightning's checkpoints carry the
    state under ``"hopq"`` (saved and restored by :meth:`save_checkpoint` and
    :meth:`load_checkpoint`).
    """

    strategy_name = "hopq_ddp"

    #: The key of hopq's state in Lightning's checkpoint dictionary.
    checkpoint_key = "hopq"

    def __init__(self, state: HookState | str = "dynamiq", **kwargs: Any) -> None:
        taken = [k for k in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper") if k in kwargs]
        if taken:
            raise TypeError(
                f"HopqDDPStrategy registers hopq's hook itself; do not pass {', '.join(taken)}"
            )
        if kwargs.get("model_averaging_period") is not None:
            # DDPStrategy averages models only under torch's post-local SGD
            # state (ddp_comm_state=PostLocalSGDState), which hopq's hook replaces:
            # the period would be stored and never used
            raise TypeError(
                "HopqDDPStrategy: model_averaging_period belongs to torch's post-local SGD "
                "(ddp_comm_state=PostLocalSGDState), which hopq's hook replaces; it would "
                "be ignored. Every step all-reduces gradients with hopq's codec"
            )
        super().__init__(**kwargs)
        self.hook_state = _state(state)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # wraps the model, then makes the optimizers
        if self.optimizers:  # fitting: the codecs that read the optimizer get it
            adopt_optimizer(self.hook_state, self.optimizers, "HopqDDPStrategy")

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the model in DDP; registers nothing here
        assert isinstance(self.model, DistributedDataParallel)
        check_same_group(self.model, self.hook_state)
        self.model.register_comm_hook(self.hook_state, ddp_hook)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Add the hook state (every rank's rank-local counters gathered: Lightning
        calls this on every rank and writes rank 0's dictionary) to ``checkpoint``,
        then save it as ``DDPStrategy`` does."""
        mine = self.hook_state.state_dict()
        group = self.hook_state.process_group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            every: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, mine, group=group)
            mine = merge_local(every)
        checkpoint[self.checkpoint_key] = mine
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load the checkpoint as ``DDPStrategy`` does and restore the hook
        state it carries (a checkpoint saved without hopq's state leaves it as
        it is)."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        saved = checkpoint.get(self.checkpoint_key)
        if saved is not None:
            self.hook_state.load_state_dict(saved)
        return checkpoint


if HopqDDPStrategy.strategy_name not in StrategyRegistry:  # Trainer(strategy="hopq_ddp")
    StrategyRegistry.register(
        HopqDDPStrategy.strategy_name,
        HopqDDPStrategy,
        description="DDP with hopq's compressed all-reduce hook (DynamiQ by default)",
    )


class HopqMetrics(Callback):
    """Logs ``hook_state.step_metrics()`` (bits per coordinate, bytes, seconds,
    buckets) after every training batch with ``LightningModule.log_dict``, so they
    reach whatever logger the Trainer has. The state is the strategy's
    (:class:`HopqDDPStrategy`) unless given. ``prefix``: the keys' prefix."""

    def __init__(
        self, state: HookState | None = None, prefix: str = "hopq/", prog_bar: bool = False
    ) -> None:
        self.state = state
        self.prefix = prefix
        self.prog_bar = prog_bar

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        state = self.state or getattr(trainer.strategy, "hook_state", None)
        if state is None:
            raise TypeError("HopqMetrics needs a HookState, or a HopqDDPStrategy in the Trainer")
        m = state.pop_step()
        if m.buckets == 0:  # a gradient-accumulation micro-batch: nothing moved yet
            return
        pl_module.log_dict(m.as_dict(self.prefix), on_step=True, prog_bar=self.prog_bar)
