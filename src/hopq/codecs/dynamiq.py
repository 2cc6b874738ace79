"""DynamiQ (seed 000: sections 3, 4 and appendices A, B): the reference codec.

Per round:

1. *Statistics* (section 3.1): per super-group j of S entries each rank sends
   its mean and sum of squares (two bfloat16 numbers); the engine's ordered
   all-reduce gives every rank mu_j and F_j. Each rank subtracts mu_j; ``finish``
   adds back n mu_j (sum) or mu_j (average).
2. *Bit allocation* (section 3.2, appendix A) from F_j, so that payload, scales
   and the statistics together stay within ``budget`` bits per coordinate.
   Keyed calls (DDP buckets, ``StatsExchange.key``) share one budget per step
   (``share_budget``, beyond the paper): the step before's F_j of all keys are
   allocated together, and each key's allocation runs within the bits that this
   gave its super-groups. Shares live in the instance, not in ``state_dict``:
   a run resumed from a checkpoint takes the plain budget for one step.
3. *Reorder* super-groups by width (stable), so every chunk is a few runs of
   one width; chunks are cut at super-group boundaries with near-equal bytes.
4. *Quantization* (section 3.3) of every chunk at every hop: sign bit plus a
   level index on the non-uniform grid f(eps, r); groups of s entries are
   normalised by their maximum; the super-group maximum travels as bfloat16
   (rounded up), each group's maximum as a uint8 fraction of it, stochastically
   rounded, so every entry stays unbiased; the rounding of entries is
   correlated across the ranks of a chunk's aggregation tree,
   u_i = (pi_i + gamma_i) / n.

Chunk payload layout (the specification kernels follow), segment after segment
(one segment per width run inside the chunk, in chunk order):

* width 2, 4, 8 with hierarchical scales: k bfloat16 super-group scales, then
  k * S/s uint8 group scales, then k * S * w / 8 bytes of packed codes
  (code = sign << (w-1) | level, :mod:`hopq.numerics.bitpack` layout);
* width 2, 4, 8 with full-precision scales: k * S/s bfloat16 group scales, codes;
* width 16: the entries as bfloat16, stochastically rounded (k * S * 2 bytes);
* width 0 (the zero class, F_j = 0 on every rank): nothing.

Random streams (:mod:`hopq.numerics.rng`, key hop field = tag << 16 | position):
tag 0 gamma for entries (index: position in the working vector), tag 1 the
permutation for correlated rounding, shared by the correlated encoders (position
field: 0 for ``path``, depth + 1 for ``correlated``), tag 2 group-scale rounding
(index: group number).

Correlated rounding and unbiasedness: along a chain, hop k+1 rounds a value that
contains hop k's rounding error, so its u must be uniform given hop k's to stay
unbiased, and then the two errors are uncorrelated anyway (martingale
differences). ``correlated`` (default) therefore correlates only encoders of
equal depth in the chunk's tree, whose inputs are independent: leaves and
siblings of a butterfly; a ring gains nothing. ``path`` is the paper's formula
over all n encoders of the path; it is measurably biased (tests/test_dynamiq.py).

Non-finite input: a NaN or Inf poisons its super-group's mean and scale, so the
whole super-group (the position included) comes out non-finite on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, NamedTuple

import torch

from hopq.codecs.base import (
    Codec,
    CodecConfig,
    HopContext,
    Plan,
    ReduceOp,
    StatsExchange,
    check_payload,
)
from hopq.codecs.registry import register
from hopq.errors import PayloadError
from hopq.numerics.bitpack import pack_bits, unpack_bits
from hopq.numerics.fp_formats import round_up_bf16
from hopq.numerics.levels import level_table, search_tables, stochastic_level
from hopq.numerics.reduce import tree_sum
from hopq.numerics.rng import hash32, stream_key, uniform

SUPPORTED_WIDTHS = (2, 4, 8, 16)
#: Bits of the statistics exchange per super-group: mean and sum of squares in bfloat16.
STATS_BITS = 32
#: Stream tags (see module docstring).
TAG_GAMMA, TAG_PERM, TAG_SCALE = 0, 1, 2

#: eps of the non-uniform levels per width: the lowest vNMSE of the sweep in
#: ``hopq bench vnmse --tables eps`` on MiniLM gradients, n = 4, ring (README,
#: "Choosing eps": 4 bits 0.0356 at eps 0.3 vs 0.0459 uniform; 8 bits 1.6e-4 at
#: 0.08 vs 2.0e-4 uniform). Two-bit codes have two levels, {0, 1}: no eps.
DEFAULT_EPS: dict[int, float] = {2: 0.0, 4: 0.3, 8: 0.08}


class Allocation(str, Enum):
    HEURISTIC = (
        "heuristic"  # appendix A: thresholds tied by T_{2,4} = 17/512 T_{4,8}, offset u searched
    )
    EXACT = "exact"  # greedy by estimated error reduction per bit (beyond the paper)
    FIXED = "fixed"  # one width for all: the widest that fits the budget (ablation)


class Levels(str, Enum):
    NONUNIFORM = "nonuniform"
    UNIFORM = "uniform"


class Scales(str, Enum):
    HIERARCHICAL = "hierarchical"  # bf16 super-group max + uint8 group fractions
    FULL = "full"  # a bfloat16 scale per group (ablation)


class Backend(str, Enum):
    #: Triton kernels for CUDA tensors when Triton is installed, the numba kernels
    #: for CPU tensors when numba is installed, the reference otherwise.
    AUTO = "auto"
    REFERENCE = "reference"
    #: hopq.kernels.dynamiq (CUDA tensors; on CPU only under TRITON_INTERPRET=1).
    TRITON = "triton"
    #: hopq.kernels.dynamiq_cpu (CPU tensors, numba).
    CPU = "cpu"


class Rounding(str, Enum):
    #: Correlated among the encoders of a chunk at equal tree depth (disjoint
    #: subtrees); unbiased. On a ring every depth has one encoder: independent.
    CORRELATED = "correlated"
    INDEPENDENT = "independent"
    #: The paper's formula over all n encoders of the chunk's path. Biased in
    #: multi-hop: a hop rounds a value that holds the previous hops' rounding.
    PATH = "path"


@dataclass(frozen=True)
class DynamiQConfig(CodecConfig):
    """DynamiQ's knobs; defaults are the paper's configuration (section 5)."""

    budget: float = 5.0
    widths: tuple[int, ...] = (2, 4, 8)
    group_size: int = 16
    supergroup_size: int = 256
    allocation: Allocation = Allocation.HEURISTIC
    levels: Levels = Levels.NONUNIFORM
    scales: Scales = Scales.HIERARCHICAL
    rounding: Rounding = Rounding.CORRELATED
    #: Super-groups with F_j = 0 on every rank cost nothing and come out exact.
    zero_class: bool = False
    #: eps per width, as ((width, eps), ...); None: DEFAULT_EPS.
    eps: tuple[tuple[int, float], ...] | None = None
    #: Which implementation runs encode/decode; all produce the same bits.
    backend: Backend = Backend.AUTO
    #: Keyed calls (the DDP hook's buckets, see ``StatsExchange.key``) share one
    #: bit budget per step instead of each taking ``budget`` (beyond the paper):
    #: the previous step's statistics of all keys are allocated together, and
    #: each key gets the bits that allocation gave its super-groups.
    share_budget: bool = True

    def __post_init__(self) -> None:
        enums: dict[str, type[Enum]] = {
            "allocation": Allocation,
            "levels": Levels,
            "scales": Scales,
            "rounding": Rounding,
            "backend": Backend,
        }
        for name, enum in enums.items():
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                choices = [str(e.value) for e in enum]
                raise ValueError(
                    f"dynamiq: {name} must be one of {choices}, got {getattr(self, name)!r}"
                ) from None
        widths = tuple(sorted(set(int(w) for w in self.widths)))
        if not widths or any(w not in SUPPORTED_WIDTHS for w in widths):
            raise ValueError(
                f"dynamiq: widths must be a non-empty subset of {SUPPORTED_WIDTHS}, got {self.widths}"
            )
        object.__setattr__(self, "widths", widths)
        s, S = self.group_size, self.supergroup_size
        for name, v in (("group_size", s), ("supergroup_size", S)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"dynamiq: {name} must be a power of two, got {v}")
        if S % s:
            raise ValueError(f"dynamiq: group_size {s} does not divide supergroup_size {S}")
        if s < 2 and self.scales is Scales.HIERARCHICAL:
            raise ValueError("dynamiq: hierarchical scales need groups of at least 2 entries")
        floor = min(self.sg_bits(w) for w in widths) / S + STATS_BITS / S
        if not self.budget >= floor:
            raise ValueError(
                f"dynamiq: budget {self.budget} bits/coordinate is below the metadata cost: the narrowest "
                f"width {widths[0]} already takes {floor:.4f} with scales and statistics (S={S}, s={s})"
            )
        if self.eps is not None:
            for w, e in self.eps:
                if w not in SUPPORTED_WIDTHS or not e >= 0:
                    raise ValueError(
                        f"dynamiq: eps must be >= 0 per supported width, got {self.eps}"
                    )

    def eps_for(self, width: int) -> float:
        if self.levels is Levels.UNIFORM:
            return 0.0
        table = dict(self.eps) if self.eps is not None else DEFAULT_EPS
        return table.get(width, DEFAULT_EPS.get(width, 0.0))

    def meta_bits(self, width: int) -> int:
        """Scale bits per super-group of this width."""
        if width in (0, 16):
            return 0
        groups = self.supergroup_size // self.group_size
        return 16 * groups if self.scales is Scales.FULL else 16 + 8 * groups

    def sg_bits(self, width: int) -> int:
        """Payload bits of one super-group (codes and scales)."""
        return self.supergroup_size * width + self.meta_bits(width)


class Streams(NamedTuple):
    """The random streams of one encoding, as the kernels take them."""

    gamma_key: tuple[int, int]
    perm_key: tuple[int, int]
    peers: int
    peer: int
    units: tuple[int, ...]
    scale_key: tuple[int, int]


@dataclass
class Segment:
    """A run of super-groups of one width inside a chunk."""

    width: int
    lo: int  # first super-group (reordered index)
    hi: int  # one past the last
    offset: int  # byte offset in the chunk payload
    nbytes: int


@dataclass
class DynamiQPlan(Plan):
    supergroups: int = 0
    #: Width of each super-group, in reordered order (host list).
    widths: tuple[int, ...] = ()
    #: perm[k] = original index of the k-th reordered super-group.
    perm: torch.Tensor | None = None
    #: Global mean per super-group (original order).
    mu: torch.Tensor | None = None
    segments: tuple[tuple[Segment, ...], ...] = ()
    #: Payload bits per coordinate the allocation planned (stats included).
    planned_bits: float = 0.0
    #: Whether even the narrowest allocation exceeded the budget (tiny tensors).
    over_budget: bool = False


def _bf16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _units(n: int) -> list[int]:
    return [a for a in range(1, n) if math.gcd(a, n) == 1] or [1]


def _kernel_module(cfg: DynamiQConfig, device_type: str) -> Any:
    """The kernel module that runs ``cfg``'s segments on this device type, or
    None for the reference (see :class:`Backend`)."""
    b = cfg.backend
    if b is Backend.REFERENCE:
        return None
    supported = cfg.scales is Scales.HIERARCHICAL and _kernel_levels_ok(cfg)
    if b is Backend.AUTO:
        if not supported:
            return None
        if device_type == "cuda":
            from hopq.kernels import dynamiq as tk

            return tk if tk.available() else None
        if device_type == "cpu":
            from hopq.kernels import dynamiq_cpu as ck

            return ck if ck.available() else None
        return None
    if not supported:
        raise ValueError(
            f"dynamiq: backend {b.value!r} needs scales='hierarchical' and level tables "
            f"the kernels' bucket search handles (eps {[cfg.eps_for(w) for w in cfg.widths]})"
        )
    if b is Backend.CPU:
        from hopq.kernels import dynamiq_cpu as ck

        if not ck.available():
            raise RuntimeError("dynamiq: backend 'cpu' needs numba (pip install hopq[cpu])")
        if device_type != "cpu":
            raise ValueError(f"dynamiq: backend 'cpu' runs on CPU tensors, got {device_type}")
        return ck
    from hopq.kernels import dynamiq as tk

    if not tk.available():
        raise RuntimeError("dynamiq: backend 'triton' needs triton (pip install hopq[triton])")
    if device_type != "cuda" and not tk.interpreting():
        raise ValueError(
            f"dynamiq: backend 'triton' runs on CUDA tensors (or with TRITON_INTERPRET=1), got {device_type}"
        )
    return tk


def _kernel_levels_ok(cfg: DynamiQConfig) -> bool:
    try:
        for w in cfg.widths:
            if w in (2, 4, 8):
                search_tables(w, cfg.eps_for(w))
    except ValueError:
        return False
    return True


@register(
    "dynamiq",
    "DynamiQ: variable bitwidth per super-group, non-uniform levels, hierarchical scales, correlated rounding",
)
class DynamiQ(Codec):
    config_class = DynamiQConfig
    config: DynamiQConfig
    layout_preserving: ClassVar[bool] = False

    def __init__(self, config: CodecConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        #: key -> (numel, F) of the keyed calls of the step under way.
        self._step_stats: dict[int, tuple[int, torch.Tensor]] = {}
        #: key -> (numel, bits per coordinate) split from the previous step.
        self._shares: dict[int, tuple[int, float]] = {}
        #: device type -> kernel module (or None: the reference), resolved once.
        self._kernel_cache: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # modules neither pickle nor deep-copy: a copy resolves its kernels again
        return {**self.__dict__, "_kernel_cache": {}}

    def nonfinite_block(self) -> int:
        return self.config.supergroup_size  # the mean and the scale carry the poison

    # -- planning ----------------------------------------------------------
    def plan(self, x: torch.Tensor, stats: StatsExchange) -> DynamiQPlan:
        cfg = self.config
        S = cfg.supergroup_size
        d = x.numel()
        m = -(-d // S)
        kern = self._kernels(x.device)
        if kern is not None and hasattr(kern, "supergroup_stats"):  # the same bits, fused
            local_mean, sq = kern.supergroup_stats(x.reshape(-1).to(torch.float32), S)
        else:
            xs = self._padded(x, m)
            counts = torch.full((m,), float(S), device=xs.device)
            if m and d % S:
                counts[-1] = d % S
            local_mean = tree_sum(xs) / counts
            sq = tree_sum(xs.square())
            # F must stay > 0 whenever an entry is non-zero (the zero class is
            # lossless): squares of tiny entries underflow, so floor F at the
            # smallest normal.
            nonzero = xs.ne(0).any(1)
            sq = torch.where(nonzero & (sq == 0), torch.finfo(torch.float32).smallest_normal, sq)
        local = torch.stack([local_mean, sq]).to(torch.bfloat16)
        glob = stats.all_reduce(local, "sum").float()
        mu = glob[0] / stats.world_size
        F = glob[1]
        budget = self._budget_for(stats.key, d)
        F64 = F.cpu().double()
        widths = self._allocate(F64, d, budget)
        if stats.key is not None and cfg.share_budget:
            self._step_stats[stats.key] = (d, F64)
        order = sorted(range(m), key=lambda j: widths[j])  # stable: by width, then position
        sorted_widths = tuple(widths[j] for j in order)
        perm = torch.tensor(order, dtype=torch.int64, device=x.device)
        cost = {w: cfg.sg_bits(w) // 8 for w in set(sorted_widths)}
        sg_bytes = [cost[w] for w in sorted_widths]
        chunks_sg = self._split(sg_bytes, stats.n_chunks)
        segments = []
        for lo, hi in chunks_sg:
            segs = []
            off = 0
            k = lo
            while k < hi:
                w = sorted_widths[k]
                e = k
                while e < hi and sorted_widths[e] == w:
                    e += 1
                nb = sum(sg_bytes[k:e])
                segs.append(Segment(w, k, e, off, nb))
                off += nb
                k = e
            segments.append(tuple(segs))
        total_bits = 8 * sum(sg_bytes) + STATS_BITS * m
        return DynamiQPlan(
            numel=d,
            work_numel=m * S,
            chunks=tuple((lo * S, hi * S) for lo, hi in chunks_sg),
            payload_nbytes=tuple(sum(s.nbytes for s in segs) for segs in segments),
            supergroups=m,
            widths=sorted_widths,
            perm=perm,
            mu=mu,
            segments=tuple(segments),
            planned_bits=total_bits / d if d else 0.0,
            over_budget=bool(d) and total_bits > budget * d + 1e-9,
        )

    def _padded(self, x: torch.Tensor, m: int) -> torch.Tensor:
        S = self.config.supergroup_size
        flat = x.reshape(-1).to(torch.float32)
        if flat.numel() == m * S:
            return flat.view(m, S)
        out = flat.new_zeros(m * S)
        out[: flat.numel()] = flat
        return out.view(m, S)

    @staticmethod
    def _split(sg_bytes: list[int], n_chunks: int) -> list[tuple[int, int]]:
        """Cut the reordered super-groups into n_chunks runs of near-equal bytes."""
        m = len(sg_bytes)
        total = sum(sg_bytes)
        bounds = [0]
        acc = 0
        k = 0
        for c in range(1, n_chunks):
            target = total * c / n_chunks
            while k < m and acc + sg_bytes[k] / 2 <= target:
                acc += sg_bytes[k]
                k += 1
            bounds.append(k)
        bounds.append(m)
        return [(bounds[i], bounds[i + 1]) for i in range(n_chunks)]

    def _budget_for(self, key: int | None, d: int) -> float:
        """Bits per coordinate for this call. A keyed call whose key already ran
        in this step starts the next step: the finished step's statistics are
        split into per-key shares first (the same float64 arithmetic on the same
        all-reduced F on every rank, so every rank gets the same shares). A key
        without a share of its size (the first step, DDP's bucket rebuild) takes
        the configured budget."""
        cfg = self.config
        if key is None or not cfg.share_budget:
            return cfg.budget
        if key in self._step_stats:
            self._shares = self._split_budget(self._step_stats)
            self._step_stats = {}
        share = self._shares.get(key)
        return share[1] if share is not None and share[0] == d else cfg.budget

    def _split_budget(
        self, step: dict[int, tuple[int, torch.Tensor]]
    ) -> dict[int, tuple[int, float]]:
        """Per-key budgets that sum to ``budget`` over the step: one allocation over
        the super-groups of all keys; each key gets the bits (payload, scales,
        statistics) of its own super-groups, plus the allocation's leftover in
        proportion to its size."""
        cfg = self.config
        keys = [k for k in sorted(step) if step[k][0] > 0]
        total = sum(step[k][0] for k in keys)
        if not keys:
            return {}
        widths = self._allocate(torch.cat([step[k][1] for k in keys]), total, cfg.budget)
        per_width = {w: cfg.sg_bits(w) + STATS_BITS for w in (0, *cfg.widths)}
        sg_cost = torch.tensor([per_width[w] for w in widths], dtype=torch.float64)
        sizes = [step[k][1].numel() for k in keys]
        bits = [float(c.sum()) for c in torch.split(sg_cost, sizes)]
        slack = max(0.0, cfg.budget * total - sum(bits))
        return {
            k: (step[k][0], (b + slack * step[k][0] / total) / step[k][0])
            for k, b in zip(keys, bits, strict=True)
        }

    def _allocate(self, F: torch.Tensor, d: int, budget: float) -> list[int]:
        """Width per super-group (original order) for ``budget`` bits per coordinate,
        identical on every rank: pure float64 CPU arithmetic on the all-reduced F."""
        cfg = self.config
        m = F.numel()
        if m == 0:
            return []
        W = list(cfg.widths)
        budget_bits = budget * d - STATS_BITS * m
        F = torch.nan_to_num(F, nan=math.inf)
        zero = (F == 0) if cfg.zero_class else torch.zeros(m, dtype=torch.bool)
        live = ~zero
        cost = {w: cfg.sg_bits(w) for w in W}
        if cfg.allocation is Allocation.FIXED or len(W) == 1:
            n_live = int(live.sum())
            fit = [w for w in W if cost[w] * n_live <= budget_bits] or [W[0]]
            width = torch.full((m,), fit[-1], dtype=torch.int64)
        elif cfg.allocation is Allocation.HEURISTIC:
            width = self._heuristic(F, live, W, cost, budget_bits)
        else:
            width = self._exact(F, live, W, cost, budget_bits)
        width[zero] = 0
        return width.tolist()

    @staticmethod
    def _heuristic(
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

    @staticmethod
    def _exact(
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
            g = torch.cat(gains)
            order = torch.sort(-g, stable=True).indices
            csum = torch.cumsum(torch.cat(costs)[order], 0) + spent
            take = order[csum <= budget]
            own = torch.cat(owners)[take]
            lev = torch.cat(levels)[take]
            level.scatter_reduce_(0, own, lev, reduce="amax")
        return torch.tensor(W, dtype=torch.int64)[level]

    def prepare(self, plan: Plan, x: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        assert isinstance(plan, DynamiQPlan) and plan.perm is not None and plan.mu is not None
        m, S, d = plan.supergroups, self.config.supergroup_size, plan.numel
        kern = self._kernels(x.device)
        if kern is not None and hasattr(kern, "gather_rows") and x.dtype == torch.float32:
            return kern.gather_rows(x, plan.perm, plan.mu, S)
        xs = self._padded(x, m) - plan.mu[:, None]
        if d % S and m:
            xs[-1, d % S :] = 0  # padding stays exactly zero after the shift
        return xs.index_select(0, plan.perm).reshape(-1)

    def finish(self, plan: Plan, y: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
        assert isinstance(plan, DynamiQPlan) and plan.perm is not None and plan.mu is not None
        m, S = plan.supergroups, self.config.supergroup_size
        kern = self._kernels(y.device)
        if kern is not None and hasattr(kern, "scatter_rows"):
            return kern.scatter_rows(
                y, plan.perm, plan.mu, S, world_size, op is ReduceOp.AVG, plan.numel
            )
        out = torch.empty_like(y).view(m, S)
        out.index_copy_(0, plan.perm, y.view(m, S))
        if op is ReduceOp.AVG:
            out.div_(world_size).add_(plan.mu[:, None])
        else:
            out.add_(plan.mu[:, None] * world_size)
        return out.reshape(-1)[: plan.numel]

    # -- quantization ------------------------------------------------------
    def _streams(self, ctx: HopContext) -> Streams:
        """The random streams of one encoding (module docstring): keys and the
        correlated-rounding class (peers = 1: independent rounding)."""
        if self.config.rounding is Rounding.PATH:
            n, me, cls = ctx.world_size, ctx.hop, 0
        else:
            n, me, cls = ctx.peers, ctx.peer, ctx.depth + 1
        if self.config.rounding is Rounding.INDEPENDENT:
            n, me = 1, 0
        return Streams(
            gamma_key=stream_key(ctx.seed, ctx.round, ctx.chunk, TAG_GAMMA << 16 | ctx.hop),
            perm_key=stream_key(ctx.seed, ctx.round, ctx.chunk, TAG_PERM << 16 | cls),
            peers=n,
            peer=me,
            units=tuple(_units(n)),
            scale_key=stream_key(ctx.seed, ctx.round, ctx.chunk, TAG_SCALE << 16 | ctx.hop),
        )

    def _uniforms(
        self, plan: DynamiQPlan, ctx: HopContext, start: int, count: int, device: torch.device
    ) -> torch.Tensor:
        """u for the entries [start, start + count) of the working vector."""
        st = self._streams(ctx)
        gamma = uniform(count, st.gamma_key, offset=start, device=device)
        n, me = st.peers, st.peer
        if n == 1:
            return gamma
        idx = torch.arange(start, start + count, dtype=torch.int64, device=device)
        # pi: an affine permutation (mult * i + shift) mod n with mult a unit mod n,
        # drawn per entry from a stream shared by the n correlated encoders.
        h = hash32(idx, st.perm_key)
        units = torch.tensor(st.units, dtype=torch.int64, device=device)
        mult = units[(h >> 16) % units.numel()]
        shift = (h & 0xFFFF) % n
        pi = (mult * me + shift) % n
        return (pi.to(torch.float32) + gamma) / float(n)

    # -- backends ----------------------------------------------------------
    def _kernels(self, device: torch.device) -> Any:
        """The kernel module that runs this device's segments, or None for the
        reference (see :class:`Backend`); resolved once per device type (it is
        asked on every encode and decode)."""
        if device.type not in self._kernel_cache:
            self._kernel_cache[device.type] = _kernel_module(self.config, device.type)
        return self._kernel_cache[device.type]

    def _run_segment(
        self, kern, mode: int, sg: Segment, ctx: HopContext, **tensors: torch.Tensor | None
    ) -> None:
        cfg = self.config
        kern.run_segment(
            mode,
            sg.width,
            sg.hi - sg.lo,
            cfg.supergroup_size,
            cfg.group_size,
            sg.lo,
            eps=cfg.eps_for(sg.width),
            **tensors,
            **self._streams(ctx)._asdict(),
        )

    def _encode_rows(
        self, plan: DynamiQPlan, rows: torch.Tensor, w: int, first_row: int, ctx: HopContext
    ) -> list[torch.Tensor]:
        cfg = self.config
        S, s = cfg.supergroup_size, cfg.group_size
        k = rows.shape[0]
        dev = rows.device
        u = self._uniforms(plan, ctx, first_row * S, k * S, dev).view(k, S)
        if w == 16:
            bits = rows.contiguous().view(torch.int32).to(torch.int64)
            r16 = (u * 65536.0).to(torch.int64)  # the 16 random bits below bf16's mantissa
            up = ((bits + r16) >> 16).to(
                torch.int16
            )  # sign-magnitude: rounds |x| up w.p. its low bits
            return [_bf16_bytes(up.view(torch.bfloat16))]
        G = rows.view(k, S // s, s)
        gmax = G.abs().amax(-1)
        parts = []
        if cfg.scales is Scales.HIERARCHICAL:
            M_bf = round_up_bf16(gmax.amax(-1))
            Mf = M_bf.float()[:, None]
            g = torch.nan_to_num(
                torch.where(Mf > 0, gmax / Mf * 255.0, 0.0), nan=0.0, posinf=0.0, neginf=0.0
            )
            scale_key = stream_key(ctx.seed, ctx.round, ctx.chunk, TAG_SCALE << 16 | ctx.hop)
            us = uniform(k * (S // s), scale_key, offset=first_row * (S // s), device=dev)
            fl = torch.floor(g)
            rG = (
                (fl + (us.view(k, S // s) < g - fl).to(torch.float32))
                .clamp_(0, 255)
                .to(torch.uint8)
            )
            parts += [_bf16_bytes(M_bf), rG.reshape(-1)]
            norm = gmax
        else:
            sf = round_up_bf16(gmax)
            parts.append(_bf16_bytes(sf))
            norm = sf.float()
        y = torch.where(norm[..., None] > 0, G.abs() / norm[..., None], 0.0)
        table = level_table(w, cfg.eps_for(w), dev)
        level = stochastic_level(y.reshape(k, S), table, u)
        code = (level | ((rows < 0).to(torch.int64) << (w - 1))).to(torch.uint8)
        parts.append(pack_bits(code.reshape(-1), w))
        return parts

    def _decode_rows(self, seg_bytes: torch.Tensor, w: int, k: int) -> torch.Tensor:
        cfg = self.config
        S, s = cfg.supergroup_size, cfg.group_size
        if w == 0:
            return torch.zeros(k, S, device=seg_bytes.device)
        if w == 16:
            return seg_bytes.clone().view(torch.bfloat16).float().view(k, S)
        ng = S // s
        if cfg.scales is Scales.HIERARCHICAL:
            M = seg_bytes[: 2 * k].clone().view(torch.bfloat16).float()
            rG = seg_bytes[2 * k : 2 * k + k * ng].float().view(k, ng)
            sf = rG * M[:, None] / 255.0
            codes_at = 2 * k + k * ng
        else:
            sf = seg_bytes[: 2 * k * ng].clone().view(torch.bfloat16).float().view(k, ng)
            codes_at = 2 * k * ng
        code = unpack_bits(seg_bytes[codes_at:], w, k * S).to(torch.int64)
        top = 1 << (w - 1)
        table = level_table(w, cfg.eps_for(w), seg_bytes.device)
        mag = table[code & (top - 1)].view(k, ng, s) * sf[..., None]
        return torch.where((code >= top).view(k, ng, s), -mag, mag).view(k, S)

    def _segments(
        self, plan: Plan, ctx: HopContext
    ) -> tuple[DynamiQPlan, tuple[Segment, ...], int]:
        assert isinstance(plan, DynamiQPlan)
        segs = plan.segments[ctx.chunk]
        lo = segs[0].lo if segs else 0
        return plan, segs, lo

    def encode(self, plan: Plan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        kern = self._kernels(chunk.device)
        if kern is None:
            return self._encode_reference(plan, chunk, ctx)
        return self._kernel_encode(kern, plan, None, chunk, ctx)

    def _kernel_encode(
        self, kern, plan: Plan, payload: torch.Tensor | None, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        """ENCODE (payload None) or the fused DAR through a kernel module."""
        p, segs, lo = self._segments(plan, ctx)
        S = self.config.supergroup_size
        out = torch.empty(p.payload_nbytes[ctx.chunk], dtype=torch.uint8, device=local.device)
        if payload is not None:
            check_payload(
                payload, p.payload_nbytes[ctx.chunk], f"dynamiq chunk {ctx.chunk} payload"
            )
        for sg in segs:
            if sg.width == 0:
                continue
            a, b = (sg.lo - lo) * S, (sg.hi - lo) * S
            self._run_segment(
                kern,
                kern.ENCODE if payload is None else kern.DAR,
                sg,
                ctx,
                payload=None if payload is None else payload[sg.offset : sg.offset + sg.nbytes],
                local=local[a:b],
                out_rows=None,
                out_payload=out[sg.offset : sg.offset + sg.nbytes],
            )
        return out

    def _kernel_decode(
        self, kern, mode: int, plan: Plan, payload: torch.Tensor, out: torch.Tensor, ctx: HopContext
    ) -> None:
        p, segs, lo = self._segments(plan, ctx)
        check_payload(payload, p.payload_nbytes[ctx.chunk], f"dynamiq chunk {ctx.chunk} payload")
        S = self.config.supergroup_size
        for sg in segs:
            a, b = (sg.lo - lo) * S, (sg.hi - lo) * S
            if sg.width == 0:
                if mode == kern.DECODE:
                    out[a:b] = 0
                continue
            self._run_segment(
                kern,
                mode,
                sg,
                ctx,
                payload=payload[sg.offset : sg.offset + sg.nbytes],
                local=out[a:b] if mode == kern.DECODE_ACC else None,
                out_rows=out[a:b],
                out_payload=None,
            )

    def decode(self, plan: Plan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor) -> None:
        kern = self._kernels(out.device)
        if kern is None:
            self._decode_reference(plan, payload, ctx, out)
        else:
            self._kernel_decode(kern, kern.DECODE, plan, payload, out, ctx)

    def decode_accumulate(
        self, plan: Plan, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        kern = self._kernels(acc.device)
        if kern is None:
            super().decode_accumulate(plan, payload, acc, ctx)
        else:
            self._kernel_decode(kern, kern.DECODE_ACC, plan, payload, acc, ctx)

    def decode_accumulate_encode(
        self, plan: Plan, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        kern = self._kernels(local.device)
        if kern is None:
            return super().decode_accumulate_encode(plan, payload, local, ctx)
        return self._kernel_encode(kern, plan, payload, local, ctx)

    # -- the reference -----------------------------------------------------
    def _encode_reference(self, plan: Plan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        p, segs, lo = self._segments(plan, ctx)
        S = self.config.supergroup_size
        rows = chunk.view(-1, S)
        parts: list[torch.Tensor] = []
        for sg in segs:
            if sg.width == 0:
                continue
            parts += self._encode_rows(p, rows[sg.lo - lo : sg.hi - lo], sg.width, sg.lo, ctx)
        if not parts:
            return torch.empty(0, dtype=torch.uint8, device=chunk.device)
        out = torch.cat(parts)
        if out.numel() != p.payload_nbytes[ctx.chunk]:
            raise AssertionError("dynamiq: encoded size differs from the plan")
        return out

    def _decode_reference(
        self, plan: Plan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor
    ) -> None:
        p, segs, lo = self._segments(plan, ctx)
        check_payload(payload, p.payload_nbytes[ctx.chunk], f"dynamiq chunk {ctx.chunk} payload")
        S = self.config.supergroup_size
        rows = out.view(-1, S)
        for sg in segs:
            data = payload[sg.offset : sg.offset + sg.nbytes]
            if data.numel() != sg.nbytes:
                raise PayloadError("dynamiq: truncated segment")
            rows[sg.lo - lo : sg.hi - lo] = self._decode_rows(data, sg.width, sg.hi - sg.lo)

    def state_dict(self) -> dict[str, object]:
        return {"round": self.round}
