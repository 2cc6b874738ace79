"""DynamiQ (Dynamic Quantization for multi-hop all-reduce; the DynamiQ paper's
sections 3, 4 and appendices A, B): the flagship codec.

Per round:

1. *Statistics* (section 3.1): per super-group j of S entries each rank sends
   its mean and sum of squares (two bfloat16 numbers); the engine's ordered
   all-reduce gives every rank mu_j and F_j. Each rank subtracts mu_j; ``finish``
   adds back n mu_j (sum) or mu_j (average).
2. *Bit allocation* (section 3.2, appendix A; :mod:`.allocation`) from F_j, so
   that payload, scales and the statistics together stay within ``budget`` bits
   per coordinate. Keyed calls (DDP buckets, ``StatsExchange.key``) share one
   budget per step (``share_budget``, beyond the paper): the step before's F_j
   of all keys are allocated together, and each key's allocation runs within
   the bits that this gave its super-groups.
3. *Reorder* super-groups by width (stable), so every chunk is a few runs of
   one width; chunks are cut at super-group boundaries with near-equal bytes
   (:mod:`.layout`, which also fixes the payload layout).
4. *Quantization* (section 3.3; :mod:`.reference`, the specification) of every
   chunk at every hop, with the rounding of entries correlated across the ranks
   of a chunk's aggregation tree.

Correlated rounding and unbiasedness: along a chain, hop k+1 rounds a value that
contains hop k's rounding error, so its u must be uniform given hop k's to stay
unbiased, and then the two errors are uncorrelated anyway (martingale
differences). ``correlated`` (default) therefore correlates only encoders of
equal depth in the chunk's tree, whose inputs are independent: leaves and
siblings of a butterfly; a ring gains nothing. ``path`` is the paper's formula
over all n encoders of the path; it is measurably biased (tests/test_dynamiq.py).

Non-finite input: a NaN or Inf poisons its super-group's mean and scale, so the
whole super-group (the position included) comes out non-finite on every rank.

Kernels (:mod:`.kernels_cpu`, numba; :mod:`.kernels_triton`, Triton; each
segment handed over as one :class:`~.segment.SegmentCall`): ``backend="auto"``
runs the numba kernels on CPU tensors and the Triton kernels on CUDA tensors
when installed, the reference otherwise; all produce the same bits.
"""

from hopq.codecs.dynamiq.codec import DynamiQ
from hopq.codecs.dynamiq.config import (
    DEFAULT_EPS,
    PAPER,
    STATS_BITS,
    SUPPORTED_WIDTHS,
    Allocation,
    Backend,
    DynamiQConfig,
    Levels,
    Rounding,
    Scales,
)
from hopq.codecs.dynamiq.layout import DynamiQPlan, Segment

__all__ = [
    "DEFAULT_EPS",
    "PAPER",
    "STATS_BITS",
    "SUPPORTED_WIDTHS",
    "Allocation",
    "Backend",
    "DynamiQ",
    "DynamiQConfig",
    "DynamiQPlan",
    "Levels",
    "Rounding",
    "Scales",
    "Segment",
]
