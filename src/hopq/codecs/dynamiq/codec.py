"""The DynamiQ codec: planning, budget sharing and dispatch to the reference or a
kernel backend (all of which produce the same bits)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from hopq.codecs.base import (
    Codec,
    CodecConfig,
    HopContext,
    ReadsOptimizer,
    ReduceOp,
    StatsExchange,
    StatsOp,
    check_bounds,
    segment_starts,
)
from hopq.codecs.base import check_payload as _check_payload
from hopq.codecs.dynamiq import reference
from hopq.codecs.dynamiq.allocation import allocate, split_budget, starved
from hopq.codecs.dynamiq.config import Backend, DynamiQConfig, Scales
from hopq.codecs.dynamiq.layout import DynamiQPlan, Segment, build_plan
from hopq.codecs.dynamiq.optim import check_optimizer, step_sizes
from hopq.codecs.dynamiq.segment import DynamiQKernels, SegmentCall, Streams
from hopq.codecs.registry import register
from hopq.codecs.uncompressed import Bf16
from hopq.kernels import Mode, resolve
from hopq.numerics.levels import search_tables
from hopq.numerics.rows import gather_rows, scatter_rows


def _kernel_levels_ok(cfg: DynamiQConfig) -> bool:
    try:
        for w in cfg.widths:
            if w in (2, 4, 8):
                search_tables(w, cfg.eps_for(w))
    except ValueError:
        return False
    return True


def resolve_kernels(cfg: DynamiQConfig, device_type: str) -> DynamiQKernels | None:
    """The kernel module that runs ``cfg``'s segments on this device type, or None
    for the reference (see :class:`~hopq.codecs.dynamiq.config.Backend`). The
    kernels take hierarchical scales and level tables their bucket search
    handles; ``auto`` runs the reference otherwise, a named backend refuses."""
    b = cfg.backend
    supported = cfg.scales is Scales.HIERARCHICAL and _kernel_levels_ok(cfg)
    if not supported and b is not Backend.REFERENCE:
        if b is Backend.AUTO:
            return None
        raise ValueError(
            f"dynamiq: backend {b.value!r} needs scales='hierarchical' and level tables "
            f"the kernels' bucket search handles (eps {[cfg.eps_for(w) for w in cfg.widths]})"
        )
    module: DynamiQKernels | None = resolve("dynamiq", b.value, device_type)
    return module


_FLOAT_MAX = float(torch.finfo(torch.float32).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
#: Extra halvings of the working vector, beyond log2 of the world size, where a
#: super-group's values come near float32's limit: a partial sum of n entries
#: (each |x - mu| <= 2 max) with a hop's rounding above it (a decoded value is
#: at most its group's scale, 1 + 2^-7 of the partial sum's maximum) stays
#: below 2^128 for any n up to 2^16 with 2^-8 to spare.
PRESCALE_MARGIN = 8


def exchange_means(local: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
    """Local means scaled for the bfloat16 statistics sum: divided by a power of
    two P >= n, so that the sum of n means, each within float32's range, stays
    within bfloat16's (3.39e38, below float32's 3.40e38); returns P. Scaling by
    a power of two commutes with rounding: the sum times P has the bits of the
    unscaled sum wherever that one is finite."""
    P = float(1 << max(n - 1, 0).bit_length())
    return local / P, P


def global_means(summed: torch.Tensor, n: int, P: float) -> torch.Tensor:
    """The global mean per super-group from the exchanged sum of means / P: the
    sum times P, divided by n (the bits of the unscaled exchange), or where the
    sum times P leaves float32's range, the sum times P / n (finite)."""
    m = summed * P
    return torch.where(torch.isfinite(m), m / n, summed * (P / n))


def saturate_finite_rows(out: torch.Tensor, mu: torch.Tensor, S: int) -> torch.Tensor:
    """Adding the means back can push an estimate just past float32's limit when the
    true sum lies just below it: such entries saturate. A super-group with a NaN
    or Inf input has a non-finite mean, and keeps its poison."""
    if out.numel() == 0:
        return out
    lo, hi = torch.aminmax(out)  # one pass, no mask (a NaN takes the full path)
    if bool(lo > -math.inf) and bool(hi < math.inf):
        return out
    inf = torch.isinf(out)
    if not bool(inf.any()):
        return out
    rows = torch.isfinite(mu).repeat_interleave(S)[: out.numel()]
    return torch.where(inf & rows, out.clamp(-_FLOAT_MAX, _FLOAT_MAX), out)


@register(
    "dynamiq",
    "DynamiQ: variable bitwidth per super-group, non-uniform levels, hierarchical scales, correlated rounding",
)
class DynamiQ(ReadsOptimizer, Codec[DynamiQPlan]):
    """DynamiQ (Dynamic Quantization for multi-hop all-reduce), sections 3-4 and
    appendices A-B; see :mod:`hopq.codecs.dynamiq`."""

    config_class = DynamiQConfig
    config: DynamiQConfig
    layout_preserving: ClassVar[bool] = False
    #: With chunk bounds (a reduce-scatter over rank shards): super-groups start
    #: at each chunk's start and are reordered inside their chunk; the
    #: statistics exchange and the bit allocation stay global.
    chunk_local: ClassVar[bool] = True
    plans_ahead: ClassVar[bool] = True

    def __init__(self, config: CodecConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        #: key -> (numel, F) of the keyed calls of the step under way.
        self._step_stats: dict[int, tuple[int, torch.Tensor]] = {}
        #: key -> (numel, bits per coordinate) split from the previous step.
        self._shares: dict[int, tuple[int, float]] = {}
        #: The codec of the calls too small for DynamiQ (small_call_codec).
        self._fallback: Codec[Any] | None = None
        #: device type -> kernel module (or None: the reference), resolved once.
        self._kernel_cache: dict[str, DynamiQKernels | None] = {}
        #: key -> the optimizer's step size per coordinate for that key's next
        #: call (``set_step_sizes``), whose energies are weighed by its square.
        self._step_sizes: dict[int | None, torch.Tensor] = {}
        #: key -> the mean squared step size of every super-group of that key's
        #: next call (``set_supergroup_weights``: FSDP, where each rank holds the
        #: optimizer's state for its own slice only), and the bits per coordinate
        #: their exchange cost, which that call's budget pays.
        self._sg_weights: dict[int | None, tuple[torch.Tensor, float]] = {}

    def small_call_codec(
        self,
        numel: int,
        key: int | None = None,
        shards: tuple[int, ...] | None = None,
        phases: int = 2,
    ) -> Codec[Any] | None:
        """bf16 for the whole call where its size cannot afford the width a large
        call gets everywhere (:func:`~hopq.codecs.dynamiq.allocation.starved`:
        the last super-group's padding and the statistics cost as much as full
        super-groups, so a few hundred entries leave some super-groups 2-bit
        codes, vNMSE 3.1 at 257 entries against 0.04 at 10,000;
        docs/codecs/dynamiq.md, "Small calls"); none with
        ``small_call_fallback=False``."""
        cfg = self.config
        if not cfg.small_call_fallback:
            return None
        spans = (
            None if shards is None else [b - a for a, b in zip(shards, shards[1:], strict=False)]
        )
        if not starved(cfg, numel, spans, 2.0 if phases == 1 else 1.0):
            return None
        # the optimizer's input set for this call is used up, as plan would
        r = self._step_sizes.pop(key, None)
        self._sg_weights.pop(key, None)
        if r is not None and r.numel() != numel:
            raise ValueError(
                f"dynamiq: the step sizes set for key {key} cover {r.numel()} "
                f"coordinates, this call has {numel}"
            )
        if getattr(self, "_fallback", None) is None:  # (a codec pickled without one)
            self._fallback = Bf16()
        assert self._fallback is not None
        return self._fallback

    def __getstate__(self) -> dict[str, Any]:
        # modules neither pickle nor deep-copy: a copy resolves its kernels again
        return {**self.__dict__, "_kernel_cache": {}}

    def nonfinite_block(self) -> int:
        return self.config.supergroup_size  # the mean and the scale carry the poison

    def kernels(self, device: torch.device) -> DynamiQKernels | None:
        """The kernel module that runs this device's segments, or None for the
        reference; resolved once per device type (it is asked on every call)."""
        if device.type not in self._kernel_cache:
            self._kernel_cache[device.type] = resolve_kernels(self.config, device.type)
        return self._kernel_cache[device.type]

    def warm_up(self, device: torch.device) -> None:
        """Compile (or load from numba's disk cache) the CPU kernels, once per
        process, before a call's timeout starts (with a cold cache this takes
        tens of seconds; :meth:`Codec.warm_up <hopq.codecs.base.Codec.warm_up>`)."""
        warm = getattr(self.kernels(device), "warm_up", None)
        if device.type == "cpu" and warm is not None:
            warm()

    def backend_name(self, device: torch.device) -> str:
        """ "reference", or the kernel backend's name ("cpu", "triton")."""
        kern = self.kernels(device)
        return "reference" if kern is None else kern.__name__.rsplit("_", 1)[-1]  # type: ignore[attr-defined]

    # -- planning ----------------------------------------------------------
    def plan(self, x: torch.Tensor, stats: StatsExchange) -> DynamiQPlan:
        cfg = self.config
        S = cfg.supergroup_size
        d = x.numel()
        flat = x.reshape(-1).to(torch.float32)

        bounds = check_bounds(stats, d)
        spans = [(0, d)]  # the spans whose super-groups start at their start: the call
        if bounds is not None:  # or each chunk of a reduce-scatter
            spans = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
        r = self._step_sizes.pop(stats.key, None)  # one call's
        w_all, spent = self._sg_weights.pop(stats.key, (None, 0.0))
        if r is not None and r.numel() != d:
            raise ValueError(
                f"dynamiq: the step sizes set for key {stats.key} cover {r.numel()} "
                f"coordinates, this call has {d}"
            )
        if r is not None and w_all is not None:
            raise ValueError(
                f"dynamiq: key {stats.key} has both step sizes and super-group weights "
                "set for its next call; set one"
            )
        groups = [-(-(b - a) // S) for a, b in spans]  # super-groups of each span
        if w_all is not None and w_all.numel() != sum(groups):
            raise ValueError(
                f"dynamiq: the super-group weights set for key {stats.key} cover "
                f"{w_all.numel()} super-groups, this call has {sum(groups)}"
            )
        ws: list[torch.Tensor | None] = (
            [None] * len(spans) if w_all is None else list(w_all.to(x.device).split(groups))
        )

        def sums(v: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor | None) -> torch.Tensor:
            # means and energies of v; with step sizes, the energies times the
            # super-group's mean r^2: a super-group's error is spread over its
            # entries by its scales, whatever each entry's own size (optim.py)
            out = self._sg_stats(v)
            if r is not None:
                w = self.supergroup_weights(r.to(v.device))
            if w is not None:
                # zero stays zero (the zero class is decided on the gradient), any
                # other energy stays positive (a zero step size must not make a
                # super-group the zero class's) and NaN stays NaN
                F = out[1]
                out[1] = torch.where(F == 0, F, (F * w).clamp(min=torch.finfo(F.dtype).tiny))
            return out

        sg_starts: tuple[int, ...] = ()
        if bounds is not None:  # super-groups start at every chunk's start
            sg_starts = tuple(s // S for s in segment_starts(bounds, S))
        parts = [
            sums(flat[a:b], None if r is None else r[a:b], w)
            for (a, b), w in zip(spans, ws, strict=True)
        ]
        local = torch.cat(parts, 1) if parts else flat.new_zeros(2, 0)
        n = stats.world_size
        local[0], P = exchange_means(local[0], n)
        glob = stats.all_reduce(local.to(torch.bfloat16), StatsOp.SUM).float()
        mu = global_means(glob[0], n, P)
        # a finite mean with an energy beyond bfloat16's range: values near
        # float32's limit, whose partial sums could overflow; the whole working
        # vector is scaled by a power of two (exact, up to subnormals), and the
        # energies saturate at bfloat16's maximum for the allocation
        big = torch.isfinite(mu) & torch.isinf(glob[1])
        prescale = 1.0
        if bool(big.any()):
            prescale = 2.0 ** -(PRESCALE_MARGIN + n.bit_length())
            mu = mu * prescale
            glob[1] = torch.where(big, torch.full_like(glob[1], _BF16_MAX), glob[1])
        F64 = glob[1].cpu().double()
        # what the step-size weights' exchange spent comes out of the call's budget
        budget = self._budget_for(stats.key, d) - spent
        # a reduce-scatter moves each coordinate once: the exchange weighs double
        weight = 2.0 if stats.phases == 1 else 1.0
        widths = allocate(cfg, F64, d, budget, weight)
        if stats.key is not None and cfg.share_budget:
            self._step_stats[stats.key] = (d, F64)
        plan = build_plan(
            cfg,
            d,
            widths,
            stats.n_chunks,
            mu,
            budget,
            stats.microshards,
            bounds,
            sg_starts,
            weight,
        )
        plan.prescale = prescale
        return plan

    # -- the optimizer (optim.py) -----------------------------------------------
    @property
    def optimizer_unused(self) -> str | None:
        """Why an optimizer handed to this codec would do nothing, or None."""
        if self.config.optimizer_weights:
            return None
        return "dynamiq: optimizer_weights=False allocates without the optimizer's step sizes"

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError unless optim.py has a step-size rule for ``optimizer``."""
        check_optimizer(optimizer)

    def optimizer_input(self, optimizer: Any, params: list[torch.Tensor]) -> torch.Tensor | None:
        return step_sizes(optimizer, params)

    def set_optimizer_input(self, value: torch.Tensor | None, key: int | None = None) -> None:
        # step_sizes' output: already float32, flat, finite and >= 0 (no second pass)
        if value is None or self.optimizer_unused is not None:
            self.set_step_sizes(value, key)
        else:
            self._step_sizes[key] = value

    def narrow_optimizer_input(
        self, key: int | None, lo: int, hi: int, into: int | None
    ) -> None:  # fmt: skip
        # the key's stay: a two-tier call cuts them for each of its pieces, and
        # the next set_step_sizes for the key replaces them
        r = self._step_sizes.get(key)
        if r is not None:
            self._step_sizes[into] = r[lo:hi]

    def set_step_sizes(self, r: torch.Tensor | None, key: int | None = None) -> None:
        """The optimizer's step size per coordinate for the next call with ``key``
        (that call uses them up; None: none, energies unweighted). Each rank's
        own: the energies are exchanged already weighed, so the ranks allocate
        alike even where their step sizes differ."""
        unused = self.optimizer_unused
        if unused is not None and r is not None:
            raise ValueError(unused)
        if r is None:
            self._step_sizes.pop(key, None)
            return
        r = r.detach().reshape(-1).to(torch.float32)
        if not bool((r >= 0).all()):
            raise ValueError("dynamiq: step sizes must be >= 0 (NaN is not)")
        self._step_sizes[key] = r

    def _sg_stats(self, v: torch.Tensor) -> torch.Tensor:
        """[2, m]: each super-group's mean and sum of squares (kernels or reference,
        the same bits)."""
        S = self.config.supergroup_size
        kern = self.kernels(v.device)
        if kern is None:
            return reference.supergroup_stats(v, S)
        return reference.finite_means(v, S, kern.supergroup_stats(v, S))

    def supergroup_weights(self, r: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """The mean of r^2 over each super-group of ``r`` (one span: a whole call,
        or one chunk of a reduce-scatter, whose super-groups start at its start),
        the factor its energy is weighed by. ``real``: which entries the means
        are over (1) and which not (0: FSDP's padding has no step size); default
        all. A super-group of padding alone weighs 0."""
        S = self.config.supergroup_size
        r = r.detach().reshape(-1).to(torch.float32)
        sq = self._sg_stats(r)[1]
        m = sq.numel()
        if real is None:
            count = torch.full((m,), float(S), device=r.device)
            count[-1:] = r.numel() - (m - 1) * S
        else:
            mask = real.detach().reshape(-1).to(device=r.device, dtype=torch.float32)
            if mask.numel() != r.numel():
                raise ValueError("dynamiq: real= must have one entry per step size")
            count = torch.nn.functional.pad(mask, (0, m * S - mask.numel())).view(m, S).sum(1)
        return sq / count.clamp(min=1)

    def set_supergroup_weights(
        self, w: torch.Tensor | None, key: int | None = None, spent_bits: float = 0.0
    ) -> None:
        """The weights (``supergroup_weights``, span after span) of the next call
        with ``key``, in place of step sizes per coordinate: under FSDP each rank
        holds the optimizer's state for its own slice only, so the ranks exchange
        these, 1/256 of the step sizes' size (``FSDPReduceScatter``). None: none.
        ``spent_bits``: bits per coordinate of that call (its accounting) the
        exchange cost; the call's budget pays them, so the call with its
        exchange stays within the budget."""
        if not (math.isfinite(spent_bits) and spent_bits >= 0):
            raise ValueError(f"dynamiq: spent_bits must be finite and >= 0, got {spent_bits}")
        unused = self.optimizer_unused
        if unused is not None and w is not None:
            raise ValueError(unused)
        if w is None:
            self._sg_weights.pop(key, None)
            return
        w = w.detach().reshape(-1).to(torch.float32)
        if not bool((w >= 0).all()):
            raise ValueError("dynamiq: super-group weights must be >= 0 (NaN is not)")
        self._sg_weights[key] = (w, float(spent_bits))

    def hand_over(self, copies: list[Codec[Any]]) -> None:
        if not self._step_sizes and not self._sg_weights:  # none set: the copies keep theirs
            return
        for c in copies:
            c._step_sizes = dict(self._step_sizes)  # type: ignore[attr-defined]
            c._sg_weights = dict(self._sg_weights)  # type: ignore[attr-defined]
        self._step_sizes = {}
        self._sg_weights = {}

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
            self._shares = split_budget(cfg, self._step_stats)
            self._step_stats = {}
        share = self._shares.get(key)
        return share[1] if share is not None and share[0] == d else cfg.budget

    def _partwise(self, plan: DynamiQPlan, x: torch.Tensor) -> bool:
        """Whether the working vector is prepared and finished part by part (CPU
        kernels, float32, one layout); elsewhere ``prepare`` gathers it whole,
        with the same bits."""
        kern = self.kernels(x.device)
        return (
            getattr(kern, "PARTWISE_ROWS", False)
            and x.dtype == torch.float32
            and plan.bounds is None
        )

    def prepare(self, plan: DynamiQPlan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        S = self.config.supergroup_size
        if plan.prescale != 1.0:  # values near float32's limit: a scaled copy
            x = x.detach().reshape(-1).to(torch.float32) * plan.prescale
            overwrite = False
        if self._partwise(plan, x):
            # gathered a part at a time (prepare_part), each just before its
            # first use: all but the first part's overlap the transfers
            plan.source = x.detach().reshape(-1).contiguous()
            if overwrite and plan.source.data_ptr() == x.data_ptr():
                # the result goes back into x, part by part: a part's rows are
                # read (prepare_part) before that part is finished, and no
                # other part reads them
                plan.out = plan.source
            return torch.empty(plan.work_numel, dtype=torch.float32, device=x.device)
        kern = self.kernels(x.device)
        gather = kern.gather_rows if kern is not None and x.dtype == torch.float32 else gather_rows
        if plan.bounds is None:
            return gather(x, plan.perm, plan.mu, S)
        flat = x.reshape(-1)
        parts = [
            gather(flat[a:b], plan.perm[lo:hi] - lo, plan.mu[lo:hi], S)
            for (a, b), (lo, hi) in self._segments(plan)
        ]
        return torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def _segments(plan: DynamiQPlan) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """With chunk bounds: per non-empty chunk, its caller range and its
        super-group range."""
        assert plan.bounds is not None
        b, g = plan.bounds, plan.sg_starts
        return [((b[c], b[c + 1]), (g[c], g[c + 1])) for c in range(len(b) - 1) if b[c + 1] > b[c]]

    def prepare_part(self, plan: DynamiQPlan, work: torch.Tensor, part: int) -> None:
        if plan.source is None or part in plan.prepared:
            return
        S = self.config.supergroup_size
        s, e = plan.chunks[part]
        kern = self.kernels(work.device)
        kern.gather_rows(plan.source, plan.perm[s // S : e // S], plan.mu, S, out=work[s:e])  # type: ignore[union-attr, call-arg]
        plan.prepared.add(part)

    def finish_part(
        self, plan: DynamiQPlan, work: torch.Tensor, part: int, op: ReduceOp, world_size: int
    ) -> None:
        self._scatter_part(plan, work, part, op, world_size)

    def _scatter_part(
        self, plan: DynamiQPlan, work: torch.Tensor, part: int, op: ReduceOp, world_size: int
    ) -> None:
        # finish_part's work, apart from it: finish scatters the parts left over
        # with this, so it does not depend on what a subclass makes of finish_part
        if plan.source is None or part in plan.finished:
            return
        S = self.config.supergroup_size
        if plan.out is None:
            plan.out = torch.empty(plan.numel, dtype=torch.float32, device=work.device)
        s, e = plan.chunks[part]
        kern = self.kernels(work.device)
        kern.scatter_rows(  # type: ignore[union-attr, call-arg]
            work[s:e],
            plan.perm[s // S : e // S],
            plan.mu,
            S,
            world_size,
            op is ReduceOp.AVG,
            plan.numel,
            out=plan.out,
            saturate=True,
        )
        plan.finished.add(part)

    def finish(
        self, plan: DynamiQPlan, y: torch.Tensor, op: ReduceOp, world_size: int
    ) -> torch.Tensor:
        S = self.config.supergroup_size
        if plan.source is not None:
            for m in range(len(plan.chunks)):  # the parts the engine did not finish
                self._scatter_part(plan, y, m, op, world_size)
            out = plan.out
            if out is None:  # no parts (an empty tensor)
                out = torch.empty(plan.numel, dtype=torch.float32, device=y.device)
            plan.source = plan.out = None  # the plan holds no tensors after the call
            if plan.prescale != 1.0:
                return saturate_finite_rows(out.mul_(1.0 / plan.prescale), plan.mu, S)
            return out  # saturated part by part (scatter_rows)
        kern = self.kernels(y.device)
        scatter = kern.scatter_rows if kern is not None else scatter_rows
        avg = op is ReduceOp.AVG
        back = 1.0 / plan.prescale  # a power of two: exact
        if plan.bounds is None:
            out = scatter(y, plan.perm, plan.mu, S, world_size, avg, plan.numel)
            if back != 1.0:
                out = out * back
            return saturate_finite_rows(out, plan.mu, S)
        parts = []
        for (a, b), (lo, hi) in self._segments(plan):
            perm, mu = plan.perm[lo:hi] - lo, plan.mu[lo:hi]
            part = scatter(y[lo * S : hi * S], perm, mu, S, world_size, avg, b - a)
            if back != 1.0:
                part = part * back
            parts.append(saturate_finite_rows(part, mu, S))
        return torch.cat(parts) if parts else y[:0]

    # -- the four hop operations ---------------------------------------------
    def _segment_call(
        self, mode: Mode, sg: Segment, streams: Streams, **tensors: torch.Tensor | None
    ) -> SegmentCall:
        """The kernel call for segment ``sg`` in ``mode`` with ``tensors``
        (payload, local, out_rows, out_payload: see :class:`SegmentCall`)."""
        cfg, w = self.config, sg.width
        S, s, eps = cfg.supergroup_size, cfg.group_size, cfg.eps_for(w)
        return SegmentCall(mode, w, sg.hi - sg.lo, S, s, sg.lo, eps, streams, **tensors)

    def _kernel_encode(
        self,
        kern: DynamiQKernels,
        plan: DynamiQPlan,
        payload: torch.Tensor | None,
        local: torch.Tensor,
        ctx: HopContext,
    ) -> torch.Tensor:
        """ENCODE (payload None) or the fused DAR through a kernel module."""
        segs, lo = plan.chunk_segments(ctx.chunk)
        S = self.config.supergroup_size
        out = torch.empty(plan.payload_nbytes[ctx.chunk], dtype=torch.uint8, device=local.device)
        if payload is not None:
            _check_payload(
                payload, plan.payload_nbytes[ctx.chunk], f"dynamiq chunk {ctx.chunk} payload"
            )
        mode = Mode.ENCODE if payload is None else Mode.DAR
        streams = reference.streams(self.config, ctx)
        for sg in segs:
            if sg.width == 0:
                continue
            a, b = (sg.lo - lo) * S, (sg.hi - lo) * S
            call = self._segment_call(
                mode,
                sg,
                streams,
                payload=None if payload is None else payload[sg.offset : sg.offset + sg.nbytes],
                local=local[a:b],
                out_payload=out[sg.offset : sg.offset + sg.nbytes],
            )
            kern.run_segment(call)
        return out

    def _kernel_decode(
        self,
        kern: DynamiQKernels,
        mode: Mode,
        plan: DynamiQPlan,
        payload: torch.Tensor,
        out: torch.Tensor,
        ctx: HopContext,
    ) -> None:
        segs, lo = plan.chunk_segments(ctx.chunk)
        _check_payload(
            payload, plan.payload_nbytes[ctx.chunk], f"dynamiq chunk {ctx.chunk} payload"
        )
        S = self.config.supergroup_size
        streams = reference.streams(self.config, ctx)
        for sg in segs:
            a, b = (sg.lo - lo) * S, (sg.hi - lo) * S
            if sg.width == 0:
                if mode is Mode.DECODE:
                    out[a:b] = 0
                continue
            call = self._segment_call(
                mode,
                sg,
                streams,
                payload=payload[sg.offset : sg.offset + sg.nbytes],
                local=out[a:b] if mode is Mode.DECODE_ACC else None,
                out_rows=out[a:b],
            )
            kern.run_segment(call)

    def encode(self, plan: DynamiQPlan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        kern = self.kernels(chunk.device)
        if kern is None:
            return reference.encode_chunk(self.config, plan, chunk, ctx)
        return self._kernel_encode(kern, plan, None, chunk, ctx)

    def decode(
        self, plan: DynamiQPlan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor
    ) -> None:
        kern = self.kernels(out.device)
        if kern is None:
            reference.decode_chunk(self.config, plan, payload, ctx, out)
        else:
            self._kernel_decode(kern, Mode.DECODE, plan, payload, out, ctx)

    def decode_accumulate(
        self, plan: DynamiQPlan, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        kern = self.kernels(acc.device)
        if kern is None:
            super().decode_accumulate(plan, payload, acc, ctx)
        else:
            self._kernel_decode(kern, Mode.DECODE_ACC, plan, payload, acc, ctx)

    def decode_accumulate_encode(
        self, plan: DynamiQPlan, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        kern = self.kernels(local.device)
        if kern is None:
            return super().decode_accumulate_encode(plan, payload, local, ctx)
        return self._kernel_encode(kern, plan, payload, local, ctx)

    def state_dict(self) -> dict[str, Any]:
        """The round counter and the budget sharing's state (the shares split from
        the last finished step, and the statistics of the step under way), so that
        a resumed run continues bit for bit."""
        return {
            "round": self.round,
            "shares": {k: [n, b] for k, (n, b) in self._shares.items()},
            "step_stats": {k: (n, F.clone()) for k, (n, F) in self._step_stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self._shares = {int(k): (int(n), float(b)) for k, (n, b) in state.get("shares", {}).items()}
        self._step_stats = {
            int(k): (int(n), torch.as_tensor(F, dtype=torch.float64).clone())
            for k, (n, F) in state.get("step_stats", {}).items()
        }
