"""Framework integrations."""

from hopq.integrations.ddp import HookState, ddp_hook

__all__ = ["HookState", "ddp_hook"]
