"""Codecs, each registering itself by name: one folder per codec with kernels
(its config, plan, PyTorch reference and kernels side by side), one module for
the small ones (omnireduce, uncompressed)."""

from hopq.codecs import dynamiq as _dynamiq  # noqa: F401  (registers dynamiq)
from hopq.codecs import equarx as _equarx  # noqa: F401  (registers equarx)
from hopq.codecs import gcomp as _gcomp  # noqa: F401  (registers gcomp)
from hopq.codecs import gqsgd as _gqsgd  # noqa: F401  (registers gqsgd-linear, gqsgd-exp)
from hopq.codecs import mx as _mx  # noqa: F401  (registers mxfp8, mxfp6, mxfp4)
from hopq.codecs import omnireduce as _omnireduce  # noqa: F401
from hopq.codecs import thc as _thc  # noqa: F401
from hopq.codecs import uncompressed as _uncompressed  # noqa: F401  (registers fp32/bf16/fp16)
from hopq.codecs.base import Codec, CodecConfig, HopContext, Plan, ReduceOp, StatsExchange
from hopq.codecs.registry import available_codecs, codec_info, get_codec, register

__all__ = [
    "Codec",
    "CodecConfig",
    "HopContext",
    "Plan",
    "ReduceOp",
    "StatsExchange",
    "available_codecs",
    "codec_info",
    "get_codec",
    "register",
]
