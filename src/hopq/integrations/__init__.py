"""Framework integrations."""

from hopq.integrations.ddp import HookState, StepMetrics, ddp_hook

__all__ = ["HookState", "StepMetrics", "ddp_hook"]
