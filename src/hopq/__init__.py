"""hopq: compressed gradient synchronization inside multi-hop all-reduce."""

from hopq.codecs import Codec, available_codecs, get_codec
from hopq.comm import RunStats, all_reduce, reduce_scatter
from hopq.errors import (
    CodecError,
    HookNotEngagedWarning,
    HopqError,
    MismatchError,
    PayloadError,
    TransportError,
)
from hopq.integrations import HookState, StepMetrics, ddp_hook
from hopq.sim import SimResult, simulate

__version__ = "0.1.0"

__all__ = [
    "Codec",
    "CodecError",
    "HookNotEngagedWarning",
    "HookState",
    "StepMetrics",
    "HopqError",
    "MismatchError",
    "PayloadError",
    "RunStats",
    "SimResult",
    "TransportError",
    "all_reduce",
    "available_codecs",
    "ddp_hook",
    "get_codec",
    "reduce_scatter",
    "simulate",
]
