"""Global-QSGD ("Quantize Once, Train Fast", Xin, Canini, Richtárik, Horváth;
the paper text names no arXiv id or venue):
one global scale per call, stochastic rounding, and partial sums that stay in
the code domain at every hop.

Both codecs agree on one scalar per call, N = max over ranks and coordinates of
|x| (a MAX in the statistics exchange, section 4.1 with p = q = inf), and
quantize each rank's vector once, stochastically (Eq. 2), with a counter-based
hash RNG keyed by (seed, round, rank, element).

``gqsgd-linear`` (linear dithering, section 4.2): x / N * L rounds to an integer
in [-L, L]; integer partial sums are added exactly at every hop. The lane width
b and the per-rank levels L are chosen so that no sum of n ranks can leave a
b-bit lane: n L <= 2^(b-1) - 1. The nominal width ``bits`` (8 or 4) is kept while
at least ``min_levels`` per-rank levels fit, i.e. L = min(2^(bits-1) - 1,
floor((2^(b-1) - 1) / n)): the headroom for the sum comes out of the levels
(log2 n bits of them, the paper's choice). Once fewer than ``min_levels`` remain,
the lane widens (8, then 16 bits) and L returns to 2^(bits-1) - 1. A sum can
never overflow at any world size (the public implementation overflows int8 at
n = 4 and clamps its 4-bit sums); a received sum beyond what the ranks can add
up to is a corrupt payload (PayloadError).

The ranks exchange their own maxima M_i (an all-gather of one float64 each,
riding with the agreement like the paper's MAX), and N = max M_i. When the M_i
differ, n L is a loose bound: rank i's integers never exceed ceil(M_i m), so
:func:`linear_scale` takes the largest common multiplier m (at least L / N)
whose caps ceil(M_i m) still sum to at most the lane's 2^(b-1) - 1. With equal
maxima that is L / N to the bit; on the GPT's gradients (4 workers, after 0,
30 and 100 steps) the largest rank got 42.8, 46.0 and 36.3 levels instead of 31.

``gqsgd-exp`` (exponential, "natural" dithering, sections 4.2-4.3): leaf values
v = x / N * 2^-c in [0, 2^-c] round to a neighbouring power of two, or below
2^-127 to 0 or 2^-127 (unbiased: the last level is 0, Def. 1). A code is one
byte, bit 7 the sign and bits 0-6 the exponent e in [1, 127] (value 2^-e), 0 for
zero. Partial sums are combined code with code by the exponential reduce
(Algorithm 2, :func:`exp_reduce`), which rounds the exact sum of two powers of
two stochastically to a neighbouring power of two without decoding.

The scale c = 1 + D, D the schedule's most combinations in a row
(``Schedule.reduce_depths``, told by the engine): each combination at most
doubles the larger magnitude, so a code at depth d (d combinations in a row
below it, tracked per part and carried in a one-byte payload header) is at most
2^(d - c), and the sink's, at depth <= D, at most 2^-1: every exponent stays
>= 1 on *any* schedule. On a power-of-two butterfly or tree D = log2 n and
2^-c is the paper's 1/(2n); a butterfly with a fold and a tree of any n have
D = ceil(log2 n) (the paper's "round the shift up"); a ring has D = n - 1
(and so has the direct schedule, whose sink combines its n - 1 senders in turn),
which is the scaling that provably avoids the overshoot of the ring's running
sum (NOTES 5) at a cost of n - 1 - ceil(log2 n) exponents at the bottom and a
variance growing as (9/8)^(n-1). Schedules with D + 1 > :data:`MAX_CHAIN`
(rings and direct schedules beyond 64 ranks) are refused in the plan: fewer than 63 exponents
would remain. A payload's header and magnitudes are checked against D.

Non-finite input poisons the global scale, hence the whole vector (like THC).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

import torch

from hopq.codecs.base import (
    Codec,
    CodecConfig,
    HopContext,
    Plan,
    ReduceOp,
    StatsExchange,
    StatsOp,
    check_payload,
    plan_chunks,
)
from hopq.codecs.gqsgd.protocol import GQSGDExpKernels
from hopq.codecs.registry import register
from hopq.codecs.uncompressed import working_copy
from hopq.errors import PayloadError
from hopq.kernels import CpuBackend, resolve
from hopq.numerics.bitpack import pack_bits, packed_nbytes, sign_extend, unpack_bits
from hopq.numerics.div import div
from hopq.numerics.fp_formats import keep_finite
from hopq.numerics.rng import hash32, stream_key, uniform
from hopq.options import check_int, check_options, option

#: Stream coordinates (chunk field of stream_key; distinct from real chunks).
LINEAR_STREAM, EXP_STREAM = 0xFFFF3, 0xFFFF4
#: Reduce streams: chunk field REDUCE_STREAM + schedule chunk * 128 + depth.
REDUCE_STREAM = 0x100000
#: Integer lanes of gqsgd-linear: float32 holds their sums exactly.
LANES = (4, 8, 16)
#: Exponent codes: 7 bits, 1..127 (0 is zero).
EMAX = 127
#: Largest c = 1 + D gqsgd-exp accepts: its leaves then keep at least
#: 127 - 64 = 63 exponents (relative range 2^-63 below the largest entry).
MAX_CHAIN = 64
_FLOAT_MAX = float(torch.finfo(torch.float32).max)


def linear_layout(bits: int, min_levels: int, n: int) -> tuple[int, int]:
    """(lane width, per-rank levels L) of gqsgd-linear for n ranks: the nominal
    width while at least ``min_levels`` levels fit under n L <= 2^(b-1) - 1,
    else the narrowest wider lane where they do."""
    nominal = (1 << (bits - 1)) - 1
    for lane in LANES:
        if lane < bits:
            continue
        levels = min(nominal, ((1 << (lane - 1)) - 1) // n)
        if levels >= max(1, min_levels):
            return lane, levels
    raise ValueError(
        f"gqsgd-linear: {n} ranks with {min_levels} levels each need lanes wider than "
        f"{LANES[-1]} bits (float32 sums are exact only up to 2^24)"
    )


def _local_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| of this rank as a float64 tensor of one element (NaN propagates)."""
    if x.numel():
        # max(|min|, |max|): one pass and no temporary (abs().amax() and an isnan
        # check took 6.7x as long on 4M coordinates); NaN propagates through both
        lo, hi = torch.aminmax(x.reshape(-1))
        return torch.maximum(lo.abs(), hi.abs()).double().reshape(1)
    return torch.zeros(1, dtype=torch.float64, device=x.device)


def global_max(x: torch.Tensor, stats: StatsExchange) -> float:
    """N = max |x| over every rank and coordinate (NaN/Inf propagate)."""
    return float(stats.all_reduce(_local_max(x), StatsOp.MAX).item())


@dataclass(frozen=True)
class LinearScale:
    """gqsgd-linear's agreed quantization: integers round(x * factor), rank i's
    clamped to +-caps[i], decoded as sum * step; ``limit`` = sum(caps) fits the lane."""

    factor: float
    step: float
    caps: tuple[int, ...]

    @property
    def limit(self) -> int:
        return sum(self.caps)


def linear_scale(maxima: list[float], bits: int, lane: int, levels: int) -> LinearScale:
    """The finest common step whose integer sums cannot leave the lane, from every
    rank's max |x| (``maxima``: finite, not all zero), computed in exact rationals
    so that every rank gets the same bits.

    Rank i's integers stay within K_i = ceil(M_i m) for a multiplier m; the sum of
    all ranks' within sum_i K_i, which must not exceed the lane's C = 2^(b-1) - 1,
    and no K_i may exceed the nominal 2^(bits-1) - 1. The plain rule, m = L / N
    with L = ``levels`` = min(nominal, floor(C / n)) for every rank (N the
    largest M_i), meets that whatever the maxima. When they differ, ranks with
    smaller maxima need fewer levels and m can grow: from max(L / N, (C - n) /
    sum M) (both feasible, since ceil(v) < v + 1), the ranks that set m (the
    smallest K_i / M_i) get one more level each while the lane has room for all
    of them. Never coarser than the plain rule, and equal to it, to the bit,
    when all maxima are equal."""
    C = (1 << (lane - 1)) - 1
    P = (1 << (bits - 1)) - 1
    M = [Fraction(v) for v in maxima]
    N = max(M)
    pos = [i for i, v in enumerate(M) if v > 0]
    m = min(max(Fraction(levels) / N, Fraction(C - len(pos)) / sum(M)), Fraction(P) / N)
    K = [math.ceil(v * m) for v in M]
    total = sum(K)
    heap = [(Fraction(K[i]) / M[i], i) for i in pos]
    heapq.heapify(heap)
    while True:
        low = heap[0][0]
        tied = []
        while heap and heap[0][0] == low:
            tied.append(heapq.heappop(heap)[1])
        if total + len(tied) > C or any(K[i] + 1 > P for i in tied):
            for i in tied:
                heapq.heappush(heap, (low, i))
            break
        for i in tied:
            K[i] += 1
            heapq.heappush(heap, (Fraction(K[i]) / M[i], i))
        total += len(tied)
    m = heap[0][0]
    return LinearScale(factor=float(m), step=float(1 / m), caps=tuple(K))


def _nan(plan: Plan, device: torch.device) -> torch.Tensor:
    return torch.full((plan.numel,), float("nan"), device=device)


class _PartwiseFinish:
    """Both Global-QSGD codecs: a part becomes values as soon as it is final on
    this rank (:meth:`Codec.finish_part`, overlapping the transfers of the
    others); ``finish`` does the parts left. The codec's ``_values`` turns codes
    into values; its plan records the parts done."""

    def _values(
        self,
        plan: Any,
        y: torch.Tensor,
        op: ReduceOp,
        world_size: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def finish_part(
        self, plan: Any, work: torch.Tensor, part: int, op: ReduceOp, world_size: int
    ) -> None:
        N = plan.scale
        if not math.isfinite(N) or N == 0 or part in plan.finished:
            return  # finish() gives NaN or zeros everywhere
        s, e = plan.chunks[part]
        v = work[s:e]
        self._values(plan, v, op, world_size, out=v)
        plan.finished.add(part)

    def finish(self, plan: Any, y: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
        N = plan.scale
        if not math.isfinite(N):
            return _nan(plan, y.device)
        if N == 0:
            return torch.zeros(plan.numel, dtype=torch.float32, device=y.device)
        if not plan.finished:
            return self._values(plan, y, op, world_size)
        for m in range(len(plan.chunks)):  # the parts the engine did not finish yet
            self.finish_part(plan, y, m, op, world_size)
        return y


#: auto: the numba kernels (:mod:`hopq.codecs.gqsgd.kernels_cpu`) when numba is installed.
Backend = CpuBackend


def _kernels(codec: str, backend: Backend, device: torch.device) -> GQSGDExpKernels | None:
    """The kernel module for tensors on ``device``, or None for the reference."""
    module: GQSGDExpKernels | None = resolve(codec, backend.value, device.type)
    return module


# ---------------------------------------------------------------------------
# linear dithering
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GQSGDLinearConfig(CodecConfig):
    bits: int = option(8, "nominal bits per coordinate on the wire", choices=(8, 4))
    min_levels: int = option(
        1, "fewest per-rank levels before the integer lane widens (8, then 16 bits)", lo=1
    )
    backend: Backend = option(
        Backend.AUTO,
        "implementation of the quantization, hop and decode (same bits)",
        choices=Backend,
    )

    def __post_init__(self) -> None:
        check_options(self, "gqsgd-linear")
        check_int("gqsgd-linear: min_levels", self.min_levels, lo=1, hi=(1 << (self.bits - 1)) - 1)


@dataclass
class GQSGDLinearPlan(Plan):
    scale: float  # N (may be NaN/Inf: finish() then poisons everything)
    lane_bits: int
    #: This rank's integers are round(x * factor), within +-levels ...
    levels: int
    #: ... every rank's sum to at most limit, decoded as sum * step.
    limit: int
    factor: float
    step: float
    world_size: int
    seed: int
    round: int
    rank: int
    #: Parts already turned into values by :meth:`GQSGDLinear.finish_part`.
    finished: set[int] = field(default_factory=set)


@register(
    "gqsgd-linear",
    "Global-QSGD linear dithering: global max scale, stochastic integers summed exactly in the code domain",
)
class GQSGDLinear(_PartwiseFinish, Codec[GQSGDLinearPlan]):
    config_class = GQSGDLinearConfig
    config: GQSGDLinearConfig
    layout_preserving: ClassVar[bool] = True
    chunk_local: ClassVar[bool] = True
    first_stats_nbytes: ClassVar[int | None] = 8
    plans_ahead: ClassVar[bool] = True

    def nonfinite_block(self) -> int:
        return 1 << 62  # the global scale carries the poison everywhere

    def plan(self, x: torch.Tensor, stats: StatsExchange) -> GQSGDLinearPlan:
        cfg = self.config
        n = stats.world_size
        lane, L = linear_layout(cfg.bits, cfg.min_levels, n)
        # every rank's max |x| (riding with the agreement): their max N is the
        # paper's global scale, and their spread lets the lane hold more levels
        maxima = stats.all_gather(_local_max(x)).reshape(-1).tolist()
        N = float(torch.tensor(maxima, dtype=torch.float64).max())  # NaN/Inf propagate
        if math.isfinite(N) and N > 0:
            sc = linear_scale(maxima, cfg.bits, lane, L)
            caps, factor, step = sc.caps, sc.factor, sc.step
        else:  # prepare gives zeros, finish poisons (or zeros) everything
            caps, factor, step = (L,) * n, 0.0, 0.0
        d = x.numel()
        chunks = plan_chunks(d, stats, align=2)
        return GQSGDLinearPlan(
            numel=d,
            work_numel=d,
            chunks=chunks,
            payload_nbytes=tuple(packed_nbytes(e - s, lane) for s, e in chunks),
            scale=N,
            lane_bits=lane,
            levels=caps[stats.rank],
            limit=sum(caps),
            factor=factor,
            step=step,
            world_size=n,
            seed=stats.seed,
            round=stats.round,
            rank=stats.rank,
        )

    def prepare(
        self, plan: GQSGDLinearPlan, x: torch.Tensor, overwrite: bool = False
    ) -> torch.Tensor:
        """This rank's values as float32; :meth:`prepare_part` turns each part into
        its integers when the engine first needs it, so that the rounding of one
        part overlaps the transfer of the ones before it."""
        if not math.isfinite(plan.scale) or plan.scale == 0 or not plan.numel:
            return torch.zeros(plan.numel, dtype=torch.float32, device=x.device)
        return working_copy(x, overwrite)

    def prepare_part(self, plan: GQSGDLinearPlan, work: torch.Tensor, part: int) -> None:
        """Part ``part`` of ``work`` in place: its integers in [-L, L] (as float32),
        stochastic rounding of x / N * L with the uniforms of its element indices."""
        N = plan.scale
        if not math.isfinite(N) or N == 0:
            return  # prepare gave zeros
        s, e = plan.chunks[part]
        v = work[s:e]
        key = stream_key(plan.seed, plan.round, LINEAR_STREAM, plan.rank)
        k = _kernels("gqsgd-linear", self.config.backend, work.device)
        if k is not None and v.is_contiguous():
            k.linear_quantize(v, plan.factor, plan.levels, key, start=s, out=v)
            return
        d = v.double() * plan.factor
        u = uniform(d.numel(), key, offset=s, device=work.device)
        lo = torch.floor(d)
        q = lo + (u.double() < d - lo).double()
        v.copy_(q.clamp_(-plan.levels, plan.levels))

    def _limit(self, plan: GQSGDLinearPlan) -> int:
        return plan.limit  # what the n ranks can sum to

    def encode(self, plan: GQSGDLinearPlan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        b = plan.lane_bits
        if b == 8:  # exact integers in [-127, 127]
            return chunk.to(torch.int8).view(torch.uint8)
        k = _kernels("gqsgd-linear", self.config.backend, chunk.device)
        if k is not None and chunk.is_contiguous() and chunk.dtype == torch.float32:
            return k.linear_pack(chunk, b)
        i = chunk.to(torch.int64)
        if b == 4:
            return pack_bits((i & 0xF).to(torch.uint8), 4)
        return pack_bits(i, 16)

    def _unpack(self, plan: GQSGDLinearPlan, payload: torch.Tensor, n: int, c: int) -> torch.Tensor:
        check_payload(payload, plan.payload_nbytes[c], f"gqsgd-linear chunk {c} payload")
        b = plan.lane_bits
        k = _kernels("gqsgd-linear", self.config.backend, payload.device)
        if k is not None:
            v = torch.empty(n, dtype=torch.float32)
            if k.linear_unpack(payload, b, self._limit(plan), v):
                self._beyond(plan, c)
            return v
        if b == 8:
            v = payload.view(torch.int8).to(torch.float32)
        elif b == 4:
            v = sign_extend(unpack_bits(payload, 4, n).to(torch.int64), 4).to(torch.float32)
        else:
            v = sign_extend(unpack_bits(payload, 16, n).to(torch.int64), 16).to(torch.float32)
        if n and float(v.abs().max()) > self._limit(plan):
            self._beyond(plan, c)
        return v

    def _beyond(self, plan: GQSGDLinearPlan, c: int) -> None:
        """A received lane or a sum beyond what the ranks' caps can add up to."""
        raise PayloadError(
            f"gqsgd-linear chunk {c}: a partial sum beyond {self._limit(plan)}, more "
            f"than the {plan.world_size} ranks' levels can add up to "
            "(a corrupt payload, or a contribution counted twice)"
        )

    def decode(
        self, plan: GQSGDLinearPlan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor
    ) -> None:
        out.copy_(self._unpack(plan, payload, out.numel(), ctx.chunk))

    def _hop(
        self,
        plan: GQSGDLinearPlan,
        payload: torch.Tensor,
        acc: torch.Tensor,
        ctx: HopContext,
        encode: bool,
    ) -> torch.Tensor | None:
        """The numba hop on the plan's lanes, or None (the caller runs the reference)."""
        k = _kernels("gqsgd-linear", self.config.backend, acc.device)
        if k is None or not acc.is_contiguous():
            return None
        check_payload(
            payload, plan.payload_nbytes[ctx.chunk], f"gqsgd-linear chunk {ctx.chunk} payload"
        )
        out = torch.empty_like(payload) if encode else None
        if k.linear_hop(acc, payload, plan.lane_bits, self._limit(plan), out):
            self._beyond(plan, ctx.chunk)
        return out if out is not None else payload

    def decode_accumulate_encode(
        self, plan: GQSGDLinearPlan, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        out = self._hop(plan, payload, local, ctx, encode=True)
        if out is not None:
            return out
        self.decode_accumulate(plan, payload, local, ctx)
        return self.encode(plan, local, ctx)

    def decode_accumulate(
        self, plan: GQSGDLinearPlan, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        if self._hop(plan, payload, acc, ctx, encode=False) is not None:
            return
        acc.add_(self._unpack(plan, payload, acc.numel(), ctx.chunk))  # exact integers
        if acc.numel() and float(acc.abs().max()) > self._limit(plan):
            self._beyond(plan, ctx.chunk)

    def _values(
        self,
        plan: GQSGDLinearPlan,
        y: torch.Tensor,
        op: ReduceOp,
        world_size: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The integer sums ``y`` as values (``step`` each, averaged for AVG), into
        ``out`` when given (may be ``y``)."""
        k = _kernels("gqsgd-linear", self.config.backend, y.device)
        if k is not None and y.dtype == torch.float32 and y.is_contiguous():
            n = world_size if op is ReduceOp.AVG else 1
            return k.linear_finish(y, plan.step, n, _FLOAT_MAX, out=out)
        v = y.double() * plan.step
        if op is ReduceOp.AVG:
            v = div(v, world_size)
        r = keep_finite(v.to(torch.float32), v, _FLOAT_MAX)
        return r if out is None else out.copy_(r)


# ---------------------------------------------------------------------------
# exponential dithering and the exponential reduce
# ---------------------------------------------------------------------------
def exp_quantize(t: torch.Tensor, u: torch.Tensor, chain: int) -> torch.Tensor:
    """Natural dithering of magnitudes t = |x| / N in [0, 1] (float64) scaled by
    2^-chain: the exponent e >= chain (int32) of 2^-e, 0 for zero. ``u`` are
    uniforms in [0, 1). Between two powers of two it rounds up with probability
    (v - lo) / (hi - lo); below 2^-127 it rounds to 2^-127 or 0."""
    m, E = torch.frexp(t)  # t = m 2^E, m in [0.5, 1)
    E = E.to(torch.int32)
    e_hi = chain - E  # v in [2^-(e_hi + 1), 2^-e_hi)
    ud = u.double()
    up = ud < 2.0 * m - 1.0
    e = torch.where(up, e_hi, e_hi + 1)
    bottom = e_hi >= EMAX  # v < 2^-127: levels 0 and 2^-127
    p_bottom = torch.ldexp(t, torch.tensor(EMAX - chain, dtype=torch.float64, device=t.device))
    e = torch.where(bottom, torch.where(ud < p_bottom, EMAX, 0), e)
    return torch.where(t > 0, e, 0).to(torch.int32)


def exp_reduce(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Algorithm 2: combine signed exponent codes a, b (int32, value sign 2^-|c|,
    0 for zero) into a code of their sum, rounded stochastically to a
    neighbouring power of two, unbiased; ``h`` are uint32 hashes (int64).

    With e1 <= e2 the larger magnitude's exponent and diff = e2 - e1: same signs
    give 2^-(e1-1) with probability 2^-diff, else 2^-e1; opposite signs give 0
    if diff = 0, else 2^-(e1+1) with probability 2^-(diff-1), else 2^-e1 (with
    the larger one's sign). An event of probability 2^-j is "h < 2^32 >> j": exact
    up to j = 32 (diff > 32: the smaller operand, below 2^-32 of the larger,
    is dropped). Symmetric in (a, b), so whoever computes it gets the same bytes."""
    ea, eb = a.abs(), b.abs()
    za, zb = ea == 0, eb == 0
    a_big = ~za & (zb | (ea <= eb))
    eh = torch.where(a_big, ea, eb)
    el = torch.where(a_big, eb, ea)
    sh = torch.where(a_big, torch.sign(a), torch.sign(b))
    same = (a > 0) == (b > 0)
    diff = el - eh
    j = torch.where(same, diff, diff - 1).clamp(0, 33).to(torch.int64)
    ev = (h < torch.bitwise_right_shift(torch.full_like(j, 1 << 32), j)).to(torch.int32)
    e_res = torch.where(same, eh - ev, eh + ev)
    res = torch.where(~same & (diff == 0), 0, sh * e_res)
    return torch.where(za | zb, a + b, res).to(torch.int32)


def codes_to_bytes(c: torch.Tensor) -> torch.Tensor:
    """Signed exponent codes -> bytes: bit 7 the sign, bits 0-6 the exponent."""
    return (c.abs() | ((c < 0).to(c.dtype) << 7)).to(torch.uint8)


def bytes_to_codes(p: torch.Tensor) -> torch.Tensor:
    v = p.to(torch.int32)
    e = v & 0x7F
    return torch.where(v >= 0x80, -e, e)


@dataclass(frozen=True)
class GQSGDExpConfig(CodecConfig):
    """8 bits, sign + 7-bit exponent (the paper's E 8-bit)."""

    backend: Backend = option(
        Backend.AUTO,
        "implementation of the leaf quantization and the exponential reduce (same bits)",
        choices=Backend,
    )

    def __post_init__(self) -> None:
        check_options(self, "gqsgd-exp")


@dataclass
class GQSGDExpPlan(Plan):
    scale: float  # N
    chain: int  # c = 1 + D: leaves scaled by 2^-c
    world_size: int
    seed: int
    round: int
    rank: int
    #: Rank-local: per part, the depth of the codes in the working vector.
    depth: dict[int, int] = field(default_factory=dict)
    #: Parts already turned into values by :meth:`GQSGDExp.finish_part`.
    finished: set[int] = field(default_factory=set)


def _chain(stats: StatsExchange) -> int:
    """c = 1 + the schedule's most combinations in a row (the engine tells it as
    ``reduce_depth``); without it, the bound every schedule keeps: each
    combination adds at least one rank's contribution, so at most n - 1."""
    d = getattr(stats, "reduce_depth", None)
    return 1 + (int(d) if d is not None else max(0, stats.world_size - 1))


@register(
    "gqsgd-exp",
    "Global-QSGD exponential dithering: sign + 7-bit exponent, combined by the exponential reduce (Alg. 2)",
)
class GQSGDExp(_PartwiseFinish, Codec[GQSGDExpPlan]):
    config_class = GQSGDExpConfig
    config: GQSGDExpConfig
    layout_preserving: ClassVar[bool] = True
    chunk_local: ClassVar[bool] = True
    first_stats_nbytes: ClassVar[int | None] = 8
    plans_ahead: ClassVar[bool] = True

    def nonfinite_block(self) -> int:
        return 1 << 62

    def kernels(self, device: torch.device) -> GQSGDExpKernels | None:
        """The kernel module for tensors on ``device``, or None for the reference."""
        return _kernels("gqsgd-exp", self.config.backend, device)

    def plan(self, x: torch.Tensor, stats: StatsExchange) -> GQSGDExpPlan:
        chain = _chain(stats)
        if chain > MAX_CHAIN:
            raise ValueError(
                f"gqsgd-exp: a schedule with {chain - 1} combinations in a row (a ring or "
                f"direct schedule of {stats.world_size} ranks?) would leave fewer than "
                f"{EMAX - MAX_CHAIN} of "
                "its 127 exponents; use the butterfly or tree topology"
            )
        N = global_max(x, stats)
        d = x.numel()
        chunks = plan_chunks(d, stats)
        return GQSGDExpPlan(
            numel=d,
            work_numel=d,
            chunks=chunks,
            payload_nbytes=tuple(1 + e - s for s, e in chunks),
            scale=N,
            chain=chain,
            world_size=stats.world_size,
            seed=stats.seed,
            round=stats.round,
            rank=stats.rank,
        )

    def prepare(self, plan: GQSGDExpPlan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        """This rank's values as float32; :meth:`prepare_part` turns each part into
        its leaf codes when the engine first needs it (overlapping the transfers)."""
        N = plan.scale
        plan.depth.clear()
        if not math.isfinite(N) or N == 0 or not plan.numel:
            return torch.zeros(plan.numel, dtype=torch.float32, device=x.device)
        return working_copy(x, overwrite)

    def prepare_part(self, plan: GQSGDExpPlan, work: torch.Tensor, part: int) -> None:
        """Part ``part`` of ``work`` in place: its leaf codes (signed exponents, as
        float32), with the uniforms of its element indices."""
        N = plan.scale
        if not math.isfinite(N) or N == 0:
            return  # prepare gave zeros
        s, e = plan.chunks[part]
        v = work[s:e]
        key = stream_key(plan.seed, plan.round, EXP_STREAM, plan.rank)
        k = self.kernels(work.device)
        if k is not None and v.is_contiguous():
            k.exp_quantize(v, N, plan.chain, key, start=s, out=v)
            return
        flat = v.double()
        u = uniform(flat.numel(), key, offset=s, device=work.device)
        codes = exp_quantize(flat.abs() / N, u, plan.chain)
        v.copy_(torch.where(flat < 0, -codes, codes))

    def _parse(self, plan: GQSGDExpPlan, payload: torch.Tensor, c: int) -> tuple[int, torch.Tensor]:
        check_payload(payload, plan.payload_nbytes[c], f"gqsgd-exp chunk {c} payload")
        depth = int(payload[0])
        if depth >= plan.chain:
            raise PayloadError(
                f"gqsgd-exp chunk {c}: payload of depth {depth}; this schedule combines "
                f"at most {plan.chain - 1} times in a row"
            )
        body = payload[1:]
        if bool((body == 0x80).any()):
            raise PayloadError(f"gqsgd-exp chunk {c}: a negative zero code")
        codes = bytes_to_codes(body)
        e = codes.abs()
        # a code at depth d is at most 2^(d - chain): its exponent >= chain - d
        if bool(((e > 0) & (e < plan.chain - depth)).any()):
            raise PayloadError(
                f"gqsgd-exp chunk {c}: an exponent below {plan.chain - depth}, larger than "
                f"a partial sum of depth {depth} can be"
            )
        return depth, codes

    def encode(self, plan: GQSGDExpPlan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        head = torch.tensor([plan.depth.get(ctx.chunk, 0)], dtype=torch.uint8, device=chunk.device)
        return torch.cat([head, codes_to_bytes(chunk.to(torch.int32))])

    def decode(
        self, plan: GQSGDExpPlan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor
    ) -> None:
        _, codes = self._parse(plan, payload, ctx.chunk)
        out.copy_(codes)

    def reduce_hashes(
        self, plan: GQSGDExpPlan, ctx: HopContext, depth: int, n: int, device: torch.device
    ) -> torch.Tensor:
        """The shared draw of one combination: keyed by (seed, round, schedule chunk,
        hop, depth of the result) and the global element index, all known to
        both partners and independent of the number of microshards."""
        start = plan.chunks[ctx.chunk][0]
        idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
        return hash32(idx, self.reduce_key(plan, ctx, depth))

    def reduce_key(self, plan: GQSGDExpPlan, ctx: HopContext, depth: int) -> tuple[int, int]:
        return stream_key(
            plan.seed, plan.round, REDUCE_STREAM + ctx.stream_chunk * 128 + depth, ctx.hop
        )

    def _combine(
        self,
        plan: GQSGDExpPlan,
        payload: torch.Tensor,
        acc: torch.Tensor,
        ctx: HopContext,
        encode: bool,
    ) -> torch.Tensor | None:
        """acc <- exp_reduce(acc, payload's codes); with ``encode``, the result's payload."""
        k = self.kernels(acc.device)
        if k is None or not acc.is_contiguous():
            dp, codes = self._parse(plan, payload, ctx.chunk)
            depth = self._depth(plan, ctx, dp)
            h = self.reduce_hashes(plan, ctx, depth, acc.numel(), acc.device)
            acc.copy_(exp_reduce(acc.to(torch.int32), codes, h))
            plan.depth[ctx.chunk] = depth
            return self.encode(plan, acc, ctx) if encode else None
        check_payload(
            payload, plan.payload_nbytes[ctx.chunk], f"gqsgd-exp chunk {ctx.chunk} payload"
        )
        dp = int(payload[0])
        if dp >= plan.chain:
            self._parse(plan, payload, ctx.chunk)  # raises its reason
        depth = self._depth(plan, ctx, dp)
        out = torch.empty_like(payload) if encode else None
        bad = k.exp_reduce(
            acc,
            payload[1:],
            self.reduce_key(plan, ctx, depth),
            plan.chunks[ctx.chunk][0],
            plan.chain - dp,
            None if out is None else out[1:],
        )
        if bad:
            self._parse(plan, payload, ctx.chunk)  # raises its reason
        plan.depth[ctx.chunk] = depth
        if out is not None:
            out[0] = depth
        return out

    def _depth(self, plan: GQSGDExpPlan, ctx: HopContext, dp: int) -> int:
        depth = max(dp, plan.depth.get(ctx.chunk, 0)) + 1
        if depth >= plan.chain:
            raise PayloadError(
                f"gqsgd-exp chunk {ctx.chunk}: combining reaches depth {depth}, beyond this "
                f"schedule's {plan.chain - 1} combinations in a row (a corrupt payload?)"
            )
        return depth

    def decode_accumulate(
        self, plan: GQSGDExpPlan, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        self._combine(plan, payload, acc, ctx, encode=False)

    def decode_accumulate_encode(
        self, plan: GQSGDExpPlan, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        out = self._combine(plan, payload, local, ctx, encode=True)
        assert out is not None
        return out

    def _values(
        self,
        plan: GQSGDExpPlan,
        y: torch.Tensor,
        op: ReduceOp,
        world_size: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The signed exponent codes ``y`` as values, into ``out`` when given (may
        be ``y``)."""
        N = plan.scale
        k = self.kernels(y.device)
        if k is not None and y.dtype == torch.float32 and y.is_contiguous():
            n = world_size if op is ReduceOp.AVG else 1
            return k.exp_finish(y, N, plan.chain, n, _FLOAT_MAX, out=out)
        c = y.to(torch.int32)
        e = c.abs()
        mag = torch.ldexp(torch.full_like(y, N, dtype=torch.float64), (plan.chain - e).double())
        v = torch.where(e > 0, torch.where(c < 0, -mag, mag), 0.0)
        if op is ReduceOp.AVG:
            v = div(v, world_size)
        r = keep_finite(v.to(torch.float32), v, _FLOAT_MAX)
        return r if out is None else out.copy_(r)

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round}
