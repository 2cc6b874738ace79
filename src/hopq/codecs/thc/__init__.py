"""THC (tensor homomorphic compression, Li et al., NSDI'24) for multi-hop all-reduce;
see :mod:`.codec`, and :mod:`.kernels_cpu` for its numba kernels."""

from hopq.codecs.thc.codec import (
    LANES,
    ROUND_STREAM,
    SIGN_STREAM,
    THC,
    WIDE,
    THCConfig,
    THCPlan,
    fwht,
)

__all__ = [
    "LANES",
    "ROUND_STREAM",
    "SIGN_STREAM",
    "THC",
    "THCConfig",
    "THCPlan",
    "WIDE",
    "fwht",
]
