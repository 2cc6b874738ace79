"""Framework integrations. ``FSDPReduceScatter`` is imported on first use: FSDP2's
modules take over a second to import, which ``import hopq`` does not pay."""

from typing import TYPE_CHECKING, Any

from hopq.integrations.ddp import HookState, StepMetrics, ddp_hook

if TYPE_CHECKING:
    from hopq.integrations.fsdp import FSDPReduceScatter

__all__ = ["FSDPReduceScatter", "HookState", "StepMetrics", "ddp_hook"]


def __getattr__(name: str) -> Any:
    if name == "FSDPReduceScatter":
        from hopq.integrations.fsdp import FSDPReduceScatter

        return FSDPReduceScatter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
