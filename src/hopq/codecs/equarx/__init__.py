"""EQuARX: dynamic block-wise quantization of every hop (Ahmed et al.); see :mod:`.codec`,
:mod:`.kernels_cpu` for its numba kernel and :mod:`.kernels_triton` for its GPU kernels."""

from hopq.codecs.equarx.codec import (
    Backend,
    Element,
    EQuARX,
    EQuARXCodec,
    EQuARXConfig,
    Layout,
    ScaleFormat,
    equarx_chunks,
)

__all__ = [
    "Backend",
    "EQuARX",
    "EQuARXCodec",
    "EQuARXConfig",
    "Element",
    "Layout",
    "ScaleFormat",
    "equarx_chunks",
]
