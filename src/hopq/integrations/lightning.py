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

FSDP: Lightning's ``ModelParallelStrategy`` is its FSDP2 path (the module calls
``fully_shard`` in ``configure_model``); hopq's reduce-scatter replaces FSDP2's
with :func:`install_fsdp` (called in ``configure_model`` after ``fully_shard``)
or the :class:`HopqFSDP` callback (installs it when fitting starts, logs the
step metrics, and carries its state in Lightning's checkpoints). Lightning's ``FSDPStrategy`` wraps the model in FSDP1, which
takes no custom reduce-scatter: both refuse it, naming the way that works.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from hopq.integrations.ddp import HookState, adopt_optimizer, check_same_group, ddp_hook
from hopq.integrations.fsdp import FSDPReduceScatter
from hopq.integrations.records import gathered_state

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, StrategyRegistry
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
        from torch.distributed.fsdp import FSDPModule

        if self.model is not None and any(isinstance(m, FSDPModule) for m in self.model.modules()):
            # DDP would fail on the sharded (DTensor) parameters with an operator error
            raise TypeError(
                "HopqDDPStrategy: configure_model called fully_shard (FSDP2), which DDP cannot "
                "wrap. Use Trainer(strategy=ModelParallelStrategy(data_parallel_size=..., "
                "tensor_parallel_size=1)) with hopq.integrations.lightning.HopqFSDP(comm) in the "
                "callbacks (or install_fsdp(self, comm) in configure_model)"
            )
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
        checkpoint[self.checkpoint_key] = gathered_state(
            self.hook_state, self.hook_state.process_group
        )
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
            raise TypeError(
                "HopqMetrics needs a HookState, or a HopqDDPStrategy in the Trainer (under "
                "ModelParallelStrategy with fully_shard, HopqFSDP(comm) installs hopq's "
                "reduce-scatter and logs its metrics)"
            )
        m = state.pop_step()
        if m.buckets == 0:  # a gradient-accumulation micro-batch: nothing moved yet
            return
        pl_module.log_dict(m.as_dict(self.prefix), on_step=True, prog_bar=self.prog_bar)


#: Why FSDP1 (Lightning's ``FSDPStrategy``) cannot carry hopq, and what does.
FSDP1_MESSAGE = (
    "Lightning's FSDPStrategy wraps the model in FSDP1 (FullyShardedDataParallel), which "
    "takes no custom reduce-scatter, so hopq cannot compress its gradients. Use "
    "Trainer(strategy=ModelParallelStrategy(data_parallel_size=..., tensor_parallel_size=1)), "
    "call torch.distributed.fsdp.fully_shard in LightningModule.configure_model, and add "
    "hopq.integrations.lightning.HopqFSDP(comm) to the callbacks (or call "
    "install_fsdp(self, comm) in configure_model after fully_shard)"
)


def _comm(comm: FSDPReduceScatter | str) -> FSDPReduceScatter:
    if isinstance(comm, str):
        return FSDPReduceScatter(comm)
    if not isinstance(comm, FSDPReduceScatter):
        raise TypeError(f"expected a hopq.FSDPReduceScatter or a codec name, got {comm!r}")
    return comm


def _refuse_fsdp1(module: Any) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(FSDP1_MESSAGE)


def install_fsdp(module: Any, comm: FSDPReduceScatter | str = "dynamiq") -> FSDPReduceScatter:
    """Make hopq's reduce-scatter FSDP2's in ``module``: call it in
    ``LightningModule.configure_model`` after ``fully_shard``, under
    ``ModelParallelStrategy``.

    Args:
        module: The LightningModule (or any module) ``fully_shard`` was called on.
        comm: A :class:`hopq.FSDPReduceScatter`, or a codec name for its defaults.

    Returns:
        The installed ``FSDPReduceScatter`` (read ``step_metrics()`` from it).

    Raises:
        TypeError: ``module`` holds FSDP1 modules (Lightning's ``FSDPStrategy``).
        ValueError: ``module`` holds no FSDP2 module (``fully_shard`` not called).

    Example:
        ```python
        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net, mesh=mesh)
            self.comm = install_fsdp(self, hopq.FSDPReduceScatter("dynamiq"))
        ```
    """
    _refuse_fsdp1(module)
    comm = _comm(comm)
    comm.install(module)
    return comm


class HopqFSDP(Callback):
    """Installs hopq's reduce-scatter on the LightningModule's FSDP2 modules when
    fitting starts (after ``configure_model`` called ``fully_shard``, under
    ``ModelParallelStrategy``), and logs its step metrics after every training
    batch (``log=False``: read ``comm.step_metrics()`` yourself). Raises under
    Lightning's ``FSDPStrategy`` (FSDP1), naming the way that works.

    ``comm``: a :class:`hopq.FSDPReduceScatter`, or a codec name for its defaults.
    """

    def __init__(
        self,
        comm: FSDPReduceScatter | str = "dynamiq",
        log: bool = True,
        prefix: str = "hopq/",
        prog_bar: bool = False,
    ) -> None:
        self.comm = _comm(comm)
        self.log = log
        self.prefix = prefix
        self.prog_bar = prog_bar
        self._installed: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if isinstance(trainer.strategy, FSDPStrategy):
            raise TypeError(FSDP1_MESSAGE)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        _refuse_fsdp1(pl_module)
        if self._installed is pl_module:
            return
        if not any(isinstance(m, FSDPModule) for m in pl_module.modules()):
            raise ValueError(
                f"HopqFSDP found no FSDP2 module under {type(trainer.strategy).__name__}: use "
                "ModelParallelStrategy and call torch.distributed.fsdp.fully_shard in "
                "configure_model (for DDP, use HopqDDPStrategy)"
            )
        self.comm.install(pl_module)
        self._installed = pl_module

    def state_dict(self) -> dict[str, Any]:
        """``comm``'s state (every rank's rank-local counters gathered: Lightning
        calls this on every rank and writes rank 0's checkpoint), saved by
        Lightning under the callback's entry and restored by ``fit(ckpt_path=...)``."""
        return gathered_state(self.comm)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``comm``'s state from a checkpoint this callback saved."""
        self.comm.load_state_dict(state_dict)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        if not self.log:
            return
        m = self.comm.pop_step()
        if m.buckets == 0:  # a gradient-accumulation micro-batch: nothing moved yet
            return
        pl_module.log_dict(m.as_dict(self.prefix), on_step=True, prog_bar=self.prog_bar)
