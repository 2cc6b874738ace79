"""DynamiQ's PyTorch reference: the specification the kernels reproduce bit for bit.

Quantization (section 3.3): sign bit plus a level index on the non-uniform grid
f(eps, r); groups of s entries are normalised by their maximum; the super-group
maximum travels as bfloat16 (rounded up), each group's maximum as a uint8
fraction of it, stochastically rounded, so every entry stays unbiased.

Random streams (:mod:`hopq.numerics.rng`, key hop field = tag << 16 | position):
tag 0 gamma for entries (index: position in the working vector), tag 1 the
permutation for correlated rounding, shared by the correlated encoders (position
field: 0 for ``path``, depth + 1 for ``correlated``), tag 2 group-scale rounding
(index: group number).
"""

from __future__ import annotations

import math

import torch

from hopq.codecs.base import HopContext, check_payload
from hopq.codecs.dynamiq.config import DynamiQConfig, Rounding, Scales
from hopq.codecs.dynamiq.layout import DynamiQPlan
from hopq.codecs.dynamiq.segment import SegmentCall, Streams
from hopq.errors import PayloadError
from hopq.kernels import Mode
from hopq.numerics.bitpack import pack_bits, unpack_bits
from hopq.numerics.blocks import pad_to_blocks
from hopq.numerics.div import div
from hopq.numerics.fp_formats import round_up_bf16
from hopq.numerics.levels import level_table, stochastic_level
from hopq.numerics.reduce import tree_sum
from hopq.numerics.rng import hash32, stream_key, uniform

#: Stream tags (see the module docstring).
TAG_GAMMA, TAG_PERM, TAG_SCALE = 0, 1, 2


def _units(n: int) -> tuple[int, ...]:
    return tuple(a for a in range(1, n) if math.gcd(a, n) == 1) or (1,)


def streams(cfg: DynamiQConfig, ctx: HopContext) -> Streams:
    """The random streams of one encoding: keys and the correlated-rounding
    class (peers = 1: independent rounding)."""
    if cfg.rounding is Rounding.PATH:
        n, me, cls = ctx.world_size, ctx.hop, 0
    else:
        n, me, cls = ctx.peers, ctx.peer, ctx.depth + 1
    if cfg.rounding is Rounding.INDEPENDENT:
        n, me = 1, 0
    c = ctx.stream_chunk
    return Streams(
        gamma_key=stream_key(ctx.seed, ctx.round, c, TAG_GAMMA << 16 | ctx.hop),
        perm_key=stream_key(ctx.seed, ctx.round, c, TAG_PERM << 16 | cls),
        peers=n,
        peer=me,
        units=_units(n),
        scale_key=stream_key(ctx.seed, ctx.round, c, TAG_SCALE << 16 | ctx.hop),
    )


def uniforms(st: Streams, start: int, count: int, device: torch.device) -> torch.Tensor:
    """u for the entries [start, start + count) of the working vector: gamma, or
    with correlated rounding u_i = (pi_i + gamma_i) / n."""
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
    return div(pi.to(torch.float32) + gamma, float(n))


def supergroup_stats(x: torch.Tensor, S: int) -> torch.Tensor:
    """[2, m] float32: per super-group mean (over its real entries) and sum of
    squares, summed in :func:`hopq.numerics.reduce.tree_sum`'s order."""
    d = x.numel()
    xs = pad_to_blocks(x, S)
    m = xs.shape[0]
    counts = torch.full((m,), float(S), device=xs.device)
    if m and d % S:
        counts[-1] = d % S
    mean = tree_sum(xs) / counts
    sq = tree_sum(xs.square())
    # F must stay > 0 whenever an entry is non-zero (the zero class is lossless):
    # squares of tiny entries underflow, so floor F at the smallest normal.
    nonzero = xs.ne(0).any(1)
    sq = torch.where(nonzero & (sq == 0), torch.finfo(torch.float32).smallest_normal, sq)
    return finite_means(x, S, torch.stack([mean, sq]))


def finite_means(x: torch.Tensor, S: int, stats: torch.Tensor) -> torch.Tensor:
    """``stats`` (the tree-order statistics of ``x``; the kernels' too) with the
    means that overflowed although every entry of their super-group is finite
    recomputed: the float32 tree sum of S entries near 1e38 can exceed float32's
    range while their mean does not. Those rows sum x / S instead (exact for a
    power-of-two S), divide by the count and scale back; every other row keeps
    its bits. In place; returns ``stats``."""
    mean = stats[0]
    bad = ~torch.isfinite(mean)
    if not bool(bad.any()):
        return stats
    xs = pad_to_blocks(x, S)
    rows = torch.nonzero(bad & torch.isfinite(xs).all(1)).flatten()
    if rows.numel():
        d = x.numel()
        counts = torch.full((rows.numel(),), float(S), device=xs.device)
        counts[rows == xs.shape[0] - 1] = float(d - (xs.shape[0] - 1) * S)
        mean[rows] = tree_sum(xs[rows] * (1.0 / S)) / counts * S
    return stats


def _bf16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def encode_rows(
    cfg: DynamiQConfig, rows: torch.Tensor, w: int, first_row: int, st: Streams
) -> list[torch.Tensor]:
    """The payload parts of ``rows`` (super-groups ``first_row`` on) at width ``w``."""
    S, s = cfg.supergroup_size, cfg.group_size
    k = rows.shape[0]
    dev = rows.device
    u = uniforms(st, first_row * S, k * S, dev).view(k, S)
    if w == 16:
        bits = rows.contiguous().view(torch.int32).to(torch.int64)
        r16 = (u * 65536.0).to(torch.int64)  # the 16 random bits below bf16's mantissa
        # sign-magnitude: rounds |x| up with probability (its low 16 bits) / 2^16
        up = (bits + r16) >> 16
        # a finite entry within a bf16 ulp of float32's limit would round up to Inf:
        # it saturates at the largest bfloat16 instead (finite in, finite out)
        up = torch.where(((up & 0x7FFF) == 0x7F80) & ((bits & 0x7FFFFFFF) < 0x7F800000), up - 1, up)
        up = up.to(torch.int16)
        return [_bf16_bytes(up.view(torch.bfloat16))]
    G = rows.view(k, S // s, s)
    gmax = G.abs().amax(-1)
    parts = []
    if cfg.scales is Scales.HIERARCHICAL:
        M_bf = round_up_bf16(gmax.amax(-1), saturate=True)
        Mf = M_bf.float()[:, None]
        g = torch.nan_to_num(
            torch.where(Mf > 0, gmax / Mf * 255.0, 0.0), nan=0.0, posinf=0.0, neginf=0.0
        )
        us = uniform(k * (S // s), st.scale_key, offset=first_row * (S // s), device=dev)
        fl = torch.floor(g)
        rG = (fl + (us.view(k, S // s) < g - fl).to(torch.float32)).clamp_(0, 255).to(torch.uint8)
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


#: Super-group scales from here up multiply the group fraction by M / 255 rather
#: than dividing rG * M by 255, which would overflow float32 (255 * 2^120 > 2^127).
BIG_SCALE = 2.0**120


def group_scales(rG: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """A group's scale from its uint8 fraction rG of the super-group scale M:
    rG * M / 255, computed so that it never overflows (the kernels do the same)."""
    return torch.where(M < BIG_SCALE, div(rG * M, 255.0), rG * div(M, 255.0))


def decode_rows(cfg: DynamiQConfig, seg_bytes: torch.Tensor, w: int, k: int) -> torch.Tensor:
    """The [k, S] float32 values a segment's bytes encode."""
    S, s = cfg.supergroup_size, cfg.group_size
    if w == 0:
        return torch.zeros(k, S, device=seg_bytes.device)
    if w == 16:
        return seg_bytes.clone().view(torch.bfloat16).float().view(k, S)
    ng = S // s
    if cfg.scales is Scales.HIERARCHICAL:
        M = seg_bytes[: 2 * k].clone().view(torch.bfloat16).float()
        rG = seg_bytes[2 * k : 2 * k + k * ng].float().view(k, ng)
        sf = group_scales(rG, M[:, None])
        codes_at = 2 * k + k * ng
    else:
        sf = seg_bytes[: 2 * k * ng].clone().view(torch.bfloat16).float().view(k, ng)
        codes_at = 2 * k * ng
    code = unpack_bits(seg_bytes[codes_at:], w, k * S).to(torch.int64)
    top = 1 << (w - 1)
    table = level_table(w, cfg.eps_for(w), seg_bytes.device)
    mag = table[code & (top - 1)].view(k, ng, s) * sf[..., None]
    return torch.where((code >= top).view(k, ng, s), -mag, mag).view(k, S)


def run_segment(cfg: DynamiQConfig, call: SegmentCall) -> None:
    """One :class:`~hopq.codecs.dynamiq.segment.SegmentCall` as the reference runs
    it: what a kernel module's ``run_segment`` reproduces bit for bit. ``cfg``
    gives the scales (the kernels take hierarchical ones); the call's sizes and
    level parameter must be its. The fused hop leaves ``local`` as it is, as the
    kernels do."""
    k, S, w = call.rows, call.S, call.width
    if (S, call.s, call.eps) != (cfg.supergroup_size, cfg.group_size, cfg.eps_for(w)):
        raise ValueError("dynamiq: the segment call's sizes or level table are not the config's")

    def given(t: torch.Tensor | None, name: str) -> torch.Tensor:
        if t is None:
            raise ValueError(f"dynamiq: mode {call.mode.name} needs {name}")
        return t

    if call.mode == Mode.ENCODE:
        rows = given(call.local, "local").view(k, S)
    else:
        rows = decode_rows(cfg, given(call.payload, "payload"), w, k)
        if call.mode != Mode.DECODE:
            rows = given(call.local, "local").view(k, S) + rows  # the engine's acc += decode
        if call.mode != Mode.DAR:
            given(call.out_rows, "out_rows").view(k, S).copy_(rows)
            return
    parts = encode_rows(cfg, rows, w, call.row0, call.streams)
    given(call.out_payload, "out_payload").copy_(torch.cat(parts))


def encode_chunk(
    cfg: DynamiQConfig, plan: DynamiQPlan, chunk: torch.Tensor, ctx: HopContext
) -> torch.Tensor:
    """A chunk's payload: its segments' parts, in order."""
    segs, lo = plan.chunk_segments(ctx.chunk)
    rows = chunk.view(-1, cfg.supergroup_size)
    st = streams(cfg, ctx)
    parts: list[torch.Tensor] = []
    for sg in segs:
        if sg.width == 0:
            continue
        parts += encode_rows(cfg, rows[sg.lo - lo : sg.hi - lo], sg.width, sg.lo, st)
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=chunk.device)
    out = torch.cat(parts)
    if out.numel() != plan.payload_nbytes[ctx.chunk]:
        raise AssertionError("dynamiq: encoded size differs from the plan")
    return out


def decode_chunk(
    cfg: DynamiQConfig, plan: DynamiQPlan, payload: torch.Tensor, ctx: HopContext, out: torch.Tensor
) -> None:
    """``out`` (the chunk's rows) = decode(payload)."""
    segs, lo = plan.chunk_segments(ctx.chunk)
    check_payload(payload, plan.payload_nbytes[ctx.chunk], f"dynamiq chunk {ctx.chunk} payload")
    rows = out.view(-1, cfg.supergroup_size)
    for sg in segs:
        data = payload[sg.offset : sg.offset + sg.nbytes]
        if data.numel() != sg.nbytes:
            raise PayloadError("dynamiq: truncated segment")
        rows[sg.lo - lo : sg.hi - lo] = decode_rows(cfg, data, sg.width, sg.hi - sg.lo)
