"""Microscaling formats MXFP8 / MXFP6 / MXFP4 for multi-hop all-reduce; see
:mod:`.codec`, :mod:`.kernels_cpu` for their numba kernels and
:mod:`.kernels_triton` for their Triton ones."""

from hopq.codecs.mx.codec import (
    MXFP4,
    MXFP6,
    MXFP8,
    Backend,
    MXCodec,
    MXConfig,
    MXPlan,
    ScaleFormat,
)

__all__ = [
    "Backend",
    "MXCodec",
    "MXConfig",
    "MXFP4",
    "MXFP6",
    "MXFP8",
    "MXPlan",
    "ScaleFormat",
]
