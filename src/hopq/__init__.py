"""hopq: compressed gradient synchronization inside multi-hop all-reduce."""

from typing import TYPE_CHECKING, Any

from hopq.codecs import Codec, available_codecs, get_codec
from hopq.comm import RunStats, all_reduce, reduce_scatter
from hopq.comm.layout import NodeLayout
from hopq.comm.plan import Plan, PlanInputs, plan
from hopq.errors import (
    CodecError,
    HookNotEngagedWarning,
    HopqError,
    MismatchError,
    PayloadError,
    TransportError,
)
from hopq.integrations import HookState, StepMetrics, ddp_hook
from hopq.sim import SimResult, SimShards, simulate, simulate_reduce_scatter

if TYPE_CHECKING:
    from hopq.integrations.fsdp import FSDPReduceScatter

__version__ = "0.1.0"

__all__ = [
    "Codec",
    "CodecError",
    "HookNotEngagedWarning",
    "FSDPReduceScatter",
    "HookState",
    "StepMetrics",
    "HopqError",
    "MismatchError",
    "NodeLayout",
    "PayloadError",
    "Plan",
    "PlanInputs",
    "RunStats",
    "SimResult",
    "SimShards",
    "TransportError",
    "all_reduce",
    "available_codecs",
    "ddp_hook",
    "get_codec",
    "plan",
    "reduce_scatter",
    "simulate",
    "simulate_reduce_scatter",
]


def __getattr__(name: str) -> Any:
    # FSDP2's modules take over a second to import: only when asked for
    if name == "FSDPReduceScatter":
        from hopq.integrations.fsdp import FSDPReduceScatter

        return FSDPReduceScatter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
