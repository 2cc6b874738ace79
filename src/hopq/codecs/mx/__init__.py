"""Microscaling formats MXFP8 / MXFP6 / MXFP4 for multi-hop all-reduce; see
:mod:`.codec`, and :mod:`.kernels_cpu` for their numba kernels."""

from hopq.codecs.mx.codec import (
    MXFP4,
    MXFP6,
    MXFP8,
    MXCodec,
    MXConfig,
    MXPlan,
    ScaleFormat,
)

__all__ = [
    "MXCodec",
    "MXConfig",
    "MXFP4",
    "MXFP6",
    "MXFP8",
    "MXPlan",
    "ScaleFormat",
]
