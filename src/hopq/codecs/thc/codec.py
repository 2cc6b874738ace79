"""THC (tensor homomorphic compression, Li et al., NSDI'24) adapted to multi-hop
all-reduce as in the DynamiQ paper (section 5, "Baseline compression schemes").

Each rank rotates its gradient with a randomized Hadamard transform (random
signs from a seed all ranks share, then a fast Walsh-Hadamard transform over
power-of-two blocks that each interleave the whole vector, normalised), the ranks agree on a global scale M (the
largest rotated magnitude, a max all-reduce), and each rank quantizes every
rotated coordinate once, stochastically, to an integer in [-L, L] with
L = 2^(q-1) - 1 (q = 4: the 15 levels -7..7). Partial sums then travel as
integers in b-bit lanes and are added without any decompression (homomorphic):
a sum of n ranks lies in [-nL, nL], so the lane needs 2 n L + 1 values. By
default b follows the DynamiQ paper's THC (8 bits up to n = 8, then 12), widened
to the smallest of 12, 16, 24 bits that holds those values (for q = 4, 12 bits
last up to n = 292; for q = 8, L = 127, 16 bits are needed from n = 9). A lane
set by hand that is too narrow saturates a partial sum beyond it and counts it
(``overflows``, with a warning): never wrapped. Decoding scales by M / L and
applies the inverse transform once, in ``finish``.

Non-finite input poisons the global scale, hence the whole vector.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache
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
    check_bounds,
    check_payload,
    from_segments,
    nested_chunks,
    segment_starts,
    split_parts,
    to_segments,
)
from hopq.codecs.registry import register
from hopq.kernels import CpuBackend, resolve
from hopq.numerics.bitpack import pack_bits, sign_extend, unpack_bits
from hopq.numerics.blocks import n_blocks, pad_to_blocks
from hopq.numerics.div import div, div_
from hopq.numerics.fp_formats import keep_finite
from hopq.numerics.rng import hash32, stream_key, uniform
from hopq.options import check_options, option

#: Stream coordinates of THC's randomness (chunk field; distinct from real chunks).
SIGN_STREAM, ROUND_STREAM = 0xFFFF0, 0xFFFF1
#: Lane widths; integer sums are accumulated in float32, exact up to 2^24.
LANES = (8, 12, 16, 24)
#: Above this magnitude (rotated), the transform runs in float64.
WIDE = 2.0**100
_FLOAT_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class THCConfig(CodecConfig):
    q: int = option(
        4, "bits per quantized coordinate (levels -(2^(q-1)-1) .. 2^(q-1)-1)", lo=2, hi=8
    )
    #: Lane width b; None: chosen from the world size (see the module docstring).
    lane_bits: int | None = option(
        None, "integer lane width; default: the narrowest that cannot overflow", choices=LANES
    )
    #: Hadamard block H (a power of two); small vectors use the largest power of
    #: two <= d / 16, so that padding to whole blocks stays small. Block j holds
    #: every m-th coordinate (m = number of blocks), so each block samples the
    #: whole vector: with one global scale, contiguous blocks of skewed gradients
    #: leave low-energy blocks with far more rounding noise than signal (measured
    #: on MiniLM gradients, n = 4: vNMSE 1.7 contiguous vs interleaved, README).
    hadamard_block: int = option(1 << 16, "Hadamard block (a power of two)", lo=1, hi=1 << 24)
    backend: CpuBackend = option(
        CpuBackend.AUTO,
        "implementation of the signs, uniforms and Hadamard transform (same bits)",
        choices=CpuBackend,
    )

    def __post_init__(self) -> None:
        check_options(self, "thc")
        h = self.hadamard_block
        if h & (h - 1):
            raise ValueError(f"thc: hadamard_block must be a power of two, got {h}")

    @property
    def levels(self) -> int:
        return (1 << (self.q - 1)) - 1

    def lane_need(self, n: int) -> int:
        """Bits a lane needs so that a sum of n ranks' integers never saturates:
        sums lie in [-n L, n L], 2 n L + 1 values."""
        return math.ceil(math.log2(2 * n * self.levels + 1))

    def lanes_for(self, n: int) -> int:
        if self.lane_bits is not None:
            return self.lane_bits
        need = self.lane_need(n)
        paper = 8 if n <= 8 else 12
        for b in LANES:
            if b >= max(need, paper):
                return b
        raise ValueError(
            f"thc: {n} ranks of {self.q}-bit integers need {need}-bit lanes; at most "
            f"{LANES[-1]} are exact in float32 accumulation (lower q)"
        )


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalised fast Walsh-Hadamard transform along the last dimension (a power
    of two): its own inverse. log2(H) vectorised butterfly passes."""
    H = x.shape[-1]
    y = x.reshape(-1, H)
    h = 1
    while h < H:
        y = y.view(-1, H // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / math.sqrt(H))).to(x.dtype)


@dataclass
class THCPlan(Plan):
    block: int
    step: float  # M / L
    lane_bits: int
    seed: int
    round: int
    rank: int
    world_size: int
    #: This rank's rotated vector: rank-local (not agreed), consumed by prepare().
    rotated: torch.Tensor
    #: Whether finish() works in float64 (sums near float32's limit).
    wide: bool
    #: The caller's schedule-chunk bounds when the engine asked for them: each
    #: chunk is then rotated on its own (padded to whole Hadamard blocks); None:
    #: one rotation of the whole vector.
    bounds: tuple[int, ...] | None = None
    #: With bounds: where each chunk starts in the working vector.
    starts: tuple[int, ...] = ()


@register(
    "thc",
    "THC: randomized Hadamard transform, global scale, 4-bit stochastic integers summed homomorphically",
)
class THC(Codec[THCPlan]):
    config_class = THCConfig
    config: THCConfig
    layout_preserving: ClassVar[bool] = False
    #: With chunk bounds (a reduce-scatter over rank shards) every chunk is
    #: rotated on its own, so a chunk's final sums decode without the others;
    #: the scale stays global.
    chunk_local: ClassVar[bool] = True
    #: Its only statistic, the global maximum: one float64.
    first_stats_nbytes: ClassVar[int | None] = 8

    def __init__(self, config: THCConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        #: Saturated lanes this rank produced in the last round.
        self.overflows = 0

    def nonfinite_block(self) -> int:
        return 1 << 62  # the global scale carries the poison everywhere

    # -- kernels -------------------------------------------------------------
    def kernels(self, device: torch.device) -> Any:
        """The kernel module on ``device`` (:mod:`hopq.codecs.thc.kernels_cpu`), or None
        for the reference (the same bits)."""
        return _resolve(self.config.backend.value, device.type)

    def _fwht(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernels(x.device)
        return fwht(x) if k is None else k.fwht(x)

    def _signs(self, n: int, seed: int, round: int, device: torch.device) -> torch.Tensor:
        key = stream_key(seed, round, SIGN_STREAM, 0)
        k = self.kernels(device)
        if k is not None:
            return k.signs(n, key)
        idx = torch.arange(n, dtype=torch.int64, device=device)
        bit = hash32(idx, key) & 1
        return 1.0 - 2.0 * bit.to(torch.float32)

    def _rotate(self, x: torch.Tensor, H: int, seed: int, round: int, numel: int) -> torch.Tensor:
        """Signs, then interleave (block j = coordinates j, j + m, ...), then FWHT per block.
        In x's dtype: float64 for inputs whose rotation would overflow float32."""
        if x.dtype == torch.float32:
            padded = pad_to_blocks(x, H).reshape(-1) if numel else x.new_zeros(0)
        else:  # pad_to_blocks would round to float32 and overflow the transform
            padded = x.new_zeros(numel)
            padded[: x.numel()] = x
        signed = padded * self._signs(numel, seed, round, x.device)
        return self._fwht(signed.view(H, -1).t().contiguous()).reshape(-1)

    def _rotate_chunks(
        self,
        x: torch.Tensor,
        H: int,
        seed: int,
        round: int,
        bounds: tuple[int, ...],
        starts: tuple[int, ...],
    ) -> torch.Tensor:
        """:meth:`_rotate` of every chunk on its own: chunk c (padded to whole
        blocks) is interleaved and transformed within itself; the signs follow
        the working-vector positions."""
        signed = to_segments(x, bounds, max(H, 2), x.dtype)
        signed *= self._signs(signed.numel(), seed, round, x.device)
        out = torch.empty_like(signed)
        for s, e in zip(starts, starts[1:], strict=False):
            if e > s:
                out[s:e] = self._fwht(signed[s:e].view(H, -1).t().contiguous()).reshape(-1)
        return out

    def _unrotate_chunks(self, plan: THCPlan, vals: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_rotate_chunks`, in the caller's layout."""
        H = plan.block
        out = torch.empty_like(vals)
        for s, e in zip(plan.starts, plan.starts[1:], strict=False):
            if e > s:
                out[s:e] = self._fwht(vals[s:e].view(-1, H)).t().reshape(-1)
        out *= self._signs(out.numel(), plan.seed, plan.round, vals.device)
        assert plan.bounds is not None
        return from_segments(out, plan.bounds, max(H, 2))

    def plan(self, x: torch.Tensor, stats: StatsExchange) -> THCPlan:
        cfg = self.config
        d = x.numel()
        bounds = check_bounds(stats, d)
        # with chunk bounds, each chunk is rotated on its own: H from the longest
        span = d if bounds is None else max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        # the largest power of two <= d / 16, capped: padding stays under ~6% of d
        H = min(cfg.hadamard_block, 1 << max(0, (max(span, 1) // 16).bit_length() - 1))
        # chunks of whole blocks and even sizes (12-bit lanes pack in pairs)
        starts = () if bounds is None else segment_starts(bounds, max(H, 2))
        work = n_blocks(d, H) * H if bounds is None else starts[-1]
        lanes = cfg.lanes_for(stats.world_size)
        flat = x.reshape(-1).to(torch.float32)
        # Rotated coordinates reach sqrt(H) times the largest entry: near float32's
        # limit this rank rotates in float64 (its own choice: only its integers
        # leave it), so finite input never overflows.
        if d:  # max |x| without a temporary (NaN propagates)
            lo, hi = torch.aminmax(flat)
            big = float(torch.maximum(-lo, hi))
        else:
            big = 0.0
        if math.isfinite(big) and big * math.sqrt(H) >= WIDE:
            flat = flat.double()
        k = self.kernels(x.device)
        top = None
        if bounds is None and k is not None and flat.dtype == torch.float32 and work:
            key = stream_key(stats.seed, stats.round, SIGN_STREAM, 0)
            rot, top = k.rotate(flat, H, work, key)  # fused: the same bits
        elif bounds is None:
            rot = self._rotate(flat, H, stats.seed, stats.round, work)
        else:
            rot = self._rotate_chunks(flat, H, stats.seed, stats.round, bounds, starts)
        if top is not None:
            local_max = torch.tensor([top], dtype=torch.float64, device=x.device)
        elif work:
            local_max = rot.abs().amax().double().reshape(1)
        else:
            local_max = torch.zeros(1, dtype=torch.float64, device=x.device)
        M = float(stats.all_reduce(local_max, StatsOp.MAX).item())
        # 12-bit lanes pack in pairs
        chunks = (
            nested_chunks(work, stats.n_chunks, stats.microshards, align=2)
            if bounds is None
            else split_parts(starts, stats.microshards, align=2)
        )
        self.overflows = 0
        return THCPlan(
            numel=d,
            work_numel=work,
            chunks=chunks,
            payload_nbytes=tuple((e - s) * lanes // 8 for s, e in chunks),
            block=H,
            # NaN/Inf must survive to finish(): only an all-zero vector gets step 1
            step=M / cfg.levels if M != 0 else 1.0,
            lane_bits=lanes,
            seed=stats.seed,
            round=stats.round,
            rank=stats.rank,
            world_size=stats.world_size,
            rotated=rot,
            # the inverse transform of the sums in float64 too (agreed: from M)
            wide=math.isfinite(M) and M * stats.world_size * math.sqrt(H) >= WIDE,
            bounds=bounds,
            starts=starts,
        )

    def prepare(self, plan: THCPlan, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        """This rank's integers, as float32: stochastic rounding of rotated / step."""
        rot = plan.rotated
        if not math.isfinite(plan.step):  # non-finite input: finish() multiplies by it
            return torch.zeros_like(rot)
        key = stream_key(plan.seed, plan.round, ROUND_STREAM, plan.rank)
        k = self.kernels(rot.device)
        if k is not None and rot.dtype == torch.float32:
            return k.quantize(rot, plan.step, key, self.config.levels)
        v = div(rot, plan.step)
        u = uniform(v.numel(), key, device=v.device) if k is None else k.uniform(v.numel(), key)
        lo = torch.floor(v)
        q = (lo + (u < v - lo).to(v.dtype)).to(torch.float32)
        L = self.config.levels
        return q.clamp_(-L, L)

    # -- integer lanes -----------------------------------------------------
    def _pack(self, plan: THCPlan, ints: torch.Tensor) -> torch.Tensor:
        b = plan.lane_bits
        top = (1 << (b - 1)) - 1
        k = self.kernels(ints.device)
        if b == 8 and k is not None and ints.dtype == torch.float32:
            out, n_sat = k.pack8(ints, top)  # one pass, the same bytes
        else:
            sat = ints.abs() > top
            n_sat = int(sat.sum()) if bool(sat.any()) else 0
            i = ints.clamp(-top, top).to(torch.int64)
            # two's complement in b-bit lanes
            out = i.to(torch.int8).view(torch.uint8) if b == 8 else pack_bits(i & ((1 << b) - 1), b)
        if n_sat:
            self.overflows += n_sat
            warnings.warn(
                f"thc: {n_sat} partial sums exceed {b}-bit lanes and saturate; "
                f"leave lane_bits unset (this world needs {self.config.lane_need(plan.world_size)})",
                RuntimeWarning,
                stacklevel=3,
            )
        return out

    def _unpack(self, plan: THCPlan, payload: torch.Tensor, n: int) -> torch.Tensor:
        b = plan.lane_bits
        if b == 8:
            return payload.view(torch.int8).to(torch.float32)
        return sign_extend(unpack_bits(payload, b, n), b).to(torch.float32)

    def encode(self, plan: THCPlan, chunk: torch.Tensor, ctx: HopContext) -> torch.Tensor:
        return self._pack(plan, chunk)

    def decode(
        self, plan: THCPlan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor
    ) -> None:
        check_payload(payload, plan.payload_nbytes[ctx.chunk], f"thc chunk {ctx.chunk} payload")
        out.copy_(self._unpack(plan, payload, out.numel()))

    def decode_accumulate(
        self, plan: THCPlan, payload: torch.Tensor, acc: torch.Tensor, ctx: HopContext
    ) -> None:
        check_payload(payload, plan.payload_nbytes[ctx.chunk], f"thc chunk {ctx.chunk} payload")
        acc.add_(self._unpack(plan, payload, acc.numel()))  # integers: exact in float32

    def finish(self, plan: THCPlan, y: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
        if not plan.work_numel:
            return y
        H = plan.block
        k = self.kernels(y.device)
        if k is not None and not plan.wide and plan.bounds is None and y.dtype == torch.float32:
            key = stream_key(plan.seed, plan.round, SIGN_STREAM, 0)
            out = k.unrotate(y, plan.step, H, key, plan.numel)  # fused: the same bits
            return div_(out, world_size) if op is ReduceOp.AVG else out
        vals = y.double() * plan.step if plan.wide else y * plan.step
        if plan.bounds is not None:
            out = self._unrotate_chunks(plan, vals)
        else:
            rot = self._fwht(vals.view(-1, H))  # the transform is its own inverse
            rot = rot.t().reshape(-1)  # undo the interleave
            out = (rot * self._signs(plan.work_numel, plan.seed, plan.round, y.device))[
                : plan.numel
            ]
        if op is ReduceOp.AVG:
            out = div_(out, world_size)
        if plan.wide:  # an estimate beyond float32's range saturates (finite in, finite out)
            out = keep_finite(out.to(torch.float32), out, _FLOAT_MAX)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "overflows": self.overflows}

    def agreed_state(self) -> Any:
        return {"round": self.round}  # overflows are what this rank saw

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.overflows = int(state.get("overflows", 0))


@lru_cache(maxsize=8)
def _resolve(choice: str, device_type: str) -> Any:
    return resolve("thc", choice, device_type)
