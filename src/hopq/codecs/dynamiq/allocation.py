"""DynamiQ's bit allocation (section 3.2, appendix A) and the budget split across
keyed calls (beyond the paper).

Everything here is float64 CPU arithmetic on the all-reduced statistics F_j, so
every rank computes the same widths and the same shares bit for bit.
"""

from __future__ import annotations

import math

import torch

from hopq.codecs.dynamiq.config import STATS_BITS, Allocation, DynamiQConfig


def allocate(
    cfg: DynamiQConfig, F: torch.Tensor, d: int, budget: float, stats_weight: float = 1.0
) -> torch.Tensor:
    """Width per super-group (original order, int64) for ``budget`` bits per
    coordinate over ``d`` coordinates, statistics included (``stats_weight``
    times their bits: 2 in a reduce-scatter, whose coordinates move once, not
    twice)."""
    m = F.numel()
    if m == 0:
        return torch.zeros(0, dtype=torch.int64)
    W = list(cfg.widths)
    budget_bits = budget * d - stats_weight * STATS_BITS * m
    F = torch.nan_to_num(F, nan=math.inf)
    zero = (F == 0) if cfg.zero_class else torch.zeros(m, dtype=torch.bool)
    live = ~zero
    cost = {w: cfg.sg_bits(w) for w in W}
    if cfg.allocation is Allocation.FIXED or len(W) == 1:
        n_live = int(live.sum())
        fit = [w for w in W if cost[w] * n_live <= budget_bits] or [W[0]]
        width = torch.full((m,), fit[-1], dtype=torch.int64)
    elif cfg.allocation is Allocation.HEURISTIC:
        width = heuristic(F, live, W, cost, budget_bits)
    else:
        width = exact(F, live, W, cost, budget_bits)
    width[zero] = 0
    return width


def heuristic(
    F: torch.Tensor, live: torch.Tensor, W: list[int], cost: dict[int, int], budget: float
) -> torch.Tensor:
    """Appendix A: z_j = c log2 F_j + u with c = 4 / log2(512/17); a super-group
    passes the boundary between consecutive widths a < b at z = B_{a,b}. For
    W = {2, 4, 8} the boundaries are 4 and 8, i.e. q_j = 2^clamp(1, 3,
    floor(log2 z_j)), and T_{2,4} = 17/512 T_{4,8}. Further boundaries follow
    section 3.2's equal per-bit benefit, T_{a,b} (4^{b-a} - 1) / (4^b (b-a)).
    u is the largest offset (bisection) whose allocation fits the budget."""
    c = 4.0 / math.log2(512.0 / 17.0)

    def benefit(a: int, b: int) -> float:
        return (4.0 ** (b - a) - 1.0) / (4.0**b * (b - a))

    bounds = [4.0]
    for k in range(1, len(W) - 1):
        a, b, nb = W[k - 1], W[k], W[k + 1]
        # T_{b,nb} / T_{a,b} = benefit(a,b) / benefit(b,nb)
        bounds.append(bounds[-1] + c * math.log2(benefit(a, b) / benefit(b, nb)))
    B = torch.tensor(bounds, dtype=torch.float64)
    # F = 0 outside the zero class -> very low; F = Inf (non-finite input) -> the
    # widest; both kept finite so that the bisection range stays sane.
    logF = torch.log2(F.clamp(min=1e-300)).clamp(max=1e4)
    widths_t = torch.tensor(W, dtype=torch.int64)
    costs_t = torch.tensor([cost[w] for w in W], dtype=torch.float64)
    zc = c * logF[live]

    def alloc(u: float) -> torch.Tensor:
        return torch.bucketize(zc + u, B, right=True)  # index into W

    def total(u: float) -> float:
        return float(costs_t[alloc(u)].sum())

    finite = zc[torch.isfinite(zc)]
    if finite.numel():
        lo = float(B[0]) - float(finite.max()) - 1.0
        hi = float(B[-1]) - float(finite.min()) + 1.0
    else:
        lo, hi = -1.0, 1.0
    if total(hi) <= budget:
        u = hi
    elif total(lo) > budget:
        u = lo  # over budget: everything at the narrowest width (tiny tensors)
    else:
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            if total(mid) <= budget:
                lo = mid
            else:
                hi = mid
        u = lo
    width = torch.full((F.numel(),), W[0], dtype=torch.int64)
    width[live] = widths_t[alloc(u)]
    return width


def exact(
    F: torch.Tensor, live: torch.Tensor, W: list[int], cost: dict[int, int], budget: float
) -> torch.Tensor:
    """Greedy by marginal benefit per bit (beyond the paper): the estimated error
    of a super-group at width w is F_j e_w with e_w = 1/(2^(w-1) - 1)^2 (level
    spacing squared; e_16 = 2^-18 for bfloat16), every upgrade step (j, w -> w')
    is ranked by F_j (e_w - e_w') / (cost_w' - cost_w), and the best steps are
    taken while the budget lasts. Steps of one super-group come in order
    because e is convex in the bits spent."""

    def err(w: int) -> float:
        return 2.0**-18 if w == 16 else 1.0 / ((1 << (w - 1)) - 1) ** 2

    m = F.numel()
    idx = torch.nonzero(live).flatten()
    Fl = torch.nan_to_num(F[idx], posinf=1e300)
    spent = float(cost[W[0]]) * idx.numel()
    gains, costs, owners, levels = [], [], [], []
    for k in range(len(W) - 1):
        a, b = W[k], W[k + 1]
        dc = float(cost[b] - cost[a])
        gains.append(Fl * ((err(a) - err(b)) / dc))
        costs.append(torch.full((idx.numel(),), dc, dtype=torch.float64))
        owners.append(idx)
        levels.append(torch.full((idx.numel(),), k + 1, dtype=torch.int64))
    level = torch.zeros(m, dtype=torch.int64)
    if gains:
        order = descending_order(torch.cat(gains))
        csum = torch.cumsum(torch.cat(costs)[order], 0) + spent
        take = order[csum <= budget]
        own = torch.cat(owners)[take]
        lev = torch.cat(levels)[take]
        level.scatter_reduce_(0, own, lev, reduce="amax")
    return torch.tensor(W, dtype=torch.int64)[level]


def descending_order(g: torch.Tensor) -> torch.Tensor:
    """``torch.sort(-g, stable=True).indices`` for a float64 ``g`` without NaN:
    largest first, equal values in index order. An unstable (SIMD) sort, then
    the runs of equal values put in index order by one sort of unique int64
    keys (run, index): 1.4 against 2.6 ms for the 49K steps of a 16 MiB call
    (gains from bfloat16 statistics, many ties), with the same order. Without
    numpy (a torch-only install): the stable sort itself."""
    try:
        import numpy as np
    except ImportError:
        return torch.sort(-g, stable=True).indices
    k = g.numel()
    if k < 2:
        return torch.arange(k, dtype=torch.int64)
    neg = -g.numpy()
    order = np.argsort(neg)
    ranked = neg[order]
    run = np.empty(k, dtype=np.int64)
    run[0] = 0
    np.cumsum(ranked[1:] != ranked[:-1], out=run[1:])
    if run[-1] == k - 1:  # every value distinct: no ties to order
        return torch.from_numpy(order.astype(np.int64, copy=False))
    shift = int(k - 1).bit_length()
    keys = np.sort((run << shift) | order)
    return torch.from_numpy(keys & ((1 << shift) - 1))


def split_budget(
    cfg: DynamiQConfig, step: dict[int, tuple[int, torch.Tensor]]
) -> dict[int, tuple[int, float]]:
    """Per-key budgets (key -> (numel, bits per coordinate)) that sum to ``budget``
    over the step ``step`` (key -> (numel, F)): one allocation over the
    super-groups of all keys; each key gets the bits (payload, scales,
    statistics) of its own super-groups, plus the allocation's leftover in
    proportion to its size."""
    keys = [k for k in sorted(step) if step[k][0] > 0]
    total = sum(step[k][0] for k in keys)
    if not keys:
        return {}
    widths = allocate(cfg, torch.cat([step[k][1] for k in keys]), total, cfg.budget)
    lut = torch.zeros(max(cfg.widths) + 1, dtype=torch.float64)
    for w in (0, *cfg.widths):
        lut[w] = cfg.sg_bits(w) + STATS_BITS
    sg_cost = lut[widths]
    sizes = [step[k][1].numel() for k in keys]
    bits = [float(c.sum()) for c in torch.split(sg_cost, sizes)]
    slack = max(0.0, cfg.budget * total - sum(bits))
    return {
        k: (step[k][0], (b + slack * step[k][0] / total) / step[k][0])
        for k, b in zip(keys, bits, strict=True)
    }
