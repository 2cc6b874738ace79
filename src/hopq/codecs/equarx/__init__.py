"""EQuARX: dynamic block-wise quantization of every hop (Ahmed et al.); see :mod:`.codec`,
and :mod:`.kernels_cpu` for its numba kernel."""

from hopq.codecs.equarx.codec import (
    Element,
    EQuARX,
    EQuARXCodec,
    EQuARXConfig,
    Layout,
    ScaleFormat,
    equarx_chunks,
)

__all__ = [
    "EQuARX",
    "EQuARXCodec",
    "EQuARXConfig",
    "Element",
    "Layout",
    "ScaleFormat",
    "equarx_chunks",
]
