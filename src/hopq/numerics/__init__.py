"""Numerics shared by codecs and kernels: hash RNG, bit packing (torch only)."""

from hopq.numerics.bitpack import pack_bits, packed_nbytes, unpack_bits
from hopq.numerics.rng import stream_key, uniform

__all__ = ["pack_bits", "packed_nbytes", "stream_key", "uniform", "unpack_bits"]
