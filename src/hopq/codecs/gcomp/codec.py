"""GComp (Li et al., SoCC '24): near-lossless fp32 gradient compression inside the
ring, adapted to hopq's multi-hop engine.

* Exponents: canonical Huffman with escape (:mod:`.huffman`), the table built on
  every rank from a 256-bin exponent histogram summed in the statistics
  exchange, rebuilt every ``rebuild_every`` calls per key (paper 4.4: 50), named
  by its id in every payload.
* Zero pruning, sign + mantissa with optimizer-aware truncation (0/6/12/18 bits),
  block/chunk headers: :mod:`.reference`, :mod:`.format`.
* Thresholds: the optimizer's delta has the form A / g for every optimizer of
  the paper's Table 2 (:mod:`.optim` computes |A| per coordinate from the
  optimizer state); the caller hands them over per key with
  :meth:`GComp.set_thresholds` (the DDP hook does it with
  ``HookState(codec="gcomp", optimizer=opt)``).
* Hops: every encoding (leaf, fused hop, the owner's final payload) truncates
  its own partial sum v with the rule |v| * 2**k < |A|, A taken for the
  *averaged* gradient, v at sum scale. Each truncation then errs by less than
  2**-23 |A| on the sum, i.e. 2**-23 |A| / n on the average, and a coordinate
  meets at most n truncations (ring: leaf, n - 2 inner hops, the owner; the
  butterfly fewer), so the total error on the averaged gradient stays within
  the one truncation the paper's argument allows (2**-23 |A|: the bits the
  optimizer's update would lose anyway). Truncation rounds toward zero, so the
  error is biased (toward smaller magnitudes); ``hopq bench gcomp`` measures it.
* Non-finite values: exponent 255 always travels at level 0 (whole mantissa):
  NaN and Inf arrive where they were. Zeros, -0 and subnormals become +0.
* CUDA tensors are coded on the host, as the paper's system does (PyTorch DDP
  on Gloo with A100s, its coder on the CPU inside Gloo; no GPU kernels): each
  encode, decode and fused hop copies its chunk (and payload) to the host, runs
  the CPU kernels (or the reference) there and copies the result back, so the
  bits are the CPU run's. Payloads live on the tensor's device, as the
  transport needs (NCCL takes CUDA tensors only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hopq.codecs.base import (
    Codec,
    CodecConfig,
    HopContext,
    Plan,
    ReadsOptimizer,
    ReduceOp,
    StatsExchange,
    StatsOp,
    plan_chunks,
)
from hopq.codecs.gcomp import format as fmt
from hopq.codecs.gcomp import reference as ref
from hopq.codecs.gcomp.huffman import Table, build_table, table_from_lengths
from hopq.codecs.gcomp.optim import check_rule, thresholds
from hopq.codecs.registry import register
from hopq.codecs.uncompressed import working_copy
from hopq.errors import PayloadError
from hopq.kernels import CpuBackend, resolve
from hopq.numerics.div import div_
from hopq.options import check_options, option

Backend = CpuBackend  # auto: hopq.codecs.gcomp.kernels_cpu when numba is installed


@dataclass(frozen=True)
class GCompConfig(CodecConfig):
    #: 10: a 1024-entry lookup table (L1-resident); exponents of fp32 gradients
    #: concentrate on ~15-20 values, so codes over 10 bits are rare and cost 18.
    n_theta: int = option(
        10, "escape threshold: longer exponent codes go as prefix + 8 raw bits", lo=4, hi=16
    )
    rebuild_every: int = option(
        50, "calls per key between code-table rebuilds (paper: 50; 0: build once)", lo=0
    )
    chunk_values: int = option(
        1 << 16, "values per chunk inside a payload (own header each)", lo=1, hi=1 << 24
    )
    fixed_level: int = option(
        -1,
        "truncate every value at this level (0-3: 0/6/12/18 bits); -1: by the thresholds",
        lo=-1,
        hi=3,
    )
    backend: Backend = option(Backend.AUTO, "kernels", choices=[b.value for b in Backend])

    def __post_init__(self) -> None:
        check_options(self, "gcomp")


@dataclass
class GCompPlan(Plan):
    table: Table
    #: |A| per coordinate of the working vector (rank-local input), or None.
    thr: torch.Tensor | None
    fixed: int
    chunk_values: int
    #: The key whose table it uses, and whether this call rebuilt it.
    key: str = "None"
    rebuilt: bool = False


def resolve_kernels(cfg: GCompConfig, device_type: str) -> Any:
    return resolve("gcomp", cfg.backend.value, device_type)


@register(
    "gcomp",
    "GComp: Huffman-coded exponents, optimizer-aware mantissa truncation, zero pruning",
    devices=("cpu", "cuda"),  # CUDA tensors coded on the host (see the module's docstring)
)
class GComp(ReadsOptimizer, Codec[GCompPlan]):
    config_class = GCompConfig
    config: GCompConfig
    layout_preserving: ClassVar[bool] = True
    chunk_local: ClassVar[bool] = True
    variable_size: ClassVar[bool] = True

    def __init__(self, config: GCompConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        #: key -> (code lengths, calls since the table was built); agreed state.
        self.tables: dict[str, tuple[list[int], int]] = {}
        #: key -> |A| per coordinate for the next calls with that key (rank-local).
        self.thresholds: dict[str, torch.Tensor] = {}
        self._kernel_cache: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_kernel_cache": {}}

    def kernels(self, device: torch.device) -> Any:
        """The kernel module (None: the reference); GComp codes every device's
        tensors on the host, so this is the CPU's whatever ``device`` is."""
        if "cpu" not in self._kernel_cache:
            self._kernel_cache["cpu"] = resolve_kernels(self.config, "cpu")
        return self._kernel_cache["cpu"]

    # -- thresholds -----------------------------------------------------------
    @property
    def optimizer_unused(self) -> str | None:
        """Why an optimizer handed to this codec would do nothing, or None."""
        lv = self.config.fixed_level
        if lv < 0:
            return None
        return (
            f"gcomp: fixed_level={lv} truncates every value at level {lv}, so an optimizer's "
            "thresholds would not be used: pass no optimizer, or fixed_level=-1 for the "
            "optimizer-aware truncation"
        )

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError unless Table 2 has a truncation rule for ``optimizer``."""
        check_rule(optimizer)

    def optimizer_input(self, optimizer: Any, params: list[torch.Tensor]) -> torch.Tensor:
        return thresholds(optimizer, params)

    def set_optimizer_input(self, value: torch.Tensor | None, key: int | None = None) -> None:
        self.set_thresholds(value, key)

    def narrow_optimizer_input(
        self, key: int | None, lo: int, hi: int, into: int | None
    ) -> None:  # fmt: skip
        thr = self.thresholds.get(str(key))  # kept across calls, as set
        if thr is None:
            self.thresholds.pop(str(into), None)
        else:
            self.thresholds[str(into)] = thr[lo:hi]

    def set_thresholds(self, thr: torch.Tensor | None, key: int | None = None) -> None:
        """|A| per coordinate (delta = A / g, paper Table 2) of the gradient the
        calls with ``key`` carry, for the averaged gradient; None: no truncation."""
        unused = self.optimizer_unused
        if unused is not None and thr is not None:
            raise ValueError(unused)
        k = str(key)
        if thr is None:
            self.thresholds.pop(k, None)
        else:
            self.thresholds[k] = thr.detach().reshape(-1).to(torch.float32).abs()

    # -- plan -------------------------------------------------------------------
    def plan(self, x: torch.Tensor, stats: StatsExchange) -> GCompPlan:
        cfg = self.config
        d = x.numel()
        k = str(stats.key)
        entry = self.tables.get(k)
        rebuilt = entry is None or (cfg.rebuild_every > 0 and entry[1] >= cfg.rebuild_every)
        if rebuilt:
            flat = x.reshape(-1).to(torch.float32)
            hist = stats.all_reduce(ref.histogram(flat), StatsOp.SUM)
            table = build_table(hist, cfg.n_theta)
            self.tables[k] = (table.lengths.tolist(), 0)
        else:
            assert entry is not None
            table = _cached_table(tuple(entry[0]), cfg.n_theta)
        thr = self.thresholds.get(k)
        if thr is not None and thr.numel() != d:
            raise ValueError(
                f"gcomp: thresholds for key {stats.key} have {thr.numel()} entries, the tensor {d}"
            )
        if thr is not None:
            thr = _host(thr)  # the coder runs on the host: one copy per call
        chunks = plan_chunks(d, stats)
        sizes = tuple(fmt.bound(e - s, cfg.chunk_values, cfg.n_theta) for s, e in chunks)
        return GCompPlan(
            d, d, chunks, sizes, table, thr, cfg.fixed_level, cfg.chunk_values, k, rebuilt
        )

    def end_round(self, plan: GCompPlan) -> None:
        super().end_round(plan)
        lengths, uses = self.tables[plan.key]
        self.tables[plan.key] = (lengths, uses + 1)

    def prepare(self, plan: GCompPlan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        return working_copy(x, overwrite)

    # -- hops -------------------------------------------------------------------
    def _thr(self, plan: GCompPlan, ctx: HopContext) -> torch.Tensor | None:
        if plan.thr is None:
            return None
        s, e = plan.chunks[ctx.chunk]
        return plan.thr[s:e]

    def encode(self, plan: GCompPlan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        thr = self._thr(plan, ctx)
        kern = self.kernels(chunk.device)
        x = _host(chunk)
        if kern is not None:
            out: torch.Tensor = kern.encode(x, thr, plan.fixed, plan.table, plan.chunk_values)
        else:
            out = ref.encode(x, thr, plan.fixed, plan.table, plan.chunk_values)
        return out.to(chunk.device)

    def _decode(
        self, plan: GCompPlan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor, acc: bool
    ) -> None:
        n = plan.chunk_numel(ctx.chunk)
        if out.numel() != n:
            raise PayloadError(f"gcomp: output of {out.numel()} values, the chunk has {n}")
        kern = self.kernels(out.device)
        p = _host(payload)
        # on a GPU: decode (and add) into a host copy, then copy it back, so the
        # sums are the host's float32 additions, as on the CPU
        dst = (
            out
            if out.device.type == "cpu"
            else (out.cpu() if acc else torch.empty(n, dtype=out.dtype))
        )
        if kern is not None:
            kern.decode(p, n, plan.table, plan.chunk_values, dst, acc)
        else:
            y = ref.decode(p, n, plan.table, plan.chunk_values)
            if acc:
                dst.add_(y)
            else:
                dst.copy_(y)
        if dst is not out:
            out.copy_(dst)

    def decode(
        self, plan: GCompPlan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor
    ) -> None:
        self._decode(plan, payload, ctx, out, False)

    def decode_accumulate(
        self, plan: GCompPlan, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        self._decode(plan, payload, ctx, acc, True)

    def decode_accumulate_encode(
        self, plan: GCompPlan, payload: torch.Tensor, local: torch.Tensor, ctx: HopContext
    ) -> torch.Tensor:
        """With the kernels: one pass (decode a value, add, encode the sum);
        otherwise decode-accumulate, then encode. The same bits either way."""
        kern = self.kernels(local.device)
        n = plan.chunk_numel(ctx.chunk)
        if kern is None or not local.is_contiguous() or local.dtype != torch.float32:
            return super().decode_accumulate_encode(plan, payload, local, ctx)
        if local.numel() != n:
            raise PayloadError(f"gcomp: local chunk of {local.numel()} values, the chunk has {n}")
        h = _host(local)
        out: torch.Tensor = kern.hop(
            _host(payload), h, self._thr(plan, ctx), plan.fixed, plan.table, plan.chunk_values
        )
        if h is not local:
            local.copy_(h)  # the sum, as the CPU run leaves it
        return out.to(local.device)

    def finish(
        self, plan: GCompPlan, y: torch.Tensor, op: ReduceOp, world_size: int
    ) -> torch.Tensor:
        return div_(y, world_size) if op is ReduceOp.AVG else y

    def error_bound(
        self, abs_sum: torch.Tensor, chain: int, adds: int | None = None
    ) -> torch.Tensor | None:
        """Per truncation 2**(k-23) |v| (k the fixed level's bits; 0 without one),
        per addition in a row float32's half ulp (``adds``, by default one per hop),
        per hop a flushed subnormal."""
        k = 6 * max(self.config.fixed_level, 0)
        trunc = 2.0 ** (k - 23) if k else 0.0
        n_adds = chain if adds is None else adds
        return chain * (trunc * abs_sum + torch.finfo(torch.float32).smallest_normal) + (
            n_adds * 2.0**-24 * abs_sum
        )

    # -- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "tables": {k: (list(v[0]), v[1]) for k, v in self.tables.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.tables = {str(k): (list(v[0]), int(v[1])) for k, v in state["tables"].items()}


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host (itself when it is there)."""
    return t if t.device.type == "cpu" else t.cpu()


_TABLES: dict[tuple[tuple[int, ...], int], Table] = {}


def _cached_table(lengths: tuple[int, ...], n_theta: int) -> Table:
    key = (lengths, n_theta)
    if key not in _TABLES:
        if len(_TABLES) > 256:
            _TABLES.clear()
        _TABLES[key] = table_from_lengths(list(lengths), n_theta)
    return _TABLES[key]
