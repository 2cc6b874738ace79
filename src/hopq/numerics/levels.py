"""Quantization level tables and the stochastic rounding onto them.

DynamiQ (section 3.3) encodes an entry with ``w`` bits as a sign bit and a
level index r in {0, ..., L-1}, L = 2**(w-1), whose magnitude is a point of

    f(eps, r) = ((1 + 2 eps^2)^r - 1) / ((1 + 2 eps^2)^(L-1) - 1)

(non-uniform; eps -> 0 gives the uniform grid r / (L-1)). Tables are computed
in float64 and stored as float32: the float32 table is the specification.
"""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=64)
def _table(width: int, eps: float) -> tuple[float, ...]:
    if width < 2:
        raise ValueError(f"a level table needs at least 2 bits (sign + magnitude), got {width}")
    top = (1 << (width - 1)) - 1
    if eps <= 0:
        vals = [r / top for r in range(top + 1)]
    else:
        a = 1.0 + 2.0 * eps * eps
        den = a**top - 1.0
        vals = [(a**r - 1.0) / den for r in range(top + 1)]
    vals[0], vals[-1] = 0.0, 1.0
    return tuple(float(torch.tensor(v, dtype=torch.float32)) for v in vals)


def level_table(width: int, eps: float, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 magnitudes of the 2**(width-1) levels in [0, 1]; eps <= 0: uniform."""
    return torch.tensor(_table(width, eps), dtype=torch.float32, device=device)


def stochastic_level(y: torch.Tensor, table: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Unbiased stochastic rounding of y in [0, 1] onto ``table``.

    r = the last level <= y (clamped to L-2); round up to r+1 iff
    u < (y - Q[r]) / (Q[r+1] - Q[r]). Returns the level index (int64).
    Non-finite y gives some valid index (its output is poisoned by the scale).
    """
    top = table.numel() - 1
    r = (torch.searchsorted(table, y, right=True) - 1).clamp_(0, top - 1)
    lo = table[r]
    hi = table[r + 1]
    p = (y - lo) / (hi - lo)
    return r + (u < p).to(torch.int64)


#: Bucket counts of :func:`search_tables`: from 2**8 up to 2**16.
_MIN_BUCKETS_LOG, _MAX_BUCKETS_LOG = 8, 16
_ONE_STEP_MAX_LOG = 12  # 16 KiB of int32: the table stays in L1
#: More steps than this and kernels leave the table to the reference.
MAX_SEARCH_STEPS = 8


@lru_cache(maxsize=64)
def search_tables(width: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Tables for a gather-light exact level search in kernels.

    Returns (levels with +inf appended, ``bucket``, log2 NB, steps): ``bucket[b]``
    is the answer of :func:`stochastic_level`'s search, ``clamp(searchsorted(table,
    y, right) - 1, 0, L - 2)``, at ``y = b / NB``; for any ``y`` in ``[b/NB,
    (b+1)/NB)`` the answer is at most ``steps`` levels above it (checked here), so
    a kernel starts at ``bucket[floor(y NB)]`` and steps up while the next level
    is ``<= y``, ``steps`` times. The smallest NB up to 2^12 with one step is
    taken (one gather fewer per entry than two: 8-bit CPU hops went from 105-113
    to 121-125 M/s), else the smallest with two; tables too uneven for that
    (large eps) take more steps, and beyond ``MAX_SEARCH_STEPS`` raise ValueError."""
    table = level_table(width, eps)
    top = table.numel() - 1
    ext = torch.cat([table, table.new_full((1,), float("inf"))])

    def first_levels(nb_log: int) -> tuple[torch.Tensor, int]:
        edges = (torch.arange((1 << nb_log) + 1, dtype=torch.float64) / (1 << nb_log)).float()
        first = (torch.searchsorted(table, edges, right=True) - 1).clamp(0, max(top - 1, 0))
        return first, max(int((first[1:] - first[:-1]).max()), 1)  # edges are exact

    # one step from the smallest table up to 2^12 buckets, else two up to 2^16;
    # if neither, the loop ends on the finest table with the steps it needs
    tries = [(1, b) for b in range(_MIN_BUCKETS_LOG, _ONE_STEP_MAX_LOG + 1)]
    tries += [(2, b) for b in range(_MIN_BUCKETS_LOG, _MAX_BUCKETS_LOG + 1)]
    for want, nb_log in tries:
        first, steps = first_levels(nb_log)
        if steps <= want:
            break
    if steps > MAX_SEARCH_STEPS:
        raise ValueError(
            f"level table of width {width} (eps {eps}) needs {steps} search steps "
            f"(kernels take at most {MAX_SEARCH_STEPS})"
        )
    return ext, first[:-1].to(torch.int32).contiguous(), nb_log, steps
