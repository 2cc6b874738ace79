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


#: The share of a call's entries that the budget may leave below the width a
#: large call gets before the call runs bf16 instead (:func:`starved`): those
#: entries take 2-bit codes, vNMSE 1-3 on them: at the edge, 1/32 of them,
#: median vNMSE 0.12 (0.16 at worst of 8 seeds) at 1,057 and 1,321 entries
#: against 0.04 for a large call (4 ranks, ring, i.i.d. Gaussians).
SMALL_CALL_SHARE = 1 / 32


def starved(
    cfg: DynamiQConfig, numel: int, spans: list[int] | None = None, stats_weight: float = 1.0
) -> bool:
    """Whether a call of ``numel`` entries is too small for DynamiQ. A call pads
    its last super-group to S entries and pays the statistics per super-group,
    so a few super-groups may not all get the width a large call gives each
    (4 bits at the default 5-bit budget): the allocation leaves the emptiest
    ones narrower. The call is starved where those hold more than
    :data:`SMALL_CALL_SHARE` of its entries, or where not even the narrowest
    width fits: with the defaults vNMSE 3.1 at 257 entries, 1.1 at 769, 0.24
    at 1,100, against 0.04 from 1,150 on (docs/codecs/dynamiq.md, "Small
    calls"). ``spans``: the sizes of the pieces whose super-groups start at
    their own start (a call over rank shards), else the call is one;
    ``stats_weight``: 2 in a reduce-scatter. From the sizes and the
    configuration alone: every rank decides alike."""
    if numel <= 0:
        return False
    S, W = cfg.supergroup_size, list(cfg.widths)
    rows: list[int] = []  # real entries of each super-group
    for k in spans if spans is not None else [numel]:
        full, rest = divmod(k, S)
        rows += [S] * full + ([rest] if rest else [])

    def bits(w: int) -> float:
        return cfg.sg_bits(w) + stats_weight * STATS_BITS

    budget = cfg.budget * numel
    if len(rows) * bits(W[0]) > budget:
        return True
    large = [w for w in W if bits(w) <= cfg.budget * S]
    if not large:
        return False
    deficit = len(rows) * bits(large[-1]) - budget
    if deficit <= 0:
        return False
    save = bits(large[-1]) - bits(W[0])  # one super-group taken down to the narrowest
    k = math.ceil(deficit / save)
    return sum(sorted(rows)[:k]) > SMALL_CALL_SHARE * numel


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
    is ranked by its gain F_j (e_w - e_w') / (cost_w' - cost_w), largest first,
    equal gains in the order (step, super-group), and the steps are taken in
    that order while the running cost stays within the budget (the first step
    that does not fit ends the allocation). Steps of one super-group come in
    order because e is convex in the bits spent.

    That is a stable sort of all steps by gain, but only the steps whose gain
    equals the one where the budget runs out need their order: the steps are
    grouped by distinct statistic (statistics that went through bfloat16 take a
    few thousand values for tens of thousands of super-groups), the groups of
    equal gain are taken whole while they fit, and only the group where the
    budget runs out is expanded step by step (the allocation of a 16 MiB call:
    0.9 against 2.0 ms; the same widths, tested against the stable sort)."""

    def err(w: int) -> float:
        return 2.0**-18 if w == 16 else 1.0 / ((1 << (w - 1)) - 1) ** 2

    m = F.numel()
    level = torch.zeros(m, dtype=torch.int64)
    widths = torch.tensor(W, dtype=torch.int64)
    idx = torch.nonzero(live).flatten()
    K = len(W) - 1
    if K == 0 or idx.numel() == 0:
        return widths[level]
    Fl = torch.nan_to_num(F[idx], posinf=1e300)
    spent = float(cost[W[0]]) * idx.numel()
    dcs = [float(cost[W[k + 1]] - cost[W[k]]) for k in range(K)]
    # the same float64 products as a gain per step would be: equal statistics,
    # equal gains
    scales = [(err(W[k]) - err(W[k + 1])) / dcs[k] for k in range(K)]
    u, inv, cnt = _distinct(Fl)
    U = u.numel()
    gain = torch.cat([u * c for c in scales])  # entry k * U + v: step k of value v
    whole = torch.cat([cnt.double() * dc for dc in dcs])  # all its steps' cost (exact)
    order = _descending(gain)
    g = gain[order]
    first = torch.ones(g.numel(), dtype=torch.bool)
    first[1:] = g[1:] != g[:-1]
    group = torch.cumsum(first, 0) - 1
    n_groups = int(group[-1]) + 1
    group_cost = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, whole[order])
    after = torch.cumsum(group_cost, 0) + spent  # integers below 2^53: exact
    over = torch.nonzero(after > budget).flatten()
    cut = int(over[0]) if over.numel() else n_groups  # the group where the budget runs out
    taken = order[group < cut]
    per_value = torch.zeros(U, dtype=torch.int64)
    per_value.scatter_reduce_(0, taken % U, taken // U + 1, reduce="amax")
    lev = per_value[inv]
    if cut < n_groups:
        before = float(after[cut - 1]) if cut > 0 else spent
        entries = order[group == cut]
        ks, vs = entries // U, entries % U
        steps, step_k = [], []
        for k in sorted(set(ks.tolist())):  # steps in order: by step, then super-group
            chosen = torch.zeros(U, dtype=torch.bool)
            chosen[vs[ks == k]] = True
            pos = torch.nonzero(chosen[inv]).flatten()
            steps.append(pos)
            step_k.append(torch.full_like(pos, k))
        pos, sk = torch.cat(steps), torch.cat(step_k)
        running = torch.cumsum(torch.tensor(dcs, dtype=torch.float64)[sk], 0) + before
        fits = running <= budget
        lev.scatter_reduce_(0, pos[fits], sk[fits] + 1, reduce="amax")
    level[idx] = lev
    return widths[level]


def _distinct(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted distinct values of a float64 ``x`` without NaN, each entry's
    index among them and their counts: numpy's (a third of torch's time), or
    torch's on a torch-only install (the same values, inverse and counts)."""
    try:
        import numpy as np
    except ImportError:
        return torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    a = x.numpy()
    order = np.argsort(a)  # ties in any order: they are one value
    ranked = a[order]
    first = np.empty(a.size, dtype=bool)
    first[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    inv = np.empty(a.size, dtype=np.int64)
    inv[order] = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    cnt = np.diff(np.append(starts, a.size))
    return torch.from_numpy(ranked[starts]), torch.from_numpy(inv), torch.from_numpy(cnt)


def _descending(x: torch.Tensor) -> torch.Tensor:
    """Indices that sort ``x`` largest first, equal values in any order."""
    try:
        import numpy as np
    except ImportError:
        return torch.argsort(x, descending=True)
    return torch.from_numpy(np.argsort(-x.numpy()))


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
